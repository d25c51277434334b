"""Accuracy-aware int8 on a real Optimum export: a BERT whose plain int8 fails cosine_mean >= 0.99 passes after
its most sensitive nodes are kept float, and both int8 graphs keep them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from transformers import BertConfig, BertModel

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore, file_digest
from tasks.stages.accuracy import cosine, mean_pool
from tasks.stages.export import run_export
from tasks.stages.inputs import encoder_feeds, read_texts
from tasks.stages.models import load_tokenizer
from tasks.stages.precision import CPU_MODEL_FILE, MODEL_FILE, PrecisionConfig, precision_work, run_precision
from tests.fixtures.models import MINILM_TOKENIZER_FILES

REPO = Path(__file__).resolve().parents[1]
OUTLIER_LAYER = 1
OUTLIER_SCALE = 200.0


@pytest.fixture(scope="module")
def outlier_bert_dir(tmp_path_factory, minilm_dir) -> Path:
    """A 2-layer BERT whose layer-1 FFN carries that layer's output, with one FFN neuron scaled up 200x (and
    its way out scaled down as much): the FFN output MatMul's input has one huge channel, so its per-tensor
    int8 scale leaves the other channels a few levels at most (the outlier features of real BERTs)."""
    out = tmp_path_factory.mktemp("outlier-bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    model = BertModel(config).eval()
    layer = model.encoder.layer[OUTLIER_LAYER]
    with torch.no_grad():
        layer.intermediate.dense.weight[0] *= OUTLIER_SCALE
        layer.intermediate.dense.bias[0] = OUTLIER_SCALE
        layer.output.dense.weight[:, 1:] *= 50  # the FFN's other neurons then carry the layer's output
        layer.output.dense.weight[:, 0] /= OUTLIER_SCALE
    model.save_pretrained(out)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, out / name)
    return out


def _spec(root: Path, model_dir: Path, **quantization: object) -> spec_module.PipelineSpec:
    (root / "data").mkdir(exist_ok=True)
    for name in ("calibration.txt", "eval.txt"):
        shutil.copy(REPO / "data" / name, root / "data" / name)
    pipeline = {
        "model": {"path": str(model_dir), "task": "feature-extraction"},
        "profiles": [{"batch": [1, 4, 8], "seq": [8, 32, 32]}],
        "precisions": ["fp32", "int8"],
        "targets": [{"name": "cpu", "backend": "onnxruntime"}, {"name": "sm90", "backend": "tensorrt", "arch": "sm90"}],
        "quantization": quantization,
        "calibration": {"data": "data/calibration.txt", "samples": 32, "seq_len": 32, "batch_size": 8},
        "accuracy": {"data": "data/eval.txt", "seq_len": 32, "gates": {"cosine_mean": {"min": 0.99}}},
        "benchmark": {"batch_sizes": [1], "seq_lens": [16]},
    }
    path = root / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": {"outlier": pipeline}}))
    return spec_module.load(path).pipelines["outlier"]


@pytest.fixture(scope="module")
def built(outlier_bert_dir, tmp_path_factory):
    """The same export quantized plainly and with the accuracy fallback."""
    root = tmp_path_factory.mktemp("fallback")
    plain = _spec(root, outlier_bert_dir)
    store = ArtifactStore(root / "artifacts")
    exported = run_export(ExportConfig.of(plain), store)
    with_fallback = _spec(root, outlier_bert_dir, accuracy_fallback={"max_float_share": 0.2})
    return (exported, run_precision(PrecisionConfig.of(plain, "int8"), exported, store),
            run_precision(PrecisionConfig.of(with_fallback, "int8"), exported, store), with_fallback)


def _eval_cosine_mean(spec, exported, graph: Path) -> float:
    """cosine_mean on the held-out text (not what the fallback measured on): what the accuracy gate reads."""
    texts = read_texts(spec.resolve(spec.accuracy.data), limit=32)
    feeds = encoder_feeds(load_tokenizer(ModelSource.of(spec)), texts, 32, 32, exported.outputs["inputs"])
    mask = feeds["attention_mask"]

    def run(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]

    return float(cosine(mean_pool(run(exported.file(MODEL_FILE)), mask), mean_pool(run(graph), mask)).mean())


def test_plain_int8_fails_the_gate_and_the_fallback_passes_it(built) -> None:
    exported, plain, fallback, spec = built
    assert "accuracy_fallback" not in plain.outputs
    assert _eval_cosine_mean(spec, exported, plain.file(MODEL_FILE)) < 0.99
    record = fallback.outputs["accuracy_fallback"]
    assert record["needed"] and record["passed"]
    assert record["before"]["cosine_mean"] < 0.99 <= record["after"]["cosine_mean"]
    assert _eval_cosine_mean(spec, exported, fallback.file(MODEL_FILE)) >= 0.99
    assert record["cpu_graph"]["cosine_mean"] >= 0.99
    assert _eval_cosine_mean(spec, exported, fallback.file(CPU_MODEL_FILE)) >= 0.99


def test_the_outlier_layers_ffn_output_is_ranked_most_sensitive_and_kept_within_budget(built) -> None:
    _, _, fallback, _ = built
    record = fallback.outputs["accuracy_fallback"]
    outlier = f"/encoder/layer.{OUTLIER_LAYER}/output/dense/MatMul"
    assert record["sensitivity"][0]["node"] == outlier
    # Far ahead of the next node on any x86 CPU: 80x where int8 products saturate (no VNNI: the other nodes'
    # errors grow), over 100x with VNNI.
    assert record["sensitivity"][0]["error"] > 20 * record["sensitivity"][1]["error"]
    assert record["kept"][0] == outlier
    assert record["float_share"] <= 0.2 and record["float_nodes"] == len(record["kept"])
    assert fallback.outputs["excluded_nodes"] == sorted(record["kept"])


def test_kept_nodes_are_float_in_both_int8_graphs(built) -> None:
    _, _, fallback, _ = built
    for name in (MODEL_FILE, CPU_MODEL_FILE):
        model = onnx.load(str(fallback.file(name)))
        producer = {out: node.op_type for node in model.graph.node for out in node.output}
        kept = [n for n in model.graph.node if n.name in fallback.outputs["accuracy_fallback"]["kept"]]
        assert kept, name
        for node in kept:
            assert not {"DequantizeLinear", "DynamicQuantizeLinear"} & {producer.get(i) for i in node.input}, name


def test_a_cpu_only_pipeline_keeps_the_same_nodes_float_without_publishing_the_qdq_graph(built, tmp_path: Path) -> None:
    """The fallback measures the Q/DQ graph even where no target builds from it (quantized into scratch)."""
    exported, _, fallback, spec = built
    cpu_only = spec.model_copy(update={"targets": [t for t in spec.targets if t.backend == "onnxruntime"]})
    alone = run_precision(PrecisionConfig.of(cpu_only, "int8"), exported, ArtifactStore(tmp_path))
    assert not alone.file(MODEL_FILE).exists()
    assert alone.outputs["accuracy_fallback"]["kept"] == fallback.outputs["accuracy_fallback"]["kept"]
    assert file_digest(alone.file(CPU_MODEL_FILE)) == file_digest(fallback.file(CPU_MODEL_FILE))


def test_a_budget_too_small_is_recorded_as_not_passing(built, outlier_bert_dir: Path, tmp_path: Path) -> None:
    exported = built[0]
    spec = _spec(tmp_path, outlier_bert_dir, accuracy_fallback={"max_float_share": 0.01})
    config = PrecisionConfig.of(spec, "int8")
    record = run_precision(config, exported, ArtifactStore(tmp_path / "artifacts")).outputs["accuracy_fallback"]
    assert record["needed"] and not record["passed"] and record["kept"] == []
    assert record["failing"] and record["failing"][0].startswith("cosine_mean ")


def test_a_fallback_with_no_gate_to_aim_at_is_a_located_error(outlier_bert_dir: Path, tmp_path: Path) -> None:
    from tasks.stages.int8_fallback import gated_metrics

    spec = _spec(tmp_path, outlier_bert_dir, accuracy_fallback={"max_float_share": 0.2})
    spec = spec.model_copy(update={"accuracy": spec.accuracy.model_copy(update={"gates": {}})})
    with pytest.raises(ValueError, match="pipeline outlier: quantization.accuracy_fallback: expected an accuracy "
                                         "gate on cosine_mean or cosine_min .* found none"):
        gated_metrics(spec)


def test_max_float_share_outside_0_to_1_is_refused(outlier_bert_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(spec_module.SpecError, match="quantization.accuracy_fallback.max_float_share"):
        _spec(tmp_path, outlier_bert_dir, accuracy_fallback={"max_float_share": 1.5})


def test_the_gate_the_fallback_aims_at_is_part_of_the_int8_key(built) -> None:
    exported, _, _, spec = built
    stricter = spec.model_copy(update={"accuracy": spec.accuracy.model_copy(
        update={"gates": {"cosine_mean": spec_module.Threshold(min=0.999)}})})
    stricter_key = precision_work(PrecisionConfig.of(stricter, "int8"), exported).key
    assert stricter_key != precision_work(PrecisionConfig.of(spec, "int8"), exported).key
