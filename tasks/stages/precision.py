"""Precision lives in the graph: the exported ONNX rewritten so its types say fp32, fp16 or int8.

It writes the graphs the pipeline's targets build from (tasks.backends.base.GRAPHS; each target names
its own in `source_graph`). model.onnx is backend-neutral: ONNX Runtime runs it on a CPU (so a quantized
model's accuracy is measurable anywhere) and TensorRT builds it strongly typed. For int8 that means
TensorRT's Q/DQ dialect (symmetric S8, per-channel weights, float bias), linted before it is written. That
graph is slow on ONNX Runtime's x86 kernels, so a target that runs there builds from model.cpu.onnx: the
graph fused the way ONNX Runtime fuses it, then quantized the way its CPU kernels are fast (dynamic, or U8S8
QDQ), with 7-bit weights where its backend says the CPU's int8 products saturate.
Calibration runs once, on real text, over the exported graph's tensors (calibration.json), as the neutral
graph is quantized (into scratch when no target builds from it). The qdq-u8s8 CPU graph reuses those ranges
without recalibrating, so a tensor that exists only after fusion has no range: the nodes using one stay
float, listed in cpu_uncalibrated.
"""

from __future__ import annotations

import contextlib
import fnmatch
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort

from tasks.backends.base import GRAPHS, BackendUnavailable, get_backend
from tasks.backends.table import BACKENDS
from tasks.config.spec import PipelineSpec, QuantizationSpec, TargetSpec
from tasks.runtime import killpoints
from tasks.runtime.error_text import described
from tasks.runtime.stage_runner import Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, file_digest, tool_versions
from tasks.stages.calibration_feeds import CalibrationSource, calibration_batches
from tasks.stages.qdq_lint import check_qdq

if TYPE_CHECKING:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod

    from tasks.stages.int8_fallback import FallbackConfig

STAGE = "precision"
TOOLS = ("onnx", "onnxruntime")
# what the stage computes: part of the key
CODE = ("tasks.stages.precision", "tasks.stages.qdq_lint", "tasks.stages.calibration_feeds", "tasks.stages.inputs",
        "tasks.stages.int8_fallback")
MODEL_FILE = GRAPHS["neutral"]
CPU_MODEL_FILE = GRAPHS["cpu"]
CALIBRATION_FILE = "calibration.json"
EXTERNAL_DATA_THRESHOLD = 1 << 30

QUANTIZED_OP_TYPES = ("MatMul", "Gemm", "Conv", "ConvTranspose")
CPU_DYNAMIC_OP_TYPES = QUANTIZED_OP_TYPES + ("Attention",)
FORMATS = {"fp32": "passthrough", "fp16": "cast-fp16", "int8": "qdq-s8-tensorrt"}


# The graphs each precision can be written as: every precision has its neutral graph, int8 a CPU one too.
WRITABLE = {"fp32": ("neutral",), "fp16": ("neutral",), "int8": ("neutral", "cpu")}


@dataclass(frozen=True)
class PrecisionConfig:
    """What the precision stage reads of a pipeline for one precision: the pipeline's name (for messages), the
    graphs its targets build from (`graphs`, names of tasks.backends.base.GRAPHS) and, for int8 only,
    `quantization:` and the calibration feeds, plus what the accuracy fallback reads when
    quantization.accuracy_fallback is set (tasks/stages/int8_fallback.py FallbackConfig). fp32 and fp16 read
    nothing else: their key is the export's and the precision."""

    pipeline: str
    precision: str
    quantization: QuantizationSpec | None = None
    calibration: CalibrationSource | None = None
    fallback: FallbackConfig | None = None
    graphs: tuple[str, ...] = ("neutral",)
    # How the CPU running the `cpu` graph adds int8 products (Backend.int8_products): a CPU graph made for one
    # that saturates has 7-bit weights, so the choice is part of the key. None without a `cpu` graph.
    cpu_int8_products: str | None = None

    @classmethod
    def of(cls, spec: PipelineSpec, precision: str) -> PrecisionConfig:
        built = {c.target for c in spec.candidates() if c.precision == precision}
        targets = [t for t in spec.targets if t.name in built and BACKENDS[t.backend].source == "onnx"]
        graphs = source_graphs(spec.name, precision, targets)
        if precision != "int8":
            return cls(spec.name, precision, graphs=graphs)
        from tasks.stages.int8_fallback import FallbackConfig

        fallback = FallbackConfig.of(spec) if spec.quantization.accuracy_fallback is not None else None
        cpu_targets = [t for t in targets if t.source_graph("int8") == "cpu"]
        products = cpu_int8_products(cpu_targets) if cpu_targets else None
        return cls(spec.name, precision, spec.quantization, CalibrationSource.of(spec), fallback, graphs, products)


