"""How GPU engines are timed, and what their times are compared with: shared by every GPU backend.

Both sides of a comparison are timed alike: inputs already on the device, outputs left there, one
CUDA event pair around each call on the current stream (no host copies and no host clock in the
timed region). The hardware ceilings, the bf16 matrix-product rate and the device-to-device copy
bandwidth, are measured in the same run on random data, never taken from a datasheet, so a
fraction of the bound says how far an engine is from what this GPU does today.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tasks.measure.stats import wilson_interval


def summary(samples: Sequence[float] | torch.Tensor) -> dict[str, float]:
    """Median and spread (p10, p90, min) of latency samples in ms; works on CPU lists and tensors."""
    values = torch.as_tensor(samples, dtype=torch.float64).flatten().cpu()
    if values.numel() == 0:
        raise ValueError("no samples to summarise")
    q = torch.quantile(values, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {"median_ms": round(float(q[1]), 4), "p10_ms": round(float(q[0]), 4), "p90_ms": round(float(q[2]), 4),
            "min_ms": round(float(values.min()), 4), "n": int(values.numel())}


def cuda_times_ms(fn: Callable[[], Any], warmup: int = 5, repeats: int = 30) -> list[float]:
    """Per-call latencies from CUDA events on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def peak_memory_bytes(fn: Callable[[], Any]) -> int:
    """Peak device memory allocated while `fn` runs once (weights and caches already resident count)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def gemm_ceiling(n: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 20) -> dict[str, Any]:
    """The matrix-product rate of this GPU today: an n×n×n product on random data through cuBLAS."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    stats = summary(cuda_times_ms(lambda: torch.mm(a, b), warmup=5, repeats=repeats))
    flops = 2 * n**3
    return {"shape": [n, n, n], "dtype": str(dtype).removeprefix("torch."), **stats,
            "tflops": round(flops / stats["median_ms"] / 1e9, 1),
            "tflops_p10_p90": [round(flops / stats["p90_ms"] / 1e9, 1), round(flops / stats["p10_ms"] / 1e9, 1)]}


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> dict[str, Any]:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    stats = summary(cuda_times_ms(lambda: dst.copy_(src), warmup=3, repeats=repeats))
    moved = 2 * nbytes
    return {"bytes": nbytes, **stats, "tb_per_s": round(moved / stats["median_ms"] / 1e9, 3),
            "tb_per_s_p10_p90": [round(moved / stats["p90_ms"] / 1e9, 3), round(moved / stats["p10_ms"] / 1e9, 3)]}


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-family decoder that its arithmetic and memory traffic depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        heads = config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads,
                   config.intermediate_size, config.vocab_size)

    @property
    def layer_params(self) -> int:
        """Matrix weights of one layer (norms are too small to count)."""
        attention = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return attention + 3 * self.hidden * self.intermediate

    @property
    def matrix_params(self) -> int:
        """Every weight a forward multiplies by, the LM head included (tied or not, it is read)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def prefill_flops(self, batch: int, seq: int, last_token_logits: bool = True) -> float:
        """Multiply-adds ×2 of a causal prefill; attention counted for the full square, as kernels compute it."""
        tokens = batch * seq
        linear = 2 * tokens * self.layers * self.layer_params
        attention = 4 * batch * seq * seq * self.heads * self.head_dim * self.layers
        head = 2 * (batch if last_token_logits else tokens) * self.vocab * self.hidden
        return float(linear + attention + head)

    def decode_bytes(self, batch: int, past: int, bytes_per_weight: float, bytes_per_cache: float = 2) -> float:
        """Fewest bytes one decode step must read: every weight once and the KV cache actually used."""
        kv = 2 * self.layers * batch * self.kv_heads * self.head_dim * past * bytes_per_cache
        return self.matrix_params * bytes_per_weight + kv


def encoder_flops(config: Any, batch: int, seq: int) -> float:
    """Multiply-adds ×2 of a BERT-family encoder forward (embedding lookups are not arithmetic)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = batch * seq
    return float(layers * (2 * tokens * (4 * h * h + 2 * h * i) + 4 * batch * seq * seq * h))


def bound_ms(flops: float, tflops: float) -> float:
    """Arithmetic floor in ms at `tflops`."""
    return flops / (tflops * 1e9)


def bytes_bound_ms(nbytes: float, tb_per_s: float) -> float:
    """Memory floor in ms at `tb_per_s` (bytes read once)."""
    return nbytes / (tb_per_s * 1e9)


def kernel_profile(fn: Callable[[], Any], calls: int = 5, top: int = 12) -> list[dict[str, Any]]:
    """Where the device time of `fn` goes: its `top` kernels by device time per call (torch.profiler),
    each with its share of the total. Says which kernels an engine is short of its bound in."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in kernels) or 1.0
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"kernel": e.key[:120], "ms_per_call": round(e.device_time_total / calls / 1e3, 4),
             "launches_per_call": round(e.count / calls, 1), "share": round(e.device_time_total / total, 3)}
            for e in kernels[:top]] + [{"kernel": "(all kernels)", "ms_per_call": round(total / calls / 1e3, 4)}]


def logit_agreement(reference: Sequence[torch.Tensor], candidate: Sequence[torch.Tensor]) -> dict[str, Any]:
    """How closely candidate next-token logits follow the reference's ([positions, vocab] each).

    Top-1 agreement alone misleads on random weights, whose best two logits are near-ties: the
    reference's own top-1 margin, in the same units as the candidate's error, says how many
    positions any precision could flip. Relative error is over all logits of all positions."""
    ref = torch.cat([r.float().reshape(-1, r.shape[-1]) for r in reference])
    got = torch.cat([c.float().reshape(-1, c.shape[-1]) for c in candidate])
    if ref.shape != got.shape:
        raise ValueError(f"reference logits {tuple(ref.shape)} and candidate logits {tuple(got.shape)} differ in shape")
    best2 = ref.topk(2, dim=-1).values
    margin = best2[:, 0] - best2[:, 1]
    error = (got - ref).abs()
    hits = int((ref.argmax(-1) == got.argmax(-1)).sum())
    return {"positions": ref.shape[0],
            "top1": round(hits / ref.shape[0], 4),
            "top1_95": [round(bound, 4) for bound in wilson_interval(hits, ref.shape[0])],
            "relative_error": round(float(error.norm() / ref.norm().clamp(min=1e-30)), 5),
            "reference_margin_median": round(float(margin.quantile(0.5)), 4),
            "reference_logit_std": round(float(ref.std()), 4),
            "error_median": round(float(error.median()), 5),
            "error_p99": round(float(error.flatten().kthvalue(max(1, math.ceil(0.99 * error.numel()))).values), 5)}
