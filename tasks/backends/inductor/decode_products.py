"""The decode step's own ops: `smelter::decode_linear` (products, bf16 or e4m3 weights) and
`smelter::decode_attention` (one new token's attention over the KV cache).

A decode step reads every weight once for a handful of rows, so its products are bound by the bytes
of the weights, not by arithmetic. `decode_linear` reads the weights as they are stored:
- bf16 weights (`scale` None): y = x @ wᵀ;
- e4m3 weights with one fp32 scale per output channel (`scale` [N]): y = (x @ wᵀ) * scale, half the
  bytes of bf16 (`quantize_weight` makes them);
- the product's input is x, silu(gate) * up of x = [gate, up] (`gated`: the MLP's down product), or
  rms_norm(x) (`norm` weights: the products after a norm), and `residual` is added to its output, so
  the step's norms, MLP pointwise step and residual adds travel with the products.

On a CUDA GPU, per weight width (bf16 or e4m3), Triton kernels of smelter's own stream the weight
matrix once, converting e4m3 weights in registers (weight-only quantisation: the activations are not
rounded): up to `GEMV_ROWS` rows `_gemv_kernel` on the CUDA cores (one row: decode at batch 1),
which computes the input (norm or gate) and adds the residual itself, so at batch 1 those steps
cost no kernels of their own; up to `ROWS_KERNEL_ROWS` rows `_rows_kernel` on the tensor cores (the
rows padded to 16, each program BLOCK_N output channels over all of K, so each weight is read once
for all rows), after one kernel for the norm or gate. Which kernel runs where, and their block
shapes, are what the H200 measured fastest (benchmarks/gpu_pipeline.py, section decode_step). For
more rows, bf16 weights go to cuBLAS (`F.linear`, `addmm` with a residual). e4m3 weights go, after
one kernel that computes the input and quantises each of its rows to e4m3 with its own scale, to
`_rows_kernel` on the fp8 tensor cores up to `FP8_ROWS_KERNEL_ROWS` rows (two kernels per product,
as for bf16: cuBLAS's fp8 product after a norm or gate kernel and a quantisation kernel made the
H200's fp8 step at 64 rows slower than its bf16 one), and to cuBLAS's fp8 product
(`torch._scaled_mm`, row-wise scales) above. Elsewhere (CPU, or no Triton) the ops compute the same
function with torch operations, so an exported decode step runs anywhere.

`decode_attention` (Triton on a CUDA GPU) applies the rotary embedding to q, then each program reads
one KV head's cache once for the query heads that share it (flash-decoding: an online softmax over
blocks of positions up to `pos`, never past it); at small batch the positions are split over several
programs, so that enough of them stream, and a second kernel combines their partial softmaxes.

On Hopper and later every one of these kernels is launched with programmatic dependent launch
(`PDL`): it starts while the kernel before it drains, and the weight-streaming kernels request
their first block of weights (which nothing in a step writes) before they wait for that kernel
(`gdc_wait`), so a replayed step loses little to launch gaps and ramps between its ~130 small
kernels. At one row, e4m3 weights are widened to fp32 with integer operations on 32-bit words of
four weights (`GEMV_WORDS`), not by the conversion instructions: 0-13% faster per product on the
H200, and still bound by that widening, not by bytes (about 1.5 TB/s of e4m3 for the LM head).

The ops are opaque to Inductor (extern calls inside the compiled step), and their kernels are
captured by CUDA-graph replay like any other.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Per weight width (bytes per element): rows up to which the CUDA-core weight-streaming kernel runs,
# and up to which the tensor-core one does; above, cuBLAS.
GEMV_ROWS = {2: 1, 1: 1}
ROWS_KERNEL_ROWS = {2: 64, 1: 16}
# e4m3 weights: rows up to which, above ROWS_KERNEL_ROWS, the activations rounded to e4m3 (one scale
# per row) meet the weights on the fp8 tensor cores in `_rows_kernel`; above, in cuBLAS's fp8 product.
FP8_ROWS_KERNEL_ROWS = 64
# e4m3 weights through the weight-streaming CUDA-core kernel as 32-bit words widened by integer
# operations (_gemv_kernel's W_WORDS), not through the conversion unit
GEMV_WORDS = True
ATTENTION_PROGRAMS = 256  # at least this many programs stream the KV cache (positions split to get there)
# (positions per step of the attention kernel's loop, num_stages, num_warps), as the H200 measured
# fastest: "split" where the positions are split over programs (few sequences), "whole" where each
# program reads a KV head's whole cache.
ATTENTION_CONFIGS = {"split": (64, 2, 4), "whole": (32, 3, 4)}
# Every Triton kernel below (and the jitted bodies `_gemv_words` and `_gemv_epilogue` that one inlines), by name:
# the build packs their compiled entries into the engine
# (tasks/backends/inductor/kernel_bundle.py), so a fresh process does not compile them on first launch.
KERNELS = ("_gemv_kernel", "_gemv_words", "_gemv_epilogue", "_rows_kernel", "_gate_kernel", "_rms_norm_kernel",
           "_quantize_input_kernel", "_attention_kernel", "_attention_combine_kernel")

try:  # Triton ships with CUDA builds of torch; a CPU-only install computes with torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _triton_has_pdl() -> bool:
    """Whether this Triton launches with programmatic dependent launch (`launch_pdl`) and has the
    grid-dependency instructions (`tl.extra.cuda.gdc_wait`)."""
    if triton is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):  # pragma: no cover - depends on the install
        return False


# Programmatic dependent launch (Hopper and later): each of the decode ops' kernels is launched so
# that it starts while the kernel before it drains, requests the weights it streams (which nothing
# in a step writes) at once, and waits for the kernel before (`gdc_wait`) only before it reads an
# activation or writes its output. In a replayed step that hides the launch gap and the ramp of
# each small product. SMELTER_DECODE_PDL=0 turns it off (to measure what it buys).
PDL = _triton_has_pdl() and os.environ.get("SMELTER_DECODE_PDL", "1") != "0"
_PDL_DEVICES: dict[int, bool] = {}


def pdl_on(t: torch.Tensor) -> bool:
    """Whether the kernels reading `t` (a CUDA tensor) launch with programmatic dependent launch."""
    if not PDL or not t.is_cuda:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


def _launch(t: torch.Tensor) -> dict[str, bool]:
    """The launch options and the USE_GDC constant of a kernel that reads `t`."""
    on = pdl_on(t)
    return {"USE_GDC": on, "launch_pdl": True} if on else {"USE_GDC": False}


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights [N, K] and their fp32 scales [N], one per output channel (its largest magnitude
    maps to 448)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def gate(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gate_up output [.., 2K] (gate first), in x's dtype."""
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, scale in the model's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def product_input(x: torch.Tensor, gated: bool, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """What decode_linear multiplies the weights by: silu(gate) * up of x (gated), rms_norm(x) (norm
    weights given), or x."""
    if gated:
        return gate(x)
    if norm is not None:
        return rms_norm(x, norm, eps)
    return x


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, gated: bool = False,
              norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """What decode_linear computes, with torch operations (fp32 accumulation for e4m3 weights)."""
    x = product_input(x, gated, norm, eps)
    if scale is None:
        y = F.linear(x, weight.to(x.dtype))
    else:
        y = (F.linear(x.float(), weight.float()) * scale).to(x.dtype)
    return y + residual if residual is not None else y


# (N, K, weight bytes per element) -> (BLOCK_N, BLOCK_K, num_warps) of `_gemv_kernel` for the
# Llama-3.2-1B decoder's product shapes, and (N, K, weight bytes per element, rows bucket: 16 for up
# to 16 rows, else 64) -> (BLOCK_N, BLOCK_K, num_warps, num_stages) of `_rows_kernel`: the fastest
# block shapes on the H200 (2026-12-04 21:25 UTC, benchmarks/gpu_pipeline.py section decode_step, each
# product timed inside a CUDA graph of many, as a replayed step runs it, with programmatic dependent
# launch, and e4m3 at one row as words). Other shapes use the rules below. The e4m3 64-row entries now
# serve the e4m3 x e4m3 path: other shapes, up to 9% faster per product alone, made the whole step 3.5%
# slower (2026-12-05, h200.json decode_step_fp8_rows_tuning).
GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (3072, 2048, 1): (8, 512, 4), (3072, 2048, 2): (4, 512, 4), (2048, 2048, 1): (8, 2048, 8),
    (2048, 2048, 2): (16, 1024, 8), (16384, 2048, 1): (8, 512, 4), (16384, 2048, 2): (8, 256, 4),
    (2048, 8192, 1): (8, 2048, 8), (2048, 8192, 2): (8, 1024, 8), (128256, 2048, 1): (8, 512, 4),
    (128256, 2048, 2): (32, 256, 4)}
ROWS_CONFIGS: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {
    (3072, 2048, 1, 16): (32, 256, 4, 4), (3072, 2048, 2, 16): (32, 256, 4, 4), (3072, 2048, 1, 64): (32, 256, 4, 4),
    (3072, 2048, 2, 64): (32, 256, 4, 4), (2048, 2048, 1, 16): (32, 256, 4, 4), (2048, 2048, 2, 16): (16, 512, 4, 3),
    (2048, 2048, 1, 64): (16, 256, 4, 4), (2048, 2048, 2, 64): (16, 256, 4, 4),
    (16384, 2048, 1, 16): (32, 256, 4, 4), (16384, 2048, 2, 16): (64, 128, 4, 4),
    (16384, 2048, 1, 64): (64, 128, 4, 4), (16384, 2048, 2, 64): (128, 128, 8, 3),
    (2048, 8192, 1, 16): (32, 256, 4, 4), (2048, 8192, 2, 16): (16, 512, 4, 3), (2048, 8192, 1, 64): (16, 256, 4, 4),
    (2048, 8192, 2, 64): (16, 256, 4, 4), (128256, 2048, 1, 16): (64, 128, 4, 4),
    (128256, 2048, 2, 16): (64, 128, 4, 4), (128256, 2048, 1, 64): (128, 128, 8, 3),
    (128256, 2048, 2, 64): (128, 128, 8, 3)}


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


def rows_config(n: int, k: int, itemsize: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the weight-streaming kernel: the measured one for
    this shape, else the widest BLOCK_N that still gives every multiprocessor a program or more."""
    bucket = 16 if rows <= 16 else 64
    if (n, k, itemsize, bucket) in ROWS_CONFIGS:
        return ROWS_CONFIGS[(n, k, itemsize, bucket)]
    block_n = 16
    while block_n < 64 and -(-n // (block_n * 2)) >= 256:
        block_n *= 2
    return block_n, 128, 4, 3


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_rm, stride_ym, eps,
                     HAS_SCALE: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, W_WORDS: tl.constexpr,
                     USE_GDC: tl.constexpr):
        """y[m, n-block] = input[m] · w[n-block]ᵀ (× scale) (+ residual[m, n-block]) on the CUDA cores:
        one program per (BLOCK_N rows of w, row m of x). The input is x, silu(gate) * up of x = [gate,
        up] (GATED), or rms_norm(x) with weights nw (NORM): each program computes it from x as it goes
        (a few KB, from L2), cheap for one row, so the norms, the MLP's pointwise step and the
        residual adds cost no kernels of their own. The norm's 1/rms multiplies the sum at the end
        (x's squares are summed in the same pass), so the weights' loads never wait for it; the
        normalised input is then not rounded to the activations' dtype, as the unfused step rounds it.
        The weights are requested one block ahead of their use (in registers), the first block
        before waiting on the kernel before (USE_GDC: programmatic dependent launch), since nothing
        in a step writes them; x, the residual and y only after that wait.

        W_WORDS (e4m3 weights, K a multiple of BLOCK_K): w is read as 32-bit words of 4 weights, each
        widened to fp32 by integer operations, not the conversion instructions (with which the
        gate_up product streamed 2.2 TB/s of e4m3 on the H200, 2.5 this way): an e4m3 value's sign, exponent
        and mantissa bits placed at fp32's positions give the value times 2^-120 exactly (e4m3's
        subnormals become fp32 subnormals). x is multiplied by 2^64 and the sum by 2^56, powers of
        two, so the products stay far from fp32's subnormals."""
        if W_WORDS:
            _gemv_words(x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                        eps, HAS_SCALE, GATED, NORM, HAS_RESIDUAL, BLOCK_N, BLOCK_K, USE_GDC)
            return
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        x_row = x_ptr + m * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        dtype = y_ptr.dtype.element_ty
        if EVEN_K:
            w_next = tl.load(w_rows + rk[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w_next = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K), other=0.0)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for i in range(0, tl.cdiv(K, BLOCK_K)):
            kk = i * BLOCK_K + rk
            w = w_next
            ahead = kk + BLOCK_K
            w_next = tl.load(w_rows + ahead[None, :], mask=n_ok[:, None] & (ahead[None, :] < K), other=0.0)
            if EVEN_K:
                x = tl.load(x_row + kk).to(tl.float32)
                if GATED:
                    u = tl.load(x_row + K + kk).to(tl.float32)
                if NORM:
                    nw = tl.load(nw_ptr + kk).to(tl.float32)
            else:
                x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
                if GATED:
                    u = tl.load(x_row + K + kk, mask=kk < K, other=0.0).to(tl.float32)
                if NORM:
                    nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            if GATED:
                x = (x * tl.sigmoid(x) * u).to(dtype).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * nw
            acc += w.to(tl.float32) * x[None, :]
        _gemv_epilogue(tl.sum(acc, axis=1), squares, s_ptr, r_ptr, y_ptr, rn, n_ok, m, K, stride_rm, stride_ym, eps,
                       HAS_SCALE, NORM, HAS_RESIDUAL)

    @triton.jit
    def _gemv_words(x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_rm, stride_ym, eps,
                    HAS_SCALE: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
        """_gemv_kernel's body for e4m3 weights read as int32 words (w_ptr, stride_wn in words)."""
        WORDS: tl.constexpr = BLOCK_K // 4
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, WORDS)
        n_ok = rn < N
        x_row = x_ptr + m * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rj[None, :]
        dtype = y_ptr.dtype.element_ty
        steps = K // BLOCK_K
        r_next = tl.load(w_rows, mask=n_ok[:, None], other=0)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        squares = tl.zeros((WORDS,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for i in range(0, steps):
            r = r_next
            r_next = tl.load(w_rows + (i + 1) * WORDS, mask=n_ok[:, None] & (i + 1 < steps), other=0)
            k4 = i * BLOCK_K + 4 * rj
            for b in tl.static_range(4):
                kk = k4 + b
                x = tl.load(x_row + kk).to(tl.float32)
                if GATED:
                    u = tl.load(x_row + K + kk).to(tl.float32)
                    x = (x * tl.sigmoid(x) * u).to(dtype).to(tl.float32)
                if NORM:
                    squares += x * x
                    x = x * tl.load(nw_ptr + kk).to(tl.float32)
                if b == 3:
                    bits = r
                else:
                    bits = r << (24 - 8 * b)
                w = ((bits & -2147483648) | ((bits >> 4) & 0x07F00000)).to(tl.float32, bitcast=True)
                acc += w * (x * 18446744073709551616.0)[None, :]
        _gemv_epilogue(tl.sum(acc, axis=1) * 72057594037927936.0, squares, s_ptr, r_ptr, y_ptr, rn, n_ok, m, K,
                       stride_rm, stride_ym, eps, HAS_SCALE, NORM, HAS_RESIDUAL)

    @triton.jit
    def _gemv_epilogue(y, squares, s_ptr, r_ptr, y_ptr, rn, n_ok, m, K, stride_rm, stride_ym, eps,
                       HAS_SCALE: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """The one-row products' end, shared by both bodies: y (the row's sums, fp32) times the norm's 1/rms and
        the weights' scale, rounded to the activations' dtype, plus the residual, stored."""
        dtype = y_ptr.dtype.element_ty
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if HAS_SCALE:
            y = y * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        if HAS_RESIDUAL:
            y = y.to(dtype).to(tl.float32) + tl.load(r_ptr + m * stride_rm + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rn, y.to(dtype), mask=n_ok)

    @triton.jit
    def _rows_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                     HAS_SCALE: tl.constexpr, X_SCALE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     USE_GDC: tl.constexpr):
        """y[:, n-block] = x · w[n-block]ᵀ (× scale) (+ residual) for all M rows of x at once: one
        program per BLOCK_N output channels, so each weight is read once whatever M is. e4m3 weights
        are widened to x's dtype in registers; with e4m3 x (X_SCALE: one fp32 scale per row, xs) both
        go to the fp8 tensor cores as they are, and the row's scale multiplies the sums at the end."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm[:, None] * stride_xm
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                x_mask = m_ok[:, None]
                w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
            else:
                x_mask = m_ok[:, None] & (kk[None, :] < K)
                w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < K), other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(x, w.to(x.dtype), acc)
        if X_SCALE:
            acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
        if HAS_SCALE:
            acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if HAS_RESIDUAL:
            acc = (acc.to(y_ptr.dtype.element_ty).to(tl.float32)
                   + tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ok, other=0.0).to(tl.float32))
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gate_kernel(x_ptr, y_ptr, K, stride_xm, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
        """y[m, k-block] = silu(x[m, k]) * x[m, K + k], in y's dtype (the MLP's pointwise step)."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(0)
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = rk < K
        g = tl.load(x_ptr + m * stride_xm + rk, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + m * stride_xm + K + rk, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * K + rk, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_norm_kernel(x_ptr, nw_ptr, y_ptr, K, stride_xm, eps, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
        """y[m] = rms_norm(x[m]) with weights nw, rounded as the unfused step rounds it."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        ok = rk < K
        x = tl.load(x_ptr + m * stride_xm + rk, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        nw = tl.load(nw_ptr + rk, mask=ok, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + m * K + rk, ((x * rstd).to(dtype).to(tl.float32) * nw).to(dtype), mask=ok)

    @triton.jit
    def _quantize_input_kernel(x_ptr, nw_ptr, q_ptr, s_ptr, K, stride_xm, eps, GATED: tl.constexpr,
                               NORM: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
        """Row m of the product's input (x, silu(gate) * up of x = [gate, up] (GATED), or rms_norm(x)
        with weights nw (NORM)), rounded to x's dtype as _gate_kernel and _rms_norm_kernel round it,
        then to e4m3 with its own scale (largest magnitude -> 448): the input of an fp8 product in
        one kernel, not one for the input and one for its rounding."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        ok = rk < K
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + m * stride_xm + rk, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(x_ptr + m * stride_xm + K + rk, mask=ok, other=0.0).to(tl.float32)
            x = (x * tl.sigmoid(x) * u).to(dtype).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            nw = tl.load(nw_ptr + rk, mask=ok, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + m * K + rk, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
        tl.store(s_ptr + m, scale)

    @triton.jit
    def _attention_kernel(q_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, part_ptr, stats_ptr,
                          stride_qb, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                          sm_scale, chunk, SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                          D: tl.constexpr, BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr):
        """Program (b, KV head, split): the GROUP query heads of that KV head, rotated here, against
        positions [split * chunk, min((split + 1) * chunk, pos + 1)) of its cache, online softmax.
        One split: writes the output; more: the unnormalised output and (max, sum) per head."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        heads_total = tl.num_programs(1) * GROUP
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        g_ok = rg < GROUP
        head = kvh * GROUP + rg
        q_rows = q_ptr + b * stride_qb + head[:, None] * D
        q = tl.load(q_rows + rd[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        turned = tl.load(q_rows + ((rd + D // 2) % D)[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + rd).to(tl.float32)
        sin = tl.load(sin_ptr + rd).to(tl.float32) * tl.where(rd < D // 2, -1.0, 1.0)
        q = (q * cos[None, :] + turned * sin[None, :]).to(k_ptr.dtype.element_ty)

        length = tl.load(pos_ptr) + 1
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        rs = tl.arange(0, BLOCK_S)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):
            s = s0 + rs
            s_ok = s < end
            k = tl.load(k_base + s[:, None] * stride_ks + rd[None, :], mask=s_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * sm_scale
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + s[:, None] * stride_vs + rd[None, :], mask=s_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + b * heads_total * D + head[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=g_ok[:, None])
        else:
            row = (b * heads_total + head) * SPLITS + split
            tl.store(part_ptr + row[:, None] * D + rd[None, :], acc, mask=g_ok[:, None])
            tl.store(stats_ptr + row * 2, m_i, mask=g_ok)
            tl.store(stats_ptr + row * 2 + 1, l_i, mask=g_ok)

    @triton.jit
    def _attention_combine_kernel(part_ptr, stats_ptr, o_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                                  D: tl.constexpr, USE_GDC: tl.constexpr):
        """Program (b * heads + head): the splits' partial softmaxes into the head's output."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        rsp = tl.arange(0, SPLITS_PAD)
        rd = tl.arange(0, D)
        ok = rsp < SPLITS
        row = bh * SPLITS + rsp
        m = tl.load(stats_ptr + row * 2, mask=ok, other=float("-inf"))
        l = tl.load(stats_ptr + row * 2 + 1, mask=ok, other=0.0)
        top = tl.max(m, axis=0)
        weight = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        part = tl.load(part_ptr + row[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(part * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
        tl.store(o_ptr + bh * D + rd, out.to(o_ptr.dtype.element_ty))


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, gated: bool = False,
         norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The CUDA-core weight-streaming kernel (Triton): decode_linear for x [M, K] ([M, 2K] gated);
    meant for one row (each row reads the weights again)."""
    m = x.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    n = weight.shape[0]
    block_n, block_k, warps = config or gemv_config(n, k, weight.element_size())
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    words = (GEMV_WORDS and weight.dtype == FP8 and k % block_k == 0 and block_k % 4 == 0
             and weight.stride(0) % 4 == 0 and weight.data_ptr() % 16 == 0)
    w = weight.view(torch.int32) if words else weight
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        x, w, scale if scale is not None else weight, norm if norm is not None else weight,
        residual if residual is not None else y, y, n, k, x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0), eps,
        HAS_SCALE=scale is not None, GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, W_WORDS=words, num_warps=warps, **_launch(x))
    return y


def prepared_input(x: torch.Tensor, gated: bool, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """product_input on the GPU, one Triton kernel (none for a plain x)."""
    if not gated and norm is None:
        return x
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if gated:
        _gate_kernel[(m, triton.cdiv(k, 1024))](x, y, k, x.stride(0), BLOCK_K=1024, num_warps=4, **_launch(x))
    else:
        block_k = triton.next_power_of_2(k)
        _rms_norm_kernel[(m,)](x, norm, y, k, x.stride(0), eps, BLOCK_K=block_k,
                               num_warps=8 if block_k >= 4096 else 4, **_launch(x))
    return y


def quantize_input(x: torch.Tensor, gated: bool = False, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """product_input's rows in e4m3 [M, K], each with its own fp32 scale [M] (its largest magnitude
    maps to 448): one Triton kernel, one program per row (the whole row, for its largest magnitude)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    quantised = torch.empty(m, k, dtype=FP8, device=x.device)
    row_scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_input_kernel[(m,)](x, norm if norm is not None else x, quantised, row_scale, k, x.stride(0), eps,
                                 GATED=gated, NORM=norm is not None, BLOCK_K=block_k,
                                 num_warps=min(16, max(4, block_k // 512)), **_launch(x))
    return quantised, row_scale


def rows_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                 residual: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
                 x_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor-core weight-streaming kernel (CUDA, Triton): y [M, N] (+ residual) for x [M, K], M <= 64,
    in x's dtype; for e4m3 x with one fp32 scale per row (x_scale [M]) and e4m3 weights, on the fp8
    tensor cores, in `dtype`."""
    m, k = x.shape
    n = weight.shape[0]
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    block_n, block_k, warps, stages = config or rows_config(n, k, weight.element_size(), m)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=dtype or x.dtype, device=x.device)
    # e4m3 x: 64 rows whatever M (one compiled kernel for all the rows it serves; an fp8 MMA of the
    # Hopper tensor cores spans 64 rows anyway)
    block_m = 64 if x_scale is not None else max(16, triton.next_power_of_2(m))
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, x_scale if x_scale is not None else x, weight, scale if scale is not None else weight,
        residual if residual is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_SCALE=scale is not None, X_SCALE=x_scale is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
        num_stages=stages, **_launch(x))
    return y


def quantized_rows_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool = False,
                           norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """decode_linear on e4m3 weights in two kernels, as bf16 weights take: the input rounded to e4m3
    per row (quantize_input, as fp8_rows_product rounds it), then the tensor-core kernel on e4m3 x e4m3."""
    quantised, row_scale = quantize_input(x, gated, norm, eps)
    return rows_product(quantised, weight, scale, residual, config, x_scale=row_scale, dtype=x.dtype)


def fp8_rows_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool = False,
                     norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Many rows against e4m3 weights: the input rounded to e4m3 per row (quantize_input), then
    cuBLAS's fp8 product with row-wise scales, into x's dtype."""
    quantised, row_scale = quantize_input(x, gated, norm, eps)
    return torch._scaled_mm(quantised, weight.t(), scale_a=row_scale.view(-1, 1), scale_b=scale.view(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


def _fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.dim() == 2 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16))


@torch.library.custom_op("smelter::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, gated: bool = False,
                  norm: torch.Tensor | None = None, eps: float = 0.0,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """input @ weight [N, K]ᵀ (× scale [N] for e4m3 weights) (+ residual [M, N]) -> [M, N] in x's
    dtype, where input is product_input: x [M, K], silu(gate) * up of x [M, 2K] (gated), or
    rms_norm(x, norm, eps) (norm weights [K] given)."""
    if not _fast_path(x, weight):
        return reference(x, weight, scale, gated, norm, eps, residual)
    rows, width = x.shape[0], weight.element_size()
    if rows <= GEMV_ROWS.get(width, 0):
        return gemv(x, weight, scale, gated, norm, eps, residual)
    if scale is not None and rows > ROWS_KERNEL_ROWS.get(width, 0):
        if rows <= FP8_ROWS_KERNEL_ROWS:
            return quantized_rows_product(x, weight, scale, gated, norm, eps, residual)
        y = fp8_rows_product(x, weight, scale, gated, norm, eps)
        return y.add_(residual) if residual is not None else y
    x = prepared_input(x, gated, norm, eps)
    if rows <= ROWS_KERNEL_ROWS.get(width, 0):
        return rows_product(x, weight, scale, residual)
    return torch.addmm(residual, x, weight.t()) if residual is not None else F.linear(x, weight)


@decode_linear.register_fake
def _decode_linear_shape(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, gated: bool = False,
                         norm: torch.Tensor | None = None, eps: float = 0.0,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as HF applies it (x * cos + rotate_half(x) * sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_reference(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """What decode_attention computes, with torch operations: the query heads that share a KV head
    form one small matrix, so each KV head's cache is read once by a batched product."""
    batch, kv_heads, max_len, d = k_cache.shape
    heads = q.shape[-1] // d
    q = rotate(q.reshape(batch, heads, d), cos.reshape(1, 1, d), sin.reshape(1, 1, d))
    grouped = q.view(batch, kv_heads, heads // kv_heads, d)
    mask = torch.where(torch.arange(max_len, device=q.device) <= pos, 0.0, float("-inf"))
    scores = torch.matmul(grouped, k_cache.transpose(-1, -2)).float() * (d ** -0.5) + mask
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(weights, v_cache).reshape(batch, heads * d)


def attention_splits(batch: int, kv_heads: int, max_len: int, block_s: int) -> tuple[int, int]:
    """(splits, positions per split): enough programs to stream the cache (ATTENTION_PROGRAMS), each
    at least one block of positions."""
    blocks = triton.cdiv(max_len, block_s)
    wanted = max(1, min(blocks, triton.cdiv(ATTENTION_PROGRAMS, batch * kv_heads)))
    chunk = triton.cdiv(blocks, wanted) * block_s
    return triton.cdiv(max_len, chunk), chunk


def attention(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              pos: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """decode_attention's Triton kernels (CUDA): the split kernel, then the combine kernel where the
    positions are split."""
    batch, kv_heads, max_len, d = k_cache.shape
    heads = q.shape[-1] // d
    group = heads // kv_heads
    block_s, stages, warps = config or ATTENTION_CONFIGS["split" if batch * kv_heads < ATTENTION_PROGRAMS else "whole"]
    splits, chunk = attention_splits(batch, kv_heads, max_len, block_s)
    out = torch.empty(batch, heads * d, dtype=q.dtype, device=q.device)
    if splits > 1:
        part = torch.empty(batch * heads * splits, d, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch * heads * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out
    launch = _launch(q)
    _attention_kernel[(batch, kv_heads, splits)](
        q, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(), k_cache, v_cache, pos, out, part, stats,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), d ** -0.5, chunk,
        SPLITS=splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_S=block_s,
        num_warps=warps, num_stages=stages, **launch)
    if splits > 1:
        _attention_combine_kernel[(batch * heads,)](part, stats, out, SPLITS=splits,
                                                    SPLITS_PAD=triton.next_power_of_2(splits), D=d, num_warps=2,
                                                    **launch)
    return out


@torch.library.custom_op("smelter::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One new token's attention: q [B, heads * D] (before the rotary embedding, whose cos and sin
    [.., D] are those of `pos`) against k_cache and v_cache [B, kv_heads, max_len, D] up to `pos`
    (a 0-d tensor) -> [B, heads * D] in q's dtype."""
    d = k_cache.shape[-1]
    usable = (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
              and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and d >= 16 and d & (d - 1) == 0
              and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1)
    if not usable:
        return attention_reference(q, cos, sin, k_cache, v_cache, pos)
    return attention(q, cos, sin, k_cache, v_cache, pos)


@decode_attention.register_fake
def _decode_attention_shape(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[-1])
