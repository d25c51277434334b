"""The last check before registering reads the engine's bytes: a cache that still vouches for a file's
old digest (its size, times and inode unchanged, as after bit rot or a tool that restores times) never
lets a changed engine become a version."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.config.settings import DecisionSettings, RunSettings
from tasks.config.spec import PipelineSpec
from tasks.judge.decide import decide
from tasks.outcome import CandidateOutcome
from tasks.registry import tracking
from tasks.runtime import store
from tasks.runtime.store import ArtifactStore, file_digest
from tasks.stages import engine_check
from tests.fixtures.candidates import candidate_outcome, pipeline_spec
from tests.fixtures.judged import promoted

pytestmark = pytest.mark.usefixtures("mlflow_server")


def _logged(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    with tracking.pipeline_run(spec, "run", {}) as parent_id:
        for outcome in outcomes:
            outcome.run_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)
    return decide(DecisionSettings.of(spec), outcomes, {})


def _rot_under_unchanged_stamps(path: Path) -> None:
    """Flip bytes in place, keep the size, put the times back, and leave this process's digest cache
    vouching for the old bytes under the file's new stamp (what a filesystem whose stamps do not move
    would give)."""
    before = path.stat()
    old_digest = file_digest(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        chunk = f.read(32)
        f.seek(before.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    store._note_digest(path, store._stamp(after), old_digest)
    assert file_digest(path) == old_digest, "the cache should still vouch for the old bytes"


def test_rot_under_unchanged_stamps_is_caught_by_the_check_before_registering(tmp_path: Path) -> None:
    spec = pipeline_spec(f"rot-{uuid.uuid4().hex[:8]}")
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=400.0)
    build = outcome.stages["build"]
    uploaded = engine_check.engine_digest(build, engine_check.verify_files(build))
    _rot_under_unchanged_stamps(build.file("model.onnx"))
    with pytest.raises(engine_check.EngineRejected, match="sha256 differs from the build manifest"):
        engine_check.check_before_registering(spec.targets, spec.profiles, outcome.stages, uploaded)


def test_an_engine_that_rotted_after_upload_is_never_registered_and_the_alias_stays(tmp_path: Path) -> None:
    spec = pipeline_spec(f"rot-{uuid.uuid4().hex[:8]}")
    name = f"{spec.name}-cpu"
    first = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=400.0)
    promoted(spec, _logged(spec, [first]))

    bad = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=900.0, variant="night-2")
    logged = _logged(spec, [bad])
    _rot_under_unchanged_stamps(bad.stages["build"].file("model.onnx"))
    promoted(spec, logged)

    assert bad.status == "failed" and bad.model_version is None, bad.error
    client = MlflowClient()
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == [first.model_version]
    assert client.get_model_version_by_alias(name, "champion").version == first.model_version
