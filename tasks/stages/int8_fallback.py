"""Accuracy-aware int8: keep the nodes int8 hurts most in float until the accuracy gate passes on calibration data.

The accuracy stage judges an engine on held-out text, after the build; by then the graph is fixed.
So the precision stage checks the pipeline's own accuracy gates (cosine_mean / cosine_min for encoders,
top1_agreement for decoders) on the calibration feeds, int8 vs the exported fp32 graph, both run by
ONNX Runtime. When they fail, each quantized node's sensitivity is measured in one pass: the error its
own quantization adds (its int8 output vs the same op in float on the int8 graph's own inputs). The
most sensitive nodes are then kept in float one at a time, re-quantizing from the cached calibration
ranges, until the gates pass or quantization.accuracy_fallback.max_float_share of the quantizable
nodes is float. The exclusions go to every int8 graph (TensorRT's Q/DQ one and the CPU one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from tasks.config.spec import ModelSpec, PipelineSpec
from tasks.stages.accuracy import cosine, mean_pool

PROBE_BATCHES = 4  # calibration batches the one-pass sensitivity reads (the gate check reads them all)


def gated_metrics(spec: PipelineSpec) -> dict[str, Any]:
    """The accuracy gates the calibration check can evaluate; an error when there is none to aim at (`smelter
    validate` refuses that already, by the same rule: PipelineSpec.fallback_gates)."""
    gates, why = spec.fallback_gates()
    if why:
        raise ValueError(f"pipeline {spec.name}: quantization.accuracy_fallback: {why}")
    return gates


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    return session.run(outputs, {k: v for k, v in feeds.items() if k in names})


def _primary_output(model: ModelSpec, exported: onnx.ModelProto) -> str:
    names = [o.name for o in exported.graph.output]
    wanted = "logits" if model.is_decoder or model.task == "text-classification" else "last_hidden_state"
    return wanted if wanted in names else names[0]


def calibration_metrics(model: ModelSpec, reference: list[np.ndarray], candidate: list[np.ndarray],
                        batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """The gated metrics of `candidate` outputs vs `reference` outputs, over every calibration sample."""
    if model.is_decoder:
        agree = [(r.argmax(-1) == c.argmax(-1))[b["attention_mask"][:, -r.shape[1]:].astype(bool)]
                 for r, c, b in zip(reference, candidate, batches)]
        return {"top1_agreement": float(np.concatenate(agree).mean())}
    if model.task == "text-classification":
        cosines = np.concatenate([cosine(r, c) for r, c in zip(reference, candidate)])
    else:
        cosines = np.concatenate([cosine(mean_pool(r, b["attention_mask"]), mean_pool(c, b["attention_mask"]))
                                  for r, c, b in zip(reference, candidate, batches)])
    return {"cosine_mean": float(cosines.mean()), "cosine_min": float(cosines.min())}


def _fails(metrics: dict[str, float], gates: dict[str, Any]) -> list[str]:
    return [f"{name} {why}" for name, gate in gates.items() if (why := gate.violation(metrics[name]))]


def quantized_nodes(model: onnx.ModelProto, op_types: list[str], excluded: list[str]) -> list[str]:
    """The nodes quantization may rewrite, in graph order: the float share is counted over these."""
    skip = set(excluded)
    return [n.name for n in model.graph.node if n.op_type in op_types and n.name not in skip]


def _probe(model: onnx.ModelProto, tensors: list[str]) -> ort.InferenceSession:
    """A session of `model` that also returns these intermediate tensors."""
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    present = {o.name for o in probed.graph.output}
    probed.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors if t not in present)
    return _session(probed)


def _nmse(value: np.ndarray, exact: np.ndarray) -> float:
    value, exact = value.astype(np.float64), exact.astype(np.float64)
    return float(((value - exact) ** 2).sum() / max((exact ** 2).sum(), 1e-30))


def sensitivity(source: onnx.ModelProto, quantized: onnx.ModelProto, nodes: list[str],
                batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Each node's own int8 error, as relative squared error of its output (mean over a few calibration batches).

    A MatMul's is its int8 output vs the float product of the int8 graph's own float inputs: that
    isolates the error the node adds from what reaches it from upstream. Other op types (Gemm, Conv)
    count how much their output's error vs fp32 exceeds their inputs' (the same idea, less directly).
    """
    weights = {init.name: onnx.numpy_helper.to_array(init) for init in source.graph.initializer}
    by_name = {n.name: n for n in source.graph.node}
    wanted = sorted({t for name in nodes for t in (*by_name[name].input, *by_name[name].output)
                     if t and t not in weights})
    int8 = _probe(quantized, wanted)
    fp32 = _probe(source, wanted) if any(by_name[n].op_type != "MatMul" for n in nodes) else None
    errors = dict.fromkeys(nodes, 0.0)
    probes = batches[:PROBE_BATCHES]
    for feeds in probes:
        values = dict(zip(wanted, _run(int8, feeds, wanted)))
        exact = dict(zip(wanted, _run(fp32, feeds, wanted))) if fp32 else {}
        for name in nodes:
            node = by_name[name]
            if node.op_type == "MatMul":
                a, b = (values[i] if i in values else weights[i] for i in node.input[:2])
                error = _nmse(values[node.output[0]], np.matmul(a.astype(np.float64), b.astype(np.float64)))
            else:
                upstream = max((_nmse(values[i], exact[i]) for i in node.input if i in values), default=0.0)
                error = max(_nmse(values[node.output[0]], exact[node.output[0]]) - upstream, 0.0)
            errors[name] += error / len(probes)
    return errors


