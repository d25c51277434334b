"""Promotion as a deploy system sees it: only passing engines in the registry, one version per engine's
bytes, the alias on the best one, moved only by a new promotion from the champion the decision saw, and
never left half-moved when a step fails. Every run after the first decides against the champion the
registry holds, measured side by side (tests/fixtures/judged.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.config.settings import RegistrySettings, RunSettings
from tasks.judge import notify
from tasks.judge.promote import PromotionError
from tasks.outcome import CandidateOutcome
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore, file_digest
from tests.fixtures.candidates import candidate_outcome, failed_outcome, pipeline_spec
from tests.fixtures.judged import judged, promoted
from tests.fixtures.onnx_graphs import linear_model

pytestmark = pytest.mark.usefixtures("mlflow_server")


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
    outcomes = promoted(spec, judged(spec, [fast, slow, rejected, failed]))
    for outcome in outcomes:
        tracking.finish_candidate(outcome.run_id, RunSettings.of(spec), outcome)

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
    champion = tracking.champion(RegistrySettings.of(spec), "cpu")
    assert (champion.run_id, champion.version, champion.build_key) == (fast.run_id, fast.model_version, fast.cache_key)


def test_an_engine_rejected_before_and_passing_now_is_uploaded_to_the_run_that_registers_it(tmp_path: Path) -> None:
    """Its later runs uploaded nothing (the files were in MLflow already); the one registered gets its own copy."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    rejected = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0, passed=False)
    rejected.stages["build"] = dataclasses.replace(rejected.stages["build"], cached=True)
    promoted(spec, judged(spec, [rejected]))
    first_run = rejected.run_id
    passing = candidate_outcome(store, spec, "int8", "cpu", throughput=500.0)
    passing.stages["build"] = dataclasses.replace(passing.stages["build"], cached=True)
    assert passing.cache_key == rejected.cache_key
    logged = judged(spec, [passing])
    assert tracking.engine_source(passing.run_id) == f"runs:/{first_run}/engine", "nothing uploaded while judged"
    promoted(spec, logged)

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
    promoted(spec, judged(spec, [high_throughput, low_latency]))
    assert (low_latency.status, high_throughput.status) == ("promoted", "passed")
    assert _alias(f"{spec.name}-cpu") == low_latency.model_version


def test_alias_moves_only_when_a_later_run_promotes(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))
    assert _alias(name) == first.model_version

    worse = candidate_outcome(store, spec, "int8", "cpu", throughput=100.0, passed=False, variant="night-2")
    promoted(spec, judged(spec, [worse]))
    assert worse.status == "rejected" and _alias(name) == first.model_version
    assert _versions(name) == [first.model_version]

    unchanged = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [unchanged]))
    assert unchanged.cache_key == first.cache_key
    assert unchanged.status == "passed" and unchanged.model_version == first.model_version
    assert _versions(name) == [first.model_version]

    better = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-4")
    promoted(spec, judged(spec, [better]))
    assert better.status == "promoted" and _alias(name) == better.model_version != first.model_version


def test_failed_promotion_step_restores_previous_alias_model_metadata_and_removes_new_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = [{"url": "http://127.0.0.1:9/hooks/engines", "secret_env": "SMELTER_UNUSED_SECRET"}]
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}", webhooks=hooks)
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))
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
        promoted(spec, judged(spec, [better]))

    assert _alias(name) == first.model_version
    assert _versions(name) == [first.model_version]
    assert better.status == "passed" and better.model_version is None
    # its run does not read as judged: the decision was rolled back with the promotion
    assert MlflowClient().get_run(better.run_id).data.tags["status"] == "undecided"
    model = client.get_registered_model(name)
    assert model.description == "written by hand"
    assert model.tags["model"] == "an older model" and "backend" not in model.tags
    assert model.tags["pipeline"] == spec.name


def test_promotion_refuses_candidates_that_were_never_logged(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    unlogged = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=400.0)
    with pytest.raises(PromotionError, match="no MLflow run_id"):
        promoted(spec, [unlogged])
    assert not MlflowClient().search_registered_models(f"name = '{spec.name}-cpu'")


def test_a_version_that_gets_the_alias_back_has_its_tags_refreshed(tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))
    promoted_at = MlflowClient().get_model_version(name, first.model_version).tags["promoted_at"]
    second = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    promoted(spec, judged(spec, [second]))
    tags = MlflowClient().get_model_version(name, first.model_version).tags
    assert (tags["status"], tags["superseded_by"]) == ("superseded", second.model_version)

    again = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [again]))
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
    promoted(spec, judged(spec, [first]))

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
        logged = judged(spec, [bad])
    else:
        logged = judged(spec, [bad])
        damage_engine()
    promoted(spec, logged)

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
    logged = judged(spec, [remote])
    shutil.rmtree(remote.stages["build"].path)  # the parent's host never had the build directory
    if verdict:
        tracking.record_engine_check(remote.run_id, verdict)
    promoted(spec, logged)

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


