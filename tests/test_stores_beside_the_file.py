"""A pipelines file's stores live beside it, as its model and data paths do, whatever directory smelter
runs from: a run started elsewhere must find the same builds and registry, not start empty ones and
crown a second champion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fixtures.fleet import project_env
from tests.fixtures.models import write_pipelines

REPO = Path(__file__).resolve().parents[1]


def _smelter(args: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in project_env(**extra).items() if k not in ("MLFLOW_TRACKING_URI", "SMELTER_ARTIFACTS")}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env | extra, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_a_command_started_in_another_directory_uses_the_stores_beside_the_file(
        tmp_path: Path, tiny_bert_dir: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    pipelines = write_pipelines(project, tiny_bert_dir, "feature-extraction", name="enc")
    (project / "artifacts" / "enc").mkdir(parents=True)  # a store with something in it: the one to use

    planned = _smelter(["plan", "-f", str(pipelines)], elsewhere)
    assert planned.returncode == 0, planned.stderr
    assert (project / "mlflow.db").is_file(), "the registry beside the file was not the one opened"
    assert sorted(p.name for p in elsewhere.iterdir()) == [], "a store was made in the working directory"

    refused = _smelter(["validate", "-f", str(pipelines), "--artifacts", ""], elsewhere)
    assert refused.returncode == 2 and "--artifacts : expected a directory path" in refused.stderr


def test_a_new_experiment_keeps_its_artifacts_beside_a_store_outside_the_working_directory(
        tmp_path: Path, monkeypatch) -> None:
    from tasks.registry.runs import _artifacts_beside_the_store

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    monkeypatch.chdir(elsewhere)
    assert _artifacts_beside_the_store("smelter/enc") == (project / "mlruns" / "smelter-enc").as_uri()
    monkeypatch.chdir(project)  # MLflow's own default, ./mlruns, is already beside it
    assert _artifacts_beside_the_store("smelter/enc") is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a server keeps its own artifacts
    assert _artifacts_beside_the_store("smelter/enc") is None
