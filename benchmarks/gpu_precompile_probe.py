"""Probe: does Dynamo's AOT precompile (torch.compile(fullgraph=True).aot_compile + save_compiled_function,
then torch.compiler.load_compiled_function in a fresh process) skip retracing at a warm start, and how
long does that warm start take next to a mega-cache (save/load_cache_artifacts) warm start?

    python -m benchmarks.gpu_precompile_probe [--device cuda] [--layers 16] [--batch 8] [--seq 512]

Random-weight Llama-3.2-1B shape (bf16 on cuda); the model is passed as an argument of the compiled
function so its weights are inputs, not pickled constants. Each warm start runs in a fresh process
with empty Inductor/Triton caches. Prints one JSON line per stage and a summary."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def model_for(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                      vocab_size=args.vocab, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(args.device, dtype).eval()


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def no_guards(entries: list) -> list[bool]:
    """An engine's graph is built for fixed shapes on one arch; the load checks those itself, so keep no
    Dynamo guard (torch 2.11 cannot serialise ID_MATCH guards)."""
    return [False for _ in entries]


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def child(args: argparse.Namespace) -> None:
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True  # off by default in torch 2.11
    t0 = time.perf_counter()
    model = model_for(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    sync(args)
    t_model = time.perf_counter() - t0
    out: dict = {"stage": args.stage, "model_s": round(t_model, 3)}
    work = Path(args.work)
    with torch.no_grad():
        if args.stage == "build":
            started = time.perf_counter()
            eager = prefill(model, ids)
            compiled = torch.compile(prefill, fullgraph=True, options={"guard_filter_fn": no_guards}).aot_compile(((model, ids), {}))
            res = compiled(model, ids)
            sync(args)
            out["aot_compile_and_first_s"] = round(time.perf_counter() - started, 3)
            out["max_abs_vs_eager"] = float((res.float() - eager.float()).abs().max())
            compiled.save_compiled_function(str(work / "precompiled.bin"))
            out["precompiled_bytes"] = (work / "precompiled.bin").stat().st_size
            # the same graph through plain torch.compile + mega cache, as the engine does today
            torch._dynamo.reset()
            started = time.perf_counter()
            plain = torch.compile(prefill, fullgraph=True, dynamic=False)
            plain(model, ids)
            sync(args)
            out["plain_compile_and_first_s"] = round(time.perf_counter() - started, 3)
            art = torch.compiler.save_cache_artifacts()
            (work / "mega.bin").write_bytes(art[0] if art else b"")
            out["mega_bytes"] = (work / "mega.bin").stat().st_size
        elif args.stage == "load_precompiled":
            started = time.perf_counter()
            fn = load_precompiled(work / "precompiled.bin")
            out["load_s"] = round(time.perf_counter() - started, 3)
            res = fn(model, ids)
            sync(args)
            out["load_and_first_s"] = round(time.perf_counter() - started, 3)
            ref = prefill(model, ids)
            out["max_abs_vs_eager"] = float((res.float() - ref.float()).abs().max())
            out["timing_ms"] = time_ms(args, lambda: fn(model, ids))
        elif args.stage == "load_mega":
            started = time.perf_counter()
            torch.compiler.load_cache_artifacts((work / "mega.bin").read_bytes())
            out["load_s"] = round(time.perf_counter() - started, 3)
            fn = torch.compile(prefill, fullgraph=True, dynamic=False)
            fn(model, ids)
            sync(args)
            out["load_and_first_s"] = round(time.perf_counter() - started, 3)
            out["timing_ms"] = time_ms(args, lambda: fn(model, ids))
    print(json.dumps(out), flush=True)


def load_precompiled(path: Path):
    """torch 2.13 unpickles an ImportSource in the guards, whose __post_init__ installs a guard and so
    needs a TracingContext; give it a throwaway one (torch 2.11 may not need it)."""
    from torch._guards import TracingContext, tracing

    with open(path, "rb") as f:
        try:
            return torch.compiler.load_compiled_function(f)
        except RuntimeError as e:
            if "ongoing trace" not in str(e):
                raise
        f.seek(0)
        with tracing(TracingContext(None)):
            return torch.compiler.load_compiled_function(f)


def time_ms(args: argparse.Namespace, fn) -> float | None:
    if args.device != "cuda":
        return None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / 10, 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--stage")
    p.add_argument("--work")
    args = p.parse_args()
    if args.stage:
        return child(args)
    work = tempfile.mkdtemp(prefix="precompile-")
    common = [f"--device={args.device}", f"--layers={args.layers}", f"--hidden={args.hidden}",
              f"--vocab={args.vocab}", f"--batch={args.batch}", f"--seq={args.seq}", f"--work={work}"]
    results = []
    for stage in ("build", "load_precompiled", "load_mega", "load_precompiled", "load_mega"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind-"),
               "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="tri-")}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_precompile_probe", f"--stage={stage}", *common],
                              capture_output=True, text=True, env=env, timeout=540)
        wall = round(time.perf_counter() - started, 2)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
        r = json.loads(line) if line else {"stage": stage, "error": proc.stderr[-2500:]}
        r["process_wall_s"] = wall
        results.append(r)
        print(json.dumps(r), flush=True)
    print("SUMMARY " + json.dumps({"torch": torch.__version__, "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
