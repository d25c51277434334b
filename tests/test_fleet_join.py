"""Fan-out and join without workers: the `fleet` settings, a candidate judged from its MLflow run alone,
a pool no worker picks up, and one build per GPU."""

from __future__ import annotations

import contextvars
import re
import threading
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tasks.config.settings import GateSettings, RunSettings
from tasks.config.spec import SpecError, load
from tasks.judge import gates
from tasks.metrics import stage_metrics
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tests.fixtures.candidates import candidate_outcome, failed_outcome, pipeline_spec


def _with_fleet(path: Path, fleet: object) -> Path:
    document = yaml.safe_load(path.read_text())
    document.pop("fleet", None)
    path.write_text(yaml.safe_dump({"fleet": fleet, **document}, sort_keys=False))
    return path


def test_worker_timeout_defaults_to_ten_minutes_and_is_bounded(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction")
    assert load(path).fleet.worker_timeout == 600
    assert load(_with_fleet(path, {"worker_timeout": 30})).fleet.worker_timeout == 30
    for bad, expected in (({"worker_timeout": 0}, "fleet.worker_timeout: Input should be greater than 0"),
                          ({"worker_timeout": 1e9}, "fleet.worker_timeout: Input should be less than or equal"),
                          ({"worker_timeout": "10m"}, "fleet.worker_timeout: Input should be a valid number"),
                          ({"worker_timeot": 5}, "fleet.worker_timeot: unknown key"),
                          ([5], "fleet: expected a mapping")):
        with pytest.raises(SpecError) as raised:
            load(_with_fleet(path, bad))
        (problem,) = raised.value.problems
        assert re.match(rf"{re.escape(str(path))}:[12]: ", problem) and expected in problem, problem


@pytest.mark.usefixtures("mlflow_server")
def test_the_parent_judges_a_candidate_from_its_mlflow_run_alone(tmp_path: Path) -> None:
    """What a build on another host hands back: its stage results rebuilt from MLflow, gated as if local."""
    spec = pipeline_spec(f"join-{tmp_path.name[-8:]}".lower().replace("_", "-"))
    worker_store, parent_store = ArtifactStore(tmp_path / "worker"), ArtifactStore(tmp_path / "parent")
    built = candidate_outcome(worker_store, spec, "fp32", "cpu", throughput=400)
    built.gates = []
    broken = failed_outcome(worker_store, spec, "int8", "cpu")
    with tracking.pipeline_run(spec, "join", params={}) as parent_run_id:
        ids = {o.candidate.name: tracking.log_candidate(parent_run_id, RunSettings.of(spec), o,
                                                        extra_tags={"fleet.pool": "gpu-x"})
               for o in (built, broken)}
        joined = tracking.candidate_outcomes(spec.name, parent_run_id, parent_store.root)

    assert set(joined) == set(ids)
    again = joined[built.candidate.name]
    assert again.run_id == ids[built.candidate.name] and again.status == "passed"
    assert {n: (s.key, s.cached, s.outputs) for n, s in again.stages.items()} == \
        {n: (s.key, s.cached, s.outputs) for n, s in built.stages.items()}
    assert stage_metrics(again.stages) == stage_metrics(built.stages)
    validity = again.stages["accuracy"].outputs["validity"]
    settings = GateSettings.of(spec)
    assert gates.evaluate(settings, stage_metrics(again.stages), validity, None) == \
        gates.evaluate(settings, stage_metrics(built.stages), built.stages["accuracy"].outputs["validity"], None)
    assert not again.stages["build"].path.exists(), "the parent's store does not have another host's build"
    engine = tracking.engine_dir(again, tmp_path / "downloaded")
    assert (engine / "model.onnx").read_bytes() == built.stages["build"].file("model.onnx").read_bytes()

    failed = joined[broken.candidate.name]
    assert (failed.status, failed.failed_stage, failed.error) == ("failed", "build", broken.error)
    tags = MlflowClient().get_run(ids[built.candidate.name]).data.tags
    assert tags["gate"] == "pending" and tags["fleet.pool"] == "gpu-x"


def test_a_pool_without_a_worker_is_cancelled_after_worker_timeout(prefect_server, tmp_path: Path,
                                                                   pipeline_factory, tiny_bert_dir) -> None:
    from prefect.client.orchestration import get_client

    from flows import deploy, fleet

    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="lonely",
                            targets=[{"name": "cpu", "backend": "onnxruntime"},
                                     {"name": "far", "backend": "onnxruntime", "pool": "gpu-nobody"}])
    specs = load(path)
    plans = [p for p in deploy.plan(specs, str(path), str(tmp_path / "artifacts"), fan_out=True)
             if p.flow_name == deploy.BUILD_FLOW]
    assert [p.full_name for p in plans] == ["smelter-build/gpu-nobody"]
    deploy.create_pools(["gpu-nobody"])
    deploy.register(plans, str(tmp_path))

    ran = fleet.dispatch("gpu-nobody", {"pipeline": "lonely", "targets": ["far"], "parent_run_id": "none"}, 2)
    assert ran.failure == "no worker on pool gpu-nobody within 2 s"
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(ran.flow_run_id).state.is_cancelled()

    missing = fleet.dispatch("gpu-elsewhere", {"pipeline": "lonely"}, 2)
    assert missing.flow_run_id is None and "no deployment smelter-build/gpu-elsewhere" in missing.failure


