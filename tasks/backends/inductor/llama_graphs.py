"""Llama-family graphs the inductor backend exports: a prefill over whole prompts and one decode step.

Built from the HF model's own weights, so they compute the same function, laid out for the GPU:
the q, k and v projections are one matrix, and so are gate and up, so each layer runs four
products instead of seven (one activation quantisation each, in fp8).

- Prefill (`LlamaPrefill`): causal attention through SDPA's fused kernel, no mask tensor. Prompts
  are right-padded (real tokens first, as smelter's feeds are): a causal model's real tokens never
  see the padding after them, so the result at each row's last real token is exact. Only that
  token's logits are computed, as generation needs.
- Decode step (`StaticDecoder`): the cache is passed in, one K and one V tensor per layer (each
  [batch, kv_heads, max_len, head_dim]: slices of one big tensor would make every layer's write a
  scatter into the whole cache), and written in place at `pos`, so one exported graph serves every
  batch size and cache length, and a caller that keeps the cache at fixed addresses can replay the
  step with CUDA graphs. Every row is at the same `pos`.

fp8 (`fp8=True`, prefill only: its products are bound by arithmetic): products run in e4m3 through
`torch._scaled_mm` into bf16, scaled one of two ways:
- per token (default): one scale per weight output channel, and each activation row's scale
  computed as it arrives: no calibration, nothing clipped, but each product's input is read twice
  (its maximum, then its quantisation);
- static (`input_scales`, from `calibrate_input_amax` on real text): one scale per product input,
  fixed at build, so quantising an input is a pointwise step fused into the kernel that produces
  it. A value past the calibrated range is clipped to it. e4m3 is a floating format, so one scale
  for all tokens costs precision only for values 2^15 below the largest.
Norms, attention, the embedding and the LM head stay bf16, and so do the products named in `kept`
(llama_support.product_names). The decode step reads weights, so its products are bound by their
bytes: they run through `smelter::decode_linear` (decode_products.py), which also takes in the
norm before a product, the MLP's silu(gate) * up and the residual add after it (at batch 1 inside
the product's kernel), with e4m3 weights and one scale per output channel where asked
(`StaticDecoder(fp8_weights=True)`: weight-only at small batch, the activations staying bf16), which
halves the bytes a step reads; its attention runs through `smelter::decode_attention`, one kernel
that rotates q and reads each KV head's cache once.

Rotary cos/sin come from one op per graph (`smelter::rope`), which Inductor cannot see into: it
would otherwise inline the cheap-looking table into every layer's q and k kernels, evaluating cos
and sin per element of q and k (on the H200 those kernels ran at a third of copy bandwidth).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# (importing decode_products also registers smelter::decode_linear and decode_attention, which decode graphs call)
from tasks.backends.inductor import decode_products
from tasks.backends.inductor.decode_products import rms_norm
from tasks.backends.inductor.fp8_linear import Fp8Linear, input_amax, layer_products, product_errors
from tasks.backends.inductor.llama_support import PRODUCTS, fp8_unsupported, unsupported

@torch.library.custom_op("smelter::rope", mutates_args=())
def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [*positions.shape, 2 * len(inv_freq)] of the rotary angles, as HF computes them."""
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


@rope_table.register_fake
def _rope_table_shape(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    return (positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32))


class _Rope(nn.Module):
    """Rotary angles from the model's own inv_freq (llama3 or any other scaling already folded in)."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=True)
        self.scale = float(getattr(rotary, "attention_scaling", 1.0))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_table(positions, self.inv_freq, self.scale)
        return cos.to(dtype), sin.to(dtype)


class _Body(nn.Module):
    """What both graphs share: embedding, layers, final norm, LM head."""

    def __init__(self, model: nn.Module, fp8: bool, kept: Collection[str] = (),
                 input_scales: Mapping[str, float] | None = None):
        super().__init__()
        config = model.config
        problem = fp8_unsupported(config) if fp8 else unsupported(config)
        if problem:
            raise ValueError(problem)
        body = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embed = nn.Parameter(body.embed_tokens.weight.detach(), requires_grad=False)
        self.lm_head = nn.Parameter(model.lm_head.weight.detach(), requires_grad=False)
        self.norm = nn.Parameter(body.norm.weight.detach(), requires_grad=False)
        self.rope = _Rope(body.rotary_emb)
        fp8_products = layer_products(len(body.layers), PRODUCTS, fp8, kept, input_scales)
        self.layers = nn.ModuleList(_Layer(layer, self.heads, self.kv_heads, self.head_dim, self.eps, products)
                                    for layer, products in zip(body.layers, fp8_products))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.norm, self.eps), self.lm_head)


class LlamaPrefill(_Body):
    """logits[B, V] of the token after each row's last real token (attention_mask: 1s then 0s)."""

    def __init__(self, model: nn.Module, fp8: bool = False, kept: Collection[str] = (),
                 input_scales: Mapping[str, float] | None = None):
        super().__init__(model, fp8, kept, input_scales)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.hidden(input_ids)
        last = attention_mask.sum(dim=1).clamp(min=1) - 1
        return self.logits(x[torch.arange(x.shape[0], device=x.device), last])

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last layer's output [B, S, hidden] at every position (before the final norm)."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(torch.arange(input_ids.shape[1], device=input_ids.device), x.dtype)
        # (from the shape, not numel(): a loaded program's sym_numel breaks torch.compile's graph in two)
        unit_rows = x.new_ones(x.shape[0] * x.shape[1], 1, dtype=torch.float32)
        for layer in self.layers:
            x = layer.prefill(x, cos, sin, unit_rows)
        return x


