"""Which models the encoder graph (encoder_graphs.py) builds, and in fp8, read from a config alone.

No torch here: `smelter validate` asks the same questions before any work, and the build asks them
again of the loaded model, so both refuse with the same words.
"""

from __future__ import annotations

from typing import Any

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
PRODUCTS = ("qkv", "o", "up", "down")  # each layer's products, q/k/v fused


def unsupported(config: Any) -> str | None:
    """Why this model has no encoder graph here (it then exports through the HF forward), or None."""
    if getattr(config, "model_type", None) != "bert":
        return f"the encoder graph supports model_type bert; this model is {getattr(config, 'model_type', None)}"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "the encoder graph supports bidirectional encoders, not BERT decoders"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"the encoder graph supports absolute positions, not {config.position_embedding_type}"
    if getattr(config, "hidden_act", "gelu") not in ACTIVATIONS:
        return f"the encoder graph supports hidden_act {', '.join(ACTIVATIONS)}, not {config.hidden_act}"
    return None


def fp8_unsupported(config: Any) -> str | None:
    """Why this encoder's products cannot run in fp8 here (torch._scaled_mm needs dimensions divisible by 16)."""
    problem = unsupported(config)
    if problem:
        return f"fp8 is built for Llama-family decoders and BERT-family encoders only: {problem}"
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size}
    odd = [f"{name} = {value}" for name, value in sizes.items() if value % 16]
    return f"fp8 products need sizes divisible by 16; this model has {', '.join(odd)}" if odd else None


def product_costs(config: Any) -> dict[str, int]:
    """Each product's multiply-adds per token, by name in graph order: what keeping it in bf16 costs."""
    hidden, inner = config.hidden_size, config.intermediate_size
    per_layer = {"qkv": 3 * hidden * hidden, "o": hidden * hidden, "up": hidden * inner, "down": inner * hidden}
    return {f"layers.{i}.{product}": per_layer[product]
            for i in range(config.num_hidden_layers) for product in PRODUCTS}
