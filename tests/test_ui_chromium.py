"""The MLflow UI of a real run, in headless Chromium: the link `smelter run` prints opens the experiment
on its runs (not the GenAI traces page), the parent run shows the summary figure, a child run's
description says its status and why. Skipped, with the reason, where Chromium is not installed
(.ci/run installs Debian's `chromium`)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from flows.cli import main
from tests.fixtures.models import write_pipelines

REPO = Path(__file__).resolve().parents[1]


def _screenshots() -> Any:
    spec = importlib.util.spec_from_file_location("screenshots", REPO / "scripts" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


screenshots = _screenshots()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(screenshots.chromium() is None,
                                 reason="Chromium is not installed (Debian: apt-get install chromium; .ci/run does)")]


@pytest.fixture(scope="module")
def ui_run(tmp_path_factory: pytest.TempPathFactory, tiny_bert_dir: Path, mlflow_server: str,
           prefect_server: None) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ui")
    name = f"ui-{uuid.uuid4().hex[:6]}"
    path = write_pipelines(root, tiny_bert_dir, "feature-extraction", precisions=["fp32", "int8"], name=name,
                           accuracy={"gates": {"max_abs_error": {"max": 1e-4}}})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "-f", str(path), "--artifacts", str(root / "artifacts")]) == 0
    link = re.search(r"^MLflow: \S+: (\S+)", out.getvalue(), flags=re.M).group(1)
    runs = {r.info.run_name: r for r in MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name(f"smelter/{name}").experiment_id])}
    return {"name": name, "link": link, "runs": runs, "server": mlflow_server}


def test_the_printed_link_opens_the_experiment_on_its_runs(ui_run: dict[str, Any]) -> None:
    experiment_page = re.sub(r"/runs/[0-9a-f]+", "", ui_run["link"])
    text = screenshots.page_text(screenshots.page_dom(experiment_page))
    parent = next(n for n in ui_run["runs"] if "/" not in n)
    assert parent in text, text[:2000]
    assert "Traces 0" not in text and "No data available" not in text, "the GenAI overview opened"


def test_the_parent_run_shows_the_summary_figure(ui_run: dict[str, Any]) -> None:
    dom = screenshots.page_dom(ui_run["link"].replace("?", "/artifacts/summary.png?"))
    assert re.search(r'<img[^>]+alt="summary.png"[^>]+src="blob:', dom), screenshots.page_text(dom)[:2000]


def test_a_child_run_says_its_status_and_why(ui_run: dict[str, Any]) -> None:
    child = ui_run["runs"][f"{ui_run['name']}/int8/cpu"]
    url = screenshots.run_url(ui_run["server"], child.info.experiment_id, child.info.run_id)
    text = screenshots.page_text(screenshots.page_dom(url))
    assert re.search(r"Description rejected ?: accuracy: max_abs_error \S+ > max 0.0001", text), text[:3000]
