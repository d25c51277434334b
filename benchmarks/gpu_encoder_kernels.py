"""Candidate kernels for the encoder graph, each timed alone at BERT-base's 8 × 512 and MiniLM's 256 × 128 shapes.

For deciding, in one device call, which of smelter's own kernels could replace what the engine runs now:
- products: a persistent Triton product over TMA descriptors (bias, GELU's tanh form or a residual
  add in its epilogue; tiles walked so that the next tile's loads overlap this tile's epilogue), each
  block shape, against cuBLAS (F.linear; torch._addmm_activation with GELU for the up product);
- attention: smelter's kernel (encoder_ops) against a variant that takes G heads per program
  (3-D blocks: each row's G × head_dim values are contiguous in the qkv product's output) and against
  the same kernels skipping key blocks that lie wholly in a row's trailing padding;
- residual add + layer norm: Inductor's fused kernel (reads the product's output and the residual),
  against a norm that reads one tensor (the residual already added in the product's epilogue);
- mlp (hidden 3 × 2^k only: MiniLM's shape): the up product with GELU, the down product and the output
  norm as the engine runs them, against a fused MLP of smelter's own (fused_mlp, not kept), each block shape.

Every time is the median of one call among 20 replayed from a CUDA graph (no launch gaps), as
benchmarks/gpu_encoder_variants.py times smelter's attention alone.

Usage: python -m benchmarks.gpu_encoder_kernels --out kernels.json [--parts products,norms,attention,mlp,mlp2]
       [--base-ops old_encoder_ops.py] [--groups]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.gpu_encoder_variants import graphed_ms, relative_error
from tasks.measure import gpu_measure as gm


@triton.jit
def _linear_kernel(a_desc, w_desc, c_desc, bias_ptr, res_ptr, M, N, K, stride_r, programs,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   GELU: tl.constexpr, RESIDUAL: tl.constexpr):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    k_steps = tl.cdiv(K, BK)
    stored = start - programs
    for tile in tl.range(start, num_m * num_n, programs, flatten=True):
        first = (tile // per_group) * GROUP_M
        rows_in_group = tl.minimum(num_m - first, GROUP_M)
        pm = first + (tile % per_group) % rows_in_group
        pn = (tile % per_group) // rows_in_group
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_steps):
            a = a_desc.load([pm * BM, ki * BK])
            w = w_desc.load([pn * BN, ki * BK])
            acc = tl.dot(a, w.T, acc)
        # the epilogue's tile, counted apart so the loads of the next tile need not wait for it
        stored += programs
        first_c = (stored // per_group) * GROUP_M
        rows_c = tl.minimum(num_m - first_c, GROUP_M)
        cm = first_c + (stored % per_group) % rows_c
        cn = (stored % per_group) // rows_c
        cols = cn * BN + tl.arange(0, BN)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if RESIDUAL:
            rows = cm * BM + tl.arange(0, BM)
            acc += tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :],
                           mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        if GELU:  # tanh form: x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
            inner = acc * (0.7978845608028654 + 0.035677408136300125 * acc * acc)
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32,
                                          is_pure=True, pack=1)
            acc = 0.5 * acc * (1.0 + t)
        c_desc.store([cm * BM, cn * BN], acc.to(bias_ptr.dtype.element_ty))


def own_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, settings: tuple[int, ...],
               gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    bm, bn, bk, stages, warps, per_sm, group = settings
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles if per_sm == 0 else min(tiles, per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
    res = residual if residual is not None else out
    _linear_kernel[(programs,)](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
                                TensorDescriptor.from_tensor(out, [bm, bn]), bias, res, m, n, k, res.stride(0), programs,
                                BM=bm, BN=bn, BK=bk, GROUP_M=group, GELU=gelu, RESIDUAL=residual is not None,
                                num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _attention_groups_kernel(qkv_ptr, bias_ptr, o_ptr, S, stride_qb, stride_qs, stride_bb, stride_ob, stride_os,
                             qk_scale, H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
                             SKIP: tl.constexpr, S_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    block = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // (H // G)
    h0 = (bg % (H // G)) * G
    rm = block * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, G)[:, None, None] * D + tl.arange(0, D)[None, None, :]
    m_ok = (rm < S)[None, :, None]
    base = qkv_ptr + b * stride_qb + h0 * D
    q = tl.load(base + rm[None, :, None] * stride_qs + col, mask=m_ok, other=0.0)
    n_end = S
    if HAS_BIAS and SKIP:  # keys after the last one whose bias is above the floor add exactly nothing
        rs = tl.arange(0, S_POW2)
        kb = tl.load(bias_ptr + b * stride_bb + rs, mask=rs < S, other=-3.0e38).to(tl.float32)
        last = tl.max(tl.where(kb > -1e30, rs + 1, 0), axis=0)
        n_end = tl.where(last == 0, S, last)
    m_i = tl.full((G, BLOCK_M), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((G, BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < S
        k = tl.load(base + H * D + rn[None, :, None] * stride_qs + col, mask=n_ok[None, :, None], other=0.0)
        scores = tl.dot(q, tl.permute(k, (0, 2, 1))) * qk_scale
        if HAS_BIAS:
            bias = tl.load(bias_ptr + b * stride_bb + rn, mask=n_ok, other=0.0).to(tl.float32)
            scores += tl.maximum(bias, -1e30)[None, None, :] * 1.4426950408889634
        scores = tl.where(n_ok[None, None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=2))
        p = tl.math.exp2(scores - m_new[:, :, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        v = tl.load(base + 2 * H * D + rn[None, :, None] * stride_qs + col, mask=n_ok[None, :, None], other=0.0)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, :, None]
    tl.store(o_ptr + b * stride_ob + rm[None, :, None] * stride_os + h0 * D + col, out.to(o_ptr.dtype.element_ty),
             mask=m_ok)


def grouped_attention(qkv: torch.Tensor, key_bias: torch.Tensor | None, heads: int, settings: tuple[int, ...],
                      skip: bool = False) -> torch.Tensor:
    group, block_m, block_n, warps, stages = settings
    batch, seq, width = qkv.shape
    hidden = width // 3
    d = hidden // heads
    out = torch.empty(batch, seq, hidden, dtype=qkv.dtype, device=qkv.device)
    bias = key_bias if key_bias is not None else qkv
    _attention_groups_kernel[(triton.cdiv(seq, block_m), batch * heads // group)](
        qkv, bias, out, seq, qkv.stride(0), qkv.stride(1), bias.stride(0), out.stride(0), out.stride(1),
        d ** -0.5 * 1.4426950408889634, H=heads, D=d, G=group, HAS_BIAS=key_bias is not None, SKIP=skip,
        S_POW2=triton.next_power_of_2(seq), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, M, eps, N: tl.constexpr, N_POW2: tl.constexpr,
                 ROWS: tl.constexpr, RESIDUAL: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, N_POW2)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        x += tl.load(r_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = (xc * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < N).to(tl.float32)[None, :]
         + tl.load(b_ptr + cols, mask=cols < N).to(tl.float32)[None, :])
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
         rows: int = 8, warps: int = 4) -> torch.Tensor:
    m, n = x.shape
    out = torch.empty_like(x)
    _norm_kernel[(triton.cdiv(m, rows),)](x, residual if residual is not None else x, weight, bias, out, m, 1e-12,
                                          N=n, N_POW2=triton.next_power_of_2(n), ROWS=rows, RESIDUAL=residual is not None, num_warps=warps)
    return out


LINEAR_CONFIGS = [  # BM, BN, BK, stages, warps, programs per SM (0: one per tile), GROUP_M
    (128, 256, 64, 3, 8, 1, 8), (128, 128, 64, 4, 8, 1, 8), (128, 128, 64, 2, 4, 2, 8), (128, 128, 64, 2, 8, 2, 8),
    (128, 128, 64, 2, 4, 0, 8), (128, 256, 64, 3, 8, 0, 8), (64, 256, 64, 2, 4, 2, 8), (128, 128, 128, 2, 8, 1, 8),
    (256, 128, 64, 3, 8, 1, 8), (128, 64, 64, 4, 4, 2, 8),
]
ATTENTION_CONFIGS = [  # G heads, BLOCK_M, BLOCK_N, warps, stages
    (1, 128, 32, 8, 3), (2, 128, 32, 8, 3), (4, 64, 32, 8, 3), (2, 64, 64, 4, 2),
]
SHAPES = {"bert_8x512": dict(tokens=4096, hidden=768, inner=3072, heads=12, batch=8, seq=512),
          "minilm_256x128": dict(tokens=32768, hidden=384, inner=1536, heads=12, batch=256, seq=128)}


def products(shape: dict[str, int], tflops: float, configs: list[tuple[int, ...]]) -> dict[str, Any]:
    m, h, i = shape["tokens"], shape["hidden"], shape["inner"]
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for name, (k, n) in {"qkv": (h, 3 * h), "o": (h, h), "up": (h, i), "down": (i, h)}.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if name in ("o", "down") else None
        gelu = name == "up"
        flop = 2 * m * k * n
        ref = F.linear(x.float(), w.float(), b.float())
        if gelu:
            ref = F.gelu(ref, approximate="tanh")
            cublas = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
        else:
            cublas = lambda: F.linear(x, w, b)  # noqa: E731
        row: dict[str, Any] = {"shape": [m, k, n], "cublas": {"ms": graphed_ms(cublas), "rel_error": relative_error(cublas(), ref)}}
        row["cublas"]["tflops"] = round(flop / row["cublas"]["ms"] / 1e9, 1)
        if r is not None:  # the residual added where the norm reads it now
            row["cublas_then_add_norm_ms"] = graphed_ms(lambda: norm(F.linear(x, w, b), r, b.new_ones(n), b))
        best = None
        for c in configs:
            key = "x".join(map(str, c))
            try:
                got = own_linear(x, w, b, c, gelu=gelu)
                entry = {"ms": graphed_ms(lambda: own_linear(x, w, b, c, gelu=gelu)), "rel_error": relative_error(got, ref)}
                entry["tflops"] = round(flop / entry["ms"] / 1e9, 1)
                row[key] = entry
                if entry["rel_error"] < 1e-2 and (best is None or entry["ms"] < row[best]["ms"]):
                    best = key
            except Exception as e:  # a block shape this GPU cannot run says so
                row[key] = f"{type(e).__name__}: {str(e)[:300]}"
        row["best"] = best
        if best:
            row["best_vs_cublas"] = round(row["cublas"]["ms"] / row[best]["ms"], 3)
        if best and r is not None:  # the residual added in the product's epilogue, the norm reading one tensor
            c = tuple(int(v) for v in best.split("x"))
            try:
                got = own_linear(x, w, b, c, residual=r)
                row["best_residual"] = {
                    "rel_error": relative_error(got, ref + r.float()),
                    "ms": graphed_ms(lambda: own_linear(x, w, b, c, residual=r)),
                    "then_norm_ms": graphed_ms(lambda: norm(own_linear(x, w, b, c, residual=r), None, b.new_ones(n), b)),
                    "plain_then_add_norm_ms": graphed_ms(lambda: norm(own_linear(x, w, b, c), r, b.new_ones(n), b))}
            except Exception as e:
                row["best_residual"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[name] = row
        print(f"  {name}: cublas {row['cublas']}, best {best} {row.get(best)}", flush=True)
    return out


def norms(shape: dict[str, int]) -> dict[str, Any]:
    m, h = shape["tokens"], shape["hidden"]
    x, r = (torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w, b = torch.ones(h, device="cuda", dtype=torch.bfloat16), torch.zeros(h, device="cuda", dtype=torch.bfloat16)
    inductor = torch.compile(lambda x, r: F.layer_norm(x + r, (h,), w, b, 1e-12))
    ref = F.layer_norm(x.float() + r.float(), (h,))
    out: dict[str, Any] = {"inductor_add_norm_ms": graphed_ms(lambda: inductor(x, r)),
                           "copy_ms": graphed_ms(lambda: x.clone())}
    for rows, warps in ((4, 4), (8, 4), (16, 8), (2, 2)):
        try:
            out[f"own_{rows}x{warps}"] = {"add_norm_ms": graphed_ms(lambda: norm(x, r, w, b, rows, warps)),
                                          "norm_ms": graphed_ms(lambda: norm(x, None, w, b, rows, warps)),
                                          "rel_error": relative_error(norm(x, r, w, b, rows, warps), ref)}
        except Exception as e:
            out[f"own_{rows}x{warps}"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


# The fused MLP measured and not kept (docs/gpu-engines.md, "Encoders"): one program per BLOCK_M rows
@triton.jit
def _gelu_tanh(h, APPROX: tl.constexpr):
    """GELU's tanh form, x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3), as cuBLASLt's epilogue computes
    it: with APPROX, one tanh.approx.f32 (the interpreter has no inline assembly)."""
    inner = h * (0.7978845608028654 + 0.035677408136300125 * h * h)
    if APPROX:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return 0.5 * h * (1.0 + t)
    return h / (1.0 + tl.math.exp2(inner * -2.8853900817779268))


@triton.jit
def _encoder_mlp_kernel(x_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, nw_ptr, nb_ptr, out_ptr, M, stride_x, stride_o,
                        eps, I: tl.constexpr, CW: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr,
                        NORM: tl.constexpr, TMA: tl.constexpr, APPROX: tl.constexpr, WS: tl.constexpr = False):
    """Program (block of BM rows): out = LayerNorm(GELU(x Wu^T + bu) Wd^T + bd + x) for a hidden of 3 × CW, the
    intermediate BI columns at a time (GELU's output rounded to bf16, as the up product's output is) and added
    into three fp32 accumulators of BM × CW: it never reaches memory. Without NORM, the sum before the norm.
    With TMA, x_ptr, wu_ptr and wd_ptr are tensor descriptors of blocks [BM, CW], [BI, CW] and [CW, BI]."""
    pid = tl.program_id(0)
    rm = pid * BM + tl.arange(0, BM)
    rc = tl.arange(0, CW)
    m_ok = rm < M
    if TMA:
        x0 = x_ptr.load([pid * BM, 0])
        x1 = x_ptr.load([pid * BM, CW])
        x2 = x_ptr.load([pid * BM, 2 * CW])
    else:
        xp = x_ptr + rm[:, None] * stride_x + rc[None, :]
        x0 = tl.load(xp, mask=m_ok[:, None], other=0.0)
        x1 = tl.load(xp + CW, mask=m_ok[:, None], other=0.0)
        x2 = tl.load(xp + 2 * CW, mask=m_ok[:, None], other=0.0)
    acc0 = tl.zeros((BM, CW), dtype=tl.float32)
    acc1 = tl.zeros((BM, CW), dtype=tl.float32)
    acc2 = tl.zeros((BM, CW), dtype=tl.float32)
    for j in tl.range(0, I, BI, warp_specialize=WS):
        ri = j + tl.arange(0, BI)
        if TMA:
            h = tl.dot(x0, wu_ptr.load([j, 0]).T)
            h = tl.dot(x1, wu_ptr.load([j, CW]).T, h)
            h = tl.dot(x2, wu_ptr.load([j, 2 * CW]).T, h)
        else:
            wup = wu_ptr + ri[None, :] * (3 * CW) + rc[:, None]  # [CW, BI]: Wu[i, c]
            h = tl.dot(x0, tl.load(wup))
            h = tl.dot(x1, tl.load(wup + CW), h)
            h = tl.dot(x2, tl.load(wup + 2 * CW), h)
        h = _gelu_tanh(h + tl.load(bu_ptr + ri).to(tl.float32)[None, :], APPROX).to(x0.dtype)
        if TMA:
            acc0 = tl.dot(h, wd_ptr.load([0, j]).T, acc0)
            acc1 = tl.dot(h, wd_ptr.load([CW, j]).T, acc1)
            acc2 = tl.dot(h, wd_ptr.load([2 * CW, j]).T, acc2)
        else:
            wdp = wd_ptr + rc[None, :] * I + ri[:, None]  # [BI, CW]: Wd[c, i]
            acc0 = tl.dot(h, tl.load(wdp), acc0)
            acc1 = tl.dot(h, tl.load(wdp + CW * I), acc1)
            acc2 = tl.dot(h, tl.load(wdp + 2 * CW * I), acc2)
    # the residual is the MLP's input: read again here (from L2) rather than held in registers through the loop
    y0 = acc0 + tl.load(bd_ptr + rc).to(tl.float32)[None, :]
    y1 = acc1 + tl.load(bd_ptr + CW + rc).to(tl.float32)[None, :]
    y2 = acc2 + tl.load(bd_ptr + 2 * CW + rc).to(tl.float32)[None, :]
    if TMA:
        y0 += x_ptr.load([pid * BM, 0]).to(tl.float32)
        y1 += x_ptr.load([pid * BM, CW]).to(tl.float32)
        y2 += x_ptr.load([pid * BM, 2 * CW]).to(tl.float32)
    else:
        xp = x_ptr + rm[:, None] * stride_x + rc[None, :]
        y0 += tl.load(xp, mask=m_ok[:, None], other=0.0).to(tl.float32)
        y1 += tl.load(xp + CW, mask=m_ok[:, None], other=0.0).to(tl.float32)
        y2 += tl.load(xp + 2 * CW, mask=m_ok[:, None], other=0.0).to(tl.float32)
    if NORM:
        mean = (tl.sum(y0, axis=1) + tl.sum(y1, axis=1) + tl.sum(y2, axis=1)) / (3 * CW)
        y0 -= mean[:, None]
        y1 -= mean[:, None]
        y2 -= mean[:, None]
        var = (tl.sum(y0 * y0, axis=1) + tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / (3 * CW)
        rstd = (1.0 / tl.sqrt(var + eps))[:, None]
        y0 = y0 * rstd * tl.load(nw_ptr + rc).to(tl.float32)[None, :] + tl.load(nb_ptr + rc).to(tl.float32)[None, :]
        y1 = (y1 * rstd * tl.load(nw_ptr + CW + rc).to(tl.float32)[None, :]
              + tl.load(nb_ptr + CW + rc).to(tl.float32)[None, :])
        y2 = (y2 * rstd * tl.load(nw_ptr + 2 * CW + rc).to(tl.float32)[None, :]
              + tl.load(nb_ptr + 2 * CW + rc).to(tl.float32)[None, :])
    op = out_ptr + rm[:, None] * stride_o + rc[None, :]
    tl.store(op, y0.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    tl.store(op + CW, y1.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    tl.store(op + 2 * CW, y2.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def mlp_reference(x: torch.Tensor, up_w: torch.Tensor, up_b: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor,
                  norm_w: torch.Tensor | None, norm_b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """What fused_mlp computes, through torch: LayerNorm(GELU_tanh(x Wu^T + bu) Wd^T + bd + x) (no norm without
    its weight)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        up = torch._addmm_activation(up_b, rows, up_w.t(), use_gelu=True)
    else:
        up = F.gelu(F.linear(rows, up_w, up_b), approximate="tanh")
    y = (F.linear(up, down_w, down_b) + rows).view(x.shape)
    return y if norm_w is None else F.layer_norm(y, y.shape[-1:], norm_w, norm_b, eps)


