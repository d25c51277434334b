"""The decode step's products: `smelter::decode_linear`, one op for bf16 or e4m3 weights.

A decode step reads every weight once for a handful of rows, so its products are bound by the bytes
of the weights, not by arithmetic. This op reads the weights as they are stored:
- bf16 weights (`scale` None): y = x @ wᵀ;
- e4m3 weights with one fp32 scale per output channel (`scale` [N]): y = (x @ wᵀ) * scale, half the
  bytes of bf16 (`quantize_weight` makes them).

On a CUDA GPU, for up to `GEMV_ROWS` rows (decode at small batch), a Triton kernel of its own
streams the weight matrix once, converts each element to fp32 in registers and accumulates
against the bf16 activations (weight-only quantisation: the activations are not rounded). For
more rows, bf16 weights go to cuBLAS (`F.linear`); e4m3 weights to cuBLAS's fp8 product
(`torch._scaled_mm`, row-wise scales) after a Triton kernel quantises each activation row to e4m3
with its own scale, in one pass. Elsewhere (CPU, or no Triton) the op computes the same function
with torch operations, so an exported decode step runs anywhere.

The op is opaque to Inductor (an extern call inside the compiled step), and its kernels are
captured by CUDA-graph replay like any other.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_ROWS = 8  # rows up to which the weight-streaming kernel runs; above, cuBLAS

try:  # Triton ships with CUDA builds of torch; a CPU-only install computes with torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights [N, K] and their fp32 scales [N], one per output channel (its largest magnitude
    maps to 448)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What the op computes, with torch operations (fp32 accumulation for e4m3 weights)."""
    if scale is None:
        return F.linear(x, weight.to(x.dtype))
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)


# (N, K, weight bytes per element) -> (BLOCK_N, BLOCK_K, num_warps) for the Llama-3.2-1B decoder's
# product shapes: the block shapes the H200 figures of 2026-12-04 09:21 ran with (benchmarks/gpu_pipeline.py,
# section decode_step, `gemv_configs`). They were picked by timing each product alone, call by call;
# for all but the LM head those calls were bound by the host's launch (55-70 us against a few us of
# reading), so the choice among them is not yet measured: other shapes use gemv_config's rule.
GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (3072, 2048, 1): (4, 512, 4), (3072, 2048, 2): (8, 512, 4),
    (2048, 2048, 1): (32, 512, 8), (2048, 2048, 2): (2, 1024, 4),
    (16384, 2048, 1): (32, 512, 8), (16384, 2048, 2): (16, 512, 8),
    (2048, 8192, 1): (8, 1024, 8), (2048, 8192, 2): (8, 1024, 8),
    (128256, 2048, 1): (32, 256, 4), (128256, 2048, 2): (16, 256, 4)}


def gemv_config(n: int, k: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the weight-streaming kernel: the measured one for this shape,
    else 16 bytes per thread per load along K and enough programs (BLOCK_N rows each) to keep every
    multiprocessor's loads in flight."""
    if (n, k, itemsize) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k, itemsize)]
    block_k = min(triton.next_power_of_2(k), 512 if itemsize >= 2 else 1024)
    block_n = 1
    while block_n < 32 and -(-n // (block_n * 2)) >= 512 and block_n * 2 * block_k <= 16384:
        block_n *= 2
    return block_n, block_k, 4


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """y[m, n-block] = x[m] · w[n-block]ᵀ (× scale): one program per (BLOCK_N rows of w, row m of x)."""
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        x_row = x_ptr + m * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for i in range(0, tl.cdiv(K, BLOCK_K)):
            kk = i * BLOCK_K + rk
            if EVEN_K:
                x = tl.load(x_row + kk)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            else:
                x = tl.load(x_row + kk, mask=kk < K, other=0.0)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y = y * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
        """Row m of x to e4m3 with its own scale (largest magnitude -> 448), in one pass."""
        m = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + m * K + rk, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rk < K)
        tl.store(s_ptr + m, scale)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The weight-streaming kernel (CUDA, Triton): y [M, N] for x [M, K] (any M; meant for few rows)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps = config or gemv_config(n, k, weight.element_size())
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        x, weight, scale if scale is not None else weight, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_SCALE=scale is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps)
    return y


def fp8_rows_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Many rows against e4m3 weights: each row quantised to e4m3 with its own scale (one Triton
    pass), then cuBLAS's fp8 product with row-wise scales, into x's dtype."""
    m, k = x.shape
    x = x.contiguous()
    quantised = torch.empty(m, k, dtype=FP8, device=x.device)
    row_scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](x, quantised, row_scale, k, x.stride(0), BLOCK_K=block_k,
                                num_warps=8 if block_k >= 4096 else 4)
    return torch._scaled_mm(quantised, weight.t(), scale_a=row_scale, scale_b=scale.view(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


def _fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dim() == 2 and weight.is_contiguous()


@torch.library.custom_op("smelter::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ (× scale [N] for e4m3 weights) -> [M, N] in x's dtype."""
    if not _fast_path(x, weight):
        return reference(x, weight, scale)
    if x.shape[0] <= GEMV_ROWS:
        return gemv(x, weight, scale)
    if scale is None:
        return F.linear(x, weight)
    return fp8_rows_product(x, weight, scale)


@decode_linear.register_fake
def _decode_linear_shape(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
