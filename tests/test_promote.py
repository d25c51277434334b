"""Promotion as a deploy system sees it: only passing engines in the registry, the alias on the best
one, moved only by a new promotion, and never left half-moved when a step fails."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import uuid
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks import notify, tracking
from tasks.outcome import CandidateOutcome
from tasks.decide import decide
from tasks.promote import PromotionError, promote
from tasks.spec import PipelineSpec
from tasks.store import ArtifactStore, file_digest
from tests.fixtures.candidates import candidate_outcome, failed_outcome, pipeline_spec

pytestmark = pytest.mark.usefixtures("mlflow_server")


def _logged(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    with tracking.pipeline_run(spec, "run", {}) as parent_id:
        for outcome in outcomes:
            outcome.run_id = tracking.log_candidate(parent_id, spec, outcome)
    return decide(spec, outcomes, {})


def _versions(name: str) -> list[str]:
    return sorted(v.version for v in MlflowClient().search_model_versions(f"name = '{name}'"))


def _alias(name: str, alias: str = "champion") -> str:
    return MlflowClient().get_model_version_by_alias(name, alias).version


def test_best_passing_candidate_gets_alias_and_rejected_ones_are_never_registered(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    fast = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0)
    slow = candidate_outcome(store, spec, "fp32", "cpu", throughput=300.0)
    rejected = candidate_outcome(store, spec, "fp32", "sm90", throughput=900.0, passed=False)
    failed = failed_outcome(store, spec, "int8", "sm90")
    outcomes = promote(spec, _logged(spec, [fast, slow, rejected, failed]))
    for outcome in outcomes:
        tracking.finish_candidate(outcome.run_id, spec, outcome)

    assert [o.status for o in (fast, slow, rejected, failed)] == ["promoted", "passed", "rejected", "failed"]
    cpu_model = f"{spec.name}-cpu"
    assert _versions(cpu_model) == sorted([fast.model_version, slow.model_version])
    assert _alias(cpu_model) == fast.model_version and fast.model_name == cpu_model
    assert not MlflowClient().search_registered_models(f"name = '{spec.name}-sm90'")
    assert rejected.model_version is None and failed.model_version is None

    version = MlflowClient().get_model_version(cpu_model, fast.model_version)
    assert version.run_id == fast.run_id and version.source == f"runs:/{fast.run_id}/engine"
    assert version.tags["throughput"] == "500" and version.tags["cache_key"] == fast.cache_key
    assert version.tags["accuracy.cosine_mean"] == "0.9988"
    model = MlflowClient().get_registered_model(cpu_model)
    assert model.tags["pipeline"] == spec.name and "champion" in model.description

    run_tags = MlflowClient().get_run(fast.run_id).data.tags
    assert (run_tags["status"], run_tags["registered_model"], run_tags["model_version"]) == (
        "promoted", cpu_model, fast.model_version)
    assert MlflowClient().get_run(slow.run_id).data.tags["status"] == "passed"
    assert "Status: **promoted**" in mlflow.artifacts.load_text(f"runs:/{fast.run_id}/engine_card.md")
    assert run_tags["decision_reason"] == fast.decision.reason

    engine = Path(mlflow.artifacts.download_artifacts(f"models:/{cpu_model}@champion", dst_path=str(tmp_path / "dl")))
    assert (engine / "model.onnx").read_bytes() == fast.stages["build"].file("model.onnx").read_bytes()
    champion = tracking.champion(spec, "cpu")
    assert (champion.run_id, champion.version, champion.build_key) == (fast.run_id, fast.model_version, fast.cache_key)


def test_an_engine_rejected_before_and_passing_now_is_uploaded_to_the_run_that_registers_it(tmp_path: Path) -> None:
    """Its later runs uploaded nothing (the files were in MLflow already); the one registered gets its own copy."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    rejected = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0, passed=False)
    rejected.stages["build"] = dataclasses.replace(rejected.stages["build"], cached=True)
    promote(spec, _logged(spec, [rejected]))
    first_run = rejected.run_id
    passing = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0)
    passing.stages["build"] = dataclasses.replace(passing.stages["build"], cached=True)
    assert passing.cache_key == rejected.cache_key
    logged = _logged(spec, [passing])
    assert tracking.engine_source(passing.run_id) == f"runs:/{first_run}/engine", "nothing uploaded while judged"
    promote(spec, logged)

    assert passing.status == "promoted" and passing.run_id != first_run
    version = MlflowClient().get_model_version(f"{spec.name}-cpu", passing.model_version)
    assert version.run_id == passing.run_id and version.source == f"runs:/{passing.run_id}/engine"
    assert tracking.engine_source(passing.run_id) == version.source
    files = {a.path for a in MlflowClient().list_artifacts(passing.run_id, "engine")}
    assert "engine/model.onnx" in files and files == {a.path for a in MlflowClient().list_artifacts(first_run, "engine")}
    engine = Path(mlflow.artifacts.download_artifacts(f"models:/{spec.name}-cpu@champion", dst_path=str(tmp_path / "dl")))
    assert (engine / "model.onnx").read_bytes() == passing.stages["build"].file("model.onnx").read_bytes()


