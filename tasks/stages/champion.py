"""The champion's engine on this machine, so it can be timed side by side with tonight's candidates.

Speed against the champion is never read from numbers another run stored: its engine is loaded
and measured in the same rounds. It comes from this artifact store when its build is here, intact
and byte for byte the registered engine, else from the registry (the files the version points to),
checked against the hashes in its own build manifest before it is trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tasks.outcome import Champion
from tasks.registry import tracking
from tasks.runtime.store import MANIFEST, ArtifactStore, StageResult, file_digest

CHAMPIONS_DIR = "_champions"


# Errors that say an engine cannot run on this machine, now or ever: its backend is not installed or cannot
# run the target, or the engine was built for other software or hardware (EngineMismatch of any backend).
CANNOT_RUN_HERE = ("BackendUnavailable", "EngineMismatch")


def same_engine(champion: Champion, build: StageResult) -> bool:
    """Whether `build` is the champion's engine: the same bytes. A build key names the inputs, and a rebuild
    from them (TensorRT is not bit-reproducible; `--force`, a repair) is another engine. A version registered
    before versions carried their digest is known by its build key alone."""
    identity = tracking.engine_identity(build)
    if champion.engine_identity and identity:
        return identity == champion.engine_identity
    return build.key == champion.build_key


def built_from(stages: Mapping[str, StageResult]) -> str | None:
    """The model files an engine was built from (tasks/stages/models.py `model_source_digest`): a build from the model
    names them in its own inputs, a build from ONNX through its export; None where neither recorded them. Only
    this says a champion was retrained: build keys also change with Optimum, smelter or backend upgrades."""
    build, export = stages.get("build"), stages.get("export")
    named = (build.manifest.get("inputs") or {}).get("model") if build else None
    return named or (export.outputs.get("model_source") if export else None)


def cannot_run_here(error: BaseException) -> bool:
    """Whether `error` says the engine cannot run here (by class, so no backend's runtime need be imported)."""
    return getattr(error, "permanent", False) or any(c.__name__ in CANNOT_RUN_HERE for c in type(error).__mro__)


def says_cannot_run_here(message: str) -> str | None:
    """The error class named in a failed stage's message ("<stage> failed: <Class>: ...") when it is one of those."""
    named = message.split(": ")[1] if message.count(": ") >= 2 else ""
    return named if named in (*CANNOT_RUN_HERE, "BuildUnavailable") else None


class ChampionUnavailable(RuntimeError):
    """The champion's engine cannot be had here. `permanent`: it never will be (its registry files are
    corrupt), so the alias may move away from it; otherwise (a registry that did not answer) nothing moves."""

    def __init__(self, message: str, *, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def _intact(engine_dir: Path) -> dict | None:
    """The build manifest when every file it lists is present with its recorded sha256, else None."""
    try:
        manifest = json.loads((engine_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    for name, meta in manifest.get("files", {}).items():
        path = engine_dir / name
        if not path.is_file() or path.stat().st_size != meta.get("bytes") or file_digest(path) != meta.get("sha256"):
            return None
    return manifest


def champion_build(pipeline: str, champion: Champion, store: ArtifactStore) -> StageResult:
    """The champion's build output: from the store when it holds the champion's very bytes, else downloaded
    from the registry and verified.

    A damaged store entry is left where it is (the build stage moves it aside and says so in its
    result); the champion then comes from the registry.
    """
    if champion.build_key and (hit := store.check(pipeline, "build", champion.build_key, repair=False)[0]) \
            and same_engine(champion, hit):  # a rebuild under the same key is not the champion's engine
        return hit
    final = store.root / CHAMPIONS_DIR / champion.registered_model / champion.version
    manifest = _intact(final) if final.is_dir() else None
    if manifest is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{champion.version}.", dir=final.parent))
        try:
            got = tracking.download_version(champion.registered_model, champion.version, tmp)
            manifest = _intact(got)
            if manifest is None:
                raise ChampionUnavailable(
                    f"{champion.label} of {champion.registered_model}: the registry's files do not match the "
                    f"hashes in their build manifest; not measuring a corrupt engine", permanent=True)
            if final.exists():
                shutil.rmtree(final)
            os.replace(got, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return StageResult(pipeline, "build", manifest.get("key", champion.build_key or ""), final, manifest, cached=True)
