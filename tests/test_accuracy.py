"""The accuracy stage: engines judged against the PyTorch FP32 reference on real held-out text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pandas as pd
import pytest
from onnx import numpy_helper

from tasks.config.spec import PipelineSpec, load
from tasks.config.stage_settings import AccuracyConfig, BuildConfig, ExportConfig
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.accuracy import PER_SAMPLE, run_accuracy
from tasks.stages.build import run_build
from tasks.stages.export import run_export


def built_engine(spec: PipelineSpec, store: ArtifactStore,
                 damage: Callable[[np.ndarray], np.ndarray] | None = None) -> StageResult:
    """Export, copy the graph as the fp32 precision output (optionally damaging the final norm's scale), build."""
    exported = run_export(ExportConfig.of(spec), store)
    model = onnx.load(str(exported.file("model.onnx")))
    label = "fp32"
    if damage is not None:
        label = "damaged"
        final_norm = [n for n in model.graph.node if n.op_type == "LayerNormalization"][-1]
        scale = numpy_helper.to_array(initializer(model, final_norm.input[1])).copy()
        model.graph.initializer.append(numpy_helper.from_array(damage(scale), "damaged_final_norm_scale"))
        final_norm.input[1] = "damaged_final_norm_scale"
    with store.writing(spec.name, "precision", f"{label}-{exported.key}", inputs={"export": exported.key}) as w:
        onnx.save(model, str(w.dir / "model.onnx"))
        w.outputs["precision"] = "fp32"
    return run_build(BuildConfig.of(spec, "cpu", "fp32"), w.result, store)


def initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    """The weight behind `name`, through the Identity nodes the exporter adds for shared weights."""
    producers = {out: node for node in model.graph.node for out in node.output}
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return next(t for t in model.graph.initializer if t.name == name)


def flip_half_the_signs(scale: np.ndarray) -> np.ndarray:
    scale[::2] *= -1
    return scale


def poison_one_channel(scale: np.ndarray) -> np.ndarray:
    scale[0] = np.nan
    return scale


@pytest.fixture
def bert_spec(pipeline_factory: Callable[..., Path], tiny_bert_dir: Path) -> PipelineSpec:
    return load(pipeline_factory(tiny_bert_dir, "feature-extraction")).pipelines["tiny"]


def test_fp32_encoder_matches_reference_and_is_cached(bert_spec: PipelineSpec, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    engine = built_engine(bert_spec, store)
    result = run_accuracy(AccuracyConfig.of(bert_spec), engine, store)
    metrics = result.outputs["metrics"]
    assert metrics["cosine_mean"] > 0.99999 and metrics["cosine_min"] > 0.9999
    assert metrics["max_abs_error"] < 1e-3
    assert result.outputs["samples"] == bert_spec.accuracy.samples
    table = pd.read_csv(result.file(PER_SAMPLE))
    assert list(table["sample"]) == list(range(bert_spec.accuracy.samples))
    assert table["cosine"].min() == pytest.approx(metrics["cosine_min"])
    assert result.outputs["validity"] == {"finite": True, "points": {"min": True, "opt": True, "max": True},
                                          "problems": [], "nonfinite_samples": {}}
    again = run_accuracy(AccuracyConfig.of(bert_spec), engine, store)
    assert again.cached and again.outputs == result.outputs


def test_damaged_engine_scores_low_cosine(bert_spec: PipelineSpec, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    engine = built_engine(bert_spec, store, flip_half_the_signs)
    metrics = run_accuracy(AccuracyConfig.of(bert_spec), engine, store).outputs["metrics"]
    assert metrics["cosine_mean"] < 0.5
    assert metrics["max_abs_error"] > 0.1


def test_nan_output_fails_validity_at_every_point(bert_spec: PipelineSpec, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    engine = built_engine(bert_spec, store, poison_one_channel)
    validity = run_accuracy(AccuracyConfig.of(bert_spec), engine, store).outputs["validity"]
    assert validity["finite"] is False
    assert validity["points"] == {"min": False, "opt": False, "max": False}
    assert any("last_hidden_state has" in p and "NaN/Inf" in p and "max {'batch': 4, 'seq': 32}" in p
               for p in validity["problems"])


def test_fp32_decoder_agrees_on_every_next_token(pipeline_factory: Callable[..., Path], tiny_llama_dir: Path,
                                                 tmp_path: Path) -> None:
    spec = load(pipeline_factory(tiny_llama_dir, "text-generation-with-past",
                                 accuracy={"seq_len": 16})).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_accuracy(AccuracyConfig.of(spec), built_engine(spec, store), store)
    metrics = result.outputs["metrics"]
    assert metrics["top1_agreement"] == 1.0
    assert metrics["logit_max_abs_error"] < 1e-3 and metrics["logit_mean_abs_error"] < 1e-4
    assert abs(metrics["perplexity_delta"]) < 1e-3 * metrics["reference_perplexity"]
    assert result.outputs["validity"]["points"] == {"min": True, "opt": True, "max": True}
    table = pd.read_csv(result.file(PER_SAMPLE))
    assert len(table) == spec.accuracy.samples and (table["top1_agreement"] == 1.0).all()