def fused_mlp(x: torch.Tensor, up_w: torch.Tensor, up_b: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor,
              norm_w: torch.Tensor | None, norm_b: torch.Tensor | None, eps: float,
              settings: tuple[int, ...]) -> torch.Tensor:
    """The fused kernel (CUDA) over x [..., 3 × CW] -> the same shape; settings: MLP_CONFIGS's."""
    block_m, block_i, warps, stages, tma, *ws = settings
    hidden, inner = x.shape[-1], up_w.shape[0]
    rows = x.reshape(-1, hidden)
    out = torch.empty_like(rows)
    cw = hidden // 3
    m = rows.shape[0]
    if tma:
        xs = TensorDescriptor.from_tensor(rows, [block_m, cw])
        wu = TensorDescriptor.from_tensor(up_w, [block_i, cw])
        wd = TensorDescriptor.from_tensor(down_w, [cw, block_i])
    else:
        xs, wu, wd = rows, up_w, down_w
    norm = norm_w is not None
    _encoder_mlp_kernel[(triton.cdiv(m, block_m),)](
        xs, wu, up_b, wd, down_b, norm_w if norm else down_b, norm_b if norm else down_b, out, m, rows.stride(0),
        out.stride(0), eps, I=inner, CW=cw, BM=block_m, BI=block_i, NORM=norm, TMA=bool(tma),
        APPROX=os.environ.get("TRITON_INTERPRET") != "1", WS=bool(ws and ws[0]), num_warps=warps, num_stages=stages)
    return out.view(x.shape)


