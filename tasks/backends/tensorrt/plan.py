"""What a TensorRT build or load should do, decided in plain Python so it is tested without a GPU.

tasks/backends/tensorrt/backend.py makes the TensorRT calls; everything that chooses *which* calls (shape
ranges per input, whether this GPU may build or load an engine, which timing cache to reuse, what
the sidecar records) lives here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tasks.backends.base import EngineMismatch, TargetSpec
from tasks.config.profiles import ProfileSpec
from tasks.runtime import gpu
from tasks.runtime.gpu import GpuInfo
from tasks.runtime.whole_file import write_whole

SIDECAR = "engine.json"
SIDECAR_FORMAT = 1
TIMING_CACHE_COPY = "timing.cache"
ARCH = re.compile(r"^sm(\d+)(\d)$")
AMPERE = (8, 0)
TRT_TO_NUMPY = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "INT32": "int32",
                "INT64": "int64", "BOOL": "bool", "UINT8": "uint8"}
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
PAST_INPUT = re.compile(r"^past_key_values\.\d+\.(key|value)$")

ShapeRange = dict[str, tuple[int, ...]]  # {"min": shape, "opt": shape, "max": shape}


def parse_arch(arch: str) -> tuple[int, int]:
    """'sm90' -> (9, 0), 'sm89' -> (8, 9), 'sm120' -> (12, 0): the last digit is the minor version."""
    match = ARCH.match(arch)
    if not match:
        raise ValueError(f"expected a GPU arch like 'sm90', got {arch!r}")
    return int(match.group(1)), int(match.group(2))


def arch_name(compute_capability: tuple[int, int]) -> str:
    return f"sm{compute_capability[0]}{compute_capability[1]}"


def cc_text(compute_capability: tuple[int, int]) -> str:
    return f"{compute_capability[0]}.{compute_capability[1]}"


def trt_major(version: str) -> int:
    """The gate every TensorRT 10-vs-11 code path keys on."""
    return int(version.split(".")[0])


def detect_gpu() -> GpuInfo | None:
    """CUDA device 0 as TensorRT will use it (tasks.runtime.gpu applies CUDA's order and CUDA_VISIBLE_DEVICES)."""
    return gpu.detect_gpu()


def build_problem(target: TargetSpec, gpu: GpuInfo | None) -> str | None:
    """Why this GPU cannot build `target`, or None.

    The arch must match, except for an `ampere_plus` target, whose engine runs on any Ampere or
    newer GPU and so may be built on any of them. `same_compute_capability` engines are portable
    across GPUs of the build GPU's compute capability, so the arch must still match.
    """
    wanted = parse_arch(target.arch or "")
    if gpu is None:
        return (f"target {target.name} ({target.arch}) needs an NVIDIA GPU with compute capability "
                f"{cc_text(wanted)}; no GPU is visible here (nvidia-smi found none)")
    if target.hardware_compatibility == "ampere_plus":
        if gpu.compute_capability < AMPERE:
            return (f"target {target.name} asks for ampere_plus hardware compatibility, which needs an Ampere or "
                    f"newer GPU (compute capability >= 8.0) to build; this machine has {gpu.name} ({gpu.cc})")
        return None
    if gpu.compute_capability != wanted:
        return (f"target {target.arch} wants compute capability {cc_text(wanted)}; this machine has "
                f"{gpu.name} ({gpu.cc}). Build it on a {target.arch} GPU, or set "
                f"hardware_compatibility: ampere_plus on the target")
    return None


def load_problem(sidecar: dict[str, Any], gpu: GpuInfo | None, trt_version: str) -> str | None:
    """Why this machine must not deserialize the engine the sidecar describes, or None."""
    built_cc = sidecar["compute_capability"]
    where = f"built with TensorRT {sidecar['tensorrt_version']} on {sidecar['gpu_name']} ({built_cc})"
    if gpu is None:
        return f"engine {where} needs an NVIDIA GPU; none is visible here"
    compat = sidecar.get("hardware_compatibility", "none")
    if compat == "ampere_plus":
        if gpu.compute_capability < AMPERE:
            return f"engine {where} is ampere_plus; this GPU {gpu.name} ({gpu.cc}) is older than Ampere"
    elif gpu.cc != built_cc:
        return f"engine {where} cannot load on {gpu.name} ({gpu.cc}): compute capability differs"
    built = sidecar["tensorrt_version"]
    if sidecar.get("version_compatible"):
        if trt_major(trt_version) != trt_major(built) or _version_tuple(trt_version) < _version_tuple(built):
            return (f"engine {where} is version compatible only with TensorRT {trt_major(built)}.x at or above "
                    f"{built}; this machine has TensorRT {trt_version}")
    elif trt_version != built:
        return f"engine {where} cannot load with TensorRT {trt_version}: rebuild it with this TensorRT"
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def onnx_input_dims(onnx_path: Path) -> dict[str, list[int | str]]:
    """Each graph input's dims: ints where static, the symbolic name ('' if unnamed) where dynamic."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    dims = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = value.type.tensor_type.shape.dim
        dims[value.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in shape]
    return dims


def dim_role(input_name: str, axis: int, symbol: str, has_past: bool) -> str | None:
    """Which profile dimension a dynamic axis follows: batch, seq, past or past+seq.

    The symbolic name decides (Optimum writes batch_size, sequence_length, past_sequence_length and
    'past_sequence_length + sequence_length'); unnamed or machine-named axes fall back to the
    position every exported text model uses.
    """
    lowered = symbol.lower()
    if "+" in lowered or "total" in lowered:
        return "past+seq"
    if "past" in lowered:
        return "past"
    if "batch" in lowered:
        return "batch"
    if "seq" in lowered:
        return "seq"
    if axis == 0:
        return "batch"
    if PAST_INPUT.match(input_name) and axis == 2:
        return "past"
    if input_name in TOKEN_INPUTS and axis == 1:
        return "past+seq" if input_name == "attention_mask" and has_past else "seq"
    return None


def profile_ranges(input_dims: dict[str, list[int | str]], profiles: list[ProfileSpec]) -> list[dict[str, ShapeRange]]:
    """One {input: {min, opt, max}} per pipelines.yaml profile, in the graph's input order."""
    has_past = any(PAST_INPUT.match(name) for name in input_dims)
    ranges = []
    for index, profile in enumerate(profiles):
        points = profile.shapes()
        per_input = {}
        for name, dims in input_dims.items():
            shapes = {}
            for point, sizes in points.items():
                shapes[point] = tuple(_dim_size(name, axis, dim, sizes, has_past, index)
                                      for axis, dim in enumerate(dims))
            per_input[name] = shapes
        ranges.append(per_input)
    return ranges


def _dim_size(name: str, axis: int, dim: int | str, sizes: dict[str, int], has_past: bool, index: int) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    role = dim_role(name, axis, str(dim), has_past)
    if role is None:
        raise ValueError(f"input {name!r} axis {axis} ({dim!r}) is dynamic but is not a batch, sequence or past "
                         f"length axis; export it with a static size or a name containing batch/sequence/past")
    if "past" in role and "past" not in sizes:
        raise ValueError(f"input {name!r} axis {axis} ({dim!r}) is a past length: profiles[{index}] needs "
                         f"'past: [min, opt, max]'")
    if role == "past+seq":
        return sizes["past"] + sizes["seq"]
    return sizes[role]


def choose_profile(ranges: list[dict[str, dict[str, list[int]]]], shapes: dict[str, tuple[int, ...]]) -> int:
    """The first optimization profile whose [min, max] holds every input shape."""
    for index, profile in enumerate(ranges):
        if all(name in profile and _within(shape, profile[name]) for name, shape in shapes.items()):
            return index
    wanted = ", ".join(f"{n}{list(s)}" for n, s in shapes.items())
    held = "; ".join(", ".join(f"{n}: {r['min']}..{r['max']}" for n, r in p.items()) for p in ranges)
    raise ValueError(f"no optimization profile of this engine holds the shapes {wanted}; profiles: {held}")


def _within(shape: tuple[int, ...], shape_range: dict[str, list[int]]) -> bool:
    low, high = shape_range["min"], shape_range["max"]
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high))