def _rebuilt(outcome: CandidateOutcome, seed: int | None) -> CandidateOutcome:
    """The candidate as a `--force` rebuild or a repair leaves it: the same build key, a sidecar with another
    build time and, with a `seed`, other engine bytes (a TensorRT build is not bit-reproducible)."""
    build = outcome.stages["build"]
    sidecar = build.file("engine.json")
    sidecar.write_text(json.dumps(json.loads(sidecar.read_text()) | {"optimize_seconds": 0.123}))
    changed = [sidecar] + ([linear_model(build.file("model.onnx"), fp16=False, seed=seed)] if seed is not None else [])
    for path in changed:
        build.manifest["files"][path.name] = {"sha256": file_digest(path), "bytes": path.stat().st_size}
    return outcome


def test_a_version_is_its_engine_bytes_a_rebuild_with_other_bytes_is_a_new_one_measured_against_the_champion(
        tmp_path: Path) -> None:
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    name = f"{spec.name}-cpu"
    first = candidate_outcome(ArtifactStore(tmp_path / "night-1"), spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))
    same_bytes = _rebuilt(candidate_outcome(ArtifactStore(tmp_path / "night-2"), spec, "int8", "cpu",
                                            throughput=400.0), seed=None)  # a rebuild that gave the same engine
    promoted(spec, judged(spec, [same_bytes]))
    assert same_bytes.model_version == first.model_version and _versions(name) == [first.model_version]
    assert same_bytes.decision.holds_alias and same_bytes.status == "passed"

    rebuilt = _rebuilt(candidate_outcome(ArtifactStore(tmp_path / "night-3"), spec, "int8", "cpu", throughput=400.0),
                       seed=7)
    assert rebuilt.cache_key == first.cache_key
    promoted(spec, judged(spec, [rebuilt], vs_champion=1.01))

    assert rebuilt.model_version != first.model_version
    assert _versions(name) == sorted([first.model_version, rebuilt.model_version])
    assert rebuilt.reason.startswith(f"not significant: 1.01x [0.99, 1.03] vs champion v{first.model_version}")
    assert rebuilt.status == "passed" and _alias(name) == first.model_version
    client = MlflowClient()
    digests = {v: client.get_model_version(name, v).tags[tracking.ENGINE_IDENTITY_TAG]
               for v in (first.model_version, rebuilt.model_version)}
    assert digests[rebuilt.model_version] == tracking.engine_identity(rebuilt.stages["build"])
    assert digests[first.model_version] != digests[rebuilt.model_version]
    engine = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{rebuilt.model_version}",
                                                      dst_path=str(tmp_path / "dl")))
    assert (engine / "model.onnx").read_bytes() == rebuilt.stages["build"].file("model.onnx").read_bytes()

    rebuilt_again = _rebuilt(candidate_outcome(ArtifactStore(tmp_path / "night-4"), spec, "int8", "cpu",
                                               throughput=400.0), seed=7)
    promoted(spec, judged(spec, [rebuilt_again], vs_champion=1.01))
    assert rebuilt_again.model_version == rebuilt.model_version, "the same bytes never make two versions"
    assert len(_versions(name)) == 2


@pytest.mark.parametrize("meanwhile", ["another run promoted its engine", "the alias was removed by hand"])
def test_the_alias_moves_only_from_the_champion_the_decision_saw(tmp_path: Path, meanwhile: str) -> None:
    """Compare-and-set: between the decision and the move, the alias changed; the newer state is kept."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))
    late = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    decided = judged(spec, [late])
    assert late.decision.take_alias and late.decision.champion == first.model_version

    if meanwhile.startswith("another run"):
        other = candidate_outcome(store, spec, "fp32", "cpu", throughput=700.0, variant="night-2-elsewhere")
        promoted(spec, judged(spec, [other]))
        assert other.status == "promoted"
        now = other.model_version
    else:
        tracking.delete_alias(name, "champion")
        now = None
    promoted(spec, decided)

    assert tracking.alias_version(name, "champion") == now, "a newer state of the alias is never overwritten"
    assert late.status == "passed" and late.model_version is not None
    assert not late.decision.take_alias and not late.decision.holds_alias
    assert (f"not applied: alias champion moved from v{first.model_version} to {f'v{now}' if now else 'no version'}"
            in late.reason)
    late_tags = MlflowClient().get_model_version(name, late.model_version).tags
    assert notify.EVENTS_TAG not in late_tags and late_tags.get("status") != "promoted", "no event, no promotion"
    if now:
        assert MlflowClient().get_model_version(name, now).tags["status"] == "promoted"


def test_two_runs_deciding_for_the_same_engine_at_once_register_and_announce_it_once(tmp_path: Path) -> None:
    """Both saw no champion; the second to promote finds the alias already on that very engine: no conflict."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    name = f"{spec.name}-cpu"
    runs = [candidate_outcome(ArtifactStore(tmp_path / f"host-{i}"), spec, "int8", "cpu", throughput=400.0)
            for i in range(2)]
    decided = [judged(spec, [outcome]) for outcome in runs]
    for outcomes in decided:
        promoted(spec, outcomes)

    assert [o.status for o in runs] == ["promoted", "passed"]
    assert runs[0].model_version == runs[1].model_version == _alias(name) and _versions(name) == [_alias(name)]
    assert "not applied" not in runs[1].reason
    assert len(notify.read_events(MlflowClient().get_model_version(name, _alias(name)).tags)) == 1


