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
  them in the whole forward); the o product stays Inductor's choice (its Triton template, or cuBLAS in some runs);
- bias adds, the residual adds and the layer norms are plain pointwise and reduction ops, which
  Inductor fuses into the products' epilogues or one kernel after them; with `gelu_epilogue` the
  up product's GELU runs in cuBLASLt's epilogue (torch._addmm_activation: GELU's tanh form, which
  differs from erf's by under 5e-4, less than bf16 rounds to), so its 4 × hidden-wide output is
  written once instead of written, read and written again;
- fp8 (`fp8=True`): every product but those `kept` names runs in e4m3 (fp8_linear.Fp8Linear, through
  smelter::scaled_mm, opaque to max-autotune, its bias added in cuBLAS's epilogue), each input scaled
  per token or by its static scale (`input_scales`, from `calibrate_input_amax` on real text). Static
  inputs are quantised inside the kernel before: the layer norm, the GELU (its tanh form, as the
  bf16 epilogue computes it, where `gelu_epilogue` is set) and, with `fp8_attention_out`, smelter's
  attention itself. Attention's arithmetic, the layer norms and the embedding stay bf16, as in the
  decoder's fp8.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

# importing it registers smelter::encoder_attention and smelter::cublas_linear
from tasks.backends.inductor import encoder_ops  # noqa: F401
from tasks.backends.inductor.encoder_support import PRODUCTS, fp8_unsupported, unsupported
from tasks.backends.inductor.fp8_linear import Fp8Linear, input_amax, layer_products, product_errors

ACTIVATION_FUNCTIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Norm(nn.Module):
    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach(), requires_grad=False)
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class _Product(nn.Module):
    """One bf16 product with its bias: F.linear, pinned to cuBLAS (`cublas`), or with GELU's tanh form in
    cuBLASLt's epilogue (`gelu`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, cublas: bool = False, gelu: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.cublas, self.gelu = cublas, gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            rows = x.reshape(-1, x.shape[-1])
            return torch._addmm_activation(self.bias, rows, self.weight.t(), use_gelu=True).view(*x.shape[:-1], -1)
        if self.cublas:
            return torch.ops.smelter.cublas_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, act: str, gelu_epilogue: bool, own_attention: bool,
                 cublas_products: bool, fp8_products: Mapping[str, float | None], fp8_attention_out: bool):
        """fp8_products: the products run in e4m3, each with its static input scale (None: per token)."""
        super().__init__()
        attention = layer.attention.self
        self.heads = heads
        # GELU's tanh form where the up product's epilogue would compute it (an fp8 product has none)
        self.act = ACTIVATION_FUNCTIONS["gelu_new" if gelu_epilogue and act.startswith("gelu") else act]
        self.own_attention = own_attention
        linears = {"qkv": (torch.cat([attention.query.weight, attention.key.weight, attention.value.weight]),
                           torch.cat([attention.query.bias, attention.key.bias, attention.value.bias])),
                   "o": (layer.attention.output.dense.weight, layer.attention.output.dense.bias),
                   "up": (layer.intermediate.dense.weight, layer.intermediate.dense.bias),
                   "down": (layer.output.dense.weight, layer.output.dense.bias)}
        for name, (weight, bias) in linears.items():
            if name in fp8_products:
                product: nn.Module = Fp8Linear(weight, bias, fp8=True, input_scale=fp8_products[name], opaque=True)
            else:
                product = _Product(weight, bias, cublas=cublas_products and name in ("qkv", "down"),
                                   gelu=name == "up" and gelu_epilogue and act.startswith("gelu"))
            setattr(self, name, product)
        self.attention_norm = _Norm(layer.attention.output.LayerNorm)
        self.output_norm = _Norm(layer.output.LayerNorm)
        # a static fp8 o product takes its input from smelter's attention already in e4m3
        self.fp8_attention_out = (fp8_attention_out and own_attention and fp8_products.get("o") is not None)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x)
        if self.own_attention:
            scale = self.o.inv_input_scale if self.fp8_attention_out and qkv.dtype == torch.bfloat16 else None
            attended = torch.ops.smelter.encoder_attention(qkv, key_bias, self.heads, scale)
        else:
            q, k, v = qkv.view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            mask = None if key_bias is None else key_bias[:, None, None, :]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        x = self.attention_norm(self.o(attended.reshape(batch, seq, hidden)) + x)
        up = self.up(x)
        if not getattr(self.up, "gelu", False):
            up = self.act(up)
        return self.output_norm(self.down(up) + x)


class EncoderPrefill(nn.Module):
    """last_hidden_state [B, S, hidden] of a BERT-family encoder (token type 0 throughout, as smelter's
    feeds have no token_type_ids). With `padding=False` it takes input_ids alone (no token is padding).
    With `fp8`, every product but those `kept` names (encoder_support.PRODUCTS by layer: layers.0.qkv ...)
    runs in e4m3, scaled per token or by `input_scales` (one per product input)."""

    def __init__(self, model: nn.Module, padding: bool = True, gelu_epilogue: bool = False,
                 own_attention: bool = False, cublas_products: bool = False, fp8: bool = False,
                 kept: Collection[str] = (), input_scales: Mapping[str, float] | None = None,
                 fp8_attention_out: bool = True):
        super().__init__()
        config = model.config
        problem = fp8_unsupported(config) if fp8 else unsupported(config)
        if problem:
            raise ValueError(problem)
        embeddings = model.embeddings
        self.padding = padding
        self.word = nn.Parameter(embeddings.word_embeddings.weight.detach(), requires_grad=False)
        self.position = nn.Parameter(embeddings.position_embeddings.weight.detach(), requires_grad=False)
        self.token_type = nn.Parameter(embeddings.token_type_embeddings.weight[0].detach().clone(),
                                       requires_grad=False)
        self.embedding_norm = _Norm(embeddings.LayerNorm)
        fp8_products = layer_products(len(model.encoder.layer), PRODUCTS, fp8, kept, input_scales)
        self.layers = nn.ModuleList(
            _Layer(layer, config.num_attention_heads, config.hidden_act, gelu_epilogue, own_attention,
                   cublas_products, products, fp8_attention_out)
            for layer, products in zip(model.encoder.layer, fp8_products))

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


def _products(graph: EncoderPrefill) -> dict[str, tuple[nn.Module, str]]:
    return {f"layers.{i}.{p}": (layer, p) for i, layer in enumerate(graph.layers) for p in PRODUCTS}


def calibrate_input_amax(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Each product's largest input magnitude over the real tokens of `batches` ((input_ids,
    attention_mask) on the model's device), through the unquantised graph: what static fp8 scales are
    set from."""
    graph = EncoderPrefill(model).eval()
    return input_amax({name: getattr(holder, p) for name, (holder, p) in _products(graph).items()}, graph, batches)


def fp8_sensitivity(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    input_scales: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each product's fp8 error as the last hidden state sees it: the mean squared change of each of its
    values at every real token of `batches` when that product alone runs in e4m3
    (fp8_linear.product_errors), what keeping it in bf16 buys."""
    graph = EncoderPrefill(model).eval()

    def hidden(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return graph(ids, mask)[mask.bool()].float()

    return product_errors(_products(graph), batches, hidden, model.config.hidden_size, input_scales=input_scales)
