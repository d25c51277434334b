"""The precision stage on a real Optimum export of a tiny BERT, run by the real ONNX Runtime."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore, file_digest
from tasks.stages.export import run_export
from tasks.stages.inputs import encoder_feeds, read_texts
from tasks.stages.models import load_tokenizer
from tasks.stages.precision import (
    CALIBRATION_FILE,
    CPU_MODEL_FILE,
    MODEL_FILE,
    fused_exclusions,
    PrecisionConfig,
    precision_work,
    run_precision,
    uncalibrated,
)
from tasks.stages.qdq_lint import lint_qdq

REPO = Path(__file__).resolve().parents[1]
EXCLUDED = "*[0-9]/output/dense/MatMul"  # FFN output only: fnmatch's * also crosses "/"


def _write_spec(root: Path, model_dir: Path, **quantization: object) -> spec_module.PipelineSpec:
    pipeline = {
        "model": {"path": str(model_dir), "task": "feature-extraction"},
        "profiles": [{"batch": [1, 2, 4], "seq": [8, 16, 32]}],
        "precisions": ["fp32", "fp16", "int8"],
        "targets": [{"name": "cpu", "backend": "onnxruntime"}, {"name": "sm90", "backend": "tensorrt", "arch": "sm90"}],
        "quantization": {"exclude_nodes": [EXCLUDED], **quantization},
        "calibration": {"data": "data/calibration.txt", "samples": 16, "seq_len": 32, "batch_size": 4},
        "accuracy": {"data": "data/eval.txt", "seq_len": 32},
        "benchmark": {"batch_sizes": [1, 2], "seq_lens": [16]},
    }
    path = root / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": {"tiny": pipeline}}))
    return spec_module.load(path).pipelines["tiny"]


@pytest.fixture(scope="module")
def bert(tiny_bert_dir, tmp_path_factory):
    """One tiny-BERT export and its fp32/fp16/int8 precision outputs (for a CPU and a TensorRT target: both int8
    graphs), shared by the tests below."""
    root = tmp_path_factory.mktemp("precision")
    (root / "data").mkdir()
    for name in ("calibration.txt", "eval.txt"):
        shutil.copy(REPO / "data" / name, root / "data" / name)
    spec = _write_spec(root, tiny_bert_dir)
    store = ArtifactStore(root / "artifacts")
    exported = run_export(ExportConfig.of(spec), store)
    results = {p: run_precision(PrecisionConfig.of(spec, p), exported, store) for p in ("fp32", "fp16", "int8")}
    return spec, store, exported, results


def _run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]


@pytest.fixture(scope="module")
def eval_feeds(bert):
    spec, _, exported, _ = bert
    texts = read_texts(spec.resolve(spec.accuracy.data), limit=8)
    return encoder_feeds(load_tokenizer(ModelSource.of(spec)), texts, 8, 32, exported.outputs["inputs"])


def _cosines(reference: np.ndarray, other: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Cosine per sample of mean-pooled token embeddings (what a sentence encoder returns)."""
    weights = mask[..., None].astype(np.float32)
    a, b = (reference * weights).sum(1), (other * weights).sum(1)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _io_types(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input) + list(model.graph.output)]


def test_fp32_is_the_exported_graph(bert, eval_feeds):
    _, _, exported, results = bert
    assert results["fp32"].outputs["format"] == "passthrough"
    np.testing.assert_array_equal(_run(results["fp32"].file(MODEL_FILE), eval_feeds),
                                  _run(exported.file(MODEL_FILE), eval_feeds))


def test_fp16_has_half_weights_same_io_and_close_outputs(bert, eval_feeds):
    _, _, exported, results = bert
    fp16 = onnx.load(str(results["fp16"].file(MODEL_FILE)))
    weight_types = {init.data_type for init in fp16.graph.initializer if init.dims and len(init.dims) == 2}
    assert weight_types == {onnx.TensorProto.FLOAT16}
    assert _io_types(fp16) == _io_types(onnx.load(str(exported.file(MODEL_FILE))))
    half = _run(results["fp16"].file(MODEL_FILE), eval_feeds)
    full = _run(exported.file(MODEL_FILE), eval_feeds)
    assert half.dtype == np.float32
    np.testing.assert_allclose(half, full, atol=3e-2)


