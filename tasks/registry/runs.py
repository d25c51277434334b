"""MLflow runs: one experiment per pipeline, a parent run per pipeline run, a child run per candidate.

Tag, param and metric names are fixed here so the MLflow compare view lines up run after run; a run
left RUNNING by a process that died is closed as KILLED the next time its pipeline runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import platform
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.config.settings import RunSettings
from tasks.config.spec import PipelineSpec, TargetSpec
from tasks.outcome import STATUSES, CandidateOutcome, counted
from tasks.registry.client import _client, tracking_server, tracking_uri
from tasks.runtime import killpoints
from tasks.runtime.holder import Holder, machine_id
from tasks.runtime.redact import redacted_url
from tasks.runtime.store import StageResult
from tasks.stages.accuracy import measured_on

MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 8000
HEADLINE_PREFIX = "_"  # sorts before letters where MLflow sorts names (ASCII); the run page lists them as logged: first
DESCRIPTION_TAG = "mlflow.note.content"  # what the MLflow UI shows as a run's description
# MLflow 3's UI opens an experiment by its kind: without it a smelter experiment opens on GenAI traces
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
OWNER_TAG = "smelter.owner"  # "<host> <pid> <process start>": who may still be writing a RUNNING run
# MLflow 3.17's UI picks an experiment's page by its GenAI / Model training switch (default GenAI: traces),
# not by the experiment's kind tag; this query selects runs, and the UI remembers it
UI_TRAINING_VIEW = "workflowType=machine_learning"
# The text a candidate's accuracy was measured on (tasks/stages/accuracy.py `eval_data`): regressions compare like for like
EVAL_DATA_TAG = "eval_data"
# The stages that make an engine: the parent's `rebuilt` tag says whether any ran (a re-measurement is no rebuild)
ENGINE_STAGES = ("export", "precision", "build")
SUMMARY_FIGURE = "summary.png"  # speedup of every candidate of a run, on the parent run and each engine card


def owner_tag() -> str:
    """`host pid start machine`: the process that owns a run, as `_owner_gone` checks it."""
    me = Holder.current()
    return f"{me.host} {me.pid} {me.start} {me.machine}"


def _owner_gone(owner: str) -> bool:
    """True only when the owner ran on this host and that process no longer exists (a tag without the
    machine field, from an earlier version, counts as this host's when its host name is this one's)."""
    fields = owner.split(" ")
    if len(fields) == 3 and fields[0] == socket.gethostname():
        fields.append(machine_id())
    if len(fields) != 4 or not fields[1].isdigit():
        return False
    host, pid, start, machine = fields
    return Holder(host, machine, int(pid), start).gone()


def close_stale_runs(pipeline: str) -> list[str]:
    """Mark as KILLED this pipeline's RUNNING runs whose owning process is gone (a killed run); returns their ids."""
    client = _client()
    found = client.get_experiment_by_name(experiment_name(pipeline))
    if found is None:
        return []
    closed = []
    for run in client.search_runs([found.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000):
        if _owner_gone(run.data.tags.get(OWNER_TAG, "")):
            client.set_terminated(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    return closed


def experiment_name(pipeline: str) -> str:
    return f"smelter/{pipeline}"


def _experiment_id(client: MlflowClient, pipeline: str) -> str:
    """The pipeline's experiment, created on first use (tolerating a concurrent creator)."""
    name = experiment_name(pipeline)
    found = client.get_experiment_by_name(name)
    if found is not None:
        if EXPERIMENT_KIND_TAG not in found.tags:  # made by an older smelter
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    try:
        return client.create_experiment(name, _artifacts_beside_the_store(name),
                                        tags={"pipeline": pipeline, EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


OUTCOME_VIEW = "smelter-outcome"  # the saved view's id: the experiment tag mlflow.sharedViewState.<id>
OUTCOME_VIEW_NAME = "smelter: outcome"
SAVED_VIEW_TAG = "mlflow.sharedViewState."  # where MLflow's UI keeps a saved (and shared) runs-table view


def save_outcome_view(client: MlflowClient, experiment_id: str) -> None:
    """A saved view of the runs table, "smelter: outcome" in the Runs tab's view menu (or the experiment's
    `#/experiments/<id>/runs?viewStateShareKey=smelter-outcome`): status, the decision's reason, speedup and
    the description as the first columns (a pipeline run's counts and each candidate's outcome in a word; a
    candidate's status and why), sized so the first two fit beside MLflow's assistant panel, newest first.
    Written as MLflow 3's UI writes one: an experiment tag holding a JSON envelope around the table's state.
    MLflow keeps which rows are expanded out of a saved view (and nests a candidate under its pipeline run
    whatever the filter), so a pipeline run's candidates are one click away, on its row's +."""
    columns = ["tags.`status`", "tags.`decision_reason`", f"metrics.`{HEADLINE_PREFIX}speedup`",
               "attributes.`Description`"]
    # wide enough for a pipeline run's counts and the first candidates of its one-line outcome on the first screen
    widths = {"tags.`status`": 170, "tags.`decision_reason`": 380, f"metrics.`{HEADLINE_PREFIX}speedup`": 90}
    state = {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths,
             "orderByKey": "attributes.start_time", "orderByAsc": False}
    envelope = {"name": OUTCOME_VIEW_NAME, "createdAt": 0, "state": json.dumps(state)}
    client.set_experiment_tag(experiment_id, f"{SAVED_VIEW_TAG}{OUTCOME_VIEW}", json.dumps(envelope))


def _artifacts_beside_the_store(experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts when its store is a SQLite file outside the working
    directory (smelter run from elsewhere: flows/cli.py keeps the stores beside the pipelines file): in
    mlruns/ beside that file, not MLflow's default ./mlruns of the working directory, which would split
    the project's artifacts. None (MLflow's default) otherwise."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    beside = Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlruns"
    if beside == (Path.cwd() / "mlruns").resolve():
        return None
    return (beside / experiment.replace("/", "-")).as_uri()


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config as dotted MLflow params; lists stay whole (as JSON) so a param is one setting."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, inner in value.items():
            flat |= flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return flat
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return {prefix: text[:MAX_PARAM_CHARS]}


@contextlib.contextmanager
def pipeline_run(spec: PipelineSpec, run_name: str, params: dict[str, Any]) -> Iterator[str]:
    """One parent run per pipeline run; candidates nest under the yielded run id.

    The run is not made the thread's active run, so candidates may be logged from any thread
    (Prefect task runners) or process. It ends FINISHED, or FAILED when the body raises.
    """
    client = _client()
    close_stale_runs(spec.name)
    tags = {"model": spec.model.named, "pipeline": spec.name, OWNER_TAG: owner_tag()}
    experiment_id = _experiment_id(client, spec.name)
    run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    save_outcome_view(client, experiment_id)
    killpoints.reach("run.started")
    status = "FAILED"
    try:
        config = spec.model_dump(mode="json")
        for hook in config["promotion"]["webhooks"]:
            hook["url"] = redacted_url(hook["url"])
        flat = flatten(config) | flatten(params)
        client.log_batch(run_id, params=[Param(k, v) for k, v in flat.items()])
        yield run_id
        status = "FINISHED"
        killpoints.reach("run.finishing")
    except BaseException as e:
        status = _ended_by(e)
        raise
    finally:
        client.set_terminated(run_id, status)


def _ended_by(error: BaseException) -> str:
    """The status of a run a body left by raising: KILLED when the user stopped it (Ctrl-C, SIGTERM)."""
    return "FAILED" if isinstance(error, Exception) else "KILLED"


def _arch(target: TargetSpec, outcome: CandidateOutcome) -> str:
    if target.gpu_arch:
        return target.gpu_arch
    build = outcome.stages.get("build")
    hardware = build.outputs.get("hardware", {}) if build else {}
    host = build.manifest.get("host", {}) if build else {}
    return f"cpu-{hardware.get('machine') or host.get('machine') or platform.machine()}"


def gate_tag(outcome: CandidateOutcome) -> str:
    """A run's `gate` tag: `pending` when no verdict is in, as a build logged before it was gated, or a candidate
    timed on a busy machine (status `pending`: speed not judged); neither failed a gate."""
    if outcome.passed_gates:
        return "passed"
    return "pending" if outcome.status == "pending" or outcome.status == "passed" and not outcome.gates else "failed"


def candidate_tags(record: RunSettings, outcome: CandidateOutcome) -> dict[str, str]:
    candidate = outcome.candidate
    target = record.target(candidate.target)
    build = outcome.stages.get("build")
    tags = {  # what was decided first: the run page lists tags in the order they were first set
        "status": outcome.status, "decision_reason": outcome.reason or "not decided yet", "gate": gate_tag(outcome),
        "gate_reasons": "; ".join(outcome.gate_reasons),
        "candidate": candidate.name, "pipeline": candidate.pipeline, "model": record.model,
        "precision": candidate.precision, "target": candidate.target, "arch": _arch(target, outcome),
        "backend": build.outputs.get("backend", target.backend) if build else target.backend,
        "rebuilt": ",".join(name for name, stage in outcome.stages.items() if not stage.cached) or "none",
    }
    if build:
        tags |= {"backend_version": str(build.outputs.get("backend_version", "")), "cache_key": build.key}
    if data := measured_on(outcome.stages.get("accuracy")):
        tags[EVAL_DATA_TAG] = data
    if (benchmark := outcome.stages.get("benchmark")) and (host := benchmark.outputs.get("host")):
        tags |= {"bench.cpu": str(host.get("cpu")), "bench.contended": str(host.get("contended")).lower(),
                 "bench.load": f"{host.get('load_start')} -> {host.get('load_end')}",
                 "bench.foreign_cpu_share": str(host.get("foreign_cpu_share"))}
    if outcome.error:
        tags |= {"error": outcome.error, "failed_stage": outcome.failed_stage or ""}
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


def candidate_params(record: RunSettings, outcome: CandidateOutcome) -> dict[str, str]:
    """Precision and target config: what differs between sibling candidates in the compare view."""
    precision: dict[str, Any] = {"name": outcome.candidate.precision}
    if outcome.candidate.precision == "int8":
        precision |= {"quantization": record.quantization.model_dump(mode="json")}
    if record.calibrated(outcome.candidate):
        precision |= {"calibration": record.calibration.model_dump(mode="json")}
    target = record.target(outcome.candidate.target).model_dump(mode="json")
    return flatten({"precision": precision, "target": target})


def _log_bytes(client: MlflowClient, run_id: str, data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="smelter-artifact-") as tmp:
        (Path(tmp) / name).write_bytes(data)
        client.log_artifact(run_id, str(Path(tmp) / name))


def log_summary_figure(parent_run_id: str, figure: bytes) -> None:
    """The run's summary figure (tasks/judge/summary_figure.py) on the parent run, where the decision is read."""
    _log_bytes(_client(), parent_run_id, figure, SUMMARY_FIGURE)


def rounded(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics as MLflow shows them: 4 significant digits, more than any timing here resolves (17 digits
    in the UI only hide the number); accuracy keeps 6, so a cosine of 0.99996 does not read as 1; whole
    numbers (bytes, counts) stay whole."""
    speed = {f"{HEADLINE_PREFIX}{short}" for short in ("speedup", "throughput", "p99_ms", "engine_mb")}

    def digits(name: str) -> int:  # the headline copies of accuracy metrics are `_<metric>`
        return 6 if name.startswith("accuracy.") or name.startswith(HEADLINE_PREFIX) and name not in speed else 4

    return {k: v if not math.isfinite(v) or v == int(v) else float(f"{v:.{digits(k)}g}") for k, v in metrics.items()}


UNDECIDED = "undecided"


def before_decision(outcome: CandidateOutcome) -> dict[str, str]:
    """The status tag and description a candidate's run carries until its decision is recorded on it
    (finish_candidate): one not failed or rejected reads `undecided`, so a run stopped before deciding (an
    interrupt, the tracking server gone at promotion) leaves no candidate that reads as judged and passed."""
    if outcome.status != "passed":
        return {"status": outcome.status, DESCRIPTION_TAG: candidate_description(outcome)}
    why = "passed its gates, not decided yet" if outcome.gates else "not judged yet"
    return {"status": UNDECIDED, DESCRIPTION_TAG: f"**{UNDECIDED}**: {why} (a run stopped before deciding leaves it so)"}


def candidate_description(outcome: CandidateOutcome) -> str:
    """The child run's description in the MLflow UI: its status and why, the first thing a reader wants."""
    text = f"**{outcome.status}**" + (f": {outcome.reason}" if outcome.reason else "")
    if outcome.model_version:
        text += f"\n\nRegistered as `{outcome.model_name}` version {outcome.model_version}."
    return text[:MAX_TAG_CHARS]


def log_directory(run_id: str, local_dir: Path, artifact_path: str) -> None:
    """Attach a directory written after the run was logged (e.g. a Triton package) to that run."""
    _client().log_artifacts(run_id, str(local_dir), artifact_path)


def run_metrics(run_id: str) -> dict[str, float]:
    return dict(_client().get_run(run_id).data.metrics)


LOCAL_UI_PORT = 5000  # `mlflow ui`'s default


@functools.cache
def local_ui_port() -> int:
    """The port `mlflow ui` is told to use when the client writes a store directly: its default when free
    here, else a free one (another program on 5000 would answer the links). One per process, so every link
    and the printed command agree."""
    for port in (LOCAL_UI_PORT, 0):
        with contextlib.suppress(OSError), socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
            return probe.getsockname()[1]
    return LOCAL_UI_PORT


def run_url(run_id: str) -> str:
    """Where a run opens in the MLflow UI: on the tracking server, or on the address `mlflow ui` is told to use
    (`local_ui_port`) when the client writes a store directly; in the UI's model-training view (UI_TRAINING_VIEW)."""
    experiment_id = _client().get_run(run_id).info.experiment_id
    return f"{_ui_base()}/#/experiments/{experiment_id}/runs/{run_id}?{UI_TRAINING_VIEW}"


def _ui_base() -> str:
    server = urlsplit(tracking_server() or f"http://127.0.0.1:{local_ui_port()}")
    return f"{server.scheme}://{server.netloc.rpartition('@')[2]}{server.path}".rstrip("/")  # no user:password


def headline_metrics(gated_accuracy: Sequence[str], metrics: dict[str, float]) -> dict[str, float]:
    """A handful of copies named to sort first: speedup, throughput, p99, the gated accuracy, engine size."""
    picks = {"speedup": "speedup_vs_reference", "throughput": "throughput", "p99_ms": "p99_ms"}
    gated = list(gated_accuracy) or sorted(k.removeprefix("accuracy.") for k in metrics
                                                if k.startswith("accuracy."))[:1]
    picks |= {name: f"accuracy.{name}" for name in gated}
    headline = {f"{HEADLINE_PREFIX}{short}": metrics[name] for short, name in picks.items() if name in metrics}
    if "engine_bytes" in metrics:
        headline[f"{HEADLINE_PREFIX}engine_mb"] = metrics["engine_bytes"] / 1e6
    return headline


def stage_seconds(stages: dict[str, StageResult]) -> dict[str, float]:
    """Seconds this run spent in each stage: what producing it took, or 0 for a reused output."""
    return {f"stage_seconds.{name}": 0.0 if stage.cached else float(stage.manifest.get("seconds", 0.0))
            for name, stage in stages.items()}


def describe_pipeline_run(parent_run_id: str, outcomes: list[CandidateOutcome]) -> None:
    """What a pipeline run's page and its row in the runs table say first. Its description is one short row per
    candidate (status and version, speed, why in a few words), champion first; the run page folds a description
    taller than 150 px behind "Show more", which fits a header and four narrow rows, not a line of counts above
    them: the counts are its `status` tag, and its `decision_reason` tag is every candidate's outcome on one
    line, which the runs table shows on the run's row collapsed. Each candidate's full reason is its own run's
    description. Tag `rebuilt`: whether anything was rebuilt (an unchanged nightly: false)."""
    ranked = _champion_first(outcomes)
    lines = ["| candidate | status | speedup | why |", "|---|---|---|---|"]
    for o in ranked:  # narrow: a row that wraps while the page lays out folds the table for good
        speedup = o.metrics.get("speedup_vs_reference")
        shown = f"{speedup:.3g}x" if speedup is not None and math.isfinite(speedup) else "-"
        version = f" v{o.model_version}" if o.model_version else ""
        why = short_reason(o).replace("|", "/")
        lines.append(f"| {_short_name(o)} | **{o.status}**{version} | {shown} | {why} |")
    rebuilt = any(not stage.cached for o in outcomes for name, stage in o.stages.items() if name in ENGINE_STAGES)
    client = _client()
    client.set_tag(parent_run_id, DESCRIPTION_TAG, "\n".join(lines) if outcomes else "no candidates")
    client.set_tag(parent_run_id, "rebuilt", str(rebuilt).lower())
    client.set_tag(parent_run_id, "status", counted(o.status for o in outcomes))
    client.set_tag(parent_run_id, "decision_reason", outcome_line(ranked)[:MAX_TAG_CHARS])


def _champion_first(outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    """Promoted, passed, rejected, pending, failed; the file's order within each."""
    rank = {status: i for i, status in enumerate(STATUSES)}
    return sorted(outcomes, key=lambda o: rank.get(o.status, len(rank)))


def _short_name(outcome: CandidateOutcome) -> str:
    """`int8/cpu`: a candidate within its pipeline's run."""
    return f"{outcome.candidate.precision}/{outcome.candidate.target}"


def outcome_line(outcomes: list[CandidateOutcome]) -> str:
    """Candidates' outcomes on one line, in the order given, in a word each, as the summary figure labels its
    bars: `int8/cpu promoted v3 · fp32/cpu rejected: p99_ms · fp16/cpu failed: build`. The runs table shows a
    cell's first fifty-odd characters beside MLflow's assistant panel."""
    def part(o: CandidateOutcome) -> str:
        said = f"{_short_name(o)} {o.status}"
        if o.status in ("promoted", "passed"):
            return f"{said} v{o.model_version}" if o.model_version else said
        if o.status == "rejected":
            return f"{said}: {', '.join(o.missed_gates) or 'gates'}"
        if o.status == "failed":
            return f"{said}: {o.failed_stage or 'error'}"
        return f"{said}: machine busy" if o.status == "pending" else said
    return " · ".join(part(o) for o in outcomes) or "no candidates"


SHORT_REASON = 60  # characters of a row's why: a table row stays one line on the run page


def short_reason(outcome: CandidateOutcome) -> str:
    """A few words of why: the bounds a rejected candidate missed (`p99_ms 106.9 > max 50`), the stage that
    failed, a busy machine, else the decision's reason cut short."""
    if outcome.status == "rejected":
        missed = [reason.split(" (")[0] for gate in outcome.gates if not gate.passed and not gate.inconclusive
                  for reason in gate.reasons]
        text = "; ".join(missed) or outcome.reason
    elif outcome.status == "failed":  # the error itself, under the stage that raised it
        stage, text = outcome.failed_stage, outcome.reason
        if stage and not text.startswith(stage):
            text = f"{stage}: {text}"
    elif outcome.status == "pending":
        text = "machine busy: speed not judged"
    else:
        text = outcome.reason.split(" (")[0]
    return text if len(text) <= SHORT_REASON else text[:SHORT_REASON - 1].rstrip() + "…"
