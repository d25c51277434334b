"""Write the TensorRT Python API name lists that tests/test_tensorrt_api.py checks our backend against.

TensorRT itself cannot be installed from PyPI, but the `tensorrt-cu12-bindings` wheels there are the
real pybind11 extension for both majors. The extension links against libnvinfer, libnvinfer_plugin and
libnvonnxparser for only nine entry points (createInferBuilder_INTERNAL, ...), none called while the
module imports; so this script compiles tiny stand-ins that export those nine symbols, imports the real
extension against them in a child process, and records what the bindings define: every module-level
name, every public member of every class, and, from the pybind11 signatures, which members return
another TensorRT class and which of those are methods rather than properties (so the test can
follow `builder.create_network()` to `INetworkDefinition`).

Needs network access to PyPI and a C compiler (cc). Usage:
    python scripts/trt_api_names.py                 # the default versions below
    python scripts/trt_api_names.py 10.8.0.43 10.16.1.11 11.4.0.106
The newest version of each major is written as tensorrt_api_<major>.json, older ones as
tensorrt_api_<major>.<minor>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_VERSIONS = ("10.8.0.43", "10.16.1.11", "11.4.0.106")  # 10.8: the pinned docker image's
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data"
STUB_LIBRARIES = ("nvinfer", "nvinfer_plugin", "nvonnxparser")
STUB_SOURCE = """
void *createInferBuilder_INTERNAL(void *a, int b) { return 0; }
void *createInferRefitter_INTERNAL(void *a, void *b, int c) { return 0; }
void *createInferRuntime_INTERNAL(void *a, int b) { return 0; }
void *createNvOnnxParserRefitter_INTERNAL(void *a, void *b, int c) { return 0; }
void *createNvOnnxParser_INTERNAL(void *a, void *b, int c) { return 0; }
void *getBuilderPluginRegistry(int a) { return 0; }
int getNvOnnxParserVersion(void) { return 0; }
void *getPluginRegistry(void) { return 0; }
int initLibNvInferPlugins(void *a, const char *b) { return 0; }
"""
SIGNATURE = re.compile(r"^(?:\d+\. )?\w*\(.*\)\s*->\s*(\S+)$")
RETURN_CLASS = re.compile(r"^(?:tensorrt(?:_bindings)?\.tensorrt\.|nvonnxparser::I?)([A-Za-z_][A-Za-z0-9_.]*)$")


def download(version: str, into: Path) -> Path:
    """The bindings wheel for this interpreter's Python on x86-64 Linux."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", py, "--platform", "manylinux_2_28_x86_64", "-d", str(into),
                    f"tensorrt-cu12-bindings=={version}"], check=True)
    wheels = list(into.glob(f"tensorrt_cu12_bindings-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip saved no tensorrt_cu12_bindings-{version} wheel into {into}")
    return wheels[0]


def stub_libraries(major: int, into: Path) -> Path:
    """Stand-ins for the TensorRT shared libraries, enough for the extension to load."""
    into.mkdir(parents=True, exist_ok=True)
    source = into / "stub.c"
    source.write_text(STUB_SOURCE)
    for lib in STUB_LIBRARIES:
        soname = f"lib{lib}.so.{major}"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(into / soname), f"-Wl,-soname,{soname}", str(source)],
                       check=True)
    return into


def names_from_wheel(version: str, work: Path) -> dict:
    wheel = download(version, work / "wheels")
    site = work / f"site-{version}"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    libs = stub_libraries(int(version.split(".")[0]), (work / f"libs-{version}"))
    env = dict(os.environ, PYTHONPATH=str(site), LD_LIBRARY_PATH=str(libs))
    dumped = subprocess.run([sys.executable, __file__, "--dump"], env=env, check=True, capture_output=True,
                            text=True)
    names = json.loads(dumped.stdout)
    names["wheel"] = wheel.name
    return names


def _returns(doc: str | None) -> str | None:
    """The TensorRT class named by the first pybind11 signature in a docstring, if any."""
    for line in (doc or "").splitlines():
        if signature := SIGNATURE.match(line.strip()):
            named = RETURN_CLASS.match(signature.group(1))
            return named.group(1) if named else None
    return None


def dump_loaded_bindings() -> dict:
    """Runs in the child process, where the real extension imports against the stand-in libraries."""
    import tensorrt_bindings as trt

    module_classes = {name: obj for name, obj in vars(trt).items() if isinstance(obj, type) and not name.startswith("_")}
    classes, returns, methods = {}, {}, []

    def record(path: str, cls: type) -> None:
        members = sorted(n for n in dir(cls) if not n.startswith("_"))
        classes[path] = members
        for member in members:
            raw = inspect_attr(cls, member)
            if isinstance(raw, property):
                target = _returns(raw.fget.__doc__ if raw.fget else None)
            elif isinstance(raw, type):
                target = f"{path}.{member}" if raw.__module__.startswith("tensorrt") else None
                if target:
                    record(target, raw)
            elif callable(raw) and type(raw).__name__ in ("builtin_function_or_method", "instancemethod", "function"):
                target = _returns(getattr(raw, "__doc__", None))
                if target:
                    methods.append(f"{path}.{member}")
            else:
                value_type = type(raw)
                target = value_type.__qualname__ if value_type.__module__.startswith("tensorrt") else None
            if target:
                returns[f"{path}.{member}"] = target

    def inspect_attr(cls: type, member: str):
        for klass in cls.__mro__:
            if member in vars(klass):
                return vars(klass)[member]
        return getattr(cls, member)

    for name, cls in sorted(module_classes.items()):
        record(name, cls)
    module = {}
    for name in sorted(n for n in dir(trt) if not n.startswith("_")):
        obj = getattr(trt, name)
        module[name] = "class" if isinstance(obj, type) else "function" if callable(obj) else "value"
        if module[name] == "function" and (target := _returns(getattr(obj, "__doc__", None))):
            returns[name] = target
            methods.append(name)
    return {"tensorrt_version": trt.__version__, "module": module, "classes": classes, "returns": returns,
            "methods": sorted(methods)}


def _compact_json(names: dict) -> str:
    """One line per class or name, so a diff between two TensorRT releases reads like a changelog."""
    lines = []
    for key, value in sorted(names.items()):
        if isinstance(value, dict):
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(value.items()))
            lines.append(f"{json.dumps(key)}: {{\n{body}\n}}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS))
    parser.add_argument("--dump", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        json.dump(dump_loaded_bindings(), sys.stdout)
        return
    with tempfile.TemporaryDirectory(prefix="trt-names-") as tmp:
        for version in args.versions:
            names = names_from_wheel(version, Path(tmp))
            major, minor = version.split(".")[:2]
            newest = max((v for v in args.versions if v.split(".")[0] == major),
                         key=lambda v: tuple(int(p) for p in v.split(".")))
            out = OUT_DIR / (f"tensorrt_api_{major}.json" if version == newest else f"tensorrt_api_{major}.{minor}.json")
            out.write_text(_compact_json(names))
            print(f"{out}: TensorRT {names['tensorrt_version']}, {len(names['classes'])} classes")


if __name__ == "__main__":
    main()
