"""The MLflow and Prefect UIs of a real run, in headless Chromium, as a person reads them: the link `smelter run`
prints opens the experiment on its runs (not the GenAI traces page); the parent run shows the summary figure and
names the gate that rejected a candidate; the runs table's outcome view, a child run and the champion's registry
version show the status on their first screen; Prefect draws a rejected candidate in a state that is not the
completed (green) one and names the flow run with its counts. Skipped, with the reason, where Chromium is not
installed (.ci/run installs Debian's `chromium`)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import time
import uuid
from pathlib import Path
from collections.abc import Iterator
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
           prefect_server: None) -> Iterator[dict[str, Any]]:
    """One run (int8 misses a strict accuracy gate and is rejected, fp32 is promoted) on the session's Prefect
    server, a lasting one to `smelter run` (PREFECT_API_URL is set); its runs shown by a real `prefect server`
    with the UI, reading the same database."""
    from prefect.settings import get_current_settings

    root = tmp_path_factory.mktemp("ui")
    name = f"ui-{uuid.uuid4().hex[:6]}"
    path = write_pipelines(root, tiny_bert_dir, "feature-extraction", precisions=["fp32", "int8"], name=name,
                           accuracy={"gates": {"max_abs_error": {"max": 1e-4}}})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "-f", str(path), "--artifacts", str(root / "artifacts")]) == 0
    link = re.search(r"^MLflow: \S+: (\S+)", out.getvalue(), flags=re.M).group(1)
    client = MlflowClient()
    runs = {r.info.run_name: r for r in client.search_runs(
        [client.get_experiment_by_name(f"smelter/{name}").experiment_id])}
    settings = get_current_settings()
    database = settings.server.database.connection_url.get_secret_value()
    with screenshots.prefect_server(None, root, database=database) as prefect_ui:
        yield {"name": name, "link": link, "runs": runs, "server": mlflow_server, "prefect": prefect_ui,
               "prefect_api": settings.api.url, "prefect_ui_url": settings.ui_url, "stdout": out.getvalue()}


def test_the_printed_link_opens_the_experiment_on_its_runs(ui_run: dict[str, Any]) -> None:
    experiment_page = re.sub(r"/runs/[0-9a-f]+", "", ui_run["link"])
    text = screenshots.page_text(screenshots.page_dom(experiment_page))
    parent = next(n for n in ui_run["runs"] if "/" not in n)
    assert parent in text, text[:2000]
    assert "Traces 0" not in text and "No data available" not in text, "the GenAI overview opened"


def test_the_parent_run_shows_the_summary_figure(ui_run: dict[str, Any]) -> None:
    figure = r'<img[^>]+alt="summary.png"[^>]+src="blob:'
    dom = screenshots.page_dom(ui_run["link"].replace("?", "/artifacts/summary.png?"), showing=figure)
    assert re.search(figure, dom), screenshots.page_text(dom)[:2000]


def test_a_child_run_says_its_status_and_why(ui_run: dict[str, Any]) -> None:
    child = ui_run["runs"][f"{ui_run['name']}/int8/cpu"]
    url = screenshots.run_url(ui_run["server"], child.info.experiment_id, child.info.run_id)
    text = screenshots.page_text(screenshots.page_dom(url))
    assert re.search(r"Description rejected ?: accuracy: max_abs_error \S+ > max 0.0001", text), text[:3000]


def test_the_parent_run_names_the_gate_that_rejected_a_candidate(ui_run: dict[str, Any]) -> None:
    """Beside the summary figure, the description's table says which bound each rejected candidate missed."""
    text = screenshots.page_text(screenshots.page_dom(ui_run["link"]))
    assert re.search(r"int8/cpu rejected \S+x max_abs_error \S+ > max 0.0001", text), text[:3000]
    assert re.search(r"fp32/cpu promoted v1 \S+x", text), text[:3000]


