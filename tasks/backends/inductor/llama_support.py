"""Which models the Llama-family graphs (llama_graphs.py) build, read from a config alone.

No torch here: `smelter validate` asks the same questions before any work, and the build asks them
again of the loaded model, so both refuse with the same words.
"""

from __future__ import annotations

import fnmatch
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
PRODUCTS = ("qkv", "o", "gate_up", "down")  # each layer's products, q/k/v and gate/up fused


def unsupported(config: Any) -> str | None:
    """Why this model has no Llama-family graphs here, or None."""
    archs = getattr(config, "architectures", None) or []
    if not any(a in ARCHITECTURES for a in archs):
        return f"the Llama-family graphs support {', '.join(ARCHITECTURES)}; this model is {archs or 'unnamed'}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the Llama-family graphs support hidden_act silu, not {config.hidden_act}"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < getattr(config, "max_position_embeddings", 0):
        return (f"the Llama-family graphs attend to the whole context; this model's sliding window of {window} "
                f"tokens would give other results past it")
    return None


def fp8_unsupported(config: Any) -> str | None:
    """Why this decoder's products cannot run in fp8 here (torch._scaled_mm needs dimensions divisible by 16)."""
    problem = unsupported(config)
    if problem:
        return f"fp8 is built for Llama-family decoders and BERT-family encoders only: {problem}"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = config.num_key_value_heads or heads
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads * head_dim": heads * head_dim, "num_key_value_heads * head_dim": kv_heads * head_dim}
    odd = [f"{name} = {value}" for name, value in sizes.items() if value % 16]
    return f"fp8 products need sizes divisible by 16; this model has {', '.join(odd)}" if odd else None


def product_names(layers: int, products: tuple[str, ...] = PRODUCTS) -> list[str]:
    """Each layer product's name, as a target's fp8_exclude globs see them: layers.0.qkv ... layers.<n-1>.down
    (`products`: each layer's, the Llama-family graphs' unless given)."""
    return [f"layers.{i}.{product}" for i in range(layers) for product in products]


def fp8_kept(globs: list[str], layers: int,
             products: tuple[str, ...] = PRODUCTS) -> tuple[list[str], list[tuple[int, str]]]:
    """The products `globs` keep in bf16 (in graph order), and (index, why) for each glob that matches
    none: a typo would otherwise quantise the very layer it meant to keep."""
    names = product_names(layers, products)
    kept: set[str] = set()
    problems = []
    for i, pattern in enumerate(globs):
        matched = fnmatch.filter(names, pattern)
        if not matched:
            problems.append((i, f"{pattern!r} matches no product of this model; its {layers} layers' products are "
                                f"layers.<0-{layers - 1}>.{'|'.join(products)}"))
        kept.update(matched)
    return [name for name in names if name in kept], problems


def product_costs(config: Any) -> dict[str, int]:
    """Each product's multiply-adds per token, by name in graph order: what keeping it in bf16 costs."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = config.num_key_value_heads or heads
    hidden, inner = config.hidden_size, config.intermediate_size
    per_layer = {"qkv": hidden * (heads + 2 * kv_heads) * head_dim, "o": heads * head_dim * hidden,
                 "gate_up": hidden * 2 * inner, "down": inner * hidden}
    return {name: per_layer[name.rsplit(".", 1)[1]] for name in product_names(config.num_hidden_layers)}


def keep_sensitive(errors: dict[str, float], costs: dict[str, int], share: float, kept: list[str]) -> list[str]:
    """`kept`, then the products with the most fp8 error per multiply-add, while all kept products' cost
    stays within `share` of all products' (a knapsack filled greedily); in graph order."""
    budget = share * sum(costs.values()) - sum(costs[name] for name in kept)
    chosen = set(kept)
    for name in sorted(errors, key=lambda n: (-errors[n] / costs[n], n)):
        if name not in chosen and costs[name] <= budget:
            chosen.add(name)
            budget -= costs[name]
    return [name for name in costs if name in chosen]
