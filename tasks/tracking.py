"""Everything smelter records in MLflow: runs per pipeline and candidate, and the model registry.

The only module that imports mlflow, so metric, tag and artifact names are decided in one place
and stay the same every run (the MLflow compare view lines up only when names never drift).
MLflow's own configuration applies: MLFLOW_TRACKING_URI when set, else MLflow's default store.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import html
import json
import math
import os
import platform
import socket
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlflow
import numpy as np
import pandas as pd
import yaml
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.tracking.context.registry import resolve_tags
from mlflow.types import Schema, TensorSpec
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from tasks import engine_check, killpoints, locks
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome, Champion
from tasks.holder import Holder, machine_id
from tasks.redact import redacted_url
from tasks.spec import Candidate, PipelineSpec, registered_model_name
from tasks.store import MANIFEST, StageResult
from tasks.yaml_source import clip

REPORT_FILES = {"validate": ("report.json",), "accuracy": ("per_sample.csv", "three_way.json"),
                "benchmark": ("samples.csv",)}
MAX_PARAM_CHARS = 6000
HEALTH_TIMEOUT_S = 5.0
MAX_TAG_CHARS = 8000
HEADLINE_PREFIX = "_"  # sorts before every other metric name in MLflow's run table and compare view
DESCRIPTION_TAG = "mlflow.note.content"  # what the MLflow UI shows as a run's description
# MLflow 3's UI opens an experiment by its kind: without it a smelter experiment opens on GenAI traces
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
COMPARISON_COLUMNS = ["engine", "versus", "ratio", "ci_low", "ci_high", "conclusive"]  # what a decision reads
OUTCOME_RECORD = "smelter/outcome.json"  # a candidate's stage results, as the parent run rebuilds them
OWNER_TAG = "smelter.owner"  # "<host> <pid> <process start>": who may still be writing a RUNNING run
ENGINE_DIGEST_TAG = "engine_sha256"
ENGINE_IDENTITY_TAG = "engine_identity"  # a registry version's identity: `engine_identity`, its engine files' sha256
ENGINE_SIDECAR = "engine.json"  # what every backend writes beside its engine (tasks/backends: SIDECAR), build times too
ENGINE_SOURCE_TAG = "engine_source"  # the engine's copy in MLflow when the run did not upload one itself
ENGINE_CHECK_TAG = "engine_check"  # "passed", or why not: the verdict of the host that built the engine
# MLflow 3.17's UI picks an experiment's page by its GenAI / Model training switch (default GenAI: traces),
# not by the experiment's kind tag; this query selects runs, and the UI remembers it
UI_TRAINING_VIEW = "workflowType=machine_learning"
SUMMARY_FIGURE = "summary.png"  # speedup of every candidate of a run, on the parent run and each engine card
OUTBOX_TAG = "smelter.events"  # a version's promotion events (tasks/notify.py writes it)
OUTBOX_STATUS_TAG = "smelter.events.status"  # the same, in a few words
# Where a registry version's metric tags come from: when that benchmark ran, whether other processes competed
# for the CPU (and how much), its key and the run that read it. A less busy re-measurement replaces them.
MEASURED_AT, MEASURED_CONTENDED, MEASURED_CPU_SHARE = "measured_at", "measured_contended", "measured_cpu_share"
MEASURED_BENCHMARK, MEASURED_RUN = "measured_benchmark", "measured_run"
ENGINE_CARD = "engine_card.md"
_initialised: set[str] = set()


def _client() -> MlflowClient:
    """A client on a store that is ready for concurrent use (see `init_store`)."""
    init_store()
    return MlflowClient()


def init_store() -> None:
    """Create or migrate the tracking store once, under a file lock beside a SQLite database.

    Two processes opening a fresh SQLite store at once both run MLflow's schema migration and one
    dies (`duplicate column name`); the first to hold the lock migrates, the other finds it done.
    """
    uri = mlflow.get_tracking_uri()
    if uri in _initialised:
        return
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///").split("?")[0])
        with locks.file_lock(database.with_name(database.name + ".init.lock")):
            MlflowClient().search_experiments(max_results=1)
    _initialised.add(uri)


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
        return client.create_experiment(name, tags={"pipeline": pipeline, EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _model_tag(spec: PipelineSpec) -> str:
    return spec.model.id or spec.model.path or ""


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config as dotted MLflow params; lists stay whole (as JSON) so a param is one setting."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, inner in value.items():
            flat |= flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return flat
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return {prefix: text[:MAX_PARAM_CHARS]}


@contextlib.contextmanager
def pipeline_run(spec: PipelineSpec, run_name: str, params: dict[str, Any]) -> Iterator[str]:
    """One parent run per pipeline run; candidates nest under the yielded run id.

    The run is not made the thread's active run, so candidates may be logged from any thread
    (Prefect task runners) or process. It ends FINISHED, or FAILED when the body raises.
    """
    client = _client()
    close_stale_runs(spec.name)
    tags = {"model": _model_tag(spec), "pipeline": spec.name, OWNER_TAG: owner_tag()}
    run_id = client.create_run(_experiment_id(client, spec.name), run_name=run_name, tags=tags).info.run_id
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


def _arch(spec: PipelineSpec, outcome: CandidateOutcome) -> str:
    target = spec.target(outcome.candidate.target)
    if target.gpu_arch:
        return target.gpu_arch
    build = outcome.stages.get("build")
    hardware = build.outputs.get("hardware", {}) if build else {}
    host = build.manifest.get("host", {}) if build else {}
    return f"cpu-{hardware.get('machine') or host.get('machine') or platform.machine()}"


def candidate_tags(spec: PipelineSpec, outcome: CandidateOutcome) -> dict[str, str]:
    candidate = outcome.candidate
    target = spec.target(candidate.target)
    build = outcome.stages.get("build")
    tags = {
        "candidate": candidate.name, "pipeline": candidate.pipeline, "model": _model_tag(spec),
        "precision": candidate.precision, "target": candidate.target, "arch": _arch(spec, outcome),
        "backend": build.outputs.get("backend", target.backend) if build else target.backend,
        "gate": "passed" if outcome.passed_gates else "pending" if outcome.status == "passed" and not outcome.gates
        else "failed",
        "gate_reasons": "; ".join(outcome.gate_reasons), "status": outcome.status,
        "rebuilt": ",".join(name for name, stage in outcome.stages.items() if not stage.cached) or "none",
    }
    if build:
        tags |= {"backend_version": str(build.outputs.get("backend_version", "")), "cache_key": build.key}
    if (benchmark := outcome.stages.get("benchmark")) and (host := benchmark.outputs.get("host")):
        tags |= {"bench.cpu": str(host.get("cpu")), "bench.contended": str(host.get("contended")).lower(),
                 "bench.load": f"{host.get('load_start')} -> {host.get('load_end')}",
                 "bench.foreign_cpu_share": str(host.get("foreign_cpu_share"))}
    if outcome.error:
        tags |= {"error": outcome.error, "failed_stage": outcome.failed_stage or ""}
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


def candidate_params(spec: PipelineSpec, outcome: CandidateOutcome) -> dict[str, str]:
    """Precision and target config: what differs between sibling candidates in the compare view."""
    precision: dict[str, Any] = {"name": outcome.candidate.precision}
    if outcome.candidate.precision == "int8":
        precision |= {"quantization": spec.quantization.model_dump(mode="json")}
    if spec.calibrated(outcome.candidate):
        precision |= {"calibration": spec.calibration.model_dump(mode="json")}
    target = spec.target(outcome.candidate.target).model_dump(mode="json")
    return flatten({"precision": precision, "target": target})


def log_candidate(parent_run_id: str, spec: PipelineSpec, outcome: CandidateOutcome,
                  extra_tags: dict[str, str] | None = None) -> str:
    """A child run holding everything known about one candidate, even when it failed midway.

    Returns the child run id. The run ends FAILED for a failed candidate so the UI shows it red.
    `extra_tags` say where it was built (host, pool, flow run). The run also holds the candidate's
    stage results (OUTCOME_RECORD), so the parent can judge it from MLflow alone (`candidate_outcomes`).
    """
    client = _client()
    metrics = stage_metrics(outcome.stages)
    tags = resolve_tags(candidate_tags(spec, outcome) | (extra_tags or {})
                        | {MLFLOW_PARENT_RUN_ID: parent_run_id, OWNER_TAG: owner_tag(),
                           DESCRIPTION_TAG: candidate_description(outcome)})
    created = client.create_run(_experiment_id(client, spec.name), start_time=_work_started_ms(outcome),
                                tags=tags, run_name=outcome.candidate.name)
    run = mlflow.start_run(run_id=created.info.run_id, nested=True)
    status = "FAILED"
    try:
        mlflow.log_params(candidate_params(spec, outcome))
        mlflow.log_metrics(rounded(metrics | headline_metrics(spec, metrics) | stage_seconds(outcome.stages)))
        _log_engine(spec, outcome)
        _log_stage_files(outcome.stages)
        _log_tables(outcome.stages)
        if (benchmark := outcome.stages.get("benchmark")) and benchmark.file("latency.png").is_file():
            mlflow.log_artifact(str(benchmark.file("latency.png")), "plots")
        mlflow.log_text(engine_card(spec, outcome, metrics), "engine_card.md")  # rewritten by finish_candidate
        _log_datasets(spec, outcome)
        mlflow.log_dict(outcome_record(outcome), OUTCOME_RECORD)
        killpoints.reach("candidate.logged")
        status = "FAILED" if outcome.status == "failed" else "FINISHED"
    except BaseException as e:
        status = _ended_by(e)
        raise
    finally:
        mlflow.end_run(status)
    return run.info.run_id


def _log_engine(spec: PipelineSpec, outcome: CandidateOutcome) -> None:
    """Upload the engine unless MLflow already holds this exact one: nightly re-runs add no copies.

    Held already: by a registry version of these very bytes, or by an earlier run of this
    pipeline that uploaded these very files (a rejected engine re-judged every night); the run then
    names that copy in its `engine_source` tag. The files must match their build manifest's sha256
    first (a file that rotted in the cache is never uploaded: EngineRejected fails the candidate);
    the digest of what was uploaded is tagged on the run, and registration checks the files against
    it again.
    """
    build = outcome.stages.get("build")
    if build is None:
        return
    name = registered_model_name(spec.name, outcome.candidate.target)
    holder = versions_of_engine(name, engine_identity(build), build.key) if build.cached else []
    if holder:
        mlflow.set_tag(ENGINE_SOURCE_TAG, f"models:/{name}/{holder[0].version}")
        return
    digest = engine_check.engine_digest(build, engine_check.verify_files(build))
    earlier = _earlier_upload(spec.name, build.key, digest) if build.cached else None
    if earlier:
        mlflow.set_tags({ENGINE_SOURCE_TAG: f"runs:/{earlier}/engine", ENGINE_DIGEST_TAG: digest})
        return
    run_id = mlflow.active_run().info.run_id
    _upload_engine(run_id, build.path, outcome.stages)
    if engine_check.engine_digest(build) != digest:
        raise engine_check.EngineRejected(f"{build.path}: the engine's files changed while they were uploaded")
    mlflow.set_tag(ENGINE_DIGEST_TAG, digest)


def _upload_engine(run_id: str, files: Path, stages: dict[str, StageResult]) -> None:
    """The engine's files as the run's `engine` artifacts, with an MLmodel file naming its signature."""
    client = _client()
    for index, path in enumerate(sorted(p for p in files.rglob("*") if p.is_file() and p.name != "MLmodel")):
        if index == 1:
            killpoints.reach("upload")
        folder = path.parent.relative_to(files).as_posix()
        client.log_artifact(run_id, str(path), "engine" if folder == "." else f"engine/{folder}")
    if (signature := engine_signature(stages)) is not None:
        client.log_text(run_id, _mlmodel(signature, run_id), "engine/MLmodel")


def hold_engine_files(outcome: CandidateOutcome, work_dir: Path) -> None:
    """Upload the engine into the candidate's own run when that run only names an earlier run's copy.

    MLflow accepts a version's source only inside the version's run, and the version must point at
    the run that judged it. So the one upload a rejected engine's later runs skipped is made when
    one of them is about to be registered: from the build here, else from that copy, checked
    against the digest it was uploaded with.
    """
    client = _client()
    tags = client.get_run(outcome.run_id).data.tags
    if not tags.get(ENGINE_SOURCE_TAG, "").startswith("runs:/"):
        return
    build = outcome.stages["build"]
    files = engine_dir(outcome, work_dir)
    if engine_check.engine_digest(dataclasses.replace(build, path=files)) != tags.get(ENGINE_DIGEST_TAG):
        raise engine_check.EngineRejected(f"{tags[ENGINE_SOURCE_TAG]}: the engine's files differ from the digest "
                                          "recorded when they were uploaded")
    _upload_engine(outcome.run_id, files, outcome.stages)
    client.delete_tag(outcome.run_id, ENGINE_SOURCE_TAG)


def _earlier_upload(pipeline: str, build_key: str, digest: str) -> str | None:
    """The oldest finished run of this pipeline that uploaded the engine files with this digest itself."""
    client = _client()
    experiment = client.get_experiment_by_name(experiment_name(pipeline))
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], max_results=50, order_by=["attributes.start_time ASC"],
                              filter_string=f"tags.cache_key = '{build_key}' AND tags.{ENGINE_DIGEST_TAG} = "
                                            f"'{digest}' AND attributes.status = 'FINISHED'")
    return next((r.info.run_id for r in runs if ENGINE_SOURCE_TAG not in r.data.tags), None)


def engine_source(run_id: str) -> str:
    """Where a candidate run's engine files are in MLflow: its own `engine` artifacts, or the copy it names."""
    return _client().get_run(run_id).data.tags.get(ENGINE_SOURCE_TAG) or f"runs:/{run_id}/engine"


