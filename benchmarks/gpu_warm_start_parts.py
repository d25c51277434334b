"""Where an inductor engine's warm start goes, part by part, with and without precompiled graphs.

    python -m benchmarks.gpu_warm_start_parts [--layers 16] [--out parts.json] [--compile-mode ...]

Builds the Llama-3.2-1B-shaped bf16 engine of benchmarks/gpu_pipeline.py's decoder section (random
weights, no training: speed does not depend on the values), then loads it in fresh processes, each
with empty Inductor and Triton caches, as gpu_pipeline's warm start does (a first process
compiles the bytecode of what it imports and is reported apart), in these modes:
- `torch_compile`: the load before precompiled graphs (inductor.PRECOMPILE off, smelter's Triton
  kernels not installed from the engine): load_cache_artifacts, torch.export.load, Dynamo retrace;
- `precompiled`: the engine's precompiled graphs and shipped kernels;
- `precompiled_no_kernels`: the precompiled graphs, smelter's Triton kernels compiled again.
Each child times its parts by wrapping the functions that do them (seconds summed over calls),
then the first prefill and each decode step of batch 1 and 64 (the first three steps: run, CUDA-
graph recording, replay), then latencies after warm-up, and writes its logits so the parent can
compare the modes. Prints one JSON line per child and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter() - T0

PREFILL = (8, 512)
PAST = 512
DECODE = [(1, PAST + 16), (64, PAST + 16)]


class Timers:
    """Seconds spent in wrapped functions (outermost calls only, CUDA synchronised)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if timers._depth:
                return original(*args, **kwargs)
            timers._depth += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timers.seconds[label] = timers.seconds.get(label, 0.0) + time.perf_counter() - started
                timers.calls[label] = timers.calls.get(label, 0) + 1
                timers._depth -= 1

        setattr(owner, name, timed)


def sync() -> None:
    torch.cuda.synchronize()


def child(args: argparse.Namespace) -> None:
    t = time.perf_counter()
    from tasks.backends.inductor import backend as inductor, graph_weights, kernel_bundle, precompiled
    from tasks.backends.inductor.backend import InductorBackend
    from tasks.config.spec import InductorTarget
    imports = time.perf_counter() - t
    timers = Timers()
    timers.wrap(torch.compiler, "load_cache_artifacts", "load_cache_artifacts")
    timers.wrap(inductor, "load_program", "torch_export_load")
    timers.wrap(graph_weights.WeightsFile, "graph", "weights_to_gpu")
    timers.wrap(precompiled, "load_function", "load_precompiled")
    timers.wrap(kernel_bundle, "install", "install_triton_kernels")
    if args.mode == "torch_compile":
        inductor.PRECOMPILE = False
    if args.mode in ("torch_compile", "precompiled_no_kernels"):
        kernel_bundle.install = lambda path: 0
    target = InductorTarget(**json.loads(args.target))
    out: dict[str, Any] = {"mode": args.mode, "import_torch_s": round(T_TORCH, 3), "import_smelter_s": round(imports, 3)}
    started = time.perf_counter()
    runner = InductorBackend().load(Path(args.engine), target)
    sync()
    out["load_s"] = round(time.perf_counter() - started, 3)
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = runner.sidecar["decoder_config"]["vocab_size"]
    ids = torch.randint(0, vocab, PREFILL, device="cuda", generator=g)
    mask = torch.ones_like(ids)
    t = time.perf_counter()
    logits = runner.prefill(ids, mask)
    sync()
    out["first_prefill_s"] = round(time.perf_counter() - t, 3)
    out["load_and_first_prefill_s"] = round(time.perf_counter() - started, 3)
    saved = {"prefill": logits.float().cpu()}
    sessions = {}
    for batch, max_len in DECODE:
        t = time.perf_counter()
        session = runner.decoder(batch, max_len)
        sync()
        steps = [round(time.perf_counter() - t, 3)]
        tokens = torch.randint(0, vocab, (batch, 1), device="cuda", generator=g)
        outs = []
        for pos in range(3):
            t = time.perf_counter()
            outs.append(session.step(tokens, pos).float().cpu())
            sync()
            steps.append(round(time.perf_counter() - t, 3))
        out[f"decode_b{batch}_open_and_steps_s"] = steps
        saved[f"decode_b{batch}"] = torch.stack(outs)
        sessions[batch] = (session, tokens)
    out["load_and_first_inference_all_graphs_s"] = round(time.perf_counter() - started, 3)
    out["parts_s"] = {k: round(v, 3) for k, v in sorted(timers.seconds.items())}
    out["parts_calls"] = timers.calls
    try:
        from torch._dynamo.utils import compile_times

        out["dynamo_compile_times"] = str(compile_times(repr="str"))[:3000]
    except Exception as e:  # noqa: BLE001 - best effort, differs between torch releases
        out["dynamo_compile_times"] = f"{type(e).__name__}: {e}"
    out["precompile_problems"] = runner.precompile_problems
    out["precompiled_used"] = {"prefill": runner._prefill is None,
                               "decode": sorted(str(p.name) for p in runner._pre_decode_used)}
    from tasks.measure import gpu_measure as gm

    out["prefill_ms"] = gm.summary(gm.cuda_times_ms(lambda: runner.prefill(ids, mask), 3, 30))
    for batch, (session, tokens) in sessions.items():
        out[f"decode_b{batch}_ms"] = gm.summary(gm.cuda_times_ms(lambda: session.step(tokens, PAST), 5, 30))
    out["prefill_still_precompiled"] = runner._prefill is None
    torch.save(saved, Path(args.work) / f"logits-{args.mode}.pt")
    print(json.dumps(out), flush=True)


