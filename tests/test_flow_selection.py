"""`smelter run --pipeline A` is not blocked by another pipeline's problems, through the flows too
(which read the file again), while a run of every pipeline still refuses the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.cli import main
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.slow


def test_a_broken_pipeline_does_not_block_another(
        pipeline_factory: Any, tiny_bert_dir: Path, prefect_server: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # An unreachable tracking server fails the selected pipeline as soon as it starts recording: far
    # enough to show the flows loaded it, without building anything.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.delenv("SMELTER_SELECTION_TEST_SECRET", raising=False)
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="good")
    document = yaml.safe_load(path.read_text())
    document["pipelines"]["broken"] = document["pipelines"]["good"] | {
        "model": {"path": "no-such-model", "task": "feature-extraction"},
        "promotion": {"webhooks": [{"url": "https://hooks.example/x", "secret_env": "SMELTER_SELECTION_TEST_SECRET"}]}}
    path.write_text(yaml.safe_dump(document))
    artifacts = str(tmp_path / "artifacts")

    # The selected pipeline gets past the file checks; only the dead tracking server stops it.
    code = main(["run", "--json", "-f", str(path), "--artifacts", artifacts, "--pipeline", "good"])
    captured = capsys.readouterr()
    assert code == 2 and "MLFLOW_TRACKING_URI" in captured.err and "does not answer" in captured.err
    assert "warning:" in captured.err and "pipelines.broken.model.path" in captured.err
    assert "SMELTER_SELECTION_TEST_SECRET is not set" in captured.err

    assert main(["run", "-f", str(path), "--artifacts", artifacts]) == 2
    assert "error:" in capsys.readouterr().err
