"""TensorRT engines: the one module that imports tensorrt, imported lazily so CPU-only machines still work.

Every network is built strongly typed (the precision is in the ONNX graph as Cast or Q/DQ nodes):
TensorRT 11 has nothing else, and on 10.x we opt in, so one path serves both. Code that differs
between releases sits under `if _since(11):` (or `_since(10, 9)`); tests/test_tensorrt_api.py checks
every TensorRT name used here against the real 10.8 (the pinned image), newest 10.x and 11.x
bindings and understands that gate. Device memory, streams
and events go through Polygraphy's CUDA runtime wrapper, which needs no PyTorch.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.backends.base import Backend, BackendUnavailable, EngineMismatch, Runner, TargetSpec
from tasks.backends.tensorrt import plan as trt_plan
from tasks.config.profiles import ProfileSpec

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

ENGINE_FILE = "model.plan"
INSTALL_HINT = ("TensorRT is not installed (python package 'tensorrt'); build GPU engines in the docker image: "
                "docker build -f docker/Dockerfile -t smelter-trt . && docker run --gpus all smelter-trt smelter run "
                "(see docker/README.md)")


class EngineBuildError(RuntimeError):
    """TensorRT rejected the network; the message holds every parser or builder error."""


@functools.cache
def _trt():
    try:
        import tensorrt
    except ImportError as e:
        raise BackendUnavailable(f"{INSTALL_HINT} [{e}]") from None
    return tensorrt


def _release() -> tuple[int, int]:
    major, minor = _trt().__version__.split(".")[:2]
    return int(major), int(minor)


def _since(major: int, minor: int = 0) -> bool:
    """The version gate tests/test_tensorrt_api.py recognises: `if _since(11): ... else: ...`."""
    return _release() >= (major, minor)


def _logger(errors: list[str]) -> trt.ILogger:
    """A TensorRT logger that appends errors to `errors`, so a failure can say why instead of 'returned None'."""
    trt = _trt()

    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)

    return CollectingLogger()


def _network_flags() -> int:
    if _since(11):
        return 0
    trt = _trt()
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def _parse(network: trt.INetworkDefinition, onnx_path: Path, logger: trt.ILogger) -> None:
    """Parse the ONNX file (external data included) and report every error, not just the first."""
    trt = _trt()
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(onnx_path)):
        return
    errors = []
    for i in range(parser.num_errors):
        error = parser.get_error(i)
        errors.append(f"node {error.node()} {error.node_name()!r} ({error.node_operator()}): {error.desc()}")
    raise EngineBuildError(f"TensorRT could not parse {onnx_path} ({len(errors)} errors):\n  " + "\n  ".join(errors))


def _configure(builder: trt.Builder, target: TargetSpec, ranges: list[dict[str, trt_plan.ShapeRange]],
               timing_cache: bytes) -> trt.IBuilderConfig:
    trt = _trt()
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, target.workspace_bytes)
    config.builder_optimization_level = target.optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if target.hardware_compatibility == "ampere_plus":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    elif target.hardware_compatibility == "same_compute_capability":
        if _since(10, 9):
            config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY
        else:
            raise EngineBuildError(f"target {target.name}: hardware_compatibility same_compute_capability needs "
                                   f"TensorRT 10.9 or newer; this is TensorRT {trt.__version__} (use ampere_plus "
                                   f"or none, or a newer image)")
    if target.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if not config.set_timing_cache(config.create_timing_cache(timing_cache), False):
        # A cache from another device or TensorRT build: start empty rather than build without one.
        log.warning("TensorRT rejected the saved timing cache (another GPU or TensorRT?); starting an empty one")
        if not config.set_timing_cache(config.create_timing_cache(b""), False):
            raise EngineBuildError("TensorRT rejected an empty timing cache")
    for per_input in ranges:
        profile = builder.create_optimization_profile()
        for name, shapes in per_input.items():
            profile.set_shape(name, shapes["min"], shapes["opt"], shapes["max"])
        config.add_optimization_profile(profile)
    return config


def _engine_io(engine: trt.ICudaEngine) -> list[dict[str, Any]]:
    trt = _trt()
    io = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        io.append({"name": name,
                   "mode": "input" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output",
                   "dtype": trt_plan.numpy_dtype(engine.get_tensor_dtype(name).name),
                   "shape": list(engine.get_tensor_shape(name))})
    return io


def _layers(engine: trt.ICudaEngine) -> Any:
    trt = _trt()
    inspector = engine.create_engine_inspector()
    return json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))


def build_engine(onnx_path: Path, target: TargetSpec, ranges: list[dict[str, trt_plan.ShapeRange]],
                 engine_path: Path, timing_cache: bytes) -> dict[str, Any]:
    """Build and write one serialized engine; return what the sidecar records about the build."""
    trt = _trt()
    errors: list[str] = []
    logger = _logger(errors)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags())
    _parse(network, onnx_path, logger)
    config = _configure(builder, target, ranges, timing_cache)
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    build_seconds = time.perf_counter() - started
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build {onnx_path} for target {target.name}:\n  "
                               + "\n  ".join(errors or ["(no error was logged)"]))
    plan = bytes(serialized)
    engine_path.write_bytes(plan)
    runtime = trt.Runtime(logger)
    if target.version_compatible:
        runtime.engine_host_code_allowed = True  # a version-compatible plan embeds its lean runtime
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise EngineBuildError(f"TensorRT built {engine_path} but could not deserialize it: {errors}")
    return {"build_seconds": round(build_seconds, 3), "engine_bytes": len(plan),
            "engine_sha256": hashlib.sha256(plan).hexdigest(), "io": _engine_io(engine), "layers": _layers(engine),
            "timing_cache": config}


def merge_timing_cache(config: trt.IBuilderConfig, path: Path) -> bytes:
    """Fold this build's tactics into the cache on disk under a file lock, as Polygraphy does, so
    concurrent builds on one GPU add to the cache instead of overwriting each other's; return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = config.create_timing_cache(trt_plan.read_timing_cache(path))
        if not merged.combine(config.get_timing_cache(), False):
            log.warning("TensorRT could not merge into the timing cache %s; keeping this build's alone", path.name)
            merged = config.get_timing_cache()
        data = bytes(merged.serialize())
        trt_plan.save_timing_cache(path, data)
    return data


