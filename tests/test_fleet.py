"""The fleet on loopback: Prefect and MLflow servers as processes, work pools and deployments made by
`smelter deploy --pools` (and `prefect deploy --all`), a real worker per pool, runs started with
`prefect deployment run`, and MLflow's own registry webhook announcing the promotion."""

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

from tasks.mlflow_webhooks import verify_signature
from tests.fixtures.fleet import RecordingReceiver, Service, cli, project_env
from tests.fixtures.models import write_pipelines

pytestmark = pytest.mark.slow
SECRET_ENV = "SMELTER_FLEET_WEBHOOK_SECRET"
RUN_TIMEOUT_S = 600


def smelter(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"smelter {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_deployment(name: str, env: dict[str, str], cwd: Path) -> tuple[str, float]:
    """`prefect deployment run NAME --watch`: the flow run id and the seconds until it finished."""
    started = time.monotonic()
    done = subprocess.run([cli("prefect"), "deployment", "run", name, "--watch", "--watch-interval", "1",
                           "--watch-timeout", str(RUN_TIMEOUT_S)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S + 60)
    seconds = time.monotonic() - started
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    assert found, f"prefect deployment run {name}:\n{done.stdout}\n{done.stderr}"
    return found.group(1), seconds


def flow_run(api: str, run_id: str) -> dict[str, Any]:
    return httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()


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


def test_deployed_runs_build_on_their_pools_and_mlflow_announces_the_promotion(
        tmp_path: Path, tiny_bert_dir: Path, mlflow_server: str, prefect_api_server: str,
        recording_receiver: RecordingReceiver) -> None:
    api, name, secret = prefect_api_server, f"fleet-{uuid.uuid4().hex[:6]}", secrets.token_hex(16)
    project = tmp_path / "project"
    project.mkdir()
    write_pipelines(project, tiny_bert_dir, "feature-extraction", precisions=["fp32"], name=name,
                    targets=[{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                             {"name": "edge", "backend": "onnxruntime", "threads": 1, "pool": "gpu-test"}],
                    accuracy={"gates": {"cosine_mean": {"min": 0.9}}},
                    performance={"gates": {"p99_ms": {"max": 60000}}},
                    schedule={"cron": "0 3 * * *", "timezone": "UTC"},
                    promotion={"webhooks": [{"url": recording_receiver.url, "secret_env": SECRET_ENV,
                                             "retries": 0, "timeout_s": 5}]})
    env = project_env(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=mlflow_server, PREFECT_HOME=str(tmp_path / "home"),
                      PREFECT_WORKER_QUERY_SECONDS="1", **{SECRET_ENV: secret})

    out = smelter(["deploy", "--pools"], env, project)
    assert re.search(r"pool cpu\s+created", out) and re.search(r"pool gpu-test\s+created", out), out
    expected = {"smelter-nightly/nightly-cpu", "smelter-nightly/nightly-gpu-test",
                f"smelter-pipeline/{name}-cpu", f"smelter-pipeline/{name}-gpu-test"}
    registered = deployments(api)
    assert set(registered) == expected
    assert registered[f"smelter-pipeline/{name}-gpu-test"]["work_pool_name"] == "gpu-test"
    assert registered[f"smelter-pipeline/{name}-gpu-test"]["parameters"]["targets"] == ["edge"]
    assert [s["schedule"]["cron"] for s in registered[f"smelter-pipeline/{name}-cpu"]["schedules"]] == ["0 3 * * *"]

    smelter(["deploy", "--prefect-yaml", "prefect.yaml"], env, project)  # a directory with no checkout in it
    deployed = subprocess.run([cli("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=project,
                              capture_output=True, text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    again = deployments(api)
    assert set(again) == expected, "prefect deploy --all registers the same deployments, no others"
    assert again[f"smelter-pipeline/{name}-cpu"]["pull_steps"] == registered[f"smelter-pipeline/{name}-cpu"]["pull_steps"]

    assert "created" in smelter(["webhooks", "sync"], env, project)
    assert "updated" in smelter(["webhooks", "sync"], env, project)
    ours = [w for w in MlflowClient().list_webhooks() if w.name.startswith("smelter-")]
    assert len(ours) == 1 and ours[0].url == recording_receiver.url

    workers = []
    try:
        for pool in ("cpu", "gpu-test"):
            home = tmp_path / f"worker-{pool}"  # not the project: the pull step finds it
            home.mkdir()
            workers.append(Service([cli("prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                    "--name", f"worker-{pool}", "--limit", "1"], home / "worker.log", env, home))
        cold_id, cold_s = run_deployment(f"smelter-pipeline/{name}-cpu", env, tmp_path)
        edge_id, edge_s = run_deployment(f"smelter-pipeline/{name}-gpu-test", env, tmp_path)
        warm_id, warm_s = run_deployment(f"smelter-pipeline/{name}-cpu", env, tmp_path)
        logs = "\n".join(w.log()[-4000:] for w in workers)
        for run_id, pool in ((cold_id, "cpu"), (edge_id, "gpu-test"), (warm_id, "cpu")):
            run = flow_run(api, run_id)
            assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{logs}"
            assert run["work_pool_name"] == pool
            assert run_id in workers[0 if pool == "cpu" else 1].log(), f"run {run_id} not taken by the {pool} worker"
    finally:
        for worker in workers:
            worker.stop()
    print(f"\nprefect deployment run -> completed: cold {cold_s:.1f} s, other pool (shared upstream cached) "
          f"{edge_s:.1f} s, nothing changed {warm_s:.1f} s")

    client = MlflowClient()
    champions = {t: client.get_model_version_by_alias(f"{name}-{t}", "champion") for t in ("cpu", "edge")}
    assert all(v.version == "1" for v in champions.values())

    def mlflow_deliveries() -> list[dict[str, Any]]:
        found = []
        for headers, body in recording_receiver.with_header("X-MLflow-Signature"):
            payload = json.loads(body)
            if payload["data"].get("name") == f"{name}-cpu":
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
