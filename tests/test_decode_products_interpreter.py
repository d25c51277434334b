"""decode_products' fp8 rows path (quantize_input, then _rows_kernel on e4m3 x e4m3) without a GPU,
through Triton's interpreter on the CPU, or on a CUDA GPU where there is one.

The interpreter's float to e4m3 (and bf16) conversions are not exact (ties not to even, a carry lost), so
the exact checks use values that need no rounding; the fused input kernel is checked against the
plain one, which rounds by the same conversion.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = [
    pytest.mark.skipif(triton is None, reason="Triton is not installed here (it comes with CUDA torch); run with "
                                              "TRITON_INTERPRET=1 and triton on PYTHONPATH"),
    pytest.mark.skipif(triton is not None and DEVICE == "cpu" and not INTERPRET,
                       reason="no CUDA GPU; run with TRITON_INTERPRET=1 for Triton's interpreter on the CPU")]


def ints(*shape: int, top: int, generator: torch.Generator) -> torch.Tensor:
    """Integers in [-top, top] as fp32: exact in e4m3 up to 16, their sums exact in fp32."""
    return torch.randint(-top, top + 1, shape, generator=generator).float()


def powers_of_two(n: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """n powers of two, 2^low to 2^high: scales that round nothing."""
    return 2.0 ** torch.randint(low, high + 1, (n,), generator=generator).float()


@pytest.mark.parametrize("k", [304, 300])
def test_rows_with_a_power_of_two_scale_quantise_exactly(k: int) -> None:
    """A row whose largest magnitude is 448·2^j has scale 2^j, and each of its values, an e4m3
    value times 2^j, comes out as that e4m3 value (k 300: the row's tail masked)."""
    from tasks.backends.inductor import decode_products as dp

    g = torch.Generator().manual_seed(0)
    rows = 17
    values = ints(rows, k, top=16, generator=g)
    values[torch.arange(rows), torch.randint(0, k, (rows,), generator=g)] = torch.where(
        torch.arange(rows) % 2 == 0, 448.0, -448.0)
    powers = powers_of_two(rows, -12, 3, g)
    quantised, scale = dp.quantize_input((values * powers[:, None]).to(DEVICE, torch.bfloat16))
    assert quantised.dtype == dp.FP8 and quantised.shape == (rows, k) and scale.shape == (rows,)
    assert torch.equal(scale.cpu(), powers) and torch.equal(quantised.float().cpu(), values)


@pytest.mark.parametrize("mode", ["gated", "norm"])
def test_the_fused_input_rounds_as_the_input_kernels_do(mode: str) -> None:
    """quantize_input's silu(gate) * up and rms_norm equal prepared_input's, bit for bit, once both
    are quantised (the same conversion rounds both)."""
    from tasks.backends.inductor import decode_products as dp

    torch.manual_seed(0)
    rows, k = 24, 304
    x = torch.randn(rows, 2 * k if mode == "gated" else k, device=DEVICE).to(torch.bfloat16)
    options = {"gated": mode == "gated", "norm": (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
               if mode == "norm" else None, "eps": 1e-5}
    fused, fused_scale = dp.quantize_input(x, **options)
    plain, plain_scale = dp.quantize_input(dp.prepared_input(x, **options))
    assert torch.equal(fused_scale, plain_scale)
    assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8))


@pytest.mark.parametrize("rows, n, k", [(17, 1000, 304), (64, 96, 256), (40, 48, 100)])
def test_the_fp8_rows_kernel_is_exact_on_exact_values(rows: int, n: int, k: int) -> None:
    """_rows_kernel on e4m3 x (one scale per row) and e4m3 weights (one per channel), the output
    and the residual in fp32: small integers, powers of two as scales and a residual of sixteenths
    round nothing (sums under 2^13, even in the H200's fp8 accumulation), so it equals the exact
    product (odd n and k: the masks)."""
    from tasks.backends.inductor import decode_products as dp

    g = torch.Generator().manual_seed(1)
    x, w = ints(rows, k, top=4, generator=g), ints(n, k, top=4, generator=g)
    x_scale, scale = powers_of_two(rows, -2, 2, g), powers_of_two(n, -8, -5, g)
    residual = ints(rows, n, top=64, generator=g) / 16
    exact = (x @ w.t()) * x_scale[:, None] * scale[None, :] + residual
    x, w, x_scale, scale, residual = (t.to(DEVICE) for t in (x, w, x_scale, scale, residual))
    got = dp.rows_product(x.to(dp.FP8), w.to(dp.FP8), scale, residual, x_scale=x_scale, dtype=torch.float32).cpu()
    print(f"rows {rows} n {n} k {k}: max abs error {float((got - exact).abs().max()):.3g}")
    assert torch.equal(got, exact)


@pytest.mark.parametrize("rows", [17, 64, 65])
def test_e4m3_weights_meet_e4m3_rows_in_the_rows_kernel_then_in_cublas(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_linear on e4m3 weights (the thresholds as shipped) goes through quantized_rows_product
    at 17 to 64 rows, fp8_rows_product (cuBLAS) at 65: either is the product of the e4m3 rows that quantize_input
    makes, within the output's bf16 rounding, and near the reference (the activations rounded to
    e4m3: 0.06) where the rounding to e4m3 is exact, not in the interpreter (about 0.065 there,
    0.027 rounded exactly)."""
    from tasks.backends.inductor import decode_products as dp

    calls: list[int] = []
    product = dp.quantized_rows_product
    monkeypatch.setattr(dp, "_fast_path", lambda x, weight: True)
    monkeypatch.setitem(dp.ROWS_KERNEL_ROWS, 1, 16)
    monkeypatch.setattr(dp, "FP8_ROWS_KERNEL_ROWS", 64)
    monkeypatch.setattr(dp, "quantized_rows_product", lambda *a, **kw: calls.append(1) or product(*a, **kw))
    torch.manual_seed(0)
    n, k = 208, 304  # cuBLAS's fp8 product needs sizes divisible by 16
    x = torch.randn(rows, 2 * k, device=DEVICE).to(torch.bfloat16)
    weight, scale = dp.quantize_weight(torch.randn(n, k, device=DEVICE) * 0.02)
    norm = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
    residual = torch.randn(rows, n, device=DEVICE).to(torch.bfloat16)
    for mode in ("plain", "gated", "norm"):
        inputs = x if mode == "gated" else x[:, :k] * 3
        options = {"gated": mode == "gated", "norm": norm if mode == "norm" else None, "eps": 1e-5}
        quantised, row_scale = dp.quantize_input(inputs, **options)
        of_rows = (quantised.float() * row_scale[:, None]) @ weight.float().t() * scale
        for r in (None, residual):
            truth = dp.reference(inputs.float(), weight.float(), scale, **{
                key: v.float() if isinstance(v, torch.Tensor) else v for key, v in options.items()},
                residual=r.float() if r is not None else None)
            got = dp.decode_linear(inputs, weight, scale, residual=r, **options).float()
            own = of_rows + r.float() if r is not None else of_rows
            error, own_error = (float((got - t).norm() / t.norm()) for t in (truth, own))
            print(f"rows {rows} {mode} residual {r is not None}: relative error {error:.2e}, "
                  f"{own_error:.2e} vs the product of its e4m3 rows")
            assert torch.isfinite(got).all() and own_error < 1e-2
            assert INTERPRET or error < 0.06
    assert len(calls) == (6 if rows <= 64 else 0)