def source_graphs(pipeline: str, precision: str, targets: list[TargetSpec]) -> tuple[str, ...]:
    """The graphs of `precision` that `targets` (those building it from this stage's graphs) build from, in GRAPHS
    order, the neutral one where none does (a caller that runs the stage alone); an error naming a target that
    asks for a graph this stage does not write."""
    writable = WRITABLE.get(precision, ("neutral",))
    wanted = set()
    for target in targets:
        graph = target.source_graph(precision)
        if graph not in writable:
            raise ValueError(f"pipeline {pipeline}: target {target.name} (backend {target.backend}) builds "
                             f"{precision} from graph {graph!r}; the precision stage writes {', '.join(writable)} "
                             f"for {precision}")
        wanted.add(graph)
    return tuple(g for g in GRAPHS if g in wanted) or ("neutral",)


def cpu_int8_products(targets: list[TargetSpec]) -> str:
    """`saturating` if the backend of any of `targets` (those building from the int8 `cpu` graph) says its CPU's
    int8 products saturate (7-bit weights are exact on every CPU), else `exact`. A backend that cannot load here
    builds nothing here."""
    answers = set()
    for target in targets:
        try:
            answers.add(get_backend(target.backend).int8_products(target))
        except BackendUnavailable:
            continue
    return "saturating" if "saturating" in answers else "exact"


def precision_work(config: PrecisionConfig, export_result: StageResult) -> Work:
    """The exported graph rewritten for one precision (Cast nodes, or calibrated Q/DQ for int8)."""
    precision = config.precision
    if precision not in FORMATS:
        raise ValueError(f"pipeline {config.pipeline}: precision {precision!r} has no graph rewrite here; "
                         f"supported: {', '.join(FORMATS)} (bf16 is not: ONNX Runtime's CPU kernels cannot "
                         "run a bf16 graph, so its accuracy could not be checked before a GPU build)")
    settings, tools = _settings(config), tool_versions(*TOOLS)

    def produce(w: StageWriter, _published: StageResult | None) -> None:
        source = export_result.file(MODEL_FILE)
        if not source.is_file():
            raise FileNotFoundError(f"pipeline {config.pipeline}: export output {source} is missing")
        if precision == "fp32":
            _save(onnx.load(str(source)), w.dir / MODEL_FILE)
            w.outputs.update(_outputs(precision))
        elif precision == "fp16":
            _save(to_fp16(onnx.load(str(source))), w.dir / MODEL_FILE)
            w.outputs.update(_outputs(precision))
        else:
            w.outputs.update(_int8(config, source, w.dir))

    parts = {"upstream": {"export": export_result.key, "files": export_result.content}, "config": settings,
             "tools": tools}
    return Work(config.pipeline, STAGE, parts, CODE, produce, inputs={"export": export_result.key}, config=settings,
                tools=tools)


def _settings(config: PrecisionConfig) -> dict[str, Any]:
    settings: dict[str, Any] = {"precision": config.precision, "format": FORMATS.get(config.precision)}
    if config.precision == "int8":
        calib = config.calibration
        settings |= {"quantization": config.quantization, "calibration": calib.calibration,
                     "calibration_data_sha256": file_digest(calib.data_path), "calibration_past": calib.past,
                     "op_types": list(QUANTIZED_OP_TYPES), "graphs": list(config.graphs)}
        if "cpu" in config.graphs:
            settings["cpu_int8_products"] = config.cpu_int8_products
        if config.fallback is not None:  # the fallback aims at these gates
            settings["fallback_gates"] = config.fallback.gates
    return settings


def run_precision(config: PrecisionConfig, export_result: StageResult, store: ArtifactStore,
                  force: bool = False) -> StageResult:
    """Write the graph for one precision (cached by its work's key)."""
    return run_stage(precision_work(config, export_result), store, force)


