"""Inductor engines on a real GPU, side by side with PyTorch eager measured in the same run.

Builds, checks and measures a Llama-3.2-1B-shaped decoder and a BERT-base-shaped encoder (made
here from their configs: speed does not depend on the values; the decoder is then trained briefly
on the shipped text, so that its top-1 agreement means something) as `inductor` bf16 and fp8
engines, with eager fp32 and bf16 references on the same GPU. Everything is timed alike: inputs
and outputs on the device, CUDA events around each call. The bf16 matrix-product ceiling and the
copy bandwidth are measured first, and each figure is also given as a fraction of its bound.

Usage: python -m benchmarks.gpu_pipeline --out benchmarks/results/h200.json [--sections decoder,encoder]
       [--append] [--quick] [--profile-warm-start]
       (sections: decoder, decoder_fp8, encoder, encoder_fp8, encoder_real, decode_step, prefill)
(--quick: a 2-layer model, to check the script in a minute). Writes the JSON after each section,
so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tasks.backends.inductor.backend import InductorBackend, versions
from tasks.config.spec import InductorTarget, ProfileSpec
from tasks.measure import gpu_measure as gm
from tasks.runtime.gpu import detect_gpu

LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
                   rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"})
QUICK_LLAMA = {**LLAMA_32_1B, "num_hidden_layers": 2, "vocab_size": 32000}
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
QUICK_BERT = {**BERT_BASE, "num_hidden_layers": 2}
TRAIN_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"
EVAL_TEXT = Path(__file__).resolve().parents[1] / "data" / "eval.txt"


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


def make_model(kind: str, config: dict[str, Any], directory: Path, train_steps: int = 0) -> dict[str, Any]:
    """Random weights from the config (a decoder then trained on text for `train_steps`), saved in
    bf16: the fp32 reference upcasts these same values."""
    from transformers import BertConfig, BertModel

    if kind == "decoder":
        _, model, facts = llama_on_gpu(config, train_steps)
    else:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model, facts = BertModel(BertConfig(**config)).to(torch.bfloat16), {}
    model.save_pretrained(directory)
    return facts


def llama_on_gpu(config: dict[str, Any], train_steps: int) -> tuple[Any, torch.nn.Module, dict[str, Any]]:
    """The decoder of `config` on the GPU in bf16 (trained on text first for `train_steps`), its
    config, and what training did."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
        facts = train_on_text(model, train_steps) if train_steps else {}
    return cfg, model.to(torch.bfloat16).eval(), facts


def text_bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long().cuda()


def train_on_text(model: torch.nn.Module, steps: int, batch: int = 8, seq: int = 512,
                  lr: float = 3e-4) -> dict[str, Any]:
    """Next-byte prediction on the shipped calibration text (bf16 autocast, AdamW).

    Random weights make every next token a near-tie (the best two logits of a random model are
    about 0.14 apart where the logits spread by 0.9), so any precision flips many of them and top-1
    agreement says nothing about the engine. A model trained this little is still far from a real
    checkpoint, but its next byte is often clear, as a real model's next token often is."""
    data = text_bytes(TRAIN_TEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, data.numel() - seq, (batch,), device="cuda", generator=generator)
        chunk = data[starts[:, None] + torch.arange(seq, device="cuda")]
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=chunk, labels=chunk).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    model.eval()
    del optimizer
    torch.cuda.empty_cache()
    losses_ = torch.stack(losses).float().cpu()
    return {"train_steps": steps, "train_text": TRAIN_TEXT.name, "train_seconds": round(time.perf_counter() - started, 1),
            "loss_first_nats_per_byte": round(float(losses_[0]), 3),
            "loss_last_10_nats_per_byte": round(float(losses_[-10:].mean()), 3)}


def text_prompts(batch: int, seq: int, count: int, seed: int) -> list[torch.Tensor]:
    """Windows of the shipped evaluation text (not trained on), as byte ids."""
    data = text_bytes(EVAL_TEXT)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [data[torch.randint(0, data.numel() - seq, (batch,), device="cuda", generator=g)[:, None]
                 + torch.arange(seq, device="cuda")] for _ in range(count)]