def record_engine_check(run_id: str, verdict: str) -> None:
    _client().set_tag(run_id, ENGINE_CHECK_TAG, verdict[:500])


def engine_check_verdict(run_id: str) -> str | None:
    """What the host that built this run's engine found when it checked it (None: not checked there)."""
    return _client().get_run(run_id).data.tags.get(ENGINE_CHECK_TAG)


def uploaded_engine_digest(run_id: str) -> str | None:
    """The sha256 `_log_engine` recorded for the engine it uploaded to this run, if it uploaded one."""
    return _client().get_run(run_id).data.tags.get(ENGINE_DIGEST_TAG)


def _log_stage_files(stages: dict[str, StageResult]) -> None:
    for name, stage in stages.items():
        if name == "build":
            continue
        for file in (MANIFEST, *REPORT_FILES.get(name, ())):
            if stage.file(file).is_file():
                mlflow.log_artifact(str(stage.file(file)), f"stages/{name}")


def _log_tables(stages: dict[str, StageResult]) -> None:
    accuracy, benchmark = stages.get("accuracy"), stages.get("benchmark")
    if accuracy and accuracy.file("per_sample.csv").is_file():
        mlflow.log_table(pd.read_csv(accuracy.file("per_sample.csv")), "tables/accuracy_per_sample.json")
    if benchmark and benchmark.outputs.get("points"):
        mlflow.log_table(pd.DataFrame(benchmark.outputs["points"]), "tables/benchmark_points.json")
    if benchmark and benchmark.outputs.get("decode"):
        mlflow.log_table(pd.DataFrame(benchmark.outputs["decode"]), "tables/benchmark_decode.json")
    if benchmark and benchmark.file("samples.csv").is_file():
        mlflow.log_table(pd.read_csv(benchmark.file("samples.csv")), "tables/benchmark_samples.json")
    if benchmark and benchmark.outputs.get("comparisons"):
        table = pd.DataFrame(benchmark.outputs["comparisons"])
        first = [c for c in COMPARISON_COLUMNS if c in table.columns]
        mlflow.log_table(table[first + [c for c in table.columns if c not in first]], "tables/comparisons.json")