class TensorRTBackend(Backend):
    name = "tensorrt"
    engine_file = ENGINE_FILE
    compares_three_way = True

    def missing(self, target: TargetSpec) -> str | None:
        try:
            _trt()
        except BackendUnavailable as e:
            return str(e)
        return trt_plan.build_problem(target, trt_plan.detect_gpu())

    def version(self) -> str:
        try:
            return _trt().__version__
        except BackendUnavailable:
            return "absent"

    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        """Compute capability and GPU model: what an engine's tactics are tied to (the driver is not)."""
        gpu = trt_plan.detect_gpu()
        if gpu is None:
            return {}
        return {"compute_capability": gpu.cc, "arch": gpu.arch, "gpu_name": gpu.name}

    def build(self, onnx_path: Path, target: TargetSpec, profiles: list[ProfileSpec], out_dir: Path,
              cache_dir: Path) -> dict[str, Any]:
        problem = self.missing(target)
        if problem:
            raise BackendUnavailable(problem)
        gpu = trt_plan.detect_gpu()
        assert gpu is not None
        version = self.version()
        ranges = trt_plan.profile_ranges(trt_plan.onnx_input_dims(onnx_path), profiles)
        cache_path = trt_plan.timing_cache_path(cache_dir, gpu, version)
        before = trt_plan.read_timing_cache(cache_path)
        built = build_engine(onnx_path, target, ranges, out_dir / ENGINE_FILE, before)
        after = merge_timing_cache(built.pop("timing_cache"), cache_path)
        shutil.copyfile(cache_path, out_dir / trt_plan.TIMING_CACHE_COPY)
        sidecar = {"tensorrt_version": version, **gpu.facts(), "target": target.name, "target_arch": target.arch,
                   "hardware_compatibility": target.hardware_compatibility,
                   "version_compatible": target.version_compatible,
                   "optimization_level": target.optimization_level, "workspace_bytes": target.workspace_bytes,
                   "profiles": trt_plan.sidecar_profiles(ranges),
                   "timing_cache": trt_plan.timing_cache_report(cache_path, before, after), **built}
        trt_plan.write_sidecar(out_dir, sidecar)
        return {"backend": self.name, "backend_version": version, "engine_file": ENGINE_FILE,
                "engine_bytes": built["engine_bytes"], "build_seconds": built["build_seconds"],
                "hardware": gpu.facts(), "sidecar": trt_plan.SIDECAR, "profiles": sidecar["profiles"],
                "timing_cache_hit": sidecar["timing_cache"]["hit"]}

    def load(self, engine_dir: Path, target: TargetSpec) -> Runner:
        return TensorRTRunner(engine_dir)