def calibration_windows(batch: int, seq: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) windows of the training text, for static fp8 scales: real text, and
    none of the windows the engines are checked on."""
    data = text_bytes(TRAIN_TEXT)
    g = torch.Generator(device="cuda").manual_seed(17)
    windows = [data[torch.randint(0, data.numel() - seq, (batch,), device="cuda", generator=g)[:, None]
                    + torch.arange(seq, device="cuda")] for _ in range(count)]
    return [(ids, torch.ones_like(ids)) for ids in windows]


def static_scales(model: torch.nn.Module, args: argparse.Namespace, batch: int, seq: int) -> dict[str, float]:
    from tasks.backends.inductor.fp8_linear import FP8_MAX
    from tasks.backends.inductor.llama_graphs import calibrate_input_amax

    amax = calibrate_input_amax(model, calibration_windows(batch, seq, args.calibration_batches))
    return {name: value / FP8_MAX for name, value in amax.items()}


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


def warm_start(engine: Path, target: dict[str, Any], batch: int, seq: int, decode: list[list[int]],
               profile: bool = False) -> dict[str, Any]:
    """Load the saved engine in a fresh process with an empty Inductor cache; time load and first
    inference (with `profile`, then once more under cProfile, to say where that time goes).

    Each process starts with an empty Inductor cache. The first compiles the bytecode of every
    module it imports where the install shipped none (the lent H200's image: ~1460 modules, ~5 s),
    into a fresh PYTHONPYCACHEPREFIX; the second finds it there, as it would in an install pip
    compiled. The second is the warm start; the first is reported beside it. The profiled one comes
    last, so the profiler never slows the figures."""
    bytecode = tempfile.mkdtemp(prefix="pycache-warm-")
    runs = []
    for profiled in (False, False, True) if profile else (False, False):
        # fresh Inductor and Triton caches: what the engine's compile cache does not hold (the Triton
        # kernels smelter's own ops launch) is compiled again, as on a machine that never ran them
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-warm-"),
               "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-warm-"), "PYTHONPYCACHEPREFIX": bytecode}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pipeline", "--warm-start", str(engine),
                              "--target", json.dumps(target), "--shape", json.dumps([batch, seq, decode]),
                              *(["--profile-warm-start"] if profiled else [])],
                             capture_output=True, text=True, env=env, timeout=600)
        if out.returncode != 0:
            return {"error": out.stderr[-3000:]}
        lines = out.stdout.strip().splitlines()
        runs.append({**json.loads(lines[-1]), **({"profile": lines[:-1][:90]} if profiled else {})})
    first, warm = runs[:2]
    result = {**warm, "first_process_compiling_bytecode": first}
    if profile:
        result["under_cprofile"] = runs[2]  # Python-heavy steps (deserialising, tracing) run slower under it
    return result


def run_warm_start(engine: Path, target_json: str, shape_json: str, profile: bool) -> None:
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
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
    problems = []
    for b, max_len in decode:
        session = runner.decoder(b, max_len)
        for pos in range(3):
            session.step(torch.zeros(b, 1, dtype=torch.long, device="cuda"), pos)
        problems += [session.problem] if session.problem else []
    torch.cuda.synchronize()
    figures = {"load_s": round(loaded, 3), "load_and_first_prefill_s": round(first_prefill, 3),
               "load_and_first_inference_all_graphs_s": round(time.perf_counter() - started, 3),
               "load_seconds_in_runner": round(runner.load_seconds, 3),
               "precompiled_graphs_used": {"prefill": runner._prefill is None,
                                           "decode": sorted(p.name for p in runner._pre_decode_used)},
               "precompile_problems": runner.precompile_problems + problems}
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
        repo = f"{Path(__file__).resolve().parents[1]}/"
        lines = (re.sub(r"/\S*?(site-packages|lib/python3\.\d+)/", "", line).replace(repo, "")
                 for line in text.getvalue().splitlines())
        print("\n".join(line[:160] for line in lines if line.strip()))
    print(json.dumps(figures))


def decoder_model(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """The decoder every decoder section of this run measures, made (and trained) once."""
    config = QUICK_LLAMA if args.quick else LLAMA_32_1B
    model_dir = work / "llama"
    if not (model_dir / "config.json").is_file():
        facts = make_model("decoder", config, model_dir, args.train_steps)
        (work / "llama-training.json").write_text(json.dumps(facts))
    return config, model_dir, json.loads((work / "llama-training.json").read_text())


def decoder_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    from tasks.backends.inductor.llama_graphs import StaticDecoder  # noqa: F401  (import errors surface here, early)

    config, model_dir, training = decoder_model(args, work)
    batch, seq, past = 8, 512, 512
    decode_batches = [1, 64]
    max_len = past + 16
    from transformers import LlamaConfig

    shape = gm.DecoderShape.from_config(LlamaConfig(**config))
    section: dict[str, Any] = {"config": config, "training": training, "prefill_shape": [batch, seq], "past": past,
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
    # Eager references, same GPU, same run; accuracy on windows of text the model was not trained on.
    checks = text_prompts(batch, seq, args.check_batches, 7)
    steps = text_prompts(decode_batches[-1], 16, 1, 11)[0]
    refs: dict[str, Any] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for name, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
        model = eager("decoder", model_dir, dtype)
        with torch.no_grad():
            logits[name] = [model(input_ids=c, attention_mask=torch.ones_like(c), use_cache=False,
                                  logits_to_keep=1).logits[:, -1].float() for c in checks]
            if name == "eager_fp32":
                decode_ref = model(input_ids=steps, use_cache=False).logits.float()
        refs[name] = eager_decoder_figures(model, batch, seq, past, decode_batches, args)
        del model
        torch.cuda.empty_cache()
    refs["eager_bf16"]["vs_fp32"] = gm.logit_agreement(logits["eager_fp32"], logits["eager_bf16"])
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
    sidecar = json.loads((engine_dir / "engine.json").read_text())
    facts.update({k: sidecar.get(k) for k in ("precompiled", "triton_kernels")})
    section["engine_build"] = facts
    report.add("decoder", section)
    runner = backend.load(engine_dir, InductorTarget(**target))
    engine_logits = [runner.prefill(c, torch.ones_like(c)).float() for c in checks]
    engine: dict[str, Any] = {"vs_fp32": gm.logit_agreement(logits["eager_fp32"], engine_logits),
                              "vs_eager_bf16": gm.logit_agreement(logits["eager_bf16"], engine_logits)}
    ids = checks[0]
    mask = torch.ones_like(ids)
    engine["prefill"] = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
    engine["prefill_kernels"] = gm.kernel_profile(lambda: runner.prefill(ids, mask))
    engine["prefill_path"] = "precompiled" if runner._prefill is None else "torch.compile"
    for b in decode_batches:
        session = runner.decoder(b, max_len)
        if b == decode_batches[-1]:
            outs = [session.step(steps[:, i:i + 1], i).float() for i in range(steps.shape[1])]
            engine["decode_vs_fp32"] = gm.logit_agreement(list(decode_ref.unbind(1)), outs)
        token = torch.randint(0, config["vocab_size"], (b, 1), device="cuda")
        engine[f"decode_b{b}"] = timed(lambda: session.step(token, past), 5, args.repeats)
        engine[f"decode_b{b}_path"] = ("precompiled, own CUDA graph" if session._precompiled is not None
                                       else f"torch.compile ({session.problem or 'no precompiled step'})")
        del session
    section["engine"] = engine
    section["summary"] = decoder_summary(section, batch, seq, decode_batches)
    report.add("decoder", section)
    section["warm_start"] = warm_start(engine_dir, target, batch, seq, [[b, max_len] for b in decode_batches],
                                       profile=args.profile_warm_start)
    if "load_and_first_inference_all_graphs_s" in section["warm_start"]:
        section["warm_start"]["fraction_of_cold_build"] = round(
            section["warm_start"]["load_and_first_inference_all_graphs_s"] / facts["cold_build_s"], 3)
    report.add("decoder", section)


def decoder_fp8_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """The same decoder's prefill as an fp8 engine (e4m3 products, bf16 elsewhere), against the bf16 bound
    and the fp32 eager reference on the same prompts; its decode step is the bf16 one measured above."""
    config, model_dir, training = decoder_model(args, work)
    batch, seq = 8, 512
    from transformers import LlamaConfig

    shape = gm.DecoderShape.from_config(LlamaConfig(**config))
    bound = gm.bound_ms(shape.prefill_flops(batch, seq), ceilings["gemm_bf16"]["tflops"])
    section: dict[str, Any] = {"prefill_shape": [batch, seq], "prefill_bf16_bound_ms": round(bound, 3),
                               "training": training, "products": fp8_product_error(shape, batch * seq)}
    report.add("decoder_fp8", section)
    checks = text_prompts(batch, seq, args.fp8_check_batches or args.check_batches, 7)
    model = eager("decoder", model_dir, torch.float32)
    with torch.no_grad():
        reference = [model(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1].float() for c in checks]
    del model
    torch.cuda.empty_cache()
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.fp8_compile_mode,
              "fp8_exclude": args.fp8_exclude.split("|") if args.fp8_exclude else [], "fp8_scaling": args.fp8_scaling,
              "fp8_bf16_share": args.fp8_bf16_share}
    calibration = None
    if InductorTarget(**target).calibrates("fp8"):
        calibration = [{"input_ids": ids.cpu().numpy(), "attention_mask": mask.cpu().numpy()}
                       for ids, mask in calibration_windows(batch, seq, args.calibration_batches)]
    engine_dir = work / "engine-llama-fp8"
    engine_dir.mkdir()
    backend = InductorBackend()
    started = time.perf_counter()
    facts = backend.build_from_model(model_dir, "text-generation", "fp8", InductorTarget(**target),
                                     [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq])], engine_dir,
                                     calibration=calibration)
    facts["cold_build_s"] = round(time.perf_counter() - started, 3)
    section["engine_build"] = facts
    sidecar = json.loads((engine_dir / "engine.json").read_text())
    section["kept_bf16"] = sidecar["fp8_kept_bf16"]
    section["sensitivity"] = sidecar["fp8_sensitivity"]
    report.add("decoder_fp8", section)
    runner = backend.load(engine_dir, InductorTarget(**target))
    with torch.no_grad():
        engine_logits = [runner.prefill(c, torch.ones_like(c)).float() for c in checks]
    section["vs_fp32"] = gm.logit_agreement(reference, engine_logits)
    ids = checks[0]
    mask = torch.ones_like(ids)
    section["prefill"] = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
    ms = section["prefill"]["median_ms"]
    section["prefill_tokens_per_s"] = round(batch * seq / ms * 1e3)
    section["prefill_ms_over_bf16_bound"] = round(ms / bound, 3)
    section["prefill_kernels"] = gm.kernel_profile(lambda: runner.prefill(ids, mask))
    report.add("decoder_fp8", section)
    section["warm_start"] = warm_start(engine_dir, target, batch, seq, [], profile=args.profile_warm_start)
    if "load_and_first_prefill_s" in section["warm_start"]:
        warm = section["warm_start"]
        warm["fraction_of_cold_build"] = round(warm["load_and_first_prefill_s"] / facts["cold_build_s"], 3)
        if sidecar["fp8_sensitivity"]:  # the same, as if the build had not measured sensitivity
            scan = sidecar["fp8_sensitivity"]["seconds"]
            warm["fraction_of_cold_build_without_sensitivity"] = round(
                warm["load_and_first_prefill_s"] / (facts["cold_build_s"] - scan), 3)
    report.add("decoder_fp8", section)
    del runner
    torch.cuda.empty_cache()
    if sidecar["fp8_sensitivity"] and args.fp8_recipe_shares:
        section["recipes"] = sensitivity_recipes(args, model_dir, LlamaConfig(**config), sidecar["fp8_sensitivity"],
                                                 batch, seq)
        report.add("decoder_fp8", section)


def sensitivity_recipes(args: argparse.Namespace, model_dir: Path, cfg: Any, sensitivity: dict[str, Any],
                        batch: int, seq: int) -> dict[str, Any]:
    """Eager recipes on the fp8 engine's own model, on windows apart from those it is checked on: what
    each fp8_bf16_share would have kept, beside nothing kept and the first and last layers."""
    choosing = text_prompts(batch, seq, args.check_batches, 13)
    model = eager("decoder", model_dir, torch.float32)
    with torch.no_grad():
        fp32 = [model(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1].float() for c in choosing]
    del model
    model = eager("decoder", model_dir, torch.bfloat16)
    scales = static_scales(model, args, batch, seq) if args.fp8_scaling == "static" else None
    shares = [float(x) for x in args.fp8_recipe_shares.split(",")]
    recipes = fp8_recipes(model, choosing, fp32, kept_by_sensitivity(cfg, sensitivity, scales, shares))
    del model
    torch.cuda.empty_cache()
    return recipes


def fp8_product_error(shape: gm.DecoderShape, tokens: int) -> dict[str, Any]:
    """Each layer product of the decoder in fp8, as the engine computes it (e4m3 operands, fast
    accumulation), against the same product computed exactly on the same e4m3 values, both against
    fp32: the first gap is what quantisation costs, the second what the kernel adds to it."""
    from tasks.backends.inductor.fp8_linear import FP8_MAX, Fp8Linear

    torch.manual_seed(0)
    shapes = {"qkv": (shape.hidden, (shape.heads + 2 * shape.kv_heads) * shape.head_dim),
              "o": (shape.heads * shape.head_dim, shape.hidden), "gate_up": (shape.hidden, 2 * shape.intermediate),
              "down": (shape.intermediate, shape.hidden)}
    out: dict[str, Any] = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        exact = x.float() @ w.float().t()
        with torch.no_grad():
            engine = Fp8Linear(w, None, fp8=True)(x).float()
        x_scale = x.float().abs().amax(-1, keepdim=True) / FP8_MAX
        w_scale = w.float().abs().amax(-1, keepdim=True) / FP8_MAX
        xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * x_scale
        wq = (w.float() / w_scale).to(torch.float8_e4m3fn).float() * w_scale
        emulated = xq @ wq.t()
        norm = exact.norm()
        out[name] = {"k": k, "n": n, "engine_relative_error": round(float((engine - exact).norm() / norm), 5),
                     "exact_fp8_products_relative_error": round(float((emulated - exact).norm() / norm), 5)}
    return out


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
    save), in each `--decode-variants` products:weights (torch:bf16 is F.linear on bf16 weights;
    smelter:bf16, smelter:fp8 and smelter:fp8-head run smelter::decode_linear on bf16 weights, on e4m3
    layer weights, on e4m3 layer and LM-head weights), each against the bytes bound of its own weights,
    with its kernel profile and its top-1 vs fp32 (on the trained model, 16-byte windows of
    data/eval.txt: at batch 1 and 8, where the weight-streaming kernels run, and at batch 64); then each
    product alone (`decode_products`)."""
    import copy

    from tasks.backends.inductor import decode_products as dp
    from tasks.backends.inductor.backend import DecodeSession, _compile_options, export_decode

    past, max_len = 512, 528
    cfg, model, training = llama_on_gpu(QUICK_LLAMA if args.quick else LLAMA_32_1B, args.train_steps)
    shape = gm.DecoderShape.from_config(cfg)
    target = InductorTarget(name="sm90", backend="inductor", device="cuda", arch=detect_gpu().arch)
    section: dict[str, Any] = {"past": past, "cache_len": max_len, "training": training,
                               "programmatic_dependent_launch": dp.PDL, "gemv_e4m3_words": dp.GEMV_WORDS,
                               "bf16_bounds_ms": {f"decode_b{b}": round(gm.bytes_bound_ms(
                                   shape.decode_bytes(b, past, 2), ceilings["copy"]["tb_per_s"]), 4) for b in (1, 64)}}
    section["decode_attention"] = decode_attention_kernels(shape, ceilings, past, max_len, args.repeats)
    if args.tune_gemv and args.decode_products:  # each product alone first; the step variants then run the fastest ones
        section["decode_products"] = decode_product_kernels(shape, ceilings, args.repeats)
        section["decode_configs"] = apply_decode_configs(best_decode_configs(section["decode_products"]))
        report.add("decode_step", section)
        print(f"decode configs: {json.dumps(section['decode_configs'])}", flush=True)
    windows = text_prompts(64, 16, 1, 11)[0]
    reference = copy.deepcopy(model).float()
    with torch.no_grad():
        expected = reference(input_ids=windows, use_cache=False).logits.float()
    del reference
    torch.cuda.empty_cache()
    for variant in args.decode_variants.split(","):
        products, weights = variant.split(":")
        started = time.perf_counter()
        try:
            exported = export_decode(model, torch.bfloat16, products=products, fp8_weights=weights.startswith("fp8"),
                                     fp8_head=weights == "fp8-head")
            # every matrix a step reads once (the LM head included, tied or not), at its stored width
            weight_bytes = (shape.layers * shape.layer_params * (1 if weights.startswith("fp8") else 2)
                            + shape.vocab * shape.hidden * (1 if weights == "fp8-head" else 2))
            step = exported.module()
            figures: dict[str, Any] = {"weight_bytes": weight_bytes, "export_s": round(time.perf_counter() - started, 1)}
            for b in (1, 8, 64):
                started = time.perf_counter()
                session = DecodeSession(step, cfg, b, max_len, torch.bfloat16, "cuda")
                session.compile(_compile_options(target, decode=True))
                token = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
                for pos in range(3):
                    session.step(token, pos)
                compile_s = time.perf_counter() - started
                if b in (1, 8, 64):  # top-1 vs fp32 over all 64 windows, in groups of b
                    outs: list[torch.Tensor] = []
                    refs: list[torch.Tensor] = []
                    for g in range(0, 64, b):
                        for i in range(windows.shape[1]):
                            outs.append(session.step(windows[g:g + b, i:i + 1], i).float())
                            refs.append(expected[g:g + b, i])
                    figures[f"decode_b{b}_vs_fp32"] = gm.logit_agreement(refs, outs)
                if b == 8:
                    del session
                    continue
                timing = timed(lambda: session.step(token, past), 5, args.repeats)
                kv = 2 * shape.layers * b * shape.kv_heads * shape.head_dim * past * 2
                bound = gm.bytes_bound_ms(weight_bytes + kv, ceilings["copy"]["tb_per_s"])
                figures[f"decode_b{b}"] = {
                    **timing, "compile_s": round(compile_s, 1), "bytes_bound_ms": round(bound, 4),
                    "times_own_bytes_bound": round(timing["median_ms"] / bound, 2),
                    "times_bf16_bound": round(timing["median_ms"] / section["bf16_bounds_ms"][f"decode_b{b}"], 2),
                    "tokens_per_s": round(b / timing["median_ms"] * 1e3),
                    "kernels": gm.kernel_profile(lambda: session.step(token, past), top=16)}
                del session
            section[variant] = figures
        except Exception as e:  # the other variants still run
            import traceback
            traceback.print_exc()
            section[variant] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report.add("decode_step", section)
        print(f"decode step {variant}: " + json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "kernels"}
                                                            if isinstance(v, dict) else v)
                                                       for k, v in section[variant].items()}), flush=True)
        torch.compiler.reset()
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    if not args.tune_gemv and args.decode_products:
        section["decode_products"] = decode_product_kernels(shape, ceilings, args.repeats)
    report.add("decode_step", section)


