"""Real-text feeds at exact shapes, KV caches from the reference, and reference outputs named like ONNX."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore
from tasks.stages.export import run_export
from tasks.stages.inputs import decoder_feeds, encoder_feeds, read_texts, reference_outputs
from tasks.stages.models import load_reference, load_tokenizer
from tests.fixtures.models import TEXTS, assert_decoder_step_matches_reference, write_pipelines

BERT_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]
DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def llama(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's spec, tokenizer, reference and one real with-past export (shared: exports cost time)."""
    root = tmp_path_factory.mktemp("llama-inputs")
    pipelines = write_pipelines(root, tiny_llama_dir, "text-generation-with-past")
    spec = spec_module.load(pipelines).pipelines["tiny"]
    export = run_export(ExportConfig.of(spec), ArtifactStore(root / "artifacts"))
    return spec, load_tokenizer(ModelSource.of(spec)), load_reference(ModelSource.of(spec)), export


def test_read_texts_skips_blank_lines_and_names_the_file_when_short(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("first line\n\n   \nsecond line\nthird line\n")
    assert read_texts(path) == ["first line", "second line", "third line"]
    assert read_texts(path, limit=2) == ["first line", "second line"]
    with pytest.raises(ValueError, match=rf"{path}: expected at least 5 non-empty lines of text, found 3"):
        read_texts(path, limit=5)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt"):
        read_texts(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_texts(tmp_path / "missing.txt")


def test_repository_text_data_is_large_enough():
    calibration, evaluation = read_texts(DATA / "calibration.txt"), read_texts(DATA / "eval.txt")
    assert len(calibration) >= 300 and len(evaluation) >= 120
    assert not set(calibration) & set(evaluation), "held-out data must not repeat calibration lines"
    assert max(len(line.split()) for line in calibration) >= 100, "long lines are needed to fill seq 128"


def test_encoder_feeds_have_exact_shape_and_cycle_texts(minilm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir, local_files_only=True)
    feeds = encoder_feeds(tokenizer, TEXTS, batch=5, seq=12, input_names=BERT_INPUTS)
    assert list(feeds) == BERT_INPUTS
    for value in feeds.values():
        assert value.shape == (5, 12) and value.dtype == np.int64
    np.testing.assert_array_equal(feeds["input_ids"][0], feeds["input_ids"][2])
    assert feeds["attention_mask"][1].all(), "a long text is truncated to fill every position"
    assert not feeds["attention_mask"][0].all(), "a short text is padded"
    only_ids = encoder_feeds(tokenizer, TEXTS, batch=1, seq=64, input_names=["input_ids"])
    assert list(only_ids) == ["input_ids"] and only_ids["input_ids"].shape == (1, 64)


def test_decoder_feeds_continue_after_the_past(llama):
    spec, tokenizer, reference, export = llama
    names = list(export.outputs["inputs"])
    prefill = decoder_feeds(tokenizer, reference, TEXTS, batch=2, seq=12, past=0, input_names=names)
    step = decoder_feeds(tokenizer, reference, TEXTS, batch=2, seq=4, past=8, input_names=names)
    assert set(step) == set(names)
    assert prefill["past_key_values.0.key"].shape == (2, 2, 0, 16)
    for i in range(2):
        for kind in ("key", "value"):
            assert step[f"past_key_values.{i}.{kind}"].shape == (2, 2, 8, 16)
            assert step[f"past_key_values.{i}.{kind}"].dtype == np.float32
    np.testing.assert_array_equal(step["input_ids"], prefill["input_ids"][:, 8:])
    assert step["attention_mask"].shape == (2, 12) and step["attention_mask"].all()
    np.testing.assert_array_equal(step["position_ids"], [[8, 9, 10, 11]] * 2)
    assert prefill["input_ids"][0, 0] == tokenizer.bos_token_id
    assert (prefill["input_ids"][0] != prefill["input_ids"][1]).any(), "rows start from different texts"


def test_kv_cache_from_the_reference_reproduces_the_full_sequence(llama):
    spec, tokenizer, reference, export = llama
    names = list(export.outputs["inputs"])
    prefill = decoder_feeds(tokenizer, reference, TEXTS, batch=2, seq=12, past=0, input_names=names)
    step = decoder_feeds(tokenizer, reference, TEXTS, batch=2, seq=4, past=8, input_names=names)
    full = reference_outputs(reference, prefill, spec.model.task)
    decoded = reference_outputs(reference, step, spec.model.task)
    np.testing.assert_allclose(decoded["logits"], full["logits"][:, 8:], atol=1e-5)
    np.testing.assert_allclose(decoded["present.1.value"], full["present.1.value"], atol=1e-5)
    assert decoded["present.0.key"].shape == (2, 2, 12, 16)


@pytest.mark.parametrize("batch, seq, past", [(1, 1, 0), (2, 16, 0), (2, 1, 8), (3, 4, 24)])
def test_onnx_decoder_matches_reference_for_prefill_and_decode(llama, batch, seq, past):
    spec, tokenizer, reference, export = llama
    assert_decoder_step_matches_reference(export.file("model.onnx"), tokenizer, reference, spec.model.task,
                                          batch, seq, past, atol=1e-5, rtol=1e-4)


def test_reference_outputs_are_named_like_the_encoder_export(tiny_bert_dir, pipeline_factory):
    spec = spec_module.load(pipeline_factory(tiny_bert_dir, "feature-extraction")).pipelines["tiny"]
    feeds = encoder_feeds(load_tokenizer(ModelSource.of(spec)), TEXTS, batch=2, seq=10, input_names=BERT_INPUTS)
    outputs = reference_outputs(load_reference(ModelSource.of(spec)), feeds, spec.model.task)
    assert list(outputs) == ["last_hidden_state"]
    assert outputs["last_hidden_state"].shape == (2, 10, 32) and outputs["last_hidden_state"].dtype == np.float32
