"""Accuracy-aware int8 on minilm: calibration cosine before and after the fallback, and which nodes it kept float.

Starts from minilm's pipeline with no hand-written exclusions (quantization.exclude_nodes emptied), so the
fallback has to find the sensitive nodes itself; then scores the result on the held-out eval text too.
Usage: python benchmarks/int8_fallback_minilm.py [-f pipelines.yaml] [--share 0.2] [--artifacts DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tasks.backends.tensorrt.target import TensorRTTarget
from tasks.config.spec import AccuracyFallbackSpec, load
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore
from tasks.stages.accuracy import cosine, mean_pool
from tasks.stages.export import run_export
from tasks.stages.inputs import encoder_feeds, read_texts
from tasks.stages.models import load_tokenizer
from tasks.stages.precision import CPU_MODEL_FILE, MODEL_FILE, run_precision


def eval_cosines(spec, exported, graphs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """cosine mean/min of each graph vs the fp32 export on the pipeline's held-out eval text."""
    texts = read_texts(spec.resolve(spec.accuracy.data), limit=spec.accuracy.samples)
    feeds = encoder_feeds(load_tokenizer(ModelSource.of(spec)), texts, len(texts), spec.accuracy.seq_len,
                          exported.outputs["inputs"])

    def pooled(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return mean_pool(session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0],
                         feeds["attention_mask"])

    reference = pooled(exported.file(MODEL_FILE))
    found = {}
    for label, path in graphs.items():
        c = cosine(pooled(path), reference)
        found[label] = {"cosine_mean": round(float(c.mean()), 5), "cosine_min": round(float(c.min()), 5)}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--pipeline", default="minilm")
    parser.add_argument("--share", type=float, default=0.2, help="accuracy_fallback.max_float_share")
    parser.add_argument("--artifacts", help="artifact store (default: a temporary one)")
    args = parser.parse_args()

    spec = load(args.file, check_env=False).pipelines[args.pipeline]
    quant = spec.quantization.model_copy(update={"exclude_nodes": [],
                                                 "accuracy_fallback": AccuracyFallbackSpec(max_float_share=args.share)})
    both_graphs = [*spec.targets, TensorRTTarget(name="sm90", backend="tensorrt", arch="sm90")]  # Q/DQ and CPU int8
    spec = spec.model_copy(update={"quantization": quant, "targets": both_graphs})
    with tempfile.TemporaryDirectory() as scratch:
        store = ArtifactStore(args.artifacts or scratch)
        exported = run_export(ExportConfig.of(spec), store)
        result = run_precision(spec, exported, "int8", store)
        record = result.outputs["accuracy_fallback"]
        held_out = eval_cosines(spec, exported, {"int8 (TensorRT Q/DQ graph)": result.file(MODEL_FILE),
                                                 "int8 (CPU graph)": result.file(CPU_MODEL_FILE)})
    print(f"pipeline      {spec.name}, no hand-written exclusions, max_float_share {args.share}")
    print(f"calibration   {spec.calibration.samples} samples x {spec.calibration.seq_len} tokens")
    print(f"before        {json.dumps(record['before'])}")
    print(f"after         {json.dumps(record['after'])}   passed: {record['passed']}")
    print(f"kept float    {len(record['kept'])} of {record.get('quantizable_nodes', '?')} quantizable nodes "
          f"(share {record.get('float_share', 0)}): {', '.join(record['kept']) or 'none'}")
    print(f"CPU graph     {json.dumps(record['cpu_graph'])} (calibration text)")
    for label, metrics in held_out.items():
        print(f"held-out      {label}: {json.dumps(metrics)} ({spec.accuracy.samples} eval samples)")
    print(f"seconds       {record['seconds']}")
    top = record.get("sensitivity", [])[:5]
    if top:
        print("most sensitive: " + ", ".join(f"{s['node']} {s['error']:.3g}" for s in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
