"""Real Optimum exports of tiny models: what the export stage writes, records and caches."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig
from tasks.runtime.store import ArtifactStore
from tasks.stages.export import export_key, run_export
from tests.fixtures.models import write_pipelines


def _spec(path, name="tiny"):
    return spec_module.load(path).pipelines[name]


@pytest.fixture(scope="module")
def bert_export(tiny_bert_dir, tmp_path_factory):
    """One tiny-BERT export shared by the tests below (exports cost seconds on two cores)."""
    root = tmp_path_factory.mktemp("bert-export")
    pipelines = write_pipelines(root, tiny_bert_dir, "feature-extraction")
    spec = _spec(pipelines)
    store = ArtifactStore(root / "artifacts")
    return spec, store, run_export(ExportConfig.of(spec), store)


def test_feature_extraction_export_records_graph_facts(bert_export):
    spec, store, result = bert_export
    outputs = result.outputs
    assert result.path == store.path("tiny", "export", result.key)
    assert outputs["task"] == "feature-extraction"
    assert outputs["opset"] == spec.export.opset == 18
    assert set(outputs["inputs"]) == {"input_ids", "attention_mask", "token_type_ids"}
    assert outputs["inputs"]["input_ids"]["dtype"] == "int64"
    assert list(outputs["outputs"]) == ["last_hidden_state"]
    assert outputs["outputs"]["last_hidden_state"] == {"dtype": "float32",
                                                       "shape": ["batch_size", "sequence_length", 32]}
    assert outputs["dynamic_axes"]["input_ids"] == {"0": "batch_size", "1": "sequence_length"}
    assert outputs["model_source"] == result.manifest["inputs"]["model_source"]
    for name in ("model.onnx", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert name in result.manifest["files"], name


def test_exported_graph_runs_at_dynamic_shapes(bert_export):
    _, _, result = bert_export
    session = ort.InferenceSession(str(result.file("model.onnx")), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 8), (3, 21)):
        ids = np.ones((batch, seq), dtype=np.int64)
        (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": ids, "token_type_ids": 0 * ids})
        assert hidden.shape == (batch, seq, 32)


def test_second_export_is_a_cache_hit(bert_export):
    spec, store, first = bert_export
    again = run_export(ExportConfig.of(spec), store)
    assert again.cached and not first.cached
    assert again.key == first.key
    assert again.manifest["files"] == first.manifest["files"]


def test_key_changes_with_opset_and_model_files(bert_export, tiny_bert_dir, tmp_path):
    spec, _, first = bert_export
    opset_17 = spec.model_copy(update={"export": spec.export.model_copy(update={"opset": 17})})
    assert export_key(ExportConfig.of(opset_17)) != first.key
    model_copy = tmp_path / "model"
    model_copy.mkdir()
    for path in tiny_bert_dir.iterdir():
        (model_copy / path.name).write_bytes(path.read_bytes())
    moved = spec.model_copy(update={"model": spec.model.model_copy(update={"path": str(model_copy)})})
    assert export_key(ExportConfig.of(moved)) == first.key, "same files elsewhere on disk must share the export"
    (model_copy / "config.json").write_text((model_copy / "config.json").read_text().replace("0.02", "0.03"))
    assert export_key(ExportConfig.of(moved)) != first.key


def test_decoder_with_past_exports_one_graph_with_kv_cache(tiny_llama_dir, pipeline_factory):
    spec = _spec(pipeline_factory(tiny_llama_dir, "text-generation-with-past"))
    store = ArtifactStore(spec.base_dir / "artifacts")
    result = run_export(ExportConfig.of(spec), store)
    onnx_files = sorted(name for name in result.manifest["files"] if name.endswith(".onnx"))
    assert onnx_files == ["model.onnx"]
    inputs, outputs = result.outputs["inputs"], result.outputs["outputs"]
    past = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert set(inputs) == {"input_ids", "attention_mask", "position_ids", *past}
    assert set(outputs) == {"logits", *(name.replace("past_key_values", "present") for name in past)}
    assert inputs["past_key_values.0.key"] == {"dtype": "float32",
                                               "shape": ["batch_size", 2, "past_sequence_length", 16]}
    assert result.outputs["dynamic_axes"]["attention_mask"]["1"] == "past_sequence_length + sequence_length"
    assert "tokenizer.json" in result.manifest["files"]
