"""ONNX Runtime on the CPU: the graph optimized once, saved offline, and loaded without re-optimizing.

ORT's highest optimization level rewrites the graph for the CPU it runs on (NCHWc layouts, fused
kernels chosen by instruction set), so a saved model is only valid on a machine with the same ISA.
The ISA is therefore part of `hardware()`, hence of the build key, and `load()` refuses an engine
whose recorded ISA differs from this machine's.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from tasks.backends.base import Backend, BackendUnavailable, Runner, TargetSpec
from tasks.config.profiles import ProfileSpec

SIDECAR = "engine.json"
EXTERNAL_DATA = "model.onnx.data"
PROVIDERS = ["CPUExecutionProvider"]
CPUINFO = Path("/proc/cpuinfo")
# Instruction-set extensions that change which kernels ORT picks (x86 and Arm names as the kernel spells them).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
             "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")
# Where the CPU's int8 dot product sums in 32 bits. x86 without them multiplies u8 by s8 with VPMADDUBSW, which
# adds each pair of products into 16 bits and saturates (2 x 255 x 127 > 32767): ONNX Runtime's quantization
# docs advise 7-bit weights (reduce_range) there. Arm's dot products (and its plain widening path) are exact.
EXACT_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# Set on every session that runs an engine, and recorded with it (the engine card shows them): the intra-op pool
# still spins between the operators of a call, but stops when the call returns. By default it spins on for up
# to a second or more, taking a core from whatever runs next: in a benchmark the next engine or the PyTorch
# reference (the reference ran 1.6x slower than alone on a 2-core CPU), in a deployment the host's other work.
RUNTIME_CONFIG = {"session.force_spinning_stop": "1"}
# TargetSpec.optimization_level (0-5, shared with TensorRT) mapped onto ORT's graph optimization levels.
GRAPH_LEVELS = {0: "ORT_DISABLE_ALL", 1: "ORT_ENABLE_BASIC", 2: "ORT_ENABLE_EXTENDED"}
TOP_GRAPH_LEVEL = "ORT_ENABLE_ALL"


def cpu_isa(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """The CPU facts an offline-optimized ORT model depends on: architecture, model name, ISA flags."""
    machine = platform.machine()
    model_name, flags = None, set()
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model_name is None:
            model_name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"arch": f"cpu-{machine}", "machine": machine, "cpu": model_name or platform.processor() or machine,
            "isa": [flag for flag in ISA_FLAGS if flag in flags]}


def int8_products(isa: dict[str, Any] | None = None) -> str:
    """'exact' where int8 products sum in 32 bits (VNNI, AMX, Arm), 'saturating' on x86 without VNNI: the int8
    CPU graph is then quantized with 7-bit weights, whose pair of products cannot leave 16 bits (2 x 255 x 64)."""
    isa = isa or cpu_isa()
    if isa["machine"] not in ("x86_64", "AMD64", "i386", "i686"):
        return "exact"
    return "exact" if set(EXACT_INT8_FLAGS) & set(isa["isa"]) else "saturating"


def graph_level_name(target: TargetSpec) -> str:
    return GRAPH_LEVELS.get(target.optimization_level, TOP_GRAPH_LEVEL)


def _has_external_data(model_path: Path) -> bool:
    model = onnx.load(str(model_path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def _session_options(target: TargetSpec, level: str) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.intra_op_num_threads = target.threads or 0
    options.log_severity_level = 3
    for key, value in RUNTIME_CONFIG.items():
        options.add_session_config_entry(key, value)
    return options


def _describe_options(options: ort.SessionOptions, level: str) -> dict[str, Any]:
    """The session options that decide speed, written where a reader of the engine can see them."""
    return {"graph_optimization_level": level, "intra_op_num_threads": options.intra_op_num_threads,
            "inter_op_num_threads": options.inter_op_num_threads, "execution_mode": options.execution_mode.name,
            "enable_cpu_mem_arena": options.enable_cpu_mem_arena, "enable_mem_pattern": options.enable_mem_pattern,
            "config_entries": dict(RUNTIME_CONFIG)}


class OnnxRuntimeRunner(Runner):
    """An InferenceSession; feeds it only the inputs its graph declares (extra feeds are dropped)."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise ValueError(f"onnxruntime runner: missing inputs {missing}; the engine needs {self.input_names}")
        values = self.session.run(self.output_names, {name: feeds[name] for name in self.input_names})
        return dict(zip(self.output_names, values))

    def close(self) -> None:
        self.session = None


class OnnxRuntimeBackend(Backend):
    """CPU target: ORT graph optimization done at build time and saved as model.onnx."""

    name = "onnxruntime"
    engine_file = "model.onnx"

    def missing(self, target: TargetSpec) -> str | None:
        return None

    def version(self) -> str:
        return ort.__version__

    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        return cpu_isa()

    def int8_products(self, target: TargetSpec) -> str:
        """This CPU's (engines are built where they run: `hardware` ties them to its ISA)."""
        return int8_products()

    def build(self, onnx_path: Path, target: TargetSpec, profiles: list[ProfileSpec], out_dir: Path,
              cache_dir: Path) -> dict[str, Any]:
        """Optimize the graph once and save it; ORT models have dynamic shapes, so profiles need no build step."""
        level = graph_level_name(target)
        options = _session_options(target, level)
        engine = out_dir / self.engine_file
        options.optimized_model_filepath = str(engine)
        if _has_external_data(onnx_path):
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                             EXTERNAL_DATA)
        started = time.perf_counter()
        session = ort.InferenceSession(str(onnx_path), options, providers=PROVIDERS)
        build_seconds = time.perf_counter() - started
        if not engine.is_file():
            raise RuntimeError(f"onnxruntime did not write the optimized model {engine} from {onnx_path}")
        facts = {
            "onnxruntime_version": ort.__version__,
            "source_model": onnx_path.name,
            "session_options": _describe_options(options, level),
            "providers": session.get_providers(),
            "hardware": self.hardware(target),
            "optimize_seconds": round(build_seconds, 3),
            "engine_bytes": sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file()),
        }
        (out_dir / SIDECAR).write_text(json.dumps(facts, indent=2))
        return facts

    def load(self, engine_dir: Path, target: TargetSpec) -> Runner:
        """Open the optimized model with optimization off (it is already done) and the target's threads."""
        sidecar = engine_dir / SIDECAR
        try:
            recorded = json.loads(sidecar.read_text())
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"onnxruntime engine {engine_dir}: cannot read {SIDECAR}: {e}") from e
        here = self.hardware(target)
        if recorded["hardware"] != here:
            raise BackendUnavailable(
                f"onnxruntime engine {engine_dir} was optimized for {recorded['hardware']}, "
                f"this machine is {here}; rebuild it here")
        options = _session_options(target, "ORT_DISABLE_ALL")
        session = ort.InferenceSession(str(engine_dir / self.engine_file), options,
                                       providers=recorded["providers"])
        return OnnxRuntimeRunner(session)
