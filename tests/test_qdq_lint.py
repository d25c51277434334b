"""The Q/DQ lint on small hand-built graphs: one clean, one per TensorRT rule broken."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.stages.qdq_lint import (
    RULE_CONSTANT_PARAMS,
    RULE_INT8,
    RULE_NO_INT32_DEQUANTIZE,
    RULE_PER_TENSOR_ACTIVATION,
    RULE_WEIGHT_AXIS,
    RULE_ZERO_POINT,
    QdqLintError,
    check_qdq,
    lint_qdq,
)

K, N = 4, 3


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _graph(act_zero: np.ndarray | None = np.int8(0), act_scale: np.ndarray = np.float32(0.1),
           weight_axis: int = 1, weight_zero: np.ndarray | None = None, int32_bias: bool = False,
           weight_op: str = "MatMul", scale_from_input: bool = False) -> onnx.ModelProto:
    """x[2,K] -> Q/DQ -> MatMul with an int8 per-channel weight W[K,N] -> (+ bias) -> y."""
    channels = (K, N)[weight_axis]
    inits = [_init("w_q", np.ones((K, N), np.int8)),
             _init("w_scale", np.full(channels, 0.02, np.float32)),
             _init("w_zero", np.zeros(channels, np.int8) if weight_zero is None else weight_zero),
             _init("x_scale", act_scale)]
    act_params = ["x_scale"]
    if act_zero is not None:
        inits.append(_init("x_zero", act_zero))
        act_params.append("x_zero")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])]
    nodes = []
    if scale_from_input:
        inputs.append(helper.make_tensor_value_info("runtime_scale", TensorProto.FLOAT, []))
        act_params[0] = "runtime_scale"
    nodes += [helper.make_node("QuantizeLinear", ["x", *act_params], ["x_q"], name="x/Quantize"),
              helper.make_node("DequantizeLinear", ["x_q", *act_params], ["x_dq"], name="x/Dequantize"),
              helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], name="w/Dequantize",
                               axis=weight_axis),
              helper.make_node(weight_op, ["x_dq", "w_dq"], ["mm"], name="dense/" + weight_op)]
    out = "mm"
    if int32_bias:
        inits += [_init("b_q", np.zeros(N, np.int32)), _init("b_scale", np.float32(0.002))]
        nodes += [helper.make_node("DequantizeLinear", ["b_q", "b_scale"], ["b"], name="bias/Dequantize"),
                  helper.make_node("Add", ["mm", "b"], ["y"], name="dense/Add")]
        out = "y"
    graph = helper.make_graph(nodes, "qdq", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, N])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _rules(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(p.node, p.rule) for p in lint_qdq(model)}


def test_tensorrt_style_graph_is_clean():
    assert lint_qdq(_graph()) == []
    assert check_qdq(_graph(), "clean.onnx") == {"QuantizeLinear": 1, "DequantizeLinear": 2}


def test_uint8_activation_is_rejected():
    assert _rules(_graph(act_zero=np.uint8(0))) == {("x/Quantize", RULE_INT8), ("x/Dequantize", RULE_INT8)}


def test_missing_zero_point_means_uint8_and_is_rejected():
    assert _rules(_graph(act_zero=None)) == {("x/Quantize", RULE_INT8), ("x/Dequantize", RULE_INT8)}


def test_asymmetric_zero_point_is_rejected():
    assert _rules(_graph(act_zero=np.int8(5))) == {("x/Quantize", RULE_ZERO_POINT),
                                                  ("x/Dequantize", RULE_ZERO_POINT)}
    assert _rules(_graph(weight_zero=np.array([0, 1, 0], np.int8))) == {("w/Dequantize", RULE_ZERO_POINT)}


def test_per_channel_activation_is_rejected():
    model = _graph(act_scale=np.full(K, 0.1, np.float32))
    for node in model.graph.node[:2]:
        node.attribute.append(helper.make_attribute("axis", 1))
        node.input[2] = "x_zero_vec"
    model.graph.initializer.append(_init("x_zero_vec", np.zeros(K, np.int8)))
    assert _rules(model) == {("x/Quantize", RULE_PER_TENSOR_ACTIVATION), ("x/Dequantize", RULE_PER_TENSOR_ACTIVATION)}


def test_matmul_weight_scaled_along_input_channels_is_rejected():
    problems = lint_qdq(_graph(weight_axis=0))
    assert [(p.node, p.rule) for p in problems] == [("w/Dequantize", RULE_WEIGHT_AXIS)]
    assert "expected axis 1" in problems[0].message and "dense/MatMul" in problems[0].message


def test_gemm_weight_axis_follows_trans_b():
    assert lint_qdq(_graph(weight_op="Gemm")) == []
    assert _rules(_graph(weight_op="Gemm", weight_axis=0)) == {("w/Dequantize", RULE_WEIGHT_AXIS)}


def test_int32_bias_dequantize_is_rejected():
    assert _rules(_graph(int32_bias=True)) == {("bias/Dequantize", RULE_NO_INT32_DEQUANTIZE)}


def test_scale_computed_at_run_time_is_rejected():
    assert _rules(_graph(scale_from_input=True)) == {("x/Quantize", RULE_CONSTANT_PARAMS),
                                                    ("x/Dequantize", RULE_CONSTANT_PARAMS)}


def test_check_raises_listing_every_problem_with_the_file():
    with pytest.raises(QdqLintError) as err:
        check_qdq(_graph(act_zero=np.uint8(0), int32_bias=True), "tiny int8 model.onnx")
    message = str(err.value)
    assert message.startswith("tiny int8 model.onnx: 3 Q/DQ problem(s)")
    assert f"bias/Dequantize: {RULE_NO_INT32_DEQUANTIZE}" in message and f"x/Quantize: {RULE_INT8}" in message