def engine_card(spec: PipelineSpec, outcome: CandidateOutcome, metrics: dict[str, float],
                figure: str | None = None) -> str:
    """A one-page summary someone deciding on a deploy reads before anything else; `figure`: the image
    (a path or a data: URI) of the run's summary figure, shown under the verdict."""
    tags = candidate_tags(spec, outcome)
    lines = [f"# {outcome.candidate.name}", "",
             f"Status: **{outcome.status}**, gates {tags['gate']}", "", f"Why: {outcome.reason}", ""]
    if figure:
        lines += [f"![every candidate of this run: speedup vs PyTorch, gate, champion]({figure})", ""]
    if outcome.model_version:
        lines += [f"Registry: `{outcome.model_name}` version {outcome.model_version}", ""]
    if outcome.error:
        lines += [f"Error in stage `{outcome.failed_stage}`: {outcome.error}", ""]
    lines += ["## Gates", "", "| gate | passed | reasons |", "|---|---|---|"]
    lines += [f"| {g.gate} | {'yes' if g.passed else 'no'} | {'; '.join(g.reasons)} |" for g in outcome.gates]
    lines += ["", *metrics_section(key_metrics(metrics), measurement(outcome))]
    lines += ["", "## Identity", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {tags[k]} |" for k in ("model", "precision", "target", "arch", "backend",
                                               "backend_version", "cache_key") if k in tags]
    lines += [f"| stage {name} | {stage.key} |" for name, stage in outcome.stages.items()]
    return "\n".join(lines) + "\n"


