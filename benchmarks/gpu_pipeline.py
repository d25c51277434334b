"""Inductor engines on a real GPU, side by side with PyTorch eager measured in the same run.

Builds, checks and measures a Llama-3.2-1B-shaped decoder and a BERT-base-shaped encoder (random
weights made here from their configs: speed does not depend on the values) as `inductor` bf16
engines, with eager fp32 and bf16 references on the same GPU. Everything is timed alike: inputs
and outputs on the device, CUDA events around each call. The bf16 matrix-product ceiling and the
copy bandwidth are measured first, and each figure is also given as a fraction of its bound.

Usage: python -m benchmarks.gpu_pipeline --out benchmarks/results/h200.json [--sections decoder,encoder]
       [--append] [--quick]   (sections: decoder, decoder_fp8, encoder, decode_step)
(--quick: a 2-layer model, to check the script in a minute). Writes the JSON after each section,
so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tasks import gpu_measure as gm
from tasks.backends.inductor import InductorBackend, versions
from tasks.gpu import detect_gpu
from tasks.spec import InductorTarget, ProfileSpec

LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
                   rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"})
QUICK_LLAMA = {**LLAMA_32_1B, "num_hidden_layers": 2, "vocab_size": 32000}
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
QUICK_BERT = {**BERT_BASE, "num_hidden_layers": 2}


class Report:
    """The JSON result, rewritten after every section."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, data

    def add(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def timed(fn: Any, warmup: int, repeats: int) -> dict[str, Any]:
    """Median and spread of device-event latencies, plus peak device memory of one call."""
    stats = gm.summary(gm.cuda_times_ms(fn, warmup, repeats))
    stats["peak_memory_gib"] = round(gm.peak_memory_bytes(fn) / 2**30, 3)
    return stats


def make_model(kind: str, config: dict[str, Any], directory: Path) -> None:
    """Random weights from the config, saved in bf16 (the fp32 reference upcasts these same values)."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "decoder":
        cfg = LlamaConfig(**config)
        cfg.architectures = ["LlamaForCausalLM"]
        model = LlamaForCausalLM(cfg)
    else:
        model = BertModel(BertConfig(**config))
    model.to(torch.bfloat16).save_pretrained(directory)


def eager(kind: str, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    loader = AutoModelForCausalLM if kind == "decoder" else AutoModel
    return loader.from_pretrained(directory, dtype=dtype).cuda().eval()


def prompts(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), device="cuda", generator=g) for _ in range(count)]


def eager_decoder_figures(model: torch.nn.Module, batch: int, seq: int, past: int, decode_batches: list[int],
                          args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode-step latency of HF eager with its dynamic cache, cropped back after each step."""
    vocab = model.config.vocab_size
    ids = prompts(vocab, batch, seq, 1, 1)[0]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        figures = {"prefill": timed(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False,
                                                   logits_to_keep=1).logits, 3, args.repeats)}
        for b in decode_batches:
            context = prompts(vocab, b, past, 1, 2)[0]
            cache = model(input_ids=context, use_cache=True, logits_to_keep=1).past_key_values
            token = context[:, -1:]

            def step() -> torch.Tensor:
                out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                cache.crop(past)
                return out
            figures[f"decode_b{b}"] = timed(step, 3, args.repeats)
            del cache
    return figures


