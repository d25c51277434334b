"""e4m3 products through torch._scaled_mm, shared by smelter's Llama-family and encoder graphs, and the two
measurements an fp8 build takes on calibration text: each product's largest input (static scales) and what
each product alone in e4m3 does to the graph's output (which products to keep in bf16).

Products run in torch._scaled_mm's row-wise recipe (one scale per row of the input, one per output
channel of the weight): on the H200, cuBLAS's kernels for it took 4.9 ms over a Llama-3.2-1B prefill's
56 fp8 products where its one-scale-per-tensor kernels took 6.2 ms. A static input scale is folded into
the weight's channel scales, and the rows' scales are then all 1.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]  # (input_ids, attention_mask) on the model's device


_BIAS_INSIDE: dict[torch.device, bool] = {}  # whether torch._scaled_mm adds the bias in its epilogue here


@torch.library.custom_op("smelter::scaled_mm", mutates_args=())
def scaled_mm(quantised: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None,
              channel_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """quantised [M, K] e4m3 times weight [N, K] e4m3, each row scaled by row_scale [M, 1] (None: 1s) and each
    output channel by channel_scale [1, N], plus bias [N], into bf16 [M, N]; opaque to Inductor:
    max-autotune would time Triton templates for every fp8 shape (154 s for one on an H200), and an
    encoder's attention, opaque too, could not take the bias add into its kernel (a pass over the qkv
    product's output per layer: 12 µs at BERT-base 8 × 512 on an H100)."""
    # (ones made here, not passed in: Inductor would fill one tensor per product all the same; nor kept
    # between calls: CUDA-graph trees refuse a tensor their pool holds that no output owns)
    rows = row_scale if row_scale is not None else quantised.new_ones(quantised.shape[0], 1, dtype=torch.float32)
    if bias is not None and _BIAS_INSIDE.get(quantised.device, True):
        try:
            return torch._scaled_mm(quantised, weight.t(), scale_a=rows, scale_b=channel_scale, bias=bias,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)
        except RuntimeError:  # this torch's recipe takes no bias with these scales: add it after
            _BIAS_INSIDE[quantised.device] = False
    out = torch._scaled_mm(quantised, weight.t(), scale_a=rows, scale_b=channel_scale, out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    return out if bias is None else out + bias


@scaled_mm.register_fake
def _scaled_mm_shape(quantised: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None,
                     channel_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return quantised.new_empty(quantised.shape[0], weight.shape[0], dtype=torch.bfloat16)


class Fp8Linear(nn.Module):
    """One weight matrix: applied as is, or in e4m3 with per-token input scales (computed as each input
    arrives: nothing clipped, but the input is read twice) or a static one (`input_scale`, from
    calibration: quantising is a pointwise step Inductor fuses into the kernel before it; values past
    the calibrated range are clipped). `opaque`: the fp8 product through smelter::scaled_mm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8: bool, input_scale: float | None = None,
                 opaque: bool = False):
        super().__init__()
        self.fp8, self.opaque = fp8, opaque
        weight = weight.detach()
        self.register_buffer("inv_input_scale", None)
        if fp8:
            scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            self.weight = nn.Parameter((weight.float() / scale).to(FP8), requires_grad=False)
            if input_scale is not None:
                self.register_buffer("inv_input_scale", torch.tensor(1 / input_scale, device=weight.device))
                scale = scale * input_scale
            self.register_buffer("scale", scale.view(1, -1).contiguous())
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.scale = None
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor, unit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`unit_rows`: ones [rows, 1] in fp32, the row scales of a static product; one tensor shared by
        every product of a forward saves each its own fill (an opaque product makes its own)."""
        if not self.fp8:
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        out_dtype = x.dtype
        if x.dtype == FP8:  # already scaled by inv_input_scale and rounded (encoder_ops' attention does it)
            if self.inv_input_scale is None:
                raise ValueError("an e4m3 input needs a static product (one with an input scale)")
            quantised, row_scale, out_dtype = rows, unit_rows, torch.bfloat16
        elif self.inv_input_scale is not None:
            quantised = (rows.float() * self.inv_input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            row_scale = unit_rows
        else:
            row_scale = rows.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            quantised = (rows.float() / row_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if self.opaque and out_dtype == torch.bfloat16:
            y = torch.ops.smelter.scaled_mm(quantised, self.weight, row_scale, self.scale, self.bias)
        else:
            if row_scale is None:
                row_scale = rows.new_ones(rows.shape[0], 1, dtype=torch.float32)
            y = torch._scaled_mm(quantised, self.weight.t(), scale_a=row_scale, scale_b=self.scale,
                                 out_dtype=out_dtype, use_fast_accum=True)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def layer_products(layers: int, products: tuple[str, ...], fp8: bool, kept: Collection[str] = (),
                   input_scales: Mapping[str, float] | None = None) -> list[dict[str, float | None]]:
    """For each layer, the products a graph runs in e4m3 (every one of `products` when `fp8`, but those
    `kept` names: layers.<i>.<product>), each with its static input scale (None: per token); refuses a
    kept name of no product and static scales that miss a quantised product."""
    names = [f"layers.{i}.{product}" for i in range(layers) for product in products]
    unknown = sorted(set(kept) - set(names))
    if unknown:
        raise ValueError(f"no such products {unknown}: this model's are layers.0-{layers - 1}.{'/'.join(products)}")
    quantised = [name for name in names if fp8 and name not in kept]
    unscaled = sorted(set(quantised) - set(input_scales)) if input_scales is not None else []
    if unscaled:
        raise ValueError(f"static fp8 scales are missing for {unscaled[:4]}{' ...' if len(unscaled) > 4 else ''}")
    return [{p: (input_scales or {}).get(f"layers.{i}.{p}") for p in products if f"layers.{i}.{p}" in quantised}
            for i in range(layers)]


def input_amax(products: Mapping[str, nn.Module], run: Callable[[torch.Tensor, torch.Tensor], Any],
               batches: Batches) -> dict[str, float]:
    """Each product's largest input magnitude over the real tokens of `batches`, `run(ids, mask)` calling
    the unquantised graph that holds them: ModelOpt's `max` calibration, what static scales are set from."""
    amax: dict[str, torch.Tensor] = {}
    real: list[torch.Tensor] = []  # the current batch's real tokens, one flag per row of a product's input

    def observe(name: str) -> Any:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            rows = args[0].reshape(-1, args[0].shape[-1])[real[0]]
            if rows.numel():
                value = rows.abs().amax().float()
                amax[name] = torch.maximum(amax[name], value) if name in amax else value
        return hook

    handles = [module.register_forward_pre_hook(observe(name)) for name, module in products.items()]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                real[:] = [mask.reshape(-1).bool()]
                run(ids, mask)
    finally:
        for handle in handles:
            handle.remove()
    if len(amax) < len(handles):
        raise ValueError("fp8 calibration: the calibration feeds hold no real tokens")
    return {name: float(value) for name, value in amax.items()}


def product_errors(products: Mapping[str, tuple[nn.Module, str]], batches: Batches,
                   output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], width: int,
                   squared: Callable[[torch.Tensor], torch.Tensor] = lambda change: change.square().sum(),
                   input_scales: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each product's fp8 error as the graph's output sees it: the mean squared change of each of `width`
    output values at every real token of `batches` when that product alone (`products`: name -> (module
    holding it, attribute)) runs in e4m3 (with `input_scales`, else per-token scales). `output(ids, mask)`
    gives [real tokens, ...] in fp32 and `squared(change)` the change's summed square. Independent rounding
    errors add up, so these say what keeping each product in bf16 buys (llama_support.keep_sensitive)."""
    batches = list(batches)
    errors: dict[str, float] = {}
    with torch.no_grad():
        reference = [output(ids, mask) for ids, mask in batches]
        entries = sum(r.shape[0] for r in reference) * width
        if not entries:
            raise ValueError("fp8 sensitivity: the calibration feeds hold no real tokens")
        for name, (holder, attribute) in products.items():
            exact = getattr(holder, attribute)
            scale = input_scales[name] if input_scales is not None else None
            setattr(holder, attribute, Fp8Linear(exact.weight, exact.bias, fp8=True, input_scale=scale))
            try:
                total = sum(float(squared(output(ids, mask) - expected))
                            for (ids, mask), expected in zip(batches, reference))
            finally:
                setattr(holder, attribute, exact)
            errors[name] = total / entries
    return errors