def measurement(outcome: CandidateOutcome) -> dict[str, str]:
    """When and how the candidate's figures were measured (MEASURED_* tags): what a registry version's metric
    tags and engine card are dated with; empty when it was not benchmarked."""
    benchmark = outcome.stages.get("benchmark")
    if benchmark is None:
        return {}
    host = benchmark.outputs.get("host") or {}
    created, share = benchmark.manifest.get("created_unix"), host.get("foreign_cpu_share")
    return {MEASURED_AT: datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds") if created else "",
            MEASURED_CONTENDED: str(bool(host.get("contended"))).lower(),
            MEASURED_CPU_SHARE: "" if share is None else f"{share:.3g}",
            MEASURED_BENCHMARK: benchmark.key, MEASURED_RUN: outcome.run_id or ""}


def measured_sentence(measured: dict[str, str]) -> str:
    """One line a reader of the registry dates the figures by."""
    share = measured.get(MEASURED_CPU_SHARE)
    busy = f" (other processes used {float(share):.0%} of the CPU)" if share else ""
    machine = "a busy machine: contended" if measured.get(MEASURED_CONTENDED) == "true" else "a quiet machine"
    run = f", read by run {measured[MEASURED_RUN]}" if measured.get(MEASURED_RUN) else ""
    return (f"Measured {measured.get(MEASURED_AT) or 'at an unknown time'} on {machine}{busy}; "
            f"benchmark {measured.get(MEASURED_BENCHMARK, '?')}{run}.")


def metrics_section(metrics: dict[str, float], measured: dict[str, str]) -> list[str]:
    """The engine card's key metrics, dated: the part a re-measurement rewrites on a registered version's card."""
    lines = ["## Key metrics", ""] + ([measured_sentence(measured), ""] if measured else [])
    return lines + ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())]


def replace_card_metrics(run_id: str, section: list[str]) -> str | None:
    """Put `section` in place of the key metrics of the run's engine card; returns the card as it was, or None
    (and changes nothing) when the run has no card with that section."""
    try:
        before = mlflow.artifacts.load_text(f"runs:/{run_id}/{ENGINE_CARD}")
    except (MlflowException, OSError):
        return None
    start = before.find("\n## Key metrics\n")
    if start < 0:
        return None
    end = before.find("\n## ", start + 1)
    _client().log_text(run_id, before[:start + 1] + "\n".join(section) + "\n" + (before[end:] if end >= 0 else ""),
                       ENGINE_CARD)
    return before


def restore_card(run_id: str, text: str) -> None:
    _client().log_text(run_id, text, ENGINE_CARD)