def _hold_together(count: int, gpus: list[tuple[str, str]], hold: threading.Barrier | None) -> tuple[int, list[str]]:
    """`count` threads each take a GPU slot; (most held at once, the GPUs they got)."""
    from flows.fleet import gpu_slot

    lock, inside, most, got = threading.Lock(), [0], [0], []
    release = threading.Event()

    def work() -> None:
        with gpu_slot(True, gpus) as index:
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                got.append(index)
            if hold is not None:
                hold.wait(timeout=120)
            else:
                release.wait(timeout=2)  # long enough for a second holder to get in, if the limit let it
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work,)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return most[0], got


def test_one_build_per_gpu_at_a_time(prefect_server) -> None:
    most, got = _hold_together(2, [("7", "GPU-seven")], None)
    assert (most, got) == (1, ["7", "7"])
    both = threading.Barrier(2)
    most, got = _hold_together(2, [("0", "GPU-zero"), ("1", "GPU-one")], both)
    assert most == 2 and sorted(got) == ["0", "1"] and not both.broken, "two GPUs: two builds at once, one on each"


def test_a_gpu_is_named_as_nvidia_smi_names_it_whatever_cuda_visible_devices_says() -> None:
    from flows.fleet import usable_gpus
    from tasks.runtime.gpu import parse_smi_rows

    listed = parse_smi_rows("0, GPU-a100, 00000000:01:00.0, A100, 8.0, 550.1, 81920\n"
                            "1, GPU-h100, 00000000:02:00.0, H100, 9.0, 550.1, 81920\n")
    assert usable_gpus(listed, None, None) == [("1", "GPU-h100"), ("0", "GPU-a100")], "CUDA: fastest first"
    assert usable_gpus(listed, "0", None) == [("1", "GPU-h100")]
    assert usable_gpus(listed, "0", "PCI_BUS_ID") == [("0", "GPU-a100")]
    assert usable_gpus(listed, "GPU-a100", None) == [("0", "GPU-a100")]


def test_a_host_without_gpus_holds_no_slot_and_leaves_the_error_to_the_stage() -> None:
    from flows.fleet import gpu_slot

    with gpu_slot(True, []) as index:
        assert index is None


@pytest.mark.usefixtures("mlflow_server")
def test_a_pool_that_cannot_build_fails_its_candidates_and_the_rest_is_promoted(
        prefect_server, tmp_path: Path, pipeline_factory, tiny_bert_dir) -> None:
    """The parent on pool cpu: its own target built in-process and joined through MLflow; the other
    pool has no build deployment, so its candidate fails with the reason and the alias still moves."""
    from flows.pipeline import flow_summaries, pipeline_flow

    name = f"half-{tmp_path.name[-6:]}".lower().replace("_", "-")
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name=name,
                            targets=[{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                                     {"name": "far", "backend": "onnxruntime", "threads": 1,
                                      "pool": "gpu-unregistered"}],
                            accuracy={"gates": {"cosine_mean": {"min": 0.9}}},
                            performance={"gates": {"p99_ms": {"max": 60000}}})
    state = pipeline_flow(str(path), name, artifacts=str(tmp_path / "artifacts"), pool="cpu", return_state=True)
    assert state.is_failed(), "a flow run with a failed candidate must not look green in Prefect"
    summaries = {s["target"]: s for s in flow_summaries(state)}
    assert summaries["far"]["status"] == "failed"
    assert summaries["far"]["error"] == ("no deployment smelter-build/gpu-unregistered: "
                                         "register it with `smelter deploy --pools`")
    assert summaries["far"]["mlflow_run_id"] is None
    assert summaries["cpu"]["status"] == "promoted" and summaries["cpu"]["model_version"] == "1"
    tags = MlflowClient().get_run(summaries["cpu"]["mlflow_run_id"]).data.tags
    assert tags["gate"] == "passed" and tags["status"] == "promoted" and tags["fleet.host"]


@pytest.mark.usefixtures("mlflow_server")
def test_a_candidate_whose_run_was_not_logged_fails_at_track_with_why(tmp_path: Path) -> None:
    """A build whose MLflow run could not be logged (the tracking server gone at that moment) fails its candidate
    at `track` with the error, not as a build that did not happen; a target whose build never ran fails at build."""
    from flows.pipeline import _joined
    from tasks.config.spec import Candidate

    spec = pipeline_spec(f"untracked-{tmp_path.name[-8:]}".lower().replace("_", "-"))
    tracked, untracked = Candidate(spec.name, "fp32", "cpu"), Candidate(spec.name, "int8", "cpu")
    lost = Candidate(spec.name, "fp32", "sm90")
    why = "its MLflow run could not be logged: MlflowException: Connection refused"
    with tracking.pipeline_run(spec, "join", params={}) as parent_run_id:
        tracking.log_candidate(parent_run_id, RunSettings.of(spec),
                               candidate_outcome(ArtifactStore(tmp_path), spec, "fp32", "cpu", throughput=400))
        joined = {o.candidate.name: o for o in _joined(spec.name, [tracked, untracked, lost], parent_run_id,
                                                         ArtifactStore(tmp_path / "parent"),
                                                         {untracked.name: why, "sm90": "build on pool gpu-x failed"})}
    assert joined[tracked.name].run_id and joined[tracked.name].status == "passed"
    assert (joined[untracked.name].status, joined[untracked.name].failed_stage, joined[untracked.name].error) == (
        "failed", "track", why)
    assert (joined[lost.name].failed_stage, joined[lost.name].error) == ("build", "build on pool gpu-x failed")