def test_latency_objective_promotes_the_lowest_p99(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}", objective="latency")
    store = ArtifactStore(tmp_path)
    high_throughput = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0, p99_ms=20.0)
    low_latency = candidate_outcome(store, spec, "fp32", "cpu", throughput=300.0, p99_ms=8.0)
    promote(spec, _logged(spec, [high_throughput, low_latency]))
    assert (low_latency.status, high_throughput.status) == ("promoted", "passed")
    assert _alias(f"{spec.name}-cpu") == low_latency.model_version


def test_alias_moves_only_when_a_later_run_promotes(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [first]))
    assert _alias(name) == first.model_version

    worse = candidate_outcome(store, spec, "int8", "cpu", throughput=100.0, passed=False, variant="night-2")
    promote(spec, _logged(spec, [worse]))
    assert worse.status == "rejected" and _alias(name) == first.model_version
    assert _versions(name) == [first.model_version]

    unchanged = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [unchanged]))
    assert unchanged.cache_key == first.cache_key
    assert unchanged.status == "passed" and unchanged.model_version == first.model_version
    assert _versions(name) == [first.model_version]

    better = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-4")
    promote(spec, _logged(spec, [better]))
    assert better.status == "promoted" and _alias(name) == better.model_version != first.model_version


def test_failed_promotion_step_restores_previous_alias_model_metadata_and_removes_new_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = [{"url": "http://127.0.0.1:9/hooks/engines", "secret_env": "SMELTER_UNUSED_SECRET"}]
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}", webhooks=hooks)
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [first]))
    client = MlflowClient()
    client.update_registered_model(name, description="written by hand")
    client.set_registered_model_tag(name, "model", "an older model")
    client.delete_registered_model_tag(name, "backend")

    # The registry refuses the notification record, the last step: the registered model has been
    # refreshed and the alias moved by then, so the rollback must put both back.
    set_version_tags = tracking.set_version_tags

    def refuse_record(model: str, version: str, tags: dict[str, str]) -> None:
        if notify.EVENTS_TAG in tags:
            raise MlflowException("tag store unavailable")
        set_version_tags(model, version, tags)

    monkeypatch.setattr(tracking, "set_version_tags", refuse_record)
    better = candidate_outcome(store, spec, "int8", "cpu", throughput=900.0, variant="night-2")
    with pytest.raises(PromotionError, match=f"promotion of pipeline {spec.name} failed: .*rolled back"):
        promote(spec, _logged(spec, [better]))

    assert _alias(name) == first.model_version
    assert _versions(name) == [first.model_version]
    assert better.status == "passed" and better.model_version is None
    assert MlflowClient().get_run(better.run_id).data.tags["status"] == "passed"
    model = client.get_registered_model(name)
    assert model.description == "written by hand"
    assert model.tags["model"] == "an older model" and "backend" not in model.tags
    assert model.tags["pipeline"] == spec.name


def test_promotion_refuses_candidates_that_were_never_logged(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    unlogged = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=400.0)
    with pytest.raises(PromotionError, match="no MLflow run_id"):
        promote(spec, [unlogged])
    assert not MlflowClient().search_registered_models(f"name = '{spec.name}-cpu'")