MLP_CONFIGS = [  # BLOCK_M, BLOCK_I, warps, stages, TMA (fused_mlp's settings)
    (64, 64, 8, 2, 0), (64, 64, 8, 1, 0), (64, 32, 8, 3, 0), (64, 32, 8, 2, 0), (64, 128, 8, 1, 0), (64, 64, 4, 2, 0),
    (64, 32, 4, 3, 0), (64, 64, 8, 2, 1), (64, 64, 8, 1, 1), (64, 32, 8, 3, 1), (64, 32, 8, 2, 1), (64, 128, 8, 1, 1),
    (64, 64, 4, 2, 1), (128, 32, 8, 2, 1), (128, 64, 8, 1, 1), (32, 64, 4, 2, 0), (32, 64, 4, 2, 1), (32, 32, 4, 3, 1),
]
MLP_ROWS = (32768, 16384, 4096)  # MiniLM 256 × 128, 128 × 128, 32 × 128
MLP_CONFIGS_2 = [  # a second round (2026-12-06 14:55): 16 warps (96 accumulator registers a thread at 128 rows),
    # warp specialisation of the loop, 16 intermediate columns a step with deeper pipelines; a 6th value 1: WS
    (128, 32, 8, 2, 1), (128, 32, 16, 2, 1), (128, 32, 16, 2, 0), (128, 64, 16, 1, 1), (128, 16, 8, 4, 1),
    (128, 16, 16, 4, 1), (128, 32, 8, 2, 1, 1), (128, 32, 16, 2, 1, 1), (64, 32, 8, 3, 1, 1), (64, 32, 4, 3, 1, 1),
    (64, 32, 4, 3, 0), (64, 16, 4, 4, 0), (64, 16, 4, 4, 1),
]