def test_int8_graph_is_lint_clean_calibrated_and_accurate(bert, eval_feeds):
    _, _, exported, results = bert
    int8 = results["int8"]
    model = onnx.load(str(int8.file(MODEL_FILE)))
    assert lint_qdq(model) == []
    assert int8.outputs["lint"]["QuantizeLinear"] > 0
    assert int8.file(CALIBRATION_FILE).is_file()
    assert int8.outputs["calibration"]["samples"] == 16
    full = _run(exported.file(MODEL_FILE), eval_feeds)
    cosines = _cosines(full, _run(int8.file(MODEL_FILE), eval_feeds), eval_feeds["attention_mask"])
    assert cosines.min() > 0.9, cosines


def test_cpu_int8_graph_uses_integer_kernels_and_is_accurate(bert, eval_feeds):
    _, _, exported, results = bert
    cpu_path = results["int8"].file(CPU_MODEL_FILE)
    assert {"MatMulInteger", "DynamicQuantizeMatMul"} & {n.op_type for n in onnx.load(str(cpu_path)).graph.node}
    full = _run(exported.file(MODEL_FILE), eval_feeds)
    cosines = _cosines(full, _run(cpu_path, eval_feeds), eval_feeds["attention_mask"])
    assert cosines.min() > 0.9, cosines


def _float_inputs(model: onnx.ModelProto, pattern: str) -> dict[str, list[str]]:
    """For each node matching pattern: the op types producing its inputs."""
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    return {node.name: [producer.get(i, "initializer") for i in node.input]
            for node in model.graph.node if fnmatch.fnmatch(node.name, pattern)}


def test_excluded_matmuls_stay_float_in_both_int8_graphs(bert):
    _, _, _, results = bert
    int8 = results["int8"]
    assert int8.outputs["excluded_nodes"] == [f"/encoder/layer.{i}/output/dense/MatMul" for i in (0, 1)]
    assert int8.outputs["cpu_excluded_nodes"] == int8.outputs["excluded_nodes"]
    for name in (MODEL_FILE, CPU_MODEL_FILE):
        excluded = _float_inputs(onnx.load(str(int8.file(name))), EXCLUDED)
        assert len(excluded) == 2, name
        for node, producers in excluded.items():
            assert not {"DequantizeLinear", "DynamicQuantizeLinear"} & set(producers), (name, node, producers)
    quantized = _float_inputs(onnx.load(str(int8.file(MODEL_FILE))), "*/intermediate/dense/MatMul")
    assert all("DequantizeLinear" in producers for producers in quantized.values())


@pytest.mark.parametrize(("backend", "written", "absent"), [("onnxruntime", CPU_MODEL_FILE, MODEL_FILE),
                                                            ("tensorrt", MODEL_FILE, CPU_MODEL_FILE)])
def test_int8_writes_only_the_graph_its_targets_build_from(bert, tmp_path, backend, written, absent):
    """A CPU-only pipeline gets no TensorRT Q/DQ graph, a GPU-only one no CPU graph; the graph written is the one
    a pipeline with both targets gets, from the same calibration."""
    spec, _, exported, results = bert
    alone = spec.model_copy(update={"targets": [t for t in spec.targets if t.backend == backend]})
    int8 = run_precision(PrecisionConfig.of(alone, "int8"), exported, ArtifactStore(tmp_path))
    assert not int8.file(absent).exists() and absent not in int8.outputs["graphs"].values()
    assert file_digest(int8.file(written)) == file_digest(results["int8"].file(written))
    assert int8.file(CALIBRATION_FILE).read_text() == results["int8"].file(CALIBRATION_FILE).read_text()
    assert int8.key != results["int8"].key
    assert ("cpu_weight_bits" in int8.outputs) == (backend == "onnxruntime")
    assert (int8.outputs["lint"] != {}) == (backend == "tensorrt")


def test_second_run_is_cached(bert):
    spec, store, exported, results = bert
    again = run_precision(PrecisionConfig.of(spec, "int8"), exported, store)
    assert again.cached and again.key == results["int8"].key


