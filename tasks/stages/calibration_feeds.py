"""The calibration text as model feeds: what int8 calibration and a build that calibrates both read.

One definition, so that the precision stage and a calibrating build see the same batches.
"""

from __future__ import annotations

import numpy as np

from tasks.config.stage_settings import CalibrationSource
from tasks.stages import inputs
from tasks.stages.models import load_reference, load_tokenizer


def calibration_batches(calib: CalibrationSource, input_names: list[str],
                        past: int | None = None) -> list[dict[str, np.ndarray]]:
    """calibration.samples lines of the calibration text, tokenized into [batch_size, seq_len] feeds:
    for a decoder, after a KV cache of `past` tokens (default: the profile's typical past; 0 for a
    graph over whole prompts)."""
    settings, model = calib.calibration, calib.source
    texts = inputs.read_texts(calib.data_path, limit=settings.samples)
    tokenizer = load_tokenizer(model)
    past = calib.past if past is None else past
    decoder = model.model.is_decoder
    with_cache = decoder and any(name.startswith(inputs.PAST_PREFIX) for name in input_names)
    reference = load_reference(model) if with_cache else None  # it computes the cache
    batches = []
    for start in range(0, len(texts), settings.batch_size):
        chunk = texts[start:start + settings.batch_size]
        if decoder:
            batches.append(inputs.decoder_feeds(tokenizer, reference, chunk, len(chunk), settings.seq_len, past,
                                                input_names))
        else:
            batches.append(inputs.encoder_feeds(tokenizer, chunk, len(chunk), settings.seq_len, input_names))
    return batches


def prompt_batches(calib: CalibrationSource) -> list[dict[str, np.ndarray]]:
    """Whole-prompt feeds (input_ids, attention_mask, no KV cache): for a build that calibrates the graph it
    compiles."""
    return calibration_batches(calib, ["input_ids", "attention_mask"], past=0)