def calibrate_input_amax(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Each product's largest input magnitude (llama_support.product_names) over the real tokens of
    `batches` ((input_ids, attention_mask) on the model's device), through the unquantised prefill:
    ModelOpt's `max` calibration, what static fp8 scales are set from."""
    graph = LlamaPrefill(model).eval()
    products = {f"layers.{i}.{product}": getattr(layer, product)
                for i, layer in enumerate(graph.layers) for product in PRODUCTS}
    return input_amax(products, graph, batches)


def fp8_sensitivity(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    input_scales: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each product's fp8 error as the logits see it: the mean squared change of every logit at every
    real token of `batches` ((input_ids, attention_mask) on the model's device) when that product
    alone runs in e4m3 (with `input_scales`, else per-token scales): fp8_linear.product_errors.

    The logits' change is the final norm's change dh times the LM head W, so its squared sum over the
    vocabulary is dh·(WᵀW)·dh: no [tokens, vocab] tensor is made."""
    graph = LlamaPrefill(model).eval()
    head = graph.lm_head.float()
    gram = head.t() @ head

    def final_norm(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return rms_norm(graph.hidden(ids), graph.norm, graph.eps)[mask.bool()].float()

    products = {f"layers.{i}.{product}": (layer, product)
                for i, layer in enumerate(graph.layers) for product in PRODUCTS}
    return product_errors(products, batches, final_norm, head.shape[0], lambda change: ((change @ gram) * change).sum(),
                          input_scales)


class _DecodeLinear(nn.Module):
    """One weight matrix of the decode step, read through `smelter::decode_linear`
    (decode_products.py): bf16 as is, or e4m3 with one scale per output channel (half the bytes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8: bool):
        super().__init__()
        weight = weight.detach()
        if fp8:
            quantised, scale = decode_products.quantize_weight(weight)
            self.weight = nn.Parameter(quantised, requires_grad=False)
            self.register_buffer("scale", scale)
        else:
            self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            self.scale = None
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor, unit_rows: torch.Tensor | None = None, gated: bool = False,
                norm: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The product of silu(gate) * up of x (`gated`: x is the gate_up product's output) or of
        rms_norm(x, norm, eps), plus `residual`: computed inside the product's kernels where they can."""
        rows = x.reshape(-1, x.shape[-1])
        if residual is not None:
            residual = residual.reshape(-1, residual.shape[-1])
        y = torch.ops.smelter.decode_linear(rows, self.weight, self.scale, gated, norm, eps, residual)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


DECODE_PRODUCTS = ("torch", "smelter")


class StaticDecoder(_Body):
    """logits[B, V] of the token after `tokens` (shape [B, 1]) at position `pos`, writing its K and V into the cache.

    `products`: "torch" runs the products as F.linear on the model's weights and the attention with
    torch operations; "smelter" through smelter's decode ops (decode_products.py: weight-streaming
    Triton kernels at decode batches, the norms, the MLP's silu(gate) * up and the residual adds
    taken into the products, and one attention kernel that rotates q and reads each KV head's
    cache once up to `pos`), which
    `fp8_weights` requires: every layer product except those named in `kept` (and, with
    `fp8_head`, the LM head) then holds e4m3 weights with per-channel scales, half the bytes a step reads."""

    def __init__(self, model: nn.Module, products: str = "torch", fp8_weights: bool = False,
                 kept: Collection[str] = (), fp8_head: bool = False):
        super().__init__(model, fp8=False)
        if products not in DECODE_PRODUCTS:
            raise ValueError(f"decode products are {' or '.join(DECODE_PRODUCTS)}, not {products!r}")
        if (fp8_weights or fp8_head) and products != "smelter":
            raise ValueError("fp8 decode weights are read through products='smelter'")
        self.products = products
        if products == "smelter":
            for i, layer in enumerate(self.layers):
                for product in PRODUCTS:
                    exact = getattr(layer, product)
                    fp8 = fp8_weights and f"layers.{i}.{product}" not in kept
                    setattr(layer, product, _DecodeLinear(exact.weight, exact.bias, fp8))
                layer.decode_ops = True
            self.head = _DecodeLinear(self.lm_head, None, fp8_head)
            del self.lm_head  # the head's weights live in self.head (a tied embedding stays in self.embed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.products == "torch":
            return super().logits(x)
        return self.head(x, norm=self.norm, eps=self.eps)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        x = F.embedding(tokens[:, 0], self.embed)
        cos, sin = self.rope(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.step(x, cos, sin, pos, k_caches[i], v_caches[i])
        return self.logits(x)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, eps: float,
                 fp8_products: dict[str, float | None]):
        """fp8_products: the products run in e4m3, each with its static input scale (None: per token)."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.decode_ops = False  # the decode step through smelter's ops (StaticDecoder products="smelter")
        attn, mlp = layer.self_attn, layer.mlp
        frozen = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731
        self.ln1 = frozen(layer.input_layernorm.weight)
        self.ln2 = frozen(layer.post_attention_layernorm.weight)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [getattr(p, "bias", None) for p in projections]
        def linear(product: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
            return Fp8Linear(weight, bias, product in fp8_products, fp8_products.get(product))

        self.qkv = linear("qkv", torch.cat([p.weight for p in projections]),
                          torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o = linear("o", attn.o_proj.weight)
        self.gate_up = linear("gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down = linear("down", mlp.down_proj.weight)

    def _mlp(self, x: torch.Tensor, unit_rows: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = self.gate_up(rms_norm(x, self.ln2, self.eps), unit_rows)
        return x + self.down(decode_products.gate(gate_up), unit_rows)

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unit_rows: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] -> the layer's output, causal attention over the whole prompt."""
        batch, seq = x.shape[:2]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(rms_norm(x, self.ln1, self.eps), unit_rows).split([h * d, kvh * d, kvh * d], dim=-1)
        q = decode_products.rotate(q.view(batch, seq, h, d).transpose(1, 2), cos, sin)
        k = decode_products.rotate(k.view(batch, seq, kvh, d).transpose(1, 2), cos, sin)
        v = v.view(batch, seq, kvh, d).transpose(1, 2)
        # Query heads that share a KV head read it in place (enable_gqa). On the H200 (8x512, Llama-3.2-1B
        # heads), cuDNN's and flash's causal kernels took 0.056 and 0.064 ms per layer this way, and
        # 0.083 and 0.108 ms with K and V repeated to the query heads' count, which also has the
        # rotary kernel write 4x more.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kvh)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, h * d), unit_rows)
        return self._mlp(x, unit_rows)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] of one new token at `pos` -> the layer's output; writes K and V at `pos`."""
        batch = x.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        # smelter's ops take the norms, the MLP's pointwise step and the residual adds into the products
        if self.decode_ops:
            qkv = self.qkv(x, norm=self.ln1, eps=self.eps)
        else:
            qkv = self.qkv(rms_norm(x, self.ln1, self.eps))
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        k = decode_products.rotate(k.view(batch, kvh, d), cos, sin)
        k_cache.index_copy_(2, pos.view(1), k.view(batch, kvh, 1, d))
        v_cache.index_copy_(2, pos.view(1), v.view(batch, kvh, 1, d))
        if not self.decode_ops:
            return self._mlp(x + self.o(decode_products.attention_reference(q, cos, sin, k_cache, v_cache, pos)))
        x = self.o(torch.ops.smelter.decode_attention(q, cos, sin, k_cache, v_cache, pos), residual=x)
        return self.down(self.gate_up(x, norm=self.ln2, eps=self.eps), gated=True, residual=x)


def empty_cache(model_config: Any, batch: int, max_len: int, dtype: torch.dtype,
                device: torch.device | str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V caches for `batch` sequences of up to `max_len` tokens, random values, not zeros."""
    heads = model_config.num_attention_heads
    kv_heads = model_config.num_key_value_heads or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    shape = (batch, kv_heads, max_len, head_dim)

    def layers() -> list[torch.Tensor]:
        return [torch.randn(shape, dtype=dtype, device=device) * 0.1 for _ in range(model_config.num_hidden_layers)]
    return layers(), layers()