def test_a_three_candidate_runs_description_is_shown_whole(mlflow_server: str, tmp_path: Path) -> None:
    """The run page folds a description taller than 150 px behind "Show more" (measured as the page first lays
    out): the example pipeline's three candidates must fit (a line of counts above the table, or rows that
    wrapped before the page had its width, pushed the third row under the fold)."""
    from tasks.config.settings import RunSettings
    from tasks.registry import tracking
    from tasks.runtime.store import ArtifactStore
    from tests.fixtures.candidates import candidate_outcome, pipeline_spec

    spec = pipeline_spec(f"fold-{uuid.uuid4().hex[:6]}")
    store = ArtifactStore(tmp_path / "artifacts")
    outcomes = [candidate_outcome(store, spec, precision, "cpu", throughput=100.0, passed=False)
                for precision in ("fp32", "fp16", "int8")]
    outcomes[2].status, outcomes[2].model_version = "promoted", "1"
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        for outcome in outcomes:
            tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)
        tracking.describe_pipeline_run(parent_id, outcomes)
    url = screenshots.run_url(mlflow_server, MlflowClient().get_run(parent_id).info.experiment_id, parent_id)
    text = screenshots.page_text(screenshots.page_dom(url))
    assert "Show more" not in text, text[text.find("Description"):][:600]
    assert re.search(r"int8/cpu promoted v1 .*fp32/cpu rejected .*fp16/cpu rejected", text), "champion first"


def test_the_outcome_view_shows_status_speed_and_reason_as_columns(ui_run: dict[str, Any]) -> None:
    """The runs table in the saved view every run writes: status, reason and speedup are its first columns (on
    the first screen, beside MLflow's assistant panel), and the pipeline run's collapsed row says its counts and
    each candidate's outcome in a word."""
    parent = next(r for n, r in ui_run["runs"].items() if "/" not in n)
    url = screenshots.outcome_view_url(ui_run["server"], parent.info.experiment_id)
    text = screenshots.page_text(screenshots.page_dom(url))
    assert "smelter: outcome" in text, text[:3000]
    header = text[text.index("Run Name"):text.index(parent.info.run_name)]  # the DOM's order, not the screen's
    assert {"status", "_speedup", "decision_reason"} <= set(header.split()), header
    row = text[text.index(parent.info.run_name):]
    assert "1 promoted, 1 rejected" in row, text[:3000]
    assert "fp32/cpu promoted v1 · int8/cpu rejected: max_abs_error" in row, "the collapsed row's reason"


def test_the_champions_version_page_leads_with_status_speed_and_reason(ui_run: dict[str, Any]) -> None:
    url = screenshots.version_url(ui_run["server"], f"{ui_run['name']}-cpu", "1")
    text = screenshots.page_text(screenshots.page_dom(url))
    headline = re.search(r"promoted: holds @champion · \S+x PyTorch", text)
    assert headline, text[:3000]
    assert headline.start() < text.find("Tags"), "the status comes before the folded tags"


def test_prefect_draws_a_rejection_as_no_success_and_names_the_run_with_its_counts(ui_run: dict[str, Any]) -> None:
    """The terminal links the flow run on a lasting server; its page carries the counts in its name, and the
    rejected candidate's verdict is drawn in the cancelled (grey) style, named Rejected, not in the completed one."""
    import httpx

    link = re.search(r"^Prefect: (\S+)", ui_run["stdout"], flags=re.M)
    assert link and link.group(1).startswith(f"{ui_run['prefect_ui_url']}/runs/flow-run/"), ui_run["stdout"]
    api = ui_run["prefect_api"]
    flows = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": ui_run["name"]}}}).json()
    (pipeline_run,) = [f for f in flows if f["name"].split(": ")[0] == ui_run["name"]]
    page = screenshots.page_text(screenshots.page_dom(screenshots.flow_run_url(ui_run["prefect"], pipeline_run["id"])))
    assert f"{ui_run['name']}: 1 promoted, 1 rejected" in page, page[:2000]
    deadline = time.monotonic() + 30  # Prefect records task runs from events: the last may come a moment late
    while not (rejected := [t for t in httpx.post(f"{api}/task_runs/filter", json={
            "flow_runs": {"id": {"any_": [pipeline_run["id"]]}}}).json() if t["name"] == f"{ui_run['name']}/int8/cpu"]):
        assert time.monotonic() < deadline, "no task run for the rejected candidate"
        time.sleep(0.5)
    rejected = rejected[0]
    dom = screenshots.page_dom(screenshots.task_run_url(ui_run["prefect"], rejected["id"]))
    badge = re.search(r'class="[^"]*state-badge state--(\w+)"', dom)
    assert badge and badge.group(1) == "cancelled", badge and badge.group(0)
    assert "Rejected" in screenshots.page_text(dom[badge.start():badge.start() + 3000])