GEMV_CANDIDATES = ((4, 512, 4), (8, 512, 4), (8, 1024, 8), (32, 256, 4), (16, 1024, 8), (8, 2048, 8), (4, 2048, 4),
                   (2, 4096, 4), (4, 4096, 8), (2, 8192, 8), (4, 1024, 4), (16, 512, 8), (2, 2048, 4), (8, 256, 4))
ATTENTION_CANDIDATES = ((32, 3, 4), (64, 2, 4), (64, 3, 4), (64, 4, 4), (64, 3, 8), (128, 3, 8))
ROWS_CANDIDATES = {1: ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 4)),
                   64: ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (32, 128, 4, 4),
                        (64, 256, 8, 3))}


def with_settings(fn: Any, **settings: Any) -> Any:
    """fn with decode_products' module settings (PDL, GEMV_WORDS, ...) changed while it launches."""
    from tasks.backends.inductor import decode_products as dp

    def call(i: int) -> torch.Tensor:
        saved = {name: getattr(dp, name) for name in settings}
        for name, value in settings.items():
            setattr(dp, name, value)
        try:
            return fn(i)
        finally:
            for name, value in saved.items():
                setattr(dp, name, value)
    return call


def graph_call_us(fn: Any, copies: int, repeats: int) -> dict[str, float]:
    """Device time per call of `fn(i)`, i over `copies` inputs, replayed from one CUDA graph of all of
    them: the launch gaps are those of a replayed decode step, not the host's (calls timed one by
    one measured the host's launch, 55-70 us, for products that read in a few us)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    stats = gm.summary(gm.cuda_times_ms(graph.replay, 3, repeats))
    return {k: round(v * 1e3 / copies, 2) for k, v in stats.items() if k.endswith("_ms")}


def best_decode_configs(products: dict[str, Any]) -> dict[str, Any]:
    """From decode_product_kernels: the fastest block shape of each kernel per product, weight width
    and rows, and per weight width which kernel serves 1 row and 64 rows (the one whose best shapes
    sum to the least time over all products)."""
    gemv: dict[tuple[int, int, int], tuple[float, tuple[int, ...]]] = {}
    rows: dict[tuple[int, int, int, int], tuple[float, tuple[int, ...]]] = {}
    totals: dict[tuple[str, int, int], float] = {}
    for row in products.values():
        if not isinstance(row, dict) or "n" not in row:
            continue
        best: dict[tuple[str, int, int], float] = {}
        for way, figures in row.items():
            if not isinstance(figures, dict):
                continue
            width = 1 if "_fp8_" in way else 2
            found = re.fullmatch(r"gemv_(?:fp8|bf16)_(\d+)x(\d+)w(\d+)_m1", way)
            if found:
                key = (row["n"], row["k"], width)
                if key not in gemv or figures["us"] < gemv[key][0]:
                    gemv[key] = (figures["us"], tuple(int(g) for g in found.groups()))
            found = re.fullmatch(r"rows_(?:fp8|bf16)_(\d+)x(\d+)w(\d+)s(\d+)_m(\d+)", way)
            if found:
                m = int(found[5])
                key4 = (row["n"], row["k"], width, 16 if m <= 16 else 64)
                if key4 not in rows or figures["us"] < rows[key4][0]:
                    rows[key4] = (figures["us"], tuple(int(g) for g in found.groups()[:4]))
            kind = ("gemv" if way.startswith("gemv_") else "rows" if way.startswith("rows_")
                    else "cublas" if way.startswith(("cublas_bf16_", "fp8_rows_cublas")) else None)
            if kind:
                k3 = (kind, width, int(way.rsplit("_m", 1)[1]))
                best[k3] = min(best.get(k3, float("inf")), figures["us"])
        for k3, us in best.items():
            totals[k3] = totals.get(k3, 0.0) + us
    choice: dict[str, Any] = {}
    for width in (1, 2):
        one = {k: totals.get((k, width, 1), float("inf")) for k in ("gemv", "rows")}
        many = {k: totals.get((k, width, 64), float("inf")) for k in ("rows", "cublas")}
        choice[width] = {"gemv_rows": 1 if one["gemv"] <= one["rows"] else 0,
                         "rows_kernel_rows": 64 if many["rows"] <= many["cublas"] else 16,
                         "us_1_row": {k: round(v, 1) for k, v in one.items()},
                         "us_64_rows": {k: round(v, 1) for k, v in many.items()}}
    return {"gemv": {k: c for k, (_, c) in gemv.items()}, "rows": {k: c for k, (_, c) in rows.items()},
            "choice": choice}


def apply_decode_configs(best: dict[str, Any]) -> dict[str, Any]:
    """Set decode_products' block shapes and row thresholds to `best`; what it set, for the report."""
    from tasks.backends.inductor import decode_products as dp

    dp.GEMV_CONFIGS.update(best["gemv"])
    dp.ROWS_CONFIGS.update(best["rows"])
    for width, c in best["choice"].items():
        dp.GEMV_ROWS[width] = c["gemv_rows"]
        dp.ROWS_KERNEL_ROWS[width] = c["rows_kernel_rows"]
    return {"gemv_configs": {f"{n}x{k}x{w}": list(c) for (n, k, w), c in dp.GEMV_CONFIGS.items()},
            "rows_configs": {f"{n}x{k}x{w}x{m}": list(c) for (n, k, w, m), c in dp.ROWS_CONFIGS.items()},
            "gemv_rows": dict(dp.GEMV_ROWS), "rows_kernel_rows": dict(dp.ROWS_KERNEL_ROWS), "choice": best["choice"]}