def top1_agreement(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> float:
    same = sum(int((r.argmax(-1) == c.argmax(-1)).sum()) for r, c in zip(reference, candidate))
    return round(same / sum(r.shape[0] for r in reference), 4)


def warm_start(engine: Path, target: dict[str, Any], batch: int, seq: int, decode: list[list[int]]) -> dict[str, Any]:
    """Load the saved engine in a fresh process with an empty Inductor cache; time load and first inference."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-warm-")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pipeline", "--warm-start", str(engine),
                          "--target", json.dumps(target), "--shape", json.dumps([batch, seq, decode])],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_warm_start(engine: Path, target_json: str, shape_json: str) -> None:
    started = time.perf_counter()
    target = InductorTarget(**json.loads(target_json))
    runner = InductorBackend().load(engine, target)
    loaded = time.perf_counter() - started
    batch, seq, decode = json.loads(shape_json)
    vocab = runner.sidecar.get("decoder_config", {}) or {}
    ids = torch.randint(0, vocab.get("vocab_size", 1000), (batch, seq), device="cuda")
    runner.prefill(ids, torch.ones_like(ids))
    torch.cuda.synchronize()
    first_prefill = time.perf_counter() - started
    for b, max_len in decode:
        session = runner.decoder(b, max_len)
        for pos in range(3):
            session.step(torch.zeros(b, 1, dtype=torch.long, device="cuda"), pos)
    torch.cuda.synchronize()
    print(json.dumps({"load_s": round(loaded, 3), "load_and_first_prefill_s": round(first_prefill, 3),
                      "load_and_first_inference_all_graphs_s": round(time.perf_counter() - started, 3),
                      "load_seconds_in_runner": round(runner.load_seconds, 3)}))


def decoder_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    from tasks.backends.llama_graphs import StaticDecoder  # noqa: F401  (import errors surface here, early)

    config = QUICK_LLAMA if args.quick else LLAMA_32_1B
    batch, seq, past = 8, 512, 512
    decode_batches = [1, 64]
    max_len = past + 16
    model_dir = work / "llama"
    make_model("decoder", config, model_dir)
    from transformers import LlamaConfig

    shape = gm.DecoderShape.from_config(LlamaConfig(**config))
    section: dict[str, Any] = {"config": config, "prefill_shape": [batch, seq], "past": past,
                               "decode_batches": decode_batches, "cache_len": max_len}
    flops = shape.prefill_flops(batch, seq)
    section["bounds"] = {
        "prefill_tflop": round(flops / 1e12, 3),
        "prefill_bf16_ms": round(gm.bound_ms(flops, ceilings["gemm_bf16"]["tflops"]), 3),
        **{f"decode_b{b}_bf16_ms": round(gm.bytes_bound_ms(shape.decode_bytes(b, past, 2),
                                                           ceilings["copy"]["tb_per_s"]), 4)
           for b in decode_batches},
        "decode_bytes_note": "weights (LM head included) + KV cache at past, each read once, at the copy's "
                             "device-memory throughput (bytes read + written per second)"}
    # Eager references, same GPU, same run.
    checks = prompts(config["vocab_size"], batch, seq, args.check_batches, 7)
    refs: dict[str, Any] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for name, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
        model = eager("decoder", model_dir, dtype)
        with torch.no_grad():
            logits[name] = [model(input_ids=c, attention_mask=torch.ones_like(c), use_cache=False,
                                  logits_to_keep=1).logits[:, -1].float() for c in checks]
            if name == "eager_fp32":
                steps = prompts(config["vocab_size"], decode_batches[-1], 16, 1, 11)[0]
                decode_ref = model(input_ids=steps, use_cache=False).logits.float()
        refs[name] = eager_decoder_figures(model, batch, seq, past, decode_batches, args)
        del model
        torch.cuda.empty_cache()
    refs["eager_bf16"]["top1_vs_fp32"] = top1_agreement(logits["eager_fp32"], logits["eager_bf16"])
    section["eager"] = refs
    report.add("decoder", section)
    # The engine: cold build with an empty Inductor cache.
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.compile_mode}
    profiles = [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq]),
                ProfileSpec(batch=[decode_batches[0], decode_batches[0], decode_batches[-1]], seq=[1, 1, max_len - past],
                            past=[0, past, past])]
    engine_dir = work / "engine-llama"
    engine_dir.mkdir()
    backend = InductorBackend()
    started = time.perf_counter()
    facts = backend.build_from_model(model_dir, "text-generation", "bf16", InductorTarget(**target), profiles,
                                     engine_dir)
    facts["cold_build_s"] = round(time.perf_counter() - started, 3)
    section["engine_build"] = facts
    report.add("decoder", section)
    runner = backend.load(engine_dir, InductorTarget(**target))
    engine_logits = [runner.prefill(c, torch.ones_like(c)).float() for c in checks]
    engine: dict[str, Any] = {"top1_vs_fp32": top1_agreement(logits["eager_fp32"], engine_logits),
                              "positions_checked": len(checks) * batch}
    ids = checks[0]
    mask = torch.ones_like(ids)
    engine["prefill"] = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
    for b in decode_batches:
        session = runner.decoder(b, max_len)
        if b == decode_batches[-1]:
            outs = [session.step(steps[:, i:i + 1], i).float() for i in range(steps.shape[1])]
            engine["decode_top1_vs_fp32"] = top1_agreement(list(decode_ref.unbind(1)), outs)
            engine["decode_positions_checked"] = steps.numel()
        token = torch.randint(0, config["vocab_size"], (b, 1), device="cuda")
        engine[f"decode_b{b}"] = timed(lambda: session.step(token, past), 5, args.repeats)
        del session
    section["engine"] = engine
    section["summary"] = decoder_summary(section, batch, seq, decode_batches)
    report.add("decoder", section)
    section["warm_start"] = warm_start(engine_dir, target, batch, seq, [[b, max_len] for b in decode_batches])
    if "load_and_first_inference_all_graphs_s" in section["warm_start"]:
        section["warm_start"]["fraction_of_cold_build"] = round(
            section["warm_start"]["load_and_first_inference_all_graphs_s"] / facts["cold_build_s"], 3)
    report.add("decoder", section)


def decoder_fp8_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """The same decoder's prefill as an fp8 engine (e4m3 products, bf16 elsewhere), against the bf16 bound
    and the fp32 eager reference on the same prompts; its decode step is the bf16 one measured above."""
    config = QUICK_LLAMA if args.quick else LLAMA_32_1B
    batch, seq = 8, 512
    model_dir = work / "llama-fp8"
    make_model("decoder", config, model_dir)
    from transformers import LlamaConfig

    shape = gm.DecoderShape.from_config(LlamaConfig(**config))
    bound = gm.bound_ms(shape.prefill_flops(batch, seq), ceilings["gemm_bf16"]["tflops"])
    section: dict[str, Any] = {"prefill_shape": [batch, seq], "prefill_bf16_bound_ms": round(bound, 3)}
    checks = prompts(config["vocab_size"], batch, seq, args.check_batches, 7)
    model = eager("decoder", model_dir, torch.float32)
    with torch.no_grad():
        reference = [model(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1].float() for c in checks]
    del model
    torch.cuda.empty_cache()
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.compile_mode}
    engine_dir = work / "engine-llama-fp8"
    engine_dir.mkdir()
    backend = InductorBackend()
    started = time.perf_counter()
    facts = backend.build_from_model(model_dir, "text-generation", "fp8", InductorTarget(**target),
                                     [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq])], engine_dir)
    facts["cold_build_s"] = round(time.perf_counter() - started, 3)
    section["engine_build"] = facts
    runner = backend.load(engine_dir, InductorTarget(**target))
    with torch.no_grad():
        engine_logits = [runner.prefill(c, torch.ones_like(c)).float() for c in checks]
    section["top1_vs_fp32"] = top1_agreement(reference, engine_logits)
    section["positions_checked"] = len(checks) * batch
    ids = checks[0]
    section["prefill"] = timed(lambda: runner.prefill(ids, torch.ones_like(ids)), 3, args.repeats)
    ms = section["prefill"]["median_ms"]
    section["prefill_tokens_per_s"] = round(batch * seq / ms * 1e3)
    section["prefill_ms_over_bf16_bound"] = round(ms / bound, 3)
    report.add("decoder_fp8", section)


def decoder_summary(section: dict[str, Any], batch: int, seq: int, decode_batches: list[int]) -> dict[str, Any]:
    bounds, engine, eager_ = section["bounds"], section["engine"], section["eager"]
    out: dict[str, Any] = {}
    for who, figures in (("engine_bf16", engine), ("eager_bf16", eager_["eager_bf16"]),
                         ("eager_fp32", eager_["eager_fp32"])):
        ms = figures["prefill"]["median_ms"]
        row = {"prefill_ms": ms, "prefill_tokens_per_s": round(batch * seq / ms * 1e3),
               "prefill_fraction_of_bf16_gemm_bound": round(bounds["prefill_bf16_ms"] / ms, 3)}
        for b in decode_batches:
            step = figures[f"decode_b{b}"]["median_ms"]
            row[f"decode_b{b}_ms"] = step
            row[f"decode_b{b}_tokens_per_s"] = round(b / step * 1e3)
            row[f"decode_b{b}_times_bytes_bound"] = round(step / bounds[f"decode_b{b}_bf16_ms"], 2)
        out[who] = row
    return out


def decode_step_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """The decode-step graph alone (the engine's own export and session code, no prefill build, no
    save): for checking a change to the step in a minute and a half instead of a full build."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.backends.inductor import DecodeSession, _compile_options, export_decode

    config = QUICK_LLAMA if args.quick else LLAMA_32_1B
    past, max_len = 512, 528
    cfg = LlamaConfig(**config)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    shape = gm.DecoderShape.from_config(cfg)
    target = InductorTarget(name="sm90", backend="inductor", device="cuda", arch=detect_gpu().arch)
    step = export_decode(model, torch.bfloat16).module()
    section: dict[str, Any] = {"past": past, "cache_len": max_len}
    for b in (1, 64):
        started = time.perf_counter()
        session = DecodeSession(step, cfg, b, max_len, torch.bfloat16, "cuda")
        session.compile(_compile_options(target, decode=True))
        token = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
        for pos in range(3):
            session.step(token, pos)
        compile_s = time.perf_counter() - started
        figures = timed(lambda: session.step(token, past), 5, args.repeats)
        bound = gm.bytes_bound_ms(shape.decode_bytes(b, past, 2), ceilings["copy"]["tb_per_s"])
        section[f"decode_b{b}"] = {**figures, "compile_s": round(compile_s, 1), "bytes_bound_ms": round(bound, 4),
                                   "times_bytes_bound": round(figures["median_ms"] / bound, 2),
                                   "tokens_per_s": round(b / figures["median_ms"] * 1e3)}
        del session
    report.add("decode_step", section)
    print(f"decode step alone: {json.dumps(section)}")


def encoder_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    from transformers import BertConfig

    config = QUICK_BERT if args.quick else BERT_BASE
    batch, seq = 8, 512
    model_dir = work / "bert"
    make_model("encoder", config, model_dir)
    flops = gm.encoder_flops(BertConfig(**config), batch, seq)
    section: dict[str, Any] = {"config": config, "shape": [batch, seq],
                               "bounds": {"tflop": round(flops / 1e12, 3),
                                          "bf16_ms": round(gm.bound_ms(flops, ceilings["gemm_bf16"]["tflops"]), 4)}}
    ids = prompts(config["vocab_size"], batch, seq, 1, 3)[0]
    mask = torch.ones_like(ids)
    outs = {}
    for name, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
        model = eager("encoder", model_dir, dtype)
        with torch.no_grad():
            outs[name] = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            section[name] = timed(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state, 3,
                                  args.repeats)
        del model
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.compile_mode, "cuda_graphs": False}
    engine_dir = work / "engine-bert"
    engine_dir.mkdir()
    backend = InductorBackend()
    started = time.perf_counter()
    section["engine_build"] = backend.build_from_model(
        model_dir, "feature-extraction", "bf16", InductorTarget(**target),
        [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq])], engine_dir)
    section["engine_build"]["cold_build_s"] = round(time.perf_counter() - started, 3)
    runner = backend.load(engine_dir, InductorTarget(**target))
    got = runner.prefill(ids, mask).float()
    section["engine_bf16"] = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
    for name, values in (("engine_bf16", got), ("eager_bf16", outs["eager_bf16"])):
        cosine = torch.nn.functional.cosine_similarity(values, outs["eager_fp32"], dim=-1)
        section[name]["cosine_vs_fp32_mean"] = round(float(cosine.mean()), 6)
        section[name]["cosine_vs_fp32_min"] = round(float(cosine.min()), 6)
    for name in ("engine_bf16", "eager_bf16", "eager_fp32"):
        section[name]["fraction_of_bf16_gemm_bound"] = round(section["bounds"]["bf16_ms"] / section[name]["median_ms"], 3)
        section[name]["sequences_per_s"] = round(batch / section[name]["median_ms"] * 1e3, 1)
    report.add("encoder", section)