def test_two_hosts_registering_the_same_bytes_at_once_keep_one_version_and_the_other_run_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hosts whose promotion locks never meet (each on its own Prefect server and lock dir) register the same
    engine bytes at the same instant: each creates a version before either looks for duplicates. The run that made
    the lowest goes on first and removes the other's; then the other finds its own version gone. One version is
    left, nothing raises, and the run whose version went says which one was kept."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    name = f"{spec.name}-cpu"
    runs = [candidate_outcome(ArtifactStore(tmp_path / f"host-{i}"), spec, "int8", "cpu", throughput=400.0)
            for i in range(2)]
    decided = [judged(spec, [outcome]) for outcome in runs]
    in_step, lowest_done = threading.Barrier(2), threading.Event()
    made: dict[int, str] = {}
    create_version = tracking.create_version

    def create_in_step_with_the_other_host(*args: object, **kwargs: object) -> tracking.RegisteredVersion:
        in_step.wait(timeout=120)  # both found no version of these bytes
        created = create_version(*args, **kwargs)
        made[threading.get_ident()] = created.version
        in_step.wait(timeout=120)  # both made one
        if created.version != min(made.values(), key=int):
            assert lowest_done.wait(timeout=120)
        return created

    monkeypatch.setattr(tracking, "create_version", create_in_step_with_the_other_host)
    monkeypatch.setattr(notify, "promotion_lock", lambda registered_model: contextlib.nullcontext())
    raised: list[BaseException] = []

    def promote_on_a_host(outcomes: list[CandidateOutcome]) -> None:
        try:
            promoted(spec, outcomes)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            raised.append(e)
        finally:
            if made.get(threading.get_ident()) == min(made.values(), key=int, default=None):
                lowest_done.set()

    hosts = [threading.Thread(target=promote_on_a_host, args=(outcomes,)) for outcomes in decided]
    for host in hosts:
        host.start()
    for host in hosts:
        host.join(timeout=300)
    assert not raised, raised

    kept = _versions(name)
    assert len(kept) == 1 and [o.model_version for o in runs] == kept * 2, (kept, [o.model_version for o in runs])
    assert sorted(o.status for o in runs) == ["passed", "promoted"] and _alias(name) == kept[0]
    told = [o for o in runs if "another run registered the same engine bytes" in o.reason]
    assert len(told) == 1 and told[0].status == "passed", [o.reason for o in runs]
    assert f"as v{kept[0]}; that version is kept" in told[0].reason, told[0].reason


def test_the_accuracy_baseline_is_the_previous_version_holding_another_engine(tmp_path: Path) -> None:
    """The regression gate compares today's engine with the newest version of another engine: a rebuild under
    the same key with other bytes (a --force TensorRT build) is judged against the version registered before it;
    the same bytes under a new key (a toolchain bump that changed nothing) never against themselves."""
    spec = pipeline_spec(f"promo-{uuid.uuid4().hex[:8]}")
    first = candidate_outcome(ArtifactStore(tmp_path / "night-1"), spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first]))

    rebuilt = _rebuilt(candidate_outcome(ArtifactStore(tmp_path / "night-2"), spec, "int8", "cpu", throughput=400.0),
                       seed=7)
    assert rebuilt.cache_key == first.cache_key
    found = tracking.previous_version(RegistrySettings.of(spec), "cpu", "int8", rebuilt.stages["build"], eval_text=None)
    assert found is not None and found["version"] == first.model_version, found
    assert found["metrics"]["accuracy.cosine_mean"] == 0.9988

    same_bytes = _rebuilt(candidate_outcome(ArtifactStore(tmp_path / "night-3"), spec, "int8", "cpu",
                                            throughput=400.0, variant="new toolchain"),
                          seed=int(first.cache_key[:8], 16))  # the seed candidate_outcome gave the first engine
    assert same_bytes.cache_key != first.cache_key
    assert tracking.engine_identity(same_bytes.stages["build"]) == tracking.engine_identity(first.stages["build"])
    assert tracking.previous_version(RegistrySettings.of(spec), "cpu", "int8", same_bytes.stages["build"],
                                     eval_text=None) is None