def _log_datasets(spec: PipelineSpec, outcome: CandidateOutcome) -> None:
    """The real text this engine was calibrated and judged on, so a data change shows in the UI."""
    uses = [("evaluation", spec.accuracy.data, spec.accuracy.samples)]
    if spec.calibrated(outcome.candidate):
        uses.append(("calibration", spec.calibration.data, spec.calibration.samples))
    for context, data, samples in uses:
        path = spec.resolve(data)
        if not path.is_file():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()][:samples]
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and says so on every call
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            dataset = mlflow.data.from_pandas(pd.DataFrame({"text": lines}), source=str(path), name=path.name)
        mlflow.log_input(dataset, context=context)


def finish_candidate(run_id: str, spec: PipelineSpec, outcome: CandidateOutcome, figure: bytes | None = None) -> None:
    """Record what was decided on the candidate's run: final status, the reason, the engine card (as
    markdown, and as HTML with the run's summary figure `figure` inside, which the UI shows as a page)."""
    tags = {"status": outcome.status, "decision_reason": outcome.reason[:MAX_TAG_CHARS],
            DESCRIPTION_TAG: candidate_description(outcome)}
    if outcome.model_name:
        tags |= {"registered_model": outcome.model_name, "model_version": str(outcome.model_version)}
    client = _client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    metrics = stage_metrics(outcome.stages)
    client.log_text(run_id, engine_card(spec, outcome, metrics, SUMMARY_FIGURE if figure else None),
                    "engine_card.md")
    if figure:
        _log_bytes(client, run_id, figure, SUMMARY_FIGURE)
        embedded = f"data:image/png;base64,{base64.b64encode(figure).decode()}"
        client.log_text(run_id, _html(outcome.candidate.name, engine_card(spec, outcome, metrics, embedded)),
                        "engine_card.html")


def _log_bytes(client: MlflowClient, run_id: str, data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="smelter-artifact-") as tmp:
        (Path(tmp) / name).write_bytes(data)
        client.log_artifact(run_id, str(Path(tmp) / name))


def _html(title: str, markdown: str) -> str:
    """A markdown card as a page the MLflow UI shows as such (it shows .md files as text)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(markdown)
    style = ("body{font-family:sans-serif;max-width:60em;margin:1em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{body}</body></html>")


def log_summary_figure(parent_run_id: str, figure: bytes) -> None:
    """The run's summary figure (tasks/summary_figure.py) on the parent run, where the decision is read."""
    _log_bytes(_client(), parent_run_id, figure, SUMMARY_FIGURE)


