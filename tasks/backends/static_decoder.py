"""One decode step of a Llama-family decoder over a static KV cache: the graph the inductor backend replays.

Built from the HF model's own weights, so it computes the same function, laid out for a step that
is bound by reading the weights: the q, k and v projections are one matrix, and so are gate and
up, so each layer reads its weights in four products instead of seven. The cache is passed in,
one K and one V tensor per layer (each [batch, kv_heads, max_len, head_dim]: slices of one big
tensor would make every layer's write a scatter into the whole cache), and written in place at
`pos`, so one exported graph serves every batch size and cache length, and a caller that keeps
the cache at fixed addresses can replay the step with CUDA graphs. Every row is at the same `pos`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def unsupported(config: Any) -> str | None:
    """Why this model has no static decode step here, or None."""
    archs = getattr(config, "architectures", None) or []
    if not any(a in ARCHITECTURES for a in archs):
        return f"the decode-step graph supports {', '.join(ARCHITECTURES)}; this model is {archs or 'unnamed'}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the decode-step graph supports hidden_act silu, not {config.hidden_act}"
    return None


class StaticDecoder(nn.Module):
    """logits[B, V] of the token after `tokens` (shape [B, 1]) at position `pos`, writing its K and V into the cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        problem = unsupported(config)
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
        self.register_buffer("inv_freq", body.rotary_emb.inv_freq.detach().float().clone(), persistent=True)
        self.rope_scale = float(getattr(body.rotary_emb, "attention_scaling", 1.0))
        self.layers = nn.ModuleList(_Layer(layer, self.heads, self.kv_heads, self.head_dim, self.eps)
                                    for layer in body.layers)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        x = F.embedding(tokens[:, 0], self.embed)
        freqs = pos.float() * self.inv_freq
        angles = torch.cat([freqs, freqs])
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        positions = torch.arange(k_caches[0].shape[2], device=tokens.device)
        mask = torch.where(positions <= pos, 0.0, float("-inf")).to(torch.float32)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), pos, mask, k_caches[i], v_caches[i])
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        attn, mlp = layer.self_attn, layer.mlp
        frozen = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731
        self.ln1 = frozen(layer.input_layernorm.weight)
        self.ln2 = frozen(layer.post_attention_layernorm.weight)
        self.qkv = frozen(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        biases = [getattr(p, "bias", None) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_bias = frozen(torch.cat(biases)) if all(b is not None for b in biases) else None
        self.o = frozen(attn.o_proj.weight)
        self.gate_up = frozen(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down = frozen(mlp.down_proj.weight)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_rms_norm(x, self.ln1, self.eps), self.qkv, self.qkv_bias)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = _rope(q.view(batch, h, d), cos, sin)
        k = _rope(k.view(batch, kvh, d), cos, sin)
        k_cache.index_copy_(2, pos.view(1), k.view(batch, kvh, 1, d))
        v_cache.index_copy_(2, pos.view(1), v.view(batch, kvh, 1, d))
        # The query heads that share a KV head form one small matrix, so each KV head's cache is read
        # once by a batched product. (Written as fused products and sums instead, batch 64 measured
        # 9.8 ms against this 14.7 ms, but in another run on which eager moved as much: undecided.)
        grouped = q.view(batch, kvh, h // kvh, d)
        scores = torch.matmul(grouped, k_cache.transpose(-1, -2)).float() * (d ** -0.5) + mask
        weights = torch.softmax(scores, dim=-1).to(x.dtype)
        attended = torch.matmul(weights, v_cache).reshape(batch, h * d)
        x = x + F.linear(attended, self.o)
        gate, up = F.linear(_rms_norm(x, self.ln2, self.eps), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


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