def test_a_version_that_gets_the_alias_back_has_its_tags_refreshed(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [first]))
    promoted_at = MlflowClient().get_model_version(name, first.model_version).tags["promoted_at"]
    second = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    promote(spec, _logged(spec, [second]))
    tags = MlflowClient().get_model_version(name, first.model_version).tags
    assert (tags["status"], tags["superseded_by"]) == ("superseded", second.model_version)

    again = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [again]))
    assert again.status == "promoted" and again.model_version == first.model_version
    tags = MlflowClient().get_model_version(name, first.model_version).tags
    assert (tags["status"], tags["superseded_by"], tags["throughput"]) == ("promoted", "", "400")
    assert tags["decision_reason"] == again.decision.reason and tags["promoted_at"] > promoted_at
    assert MlflowClient().get_model_version(name, second.model_version).tags["status"] == "superseded"


@pytest.mark.parametrize("damage", ["bytes flipped after upload, size kept", "unloadable, manifest matching it"])
def test_a_corrupt_or_unloadable_engine_is_never_registered_and_the_alias_stays(tmp_path: Path, damage: str) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promote(spec, _logged(spec, [first]))

    bad = candidate_outcome(store, spec, "int8", "cpu", throughput=900.0, variant="night-2")
    build = bad.stages["build"]
    engine = build.file("model.onnx")

    def damage_engine() -> None:
        data = bytearray(engine.read_bytes())
        data[:64] = bytes(64) if damage.startswith("unloadable") else bytes(b ^ 0xFF for b in data[:64])
        engine.write_bytes(bytes(data))

    if damage.startswith("unloadable"):  # broken before it was built into the cache: every hash agrees with it
        damage_engine()
        build.manifest["files"]["model.onnx"]["sha256"] = file_digest(engine)
        logged = _logged(spec, [bad])
    else:
        logged = _logged(spec, [bad])
        damage_engine()
    promote(spec, logged)

    assert bad.status == "failed" and bad.failed_stage == "register" and bad.model_version is None
    assert ("does not load" if damage.startswith("unloadable") else "sha256 differs from the build manifest") in bad.error
    assert _versions(name) == [first.model_version] and _alias(name) == first.model_version
    assert bad.decision.reason.startswith("not registered:") and not bad.decision.take_alias


@pytest.mark.parametrize("verdict", [None, "model.onnx: the engine does not load", "passed"])
def test_an_engine_built_on_another_host_is_registered_only_on_that_hosts_check(tmp_path: Path,
                                                                                 verdict: str | None) -> None:
    """A GPU pool's engine may not load in the parent (no copy, no GPU): the parent relies on the building
    host's check, recorded on the run, and refuses an engine that host did not pass."""
    import shutil

    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    name = f"{spec.name}-cpu"
    remote = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=400.0)
    logged = _logged(spec, [remote])
    shutil.rmtree(remote.stages["build"].path)  # the parent's host never had the build directory
    if verdict:
        tracking.record_engine_check(remote.run_id, verdict)
    promote(spec, logged)

    if verdict == "passed":
        assert remote.status == "promoted" and _alias(name) == remote.model_version
    else:
        assert remote.status == "failed" and remote.failed_stage == "register" and not _versions(name)
        assert "built on another host" in remote.error and (verdict or "did not run") in remote.error


def test_stale_running_runs_of_dead_processes_are_closed_and_live_ones_left_alone(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    client = MlflowClient()
    with tracking.pipeline_run(spec, "first", {}):
        pass
    experiment = client.get_experiment_by_name(tracking.experiment_name(spec.name)).experiment_id
    host = socket.gethostname()
    killed = client.create_run(experiment, tags={tracking.OWNER_TAG: f"{host} {dead.pid} 1"}).info.run_id
    live = client.create_run(experiment, tags={tracking.OWNER_TAG: tracking.owner_tag()}).info.run_id
    elsewhere = client.create_run(experiment, tags={tracking.OWNER_TAG: f"other-host {dead.pid} 1"}).info.run_id

    with tracking.pipeline_run(spec, "next", {}):
        pass
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(live).info.status == "RUNNING"
    assert client.get_run(elsewhere).info.status == "RUNNING", "another host's process cannot be checked here"
