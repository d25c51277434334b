"""Deployments: one set of names whether served or sent to work pools, pools per kind of target,
a prefect.yaml that matches and `prefect deploy --all` takes without a warning, workers that find the
project or say what to set, and the compose stack."""

from __future__ import annotations

import base64
import importlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from flows import deploy
from flows.worker_steps import ProjectNotFound, enter_project
from tasks.config.spec import load
from tests.fixtures.fleet import cli, project_env
from tests.fixtures.models import write_pipelines

REPO = Path(__file__).resolve().parents[1]


def test_one_pool_keeps_plain_names_and_each_schedule(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                            schedule={"cron": "15 3 * * *", "timezone": "Europe/Berlin"})
    plans = {p.full_name: p for p in deploy.plan(load(path), str(path), "artifacts")}
    assert set(plans) == {"smelter-nightly/nightly", "smelter-pipeline/enc"}
    assert plans["smelter-nightly/nightly"].schedule is None and plans["smelter-nightly/nightly"].pool == "cpu"
    scheduled = plans["smelter-pipeline/enc"]
    assert (scheduled.schedule.cron, scheduled.schedule.timezone) == ("15 3 * * *", "Europe/Berlin")
    assert scheduled.parameters == {"file": str(path), "artifacts": "artifacts", "pipeline": "enc"}
    assert scheduled.entrypoint == "flows.pipeline:pipeline_flow"


def test_a_fleet_runs_parents_on_cpu_and_gets_a_build_deployment_per_other_pool(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(
        tiny_bert_dir, "feature-extraction", name="enc", schedule={"cron": "0 2 * * *"},
        targets=[{"name": "cpu", "backend": "onnxruntime"}, {"name": "sm90", "backend": "tensorrt", "arch": "sm90"},
                 {"name": "h100", "backend": "tensorrt", "arch": "sm90", "pool": "gpu-h100"}])
    specs = load(path)
    assert deploy.pools(specs) == {"cpu": ["enc/cpu"], "gpu-h100": ["enc/h100"], "gpu-sm90": ["enc/sm90"]}
    plans = {p.full_name: p for p in deploy.plan(specs, "pipelines.yaml", "artifacts", fan_out=True)}
    assert set(plans) == {"smelter-nightly/nightly", "smelter-pipeline/enc",
                          "smelter-build/gpu-h100", "smelter-build/gpu-sm90"}
    assert plans["smelter-pipeline/enc"].pool == "cpu" and plans["smelter-pipeline/enc"].parameters["pool"] == "cpu"
    assert plans["smelter-nightly/nightly"].parameters["pool"] == "cpu"
    assert plans["smelter-build/gpu-sm90"].pool == "gpu-sm90" and plans["smelter-build/gpu-sm90"].schedule is None
    assert plans["smelter-build/gpu-sm90"].entrypoint == "flows.pipeline:build_targets"
    served = {p.full_name: p for p in deploy.plan(specs, "pipelines.yaml", "artifacts")}
    assert set(served) == {"smelter-nightly/nightly", "smelter-pipeline/enc"}, "served: one process builds all"
    assert "pool" not in served["smelter-pipeline/enc"].parameters


def test_without_cpu_targets_parents_run_on_the_first_pool(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                            targets=[{"name": "a", "backend": "onnxruntime", "pool": "gpu-b"},
                                     {"name": "b", "backend": "onnxruntime", "pool": "gpu-a"}])
    plans = {p.full_name: p for p in deploy.plan(load(path), "pipelines.yaml", "artifacts", fan_out=True)}
    assert plans["smelter-nightly/nightly"].pool == "gpu-a"
    assert set(plans) == {"smelter-nightly/nightly", "smelter-build/gpu-b"}


def test_a_run_builds_its_own_pools_targets_and_sends_the_others(pipeline_factory, tiny_bert_dir):
    from flows.fleet import split_by_pool

    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                            targets=[{"name": "cpu", "backend": "onnxruntime", "pool": "cpu-large"},
                                     {"name": "edge", "backend": "onnxruntime"},
                                     {"name": "edge2", "backend": "onnxruntime", "pool": "cpu-large"}])
    spec = load(path).pipelines["enc"]
    assert split_by_pool(spec.targets, "cpu") == (["edge"], {"cpu-large": ["cpu", "edge2"]})
    assert split_by_pool(spec.targets[:2], None) == (["cpu", "edge"], {})


