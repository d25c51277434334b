"""What a run says it decided, wherever a user looks: the Prefect UI's task states and flow run message,
the MLflow runs and registry, and the last lines `smelter run` prints. One real run of a tiny encoder
(fp32 passes, int8 misses a strict accuracy gate), read back through the servers' APIs."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient

from flows.cli import main
from tests.fixtures.models import write_pipelines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory: pytest.TempPathFactory, tiny_bert_dir: Path, mlflow_server: str,
               prefect_server: None) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("judged")
    name = f"judged-{uuid.uuid4().hex[:6]}"
    path = write_pipelines(root, tiny_bert_dir, "feature-extraction", precisions=["fp32", "int8"], name=name,
                           accuracy={"gates": {"max_abs_error": {"max": 1e-4}}},
                           performance={"gates": {"speedup_vs_reference": {"min": 0.01}}, "objective": "throughput"})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", "-f", str(path), "--artifacts", str(root / "artifacts")])
    return {"name": name, "code": code, "stdout": out.getvalue()}


def _flow_run(name: str) -> Any:
    """The pipeline's flow run, named `<pipeline>: <counts>` when it ended (flows/prefect_outcome.py)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name)))
        (run,) = [run for run in runs if run.name.split(": ")[0] == name]
        return run


def _outermost(flow_run: Any) -> Any:
    """The flow run a user started (`smelter run`: the nightly flow), above the pipeline's subflow run."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while flow_run.parent_task_run_id is not None:
            flow_run = client.read_flow_run(client.read_task_run(flow_run.parent_task_run_id).flow_run_id)
    return flow_run


def _task_runs(flow_run_id: Any, named: tuple[str, ...] = (), wait_s: float = 30) -> list[Any]:
    """The flow run's task runs, read again until those `named` are among them (Prefect records task runs from
    events, so the last ones may reach the server a moment after the run returns)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + wait_s
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         limit=200)
        if set(named) <= {run.name for run in runs} or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def _flow_run_logs(flow_run_id: Any, until: str, wait_s: float = 30) -> list[str]:
    """The flow run's stored log lines, read again until `until` is among them (Prefect's log worker sends
    them in batches, so the last ones may reach the server a moment after the run returns)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + wait_s
    while True:
        messages: list[str] = []
        with get_client(sync_client=True) as client:
            while page := client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                           limit=200, offset=len(messages)):
                messages += [log.message for log in page]
        if until in messages or time.monotonic() > deadline:
            return messages
        time.sleep(0.5)


def _runs(name: str) -> dict[str, Any]:
    client = MlflowClient()
    experiment = client.get_experiment_by_name(f"smelter/{name}")
    return {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}


def test_prefect_shows_what_each_candidate_ended_as(judged_run: dict[str, Any]) -> None:
    name = judged_run["name"]
    assert judged_run["code"] == 0, judged_run["stdout"]
    flow_run = _flow_run(name)
    assert flow_run.state.is_completed()
    assert flow_run.state.message == "1 promoted, 1 rejected, 0 pending, 0 failed"
    tasks = {run.name: run for run in _task_runs(flow_run.id, named=(f"{name}/fp32/cpu", f"{name}/int8/cpu"))}
    assert flow_run.name == f"{name}: 1 promoted, 1 rejected", "the run's header and the runs list say the outcome"
    assert tasks[f"{name}/fp32/cpu"].state.name == "Promoted" and tasks[f"{name}/fp32/cpu"].state.is_completed()
    rejected = tasks[f"{name}/int8/cpu"].state
    assert rejected.name == "Rejected" and rejected.is_cancelled(), "grey in the UI: not a success, not a breakage"
    assert "max_abs_error" in tasks[f"{name}/int8/cpu"].state.message
    assert f"{name}/promote" in tasks and f"{name}/notify" in tasks
    unnamed = [n for n in tasks if re.search(r"-[0-9a-f]{3}$", n)]
    assert not unnamed, f"task runs named by Prefect's random suffix: {unnamed}"
    summary = f"{name}: 1 promoted, 1 rejected, 0 pending, 0 failed"
    logs = _flow_run_logs(_outermost(flow_run).id, until=summary)  # what `prefect deployment run --watch` streams
    assert any(line.startswith(f"{name}/cpu benchmark: done") for line in logs), logs
    assert summary in logs


def test_mlflow_holds_the_summary_figure_rounded_metrics_and_a_readable_outbox(judged_run: dict[str, Any]) -> None:
    name = judged_run["name"]
    runs = _runs(name)
    client = MlflowClient()
    parent = next(run for run_name, run in runs.items() if "/" not in run_name)
    assert "summary.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    promoted = runs[f"{name}/fp32/cpu"]
    card = Path(mlflow.artifacts.download_artifacts(f"runs:/{promoted.info.run_id}/engine_card.html"))
    assert "<img" in card.read_text() and "data:image/png;base64," in card.read_text()
    assert "summary.png" in mlflow.artifacts.load_text(f"runs:/{promoted.info.run_id}/engine_card.md")
    for key, value in promoted.data.metrics.items():
        digits = 6 if key.startswith("accuracy.") or key == "_max_abs_error" else 4
        assert value == int(value) or value == float(f"{value:.{digits}g}"), f"{key} = {value!r}: more digits than it means (whole numbers stay whole)"
    (version,) = client.search_model_versions(f"name='{name}-cpu' and run_id='{promoted.info.run_id}'")
    assert version.tags["smelter.events.status"] == "1 event(s): no webhooks"
    outbox = json.loads(mlflow.artifacts.load_text(
        f"runs:/{promoted.info.run_id}/outbox/{name}-cpu-v{version.version}.json"))
    assert outbox == json.loads(version.tags["smelter.events"])


def test_the_terminal_ends_with_the_run_in_mlflow_and_what_to_do_next(judged_run: dict[str, Any]) -> None:
    name = judged_run["name"]
    lines = judged_run["stdout"].splitlines()
    parent = next(run for run_name, run in _runs(name).items() if "/" not in run_name)
    link = next(line for line in lines if line.startswith("MLflow:"))
    assert f"/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}" in link
    assert link.split()[2].startswith(mlflow.get_tracking_uri())
    assert lines[-1] == f"Next: deploy models:/{name}-cpu@champion; an unchanged re-run is cached and moves nothing"


def test_a_webhook_delivery_left_pending_is_said_in_the_flow_runs_message() -> None:
    """The flow run's message, what Prefect shows of a run's end, counts the deliveries a webhook did not take
    (they go out with the next run or `smelter notify --retry`); each delivery once, whichever candidates share it."""
    from flows.pipeline import flow_end

    delivery = {"delivery_id": "d-1", "status": "pending"}
    summaries = [{"status": "promoted", "events": [delivery, {"delivery_id": "d-2", "status": "delivered"}]},
                 {"status": "passed", "events": [delivery]}]
    state = flow_end("1 promoted, 0 rejected, 0 pending, 0 failed", summaries)
    assert state.is_completed()
    assert state.message == ("1 promoted, 0 rejected, 0 pending, 0 failed; 1 webhook delivery pending "
                             "(smelter notify --retry)")
    delivered = flow_end("1 promoted", [{"status": "promoted", "events": [{"delivery_id": "d-3", "status": "delivered"}]}])
    assert delivered.message == "1 promoted"