def build(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu_pipeline import LLAMA_32_1B
    from tasks.backends.inductor.backend import InductorBackend
    from tasks.runtime.gpu import detect_gpu
    from tasks.config.spec import InductorTarget, ProfileSpec

    config = {**LLAMA_32_1B, "num_hidden_layers": args.layers}
    cfg = LlamaConfig(**config)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model_dir = work / "llama"
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.compile_mode}
    batch, seq = PREFILL
    profiles = [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq]),
                ProfileSpec(batch=[DECODE[0][0], DECODE[0][0], DECODE[-1][0]], seq=[1, 1, DECODE[0][1] - PAST],
                            past=[0, PAST, PAST])]
    engine = work / "engine"
    engine.mkdir()
    started = time.perf_counter()
    facts = InductorBackend().build_from_model(model_dir, "text-generation", "bf16", InductorTarget(**target),
                                               profiles, engine)
    facts["cold_build_s"] = round(time.perf_counter() - started, 3)
    sidecar = json.loads((engine / "engine.json").read_text())
    facts["precompiled"] = sidecar.get("precompiled")
    facts["triton_kernels"] = sidecar.get("triton_kernels")
    return engine, target, facts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    p.add_argument("--modes", default="torch_compile,precompiled,precompiled_no_kernels")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode")
    p.add_argument("--engine")
    p.add_argument("--target")
    p.add_argument("--work")
    args = p.parse_args()
    if args.child:
        return child(args)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    work = Path(tempfile.mkdtemp(prefix="warm-parts-"))
    engine, target, facts = build(args, work)
    print("BUILD " + json.dumps(facts, default=str), flush=True)
    bytecode = tempfile.mkdtemp(prefix="pycache-warm-")
    results: dict[str, Any] = {}
    modes = args.modes.split(",")
    # the first process compiles the bytecode of what it imports (into `bytecode`); it is reported apart
    for mode in [f"{modes[0]}:first_process", *modes]:
        runs = []
        for _ in range(1):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-warm-"),
                   "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-warm-"), "PYTHONPYCACHEPREFIX": bytecode}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_warm_start_parts", "--child",
                                   f"--mode={mode.split(':')[0]}",
                                   f"--engine={engine}", f"--target={json.dumps(target)}", f"--work={work}"],
                                  capture_output=True, text=True, env=env, timeout=300)
            lines = proc.stdout.strip().splitlines()
            r = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-3000:]}
            runs.append(r)
            print(json.dumps(r), flush=True)
        results[mode] = runs[0]
    compared = {}
    files = {m: work / f"logits-{m}.pt" for m in modes}
    if all(f.is_file() for f in files.values()) and len(files) >= 2:
        first, *others = (torch.load(f) for f in files.values())
        compared = {f"{modes[0]}_vs_{m}": {k: float((first[k] - o[k]).abs().max()) for k in first}
                    for m, o in zip(modes[1:], others)}
    summary = {"torch": torch.__version__, "layers": args.layers, "compile_mode": args.compile_mode, "build": facts,
               "modes": results, "max_abs_logit_difference_between_modes": compared}
    for mode, r in results.items():
        if "load_and_first_inference_all_graphs_s" in r:
            r["fraction_of_cold_build"] = round(r["load_and_first_inference_all_graphs_s"] / facts["cold_build_s"], 3)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    print("SUMMARY " + json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
