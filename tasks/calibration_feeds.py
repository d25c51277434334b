"""The calibration text as model feeds: what int8 calibration and a build that calibrates both read.

One definition, so that the precision stage and a calibrating build see the same batches.
"""

from __future__ import annotations

import numpy as np

from tasks import inputs
from tasks.models import ModelSource, load_reference, load_tokenizer
from tasks.spec import PipelineSpec


def calibration_past(spec: PipelineSpec) -> int:
    """Decoders with a KV cache calibrate at the optimization profile's typical past length."""
    return spec.profiles[0].past[1] if spec.model.has_past and spec.profiles[0].past else 0


def calibration_batches(spec: PipelineSpec, input_names: list[str],
                        past: int | None = None) -> list[dict[str, np.ndarray]]:
    """spec.calibration.samples lines of the calibration text, tokenized into [batch_size, seq_len] feeds:
    for a decoder, after a KV cache of `past` tokens (default: the profile's typical past; 0 for a
    graph over whole prompts)."""
    calib, model = spec.calibration, ModelSource.of(spec)
    texts = inputs.read_texts(spec.resolve(calib.data), limit=calib.samples)
    tokenizer = load_tokenizer(model)
    past = calibration_past(spec) if past is None else past
    with_cache = spec.model.is_decoder and any(name.startswith(inputs.PAST_PREFIX) for name in input_names)
    reference = load_reference(model) if with_cache else None  # it computes the cache
    batches = []
    for start in range(0, len(texts), calib.batch_size):
        chunk = texts[start:start + calib.batch_size]
        if spec.model.is_decoder:
            batches.append(inputs.decoder_feeds(tokenizer, reference, chunk, len(chunk), calib.seq_len, past,
                                                input_names))
        else:
            batches.append(inputs.encoder_feeds(tokenizer, chunk, len(chunk), calib.seq_len, input_names))
    return batches


def prompt_batches(spec: PipelineSpec) -> list[dict[str, np.ndarray]]:
    """Whole-prompt feeds (input_ids, attention_mask, no KV cache): for a build that calibrates the graph it
    compiles."""
    return calibration_batches(spec, ["input_ids", "attention_mask"], past=0)
