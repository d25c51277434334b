"""The encoder graph's own ops: `smelter::encoder_attention` (Triton) and `smelter::cublas_linear`.

`encoder_attention`: an encoder layer's bidirectional attention, read straight from its qkv product.
SDPA needs q, k and v as [batch, heads, seq, head_dim] views and hands its output back in that
layout; cuDNN's flash kernel (what SDPA picks on an H100) also sets up buffers of its own each call
(memsets every layer). At the shapes embedding services run (heads of 32 at seq 128: MiniLM) that
kernel is bound by neither arithmetic nor bytes: 82 µs a layer on an H100 at 256 × 128 with the key
bias, for 100 MB of q, k, v and output (33 µs at copy bandwidth); this kernel takes 55 µs there.
The Triton kernel here is one flash attention pass per (batch, head, block of queries): it reads q,
k and v where the qkv product wrote them ([batch, seq, 3 × hidden], q then k then v, head after
head), adds the key-padding bias of each key (natural-log units, as SDPA's float mask; clamped to
-1e30, so a row whose keys are all padding attends evenly instead of making NaN), keeps the softmax
in fp32 (exp2 of pre-scaled scores), and writes [batch, seq, hidden], the o product's input, with no
transpose between; for an fp8 engine's static o product, already scaled and rounded to e4m3 (half
the bytes, and no quantising pass between). Elsewhere (CPU, no Triton, head sizes that are not powers
of two from 16 to 128) the op computes the same function through SDPA, so an exported encoder graph
runs anywhere. Each program reads its row's bias once first: keys after the last one above the floor
(trailing padding: their exp2 is exactly 0 beside any real key) are skipped, and the key blocks before
the first key with a bias other than 0 run without it (on an H100, BERT-base's 8 × 512 went from 25.8
to 23.2 µs a layer unpadded, to 19.7 µs at 58% real tokens; MiniLM's 256 × 128 stayed at 55.8 µs
unpadded, 51.0 µs at 54% real tokens).

`cublas_linear`: F.linear that Inductor cannot see into, so max-autotune never swaps it for one of its
Triton templates. Autotuning times each candidate alone; in the whole forward the templates it picked
for BERT-base's qkv and down products (in one run both, in another the down product alone) ran 0.40-0.44
ms per forward each on an H100 where cuBLAS's ran 0.30-0.33 ms, so the graph pins those two products.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tasks.backends.inductor.fp8_linear import FP8, FP8_MAX

try:  # Triton ships with CUDA builds of torch; a CPU-only install computes with torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# (BLOCK_M queries per program, BLOCK_N keys per loop step, num_warps, num_stages) by head size, as an
# H100 measured fastest (benchmarks/gpu_encoder_variants.py --own-kernels): heads of 32 at MiniLM's
# 256 × 128, heads of 64 at BERT-base's 8 × 512; other head sizes take the latter's
CONFIGS = {32: (128, 32, 8, 3), 64: (64, 64, 4, 2)}
# The kernel's names: the build packs their compiled entries into the engine (kernel_bundle)
KERNELS = ("_encoder_attention_kernel",)
BIAS_FLOOR = -1e30  # padding's bias is clamped to this (the kernel's literal) so an all-padding row stays finite

if triton is not None:
    @triton.jit
    def _encoder_attention_kernel(qkv_ptr, bias_ptr, o_ptr, scale_ptr, S, stride_qb, stride_qs, stride_bb, stride_ob,
                                  stride_os, qk_scale, H: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  FP8_OUT: tl.constexpr, S_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr):
        """Program (block of queries, batch × heads): online softmax over the keys of its sequence up to the
        last one whose bias is above the floor (those after it would add exactly 0; all of them where every
        key is at the floor), the leading blocks whose bias is all 0 without it; with FP8_OUT, the output times
        *scale_ptr, rounded to e4m3."""
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rm = block * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D)
        m_ok = rm < S
        base = qkv_ptr + b * stride_qb + h * D
        q = tl.load(base + rm[:, None] * stride_qs + rd[None, :], mask=m_ok[:, None], other=0.0)
        k_base = base + H * D
        v_base = base + 2 * H * D
        # Keys [0, plain_end) have a bias of exactly 0 (whole blocks, all inside the sequence): they skip the bias
        # and the bounds; keys past n_end are the row's trailing padding, whose exp2 underflows to exactly 0
        # beside any real key: skipped (all keys run where every one is at the floor)
        if HAS_BIAS:
            rs = tl.arange(0, S_POW2)
            row_bias = tl.load(bias_ptr + b * stride_bb + rs, mask=rs < S, other=-3.0e38).to(tl.float32)
            last = tl.max(tl.where(row_bias > -1e30, rs + 1, 0), axis=0)
            n_end = tl.where(last == 0, S, last)
            first = tl.min(tl.where((row_bias != 0.0) & (rs < S), rs, S), axis=0)
            plain_end = (tl.minimum(first, n_end) // BLOCK_N) * BLOCK_N
        else:
            n_end = S
            plain_end = (S // BLOCK_N) * BLOCK_N
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for phase in tl.static_range(2):
            if phase == 0:
                lo = 0
                hi = plain_end
            else:
                lo = plain_end
                hi = n_end
            for n0 in range(lo, hi, BLOCK_N):
                rn = n0 + tl.arange(0, BLOCK_N)
                n_ok = rn < S
                if phase == 0:
                    k = tl.load(k_base + rn[:, None] * stride_qs + rd[None, :])
                else:
                    k = tl.load(k_base + rn[:, None] * stride_qs + rd[None, :], mask=n_ok[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k)) * qk_scale
                if phase == 1:
                    if HAS_BIAS:
                        bias = tl.load(bias_ptr + b * stride_bb + rn, mask=n_ok, other=0.0).to(tl.float32)
                        scores += tl.maximum(bias, -1e30)[None, :] * 1.4426950408889634
                    scores = tl.where(n_ok[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                p = tl.math.exp2(scores - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if phase == 0:
                    v = tl.load(v_base + rn[:, None] * stride_qs + rd[None, :])
                else:
                    v = tl.load(v_base + rn[:, None] * stride_qs + rd[None, :], mask=n_ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
        out = acc / l_i[:, None]
        if FP8_OUT:
            out = tl.clamp(out * tl.load(scale_ptr), -448.0, 448.0)
        tl.store(o_ptr + b * stride_ob + rm[:, None] * stride_os + h * D + rd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


def reference(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int,
              out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What encoder_attention computes, through SDPA."""
    batch, seq, width = qkv.shape
    hidden = width // 3
    q, k, v = qkv.view(batch, seq, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4).unbind(0)
    mask = None if key_bias is None else key_bias.to(qkv.dtype).clamp(min=BIAS_FLOOR)[:, None, None, :]
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, seq, hidden)
    if out_scale is None:
        return attended
    return (attended.float() * out_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def config(head_dim: int) -> tuple[int, int, int, int]:
    """The kernel's block shape and launch settings at this head size."""
    return CONFIGS.get(head_dim, CONFIGS[64])


def usable(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int, out_scale: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernel takes this call (else SDPA does)."""
    head_dim = qkv.shape[-1] // 3 // heads
    return (triton is not None and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)
            and (out_scale is None or torch.cuda.get_device_capability(qkv.device) >= (8, 9))
            and qkv.stride(-1) == 1 and 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0
            and (key_bias is None or key_bias.stride(-1) == 1))


def attention(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int,
              settings: tuple[int, int, int, int] | None = None, out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA) over qkv [B, S, 3 × hidden] -> [B, S, hidden] (e4m3 with `out_scale`)."""
    batch, seq, width = qkv.shape
    hidden = width // 3
    head_dim = hidden // heads
    block_m, block_n, warps, stages = settings or config(head_dim)
    dtype = qkv.dtype if out_scale is None else FP8
    out = torch.empty(batch, seq, hidden, dtype=dtype, device=qkv.device)
    bias = key_bias if key_bias is not None else qkv
    _encoder_attention_kernel[(triton.cdiv(seq, block_m), batch * heads)](
        qkv, bias, out, out_scale if out_scale is not None else qkv, seq, qkv.stride(0), qkv.stride(1),
        bias.stride(0), out.stride(0), out.stride(1), head_dim ** -0.5 * 1.4426950408889634, H=heads, D=head_dim,
        HAS_BIAS=key_bias is not None, FP8_OUT=out_scale is not None, S_POW2=triton.next_power_of_2(seq),
        BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return out


@torch.library.custom_op("smelter::encoder_attention", mutates_args=())
def encoder_attention(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int,
                      out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional attention of qkv [B, S, 3 × hidden] (q, k, v, each head after head), with an additive
    bias per key key_bias [B, S] (padding: a large negative number) or none -> [B, S, hidden] in qkv's dtype,
    or, with out_scale (a 0-dim fp32 tensor), times it in e4m3: the input of a static fp8 o product."""
    if not usable(qkv, key_bias, heads, out_scale):
        return reference(qkv, key_bias, heads, out_scale)
    return attention(qkv, key_bias, heads, out_scale=out_scale)


@encoder_attention.register_fake
def _encoder_attention_shape(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int,
                             out_scale: torch.Tensor | None = None) -> torch.Tensor:
    batch, seq, width = qkv.shape
    return qkv.new_empty(batch, seq, width // 3, dtype=qkv.dtype if out_scale is None else FP8)


@torch.library.custom_op("smelter::cublas_linear", mutates_args=())
def cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) (cuBLAS on a GPU), opaque to Inductor."""
    return F.linear(x, weight, bias)


@cublas_linear.register_fake
def _cublas_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