class _CudaEvents:
    """cudaEvent timing through the CUDA runtime library Polygraphy already loaded."""

    def __init__(self) -> None:
        from polygraphy import cuda

        self._cuda = cuda.wrapper()
        self.start, self.end = self._create(), self._create()

    def _create(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self._cuda.check(self._cuda.handle.cudaEventCreate(ctypes.byref(event)))
        return event

    def record(self, event: ctypes.c_void_p, stream_ptr: int) -> None:
        self._cuda.check(self._cuda.handle.cudaEventRecord(event, ctypes.c_void_p(stream_ptr)))

    def elapsed_ms(self) -> float:
        self._cuda.check(self._cuda.handle.cudaEventSynchronize(self.end))
        ms = ctypes.c_float()
        self._cuda.check(self._cuda.handle.cudaEventElapsedTime(ctypes.byref(ms), self.start, self.end))
        return float(ms.value)

    def close(self) -> None:
        for event in (self.start, self.end):
            self._cuda.check(self._cuda.handle.cudaEventDestroy(event))


def _output_allocator(cuda: Any) -> Any:
    """Device buffers for outputs whose shape is known only once the engine has run (NonZero and
    other data-dependent shapes): TensorRT asks this object for memory and reports the shape."""
    trt = _trt()

    class OutputAllocator(trt.IOutputAllocator):
        def __init__(self) -> None:
            trt.IOutputAllocator.__init__(self)
            self.buffers: dict[str, Any] = {}
            self.shapes: dict[str, tuple[int, ...]] = {}

        def reallocate_output(self, tensor_name: str, memory: int, size: int, alignment: int) -> int:
            buffer = self.buffers.get(tensor_name)
            if buffer is None:
                buffer = self.buffers[tensor_name] = cuda.DeviceArray.raw((max(size, 1),))
            elif buffer.nbytes < size:
                buffer.resize((size,))
            return buffer.ptr

        def reallocate_output_async(self, tensor_name: str, memory: int, size: int, alignment: int,
                                    stream: int) -> int:
            return self.reallocate_output(tensor_name, memory, size, alignment)

        def notify_shape(self, tensor_name: str, shape: Any) -> None:
            self.shapes[tensor_name] = tuple(shape)

        def free(self) -> None:
            for buffer in self.buffers.values():
                buffer.free()
            self.buffers.clear()

    return OutputAllocator()


class TensorRTRunner(Runner):
    """A deserialized engine on the name-based tensor API (set_input_shape, set_tensor_address, execute_async_v3)."""

    def __init__(self, engine_dir: Path):
        from polygraphy import cuda

        trt = _trt()
        self._cuda = cuda
        self.sidecar = trt_plan.check_loadable(engine_dir, trt_plan.detect_gpu(), trt.__version__)
        self._errors: list[str] = []
        self._logger = _logger(self._errors)
        self._runtime = trt.Runtime(self._logger)
        if self.sidecar.get("version_compatible"):
            self._runtime.engine_host_code_allowed = True
        self._engine = self._runtime.deserialize_cuda_engine((engine_dir / ENGINE_FILE).read_bytes())
        if self._engine is None:
            raise EngineMismatch(f"TensorRT could not deserialize {engine_dir / ENGINE_FILE}: "
                                          f"{self._errors}")
        self._context = self._engine.create_execution_context()
        self._stream = cuda.Stream()
        io = {t["name"]: t for t in self.sidecar["io"]}
        self.input_names = [n for n, t in io.items() if t["mode"] == "input"]
        self.output_names = [n for n, t in io.items() if t["mode"] == "output"]
        self._dtypes = {n: t["dtype"] for n, t in io.items()}
        self._profile = 0
        self._device: dict[str, Any] = {}
        self._host: dict[str, np.ndarray] = {}
        self._allocator = _output_allocator(cuda)
        self._data_dependent: set[str] = set()

    def _buffer(self, name: str, nbytes: int) -> int:
        if name not in self._device:
            self._device[name] = self._cuda.DeviceArray.raw((max(nbytes, 1),))
        return self._device[name].resize((max(nbytes, 1),)).ptr

    def _stage(self, feeds: dict[str, np.ndarray]) -> None:
        """Pick the profile, set shapes and addresses, and keep host buffers alive for the copies."""
        shapes = {name: tuple(feeds[name].shape) for name in self.input_names}
        index = trt_plan.choose_profile(self.sidecar["profiles"], shapes)
        if index != self._profile:
            self._context.set_optimization_profile_async(index, self._stream.ptr)
            self._profile = index
        for name in self.input_names:
            dtype = self._dtypes[name]
            host = (trt_plan.to_bfloat16_bits(feeds[name]) if dtype == "bfloat16"
                    else np.ascontiguousarray(feeds[name], dtype=dtype))
            self._host[name] = host
            self._context.set_input_shape(name, host.shape)
            self._context.set_tensor_address(name, self._buffer(name, host.nbytes))
        for name in self.output_names:
            shape = tuple(self._context.get_tensor_shape(name))
            if any(d < 0 for d in shape):  # known only after the run: TensorRT asks the allocator
                self._data_dependent.add(name)
                self._context.set_output_allocator(name, self._allocator)
                continue
            host = np.empty(shape, dtype=trt_plan.host_storage(self._dtypes[name]))
            self._host[name] = host
            self._context.set_tensor_address(name, self._buffer(name, host.nbytes))

    def _copy_inputs(self) -> None:
        copy, kinds = self._cuda.wrapper().memcpy, self._cuda.MemcpyKind
        for name in self.input_names:
            host = self._host[name]
            copy(self._device[name].ptr, host.ctypes.data, host.nbytes, kinds.HostToDevice, self._stream.ptr)

    def _execute(self) -> None:
        if not self._context.execute_async_v3(self._stream.ptr):
            raise RuntimeError(f"TensorRT execute_async_v3 failed: {self._errors}")

    def _copy_outputs(self) -> None:
        """After the stream is synchronized: data-dependent shapes are known only then."""
        copy, kinds = self._cuda.wrapper().memcpy, self._cuda.MemcpyKind
        for name in self.output_names:
            if name in self._data_dependent:
                host = np.empty(self._allocator.shapes[name], dtype=trt_plan.host_storage(self._dtypes[name]))
                self._host[name] = host
                source = self._allocator.buffers[name].ptr
            else:
                host, source = self._host[name], self._device[name].ptr
            copy(host.ctypes.data, source, host.nbytes, kinds.DeviceToHost, self._stream.ptr)
        self._stream.synchronize()

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._stage(feeds)
        self._copy_inputs()
        self._execute()
        self._stream.synchronize()
        self._copy_outputs()
        return {name: trt_plan.from_bfloat16_bits(self._host[name]) if self._dtypes[name] == "bfloat16"
                else self._host[name].copy() for name in self.output_names}

    def time_ms(self, feeds: dict[str, np.ndarray], warmup: int, repeats: int) -> list[float]:
        """CUDA-event latencies of the engine alone, inputs and outputs staying on the device: timed
        as the eager reference is (tasks/measure/gpu_measure.py), so no pageable host copy sits in either."""
        self._stage(feeds)
        self._copy_inputs()
        for _ in range(warmup):
            self._execute()
        self._stream.synchronize()
        events = _CudaEvents()
        samples = []
        try:
            for _ in range(repeats):
                events.record(events.start, self._stream.ptr)
                self._execute()
                events.record(events.end, self._stream.ptr)
                samples.append(events.elapsed_ms())
        finally:
            events.close()
        return samples

    def close(self) -> None:
        for array in self._device.values():
            array.free()
        self._device.clear()
        self._allocator.free()
        self._host.clear()
        if self._stream is not None:
            self._stream.free()
            self._stream = None
        self._context = None
        self._engine = None
