"""The whole graph through the CLI: real Optimum exports, ONNX Runtime, Prefect, an mlflow server and a webhook receiver."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from flows.cli import main

pytestmark = pytest.mark.slow


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["run", "--json", *args])
    return code, json.loads(capsys.readouterr().out)  # stdout holds the summary alone


def by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["candidate"]: c for c in summary["candidates"]}


def cached_task_runs() -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterState, TaskRunFilterStateName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(
            state=TaskRunFilterState(name=TaskRunFilterStateName(any_=["Cached"]))), limit=200)
    return [r.name for r in runs]


def flow_run_state(name: str) -> str:
    """The state type of the newest Prefect flow run of pipeline `name` (named `<name>: <counts>` when it ended)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = [run for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name)),
                                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC)
                if run.name.split(": ")[0] == name]
    assert runs, f"no Prefect flow run {name}"
    return runs[0].state.type.value


def prefect_table(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no Prefect artifact {key}"
    return found[-1].data


@pytest.fixture
def encoder_pipeline(pipeline_factory: Any, tiny_bert_dir: Path, webhook_receiver: Any) -> tuple[Path, str]:
    name = f"enc-{uuid.uuid4().hex[:6]}"
    path = pipeline_factory(
        tiny_bert_dir, "feature-extraction", precisions=["fp32", "int8"], name=name,
        accuracy={"gates": {"cosine_mean": {"min": 0.9}}},
        performance={"gates": {"p99_ms": {"max": 60000}}, "objective": "throughput"},
        promotion={"webhooks": [{"url": webhook_receiver.url, "secret_env": webhook_receiver.secret_env,
                                 "retries": 1, "timeout_s": 5}]})
    return path, name


def test_run_promotes_records_notifies_and_reruns_cached(
        encoder_pipeline: tuple[Path, str], mlflow_server: str, prefect_server: None, webhook_receiver: Any,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, name = encoder_pipeline
    artifacts = str(tmp_path / "artifacts")
    code, summary = run_json(capsys, "-f", str(path), "--artifacts", artifacts)
    assert code == 0, summary
    candidates = by_name(summary)
    assert set(candidates) == {f"{name}/fp32/cpu", f"{name}/int8/cpu"}
    statuses = sorted(c["status"] for c in candidates.values())
    assert statuses == ["passed", "promoted"], candidates
    promoted = next(c for c in candidates.values() if c["status"] == "promoted")
    assert promoted["registered_model"] == f"{name}-cpu" and promoted["model_version"]
    assert all(g["passed"] for g in promoted["gates"])
    assert promoted["metrics"]["accuracy.cosine_mean"] >= 0.9

    client = MlflowClient()
    champion = client.get_model_version_by_alias(f"{name}-cpu", "champion")
    assert champion.version == str(promoted["model_version"])
    run = client.get_run(promoted["mlflow_run_id"])
    assert run.data.tags["candidate"] == promoted["candidate"] and run.data.tags["gate"] == "passed"
    assert {"p99_ms", "speedup_vs_reference", "accuracy.cosine_mean"} <= set(run.data.metrics)
    assert webhook_receiver.secret not in json.dumps(run.data.params) + json.dumps(run.data.tags)

    assert len(webhook_receiver.events) == 1
    event = webhook_receiver.events[0]
    assert event["version"] == str(promoted["model_version"]) and event["precision"] == promoted["precision"]

    code, again = run_json(capsys, "-f", str(path), "--artifacts", artifacts)
    assert code == 0, [(c["candidate"], c["status"], c["error"]) for c in again["candidates"]]
    for candidate in again["candidates"]:
        remeasured = [n for n, stage in candidate["stages"].items() if not stage["cached"]]
        assert remeasured in ([], ["benchmark"]), candidate["stages"]  # a contended benchmark is measured again
        assert not remeasured or candidate["stages"]["benchmark"]["contended"]
        assert len(candidate["gates"]) == 4 and candidate["metrics"]["p99_ms"] > 0, candidate["gates"]
    still_champion = by_name(again)[promoted["candidate"]]
    assert still_champion["status"] == "passed", "an engine already holding the alias is not promoted again"
    assert still_champion["model_version"] == promoted["model_version"]
    assert all(g["passed"] for g in still_champion["gates"])
    assert len(webhook_receiver.events) == 1, "nothing changed: no second announcement"
    rerun = client.get_run(still_champion["mlflow_run_id"])
    assert rerun.data.tags["engine_source"] == f"models:/{name}-cpu/{promoted['model_version']}"
    assert not client.list_artifacts(rerun.info.run_id, "engine"), "the registry already holds this engine"
    assert any(n.endswith("/build") for n in cached_task_runs())
    table = json.loads(prefect_table(f"{name}-candidates"))
    assert {row["candidate"] for row in table} == set(candidates)
    assert client.get_model_version_by_alias(f"{name}-cpu", "champion").version == champion.version
    assert still_champion["decision"]["reason"] == f"holds the alias (champion v{champion.version})"

    # Everything rebuilt and measured again: the same statuses, versions and champion; nothing announced.
    code, forced = run_json(capsys, "-f", str(path), "--artifacts", artifacts, "--force")
    assert code == 0
    assert {n: (c["status"], c["model_version"]) for n, c in by_name(forced).items()} == {
        n: (c["status"], c["model_version"]) for n, c in by_name(again).items()}
    assert client.get_model_version_by_alias(f"{name}-cpu", "champion").version == champion.version
    assert len(webhook_receiver.events) == 1
    other = next(c for c in forced["candidates"] if c["candidate"] != promoted["candidate"])
    assert other["decision"]["vs_champion"]["version"] == champion.version
    low, high = other["metrics"]["speedup_vs_reference_ci"]
    assert low <= other["metrics"]["speedup_vs_reference"] <= high

    main(["plan", "-f", str(path), "--artifacts", artifacts])
    plan = capsys.readouterr().out
    assert "to-run" not in plan
    document = yaml.safe_load(path.read_text())
    document["pipelines"][name]["calibration"]["samples"] = 12
    path.write_text(yaml.safe_dump(document))
    main(["plan", "-f", str(path), "--artifacts", artifacts])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    states = {(r[0], r[1]): r[2] for r in rows}
    assert states[(f"{name}/int8", "precision")] == "to-run"
    assert states[(f"{name}/fp32", "precision")] == "cached"
    assert states[(f"{name}/fp32/cpu", "build")] == "cached"

    fp32 = by_name(again)[f"{name}/fp32/cpu"]
    shutil.rmtree(Path(artifacts) / name / "build" / fp32["stages"]["build"]["key"])
    code, rebuilt = run_json(capsys, "-f", str(path), "--precision", "fp32", "--artifacts", artifacts)
    stages = by_name(rebuilt)[f"{name}/fp32/cpu"]["stages"]
    assert code == 0 and not stages["build"]["cached"], "a cache entry whose directory is gone is rebuilt"
    assert stages["build"]["key"] == fp32["stages"]["build"]["key"] and stages["precision"]["cached"]

    # A user who doubts a decision times two registered engines here; the champion against itself is the noise floor.
    version = str(champion.version)
    code = main(["compare", "-f", str(path), "--artifacts", artifacts, f"{name}-cpu", version, version,
                 "--batch", "1", "--seq", "16", "--json"])
    compared = json.loads(capsys.readouterr().out)
    assert code == 0 and (compared["batch"], compared["seq"]) == (1, 16)
    assert compared["ci"][0] <= compared["ratio"] <= compared["ci"][1] and compared["rounds"] >= 1
    assert main(["compare", "-f", str(path), f"{name}-cpu", version, "999"]) == 2
    assert f"{name}-cpu has no version '999'" in capsys.readouterr().err
    assert main(["compare", "-f", str(path), "--artifacts", artifacts, f"{name}-cpu", version, version,
                 "--batch", "64", "--seq", "4096"]) == 2, "a shape no profile holds is refused before engines load"
    refused = capsys.readouterr().err
    assert str(path) in refused and "batch 64 x seq 4096: outside every profile" in refused


def test_rejected_and_failed_candidates_are_recorded_never_promoted(
        pipeline_factory: Any, tiny_bert_dir: Path, mlflow_server: str, prefect_server: None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    name = f"strict-{uuid.uuid4().hex[:6]}"
    path = pipeline_factory(
        tiny_bert_dir, "feature-extraction", precisions=["fp32"], name=name,
        targets=[{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                 {"name": "sm90", "backend": "tensorrt", "arch": "sm90"}],
        accuracy={"gates": {"cosine_min": {"min": 1.0}, "max_abs_error": {"max": 0.0}}})
    code, summary = run_json(capsys, "-f", str(path), "--artifacts", str(tmp_path / "artifacts"))
    candidates = by_name(summary)
    cpu, gpu = candidates[f"{name}/fp32/cpu"], candidates[f"{name}/fp32/sm90"]
    if gpu["status"] != "failed":
        pytest.skip("this machine has TensorRT: the sm90 candidate cannot fail for its absence")
    assert code == 1
    assert flow_run_state(name) == "FAILED", "a pipeline run with a failed candidate looked green in Prefect"
    assert cpu["status"] == "rejected"
    assert any("max_abs_error" in r for g in cpu["gates"] for r in g["reasons"])
    assert gpu["failed_stage"] == "build" and "TensorRT" in gpu["error"]
    assert cpu["mlflow_run_id"] and gpu["mlflow_run_id"]
    client = MlflowClient()
    assert client.search_model_versions(f"name='{name}-cpu'") == []
    assert client.get_run(cpu["mlflow_run_id"]).data.tags["gate"] == "failed"
    assert not list((tmp_path / "artifacts" / name / "build").glob("*/model.plan"))


def test_a_receiver_that_is_down_loses_nothing(
        encoder_pipeline: tuple[Path, str], mlflow_server: str, prefect_server: None, webhook_receiver: Any,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, name = encoder_pipeline
    webhook_receiver.down = True
    code, summary = run_json(capsys, "-f", str(path), "--precision", "fp32", "--artifacts", str(tmp_path / "a"))
    assert code == 0 and by_name(summary)[f"{name}/fp32/cpu"]["status"] == "promoted"
    assert webhook_receiver.events == [] and webhook_receiver.attempts >= 1
    version = by_name(summary)[f"{name}/fp32/cpu"]["model_version"]
    shown = MlflowClient().get_model_version(f"{name}-cpu", version).tags["smelter.events.status"]
    assert "pending 1" in shown
    webhook_receiver.down = False
    assert main(["notify", "--retry", "-f", str(path)]) == 0
    assert [e["candidate"] for e in webhook_receiver.events] == [f"{name}/fp32/cpu"]
    shown = MlflowClient().get_model_version(f"{name}-cpu", version).tags["smelter.events.status"]
    assert shown == "1 event(s): delivered 1", "the readable outbox follows a retry, not only the next run"
    capsys.readouterr()
    assert main(["notify", "--retry", "-f", str(path)]) == 0
    assert len(webhook_receiver.events) == 1
    assert "nothing to send" in capsys.readouterr().err, "a retry with nothing owed says so"


def test_decoder_with_kv_cache_end_to_end(
        pipeline_factory: Any, tiny_llama_dir: Path, mlflow_server: str, prefect_server: None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    name = f"dec-{uuid.uuid4().hex[:6]}"
    path = pipeline_factory(tiny_llama_dir, "text-generation-with-past", precisions=["fp32", "int8"], name=name,
                            accuracy={"gates": {"top1_agreement": {"min": 0.5}}})
    code, summary = run_json(capsys, "-f", str(path), "--artifacts", str(tmp_path / "artifacts"))
    assert code == 0, summary
    fp32 = by_name(summary)[f"{name}/fp32/cpu"]
    assert fp32["metrics"]["accuracy.top1_agreement"] > 0.99
    assert {c["status"] for c in summary["candidates"]} <= {"promoted", "passed", "rejected"}
    run = MlflowClient().get_run(fp32["mlflow_run_id"])
    assert any(k.startswith("decode_b") for k in run.data.metrics), sorted(run.data.metrics)


def test_an_unreachable_tracking_server_is_refused_before_any_work(
        pipeline_factory: Any, tiny_bert_dir: Path, prefect_server: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main
    from tests.fixtures.servers import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="offline")
    artifacts = tmp_path / "artifacts"
    assert main(["run", "--json", "-f", str(path), "--artifacts", str(artifacts)]) == 2
    captured = capsys.readouterr()
    assert "MLFLOW_TRACKING_URI" in captured.err and "does not answer" in captured.err
    assert not captured.out and not (artifacts / "offline").exists(), "nothing was built or written"