def test_calibration_samples_change_the_int8_key_only(bert):
    spec, _, exported, _ = bert
    fewer = spec.model_copy(update={"calibration": spec.calibration.model_copy(update={"samples": 8})})

    def key(of: spec_module.PipelineSpec, precision: str) -> str:
        return precision_work(PrecisionConfig.of(of, precision), exported).key

    assert key(fewer, "int8") != key(spec, "int8")
    assert key(fewer, "fp16") == key(spec, "fp16")


def test_qdq_u8s8_cpu_graph_reuses_the_calibration(bert, eval_feeds, tmp_path):
    spec, _, exported, results = bert
    u8s8 = spec.model_copy(update={"quantization": spec.quantization.model_copy(update={"cpu_format": "qdq-u8s8"})})
    result = run_precision(PrecisionConfig.of(u8s8, "int8"), exported, ArtifactStore(tmp_path))
    assert result.file(CALIBRATION_FILE).read_text() == results["int8"].file(CALIBRATION_FILE).read_text()
    cpu = onnx.load(str(result.file(CPU_MODEL_FILE)))
    zero_points = {init.name: init.data_type for init in cpu.graph.initializer}
    activation_types = {zero_points.get(n.input[2]) for n in cpu.graph.node if n.op_type == "QuantizeLinear"}
    assert activation_types == {onnx.TensorProto.UINT8}
    full = _run(exported.file(MODEL_FILE), eval_feeds)
    assert _cosines(full, _run(result.file(CPU_MODEL_FILE), eval_feeds), eval_feeds["attention_mask"]).min() > 0.9
    assert result.outputs["cpu_uncalibrated"] == {"count": 0, "tensors": [], "nodes": []}


def test_unmatched_exclusion_glob_is_an_error_naming_it(bert, tmp_path):
    spec, _, exported, _ = bert
    typo = spec.model_copy(update={"quantization": spec.quantization.model_copy(
        update={"exclude_nodes": ["*/outptu/dense/MatMul"]})})
    with pytest.raises(ValueError, match=r"exclude_nodes: '\*/outptu/dense/MatMul' matches no node"):
        run_precision(PrecisionConfig.of(typo, "int8"), exported, ArtifactStore(tmp_path))
    assert not list(tmp_path.rglob(MODEL_FILE))


def test_bf16_is_refused_with_the_reason(bert, tmp_path):
    spec, _, exported, _ = bert
    with pytest.raises(ValueError, match="bf16"):
        run_precision(PrecisionConfig.of(spec, "bf16"), exported, ArtifactStore(tmp_path))


def _chain(nodes: list[onnx.NodeProto], weights: list[str]) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        initializer=[onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), w) for w in weights])
    return onnx.helper.make_model(graph)


def test_exclusions_follow_nodes_through_fusion():
    """Renamed nodes inherit an exclusion through their weight, or through the tensor they now produce."""
    make = onnx.helper.make_node
    original = _chain([make("MatMul", ["x", "w1"], ["a"], name="proj/MatMul"),
                       make("MatMul", ["a", "w2"], ["b"], name="q/MatMul"),
                       make("Transpose", ["b"], ["c"], name="q/Transpose"),
                       make("Relu", ["c"], ["y"], name="act/Relu")], ["w1", "w2"])
    fused = _chain([make("FusedMatMul", ["x", "w1"], ["a"], name="MatMulFusion_0", domain="com.microsoft"),
                    make("Attention", ["a", "w_qkv"], ["c"], name="Attention_0", domain="com.microsoft"),
                    make("Relu", ["c"], ["y"], name="act/Relu")], ["w1", "w_qkv"])
    assert fused_exclusions(original, fused, ["proj/MatMul"]) == ["MatMulFusion_0"]
    assert fused_exclusions(original, fused, ["q/MatMul"]) == ["Attention_0"]
    assert fused_exclusions(original, fused, ["act/Relu"]) == ["act/Relu"]


