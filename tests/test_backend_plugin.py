"""A backend from another distribution: installed beside smelter, found through its entry point, run.

tests/data/toy_backend is a third party's package (a backend and a judging step, a module and an entry
point each); nothing in tasks/ or flows/ names them. Installed into a temporary directory and put on
PYTHONPATH, the backend is part of the schema, of `smelter validate`'s messages and of the README table, its
serving package and the judging step join the plan, and a whole pipeline builds, judges, promotes and
packages its engine, with the judging step run between smelter's gate and decide.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.fixtures.models import write_pipelines

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "tests" / "data" / "toy_backend"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a smelter process that has the toy backend installed (and nothing else changed)."""
    root = tmp_path_factory.mktemp("plugin")
    site, source = root / "site", root / "toy_backend"
    shutil.copytree(PLUGIN, source)  # setuptools writes build/ and egg-info beside the sources it installs
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=300,
                   env=os.environ | {"PIP_NO_INDEX": "1", "TMPDIR": str(root)})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    return env | {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "HF_HUB_OFFLINE": "1",
                  "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                  "SMELTER_LOCK_DIR": str(root / "locks"), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}


def smelter(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_an_installed_backend_joins_the_schema_the_messages_and_the_table(plugin_env: dict[str, str],
                                                                           tiny_bert_dir: Path, tmp_path: Path) -> None:
    table = subprocess.run([sys.executable, "-m", "tasks.backends.table", "--markdown"], env=plugin_env, cwd=REPO,
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert "| `toy` | cpu | the precision stage's ONNX | fp32, int8 | `threads` | smelter-toy-backend |" in table
    path = write_pipelines(tmp_path, tiny_bert_dir, "feature-extraction", precisions=["fp32", "fp16"],
                           targets=[{"name": "toy", "backend": "toy", "workspace": "1GiB"}])
    refused = smelter(plugin_env, "validate", "-f", str(path))
    assert refused.returncode == 2
    assert ("not a setting of backend toy; it is a setting of tensorrt (toy targets take name, pool, threads)"
            in refused.stderr), refused.stderr
    path = write_pipelines(tmp_path, tiny_bert_dir, "feature-extraction", precisions=["fp32", "fp16"],
                           targets=[{"name": "toy", "backend": "toy"}, {"name": "cpu", "backend": "onnxruntime"}])
    checked = smelter(plugin_env, "validate", "-f", str(path))
    assert checked.returncode == 0, checked.stderr
    assert "skipped: tiny/fp16/toy: backend toy does not build fp16 (it builds fp32, int8)" in checked.stderr
    planned = smelter(plugin_env, "plan", "-f", str(path), "--artifacts", str(tmp_path / "artifacts"))
    assert planned.returncode == 0, planned.stderr
    assert [line.split()[:2] for line in planned.stdout.splitlines() if " package " in line] == [["tiny", "package"]]


@pytest.mark.slow
def test_a_pipeline_runs_through_an_installed_backend(plugin_env: dict[str, str], tiny_bert_dir: Path,
                                                      tmp_path: Path) -> None:
    path = write_pipelines(tmp_path, tiny_bert_dir, "feature-extraction", precisions=["fp32"],
                           targets=[{"name": "toy", "backend": "toy", "threads": 1}],
                           accuracy={"gates": {"cosine_mean": {"min": 0.999}}},
                           performance={"gates": {"p99_ms": {"max": 60000}}})
    artifacts = tmp_path / "artifacts"
    done = smelter(plugin_env, "run", "--json", "-q", "-f", str(path), "--artifacts", str(artifacts), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    candidate, = json.loads(done.stdout)["candidates"]
    assert (candidate["candidate"], candidate["status"]) == ("tiny/fp32/toy", "promoted"), candidate
    assert candidate["metrics"]["accuracy.cosine_mean"] >= 0.999  # the unoptimized graph computes the model
    build = artifacts / "tiny" / "build" / candidate["stages"]["build"]["key"]
    manifest = json.loads((build / "manifest.json").read_text())
    assert manifest["outputs"]["backend"] == "toy" and (build / "model.onnx").is_file() and (build / "toy.json").is_file()
    client = MlflowClient(plugin_env["MLFLOW_TRACKING_URI"])
    packaged = client.list_artifacts(candidate["mlflow_run_id"], f"triton/tiny/{candidate['model_version']}")
    assert [a.path for a in packaged] == [f"triton/tiny/{candidate['model_version']}/model.onnx"]  # its serving hook's

    run = client.get_run(candidate["mlflow_run_id"])
    assert run.data.tags.get("toy.review") == "passed", "the plugin's step ran after the gate, before promotion"


def test_an_installed_judging_step_takes_its_place_in_the_graph(plugin_env: dict[str, str], tiny_bert_dir: Path,
                                                                 tmp_path: Path) -> None:
    path = write_pipelines(tmp_path, tiny_bert_dir, "feature-extraction", precisions=["fp32", "int8"],
                           targets=[{"name": "toy", "backend": "toy", "threads": 1}])
    planned = smelter(plugin_env, "plan", "-f", str(path), "--artifacts", str(tmp_path / "artifacts"))
    assert planned.returncode == 0, planned.stderr
    stages = [line.split()[1] for line in planned.stdout.splitlines() if line.split()[2:3] == ["always"]]
    assert stages == ["gate", "gate", "toy-review", "toy-review", "decide", "promote", "package", "notify"], planned.stdout