def mlp(shape: dict[str, int], configs: list[tuple[int, ...]], rows_list: tuple[int, ...] = MLP_ROWS) -> dict[str, Any]:
    """The encoder layer's MLP and output norm, LayerNorm(GELU(x Wu^T + bu) Wd^T + bd + x): as the engine runs it
    (cuBLASLt's up product with GELU, cuBLAS's down product, Inductor's add + norm) against smelter's fused kernel
    (fused_mlp) at each block shape, with and without the norm, at MLP_ROWS rows."""
    h, inner = shape["hidden"], shape["inner"]
    torch.manual_seed(0)
    wu = (torch.randn(inner, h, device="cuda") / h ** 0.5).bfloat16()
    bu = torch.randn(inner, device="cuda", dtype=torch.bfloat16) * 0.1
    wd = (torch.randn(h, inner, device="cuda") / inner ** 0.5).bfloat16()
    bd = torch.randn(h, device="cuda", dtype=torch.bfloat16) * 0.1
    nw = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16()
    nb = (0.1 * torch.randn(h, device="cuda")).bfloat16()
    add_norm = torch.compile(lambda y, x: F.layer_norm(y + x, (h,), nw, nb, 1e-12))

    def up_gelu(x: torch.Tensor) -> torch.Tensor:  # the engine's up product: GELU in cuBLASLt's epilogue
        return torch._addmm_activation(bu, x, wu.t(), use_gelu=True)

    out: dict[str, Any] = {}
    for rows in rows_list:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        ref = mlp_reference(x.float(), wu.float(), bu.float(), wd.float(), bd.float(), nw.float(), nb.float(), 1e-12)
        flop = 4 * rows * h * inner

        def engine() -> torch.Tensor:
            return add_norm(F.linear(up_gelu(x), wd, bd), x)

        up = up_gelu(x)
        down = F.linear(up, wd, bd)
        row: dict[str, Any] = {
            "tflop": round(flop / 1e12, 4),
            "engine": {"ms": graphed_ms(engine), "rel_error": relative_error(engine(), ref)},
            "parts_ms": {"up_gelu": graphed_ms(lambda: up_gelu(x)),
                         "down": graphed_ms(lambda: F.linear(up, wd, bd)),
                         "add_norm": graphed_ms(lambda: add_norm(down, x))},
            "reference_in_torch": {"ms": graphed_ms(lambda: mlp_reference(x, wu, bu, wd, bd, nw, nb, 1e-12))}}
        row["engine"]["tflops"] = round(flop / row["engine"]["ms"] / 1e9, 1)
        row["parts_ms"]["up_without_gelu"] = graphed_ms(lambda: F.linear(x, wu, bu))
        buf = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)
        for pieces in (2, 4, 8):  # the rows in pieces, each piece's 4x-wide intermediate small enough to stay in L2
            step = rows // pieces

            def chunked() -> torch.Tensor:
                for r0 in range(0, rows, step):
                    piece = up_gelu(x[r0:r0 + step])
                    torch.addmm(bd, piece, wd.t(), out=buf[r0:r0 + step])
                return add_norm(buf, x)

            row[f"engine_in_{pieces}_pieces"] = {"ms": graphed_ms(chunked), "rel_error": relative_error(chunked(), ref)}
        best = None
        for c in configs:
            key = "x".join(map(str, c))
            try:
                poison = torch.full_like(x, float("nan"))  # freed: the output's allocation reuses it
                del poison
                before = compiled_kernels(_encoder_mlp_kernel)
                out_ = fused_mlp(x, wu, bu, wd, bd, nw, nb, 1e-12, settings=c)
                new = [k for i, k in compiled_kernels(_encoder_mlp_kernel).items() if i not in before]
                entry = {"ms": graphed_ms(lambda: fused_mlp(x, wu, bu, wd, bd, nw, nb, 1e-12, settings=c)),
                         "rel_error": relative_error(out_, ref), "written": bool(torch.isfinite(out_).all())}
                entry["tflops"] = round(flop / entry["ms"] / 1e9, 1)
                if new:
                    entry["compiled"] = compiled_resources(new[0])
                row[key] = entry
                if entry["rel_error"] < 1e-2 and entry["written"] and (best is None or entry["ms"] < row[best]["ms"]):
                    best = key
            except Exception as e:  # a block shape this GPU cannot run says so
                row[key] = f"{type(e).__name__}: {str(e)[:200]}"
        row["best"] = best
        if best:
            c = tuple(int(v) for v in best.split("x"))
            row["best_vs_engine"] = round(row["engine"]["ms"] / row[best]["ms"], 3)
            row["best_without_norm"] = {
                "ms": graphed_ms(lambda: fused_mlp(x, wu, bu, wd, bd, None, None, 1e-12, settings=c)),
                "rel_error": relative_error(fused_mlp(x, wu, bu, wd, bd, None, None, 1e-12, settings=c),
                                            mlp_reference(x.float(), wu.float(), bu.float(), wd.float(), bd.float(),
                                                             None, None, 1e-12))}
            # fresh inputs: the same function on other data
            x2 = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16) * 2
            row["best_fresh_rel_error"] = relative_error(
                fused_mlp(x2, wu, bu, wd, bd, nw, nb, 1e-12, settings=c),
                mlp_reference(x2.float(), wu.float(), bu.float(), wd.float(), bd.float(), nw.float(), nb.float(), 1e-12))
        out[str(rows)] = row
        print(f"  mlp {rows} rows: engine {row['engine']} parts {row['parts_ms']} best {best} {row.get(best)}", flush=True)
        print("    " + " ".join(f"{k}={v['ms'] if isinstance(v, dict) else 'fail'}" for k, v in row.items()
                                 if k[0].isdigit()), flush=True)
        print("    " + json.dumps({k: v.get("compiled") for k, v in row.items() if k[0].isdigit() and isinstance(v, dict)}),
              flush=True)
    return out