def rounded(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics as MLflow shows them: 4 significant digits, more than any timing here resolves (17 digits
    in the UI only hide the number); accuracy keeps 6, so a cosine of 0.99996 does not read as 1; whole
    numbers (bytes, counts) stay whole."""
    speed = {f"{HEADLINE_PREFIX}{short}" for short in ("speedup", "throughput", "p99_ms", "engine_mb")}

    def digits(name: str) -> int:  # the headline copies of accuracy metrics are `_<metric>`
        return 6 if name.startswith("accuracy.") or name.startswith(HEADLINE_PREFIX) and name not in speed else 4

    return {k: v if not math.isfinite(v) or v == int(v) else float(f"{v:.{digits(k)}g}") for k, v in metrics.items()}


def show_outbox(registered_model: str, version: str) -> None:
    """The version's outbox (`smelter.events`, a JSON list the notifier owns) as people read it: a short
    `smelter.events.status` tag ("delivered 2, pending 1") on the version, the JSON as an artifact of
    its run (`outbox/<model>-v<version>.json`)."""
    client = _client()
    found = client.get_model_version(registered_model, version)
    if OUTBOX_TAG not in found.tags:
        return
    events = json.loads(found.tags[OUTBOX_TAG])
    counts: dict[str, int] = {}
    for event in events:
        for delivery in event.get("deliveries", []):
            counts[delivery["status"]] = counts.get(delivery["status"], 0) + 1
    status = ", ".join(f"{status} {n}" for status, n in sorted(counts.items())) or "no webhooks"
    client.set_model_version_tag(registered_model, version, OUTBOX_STATUS_TAG,
                                 f"{len(events)} event(s): {status}")
    if found.run_id:
        client.log_text(found.run_id, json.dumps(events, indent=2, sort_keys=True),
                        f"outbox/{registered_model}-v{version}.json")


def candidate_description(outcome: CandidateOutcome) -> str:
    """The child run's description in the MLflow UI: its status and why, the first thing a reader wants."""
    text = f"**{outcome.status}**" + (f": {outcome.reason}" if outcome.reason else "")
    if outcome.model_version:
        text += f"\n\nRegistered as `{outcome.model_name}` version {outcome.model_version}."
    return text[:MAX_TAG_CHARS]


def champion(spec: PipelineSpec, target_name: str) -> Champion | None:
    """The version holding the promotion alias for (pipeline, target), or None."""
    name = registered_model_name(spec.name, target_name)
    try:
        found = _client().get_model_version_by_alias(name, spec.promotion.alias)
    except MlflowException as e:
        if _alias_missing(e):
            return None
        raise
    return as_champion(name, found)


def as_champion(name: str, found: Any) -> Champion:
    """A registered version (MLflow's, or a RegisteredVersion) as the engine record benchmarks fetch and time."""
    return Champion(registered_model=name, version=str(found.version), run_id=found.run_id,
                    build_key=found.tags.get("cache_key") or None, precision=found.tags.get("precision"),
                    engine_identity=found.tags.get(ENGINE_IDENTITY_TAG) or None)


def previous_version(spec: PipelineSpec, target_name: str, precision: str, build_key: str | None) -> dict[str, Any] | None:
    """The newest registered version of the same (pipeline, precision, target) built from another key, with
    its run's metrics: what the accuracy regression gate compares with."""
    name = registered_model_name(spec.name, target_name)
    try:
        versions = find_versions(name, {"precision": precision})
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    others = [v for v in versions if v.tags.get("cache_key") != build_key]
    if not others:
        return None
    newest = others[-1]
    return {"version": newest.version, "metrics": dict(_client().get_run(newest.run_id).data.metrics)}


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str
    tags: dict[str, str]


def _version(found) -> RegisteredVersion:
    return RegisteredVersion(found.name, str(found.version), found.run_id, dict(found.tags))


def _alias_missing(e: MlflowException) -> bool:
    """MLflow's answer when the registered model, or only the alias, does not exist."""
    return e.error_code == "RESOURCE_DOES_NOT_EXIST" or (
        e.error_code == "INVALID_PARAMETER_VALUE" and "not found" in e.message)


@dataclass(frozen=True)
class ModelInfo:
    """A registered model's description and tags, as they were before a refresh."""

    name: str
    description: str
    tags: dict[str, str]


def ensure_registered_model(name: str, description: str, tags: dict[str, str]) -> ModelInfo | None:
    """Create the registered model or refresh its description and tags.

    Returns None when it was created, else what the refresh replaced, for `restore_registered_model`.
    """
    client = _client()
    try:
        client.create_registered_model(name, tags=tags, description=description)
        return None
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    found = client.get_registered_model(name)
    before = ModelInfo(name, found.description or "", dict(found.tags))
    client.update_registered_model(name, description=description)
    for key, value in tags.items():
        client.set_registered_model_tag(name, key, value)
    return before


def restore_registered_model(before: ModelInfo, refreshed_tags: list[str]) -> None:
    """Undo `ensure_registered_model`'s refresh: its description, and the tags it set."""
    client = _client()
    client.update_registered_model(before.name, description=before.description)
    for key in refreshed_tags:
        if key in before.tags:
            client.set_registered_model_tag(before.name, key, before.tags[key])
        else:
            client.delete_registered_model_tag(before.name, key)


def delete_registered_model(name: str) -> None:
    _client().delete_registered_model(name)


def create_version(name: str, run_id: str, tags: dict[str, str], description: str = "") -> RegisteredVersion:
    """A registry version whose files are the run's `engine` artifacts (a plain dir, not an MLflow model)."""
    created = _client().create_model_version(name, source=f"runs:/{run_id}/engine", run_id=run_id,
                                                  tags=tags, description=description)
    return _version(created)


def delete_version(name: str, version: str) -> None:
    _client().delete_model_version(name, version)


def alias_version(name: str, alias: str) -> str | None:
    """The version an alias points to, or None when the model or the alias does not exist."""
    try:
        return str(_client().get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if _alias_missing(e):
            return None
        raise


def set_alias(name: str, alias: str, version: str) -> None:
    _client().set_registered_model_alias(name, alias, version)


def delete_alias(name: str, alias: str) -> None:
    _client().delete_registered_model_alias(name, alias)


def set_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    client = _client()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)


def delete_version_tag(name: str, version: str, key: str) -> None:
    _client().delete_model_version_tag(name, version, key)


def get_version(name: str, version: str) -> RegisteredVersion:
    return _version(_client().get_model_version(name, version))


def find_versions(name: str, tags: dict[str, str]) -> list[RegisteredVersion]:
    """Versions of a registered model whose tags have these values, oldest first."""
    clauses = [f"name = '{name}'"] + [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    client, found, token = _client(), [], None
    while True:
        page = client.search_model_versions(" AND ".join(clauses), page_token=token)
        found += [_version(v) for v in page]
        token = page.token
        if not token:
            return sorted(found, key=lambda v: int(v.version))


def engine_identity(build: StageResult) -> str | None:
    """A registry version's identity: one sha256 over the engine's files as its build manifest records them (the
    hashes the upload and the check before registering verify on the bytes), less the backend's sidecar, whose
    build times differ on every rebuild; None when the manifest lists no engine file."""
    files = {name: meta for name, meta in (build.manifest.get("files") or {}).items() if name != ENGINE_SIDECAR}
    if not files:
        return None
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name].get('sha256')}\n".encode())
    return digest.hexdigest()


def versions_of_engine(name: str, identity: str | None, build_key: str | None) -> list[RegisteredVersion]:
    """The versions holding the engine with this identity, oldest first: those tagged with it, and those registered
    before versions carried one, known by their build key alone."""
    found = find_versions(name, {ENGINE_IDENTITY_TAG: identity}) if identity else []
    if build_key:
        found += [v for v in find_versions(name, {"cache_key": build_key}) if ENGINE_IDENTITY_TAG not in v.tags]
    return sorted(found, key=lambda v: int(v.version))


def version_description(name: str, version: str) -> str:
    return _client().get_model_version(name, version).description or ""