def test_where_a_target_builds_is_not_part_of_its_engine_key(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction",
                            targets=[{"name": "cpu", "backend": "onnxruntime", "pool": "big-cpus"}])
    target = load(path).pipelines["tiny"].targets[0]
    assert target.pool == "big-cpus" and "pool" not in target.model_dump()


def test_prefect_yaml_is_the_same_set_smelter_deploy_registers():
    generated = deploy.prefect_yaml(deploy.plan(load(REPO / "pipelines.yaml", check_env=False), "pipelines.yaml",
                                                "artifacts", fan_out=True), "pipelines.yaml")
    assert (REPO / "prefect.yaml").read_text() == generated, \
        "prefect.yaml is stale: regenerate it with `smelter deploy --prefect-yaml prefect.yaml`"
    document = yaml.safe_load(generated)
    for deployment in document["deployments"]:
        module, _, name = deployment["entrypoint"].partition(":")
        flow = getattr(importlib.import_module(module), name)
        assert set(deployment["parameters"]) <= set(flow.parameters.properties), deployment["name"]


def test_a_worker_without_the_project_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("SMELTER_HOME", raising=False)
    with pytest.raises(ProjectNotFound, match="Set SMELTER_HOME in the worker's environment"):
        enter_project(str(tmp_path / "gone"))
    monkeypatch.setenv("SMELTER_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(ProjectNotFound, match="SMELTER_HOME="):
        enter_project(str(tmp_path))
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SMELTER_HOME", str(tmp_path))
    assert enter_project("/recorded/at/deploy/time") == {"directory": str(tmp_path)}
    assert Path.cwd() == tmp_path


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())


def test_compose_runs_a_worker_per_pool_with_a_gpu_for_each_gpu_pool():
    services = _compose()["services"]
    gpu_file = REPO / "docker" / "pipelines.gpu.yaml"
    commands = {name: " ".join(s["command"]) if isinstance(s.get("command"), list) else s.get("command", "")
                for name, s in services.items()}
    for pool in deploy.pools(load(gpu_file, check_env=False, allow_outside_paths=True)):
        (worker,) = [n for n, c in commands.items() if f"worker start --pool {pool} " in c + " "]
        env = services[worker]["environment"]
        assert env["PREFECT_API_URL"] == "http://prefect:4200/api" and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        devices = services[worker].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert bool(devices) == pool.startswith("gpu-"), worker
        assert all("gpu" in d["capabilities"] for d in devices)
    assert "--pools" in commands["deploy"] and "postgresql" in commands["mlflow"] and "s3://" in commands["mlflow"]
    assert services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY" in services["mlflow"]["environment"]