def compiled_kernels(kernel: Any) -> dict[int, Any]:
    """The compiled variants of a Triton kernel in this process, by id."""
    try:
        return {id(c): c for caches in kernel.device_caches.values() for c in caches[0].values()}
    except Exception:  # the fields differ between Triton versions
        return {}


def compiled_resources(compiled: Any) -> dict[str, Any]:
    """Registers, spills, shared memory and the matrix instructions of one compiled Triton kernel."""
    try:
        compiled._init_handles()
        ptx = compiled.asm.get("ptx", "")
        meta = compiled.metadata
        return {"num_warps": meta.num_warps, "num_stages": meta.num_stages, "shared": meta.shared,
                "n_regs": compiled.n_regs, "n_spills": compiled.n_spills,
                "ptx_wgmma": ptx.count("wgmma.mma_async"), "ptx_mma_sync": ptx.count("mma.sync"),
                "ptx_local": ptx.count("ld.local") + ptx.count("st.local")}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def base_ops(path: Path) -> Any:
    """Another version of encoder_ops.py (its kernels and their launchers, not its torch ops), to time against."""
    import importlib.util
    import tempfile

    text = path.read_text()
    cut = text.index('@torch.library.custom_op("smelter::encoder_attention"')
    where = Path(tempfile.mkdtemp()) / "base_encoder_ops.py"
    where.write_text(text[:cut])
    spec = importlib.util.spec_from_file_location("base_encoder_ops", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention(shape: dict[str, int], configs: list[tuple[int, ...]], base: Any = None) -> dict[str, Any]:
    from tasks.backends.inductor import encoder_ops as ea

    batch, seq, hidden, heads = shape["batch"], shape["seq"], shape["hidden"], shape["heads"]
    torch.manual_seed(0)
    qkv = torch.randn(batch, seq, 3 * hidden, device="cuda", dtype=torch.bfloat16)
    masks = {"unpadded": torch.ones(batch, seq, device="cuda")}
    half = torch.ones(batch, seq, device="cuda")
    half[: batch // 2, seq * 3 // 4:] = 0  # as gpu_encoder_variants --own-kernels pads
    masks["half_rows_quarter_padded"] = half
    lengths = torch.randint(seq // 8, seq + 1, (batch,), generator=torch.Generator().manual_seed(1)).cuda()
    masks["random_lengths"] = (torch.arange(seq, device="cuda")[None, :] < lengths[:, None]).float()
    out: dict[str, Any] = {}
    for mname, mask in masks.items():
        key_bias = (1 - mask.bfloat16()) * torch.finfo(torch.bfloat16).min
        ref = ea.reference(qkv.float(), key_bias.float(), heads)
        row: dict[str, Any] = {"real_fraction": round(float(mask.mean()), 3),
                               "own": {"ms": graphed_ms(lambda: ea.attention(qkv, key_bias, heads)),
                                       "rel_error": relative_error(ea.attention(qkv, key_bias, heads), ref)},
                               "own_no_mask_ms": graphed_ms(lambda: ea.attention(qkv, None, heads))}
        if base is not None:
            row["base"] = {"ms": graphed_ms(lambda: base.attention(qkv, key_bias, heads)),
                           "rel_error": relative_error(base.attention(qkv, key_bias, heads), ref),
                           "same_as_own": bool(torch.equal(base.attention(qkv, key_bias, heads),
                                                           ea.attention(qkv, key_bias, heads)))}
            row["base_no_mask_ms"] = graphed_ms(lambda: base.attention(qkv, None, heads))
        for c in configs:
            for skip in (False, True):
                key = "x".join(map(str, c)) + ("_skip" if skip else "")
                try:
                    got = grouped_attention(qkv, key_bias, heads, c, skip)
                    row[key] = {"ms": graphed_ms(lambda: grouped_attention(qkv, key_bias, heads, c, skip)),
                                "rel_error": relative_error(got, ref)}
                except Exception as e:
                    row[key] = f"{type(e).__name__}: {str(e)[:300]}"
        out[mname] = row
        print(f"  attention {mname}: {json.dumps(row)}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--parts", default="products,attention")
    parser.add_argument("--base-ops", type=Path, help="part attention: an earlier encoder_ops.py whose kernel is timed too")
    parser.add_argument("--groups", action="store_true", help="part attention: the G-heads-per-program variants too")
    args = parser.parse_args()
    ceilings = {"gemm_bf16": gm.gemm_ceiling(), "copy": gm.copy_bandwidth()}
    report: dict[str, Any] = {"command": "python -m benchmarks.gpu_encoder_kernels " + " ".join(
                                  a for a in __import__("sys").argv[1:] if not a.startswith("/")),
                              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "gpu": torch.cuda.get_device_name(), "ceilings": ceilings}
    print(f"ceilings {json.dumps({k: v.get('tflops', v.get('tb_per_s')) for k, v in ceilings.items()})}", flush=True)
    parts = args.parts.split(",")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        section: dict[str, Any] = {}
        report[name] = section
        print(name, flush=True)
        for part in parts:
            try:
                with torch.no_grad():
                    if part == "products":
                        section[part] = products(shape, ceilings["gemm_bf16"]["tflops"], LINEAR_CONFIGS)
                    elif part == "norms":
                        section[part] = norms(shape)
                        print(f"  norms: {json.dumps(section[part])}", flush=True)
                    elif part == "mlp":
                        section[part] = mlp(shape, MLP_CONFIGS)
                    elif part == "mlp2":  # the second round's block shapes at 256 × 128 alone
                        section[part] = mlp(shape, MLP_CONFIGS_2, (32768,))
                    elif part == "attention":
                        section[part] = attention(shape, ATTENTION_CONFIGS if args.groups else [],
                                                  base_ops(args.base_ops) if args.base_ops else None)
            except Exception as e:  # the other parts still run
                section[part] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                print(f"  {part} failed: {section[part]}", flush=True)
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
