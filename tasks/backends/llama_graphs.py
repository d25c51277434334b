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

fp8 (`fp8=True`, prefill only: its products are bound by arithmetic): each layer's weights are
e4m3 with one scale per output channel, activations are quantised per token as they arrive, and
products run through `torch._scaled_mm` into bf16. Norms, attention, the embedding and the LM head
stay bf16, and so do the products named in `kept` (llama_support.product_names).
The decode step reads weights, so it stays in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tasks.backends.llama_support import PRODUCTS, fp8_unsupported, product_names, unsupported

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class _Linear(nn.Module):
    """One weight matrix: applied as is, or as e4m3 with per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8: bool):
        super().__init__()
        self.fp8 = fp8
        weight = weight.detach()
        if fp8:
            scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            self.weight = nn.Parameter((weight.float() / scale[:, None]).to(FP8), requires_grad=False)
            self.register_buffer("scale", scale.view(1, -1).contiguous())
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.scale = None
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        scale = rows.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        quantised = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        y = torch._scaled_mm(quantised, self.weight.t(), scale_a=scale, scale_b=self.scale, out_dtype=x.dtype,
                             use_fast_accum=True)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class _Rope(nn.Module):
    """Rotary angles from the model's own inv_freq (llama3 or any other scaling already folded in)."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=True)
        self.scale = float(getattr(rotary, "attention_scaling", 1.0))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


class _Body(nn.Module):
    """What both graphs share: embedding, layers, final norm, LM head."""

    def __init__(self, model: nn.Module, fp8: bool, kept: Collection[str] = ()):
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
        unknown = sorted(set(kept) - set(product_names(len(body.layers))))
        if unknown:
            raise ValueError(f"no such products {unknown}: this model's are layers.0-{len(body.layers) - 1}."
                             f"{'/'.join(PRODUCTS)}")
        self.layers = nn.ModuleList(
            _Layer(layer, self.heads, self.kv_heads, self.head_dim, self.eps,
                   {p for p in PRODUCTS if fp8 and f"layers.{i}.{p}" not in kept})
            for i, layer in enumerate(body.layers))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head)


class LlamaPrefill(_Body):
    """logits[B, V] of the token after each row's last real token (attention_mask: 1s then 0s)."""

    def __init__(self, model: nn.Module, fp8: bool = False, kept: Collection[str] = ()):
        super().__init__(model, fp8, kept)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(torch.arange(input_ids.shape[1], device=input_ids.device), x.dtype)
        for layer in self.layers:
            x = layer.prefill(x, cos, sin)
        last = attention_mask.sum(dim=1).clamp(min=1) - 1
        return self.logits(x[torch.arange(x.shape[0], device=x.device), last])


class StaticDecoder(_Body):
    """logits[B, V] of the token after `tokens` (shape [B, 1]) at position `pos`, writing its K and V into the cache."""

    def __init__(self, model: nn.Module):
        super().__init__(model, fp8=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        x = F.embedding(tokens[:, 0], self.embed)
        cos, sin = self.rope(pos, x.dtype)
        positions = torch.arange(k_caches[0].shape[2], device=tokens.device)
        mask = torch.where(positions <= pos, 0.0, float("-inf")).to(torch.float32)
        for i, layer in enumerate(self.layers):
            x = layer.step(x, cos, sin, pos, mask, k_caches[i], v_caches[i])
        return self.logits(x)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, eps: float,
                 fp8_products: set[str]):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        attn, mlp = layer.self_attn, layer.mlp
        frozen = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731
        self.ln1 = frozen(layer.input_layernorm.weight)
        self.ln2 = frozen(layer.post_attention_layernorm.weight)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [getattr(p, "bias", None) for p in projections]
        self.qkv = _Linear(torch.cat([p.weight for p in projections]),
                           torch.cat(biases) if all(b is not None for b in biases) else None, "qkv" in fp8_products)
        self.o = _Linear(attn.o_proj.weight, None, "o" in fp8_products)
        self.gate_up = _Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, "gate_up" in fp8_products)
        self.down = _Linear(mlp.down_proj.weight, None, "down" in fp8_products)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(_rms_norm(x, self.ln2, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] -> the layer's output, causal attention over the whole prompt."""
        batch, seq = x.shape[:2]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(_rms_norm(x, self.ln1, self.eps)).split([h * d, kvh * d, kvh * d], dim=-1)
        q = _rope(q.view(batch, seq, h, d).transpose(1, 2), cos, sin)
        k = _rope(k.view(batch, seq, kvh, d).transpose(1, 2), cos, sin)
        v = v.view(batch, seq, kvh, d).transpose(1, 2)
        # Query heads that share a KV head read it in place (enable_gqa). On the H200 (8x512, Llama-3.2-1B
        # heads), cuDNN's and flash's causal kernels took 0.056 and 0.064 ms per layer this way, and
        # 0.083 and 0.108 ms with K and V repeated to the query heads' count, which also has the
        # rotary kernel write 4x more.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kvh)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, h * d))
        return self._mlp(x)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] of one new token at `pos` -> the layer's output; writes K and V at `pos`."""
        batch = x.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(_rms_norm(x, self.ln1, self.eps)).split([h * d, kvh * d, kvh * d], dim=-1)
        q = _rope(q.view(batch, h, d), cos, sin)
        k = _rope(k.view(batch, kvh, d), cos, sin)
        k_cache.index_copy_(2, pos.view(1), k.view(batch, kvh, 1, d))
        v_cache.index_copy_(2, pos.view(1), v.view(batch, kvh, 1, d))
        # The query heads that share a KV head form one small matrix, so each KV head's cache is read
        # once by a batched product.
        grouped = q.view(batch, kvh, h // kvh, d)
        scores = torch.matmul(grouped, k_cache.transpose(-1, -2)).float() * (d ** -0.5) + mask
        weights = torch.softmax(scores, dim=-1).to(x.dtype)
        attended = torch.matmul(weights, v_cache).reshape(batch, h * d)
        return self._mlp(x + self.o(attended))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, scale in the model's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
