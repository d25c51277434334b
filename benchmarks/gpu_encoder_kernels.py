"""Candidate kernels for the encoder graph, each timed alone at BERT-base's 8 × 512 and MiniLM's 256 × 128 shapes.

For deciding, in one device call, which of smelter's own kernels could replace what the engine runs now:
- products: a persistent Triton product over TMA descriptors (bias, GELU's tanh form or a residual
  add in its epilogue; tiles walked so that the next tile's loads overlap this tile's epilogue), each
  block shape, against cuBLAS (F.linear; torch._addmm_activation with GELU for the up product);
- attention: smelter's kernel (encoder_ops) against a variant that takes G heads per program
  (3-D blocks: each row's G × head_dim values are contiguous in the qkv product's output) and against
  the same kernels skipping key blocks that lie wholly in a row's trailing padding;
- residual add + layer norm: Inductor's fused kernel (reads the product's output and the residual),
  against a norm that reads one tensor (the residual already added in the product's epilogue).

Every time is the median of one call among 20 replayed from a CUDA graph (no launch gaps), as
benchmarks/gpu_encoder_variants.py times smelter's attention alone.

Usage: python -m benchmarks.gpu_encoder_kernels --out kernels.json [--parts products,norms,attention]
       [--base-ops old_encoder_ops.py] [--groups]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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
                    elif part == "attention":
                        section[part] = attention(shape, ATTENTION_CONFIGS if args.groups else [],
                                                  base_ops(args.base_ops) if args.base_ops else None)
            except Exception as e:  # the other parts still run
                section[part] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                print(f"  {part} failed: {section[part]}", flush=True)
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
