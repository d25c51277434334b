"""The Q/DQ rules TensorRT's ONNX parser enforces, checked on any machine before a GPU build.

TensorRT 11 builds every network strongly typed from the Q/DQ nodes in the graph, and rejects
(or silently mis-builds) graphs outside its explicit-quantization subset: symmetric INT8 with
zero point 0, per-tensor activation scales, per-channel weight scales along the output-channel
axis, and no INT32 DequantizeLinear (ONNX Runtime's quantized bias). Finding that at precision
time costs seconds; finding it at build time costs a GPU job per arch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

QUANT_OPS = ("QuantizeLinear", "DequantizeLinear")

RULE_INT8 = "int8-only"
RULE_ZERO_POINT = "symmetric-zero-point"
RULE_CONSTANT_PARAMS = "constant-scale-and-zero-point"
RULE_PER_TENSOR_ACTIVATION = "per-tensor-activation"
RULE_WEIGHT_AXIS = "per-channel-weight-axis"
RULE_NO_INT32_DEQUANTIZE = "no-int32-dequantize"


@dataclass(frozen=True)
class LintProblem:
    """One violation: which node, which rule, and what was found instead."""

    node: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.node}: {self.rule}: {self.message}"


class QdqLintError(Exception):
    """A Q/DQ graph TensorRT would reject; `problems` lists every violation."""

    def __init__(self, where: str, problems: list[LintProblem]):
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{where}: {len(problems)} Q/DQ problem(s) TensorRT's ONNX parser rejects:\n{listed}")


class _Graph:
    """Constant values, element types and consumers of the tensors in one graph."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.constants: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        self.types: dict[str, int] = {i.name: i.data_type for i in graph.initializer}
        for info in list(graph.value_info) + list(graph.input) + list(graph.output):
            if info.type.HasField("tensor_type"):
                self.types.setdefault(info.name, info.type.tensor_type.elem_type)
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        for node in graph.node:
            for index, name in enumerate(node.input):
                self.consumers.setdefault(name, []).append((node, index))
            for name in node.output:
                self.producer[name] = node
            if node.op_type == "Constant":
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.constants[node.output[0]] = numpy_helper.to_array(value)
                    self.types[node.output[0]] = value.data_type

    def is_weight(self, name: str) -> bool:
        """A constant tensor, or a constant run through QuantizeLinear (weights stored as float + Q/DQ)."""
        if name in self.constants:
            return True
        node = self.producer.get(name)
        return node is not None and node.op_type == "QuantizeLinear" and node.input[0] in self.constants

    def rank(self, name: str) -> int | None:
        if name in self.constants:
            return self.constants[name].ndim
        node = self.producer.get(name)
        if node is not None and node.op_type == "QuantizeLinear":
            return self.rank(node.input[0])
        return None


def _node_name(node: onnx.NodeProto) -> str:
    return node.name or f"{node.op_type}({node.output[0]})"


def _axis(node: onnx.NodeProto, rank: int | None) -> int:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    return axis + rank if axis < 0 and rank is not None else axis


def _quantized_type(graph: _Graph, node: onnx.NodeProto) -> int:
    """The integer type on the quantized side of a Q or DQ node (ONNX's default is UINT8)."""
    if len(node.input) > 2 and node.input[2]:
        return graph.types.get(node.input[2], TensorProto.UNDEFINED)
    if node.op_type == "QuantizeLinear":
        return next((a.i for a in node.attribute if a.name == "output_dtype" and a.i), TensorProto.UINT8)
    source = node.input[0]
    if source in graph.types:
        return graph.types[source]
    producer = graph.producer.get(source)
    if producer is not None and producer.op_type == "QuantizeLinear":
        return _quantized_type(graph, producer)
    return TensorProto.UINT8


def _weight_axis(consumer: onnx.NodeProto, index: int, rank: int) -> int | None:
    """The output-channel axis TensorRT expects for a per-channel weight, None if not a weight input."""
    if index != 1:
        return None
    if consumer.op_type == "Conv":
        return 0
    if consumer.op_type == "ConvTranspose":
        return 1
    if consumer.op_type == "MatMul":
        return rank - 1
    if consumer.op_type == "Gemm":
        trans_b = next((a.i for a in consumer.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return None


def _check_node(graph: _Graph, node: onnx.NodeProto) -> list[LintProblem]:
    name = _node_name(node)
    problems = []
    qtype = _quantized_type(graph, node)
    if node.op_type == "DequantizeLinear" and qtype == TensorProto.INT32:
        return [LintProblem(name, RULE_NO_INT32_DEQUANTIZE,
                            f"dequantizes INT32 {node.input[0]!r} (a quantized bias); keep biases in float")]
    if qtype != TensorProto.INT8:
        problems.append(LintProblem(name, RULE_INT8,
                                    f"quantized type is {TensorProto.DataType.Name(qtype)}, expected INT8"))
    scale_name = node.input[1]
    zero_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    for param in filter(None, (scale_name, zero_name)):
        if param not in graph.constants:
            problems.append(LintProblem(name, RULE_CONSTANT_PARAMS, f"{param!r} is computed at run time, "
                                        "expected an initializer or Constant"))
    if zero_name in graph.constants and np.any(graph.constants[zero_name] != 0):
        values = np.unique(graph.constants[zero_name])[:4].tolist()
        problems.append(LintProblem(name, RULE_ZERO_POINT, f"zero point {zero_name!r} has values {values}, "
                                    "expected all 0 (symmetric)"))
    scale = graph.constants.get(scale_name)
    if scale is None or scale.size == 1:
        return problems
    source = node.input[0]
    if not graph.is_weight(source):
        problems.append(LintProblem(name, RULE_PER_TENSOR_ACTIVATION, f"activation {source!r} has {scale.size} "
                                    "scales, expected one (per-tensor)"))
        return problems
    if node.op_type == "DequantizeLinear":
        rank = graph.rank(source)
        axis = _axis(node, rank)
        for consumer, index in graph.consumers.get(node.output[0], []):
            expected = _weight_axis(consumer, index, rank or 2)
            if expected is not None and axis != expected:
                problems.append(LintProblem(name, RULE_WEIGHT_AXIS,
                                            f"per-channel axis {axis} for the weight of {consumer.op_type} "
                                            f"{_node_name(consumer)!r}, expected axis {expected} (output channels)"))
    return problems


def lint_qdq(model: onnx.ModelProto) -> list[LintProblem]:
    """Every Q/DQ node that breaks a rule of TensorRT's explicit quantization; empty when clean."""
    graph = _Graph(model)
    return [problem for node in model.graph.node if node.op_type in QUANT_OPS
            for problem in _check_node(graph, node)]


def check_qdq(model: onnx.ModelProto, where: str) -> dict[str, int]:
    """Raise QdqLintError naming `where` when the graph breaks a rule; else count its Q/DQ nodes."""
    problems = lint_qdq(model)
    if problems:
        raise QdqLintError(where, problems)
    return {op: sum(n.op_type == op for n in model.graph.node) for op in QUANT_OPS}