def timing_cache_path(cache_dir: Path, gpu: GpuInfo, trt_version: str) -> Path:
    """A timing cache is valid for one compute capability and one TensorRT build, so it is keyed by both."""
    return cache_dir / f"timing-{gpu.arch}-trt{trt_version}.cache"


def read_timing_cache(path: Path) -> bytes:
    return path.read_bytes() if path.is_file() else b""


def save_timing_cache(path: Path, data: bytes) -> None:
    """Atomic replace: builds running side by side never leave a torn cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, data)


def timing_cache_report(path: Path, before: bytes, after: bytes) -> dict[str, Any]:
    """'hit' means the build found every tactic timing in the cache it loaded (nothing new was timed)."""
    return {"file": path.name, "loaded_bytes": len(before), "saved_bytes": len(after),
            "hit": bool(before) and len(after) == len(before)}


def numpy_dtype(trt_dtype_name: str) -> str:
    """The numpy dtype name for a TensorRT DataType member name ('HALF' -> 'float16')."""
    try:
        return TRT_TO_NUMPY[trt_dtype_name]
    except KeyError:
        raise ValueError(f"engine I/O of TensorRT type {trt_dtype_name} has no numpy equivalent here; "
                         f"keep graph inputs and outputs in {', '.join(TRT_TO_NUMPY)}") from None


def host_storage(dtype: str) -> np.dtype:
    """numpy has no bfloat16: its bits travel as uint16."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def sidecar_profiles(ranges: list[dict[str, ShapeRange]]) -> list[dict[str, dict[str, list[int]]]]:
    return [{name: {point: list(shape) for point, shape in r.items()} for name, r in p.items()} for p in ranges]


def write_sidecar(engine_dir: Path, facts: dict[str, Any]) -> Path:
    path = engine_dir / SIDECAR
    path.write_text(json.dumps({"format": SIDECAR_FORMAT, **facts}, indent=2))
    return path


def read_sidecar(engine_dir: Path) -> dict[str, Any]:
    path = engine_dir / SIDECAR
    try:
        sidecar = json.loads(path.read_text())
    except OSError:
        raise EngineMismatch(f"{path} is missing: without it nobody knows which GPU and TensorRT the engine "
                             f"was built for; rebuild the engine") from None
    if sidecar.get("format") != SIDECAR_FORMAT:
        raise EngineMismatch(f"{path}: sidecar format {sidecar.get('format')!r}, expected {SIDECAR_FORMAT}; "
                             f"rebuild the engine")
    return sidecar


def check_loadable(engine_dir: Path, gpu: GpuInfo | None, trt_version: str) -> dict[str, Any]:
    """The sidecar, once it says this GPU and TensorRT may deserialize the engine."""
    sidecar = read_sidecar(engine_dir)
    problem = load_problem(sidecar, gpu, trt_version)
    if problem:
        raise EngineMismatch(f"{engine_dir}: {problem}")
    return sidecar