def decode_product_kernels(shape: gm.DecoderShape, ceilings: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each decode product alone at 1 and 64 rows, fused as the step runs it (qkv, gate_up and the
    head with the rms_norm before them, o with the residual add after it, down with silu(gate) * up
    before it and the residual add after it): smelter::decode_linear on bf16 and e4m3 weights as
    configured, and each of its ways in several block shapes (the CUDA-core kernel at 1 row, the
    norm or gate kernel then the tensor-core one at 1 and 64 rows, the norm or gate kernel then
    cuBLAS at 64 rows, e4m3 weights at 64 rows also as the input rounded to e4m3 then the fp8 tensor
    cores (`qrows_fp8_*`), and plain cuBLAS on the unfused input for reference), as achieved bytes per
    second of weights read, each call timed inside a CUDA graph of many (graph_call_us) rotating over
    copies of the weights larger than L2 together (as a step reads each weight once), and each one's
    relative error vs fp32."""
    from tasks.backends.inductor import decode_products as dp

    products = {"qkv": ((shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.hidden, "norm"),
                "o": (shape.hidden, shape.heads * shape.head_dim, "residual"),
                "gate_up": (2 * shape.intermediate, shape.hidden, "norm"),
                "down": (shape.hidden, shape.intermediate, "gated+residual"), "head": (shape.vocab, shape.hidden, "norm")}
    out: dict[str, Any] = {"copy_tb_per_s": ceilings["copy"]["tb_per_s"]}
    for name, (n, k, fused) in products.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        quantised, scale = dp.quantize_weight(w)
        copies = max(2, -(-(256 << 20) // (n * k)))
        bf16s = [w.clone() for _ in range(copies)]
        fp8s = [quantised.clone() for _ in range(copies)]
        row: dict[str, Any] = {"n": n, "k": k, "fused": fused}
        for rows in (1, 64):
            x = torch.randn(rows, 2 * k if "gated" in fused else k, device="cuda", dtype=torch.bfloat16)
            norm = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
            residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            kw: dict[str, Any] = {"gated": "gated" in fused, "eps": 1e-5, "norm": norm if fused == "norm" else None,
                                  "residual": residual if "residual" in fused else None}
            fp32 = {key: v.float() if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
            exact = dp.reference(x.float(), w.float(), None, **fp32)
            exact_fp8 = dp.reference(x.float(), quantised.float(), scale, **fp32)
            prepared = dp.product_input(x, kw["gated"], kw["norm"], kw["eps"])
            res = kw["residual"]

            def prepare() -> torch.Tensor:
                return dp.prepared_input(x, kw["gated"], kw["norm"], kw["eps"])

            def cublas(i: int) -> torch.Tensor:
                inputs = prepare()
                if res is not None:
                    return torch.addmm(res, inputs, bf16s[i].t())
                return torch.nn.functional.linear(inputs, bf16s[i])

            def cublas_fp8(i: int) -> torch.Tensor:
                y = dp.fp8_rows_product(prepare(), fp8s[i], scale)
                return y.add_(res) if res is not None else y

            def rows_way(weights: list[torch.Tensor], s: torch.Tensor | None, c: tuple[int, ...]) -> Any:
                """The tensor-core kernel as decode_linear runs it, after the norm or gate kernel."""
                return lambda i: dp.rows_product(prepare(), weights[i], s, res, config=c)

            ways: dict[str, Any] = {
                "cublas_unfused_bf16": (lambda i: torch.nn.functional.linear(prepared, bf16s[i])
                                        + (res if res is not None else 0), 2, exact),
                "smelter_bf16": (lambda i: torch.ops.smelter.decode_linear(x, bf16s[i], None, **kw), 2, exact),
                "smelter_fp8": (lambda i: torch.ops.smelter.decode_linear(x, fp8s[i], scale, **kw), 1, exact_fp8)}
            if dp.PDL:  # the same without programmatic dependent launch
                ways["smelter_bf16_no_pdl"] = (with_settings(ways["smelter_bf16"][0], PDL=False), 2, exact)
                ways["smelter_fp8_no_pdl"] = (with_settings(ways["smelter_fp8"][0], PDL=False), 1, exact_fp8)
            if rows == 1:
                # e4m3 widened by the conversion instructions, not as words
                ways["smelter_fp8_no_words"] = (with_settings(ways["smelter_fp8"][0], GEMV_WORDS=False), 1, exact_fp8)
                for c in (c for c in GEMV_CANDIDATES if c[1] <= k):
                    tag = "{}x{}w{}".format(*c)
                    ways[f"gemv_fp8_{tag}"] = (lambda i, c=c: dp.gemv(x, fp8s[i], scale, **kw, config=c), 1, exact_fp8)
                    ways[f"gemv_bf16_{tag}"] = (lambda i, c=c: dp.gemv(x, bf16s[i], None, **kw, config=c), 2, exact)
            if rows == 64:
                ways["cublas_bf16"] = (cublas, 2, exact)
                ways["fp8_rows_cublas_fp8"] = (cublas_fp8, 1, exact_fp8)
                for c in ROWS_CANDIDATES[rows]:  # e4m3 rows x e4m3 weights on the fp8 tensor cores
                    ways["qrows_fp8_{}x{}w{}s{}".format(*c)] = (
                        lambda i, c=c: dp.quantized_rows_product(x, fp8s[i], scale, kw["gated"], kw["norm"], kw["eps"],
                                                                 res, config=c), 1, exact_fp8)
            for c in ROWS_CANDIDATES[rows]:
                tag = "{}x{}w{}s{}".format(*c)
                ways[f"rows_fp8_{tag}"] = (rows_way(fp8s, scale, c), 1, exact_fp8)
                ways[f"rows_bf16_{tag}"] = (rows_way(bf16s, None, c), 2, exact)
            for way, (fn, itemsize, truth) in ways.items():
                try:
                    error = float((fn(0).float() - truth).norm() / truth.norm())
                    timing = graph_call_us(fn, copies, max(repeats, 20))
                    row[f"{way}_m{rows}"] = {"us": timing["median_ms"], "us_p10_p90": [timing["p10_ms"], timing["p90_ms"]],
                                             "tb_per_s": round(n * k * itemsize / (timing["median_ms"] * 1e6), 3),
                                             "relative_error": float(f"{error:.3g}")}
                except Exception as e:  # a block shape Triton refuses says so
                    row[f"{way}_m{rows}"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[name] = row
        print(f"decode product {name}: " + json.dumps({k: v["us"] if isinstance(v, dict) else v
                                                         for k, v in row.items()}), flush=True)
        del bf16s, fp8s
        torch.cuda.empty_cache()
    return out


def decode_attention_kernels(shape: gm.DecoderShape, ceilings: dict[str, Any], past: int, max_len: int,
                             repeats: int) -> dict[str, Any]:
    """smelter::decode_attention's kernels in several (positions per step, stages) against its torch
    reference (the unfused step's attention) at batch 1 and 64, each call timed inside a CUDA graph of
    one call per layer's cache (graph_call_us), as bytes per second of the K and V read up to `past`,
    with the relative error vs fp32; the op then runs the fastest configuration at each batch."""
    from tasks.backends.inductor import decode_products as dp

    out: dict[str, Any] = {}
    d, heads, kvh = shape.head_dim, shape.heads, shape.kv_heads
    for b in (1, 64):
        caches = [(torch.randn(b, kvh, max_len, d, device="cuda", dtype=torch.bfloat16) * 0.5,
                   torch.randn(b, kvh, max_len, d, device="cuda", dtype=torch.bfloat16)) for _ in range(shape.layers)]
        q = torch.randn(b, heads * d, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(d // 2, device="cuda") * 6.28
        cos = torch.cat([angles.cos(), angles.cos()]).to(torch.bfloat16)
        sin = torch.cat([angles.sin(), angles.sin()]).to(torch.bfloat16)
        pos = torch.tensor(past, device="cuda")
        k0, v0 = caches[0]
        truth = dp.attention_reference(q.float(), cos.float(), sin.float(), k0.float(), v0.float(), pos)
        kv_bytes = 2 * b * kvh * (past + 1) * d * 2
        row: dict[str, Any] = {"kv_bytes": kv_bytes}
        ways = {"smelter_s{}x{}w{}".format(*c): (lambda i, c=c: dp.attention(q, cos, sin, *caches[i], pos, config=c))
                for c in ATTENTION_CANDIDATES}
        ways["torch"] = lambda i: dp.attention_reference(q, cos, sin, *caches[i], pos)
        for c in ((64, 2, 4), (32, 3, 4)):  # the same without programmatic dependent launch
            ways["other_s{}x{}w{}_no_pdl".format(*c)] = with_settings(ways["smelter_s{}x{}w{}".format(*c)], PDL=False)
        for way, fn in ways.items():
            error = float((fn(0).float() - truth).norm() / truth.norm())
            timing = graph_call_us(fn, len(caches), max(repeats, 20))
            row[way] = {"us": timing["median_ms"], "us_p10_p90": [timing["p10_ms"], timing["p90_ms"]],
                        "tb_per_s": round(kv_bytes / (timing["median_ms"] * 1e6), 3),
                        "relative_error": float(f"{error:.3g}")}
        best = min((w for w in row if w.startswith("smelter_")), key=lambda w: row[w]["us"])
        config = tuple(int(g) for g in re.fullmatch(r"smelter_s(\d+)x(\d+)w(\d+)", best).groups())
        # the op's configuration for this batch's kind of launch: split positions (few sequences) or not
        row["config"] = dp.ATTENTION_CONFIGS["split" if b * kvh < dp.ATTENTION_PROGRAMS else "whole"] = config
        out[f"b{b}"] = row
        print(f"decode attention b{b}: {json.dumps(row)}", flush=True)
        del caches
        torch.cuda.empty_cache()
    return out


def prefill_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """The decoder's prefill graph alone (the engine's own export and compile options, no save or
    reload) in each `--variants` precision:compile-mode[:kept[:extra Inductor options]], beside eager
    fp32 and bf16, with a kernel profile of each, SDPA's attention kernels measured alone, and the
    top-1 of fp8 recipes (which products stay bf16): for checking a change to the prefill in minutes
    instead of a full build."""
    import copy

    from tasks.backends.inductor.backend import _compile_options, export_prefill
    from tasks.backends.inductor.llama_support import fp8_kept

    batch, seq = 8, 512
    cfg, model, training = llama_on_gpu(QUICK_LLAMA if args.quick else LLAMA_32_1B, args.train_steps)
    shape = gm.DecoderShape.from_config(cfg)
    bound = gm.bound_ms(shape.prefill_flops(batch, seq), ceilings["gemm_bf16"]["tflops"])
    section: dict[str, Any] = {"prefill_shape": [batch, seq], "bf16_bound_ms": round(bound, 3), "training": training,
                               "attention": attention_kernels(cfg, batch, seq, args.repeats)}
    report.add("prefill", section)
    checks = text_prompts(batch, seq, args.check_batches, 7)
    choosing = text_prompts(batch, seq, args.check_batches if args.fp8_recipes else 0, 13)
    reference = copy.deepcopy(model).float()
    with torch.no_grad():
        fp32 = [reference(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1] for c in checks]
        fp32_choosing = [reference(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1] for c in choosing]
        del reference
        torch.cuda.empty_cache()
        bf16 = [model(input_ids=c, use_cache=False, logits_to_keep=1).logits[:, -1] for c in checks]
    ids = checks[0]
    mask = torch.ones_like(ids)
    section["eager_bf16"] = {**timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1).logits, 3,
                                     args.repeats), "vs_fp32": gm.logit_agreement(fp32, bf16)}
    scales = static_scales(model, args, batch, seq) if args.fp8_recipes or "fp8-static" in args.variants else None
    if args.fp8_recipes:
        section["fp8_recipes"] = fp8_recipes(model, choosing, fp32_choosing, kept_by_globs(cfg, scales))
    report.add("prefill", section)
    for variant in args.variants.split(","):
        precision, mode, globs, extra = (variant.split(":") + ["", ""])[:4]
        started = time.perf_counter()
        try:
            kept = fp8_kept(globs.split("|"), cfg.num_hidden_layers)[0] if globs else []
            program = export_prefill(model, True, batch, seq, fp8=precision.startswith("fp8"), kept=kept,
                                     input_scales=scales if precision == "fp8-static" else None)
            target = InductorTarget(name="sm90", backend="inductor", device="cuda", arch=detect_gpu().arch,
                                    compile_mode=mode)
            options = {**_compile_options(target, decode=False),
                       **{k: int(v) for k, v in (o.split("=") for o in extra.split("&") if o)}}
            graph = torch.compile(program.module(), options=options)
            with torch.no_grad():
                run = lambda: graph(ids, mask)  # noqa: E731
                run()
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
                logits = [graph(c, torch.ones_like(c)).clone() for c in checks]
                figures = timed(run, 3, args.repeats)
                kernels = gm.kernel_profile(run)
            section[variant] = {**figures, "compile_s": round(compile_s, 1), "kept_bf16": len(kept),
                                "fraction_of_bf16_bound": round(bound / figures["median_ms"], 3),
                                "tokens_per_s": round(batch * seq / figures["median_ms"] * 1e3),
                                "vs_fp32": gm.logit_agreement(fp32, logits), "kernels": kernels}
        except Exception as e:  # the other variants still run
            section[variant] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report.add("prefill", section)
        print(f"prefill {variant}: {json.dumps({k: v for k, v in section[variant].items() if k != 'kernels'})}",
              flush=True)
        torch.compiler.reset()
        torch.cuda.empty_cache()


def fp8_recipes(model: torch.nn.Module, prompts_: list[torch.Tensor], fp32: list[torch.Tensor],
                recipes: dict[str, tuple[list[str], dict[str, float] | None]]) -> dict[str, Any]:
    """Top-1 against fp32 of the eager fp8 prefill for each recipe (name -> products kept in bf16, static
    input scales or None for per-token ones), on windows of the evaluation text apart from those the
    engines are checked on (another seed), so that choosing a recipe here does not tune the figure
    reported for it. `fixed_vs_first` and `broken_vs_first` pair the positions: those a recipe gets
    right that the first recipe gets wrong, and the reverse."""
    from tasks.backends.inductor.llama_graphs import LlamaPrefill

    reference = torch.cat([r.argmax(-1) for r in fp32])
    out: dict[str, Any] = {"positions": int(reference.numel())}
    baseline = None
    for name, (kept, scales) in recipes.items():
        graph = LlamaPrefill(model, fp8=True, kept=kept, input_scales=scales)
        graph.eval()
        with torch.no_grad():
            logits = [graph(p, torch.ones_like(p)).float() for p in prompts_]
        top1 = torch.cat([x.argmax(-1) for x in logits]) == reference
        baseline = top1 if baseline is None else baseline
        out[name] = {"kept": kept if len(kept) <= 16 else f"{len(kept)} products", "kept_products": len(kept),
                     "static_scales": scales is not None, "vs_fp32": gm.logit_agreement(fp32, logits),
                     "fixed_vs_first": int((top1 & ~baseline).sum()), "broken_vs_first": int((~top1 & baseline).sum())}
        del graph
        torch.cuda.empty_cache()
    return out


def kept_by_globs(cfg: Any, scales: dict[str, float] | None) -> dict[str, tuple[list[str], dict[str, float] | None]]:
    """The prefill section's recipes: products kept bf16 chosen by layer or by kind."""
    from tasks.backends.inductor.llama_support import fp8_kept

    last = cfg.num_hidden_layers - 1
    globs = {"none": [], "first layer": ["layers.0.*"], "last layer": [f"layers.{last}.*"],
             "first and last layers": ["layers.0.*", f"layers.{last}.*"],
             "first two and last two layers": ["layers.[01].*", f"layers.{last - 1}.*", f"layers.{last}.*"],
             "attention products": ["*.qkv", "*.o"], "down products": ["*.down"]}
    recipes = {name: (fp8_kept(g, cfg.num_hidden_layers)[0], None) for name, g in globs.items()}
    if scales is not None:
        recipes |= {"static: none": ([], scales), "static: first and last layers": (
            recipes["first and last layers"][0], scales)}
    return recipes


def kept_by_sensitivity(cfg: Any, sensitivity: dict[str, Any], scales: dict[str, float] | None,
                        shares: list[float]) -> dict[str, tuple[list[str], dict[str, float] | None]]:
    """Recipes of the decoder_fp8 section on its own model: nothing kept, the first and last layers (the
    hand-picked recipe of earlier runs), and fp8_bf16_share's choice at each share from the engine's
    measured sensitivity."""
    from tasks.backends.inductor.llama_support import fp8_kept, keep_sensitive, product_costs

    costs = product_costs(cfg)
    last = cfg.num_hidden_layers - 1
    recipes = {"none": ([], scales),
               "first and last layers": (fp8_kept(["layers.0.*", f"layers.{last}.*"], cfg.num_hidden_layers)[0], scales)}
    for share in shares:
        recipes[f"sensitivity share {share}"] = (keep_sensitive(sensitivity["logit_mse"], costs, share, []), scales)
    return recipes


def attention_kernels(cfg: Any, batch: int, seq: int, repeats: int) -> dict[str, Any]:
    """Causal SDPA over one layer's q, k, v, each way the prefill could call it: grouped KV heads
    repeated or passed as is (enable_gqa), through each fused backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.head_dim
    q = torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ways = {"repeat": lambda: sdpa(q, k.repeat_interleave(heads // kv_heads, 1),
                                   v.repeat_interleave(heads // kv_heads, 1), is_causal=True),
            "gqa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True)}
    out: dict[str, Any] = {"flop_causal_half": 2 * batch * seq * seq * heads * d}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        for name, fn in ways.items():
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    out[f"{backend.lower()}_{name}"] = gm.summary(gm.cuda_times_ms(fn, 3, repeats))["median_ms"]
            except Exception as e:  # a backend that refuses this call says so
                out[f"{backend.lower()}_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512)
QUICK_MINILM = {**MINILM, "num_hidden_layers": 2}


def encoder_products(cfg: Any, tokens: int, tflops: float, repeats: int) -> dict[str, Any]:
    """Each layer product of the encoder graph alone through cuBLAS (bias included) at `tokens` rows: what
    the engine's kernels of the same shapes are compared with."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    x = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in {h, i}}
    out: dict[str, Any] = {}
    for name, (k, n) in {"qkv": (h, 3 * h), "o": (h, h), "up": (h, i), "down": (i, h)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ms = gm.summary(gm.cuda_times_ms(lambda: torch.nn.functional.linear(x[k], w, b), 5, repeats))["median_ms"]
        flop = 2 * tokens * k * n
        out[name] = {"shape": [tokens, k, n], "ms": ms, "tflops": round(flop / ms / 1e9, 1),
                     "fraction_of_gemm_ceiling": round(flop / ms / 1e9 / tflops, 3)}
    return out


def encoder_engine(args: argparse.Namespace, work: Path, name: str, config: dict[str, Any], shapes: list[tuple[int, int]],
                   ceilings: dict[str, Any]) -> dict[str, Any]:
    """One encoder shape's engine (built for every shape in `shapes`), beside eager fp32 and bf16 on the
    same weights: medians, fraction of the bf16 bound, cosine vs fp32, and a kernel profile at each shape."""
    from transformers import BertConfig

    cfg = BertConfig(**config)
    model_dir = work / name
    make_model("encoder", config, model_dir)
    tflops = ceilings["gemm_bf16"]["tflops"]
    section: dict[str, Any] = {"config": config}
    inputs = {}
    for batch, seq in shapes:
        ids = prompts(config["vocab_size"], batch, seq, 1, 3)[0]
        flops = gm.encoder_flops(cfg, batch, seq)
        inputs[(batch, seq)] = ids
        section[f"{batch}x{seq}"] = {"bounds": {"tflop": round(flops / 1e12, 4),
                                                "bf16_ms": round(gm.bound_ms(flops, tflops), 4)},
                                     "products_alone": encoder_products(cfg, batch * seq, tflops, args.repeats)}
    outs: dict[tuple[int, int], dict[str, torch.Tensor]] = {shape: {} for shape in shapes}
    for who, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
        model = eager("encoder", model_dir, dtype)
        with torch.no_grad():
            for shape, ids in inputs.items():
                mask = torch.ones_like(ids)
                outs[shape][who] = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                section[f"{shape[0]}x{shape[1]}"][who] = timed(
                    lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state, 3, args.repeats)
        del model
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
              "format": "compiled", "compile_mode": args.compile_mode}
    engine_dir = work / f"engine-{name}"
    engine_dir.mkdir()
    backend = InductorBackend()
    started = time.perf_counter()
    section["engine_build"] = backend.build_from_model(
        model_dir, "feature-extraction", "bf16", InductorTarget(**target),
        [ProfileSpec(batch=[1, b, b], seq=[1, s, s]) for b, s in shapes], engine_dir)
    section["engine_build"]["cold_build_s"] = round(time.perf_counter() - started, 3)
    sidecar = json.loads((engine_dir / "engine.json").read_text())
    section["engine_build"].update({k: sidecar.get(k) for k in ("prefill_graph", "prefill_cuda_graphs", "precompiled")})
    runner = backend.load(engine_dir, InductorTarget(**target))
    for shape, ids in inputs.items():
        mask = torch.ones_like(ids)
        figures = section[f"{shape[0]}x{shape[1]}"]
        got = runner.prefill(ids, mask).float()
        figures["engine_bf16"] = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
        figures["engine_bf16_kernels"] = gm.kernel_profile(lambda: runner.prefill(ids, mask), top=16)
        figures["engine_bf16_path"] = ("precompiled, replayed from the runner's CUDA graph"
                                       if runner._prefill_graphs else "torch.compile")
        for who, values in (("engine_bf16", got), ("eager_bf16", outs[shape]["eager_bf16"])):
            cosine = torch.nn.functional.cosine_similarity(values, outs[shape]["eager_fp32"], dim=-1)
            figures[who]["cosine_vs_fp32_mean"] = round(float(cosine.mean()), 6)
            figures[who]["cosine_vs_fp32_min"] = round(float(cosine.min()), 6)
        for who in ("engine_bf16", "eager_bf16", "eager_fp32"):
            figures[who]["fraction_of_bf16_gemm_bound"] = round(figures["bounds"]["bf16_ms"] / figures[who]["median_ms"], 3)
            figures[who]["sequences_per_s"] = round(shape[0] / figures[who]["median_ms"] * 1e3, 1)
    section["target"] = target
    return section


def encoder_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """A BERT-base-shaped encoder at 8 × 512 and a MiniLM-shaped one (all-MiniLM-L6-v2's sizes) at the
    batches an embedding service runs, each as an inductor bf16 engine beside eager fp32 and bf16."""
    bert = encoder_engine(args, work, "bert", QUICK_BERT if args.quick else BERT_BASE, [(8, 512)], ceilings)
    section: dict[str, Any] = {"config": bert.pop("config"), "shape": [8, 512], **bert.pop("8x512"), **bert}
    report.add("encoder", section)
    minilm = encoder_engine(args, work, "minilm", QUICK_MINILM if args.quick else MINILM, [(32, 128), (256, 128)],
                            ceilings)
    report.add("encoder_minilm", minilm)


def encoder_fp8_products(cfg: Any, tokens: int, tflops: float, repeats: int) -> dict[str, Any]:
    """Each layer product of the encoder alone at `tokens` rows: bf16 (cuBLAS, bias included) against e4m3
    through torch._scaled_mm with row-wise scales (what the engine runs) and with one scale per tensor, the
    inputs already in e4m3. Timed call by call, launches included: compare them with each other; the
    engine's kernel profile says what the same products take in its replayed forward."""
    from tasks.backends.inductor.fp8_linear import FP8

    h, i = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, Any] = {}
    for name, (k, n) in {"qkv": (h, 3 * h), "o": (h, h), "up": (h, i), "down": (i, h)}.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        xq, wq = x.to(FP8), w.to(FP8)
        rows, channels = torch.ones(tokens, 1, device="cuda"), torch.ones(1, n, device="cuda")
        one = torch.ones((), device="cuda")
        ways = {"bf16": lambda: torch.nn.functional.linear(x, w, b),
                "fp8_rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=rows, scale_b=channels,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True),
                "fp8_tensorwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16, use_fast_accum=True)}
        flop = 2 * tokens * k * n
        out[name] = {"shape": [tokens, k, n]}
        for way, fn in ways.items():
            try:
                ms = gm.summary(gm.cuda_times_ms(fn, 5, repeats))["median_ms"]
                out[name][way] = {"ms": ms, "tflops": round(flop / ms / 1e9, 1)}
            except Exception as e:  # a recipe this torch refuses says so
                out[name][way] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def encoder_text(path: Path, batch: int, seq: int, count: int, seed: int, tokenizer: Any = None,
                 padded: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) batches of a shipped text: with a tokenizer, its lines (longer than 40
    characters) tokenised and padded to `seq` (real padding); else windows of its bytes as ids, where
    `padded` has every other row of the last batch keep only its first 3/8 to 7/8 (an embedding
    service's batches mix lengths)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    if tokenizer is not None:
        lines = [line for line in path.read_text().splitlines() if len(line) > 40]
        for _ in range(count):
            chosen = torch.randint(0, len(lines), (batch,), device="cuda", generator=g).tolist()
            encoded = tokenizer([lines[j] for j in chosen], padding="max_length", truncation=True, max_length=seq,
                                return_tensors="pt")
            out.append((encoded["input_ids"].cuda(), encoded["attention_mask"].cuda()))
        return out
    data = text_bytes(path)
    for j in range(count):
        ids = data[torch.randint(0, data.numel() - seq, (batch,), device="cuda", generator=g)[:, None]
                   + torch.arange(seq, device="cuda")]
        mask = torch.ones_like(ids)
        if padded and j == count - 1:
            for row in range(1, batch, 2):
                mask[row, seq * (3 + row % 5) // 8:] = 0
        out.append((ids, mask))
    return out


def encoder_fp8_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """BERT-base (random weights) at 8 × 512, each engine of --encoder-fp8-variants (fp8 engines: e4m3
    products, scales and sensitivity measured on windows of data/calibration.txt) against the bf16 bound of
    this run and eager fp32 and bf16 on windows of data/eval.txt (held out, one batch partly padded)."""
    config = QUICK_BERT if args.quick else BERT_BASE
    model_dir = work / "bert-fp8"
    make_model("encoder", config, model_dir)
    encoder_precisions(args, work, model_dir, "encoder_fp8", [(8, 512)], None, ceilings, report)


def encoder_real_section(args: argparse.Namespace, work: Path, ceilings: dict[str, Any], report: Report) -> None:
    """A trained encoder (--real-encoder: an HF BERT-family checkpoint with its tokenizer, e.g.
    all-MiniLM-L6-v2) at --real-encoder-shapes, on lines of the shipped texts as its tokenizer pads them:
    what fp8 does to real weights and real text, which random weights cannot say."""
    from transformers import AutoTokenizer

    if not args.real_encoder:
        raise ValueError("section encoder_real needs --real-encoder DIR")
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.real_encoder_shapes.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.real_encoder)
    encoder_precisions(args, work, Path(args.real_encoder), "encoder_real", shapes, tokenizer, ceilings, report)


def encoder_precisions(args: argparse.Namespace, work: Path, model_dir: Path, key: str, shapes: list[tuple[int, int]],
                       tokenizer: Any, ceilings: dict[str, Any], report: Report) -> None:
    """Each engine of --encoder-fp8-variants (`bf16`, or fp8_scaling[:fp8_bf16_share]) of the encoder in
    `model_dir`, built for `shapes`, at each shape: median, ratio to this run's bf16 bound, cosine vs eager
    fp32 over the real tokens of held-out text, and the kernel profile."""
    from transformers import AutoConfig

    from tasks.backends.inductor import backend as inductor_backend

    defaults = inductor_backend.ENCODER_GELU_EPILOGUE, inductor_backend.ENCODER_FP8_ATTENTION_OUT
    cfg = AutoConfig.from_pretrained(model_dir)
    tflops = ceilings["gemm_bf16"]["tflops"]
    section: dict[str, Any] = {"model": model_dir.name, "config": {k: getattr(cfg, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}, "shapes": {}}
    checks, reference, bounds = {}, {}, {}
    for batch, seq in shapes:
        name = f"{batch}x{seq}"
        flops = gm.encoder_flops(cfg, batch, seq)
        bounds[name] = gm.bound_ms(flops, tflops)
        checks[name] = encoder_text(EVAL_TEXT, batch, seq, args.encoder_check_batches, 7, tokenizer, padded=True)
        section["shapes"][name] = {
            "bounds": {"tflop": round(flops / 1e12, 4), "bf16_ms": round(bounds[name], 4)},
            "products_alone": encoder_fp8_products(cfg, batch * seq, tflops, args.repeats),
            "check": {"text": EVAL_TEXT.name, "batches": len(checks[name]),
                      "real_tokens": int(sum(int(m.sum()) for _, m in checks[name]))}}
    report.add(key, section)
    for who, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
        model = eager("encoder", model_dir, dtype)
        with torch.no_grad():
            for name, batches in checks.items():
                reference.setdefault(name, {})[who] = [
                    model(input_ids=i, attention_mask=m).last_hidden_state[m.bool()].float() for i, m in batches]
        del model
    for name in checks:
        section["shapes"][name]["eager_bf16_vs_fp32"] = hidden_agreement(reference[name]["eager_fp32"],
                                                                         reference[name]["eager_bf16"])
    batch, seq = max(shapes)
    calibration = encoder_text(TRAIN_TEXT, batch, seq, args.calibration_batches, 17, tokenizer)
    section["calibration"] = {"text": TRAIN_TEXT.name, "batches": len(calibration), "shape": [batch, seq],
                              "real_tokens": int(sum(int(m.sum()) for _, m in calibration))}
    feeds = [{"input_ids": i.cpu().numpy(), "attention_mask": m.cpu().numpy()} for i, m in calibration]
    backend = InductorBackend()
    for variant in args.encoder_fp8_variants.split(","):
        recipe, *flags = variant.split("+")
        precision = "bf16" if recipe == "bf16" else "fp8"
        scaling, _, share = recipe.partition(":")
        # flags, to measure what the engine's defaults buy: erf (GELU's erf form, no cuBLASLt epilogue),
        # sepq (a separate pass quantises the static o product's input); bf16mlp: fp8_exclude keeps the up and
        # down products in bf16 (GELU in the up product's epilogue, no quantising pass over its output)
        inductor_backend.ENCODER_GELU_EPILOGUE = "erf" not in flags
        inductor_backend.ENCODER_FP8_ATTENTION_OUT = "sepq" not in flags
        target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch,
                  "format": "compiled", "compile_mode": args.compile_mode}
        if precision == "fp8":
            target.update({"fp8_scaling": scaling, "fp8_bf16_share": float(share or 0),
                           "fp8_exclude": ["layers.*.up", "layers.*.down"] if "bf16mlp" in flags else []})
        figures: dict[str, Any] = {"target": target}
        section[variant] = figures
        try:
            engine_dir = work / f"engine-{key}-{len(section)}"
            engine_dir.mkdir()
            started = time.perf_counter()
            figures["engine_build"] = backend.build_from_model(
                model_dir, "feature-extraction", precision, InductorTarget(**target),
                [ProfileSpec(batch=[1, b, b], seq=[1, s, s]) for b, s in shapes], engine_dir,
                calibration=feeds if InductorTarget(**target).calibrates(precision) else None)
            figures["engine_build"]["cold_build_s"] = round(time.perf_counter() - started, 3)
            sidecar = json.loads((engine_dir / "engine.json").read_text())
            figures["kept_bf16"] = sidecar["fp8_kept_bf16"]
            figures["sensitivity"] = sidecar["fp8_sensitivity"]
            runner = backend.load(engine_dir, InductorTarget(**target))
            for name, batches in checks.items():
                with torch.no_grad():
                    got = [runner.prefill(i, m)[m.bool()].float() for i, m in batches]
                ids, mask = batches[0]
                timing = timed(lambda: runner.prefill(ids, mask), 3, args.repeats)
                median = timing["median_ms"]
                figures[name] = {"vs_fp32": hidden_agreement(reference[name]["eager_fp32"], got), "engine": {
                    **timing, "ms_over_bf16_bound": round(median / bounds[name], 3),
                    "fraction_of_bf16_gemm_bound": round(bounds[name] / median, 3),
                    "sequences_per_s": round(ids.shape[0] / median * 1e3, 1)},
                    "kernels": gm.kernel_profile(lambda: runner.prefill(ids, mask), top=20),
                    "path": ("precompiled, replayed from the runner's CUDA graph"
                             if runner._prefill_graphs else "torch.compile")}
                report.add(key, section)
            del runner
        except Exception as e:  # the other variants still run
            import traceback

            traceback.print_exc()
            figures["error"] = f"{type(e).__name__}: {e}"[:2000]
        report.add(key, section)
        torch.compiler.reset()
        torch.cuda.empty_cache()
    inductor_backend.ENCODER_GELU_EPILOGUE, inductor_backend.ENCODER_FP8_ATTENTION_OUT = defaults


def hidden_agreement(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict[str, Any]:
    """Cosine of each real token's hidden state against the reference's, and the relative error over all."""
    ref, got = torch.cat(reference), torch.cat(candidate)
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {"tokens": ref.shape[0], "cosine_mean": round(float(cosine.mean()), 6),
            "cosine_min": round(float(cosine.min()), 6),
            "relative_error": round(float((got - ref).norm() / ref.norm()), 5)}


def unprofiled(warm: dict[str, Any] | None) -> dict[str, Any] | None:
    return warm and {k: v for k, v in warm.items() if k not in ("under_cprofile", "profile")}


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
        print(f"  accuracy: engine vs fp32 {json.dumps(dec['engine']['vs_fp32'])}; decode step vs fp32 "
              f"{json.dumps(dec['engine'].get('decode_vs_fp32'))}; eager bf16 vs fp32 "
              f"{json.dumps(dec['eager']['eager_bf16']['vs_fp32'])}; training {json.dumps(dec.get('training'))}")
        build = ("export_seconds", "calibration_seconds", "compile_seconds", "cold_build_s", "cache_bytes",
                 "engine_bytes")
        print(f"  build {json.dumps({k: dec['engine_build'].get(k) for k in build})}")
        print(f"  warm start {json.dumps(unprofiled(dec.get('warm_start')))}")
    fp8 = data.get("decoder_fp8", {})
    if "prefill" in fp8:
        print(f"decoder fp8 prefill {fp8['prefill']['median_ms']} ms = {fp8['prefill_ms_over_bf16_bound']} x the bf16 "
              f"bound ({fp8['prefill_bf16_bound_ms']} ms), vs fp32 {json.dumps(fp8['vs_fp32'])}, "
              f"build {fp8['engine_build'].get('cold_build_s')} s; products {json.dumps(fp8['products'])}")
        sensitivity = {k: v for k, v in (fp8.get("sensitivity") or {}).items() if k != "logit_mse"}
        print(f"  kept bf16 {fp8.get('kept_bf16')}; sensitivity {json.dumps(sensitivity)}; "
              f"warm start {json.dumps(unprofiled(fp8.get('warm_start')))}")
    step = data.get("decode_step", {})
    for variant, figures in step.items():
        if isinstance(figures, dict) and "weight_bytes" in figures and "decode_b64" in figures:
            print(f"decode step {variant:<18} " + "  ".join(
                f"b{b} {figures[f'decode_b{b}']['median_ms']} ms ({figures[f'decode_b{b}']['times_own_bytes_bound']}x own "
                f"bound, {figures[f'decode_b{b}']['times_bf16_bound']}x bf16 bound)" for b in (1, 64))
                  + "  top-1 vs fp32 " + "  ".join(f"b{b} {figures[f'decode_b{b}_vs_fp32']['top1']} "
                                                  f"{figures[f'decode_b{b}_vs_fp32']['top1_95']}" for b in (8, 64)))
    enc = data.get("encoder", {})
    minilm = data.get("encoder_minilm", {})
    for label, figures in [("bert 8x512", enc), *((f"minilm {k}", v) for k, v in minilm.items() if k[0].isdigit())]:
        if "engine_bf16" in figures:
            for who in ("engine_bf16", "eager_bf16", "eager_fp32"):
                print(f"encoder {label} {who:<12} " + json.dumps({k: v for k, v in figures[who].items()
                                                                   if k not in ("n", "min_ms")}))
    for key in ("encoder_fp8", "encoder_real"):
        for variant, figures in data.get(key, {}).items():
            for shape, at in figures.items() if isinstance(figures, dict) else ():
                if isinstance(at, dict) and "engine" in at:
                    engine = at["engine"]
                    print(f"{key} {variant:<14} {shape:<8} {engine['median_ms']} ms = {engine['ms_over_bf16_bound']} x "
                          f"the bf16 bound, vs fp32 {json.dumps(at['vs_fp32'])}, kept {len(figures['kept_bf16'])} bf16")
    for label, section in (("bert", enc), ("minilm", minilm)):
        if "engine_build" in section:
            print(f"encoder {label} build " + json.dumps({k: section["engine_build"].get(k) for k in (
                "compile_seconds", "cold_build_s", "prefill_graph", "prefill_cuda_graphs")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200.json"))
    parser.add_argument("--quick", action="store_true", help="2-layer models: check the script, not the GPU")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--check-batches", type=int, default=16, help="8-window batches of data/eval.txt for the top-1 check")
    parser.add_argument("--fp8-check-batches", type=int, help="section decoder_fp8's, if not --check-batches")
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                        help="the bf16 engines' (an encoder's forward is replayed with CUDA graphs in every mode: its "
                             "target's cuda_graphs)")
    parser.add_argument("--fp8-compile-mode", default="default",
                        help="the fp8 engine's: on the H200, autotuning one fp8 product shape took 154 s (its best "
                             "qkv kernel 0.066 ms, cuBLAS's 0.080 ms), too long for a 10-minute run")
    parser.add_argument("--fp8-exclude", default="", help="the fp8 engine's products kept in bf16: globs over "
                                                          "layers.<i>.qkv|o|gate_up|down, separated by |")
    parser.add_argument("--fp8-scaling", choices=["per-token", "static"], default="per-token",
                        help="the fp8 engine's activation scales (target setting fp8_scaling)")
    parser.add_argument("--fp8-bf16-share", type=float, default=0.0,
                        help="the fp8 engine's share of product arithmetic kept bf16 by measured sensitivity "
                             "(target setting fp8_bf16_share)")
    parser.add_argument("--fp8-recipe-shares", default="0.0625,0.125,0.1875,0.25",
                        help="section decoder_fp8 with --fp8-bf16-share: eager top-1 of the products each of these "
                             "shares would keep bf16, on the engine's own model (empty: none)")
    parser.add_argument("--calibration-batches", type=int, default=16,
                        help="8-window batches of data/calibration.txt the fp8 engine calibrates on (static scales, "
                             "sensitivity)")
    parser.add_argument("--encoder-fp8-variants", default="bf16,static,static+bf16mlp",
                        help="sections encoder_fp8, encoder_real: each engine, bf16 or fp8_scaling[:fp8_bf16_share] of "
                             "an fp8 one, each with any of +erf (GELU's erf form, not in cuBLASLt's epilogue), +sepq "
                             "(the o product's input quantised in its own pass) and +bf16mlp (the up and down products "
                             "kept bf16), comma-separated")
    parser.add_argument("--encoder-check-batches", type=int, default=4,
                        help="sections encoder_fp8, encoder_real: batches of data/eval.txt the engines are checked on")
    parser.add_argument("--real-encoder", help="section encoder_real: an HF BERT-family checkpoint with its tokenizer")
    parser.add_argument("--real-encoder-shapes", default="32x128,256x128",
                        help="section encoder_real: batch x seq shapes, comma-separated")
    parser.add_argument("--train-steps", type=int, default=300, help="decoder training on data/calibration.txt")
    parser.add_argument("--sections", default="decoder,encoder")
    parser.add_argument("--tune-gemv", action=argparse.BooleanOptionalAction, default=True,
                        help="section decode_step: measure each product alone first and run the step variants with "
                             "the fastest weight-streaming block shapes")
    parser.add_argument("--decode-products", action=argparse.BooleanOptionalAction, default=True,
                        help="section decode_step: time each product alone (with --no-decode-products, only the step "
                             "variants run, with the committed block shapes)")
    parser.add_argument("--decode-variants", default="torch:bf16,smelter:bf16,smelter:fp8,smelter:fp8-head",
                        help="section decode_step: products:weights, comma-separated (products torch or smelter; "
                             "weights bf16, fp8 (layers in e4m3) or fp8-head (the LM head too))")
    parser.add_argument("--variants", default="bf16:max-autotune-no-cudagraphs,bf16:max-autotune,fp8:default,"
                                              "fp8:reduce-overhead",
                        help="section prefill: precision:compile-mode[:glob|glob kept bf16[:inductor.option=int&...]], "
                             "comma-separated; precision fp8-static: fp8 with static scales")
    parser.add_argument("--fp8-recipes", action=argparse.BooleanOptionalAction, default=True,
                        help="section prefill: top-1 of each choice of products kept bf16 in fp8 (eager)")
    parser.add_argument("--append", action="store_true",
                        help="add these sections to an existing --out (each run's command, date and ceilings kept; "
                             "each section bounded by the ceilings of the run that measured it)")
    parser.add_argument("--warm-start", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--profile-warm-start", action="store_true", help="where a warm start's time goes (cProfile)")
    args = parser.parse_args()
    if args.warm_start:
        run_warm_start(args.warm_start, args.target, args.shape, args.profile_warm_start)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_pipeline needs a CUDA GPU; this torch sees none")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    gpu = detect_gpu()
    run = {"command": " ".join(["python -m benchmarks.gpu_pipeline",
                                *(Path(a).name if os.path.isabs(a) else a for a in sys.argv[1:])]),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "sections": args.sections, "ceilings": {"gemm_bf16": gm.gemm_ceiling(), "copy": gm.copy_bandwidth()}}
    previous = json.loads(args.out.read_text()) if args.append and args.out.is_file() else {}
    report = Report(args.out, {**previous, "gpu": gpu.facts() if gpu else None, "versions": versions(),
                               "timing": "inputs and outputs device-resident on both sides; CUDA events per call; "
                                         "median with p10/p90 over repeats after warm-up"})
    report.add("runs", [*previous.get("runs", []), run])
    report.add("ceilings", run["ceilings"])  # the latest run's: each section is bounded by its own run's (runs[])
    with tempfile.TemporaryDirectory(prefix="gpu-pipeline-") as tmp:
        for name in args.sections.split(","):
            started = time.perf_counter()
            try:
                {"decoder": decoder_section, "decoder_fp8": decoder_fp8_section, "encoder": encoder_section,
                 "encoder_fp8": encoder_fp8_section, "encoder_real": encoder_real_section,
                 "decode_step": decode_step_section, "prefill": prefill_section}[name](
                    args, Path(tmp), run["ceilings"], report)
            except Exception as e:  # keep what the other section measured; say what failed
                import traceback
                traceback.print_exc()
                report.add(f"{name}_error", f"{type(e).__name__}: {e}"[:2000])
            report.add(f"{name}_seconds", round(time.perf_counter() - started, 1))
            torch.cuda.empty_cache()
    print_table(report.data)


if __name__ == "__main__":
    main()
