"""Real-text inputs at exact shapes, and the PyTorch reference's answer to them.

Validation, calibration, accuracy and benchmark all feed engines from here, so an engine is
always judged on the same kind of tokens at the same shapes as the reference it is compared to.
Feeds are keyed by the exported ONNX input names; reference outputs by the ONNX output names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache

    from tasks.config.spec import ModelSpec

PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """The non-empty lines of a text file, up to `limit` of them (all when None). A byte-order mark at the start
    (some editors write one) is dropped, not read into the first sample; tasks/config/preflight.py decodes alike."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").removeprefix("\ufeff").splitlines()
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


def _filling_texts(tokenizer: Any, texts: list[str], batch: int, seq: int) -> list[str]:
    """One text per row, texts from the i-th on joined and cycled until longer than `seq` tokens.

    Truncation, not padding, then sets the row's length: every position holds a real token, so
    an engine is exercised at every position it claims (a padded row puts pad positions there).
    """
    counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    if not any(counts):
        raise ValueError("encoder inputs: the texts tokenize to nothing")
    counted = list(zip(texts, counts))
    rows = []
    for row in range(batch):
        start = row % len(texts)
        joined, total = [], 0
        for text, count in itertools.cycle(counted[start:] + counted[:start]):
            joined.append(text)
            total += count
            if total > 2 * seq:  # margin: joining may merge a few tokens at the seams
                break
        rows.append(" ".join(joined))
    return rows


def filled_encoder_feeds(tokenizer: Any, texts: list[str], batch: int, seq: int,
                         input_names: Iterable[str]) -> dict[str, np.ndarray]:
    """encoder_feeds of real tokens only (no padding), so the longest positions are really run."""
    return encoder_feeds(tokenizer, _filling_texts(tokenizer, texts, batch, seq), batch, seq, input_names)


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


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer of a reference's returned cache.

    Some families (GPTBigCode) return an EncoderDecoderCache whose legacy tuples carry an empty
    cross-attention half; the self-attention half is the decoder's KV cache.
    """
    cache = getattr(cache, "self_attention_cache", cache)
    return [(layer[0], layer[1]) for layer in cache.to_legacy_cache()]


def _reference_cache(reference_model: torch.nn.Module, tokens: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    with torch.inference_mode():
        out = reference_model(input_ids=torch.from_numpy(tokens), use_cache=True)
    return cache_layers(out.past_key_values)


def _declared_empty_past(declared: Sequence[int | str] | None, batch: int) -> np.ndarray | None:
    """A zero-length past shaped as the graph declares it ([batch, kv heads, 0, head dim], the head
    count and head dim fixed numbers there); None when the graph leaves either open."""
    if declared is None or len(declared) != 4:
        return None
    heads, head_dim = declared[1], declared[3]
    if not (isinstance(heads, int) and heads > 0 and isinstance(head_dim, int) and head_dim > 0):
        return None
    return np.zeros((batch, heads, 0, head_dim), dtype=np.float32)


def _past_feeds(reference_model: torch.nn.Module, tokens: np.ndarray, past: int, names: list[str],
                declared_shapes: Mapping[str, Sequence[int | str]]) -> dict[str, np.ndarray]:
    """The past inputs: the reference's own cache of the first `past` tokens.

    An empty cache takes its head count and head dim from the graph's declared inputs, where
    they are fixed: families name their kv-head count differently in the config (Falcon:
    num_kv_heads / multi_query), the graph states it. Where the graph leaves them open, the
    reference's cache of one token, cut to length 0, gives them.
    """
    past_names = [name for name in names if name.startswith(PAST_PREFIX)]
    feeds: dict[str, np.ndarray] = {}
    if past == 0:
        for name in past_names:
            empty = _declared_empty_past(declared_shapes.get(name), tokens.shape[0])
            if empty is not None:
                feeds[name] = empty
        if len(feeds) == len(past_names):
            return feeds
    layers = _reference_cache(reference_model, tokens[:, :max(past, 1)])
    for i, (key, value) in enumerate(layers):
        for kind, tensor in (("key", key), ("value", value)):
            name = f"{PAST_PREFIX}{i}.{kind}"
            if name not in feeds:
                feeds[name] = tensor[:, :, :past].float().numpy().copy()
    return feeds


def decoder_feeds(tokenizer: Any, reference_model: torch.nn.Module | None, texts: list[str], batch: int, seq: int,
                  past: int, input_names: Iterable[str],
                  declared_shapes: Mapping[str, Sequence[int | str]] | None = None) -> dict[str, np.ndarray]:
    """Feeds for one decoder step: `seq` new real tokens after a KV cache of `past` real tokens.

    The cache is what the reference itself computed on the preceding tokens, so an engine is
    tested on the values it meets in generation, not on random numbers (without past inputs in
    `input_names`, no reference is needed). `declared_shapes` (input name -> the graph's dims)
    shapes an empty cache as the graph expects it.
    """
    names = list(input_names)
    tokens = _token_rows(tokenizer, texts, batch, past + seq)
    all_feeds: dict[str, np.ndarray] = {
        "input_ids": tokens[:, past:],
        "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq)).copy(),
    }
    if any(name.startswith(PAST_PREFIX) for name in names):
        if reference_model is None:
            raise ValueError("decoder_feeds: past inputs are computed by the reference model, and none was given")
        all_feeds |= _past_feeds(reference_model, tokens, past, names, declared_shapes or {})
    missing = [name for name in names if name not in all_feeds]
    if missing:
        model_type = getattr(getattr(reference_model, "config", None), "model_type", "this model")
        raise ValueError(f"decoder_feeds: cannot make inputs {missing} of a {model_type} graph; can make "
                         f"{sorted(all_feeds)} (a KV cache is fed as past_key_values.<layer>.key/.value)")
    return {name: np.ascontiguousarray(all_feeds[name]) for name in names}


def point_feeds(model: ModelSpec, tokenizer: Any, reference_model: torch.nn.Module, texts: list[str],
                shape: dict[str, int], input_names: Iterable[str],
                declared_shapes: Mapping[str, Sequence[int | str]] | None = None,
                real_tokens_only: bool = False) -> dict[str, np.ndarray]:
    """Feeds at one profile shape point ({"batch", "seq"} and, for decoders with a KV cache, "past").

    `real_tokens_only` fills encoder rows with real tokens instead of padding short texts (decoder
    rows are always real tokens); `declared_shapes` is the graph's input dims, for an empty cache.
    """
    if model.is_decoder:
        return decoder_feeds(tokenizer, reference_model, texts, shape["batch"], shape["seq"], shape.get("past", 0),
                             input_names, declared_shapes)
    make = filled_encoder_feeds if real_tokens_only else encoder_feeds
    return make(tokenizer, texts, shape["batch"], shape["seq"], input_names)


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
                for i, (key, value) in enumerate(cache_layers(out.past_key_values)):
                    outputs[f"{PRESENT_PREFIX}{i}.key"] = key
                    outputs[f"{PRESENT_PREFIX}{i}.value"] = value
        elif task == "text-classification":
            outputs = {"logits": reference_model(**tensors).logits}
        elif task == "feature-extraction":
            outputs = {"last_hidden_state": reference_model(**tensors).last_hidden_state}
        else:
            raise ValueError(f"reference_outputs: unsupported task {task!r}")
    return {name: value.float().numpy().copy() for name, value in outputs.items()}