def _compose_client() -> list[str] | None:
    """`docker compose` (the v2 plugin) when this machine has it; the docker CLI alone is not enough."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(_compose_client() is None,
                    reason="no docker compose client on this machine; the structure is checked by the test above")
def test_compose_config_is_valid_for_docker_compose():
    fernet_key = base64.urlsafe_b64encode(bytes(32)).decode()
    done = subprocess.run([*_compose_client(), "-f", str(REPO / "docker" / "compose.yaml"), "config", "--quiet"],
                          capture_output=True, text=True, timeout=60,
                          env=os.environ | {"MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": fernet_key})
    assert done.returncode == 0, done.stderr


def test_prefect_deploy_all_registers_the_generated_file_without_warnings(prefect_api_server, tmp_path,
                                                                          tiny_bert_dir):
    project = tmp_path / "project"
    project.mkdir()
    write_pipelines(project, tiny_bert_dir, "feature-extraction", name="enc",
                    schedule={"cron": "0 3 * * *", "timezone": "UTC"})
    env = project_env(PREFECT_API_URL=prefect_api_server, PREFECT_HOME=str(tmp_path / "home"))
    pools_before = _names(prefect_api_server, "work_pools")
    try:
        for args in (["deploy", "--pools"], ["deploy", "--prefect-yaml", "prefect.yaml"]):
            done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=project,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
        assert "schedules: []" not in (project / "prefect.yaml").read_text()

        deployed = subprocess.run([cli("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=project,
                                  capture_output=True, text=True, timeout=300)

        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "Warning" not in deployed.stdout + deployed.stderr, deployed.stdout + deployed.stderr
        found = httpx.post(f"{prefect_api_server}/deployments/filter", json={}, timeout=10).json()
        schedules = {d["name"]: [s["schedule"].get("cron") for s in d["schedules"]] for d in found}
        assert schedules == {"nightly": [], "enc": ["0 3 * * *"]}
    finally:  # the session's server is shared: later tests count its deployments and pools
        for deployment in httpx.post(f"{prefect_api_server}/deployments/filter", json={}, timeout=10).json():
            httpx.delete(f"{prefect_api_server}/deployments/{deployment['id']}", timeout=10)
        for pool in _names(prefect_api_server, "work_pools") - pools_before:
            httpx.delete(f"{prefect_api_server}/work_pools/{pool}", timeout=10)


def _names(api: str, what: str) -> set[str]:
    return {item["name"] for item in httpx.post(f"{api}/{what}/filter", json={}, timeout=10).json()}


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_image_context_leaves_out_local_state_and_installs_from_the_pins():
    ignored = _dockerignore()
    for path in (".git", ".venv", "artifacts/*", "mlruns", "mlflow.db", "models", ".pytest_cache", "**/__pycache__"):
        assert path in ignored, f".dockerignore: expected {path} among its patterns"
    assert "!artifacts/.gitkeep" in ignored
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "pip install -c constraints.txt" in dockerfile
    assert "make_tiny_llama.py models/tiny-llama" in dockerfile, "pipelines.yaml's tiny Llama is made in the image"
    mlflow_image = (REPO / "docker" / "mlflow.Dockerfile").read_text()
    assert "-c /tmp/constraints.txt mlflow==3.17.2" in mlflow_image


def test_every_compose_service_that_runs_smelter_or_mlflow_is_built_not_installed_at_start():
    services = _compose()["services"]
    for name, service in services.items():
        command = " ".join(service["command"]) if isinstance(service.get("command"), list) else service.get("command", "")
        assert "pip install" not in command, f"{name} installs at every start"
        if command.split()[:1] in (["smelter"], ["prefect"]) and name != "prefect" or name == "mlflow":
            build = service.get("build") or {}
            assert (REPO / "docker" / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).is_file(), \
                f"compose service {name}: expected a build: whose dockerfile exists"


def _readme_commands(path: Path, program: str) -> list[list[str]]:
    """Each `program ...` command of a README's code blocks, continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    return [shlex.split(line.split(program + " ", 1)[1].split("#")[0]) for line in text.splitlines()
            if f" {program} " in f" {line.strip()} " and line.startswith("    ")]


def test_docker_readme_smelter_commands_parse_and_select_candidates(monkeypatch):
    from flows.cli import _parser
    from tasks.config.spec import select

    monkeypatch.chdir(REPO)
    commands = _readme_commands(REPO / "docker" / "README.md", "smelter")
    assert commands, "docker/README.md shows a `smelter run` command"
    for args in commands:
        parsed = _parser().parse_args(args)
        specs = load(parsed.file, check_env=False, allow_outside_paths=parsed.allow_outside_paths)
        if parsed.command == "run":
            assert select(specs, parsed.pipeline, parsed.precision, parsed.target)