def print_table(data: dict[str, Any]) -> None:
    c = data.get("ceilings", {})
    if c:
        print(f"bf16 GEMM {c['gemm_bf16']['tflops']} TFLOP/s (p10-p90 {c['gemm_bf16']['tflops_p10_p90']}), "
              f"copy {c['copy']['tb_per_s']} TB/s (p10-p90 {c['copy']['tb_per_s_p10_p90']})")
    dec = data.get("decoder", {})
    if "summary" in dec:
        print(f"decoder bounds: {json.dumps(dec['bounds'])}")
        for who, row in dec["summary"].items():
            print(f"  {who:<12} " + "  ".join(f"{k}={v}" for k, v in row.items()))
        print(f"  engine top1 prefill {dec['engine']['top1_vs_fp32']}, decode {dec['engine'].get('decode_top1_vs_fp32')}; "
              f"eager bf16 top1 {dec['eager']['eager_bf16']['top1_vs_fp32']}")
        build = ("export_seconds", "compile_seconds", "cold_build_s", "cache_bytes", "engine_bytes")
        print(f"  build {json.dumps({k: dec['engine_build'].get(k) for k in build})}")
        print(f"  warm start {json.dumps(dec.get('warm_start'))}")
    fp8 = data.get("decoder_fp8", {})
    if "prefill" in fp8:
        print(f"decoder fp8 prefill {fp8['prefill']['median_ms']} ms = {fp8['prefill_ms_over_bf16_bound']} x the bf16 "
              f"bound ({fp8['prefill_bf16_bound_ms']} ms), top1 vs fp32 {fp8['top1_vs_fp32']}, "
              f"build {fp8['engine_build'].get('cold_build_s')} s")
    enc = data.get("encoder", {})
    if "engine_bf16" in enc:
        for who in ("engine_bf16", "eager_bf16", "eager_fp32"):
            print(f"encoder {who:<12} {json.dumps(enc[who])}")
        print(f"encoder build {json.dumps({k: enc['engine_build'].get(k) for k in ('compile_seconds', 'cold_build_s')})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200.json"))
    parser.add_argument("--quick", action="store_true", help="2-layer models: check the script, not the GPU")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--check-batches", type=int, default=16, help="8-prompt batches for the top-1 check")
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    parser.add_argument("--sections", default="decoder,encoder")
    parser.add_argument("--append", action="store_true",
                        help="add these sections to an existing --out (each run's command, date and ceilings kept)")
    parser.add_argument("--warm-start", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_start:
        run_warm_start(args.warm_start, args.target, args.shape)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_pipeline needs a CUDA GPU; this torch sees none")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    gpu = detect_gpu()
    run = {"command": " ".join(["python -m benchmarks.gpu_pipeline", *sys.argv[1:]]),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "sections": args.sections, "ceilings": {"gemm_bf16": gm.gemm_ceiling(), "copy": gm.copy_bandwidth()}}
    previous = json.loads(args.out.read_text()) if args.append and args.out.is_file() else {}
    report = Report(args.out, {**previous, "gpu": gpu.facts() if gpu else None, "versions": versions(),
                               "timing": "inputs and outputs device-resident on both sides; CUDA events per call; "
                                         "median with p10/p90 over repeats after warm-up"})
    report.add("runs", [*previous.get("runs", []), run])
    report.add("ceilings", previous.get("ceilings", run["ceilings"]))
    with tempfile.TemporaryDirectory(prefix="gpu-pipeline-") as tmp:
        for name in args.sections.split(","):
            started = time.perf_counter()
            try:
                {"decoder": decoder_section, "decoder_fp8": decoder_fp8_section, "encoder": encoder_section,
                 "decode_step": decode_step_section}[name](
                    args, Path(tmp), report.data["ceilings"], report)
            except Exception as e:  # keep what the other section measured; say what failed
                import traceback
                traceback.print_exc()
                report.add(f"{name}_error", f"{type(e).__name__}: {e}"[:2000])
            report.add(f"{name}_seconds", round(time.perf_counter() - started, 1))
            torch.cuda.empty_cache()
    print_table(report.data)


if __name__ == "__main__":
    main()