def test_activations_missing_from_the_calibration_cache_are_reported_and_their_readers_kept_float(tmp_path):
    """A cache measured on another graph (the unfused one) has no range for new tensors; ORT would refuse them."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    make = onnx.helper.make_node
    model = _chain([make("MatMul", ["x", "w1"], ["a"], name="first/MatMul"),
                    make("Relu", ["a"], ["fused"], name="fused/Relu"),
                    make("MatMul", ["fused", "w2"], ["y"], name="second/MatMul")], ["w1", "w2"])
    onnx.save(model, tmp_path / "model.onnx")
    cache = tmp_path / CALIBRATION_FILE
    bound = np.array(4.0, dtype=np.float32)
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, {name: TensorData(lowest=-bound, highest=bound)
                                                             for name in ("x", "a", "y")}), cache)
    missing = uncalibrated(model, cache, ["MatMul"], [])
    assert missing == {"count": 1, "tensors": ["fused"], "nodes": ["second/MatMul"]}
    assert uncalibrated(model, cache, ["MatMul"], ["second/MatMul"])["count"] == 0
    options = {"quant_format": QuantFormat.QDQ, "op_types_to_quantize": ["MatMul"], "activation_type": QuantType.QUInt8,
               "calibrate_method": CalibrationMethod.MinMax, "calibration_cache_path": cache}
    with pytest.raises(ValueError, match="Quantization parameters are not specified for param fused"):
        quantize_static(tmp_path / "model.onnx", tmp_path / "int8.onnx", None, **options)
    quantize_static(tmp_path / "model.onnx", tmp_path / "int8.onnx", None, nodes_to_exclude=missing["nodes"], **options)
    producers = _float_inputs(onnx.load(str(tmp_path / "int8.onnx")), "*MatMul")
    assert producers["first/MatMul"] == ["DequantizeLinear", "DequantizeLinear"]
    assert producers["second/MatMul"][0] == "Relu"


def test_int8_of_a_llama_without_past_builds_on_the_most_fused_graph_that_can_be_typed(tiny_llama_dir, tmp_path):
    """ONNX Runtime's shape inference asserts on the extended-level fused graph of a Llama-family decoder
    exported without past; int8 then quantizes the basic level's graph and says why, instead of failing."""
    (tmp_path / "data").mkdir()
    for name in ("calibration.txt", "eval.txt"):
        shutil.copy(REPO / "data" / name, tmp_path / "data" / name)
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"llama": {
        "model": {"path": str(tiny_llama_dir), "task": "text-generation"},
        "profiles": [{"batch": [1, 1, 2], "seq": [1, 16, 32]}],
        "precisions": ["fp32", "int8"], "targets": [{"name": "cpu", "backend": "onnxruntime"}],
        "calibration": {"data": "data/calibration.txt", "samples": 8, "seq_len": 16, "batch_size": 2},
        "accuracy": {"data": "data/eval.txt", "seq_len": 16, "gates": {"top1_agreement": {"min": 0.5}}},
        "benchmark": {"batch_sizes": [1], "seq_lens": [16]}}}}))
    spec = spec_module.load(tmp_path / "pipelines.yaml").pipelines["llama"]
    store = ArtifactStore(tmp_path / "artifacts")
    exported = run_export(ExportConfig.of(spec), store)
    int8 = run_precision(PrecisionConfig.of(spec, "int8"), exported, store)

    fusion = int8.outputs["cpu_fusion"]
    assert fusion["level"] in ("extended", "basic")
    assert all("shape inference failed" in why and " at " in why for why in fusion["skipped"]), fusion
    ids = np.array([[1, 5, 9, 13, 17, 21, 25, 29]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None]}
    reference = _run(exported.path / "model.onnx", feeds)
    quantized = _run(int8.path / CPU_MODEL_FILE, feeds)
    assert quantized.shape == reference.shape
    assert (quantized.argmax(-1) == reference.argmax(-1)).mean() >= 0.5


def test_a_bare_assert_names_where_it_was_raised_and_every_error_is_one_line():
    from tasks.runtime.error_text import described

    def shape_inference():
        raise AssertionError  # what ONNX Runtime's symbolic shape inference's bare assert raises

    try:
        shape_inference()
    except AssertionError as e:
        assert described(e).startswith("AssertionError: (no message; raised at test_precision.py:")
    assert described(ValueError("Got invalid dimensions\n for input:  x\n")) == (
        "ValueError: Got invalid dimensions for input: x")
