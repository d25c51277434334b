"""BERT-family encoder graph the inductor backend exports: the last hidden state of every token.

Built from the HF model's own weights, so it computes the same function, laid out for the GPU:
- q, k and v are one product (a 4096 × 768 × 2304 product keeps an H100 busier than three of
  768 columns);
- attention reads q, k and v where the qkv product wrote them and writes the o product's input:
  with `own_attention`, smelter's Triton kernel (tasks/backends/inductor/encoder_ops.py;
  on an H100 55 µs a layer at MiniLM's 256 × 128 against SDPA's 82, 26 against 32 at BERT-base's
  8 × 512), else SDPA's fused kernels. Padding is a key bias of [batch, seq] (broadcast over heads
  and queries; SDPA gets it as [batch, 1, 1, seq]), not HF's [batch, 1, seq, seq] mask; with
  `padding=False` the graph takes no mask at all. A runner uses that graph only for feeds whose
  attention_mask is all ones (`has_padding`);
- with `cublas_products` the qkv and down products run through cuBLAS always (smelter::cublas_linear),
  not through whichever of Inductor's Triton templates max-autotune times fastest alone (slower for
  them in the whole forward); the o product stays Inductor's choice (a Triton template in every run);
- bias adds, the residual adds and the layer norms are plain pointwise and reduction ops, which
  Inductor fuses into the products' epilogues or one kernel after them; with `gelu_epilogue` the
  up product's GELU runs in cuBLASLt's epilogue (torch._addmm_activation: GELU's tanh form, which
  differs from erf's by under 5e-4, less than bf16 rounds to), so its 4 × hidden-wide output is
  written once instead of written, read and written again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# importing it registers smelter::encoder_attention and smelter::cublas_linear
from tasks.backends.inductor import encoder_ops  # noqa: F401

ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def unsupported(config: Any) -> str | None:
    """Why this model has no encoder graph here (it then exports through the HF forward), or None."""
    if getattr(config, "model_type", None) != "bert":
        return f"the encoder graph supports model_type bert; this model is {getattr(config, 'model_type', None)}"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "the encoder graph supports bidirectional encoders, not BERT decoders"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"the encoder graph supports absolute positions, not {config.position_embedding_type}"
    if config.hidden_act not in ACTIVATIONS:
        return f"the encoder graph supports hidden_act {', '.join(ACTIVATIONS)}, not {config.hidden_act}"
    return None


def _weight(linear: nn.Linear) -> nn.Parameter:
    return nn.Parameter(linear.weight.detach(), requires_grad=False)


def _bias(linear: nn.Linear) -> nn.Parameter:
    return nn.Parameter(linear.bias.detach(), requires_grad=False)


class _Norm(nn.Module):
    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach(), requires_grad=False)
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, act: str, gelu_epilogue: bool, own_attention: bool,
                 cublas_products: bool):
        super().__init__()
        attention = layer.attention.self
        self.heads = heads
        self.qkv_weight = nn.Parameter(torch.cat([attention.query.weight, attention.key.weight,
                                                  attention.value.weight]).detach(), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.cat([attention.query.bias, attention.key.bias,
                                                attention.value.bias]).detach(), requires_grad=False)
        self.o_weight, self.o_bias = _weight(layer.attention.output.dense), _bias(layer.attention.output.dense)
        self.attention_norm = _Norm(layer.attention.output.LayerNorm)
        self.up_weight, self.up_bias = _weight(layer.intermediate.dense), _bias(layer.intermediate.dense)
        self.down_weight, self.down_bias = _weight(layer.output.dense), _bias(layer.output.dense)
        self.output_norm = _Norm(layer.output.LayerNorm)
        self.act = ACTIVATIONS[act]
        self.gelu_epilogue = gelu_epilogue and act.startswith("gelu")
        self.own_attention = own_attention
        self.dense = torch.ops.smelter.cublas_linear if cublas_products else F.linear

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.dense(x, self.qkv_weight, self.qkv_bias)
        if self.own_attention:
            attended = torch.ops.smelter.encoder_attention(qkv, key_bias, self.heads)
        else:
            q, k, v = qkv.view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            mask = None if key_bias is None else key_bias[:, None, None, :]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        x = self.attention_norm(F.linear(attended.reshape(batch, seq, hidden), self.o_weight, self.o_bias) + x)
        if self.gelu_epilogue:
            up = torch._addmm_activation(self.up_bias, x.reshape(batch * seq, hidden), self.up_weight.t(),
                                         use_gelu=True).view(batch, seq, -1)
        else:
            up = self.act(F.linear(x, self.up_weight, self.up_bias))
        return self.output_norm(self.dense(up, self.down_weight, self.down_bias) + x)


class EncoderPrefill(nn.Module):
    """last_hidden_state [B, S, hidden] of a BERT-family encoder (token type 0 throughout, as smelter's
    feeds have no token_type_ids). With `padding=False` it takes input_ids alone (no token is padding)."""

    def __init__(self, model: nn.Module, padding: bool = True, gelu_epilogue: bool = False,
                 own_attention: bool = False, cublas_products: bool = False):
        super().__init__()
        config = model.config
        problem = unsupported(config)
        if problem:
            raise ValueError(problem)
        embeddings = model.embeddings
        self.padding = padding
        self.word = nn.Parameter(embeddings.word_embeddings.weight.detach(), requires_grad=False)
        self.position = nn.Parameter(embeddings.position_embeddings.weight.detach(), requires_grad=False)
        self.token_type = nn.Parameter(embeddings.token_type_embeddings.weight[0].detach().clone(),
                                       requires_grad=False)
        self.embedding_norm = _Norm(embeddings.LayerNorm)
        self.layers = nn.ModuleList(_Layer(layer, config.num_attention_heads, config.hidden_act, gelu_epilogue,
                                           own_attention, cublas_products)
                                    for layer in model.encoder.layer)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.embedding_norm(F.embedding(input_ids, self.word) + self.position[:seq] + self.token_type)
        key_bias = None
        if self.padding:
            if attention_mask is None:
                raise ValueError("this encoder graph takes padded feeds: pass their attention_mask")
            # finite, so a row with no real token attends evenly instead of making NaN
            key_bias = (1 - attention_mask.to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, key_bias)
        return x


def has_padding(attention_mask: torch.Tensor) -> bool:
    """Whether any token of a feed is padding (the graph without a mask must not run it)."""
    return not bool(attention_mask.bool().all())