def set_version_description(name: str, version: str, description: str) -> None:
    _client().update_model_version(name, version, description=description)


def log_directory(run_id: str, local_dir: Path, artifact_path: str) -> None:
    """Attach a directory written after the run was logged (e.g. a Triton package) to that run."""
    _client().log_artifacts(run_id, str(local_dir), artifact_path)


def download_version(name: str, version: str, dest: Path) -> Path:
    """The files a registry version points to (its run's `engine` artifacts), into `dest`."""
    return Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(dest)))


def registered_model_exists(name: str) -> bool:
    try:
        _client().get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def find_version(name: str, version: str) -> RegisteredVersion | None:
    """A registry version, or None when the model or the version does not exist."""
    try:
        return get_version(name, version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def tracking_uri() -> str:
    return mlflow.get_tracking_uri()


def shown_uri(uri: str) -> str:
    """A store URI as messages show it: redacted when it may hold a password (a server, user:pass@)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redacted_url(uri)
    return redacted_url(uri) if parts.scheme in ("http", "https") or "@" in parts.netloc else clip(uri)


def store_problem() -> str | None:
    """Why the tracking store MLFLOW_TRACKING_URI names cannot be used, or None; asked before any work,
    since MLflow itself only fails at the first write (a dead server after minutes of retries)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    uri = mlflow.get_tracking_uri()
    scheme, shown = urlsplit(uri).scheme, shown_uri(uri)
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 - an unknown or malformed scheme, whichever way MLflow says it
        known = ", ".join(s for s in _tracking_store_registry._registry if s)
        return f"MLFLOW_TRACKING_URI {shown}: not a store MLflow can use; expected a path or one of {known}"
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///").split("?")[0])
        if not database.parent.is_dir():
            return f"MLFLOW_TRACKING_URI {shown}: the directory of the database, {clip(str(database.parent))}, does not exist"
        try:
            init_store()
        except Exception as e:  # noqa: BLE001 - not a database, or one MLflow cannot migrate, whichever way it says it
            first_line = next(iter(str(e).strip().splitlines()), "")
            return f"MLFLOW_TRACKING_URI {shown}: MLflow cannot open this store ({type(e).__name__}: {clip(first_line)})"
    if scheme in ("http", "https"):
        import httpx

        try:
            httpx.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            return (f"MLFLOW_TRACKING_URI {shown}: the MLflow server does not answer ({type(e).__name__}); "
                    "start it, or point the variable at one")
    return None


def run_metrics(run_id: str) -> dict[str, float]:
    return dict(_client().get_run(run_id).data.metrics)


def run_url(run_id: str) -> str:
    """Where a run opens in the MLflow UI: on the tracking server, or on `mlflow ui`'s default address
    when the client writes a store directly; in the UI's model-training view (UI_TRAINING_VIEW)."""
    experiment_id = _client().get_run(run_id).info.experiment_id
    server = urlsplit(tracking_server() or "http://127.0.0.1:5000")
    base = f"{server.scheme}://{server.netloc.rpartition('@')[2]}{server.path}".rstrip("/")  # no user:password
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{UI_TRAINING_VIEW}"


def tracking_server() -> str | None:
    """The MLflow server's URL, or None when the client writes a store directly."""
    uri = mlflow.get_tracking_uri()
    return uri if urlsplit(uri).scheme in ("http", "https") else None


@dataclass(frozen=True)
class RegistryWebhook:
    """One of MLflow's own registry webhooks (its secret is write-only: MLflow never returns it)."""

    webhook_id: str
    name: str
    url: str
    events: tuple[str, ...]
    description: str


def list_webhooks() -> list[RegistryWebhook]:
    """Every registry webhook of the MLflow server (webhooks need `mlflow server` with a SQL store)."""
    client, found, token = _client(), [], None
    while True:
        page = client.list_webhooks(page_token=token)
        found += [RegistryWebhook(w.webhook_id, w.name, w.url, tuple(str(e) for e in w.events), w.description or "")
                  for w in page]
        token = page.token
        if not token:
            return found


def create_webhook(name: str, url: str, events: list[str], secret: str, description: str) -> None:
    _client().create_webhook(name=name, url=url, events=events, secret=secret, description=description,
                                  status="ACTIVE")


def update_webhook(webhook_id: str, url: str, events: list[str], secret: str, description: str) -> None:
    _client().update_webhook(webhook_id, url=url, events=events, secret=secret, description=description,
                                  status="ACTIVE")


def delete_webhook(webhook_id: str) -> None:
    _client().delete_webhook(webhook_id)


def headline_metrics(spec: PipelineSpec, metrics: dict[str, float]) -> dict[str, float]:
    """A handful of copies named to sort first: speedup, throughput, p99, the gated accuracy, engine size."""
    picks = {"speedup": "speedup_vs_reference", "throughput": "throughput", "p99_ms": "p99_ms"}
    gated = list(spec.accuracy.gates) or sorted(k.removeprefix("accuracy.") for k in metrics
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


def _work_started_ms(outcome: CandidateOutcome) -> int | None:
    """When this run began producing the candidate's stages, so its MLflow run spans the real work;
    None (now) when everything was reused."""
    starts = [stage.manifest["created_unix"] - stage.manifest.get("seconds", 0.0)
              for stage in outcome.stages.values() if not stage.cached and "created_unix" in stage.manifest]
    return int(min(starts) * 1000) if starts else None


def engine_signature(stages: dict[str, StageResult]) -> ModelSignature | None:
    """The engine's input and output tensors (dynamic dimensions as -1), from the build manifest when
    it records them, else from the exported graph the engine was built from."""
    for name in ("build", "export"):
        stage = stages.get(name)
        if stage and stage.outputs.get("inputs") and stage.outputs.get("outputs"):
            io = stage.outputs
            break
    else:
        return None

    def schema(tensors: dict[str, Any]) -> Schema:
        return Schema([TensorSpec(np.dtype(t["dtype"]), tuple(d if isinstance(d, int) and d > 0 else -1
                                                              for d in t["shape"]), name)
                       for name, t in tensors.items()])

    return ModelSignature(inputs=schema(io["inputs"]), outputs=schema(io["outputs"]))


def _mlmodel(signature: ModelSignature, run_id: str) -> str:
    """A minimal MLmodel file: the registry's model version page reads the signature from it."""
    return yaml.safe_dump({"artifact_path": "engine", "flavors": {}, "run_id": run_id,
                           "mlflow_version": mlflow.__version__, "signature": signature.to_dict()}, sort_keys=False)


def describe_pipeline_run(parent_run_id: str, outcomes: list[CandidateOutcome]) -> None:
    """The parent run's description: what was decided for each candidate and why, and whether
    anything was rebuilt (tag `rebuilt`: an unchanged nightly says false)."""
    lines = ["| candidate | status | version | reason |", "|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.candidate.name} | {o.status} | {o.model_version or '-'} | {o.reason.replace('|', '/')} |")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("promoted", "passed", "rejected", "failed")}
    head = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no candidates"
    rebuilt = any(not stage.cached for o in outcomes for stage in o.stages.values())
    client = _client()
    client.set_tag(parent_run_id, DESCRIPTION_TAG, f"{head}.\n\n" + "\n".join(lines))
    client.set_tag(parent_run_id, "rebuilt", str(rebuilt).lower())


def outcome_record(outcome: CandidateOutcome) -> dict[str, Any]:
    """What a build hands back through MLflow: each stage's key, whether it was reused, and its manifest
    (the outputs gates, decisions and promotion read), why a damaged earlier output was replaced, plus
    how the build ended."""
    return {"candidate": outcome.candidate.model_dump(), "status": outcome.status, "error": outcome.error,
            "failed_stage": outcome.failed_stage,
            "stages": {name: {"key": s.key, "cached": s.cached, "manifest": s.manifest, "repaired": s.repaired,
                              "kept": s.kept}
                       for name, s in outcome.stages.items()}}


def candidate_outcomes(spec: PipelineSpec, parent_run_id: str, store_root: Path) -> dict[str, CandidateOutcome]:
    """Every candidate logged under a parent run, rebuilt from its MLflow run (keyed by candidate name).

    This is the join of a fanned-out build: hosts hand back run ids, never pickled objects. A stage's
    `path` is where this host's artifact store keeps that key; it exists only when the store is shared
    (see `engine_dir` for the engine itself). The newest run wins if a candidate was logged twice.
    """
    client = _client()
    runs = client.search_runs([_experiment_id(client, spec.name)],
                              filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    found: dict[str, CandidateOutcome] = {}
    for run in runs:
        outcome = candidate_outcome(run.info.run_id, store_root)
        if outcome is not None:
            found[outcome.candidate.name] = outcome
    return found


def candidate_outcome(run_id: str, store_root: Path) -> CandidateOutcome | None:
    """One candidate's outcome from its run's OUTCOME_RECORD; None for a run without one."""
    try:
        record = mlflow.artifacts.load_dict(f"runs:/{run_id}/{OUTCOME_RECORD}")
    except (MlflowException, OSError):
        return None
    candidate = Candidate(**record["candidate"])
    stages = {name: StageResult(candidate.pipeline, name, s["key"], store_root / candidate.pipeline / name / s["key"],
                                s["manifest"], cached=s["cached"], repaired=s.get("repaired"), kept=s.get("kept"))
              for name, s in record["stages"].items()}
    return CandidateOutcome(candidate, record["status"], stages=stages, error=record["error"],
                            failed_stage=record["failed_stage"], run_id=run_id)


def record_gates(run_id: str, outcome: CandidateOutcome) -> None:
    """The parent's gate verdict on a run a build logged before it was judged."""
    tags = {"gate": "passed" if outcome.passed_gates else "failed", "status": outcome.status,
            "gate_reasons": "; ".join(outcome.gate_reasons)[:MAX_TAG_CHARS]}
    client = _client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def engine_dir(outcome: CandidateOutcome, dest: Path) -> Path:
    """The candidate's engine on this host: its build directory when the store has it, else the run's
    `engine` artifacts (or the registry version it points to) downloaded into `dest`."""
    build = outcome.stages["build"]
    if build.path.is_dir():
        return build.path
    source = engine_source(outcome.run_id)
    dest.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(source, dst_path=str(dest)))