def keep_until_passing(spec: PipelineSpec, source: Path, target: Path, batches: list[dict[str, np.ndarray]],
                       excluded: list[str], op_types: list[str],
                       quantize: Callable[[list[str]], None]) -> tuple[list[str], dict[str, Any]]:
    """`excluded` plus the nodes kept float by the fallback, and the record of what was measured.

    `quantize(excluded)` writes the int8 graph to `target`; it has run once with `excluded` already.
    """
    started = time.perf_counter()
    settings = spec.quantization.accuracy_fallback
    gates = gated_metrics(spec)
    model = onnx.load(str(source))
    output = _primary_output(spec.model, model)
    fp32 = _session(source)
    reference = [_run(fp32, feeds, [output])[0] for feeds in batches]

    def measure() -> dict[str, float]:
        session = _session(target)
        return calibration_metrics(spec.model, reference, [_run(session, f, [output])[0] for f in batches], batches)

    before = measure()
    record: dict[str, Any] = {"max_float_share": settings.max_float_share, "gates": list(gates),
                              "data": "calibration", "before": _rounded(before)}
    if not _fails(before, gates):
        return excluded, record | {"needed": False, "passed": True, "kept": [], "after": _rounded(before),
                                   "seconds": round(time.perf_counter() - started, 3)}
    quantizable = [n.name for n in model.graph.node if n.op_type in op_types]
    candidates = quantized_nodes(model, op_types, excluded)
    budget = math.floor(settings.max_float_share * len(quantizable)) - (len(quantizable) - len(candidates))
    errors = sensitivity(model, onnx.load(str(target)), candidates, batches)
    ranked = sorted(candidates, key=lambda n: (-errors[n], n))
    kept, after = [], before
    for name in ranked[:max(budget, 0)]:
        kept.append(name)
        quantize(sorted(excluded + kept))
        after = measure()
        if not _fails(after, gates):
            break
    still = _fails(after, gates)
    return sorted(excluded + kept), record | {
        "needed": True, "passed": not still, "kept": kept, "after": _rounded(after), "failing": still,
        "quantizable_nodes": len(quantizable), "float_nodes": len(quantizable) - len(candidates) + len(kept),
        "float_share": round((len(quantizable) - len(candidates) + len(kept)) / len(quantizable), 4),
        "sensitivity": [{"node": n, "error": float(f"{errors[n]:.4g}")} for n in ranked],
        "seconds": round(time.perf_counter() - started, 3)}


def graph_metrics(spec: PipelineSpec, source: Path, graph: Path, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """The gated metrics of another int8 graph (the CPU one) on the same calibration feeds."""
    output = _primary_output(spec.model, onnx.load(str(source), load_external_data=False))
    fp32, session = _session(source), _session(graph)
    reference = [_run(fp32, f, [output])[0] for f in batches]
    return _rounded(calibration_metrics(spec.model, reference, [_run(session, f, [output])[0] for f in batches],
                                        batches))


def _rounded(metrics: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in metrics.items()}

