"""The last look at an engine before the registry holds it: its files are the ones its build recorded,
and it loads and runs.

A cached build is trusted by its manifest, and the upload copies whatever is on disk; a file that
rotted since (same size, other bytes, even under unchanged times and inode) or an engine that no
longer loads must never become a version a deploy system can fetch. So, right before a version is
created, every byte is read again: each file's sha256 is compared with the build manifest (and
with the digest recorded when the engine was uploaded, itself read byte by byte), then the
engine is loaded on its target and run once at the first profile's min point, with inputs made
from the signature the build or export recorded. Outputs must be finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tasks.config.spec import ProfileSpec, TargetSpec
from tasks.runtime.store import StageResult, file_digest


class EngineRejected(RuntimeError):
    """The engine may not be registered; the message says which file or step failed."""


def read_digests(build: StageResult) -> dict[str, str]:
    """The sha256 of every file the build manifest lists, each read from disk now, byte by byte: no
    cache, since rot can leave a file's size, times and inode as they were."""
    digests = {}
    for name in sorted(build.manifest.get("files", {})):
        path = build.file(name)
        if not path.is_file():
            raise EngineRejected(f"{build.path}: engine file {name} is missing")
        digests[name] = file_digest(path, reread=True)
    return digests


def engine_digest(build: StageResult, digests: dict[str, str] | None = None) -> str:
    """One sha256 over the build's files (names and contents), recorded at upload and checked at registration.
    `digests` as `read_digests` returns them; without, files unchanged since this process read them are
    not read again."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(build.manifest.get("files", {})):
        file_sha = digests[name] if digests is not None else file_digest(build.file(name))
        digest.update(name.encode() + b"\0" + file_sha.encode() + b"\n")
    return digest.hexdigest()


def verify_files(build: StageResult) -> dict[str, str]:
    """Every file the build manifest lists is present with its recorded sha256, read now; returns the digests."""
    digests = read_digests(build)
    for name, meta in build.manifest.get("files", {}).items():
        expected = meta.get("sha256")
        if expected and digests[name] != expected:
            raise EngineRejected(f"{build.file(name)}: sha256 differs from the build manifest's {expected[:16]}…: "
                                 "the cached engine changed since it was built")
    return digests


def _dim(value: Any, shape: dict[str, int]) -> int:
    """A signature dimension at one profile point: a number, or a name like `batch_size` or `past + seq`."""
    if isinstance(value, int) and value > 0:
        return value
    total = 0
    for term in str(value).split("+"):
        term = term.strip().lower()
        if term.isdigit():
            total += int(term)
        elif "past" in term:
            total += shape.get("past", 0)
        elif "batch" in term:
            total += shape["batch"]
        else:
            total += shape["seq"]
    return total


def signature_feeds(io: dict[str, Any], shape: dict[str, int]) -> dict[str, np.ndarray]:
    """Inputs for one run: token ids and masks of ones, positions counting up, float tensors of zeros."""
    feeds = {}
    for name, tensor in io["inputs"].items():
        dims = [_dim(d, shape) for d in tensor["shape"]]
        dtype = np.dtype(tensor["dtype"])
        if name == "position_ids":
            feeds[name] = np.broadcast_to(np.arange(dims[-1], dtype=dtype) + shape.get("past", 0), dims).copy()
        elif np.issubdtype(dtype, np.integer) or dtype == np.bool_:
            feeds[name] = np.ones(dims, dtype=dtype)
        else:
            feeds[name] = np.zeros(dims, dtype=dtype)
    return feeds


def run_once(targets: Sequence[TargetSpec], profiles: Sequence[ProfileSpec], stages: dict[str, StageResult]) -> None:
    """Load the engine on its target (found among the pipeline's `targets`) and run it once at the first profile's
    min point."""
    from tasks.stages.build import open_engine

    build = stages["build"]
    io = next((s.outputs for s in (stages.get("build"), stages.get("export"))
               if s and s.outputs.get("inputs")), None)
    try:
        runner = open_engine(targets, build)
    except Exception as e:  # noqa: BLE001 - any load error means the engine is unusable
        raise EngineRejected(f"{build.path}: the engine does not load: {type(e).__name__}: {e}") from e
    with runner:
        if io is None:
            return
        shape = profiles[0].shapes()["min"]
        feeds = signature_feeds(io, shape)
        wanted = getattr(runner, "input_names", None) or list(feeds)
        try:
            outputs = runner.infer({name: feeds[name] for name in wanted if name in feeds})
        except Exception as e:  # noqa: BLE001
            raise EngineRejected(f"{build.path}: the engine does not run at {shape}: {type(e).__name__}: {e}") from e
    bad = [name for name, value in outputs.items() if not np.isfinite(np.asarray(value, dtype=np.float64)).all()]
    if bad:
        raise EngineRejected(f"{build.path}: outputs {bad} have NaN/Inf values at {shape}")


def check_before_registering(targets: Sequence[TargetSpec], profiles: Sequence[ProfileSpec],
                             stages: dict[str, StageResult], uploaded_digest: str | None) -> None:
    """Raise EngineRejected unless the engine's files are intact (and as uploaded) and it loads and runs."""
    build = stages["build"]
    digests = verify_files(build)
    if uploaded_digest and engine_digest(build, digests) != uploaded_digest:
        raise EngineRejected(f"{build.path}: the engine's files changed since they were uploaded to MLflow")
    run_once(targets, profiles, stages)
