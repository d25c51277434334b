"""Real-text inputs at exact shapes, and the PyTorch reference's answer to them.

Validation, calibration, accuracy and benchmark all feed engines from here, so an engine is
always judged on the same kind of tokens at the same shapes as the reference it is compared to.
Feeds are keyed by the exported ONNX input names; reference outputs by the ONNX output names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache

    from tasks.spec import ModelSpec

PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """The non-empty lines of a text file, up to `limit` of them (all when None)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise FileNotFoundError(f"cannot read text samples from {path}: {e.strerror}") from e
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"{path}: expected at least 1 non-empty line of text, found none")
    if limit is not None:
        if len(texts) < limit:
            raise ValueError(f"{path}: expected at least {limit} non-empty lines of text, found {len(texts)}")
        texts = texts[:limit]
    return texts


def _cycle(texts: list[str], count: int) -> list[str]:
    if not texts:
        raise ValueError("expected at least one text sample, got none")
    return list(itertools.islice(itertools.cycle(texts), count))


def encoder_feeds(tokenizer: Any, texts: list[str], batch: int, seq: int,
                  input_names: Iterable[str]) -> dict[str, np.ndarray]:
    """int64 feeds of exactly [batch, seq]: texts padded or truncated to seq, cycled to fill the batch."""
    encoded = tokenizer(_cycle(texts, batch), padding="max_length", truncation=True, max_length=seq,
                        return_tensors="np")
    feeds = {}
    for name in input_names:
        if name in encoded:
            feeds[name] = np.ascontiguousarray(encoded[name], dtype=np.int64)
        elif name == "token_type_ids":
            feeds[name] = np.zeros((batch, seq), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
        else:
            raise ValueError(f"encoder_feeds: cannot make input {name!r}; the tokenizer gives {sorted(encoded)}")
    return feeds


def _token_rows(tokenizer: Any, texts: list[str], batch: int, length: int) -> np.ndarray:
    """[batch, length] real tokens; row i reads texts from the i-th on, one per line, so no padding is needed."""
    encoded = [tokenizer(f"{text}\n", add_special_tokens=False)["input_ids"] for text in texts]
    if not any(encoded):
        raise ValueError("decoder inputs: the texts tokenize to nothing")
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    rows = []
    for row in range(batch):
        tokens = list(start)
        rotated = encoded[row % len(encoded):] + encoded[:row % len(encoded)]
        for ids in itertools.cycle(rotated):
            tokens.extend(ids)
            if len(tokens) >= length:
                break
        rows.append(tokens[:length])
    return np.asarray(rows, dtype=np.int64)


def _kv_shape(config: Any, batch: int, length: int) -> tuple[int, int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return batch, kv_heads, length, head_dim


def decoder_feeds(tokenizer: Any, reference_model: torch.nn.Module | None, texts: list[str], batch: int, seq: int,
                  past: int, input_names: Iterable[str]) -> dict[str, np.ndarray]:
    """Feeds for one decoder step: `seq` new real tokens after a KV cache of `past` real tokens.

    The cache is what the reference itself computed on the preceding tokens, so an engine is
    tested on the values it meets in generation, not on random numbers (without past inputs in
    `input_names`, no reference is needed).
    """
    names = list(input_names)
    tokens = _token_rows(tokenizer, texts, batch, past + seq)
    all_feeds: dict[str, np.ndarray] = {
        "input_ids": tokens[:, past:],
        "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq)).copy(),
    }
    if any(name.startswith(PAST_PREFIX) for name in names):
        import torch

        if reference_model is None:
            raise ValueError("decoder_feeds: past inputs are computed by the reference model, and none was given")
        if past > 0:
            with torch.inference_mode():
                out = reference_model(input_ids=torch.from_numpy(tokens[:, :past]), use_cache=True)
            layers = out.past_key_values.to_legacy_cache()
        else:
            empty = torch.zeros(_kv_shape(reference_model.config, batch, 0), dtype=torch.float32)
            layers = [(empty, empty)] * reference_model.config.num_hidden_layers
        for i, (key, value) in enumerate(layers):
            all_feeds[f"{PAST_PREFIX}{i}.key"] = key.float().numpy().copy()
            all_feeds[f"{PAST_PREFIX}{i}.value"] = value.float().numpy().copy()
    missing = [name for name in names if name not in all_feeds]
    if missing:
        raise ValueError(f"decoder_feeds: cannot make inputs {missing}; can make {sorted(all_feeds)}")
    return {name: np.ascontiguousarray(all_feeds[name]) for name in names}


def point_feeds(model: ModelSpec, tokenizer: Any, reference_model: torch.nn.Module, texts: list[str],
                shape: dict[str, int], input_names: Iterable[str]) -> dict[str, np.ndarray]:
    """Feeds at one profile shape point ({"batch", "seq"} and, for decoders with a KV cache, "past")."""
    if model.is_decoder:
        return decoder_feeds(tokenizer, reference_model, texts, shape["batch"], shape["seq"], shape.get("past", 0),
                             input_names)
    return encoder_feeds(tokenizer, texts, shape["batch"], shape["seq"], input_names)


def past_layers(feeds: dict[str, np.ndarray], device: str = "cpu") -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The KV cache in `feeds` as (key, value) tensors per layer on `device`; empty when there is no past."""
    import torch

    layers = []
    while f"{PAST_PREFIX}{len(layers)}.key" in feeds:
        i = len(layers)
        layers.append((torch.from_numpy(feeds[f"{PAST_PREFIX}{i}.key"]).to(device),
                       torch.from_numpy(feeds[f"{PAST_PREFIX}{i}.value"]).to(device)))
    if not layers or layers[0][0].shape[2] == 0:
        return ()
    return tuple(layers)


def past_cache(layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> DynamicCache | None:
    """A fresh cache over `layers` (forward extends a cache in place, so each call needs its own); None for no past."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache.from_legacy_cache(layers) if layers else None


def reference_outputs(reference_model: torch.nn.Module, feeds: dict[str, np.ndarray],
                      task: str) -> dict[str, np.ndarray]:
    """The PyTorch model's outputs for `feeds`, named like the exported ONNX outputs."""
    import torch

    tensors = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in feeds.items()
               if not name.startswith(PAST_PREFIX)}
    with torch.inference_mode():
        if task in ("text-generation", "text-generation-with-past"):
            with_past = task == "text-generation-with-past"
            out = reference_model(**tensors, past_key_values=past_cache(past_layers(feeds)) if with_past else None,
                                  use_cache=with_past)
            outputs = {"logits": out.logits}
            if with_past:
                for i, (key, value) in enumerate(out.past_key_values.to_legacy_cache()):
                    outputs[f"{PRESENT_PREFIX}{i}.key"] = key
                    outputs[f"{PRESENT_PREFIX}{i}.value"] = value
        elif task == "text-classification":
            outputs = {"logits": reference_model(**tensors).logits}
        elif task == "feature-extraction":
            outputs = {"last_hidden_state": reference_model(**tensors).last_hidden_state}
        else:
            raise ValueError(f"reference_outputs: unsupported task {task!r}")
    return {name: value.float().numpy().copy() for name, value in outputs.items()}