def _outputs(precision: str, graphs: tuple[str, ...] = ("neutral",), **extra: Any) -> dict[str, Any]:
    return {"precision": precision, "format": FORMATS[precision], "graphs": {g: GRAPHS[g] for g in graphs},
            "calibration": {}, "excluded_nodes": [], "lint": {}} | extra


def _save(model: onnx.ModelProto, path: Path) -> None:
    """Weights inline for small models; one external data file beside the graph past 1 GiB."""
    large = sum(len(t.raw_data) for t in model.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    onnx.save_model(model, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data")


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """float16 weights and compute, with graph inputs/outputs kept in their original types.

    Keeping the IO types means every consumer (accuracy, benchmark, each backend) feeds the
    same int64 ids and reads float32 outputs, whatever the precision inside.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True)


def calibration_method(name: str) -> CalibrationMethod:
    """The onnxruntime calibration method for calibration.method (minmax, entropy or percentile)."""
    from onnxruntime.quantization import CalibrationMethod

    return {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}[name]


def text_calibration_reader(batches: list[dict[str, np.ndarray]]) -> CalibrationDataReader:
    """Calibration feeds made from real text; ranges are only as realistic as the text is."""
    from onnxruntime.quantization import CalibrationDataReader

    class TextCalibrationReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._next = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._next, None)
            if batch is not None:
                killpoints.reach("calibration")  # a test seam: ORT has started collecting ranges
            return batch

        def __len__(self) -> int:
            return len(batches)

    return TextCalibrationReader()


def excluded_nodes(model: onnx.ModelProto, quant: QuantizationSpec, pipeline: str) -> list[str]:
    """Nodes kept in float: names matching quantization.exclude_nodes globs, and exclude_op_types.

    A glob that matches nothing is an error: a typo would otherwise quantize the very layer the
    user meant to protect, and only show up as an accuracy gate failure much later.
    """
    names = [node.name for node in model.graph.node]
    excluded = {node.name for node in model.graph.node if node.op_type in quant.exclude_op_types}
    for pattern in quant.exclude_nodes:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            sample = ", ".join(n for n in names if n)[:300]
            raise ValueError(f"pipeline {pipeline}: quantization.exclude_nodes: {pattern!r} matches no node of "
                             f"the exported graph; node names look like: {sample}")
        excluded.update(matched)
    return sorted(excluded)


def fused_exclusions(original: onnx.ModelProto, fused: onnx.ModelProto, excluded: Iterable[str]) -> list[str]:
    """The nodes of a fused graph that stand for the excluded nodes of the original graph.

    Fusion renames and merges nodes, so a name glob written against the exported graph may match
    nothing after it. A fused node inherits an exclusion when it kept the excluded node's name,
    or consumes the excluded node's weight, or produces the first tensor downstream of the
    excluded node that survived fusion (fused subgraphs keep their final output's name, since
    the rest of the graph still reads it).
    """
    fused_names = {node.name for node in fused.graph.node}
    fused_weights = {init.name for init in fused.graph.initializer}
    weight_users: dict[str, set[str]] = {}
    fused_producer: dict[str, str] = {}
    for node in fused.graph.node:
        for name in node.input:
            if name in fused_weights:
                weight_users.setdefault(name, set()).add(node.name)
        for name in node.output:
            fused_producer[name] = node.name
    original_nodes = {node.name: node for node in original.graph.node}
    original_consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in original.graph.node:
        for name in node.input:
            original_consumers.setdefault(name, []).append(node)
    mapped: set[str] = set()
    for name in excluded:
        node = original_nodes[name]
        if name in fused_names:
            mapped.add(name)
            continue
        users = [weight_users[w] for w in node.input if w in weight_users]
        if users:
            mapped.update(*users)
            continue
        mapped.update(_absorbing_nodes(node, original_consumers, fused_producer))
    return sorted(mapped)


def _absorbing_nodes(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]],
                     fused_producer: dict[str, str]) -> set[str]:
    """Producers, in the fused graph, of the first tensors after `node` that survived fusion."""
    found: set[str] = set()
    pending, seen = list(node.output), set()
    while pending:
        tensor = pending.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        if tensor in fused_producer:
            found.add(fused_producer[tensor])
            continue
        for consumer in consumers.get(tensor, []):
            pending.extend(consumer.output)
    return found


# ONNX Runtime's fusion levels, most fused first: the graph CPU int8 is quantized on is the most fused one
# that symbolic shape inference can type (on a Llama-family graph without past it asserts on an Expand
# of the extended level's fused graph, while the basic level's graph types fine).
FUSION_LEVELS = ("extended", "basic")


def fuse_for_cpu(source: Path, target: Path) -> dict[str, Any]:
    """ONNX Runtime's own graph fusions, saved so quantization sees the fused graph; returns the level kept
    and why more fused levels were not.

    Quantizing after fusion is what makes int8 fast on x86: the integer kernels then cover
    whole fused ops instead of Q/DQ pairs around every small op that fusion can no longer merge.
    Symbolic shape inference then types the outputs of the fused contrib ops (BiasGelu, ...; decoders need
    guess_output_rank for their rotary and mask subgraphs);
    the quantizer silently leaves an untyped tensor in float, so a level it cannot type is not used.
    """
    skipped = []
    for level in FUSION_LEVELS:
        try:
            _save(_typed(_fused(source, target, level)), target)
            return {"level": level, "skipped": skipped}
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's inference asserts without a message
            skipped.append(f"{level}: shape inference failed ({described(e)})")
    raise RuntimeError(f"{source}: no fused graph for CPU int8 could be typed: {'; '.join(skipped)}")


def _fused(source: Path, target: Path, level: str) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level.upper()}")
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(target))


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):  # on failure it dumps the model in cwd
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)


def _tensorrt_options(model: onnx.ModelProto) -> dict[str, Any]:
    """quantize_static options that yield TensorRT's dialect: symmetric S8, float bias, Q/DQ on inputs only."""
    return {"QuantizeBias": False, "ActivationSymmetric": True, "WeightSymmetric": True,
            "AddQDQPairToWeight": True, "DedicatedQDQPair": False, "ForceQuantizeNoInputCheck": True,
            "OpTypesToExcludeOutputQuantization": sorted({n.op_type for n in model.graph.node}),
            "QDQOpTypePerChannelSupportToAxis": {"Conv": 0, "ConvTranspose": 1}}


def _int8(config: PrecisionConfig, source: Path, out_dir: Path) -> dict[str, Any]:
    """The int8 graphs config.graphs names. The neutral graph is quantized in any case: quantizing it
    calibrates (calibration.json, which the CPU graph reuses) and the accuracy fallback measures it; where no
    target builds from it, it is quantized into scratch and not published."""
    with tempfile.TemporaryDirectory(prefix="smelter-int8-") as scratch:
        neutral = out_dir / MODEL_FILE if "neutral" in config.graphs else Path(scratch) / MODEL_FILE
        return _int8_graphs(config, source, out_dir, neutral)


def _int8_graphs(config: PrecisionConfig, source: Path, out_dir: Path, neutral: Path) -> dict[str, Any]:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    quant, calib = config.quantization, config.calibration
    model = onnx.load(str(source))
    excluded = excluded_nodes(model, quant, config.pipeline)
    initializers = {init.name for init in model.graph.initializer}
    input_names = [i.name for i in model.graph.input if i.name not in initializers]
    batches = calibration_batches(calib, input_names)
    method = calibration_method(calib.calibration.method)
    op_types = [t for t in QUANTIZED_OP_TYPES if t not in quant.exclude_op_types]
    calibration_path = out_dir / CALIBRATION_FILE

    def quantize(nodes_to_exclude: list[str]) -> None:
        """The first call calibrates and writes calibration.json; later ones reuse its ranges."""
        reader = None if calibration_path.is_file() else text_calibration_reader(batches)
        quantize_static(source, neutral, reader, quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=op_types, per_channel=True, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8, nodes_to_exclude=nodes_to_exclude, calibrate_method=method,
                        extra_options=_tensorrt_options(model), calibration_cache_path=calibration_path)

    quantize(excluded)
    fallback = {}
    if config.fallback is not None:
        from tasks.stages.int8_fallback import keep_until_passing

        excluded, record = keep_until_passing(config.fallback, source, neutral, batches, excluded, op_types, quantize)
        fallback = {"accuracy_fallback": record}
    settings = calib.calibration
    outputs = _outputs("int8", config.graphs, excluded_nodes=excluded, **fallback,
                       calibration={"data": settings.data, "sha256": file_digest(calib.data_path),
                                    "samples": settings.samples, "method": settings.method,
                                    "seq_len": settings.seq_len, "batch_size": settings.batch_size,
                                    "batches": len(batches)})
    if "neutral" in config.graphs:
        lint = check_qdq(onnx.load(str(neutral)), f"{config.pipeline} int8 {MODEL_FILE}")
        outputs["lint"] = {"passed": True, **lint}
    if "cpu" in config.graphs:
        saturating = config.cpu_int8_products == "saturating"
        cpu_excluded, uncalibrated, fusion = _cpu_int8(quant, model, source, out_dir, excluded, method,
                                                       reduce_range=saturating)
        outputs |= {"cpu_format": quant.cpu_format, "cpu_fusion": fusion, "cpu_excluded_nodes": cpu_excluded,
                    "cpu_uncalibrated": uncalibrated, "cpu_int8_products": config.cpu_int8_products,
                    "cpu_weight_bits": 7 if saturating else 8}
        if fallback:
            from tasks.stages.int8_fallback import graph_metrics

            outputs["accuracy_fallback"]["cpu_graph"] = graph_metrics(config.fallback, source,
                                                                      out_dir / CPU_MODEL_FILE, batches)
    return outputs


def _cpu_int8(quant: QuantizationSpec, model: onnx.ModelProto, source: Path, out_dir: Path, excluded: list[str],
              method: CalibrationMethod, reduce_range: bool = False) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """model.cpu.onnx: the fused graph, int8 in the form ONNX Runtime's x86 kernels run fast; with 7-bit weights
    (`reduce_range`) for a CPU whose int8 products saturate (Backend.int8_products).

    Returns the fused graph's excluded nodes, what uncalibrated() found (nothing for dynamic,
    which measures ranges on every call) and the fusion level used (fuse_for_cpu).
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    skip_types = set(quant.exclude_op_types)
    with tempfile.TemporaryDirectory(prefix="smelter-fuse-") as tmp:
        fused_path = Path(tmp) / "fused.onnx"
        fusion = fuse_for_cpu(source, fused_path)
        fused = onnx.load(str(fused_path))
        cpu_excluded = fused_exclusions(model, fused, excluded)
        common = {"per_channel": True, "weight_type": QuantType.QInt8, "reduce_range": reduce_range}
        if quant.cpu_format == "dynamic":
            quantize_dynamic(fused_path, out_dir / CPU_MODEL_FILE, nodes_to_exclude=cpu_excluded,
                             op_types_to_quantize=[t for t in CPU_DYNAMIC_OP_TYPES if t not in skip_types], **common)
            return cpu_excluded, {"count": 0, "tensors": [], "nodes": []}, fusion
        op_types = [t for t in QUANTIZED_OP_TYPES if t not in skip_types]
        missing = uncalibrated(fused, out_dir / CALIBRATION_FILE, op_types, cpu_excluded)
        # The cache exists, so quantize_static loads it and never calibrates: no data reader is needed.
        quantize_static(fused_path, out_dir / CPU_MODEL_FILE, None, quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=op_types, activation_type=QuantType.QUInt8, calibrate_method=method,
                        calibration_cache_path=out_dir / CALIBRATION_FILE,
                        nodes_to_exclude=cpu_excluded + missing["nodes"], **common)
    return cpu_excluded, missing, fusion


def uncalibrated(model: onnx.ModelProto, calibration: Path, op_types: Iterable[str],
                 excluded: Iterable[str]) -> dict[str, Any]:
    """Activations (inputs, and outputs: QDQ quantizes both) of the quantizable, non-excluded nodes with no range.

    quantize_static refuses a whole graph when one of them lacks a range, so the nodes that
    touch them are returned too, to be kept float (and reported) instead.
    """
    from onnxruntime.quantization.calibrate import load_tensors_data

    ranges = load_tensors_data(calibration)
    weights = {init.name for init in model.graph.initializer}
    op_types, excluded = set(op_types), set(excluded)
    tensors: set[str] = set()
    nodes = []
    for node in model.graph.node:
        if node.op_type not in op_types or node.name in excluded:
            continue
        missing = {name for name in (*node.input, *node.output) if name and name not in weights and name not in ranges}
        if missing:
            tensors |= missing
            nodes.append(node.name)
    return {"count": len(tensors), "tensors": sorted(tensors), "nodes": sorted(nodes)}
