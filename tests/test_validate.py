"""ONNX Runtime vs PyTorch through Polygraphy, on real exports of tiny models."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ValidateConfig
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.export import run_export
from tasks.stages.validate import ValidationFailed, run_validate, validate_key

POINTS = ("min", "opt", "max")


def _exported(pipelines_path):
    spec = spec_module.load(pipelines_path).pipelines["tiny"]
    store = ArtifactStore(spec.base_dir / "artifacts")
    return spec, store, run_export(ExportConfig.of(spec), store)


def _edited_export(export: StageResult, tmp_path, initializer: str, edit) -> StageResult:
    """A copy of an export whose one initializer was changed: a broken graph to catch."""
    copy = tmp_path / "edited-export"
    shutil.copytree(export.path, copy)
    model = onnx.load(str(copy / "model.onnx"))
    tensor = next(t for t in model.graph.initializer if t.name == initializer)
    tensor.CopyFrom(numpy_helper.from_array(edit(numpy_helper.to_array(tensor).copy()), initializer))
    onnx.save(model, str(copy / "model.onnx"))
    return StageResult(export.pipeline, "export", f"{export.key}-edited", copy, export.manifest)


def test_good_encoder_export_passes_at_min_opt_max(tiny_bert_dir, pipeline_factory):
    spec, store, export = _exported(pipeline_factory(
        tiny_bert_dir, "feature-extraction",
        validation={"outputs": {"last_hidden_state": {"atol": 2e-4, "rtol": 2e-3}}}))
    result = run_validate(ValidateConfig.of(spec), export, store)
    outputs = result.outputs
    assert outputs["passed"] is True
    assert outputs["nan_inf"] == []
    assert outputs["points"] == {"min": {"batch": 1, "seq": 8}, "opt": {"batch": 2, "seq": 16},
                                 "max": {"batch": 4, "seq": 32}}
    stats = outputs["outputs"]["last_hidden_state"]
    assert set(stats) == set(POINTS)
    for point in POINTS:
        assert stats[point]["passed"] is True
        assert stats[point]["atol"] == 2e-4 and stats[point]["rtol"] == 2e-3, "per-output tolerance applies"
        assert 0 <= stats[point]["mean_abs"] <= stats[point]["max_abs"] <= 2e-4
    report = json.loads(result.file("report.json").read_text())
    assert report["outputs"] == outputs["outputs"]
    assert result.manifest["inputs"] == {"export": export.key}


def test_second_validate_is_cached_and_key_follows_tolerances(tiny_bert_dir, pipeline_factory):
    spec, store, export = _exported(pipeline_factory(tiny_bert_dir, "feature-extraction"))
    first = run_validate(ValidateConfig.of(spec), export, store)
    again = run_validate(ValidateConfig.of(spec), export, store)
    assert again.cached and again.key == first.key
    looser = spec.model_copy(update={"validation": spec.validation.model_copy(update={"atol": 1e-3})})
    assert validate_key(ValidateConfig.of(looser), export) != first.key


def test_decoder_with_past_compares_logits_and_kv_cache(tiny_llama_dir, pipeline_factory):
    spec, store, export = _exported(pipeline_factory(tiny_llama_dir, "text-generation-with-past"))
    outputs = run_validate(ValidateConfig.of(spec), export, store).outputs
    assert outputs["passed"] is True
    assert outputs["points"]["max"] == {"batch": 3, "seq": 16, "past": 24}
    assert outputs["points"]["prefill"] == {"batch": 2, "seq": 16, "past": 0}, "the empty-past step is checked"
    assert set(outputs["outputs"]) == {"logits", "present.0.key", "present.0.value", "present.1.key",
                                       "present.1.value"}
    assert all(set(by_point) == {*POINTS, "prefill"} for by_point in outputs["outputs"].values())


def test_corrupted_graph_fails_naming_output_and_statistics(tiny_bert_dir, pipeline_factory, tmp_path):
    spec, store, export = _exported(pipeline_factory(tiny_bert_dir, "feature-extraction"))
    broken = _edited_export(export, tmp_path, "embeddings.LayerNorm.bias", lambda bias: bias + 0.05)
    with pytest.raises(ValidationFailed) as failed:
        run_validate(ValidateConfig.of(spec), broken, store)
    message = str(failed.value)
    assert "'last_hidden_state' at min shape {'batch': 1, 'seq': 8}" in message
    assert "max_abs" in message and "mean_abs" in message and "max_rel" in message and "atol 0.0001" in message
    assert not (store.root / "tiny" / "validate").exists() or not any(
        (store.root / "tiny" / "validate").iterdir()), "a failed validation must leave no artifact"


def test_nan_output_is_detected(tiny_bert_dir, pipeline_factory, tmp_path):
    spec, store, export = _exported(pipeline_factory(tiny_bert_dir, "feature-extraction"))
    broken = _edited_export(export, tmp_path, "embeddings.LayerNorm.weight", lambda w: np.full_like(w, np.nan))
    with pytest.raises(ValidationFailed, match=r"last_hidden_state at max \(onnxruntime\): NaN or Inf"):
        run_validate(ValidateConfig.of(spec), broken, store)
