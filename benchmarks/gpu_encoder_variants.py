"""Encoder graphs on a real GPU, each way the inductor backend could build them, with a kernel profile of each.

For checking a change to the encoder path in minutes instead of a full engine build: the graph is
exported as the engine exports it (tasks/backends/inductor.export_prefill) and compiled at one
shape (as a precompiled engine graph is), then timed with CUDA events, profiled per kernel, and
compared with eager fp32 of the same weights (cosine of each token's hidden state). SDPA's fused
attention kernels are also timed alone at each shape, with and without a key-padding bias.

Variants (--variants, comma-separated graph:options): graph `hf` (the HF forward), `pad` (smelter's
encoder graph with its key-padding bias), `nopad` (the same graph without a mask), each with any of
the suffixes `-lt` (GELU in cuBLASLt's epilogue of the up product), `-ta` (smelter's Triton
attention, tasks/backends/inductor/encoder_ops.py, instead of SDPA) and `-cb` (the qkv and down
products pinned to cuBLAS, out of max-autotune's reach); options a subset of
`autotune` (max_autotune) and `cg` (CUDA graphs), joined by '+', or `none`.

`--own-kernels` first times smelter's attention kernel alone at each shape, over its block shapes
(`--attention-configs`), against SDPA with the key bias and with no mask, each call replayed from a
CUDA graph of 20; the variants after run with the fastest block shape found.

Usage: python -m benchmarks.gpu_encoder_variants --out enc.json [--models bert,minilm] [--repeats 30]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_pipeline import BERT_BASE, Report
from tasks.backends.inductor.backend import versions
from tasks.measure import gpu_measure as gm
from tasks.runtime.gpu import detect_gpu

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)
MODELS = {"bert": (BERT_BASE, [(8, 512)]), "minilm": (MINILM, [(32, 128), (256, 128)])}


def attention_alone(heads: int, head_dim: int, batch: int, seq: int, repeats: int) -> dict[str, Any]:
    """SDPA at one layer's shape through each fused backend: no mask, a [B,1,1,S] key bias, HF's [B,1,S,S] mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(batch, seq, device="cuda")
    mask[:, seq * 3 // 4:] = 0
    key_bias = ((1 - mask.bfloat16()) * torch.finfo(torch.bfloat16).min)[:, None, None, :]
    square = mask.bool()[:, None, None, :].expand(batch, 1, seq, seq)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks = {"none": None, "key_bias": key_bias, "square_bool": square}
    flop = 4 * batch * heads * seq * seq * head_dim
    out: dict[str, Any] = {"shape": [batch, heads, seq, head_dim], "gflop": round(flop / 1e9, 2)}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", None):
        for name, m in masks.items():
            key = f"{(backend or 'default').lower()}_{name}"
            try:
                ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else torch.no_grad()
                with ctx:
                    ms = gm.summary(gm.cuda_times_ms(lambda: sdpa(q, k, v, attn_mask=m), 3, repeats))["median_ms"]
                out[key] = {"ms": ms, "tflops": round(flop / ms / 1e9, 1)}
            except Exception as e:  # a backend that refuses this call says so
                out[key] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def graphed_ms(fn: Any, calls: int = 20, repeats: int = 15) -> float:
    """Median device time of one call of `fn`, `calls` of them recorded in one CUDA graph (no launch gaps)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = gm.cuda_times_ms(graph.replay, 2, repeats)
    return round(gm.summary(times)["median_ms"] / calls, 4)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round(float((out.float() - ref.float()).norm() / ref.float().norm()), 6)


def parse_configs(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def own_attention_alone(cfg: Any, batch: int, seq: int, attention_configs: list[tuple[int, ...]]) -> dict[str, Any]:
    """smelter's attention kernel alone at one shape, each block shape, against SDPA; `best` is the fastest."""
    from tasks.backends.inductor import encoder_ops as ea

    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    qkv = torch.randn(batch, seq, 3 * hidden, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(batch, seq, device="cuda")
    mask[: batch // 2, seq * 3 // 4:] = 0
    key_bias = (1 - mask.bfloat16()) * torch.finfo(torch.bfloat16).min
    ref = ea.reference(qkv.float(), key_bias.float(), heads)
    att: dict[str, Any] = {"sdpa_key_bias_ms": graphed_ms(lambda: ea.reference(qkv, key_bias, heads)),
                           "sdpa_no_mask_ms": graphed_ms(lambda: ea.reference(qkv, None, heads))}
    best = None
    for c in attention_configs:
        name = "x".join(map(str, c))
        try:
            err = relative_error(ea.attention(qkv, key_bias, heads, c), ref)
            ms = graphed_ms(lambda: ea.attention(qkv, key_bias, heads, c))
            att[name] = {"ms": ms, "rel_error": err,
                         "no_mask_ms": graphed_ms(lambda: ea.attention(qkv, None, heads, c))}
            if err < 2e-2 and (best is None or ms < att["x".join(map(str, best))]["ms"]):
                best = c
        except Exception as e:  # a block shape this GPU cannot run says so
            att[name] = f"{type(e).__name__}: {str(e)[:200]}"
    att["best"] = best
    return att


def variant(model: torch.nn.Module, graph: str, opts: set[str], ids: torch.Tensor, mask: torch.Tensor,
            fp32: torch.Tensor, flops: float, bound: float, repeats: int) -> dict[str, Any]:
    from tasks.backends.inductor.encoder_graphs import EncoderPrefill
    from tasks.backends.inductor.backend import _exportable_masks

    started = time.perf_counter()
    auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    if graph == "hf":
        from tasks.backends.inductor.backend import PrefillGraph

        _exportable_masks(model)
        module, inputs, dyn = PrefillGraph(model, False), (ids, mask), (auto, auto)
    else:
        padding = graph.startswith("pad")
        flags = set(graph.split("-")[1:])
        module = EncoderPrefill(model, padding=padding, gelu_epilogue="lt" in flags,
                                own_attention="ta" in flags, cublas_products="cb" in flags).eval()
        inputs, dyn = ((ids, mask), (auto, auto)) if padding else ((ids,), (auto,))
    with torch.no_grad():
        program = torch.export.export(module, inputs, dynamic_shapes=dyn, strict=False)
    options = {"max_autotune": "autotune" in opts, "triton.cudagraphs": "cg" in opts}
    compiled = torch.compile(program.module(), options=options, dynamic=False)
    with torch.no_grad():
        run = lambda: compiled(*inputs)  # noqa: E731
        for _ in range(3):
            out = run()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
        cosine = torch.nn.functional.cosine_similarity(out.float(), fp32, dim=-1)
        figures = gm.summary(gm.cuda_times_ms(run, 5, repeats))
        kernels = gm.kernel_profile(run, top=16)
    return {**figures, "compile_s": round(compile_s, 1), "fraction_of_bf16_bound": round(bound / figures["median_ms"], 3),
            "achieved_tflops": round(flops / figures["median_ms"] / 1e9, 1),
            "cosine_vs_fp32_mean": round(float(cosine.mean()), 6), "cosine_vs_fp32_min": round(float(cosine.min()), 6),
            "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="bert,minilm")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--variants", default="hf:autotune,pad:autotune,pad:autotune+cg,nopad:autotune+cg")
    parser.add_argument("--minilm-variants", default="hf:autotune,pad:autotune+cg,nopad:autotune+cg")
    parser.add_argument("--own-kernels", action="store_true")
    parser.add_argument("--attention-configs", default="64x128x4x1,128x128x8x1,64x64x4x2,128x64x4x2,128x64x8x2,"
                                                       "64x32x4x2,128x32x8x3")
    parser.add_argument("--shapes", default="", help="only these batch x seq shapes (e.g. 256x128,8x512)")
    args = parser.parse_args()
    from transformers import BertConfig, BertModel

    ceilings = {"gemm_bf16": gm.gemm_ceiling(), "copy": gm.copy_bandwidth()}
    gpu = detect_gpu()
    report = Report(args.out, {"gpu": gpu.facts() if gpu else None, "versions": versions(),
                               "command": "python -m benchmarks.gpu_encoder_variants " + " ".join(
                                   a for a in __import__("sys").argv[1:] if not a.startswith("/")),
                               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               "ceilings": ceilings})
    print(f"ceilings {json.dumps({k: v.get('tflops', v.get('tb_per_s')) for k, v in ceilings.items()})}", flush=True)
    for name in args.models.split(","):
        config, shapes = MODELS[name]
        cfg = BertConfig(**config)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = BertModel(cfg).eval()
        reference = model  # fp32
        section: dict[str, Any] = {"config": config}
        for batch, seq in shapes:
            key = f"{batch}x{seq}"
            if args.shapes and key not in args.shapes.split(","):
                continue
            flops = gm.encoder_flops(cfg, batch, seq)
            bound = gm.bound_ms(flops, ceilings["gemm_bf16"]["tflops"])
            g = torch.Generator(device="cuda").manual_seed(3)
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda", generator=g)
            mask = torch.ones_like(ids)
            with torch.no_grad():
                fp32 = reference(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            bf16 = BertModel(cfg).cuda()
            bf16.load_state_dict(reference.state_dict())
            bf16 = bf16.to(torch.bfloat16).eval()
            shape: dict[str, Any] = {"tflop": round(flops / 1e12, 4), "bf16_bound_ms": round(bound, 4),
                                     "attention": attention_alone(cfg.num_attention_heads,
                                                                  cfg.hidden_size // cfg.num_attention_heads,
                                                                  batch, seq, args.repeats)}
            with torch.no_grad():
                shape["eager_bf16"] = gm.summary(gm.cuda_times_ms(
                    lambda: bf16(input_ids=ids, attention_mask=mask).last_hidden_state, 3, args.repeats))
            section[key] = shape
            if args.own_kernels:
                from tasks.backends.inductor import encoder_ops as ea

                with torch.no_grad():
                    shape["own_attention"] = own = own_attention_alone(cfg, batch, seq,
                                                                       parse_configs(args.attention_configs))
                if own["best"]:
                    ea.CONFIGS[cfg.hidden_size // cfg.num_attention_heads] = tuple(own["best"])
                shape["attention_configs_used"] = {str(k): v for k, v in ea.CONFIGS.items()}
                print(f"{name} {key} own attention: {json.dumps(own)}", flush=True)
            report.add(name, section)
            for v in (args.variants if name == "bert" else args.minilm_variants).split(","):
                graph, opts = v.split(":")
                try:
                    shape[v] = variant(bf16, graph, set(opts.split("+")), ids, mask, fp32, flops, bound, args.repeats)
                except Exception as e:  # the other variants still run
                    shape[v] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                report.add(name, section)
                print(f"{name} {key} {v}: " + json.dumps({k: x for k, x in shape[v].items() if k != "kernels"}),
                      flush=True)
                torch.compiler.reset()
                torch.cuda.empty_cache()
            print(f"{name} {key} attention: {json.dumps(shape['attention'])}", flush=True)
            del bf16
        del model, reference
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
