"""The fleet on loopback: Prefect and MLflow servers as processes, work pools and deployments made by
`smelter deploy --pools` (and `prefect deploy --all`), a real worker per pool but one, a run started
with `prefect deployment run` that fans its targets out to their pools and joins them through MLflow,
and MLflow's own registry webhook announcing the promotion."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from flows.deploy import SILENT_RUNS_AUTOMATION
from tasks.judge.mlflow_webhooks import verify_signature
from tests.fixtures.fleet import RecordingReceiver, Service, cli, project_env
from tests.fixtures.models import write_pipelines

pytestmark = pytest.mark.slow
SECRET_ENV = "SMELTER_FLEET_WEBHOOK_SECRET"
RUN_TIMEOUT_S = 600
# How long a pool's build may wait for a worker to take it (the stranded pool waits all of it): the workers start
# just before the first run, and one took over 20 s to come up on 2 cores busy with the whole suite
WORKER_TIMEOUT_S = 60


def smelter(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"smelter {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_deployment(name: str, env: dict[str, str], cwd: Path, extra: list[str] = ()) -> tuple[str, float, str]:
    """`prefect deployment run NAME --watch`: the flow run id, the seconds until it finished and what it printed."""
    started = time.monotonic()
    done = subprocess.run([cli("prefect"), "deployment", "run", name, *extra, "--watch", "--watch-interval", "1",
                           "--watch-timeout", str(RUN_TIMEOUT_S)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S + 60)
    seconds = time.monotonic() - started
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    assert found, f"prefect deployment run {name}:\n{done.stdout}\n{done.stderr}"
    return found.group(1), seconds, done.stdout


def deployments(api: str) -> dict[str, dict[str, Any]]:
    flows = {f["id"]: f["name"] for f in httpx.post(f"{api}/flows/filter", json={}, timeout=10).json()}
    found = httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
    return {f"{flows[d['flow_id']]}/{d['name']}": d for d in found}


def wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def flow_runs(api: str) -> list[dict[str, Any]]:
    return httpx.post(f"{api}/flow_runs/filter", json={"limit": 200}, timeout=10).json()


def child_runs(parent_run_id: str) -> dict[str, Any]:
    """The candidate runs logged under one MLflow parent run, by candidate name."""
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    found = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {r.data.tags["candidate"]: r for r in found}


def parent_runs(name: str) -> list[Any]:
    """The pipeline's parent MLflow runs, oldest first."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(f"smelter/{name}")
    runs = client.search_runs([experiment.experiment_id], "tags.pipeline != ''", order_by=["attributes.start_time ASC"])
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def test_a_deployed_run_fans_out_to_each_pool_joins_in_mlflow_and_promotes_once(
        tmp_path: Path, tiny_bert_dir: Path, mlflow_server: str, prefect_api_server: str,
        recording_receiver: RecordingReceiver) -> None:
    api, name, secret = prefect_api_server, f"fleet-{uuid.uuid4().hex[:6]}", secrets.token_hex(16)
    project = tmp_path / "project"
    project.mkdir()
    write_pipelines(project, tiny_bert_dir, "feature-extraction", precisions=["fp32"], name=name,
                    targets=[{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                             {"name": "edge", "backend": "onnxruntime", "threads": 1, "pool": "gpu-test"},
                             {"name": "far", "backend": "onnxruntime", "threads": 1, "pool": "gpu-nobody"}],
                    accuracy={"gates": {"cosine_mean": {"min": 0.9}}},
                    performance={"gates": {"p99_ms": {"max": 60000}}},
                    schedule={"cron": "0 3 * * *", "timezone": "UTC"},
                    promotion={"webhooks": [{"url": recording_receiver.url, "secret_env": SECRET_ENV,
                                             "retries": 0, "timeout_s": 5}]})
    document = yaml.safe_load((project / "pipelines.yaml").read_text())
    (project / "pipelines.yaml").write_text(yaml.safe_dump({"fleet": {"worker_timeout": WORKER_TIMEOUT_S}, **document}))
    env = project_env(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=mlflow_server, PREFECT_HOME=str(tmp_path / "home"),
                      PREFECT_WORKER_QUERY_SECONDS="1", **{SECRET_ENV: secret})

    existing = {pool["name"] for pool in httpx.post(f"{api}/work_pools/filter", json={}, timeout=10).json()}
    out = smelter(["deploy", "--pools"], env, project)
    for pool in ("cpu", "gpu-test", "gpu-nobody"):  # the session's server may have a `cpu` pool already
        assert re.search(rf"pool {pool}\s+{'exists' if pool in existing else 'created'}", out), out
    expected = {"smelter-nightly/nightly", f"smelter-pipeline/{name}", "smelter-build/gpu-test",
                "smelter-build/gpu-nobody"}
    registered = deployments(api)
    assert set(registered) == expected
    assert registered[f"smelter-pipeline/{name}"]["work_pool_name"] == "cpu"
    assert registered[f"smelter-pipeline/{name}"]["parameters"]["pool"] == "cpu"
    assert registered["smelter-build/gpu-test"]["work_pool_name"] == "gpu-test"
    assert [s["schedule"]["cron"] for s in registered[f"smelter-pipeline/{name}"]["schedules"]] == ["0 3 * * *"]
    (silent,) = [a for a in httpx.post(f"{api}/automations/filter", json={}, timeout=10).json()
                 if a["name"] == SILENT_RUNS_AUTOMATION]  # a run killed with -9 ends Crashed, not Running for ever
    assert silent["trigger"]["posture"] == "Proactive" and silent["trigger"]["after"] == ["prefect.flow-run.heartbeat"]
    assert [(a["type"], a["state"]) for a in silent["actions"]] == [("change-flow-run-state", "CRASHED")]
    served = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env=env, cwd=project, capture_output=True,
                            text=True, timeout=300)  # serving here would take the pools' names from their workers
    assert served.returncode == 2 and "run on work pools" in served.stderr, served.stdout + served.stderr
    assert f"smelter-pipeline/{name} (pool cpu)" in served.stderr
    assert deployments(api)[f"smelter-pipeline/{name}"]["work_pool_name"] == "cpu"

    smelter(["deploy", "--prefect-yaml", "prefect.yaml"], env, project)  # a directory with no checkout in it
    deployed = subprocess.run([cli("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=project,
                              capture_output=True, text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    again = deployments(api)
    assert set(again) == expected, "prefect deploy --all registers the same deployments, no others"
    assert again[f"smelter-pipeline/{name}"]["pull_steps"] == registered[f"smelter-pipeline/{name}"]["pull_steps"]

    assert "created" in smelter(["webhooks", "sync"], env, project)
    assert "updated" in smelter(["webhooks", "sync"], env, project)
    ours = [w for w in MlflowClient().list_webhooks() if w.name.startswith("smelter-")]
    assert len(ours) == 1 and ours[0].url == recording_receiver.url

    workers = {}
    try:
        for pool in ("cpu", "gpu-test"):  # none for gpu-nobody
            home = tmp_path / f"worker-{pool}"  # not the project: the pull step finds it
            home.mkdir()
            workers[pool] = Service([cli("prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                     "--name", f"worker-{pool}", "--limit", "1"], home / "worker.log", env, home)
        cold_id, cold_s, watched = run_deployment(f"smelter-pipeline/{name}", env, tmp_path)
        warm_id, warm_s, _ = run_deployment(f"smelter-pipeline/{name}", env, tmp_path,
                                            ["--param", 'targets=["cpu", "edge"]'])
        # `--watch` streams the stage lines, those of the pools' builds included (the server streams logs out)
        assert f"{name}/cpu benchmark: done" in watched and f"{name}/edge benchmark: done" in watched, watched
        logs = "\n".join(w.log()[-4000:] for w in workers.values())
        by_id = {r["id"]: r for r in flow_runs(api)}
        # the cold run's candidate on the pool without a worker failed: its flow run says so, as the CLI's exit code would
        for run_id, ended in ((cold_id, "FAILED"), (warm_id, "COMPLETED")):
            assert by_id[run_id]["state"]["type"] == ended, f"{by_id[run_id]['state']}\n{logs}"
            assert by_id[run_id]["work_pool_name"] == "cpu" and run_id in workers["cpu"].log()
        assert by_id[cold_id]["state"]["message"] == "2 promoted, 0 rejected, 0 pending, 1 failed"
        builds = {pool: [r for r in by_id.values() if r["deployment_id"] == registered[f"smelter-build/{pool}"]["id"]]
                  for pool in ("gpu-test", "gpu-nobody")}
        assert len(builds["gpu-test"]) == 2 and all(r["state"]["type"] == "COMPLETED" for r in builds["gpu-test"])
        assert all(r["id"] in workers["gpu-test"].log() for r in builds["gpu-test"]), "taken by the gpu-test worker"
        (stranded,) = builds["gpu-nobody"]
        assert stranded["state"]["type"] == "CANCELLED", stranded["state"]
    finally:
        for worker in workers.values():
            worker.stop()
    print(f"\nprefect deployment run -> failed (one pool without a worker), then completed on two pools "
          f"(worker_timeout {WORKER_TIMEOUT_S} s): cold {cold_s:.1f} s; nothing changed, two pools {warm_s:.1f} s")

    cold_parent, warm_parent = parent_runs(name)
    children = child_runs(cold_parent.info.run_id)
    assert set(children) == {f"{name}/fp32/cpu", f"{name}/fp32/edge"}, "a stranded pool logs nothing"
    for target, pool in (("cpu", "cpu"), ("edge", "gpu-test")):
        tags = children[f"{name}/fp32/{target}"].data.tags
        assert tags["fleet.pool"] == pool and tags["fleet.worker"] == f"worker-{pool}"
        assert tags["status"] == "promoted" and tags["gate"] == "passed"
        assert by_id[tags["fleet.flow_run_id"]]["work_pool_name"] == pool, "built by a flow run of its own pool"
        assert tags["fleet.flow_run_id"] in workers[pool].log(), f"taken by the {pool} worker"
    description = cold_parent.data.tags["mlflow.note.content"]
    stranded_row = f"| fp32/far | **failed** | - | build: no worker on pool gpu-nobody within {WORKER_TIMEOUT_S:g} s |"
    assert stranded_row in description, description
    assert {r.data.tags["status"] for r in child_runs(warm_parent.info.run_id).values()} == {"passed"}

    client = MlflowClient()
    champions = {t: client.get_model_version_by_alias(f"{name}-{t}", "champion") for t in ("cpu", "edge")}
    assert all(v.version == "1" for v in champions.values())
    assert champions["edge"].run_id == children[f"{name}/fp32/edge"].info.run_id
    assert not client.search_registered_models(f"name = '{name}-far'")

    def mlflow_deliveries() -> list[dict[str, Any]]:
        found = []
        for headers, body in recording_receiver.with_header("X-MLflow-Signature"):
            payload = json.loads(body)
            if payload["data"].get("name") == f"{name}-edge":
                assert verify_signature(secret, headers, body), "MLflow's signature checks out with the synced secret"
                found.append(payload)
        return found

    (delivery, *_) = wait_for(mlflow_deliveries, 60, "MLflow's registry webhook")
    assert (delivery["entity"], delivery["action"]) == ("model_version_alias", "created")
    assert delivery["data"]["alias"] == "champion" and str(delivery["data"]["version"]) == "1"
    assert len(recording_receiver.with_header("X-Smelter-Signature")) == 2, "smelter's own event per promotion"

    events = httpx.post(f"{api}/events/filter", json={"filter": {"event": {"name": ["smelter.engine.promoted"]}},
                                                        "limit": 50}, timeout=10).json()["events"]
    resources = {e["resource"]["prefect.resource.id"] for e in events}
    assert {f"mlflow.model-version.{name}-cpu.1", f"mlflow.model-version.{name}-edge.1"} <= resources

    (project / "pipelines.yaml").write_text(_without_webhooks(project / "pipelines.yaml"))
    assert "deleted" in smelter(["webhooks", "sync"], env, project)
    assert not [w for w in MlflowClient().list_webhooks() if w.name.startswith("smelter-")]


def _without_webhooks(path: Path) -> str:
    document = yaml.safe_load(path.read_text())
    for pipeline in document["pipelines"].values():
        pipeline["promotion"] = {"webhooks": []}
    return yaml.safe_dump(document)
