"""`smelter`: run, plan, validate, notify and deploy from the command line.

Exit codes: 0 every stage ran (a candidate a gate rejected is a result, not an error);
1 a stage failed, or a server stopped answering mid-run; 2 an invalid pipelines.yaml, bad usage or an
unusable store or server; 130 / 143 stopped by Ctrl-C / SIGTERM (also when the signal's exception was lost).
"""

from __future__ import annotations

from flows.early_stop import STOPPED  # first: a stop while the rest loads ends as a stop, not a traceback
import argparse
import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tasks.runtime import collector, quiet_neighbours, stop_signals

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM  # what a shell reports for them
DEFAULT_FILE = "pipelines.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smelter", description="Build, validate, benchmark and promote inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_file(p: argparse.ArgumentParser, *, select: bool = True) -> argparse.ArgumentParser:
        p.add_argument("-f", "--file", default=DEFAULT_FILE, help="pipelines file (default: %(default)s)")
        p.add_argument("--artifacts", help="artifact store root (default: $SMELTER_ARTIFACTS, else artifacts/ "
                                           "beside the pipelines file)")
        p.add_argument("--allow-outside-paths", action="store_true",
                       help="accept data files outside the pipelines file's directory")
        if select:
            p.add_argument("--pipeline", action="append", default=[],
                           help="only this pipeline (repeatable); problems of the others are warnings")
        return p

    run = with_file(sub.add_parser("run", help="run the pipelines"))
    run.add_argument("--precision", action="append", default=[], help="only this precision (repeatable)")
    run.add_argument("--target", action="append", default=[], help="only this target (repeatable)")
    run.add_argument("--force", action="store_true", help="rebuild even what is cached")
    run.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    loudness = run.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true", help="print only failures and the final table")
    loudness.add_argument("-v", "--verbose", action="store_true",
                          help="also print what libraries and Prefect log (normally kept in the run's log file)")
    with_file(sub.add_parser("plan", help="show the graph that would run, cached or to-run"))
    with_file(sub.add_parser("validate", help="check the pipelines file and exit"))
    notify = with_file(sub.add_parser("notify", help="webhook deliveries"))
    notify.add_argument("--retry", action="store_true", required=True, help="send every pending event again")
    webhooks = sub.add_parser("webhooks", help="MLflow's own registry webhooks")
    webhook_actions = webhooks.add_subparsers(dest="action", required=True)
    with_file(webhook_actions.add_parser(
        "sync", help="mirror the file's webhooks into the MLflow server's registry webhooks",
        description="Make the MLflow server's registry webhooks (MLFLOW_TRACKING_URI) match the file: one per "
                    "distinct (url, secret_env), named smelter-<hash>; creates, updates, and deletes the ones of "
                    "ours the file no longer names. Webhooks made by others are left alone. The server refuses "
                    "http:// URLs unless it runs with MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https, and private or "
                    "unresolvable hosts unless it runs with MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true."), select=False)
    deploy = with_file(sub.add_parser("deploy", help="serve the scheduled deployments, or register them on work pools"),
                       select=False)
    deploy.add_argument("--pools", action="store_true",
                        help="create the work pools the targets need and register the deployments there "
                             "(for `prefect worker start --pool NAME`) instead of serving them from this process")
    deploy.add_argument("--prefect-yaml", metavar="PATH",
                        help="write the same deployments as a prefect.yaml for `prefect deploy --all`, and exit")
    compare = with_file(sub.add_parser("compare", help="time two registered engine versions side by side here"),
                        select=False)
    compare.add_argument("registered_model", help="e.g. minilm-cpu (<pipeline>-<target>)")
    compare.add_argument("version_a", help="the baseline version")
    compare.add_argument("version_b", help="the version compared with it")
    compare.add_argument("--batch", type=int, help="batch size (default: the pipeline's gate point)")
    compare.add_argument("--seq", type=int, help="sequence length of a prefill (default: the pipeline's gate point, "
                         "which may be a decode step)")
    compare.add_argument("--json", action="store_true", help="print the result as one JSON object")
    capacity = with_file(sub.add_parser(
        "capacity", help="GPUs that serve N tokens/day with a registered engine",
        usage="smelter capacity {REGISTERED_MODEL [--version N] | --figures PATH [--profiles-of PIPELINE]} "
              "--tokens-per-day N --prompt P --answer A --slo-ms MS [options]"), select=False)
    source = capacity.add_mutually_exclusive_group(required=True)
    source.add_argument("registered_model", nargs="?", help="e.g. llama-sm90 (<pipeline>-<target>)")
    source.add_argument("--figures", metavar="PATH",
                        help="measured figures as JSON instead of the registry (smelter's shape or a gpu_pipeline "
                             "results file)")
    capacity.add_argument("--version", help="registry version (default: the pipeline's promotion alias)")
    capacity.add_argument("--profiles-of", metavar="PIPELINE",
                          help="with --figures: check the mix against this pipeline's profiles")
    capacity.add_argument("--tokens-per-day", type=float, required=True, help="N, e.g. 1e9")
    capacity.add_argument("--prompt", type=int, required=True, help="prompt tokens per request")
    capacity.add_argument("--answer", type=int, required=True, help="answer (generated) tokens per request")
    capacity.add_argument("--slo-ms", type=float, required=True, help="p99 request latency limit, ms")
    capacity.add_argument("--utilisation", type=float, default=0.6, help="target GPU utilisation (default: %(default)s)")
    capacity.add_argument("--count", choices=["all", "answer"], default="all",
                          help="which tokens N counts: prompt + answer (all) or answer only (default: %(default)s)")
    capacity.add_argument("--gpus-per-host", type=int, help="also answer in hosts of this many GPUs")
    capacity.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


def _stores_beside_the_file(args: argparse.Namespace) -> None:
    """The artifact store and the MLflow store live beside the pipelines file, as its model and data paths
    do, whatever the working directory: a run started from elsewhere must find the same builds and the same
    registry, not start empty ones and crown a second champion. --artifacts, $SMELTER_ARTIFACTS and
    MLFLOW_TRACKING_URI, when given, keep their meaning."""
    if not hasattr(args, "artifacts"):
        return
    home = Path(args.file or ".").resolve().parent
    here = home == Path.cwd().resolve()  # the usual case: paths stay as short as the user wrote them
    if args.artifacts is None:
        args.artifacts = os.environ.get("SMELTER_ARTIFACTS", "artifacts" if here else str(home / "artifacts"))
    if not here and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"


def _load(args: argparse.Namespace, *, check_env: bool = True) -> Any:
    """The checked pipelines file; its warnings (other pipelines' problems, unchecked hub models) on stderr."""
    from tasks.config.spec import SpecError, load

    if not args.file:
        raise SpecError(["-f/--file: expected the path of a pipelines file, got ''"])
    problem = _artifacts_problem(args.artifacts)
    if problem:
        raise SpecError([f"{args.file}: --artifacts {args.artifacts}: {problem}"])
    specs = load(args.file, pipelines=getattr(args, "pipeline", None) or None, check_env=check_env,
                 allow_outside_paths=args.allow_outside_paths)
    for note in specs.warnings:
        print(f"warning: {note}", file=sys.stderr)
    return specs


def _artifacts_problem(artifacts: str) -> str | None:
    """Why the artifact store cannot live at `artifacts`, checked before any work rather than as a
    crash at the first write: empty (it would be the working directory), or a file on its path."""
    if not artifacts:
        return "expected a directory path (from --artifacts or $SMELTER_ARTIFACTS), got ''"
    for path in (Path(artifacts), *Path(artifacts).parents):
        if path.is_dir():
            return None
        if path.exists() or path.is_symlink():
            return "is not a directory" if path == Path(artifacts) else f"{path} is not a directory"
    return None


def _check_services(*, mlflow: bool = False, prefect: bool = False) -> None:
    """The servers a command will talk to answer, and the tracking store is one MLflow can open: a dead
    server or a mistyped URI is exit 2 in a second, not a traceback after minutes of retries."""
    from tasks.config.spec import SpecError

    problems = []
    if prefect:
        from flows.prefect_server import api_problem

        problems.append(api_problem())
    if mlflow:
        from tasks.registry.tracking import store_problem

        problems.append(store_problem())
    if any(problems):
        raise SpecError([p for p in problems if p])


def _selected(specs: Any, args: argparse.Namespace) -> list[Any]:
    return [spec for name, spec in specs.pipelines.items() if not args.pipeline or name in args.pipeline]


def _warnings(specs: list[Any]) -> list[str]:
    """Targets this machine cannot build, and (precision, target) pairs the target's backend does not build."""
    from tasks.backends.base import BackendUnavailable, get_backend

    notes = []
    for spec in specs:
        for target in spec.targets:
            try:
                why = get_backend(target.backend).missing(target)
            except BackendUnavailable as e:
                why = str(e)
            if why:
                notes.append(f"warning: {spec.name}: target {target.name}: {why}; its candidates will fail here")
        notes += [f"skipped: {candidate.name}: {why}" for candidate, why in spec.skipped()]
    return notes


def cmd_validate(args: argparse.Namespace) -> int:
    specs = _load(args)
    selected = _selected(specs, args)
    for note in _warnings(selected):
        print(note, file=sys.stderr)
    from tasks.judge.mlflow_webhooks import default_guard_warnings

    for note in default_guard_warnings(specs):
        print(f"warning: {note}", file=sys.stderr)
    count = sum(len(s.candidates()) for s in selected)
    print(f"{args.file}: ok ({len(selected)} pipelines, {count} candidates)")
    return EXIT_OK


def _champions(specs: Any) -> dict[str, dict[str, Any]]:
    """Each (pipeline, target)'s champion from the registry; none when the registry cannot be read."""
    from tasks.config.settings import RegistrySettings
    from tasks.registry import tracking

    try:
        return {s.name: {t.name: tracking.champion(RegistrySettings.of(s), t.name) for t in s.targets}
                for s in specs.pipelines.values()}
    except Exception as e:  # noqa: BLE001 - plan still shows what it can; benchmark keys assume no champion
        print(f"warning: cannot read champions from the registry ({type(e).__name__}: {e}); "
              "benchmark rows assume none", file=sys.stderr)
        return {}


def cmd_plan(args: argparse.Namespace) -> int:
    specs = _load(args, check_env=False)
    from flows.plan import plan_rows
    from tasks.config.spec import PipelinesFile
    from tasks.runtime.store import ArtifactStore

    selected = PipelinesFile(path=specs.path, pipelines={s.name: s for s in _selected(specs, args)})
    for row in plan_rows(selected, ArtifactStore(args.artifacts), _champions(selected)):
        note = f"  ({row['note']})" if row["note"] else ""
        print(f"{row['node']:<34} {row['stage']:<10} {row['state']:<7} {row['key']}{note}")
    for spec in selected.pipelines.values():
        for candidate, why in spec.skipped():
            print(f"{candidate.name:<34} {'-':<10} skipped {why}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from tasks.config.spec import select

    specs = _load(args)
    selected = select(specs, args.pipeline, args.precision, args.target)
    from flows.prefect_server import owned_server

    with owned_server() as server:  # starts now; its startup overlaps the checks below
        return _run(args, specs, selected, server)


def _run(args: argparse.Namespace, specs: Any, selected: list[Any], server: Any) -> int:
    from flows import progress
    from tasks.config.spec import SpecError

    pipelines = args.pipeline or sorted({c.pipeline for c in selected}, key=list(specs.pipelines).index)
    progress.set_level(progress.QUIET if args.quiet else progress.VERBOSE if args.verbose else progress.NORMAL)
    # Libraries' prints (MLflow creating its tables, import-time warnings, Prefect's notices) go to stderr
    # with --verbose, else to the run's log file; stdout stays the summary's. The servers are checked before
    # the store gets its log dir (a refused run leaves nothing there), their noise kept until it has one.
    checks_log = Path(tempfile.gettempdir()) / f"service-checks-{os.getpid()}.log"
    with contextlib.redirect_stdout(sys.stderr) if args.verbose else progress.captured_output(checks_log):
        _check_services(mlflow=True, prefect=True)
    try:
        log_path = _new_log_file(Path(args.artifacts) / "_logs")
        _append_and_remove(checks_log, log_path)
    except OSError as e:
        raise SpecError([f"{args.file}: --artifacts {args.artifacts}: cannot keep the run's log in "
                         f"{Path(args.artifacts) / '_logs'}: {e.strerror}"]) from e
    quieted = contextlib.redirect_stdout(sys.stderr) if args.verbose else progress.captured_output(log_path)
    try:
        with quieted:
            from flows.nightly import nightly_flow
            from flows.pipeline import flow_summaries
            from flows.prefect_outcome import run_link

            for note in _warnings(_selected(specs, args)):
                progress.message(note)
            progress.message(f"smelter: {_count(len(selected), 'candidate')} in {_count(len(pipelines), 'pipeline')}"
                             + ("" if args.verbose else f"; library output in {log_path}"))
            collector.loaded()  # what the run needs to start is loaded (tasks/runtime/collector.py)
            with server.serving():
                ended = nightly_flow(
                    file=str(Path(args.file)), pipelines=pipelines, precisions=args.precision or None,
                    targets=args.target or None, force=args.force, artifacts=args.artifacts,
                    allow_outside_paths=args.allow_outside_paths, return_state=True)
                summaries = flow_summaries(ended)
            links = _run_links(summaries)
            prefect_link = run_link(ended)  # outside `serving`: a temporary server is gone by now, a lasting one stays
    except Exception as e:
        stop_signals.raise_if_stopped()
        progress.stop_if_a_server_was_lost(e)
        raise
    stop_signals.raise_if_stopped()  # an interrupt swallowed by a finalizer or a library still ends the run as interrupted
    if not args.verbose:  # Prefect says goodbye to its temporary server at exit, past the capture
        logging.getLogger("prefect").setLevel(logging.WARNING)
    failed = [s for s in summaries if s["status"] == "failed" or s["error"]]
    from tasks.outcome import pending_events

    pending = pending_events(summaries)
    if args.json:
        print(json.dumps({"file": args.file, "ok": not failed, "events_pending": pending, "candidates": summaries},
                         indent=2, default=str))
    else:
        print(summary_table(summaries, specs))
        if pending:
            print(f"{len(pending)} promotion event(s) still pending: "
                  + ", ".join(f"{e['registered_model']} v{e['version']} to {e['url']}" for e in pending)
                  + "; they are sent again by the next run or `smelter notify --retry`")
        for line in _last_lines(summaries, specs, links, log_path, prefect_link):
            print(line)
    return EXIT_FAILED if failed else EXIT_OK


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _new_log_file(logs: Path) -> Path:
    """A log file of this run's own, `run-<UTC time>-<pid>.log`, created here and never an existing one:
    two runs started in the same second must not share one (or replace the other's)."""
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"run-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}"
    for attempt in itertools.count():
        path = logs / (f"{stem}.log" if attempt == 0 else f"{stem}-{attempt}.log")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def _append_and_remove(source: Path, log_path: Path) -> None:
    """What the server checks printed, at the head of the run's log."""
    if not source.exists():
        return
    with open(source, "rb") as checks, open(log_path, "ab") as log:
        shutil.copyfileobj(checks, log)
    source.unlink()


def _run_links(summaries: list[dict[str, Any]]) -> dict[str, str]:
    """Each pipeline's parent run in the MLflow UI ({pipeline: url}); none when MLflow cannot say."""
    from tasks.registry import tracking

    links = {}
    for summary in summaries:
        run_id = summary.get("mlflow_parent_run_id")
        if run_id and summary["pipeline"] not in links:
            with contextlib.suppress(Exception):  # a link is a convenience: the table above is the result
                links[summary["pipeline"]] = tracking.run_url(run_id)
    return links


def _last_lines(summaries: list[dict[str, Any]], specs: Any, links: dict[str, str], log_path: Path,
                prefect_link: str | None = None) -> list[str]:
    """Where to look next and what to do: the parent runs in MLflow (with the command that opens them when no
    server is set), the Prefect flow run on a lasting server, then a `Next:` line for each pipeline."""
    from tasks.registry import tracking

    lines = [f"MLflow: {pipeline}: {url}  (summary figure under Artifacts, candidates as child runs)"
             for pipeline, url in links.items()]
    if links and not tracking.tracking_server():
        lines.append(f"        (open them with: {_mlflow_command()} ui --backend-store-uri "
                     f"{tracking.shown_uri(tracking.tracking_uri())} --port {tracking.local_ui_port()})")
    if prefect_link:
        lines.append(f"Prefect: {prefect_link}  (each candidate's verdict as a task run, the table under Artifacts)")
    pipelines = list(dict.fromkeys(s["pipeline"] for s in summaries))
    for pipeline in pipelines:
        own = [s for s in summaries if s["pipeline"] == pipeline]
        lines.append("Next: " + (f"{pipeline}: " if len(pipelines) > 1 else "") + _next_step(own, specs, log_path))
    return lines


def _next_step(summaries: list[dict[str, Any]], specs: Any, log_path: Path) -> str:
    """What to do about one pipeline's run, from what its candidates ended as."""
    statuses = {s["status"] for s in summaries}
    if "failed" in statuses:
        return (f"the failed stage's error is above and in full in {log_path}; fix it and run again "
                "(finished stages are cached)")
    if "pending" in statuses:
        return ("some measurements were taken on a busy machine; run again when it is quiet to decide them "
                "(on a machine that is never quiet, benchmark.contended_above sets the share of the CPU others "
                "may use: docs/decisions.md)")
    if "promoted" in statuses:
        return (f"deploy {', '.join(_alias_uris(summaries, specs, promoted=True))}; an unchanged "
                "re-run is cached and moves nothing")
    if held := _alias_uris(summaries, specs, promoted=False) + _champions_held_elsewhere(summaries, specs):
        return f"nothing moved; {', '.join(held)} stays what to deploy; each candidate's reason is above"
    if "passed" in statuses:
        return "nothing promoted: each passing candidate's reason is above"
    return ("nothing promoted and nothing to deploy yet: every candidate missed a gate (the reasons are above; the "
            "summary figure on the MLflow run shows each bound); build something else (precisions, quantization) or "
            "change the gates in the pipelines file, then run again")


def _champions_held_elsewhere(summaries: list[dict[str, Any]], specs: Any) -> list[str]:
    """`models:/<name>@<alias> (vN)` of each alias that stayed on a version none of this run's candidates built
    (an engine of earlier settings): still what is deployed, whatever this run's candidates ended as."""
    holders = {(s["pipeline"], s["target"]) for s in summaries if (s.get("decision") or {}).get("holds_alias")}
    return sorted({f"{_alias_uri(s['pipeline'], s['target'], specs)} (v{s['decision']['champion']})"
                   for s in summaries if s["pipeline"] in specs.pipelines and (s.get("decision") or {}).get("champion")
                   and (s["pipeline"], s["target"]) not in holders})


def _mlflow_command() -> str:
    """`mlflow` as this shell finds it: by name when PATH leads to this environment's, else by its path (after
    `make run`, `.venv/bin/mlflow`: the virtual environment is not activated)."""
    here = Path(sys.executable).with_name("mlflow")
    on_path = shutil.which("mlflow")
    if on_path and Path(on_path).resolve() == here.resolve():
        return "mlflow"
    with contextlib.suppress(ValueError):
        return str(here.relative_to(Path.cwd()))
    return str(here)


def _alias_uris(summaries: list[dict[str, Any]], specs: Any, *, promoted: bool) -> list[str]:
    """`models:/<name>@<alias>` of the versions this run promoted, or of those holding the alias after it."""
    return sorted({_alias_uri(s["pipeline"], s["target"], specs)
                   for s in summaries if s.get("registered_model") and s["pipeline"] in specs.pipelines
                   and (s["status"] == "promoted" if promoted else (s.get("decision") or {}).get("holds_alias"))})


def _alias_uri(pipeline: str, target: str, specs: Any) -> str:
    """`models:/<registered model>@<alias>`: what a deployment of (pipeline, target) loads."""
    from tasks.config.schema import registered_model_name

    return f"models:/{registered_model_name(pipeline, target)}@{specs.pipelines[pipeline].promotion.alias}"


def _reason(summary: dict[str, Any], specs: Any) -> str:
    """Why a candidate ended as it did: a failed one's error, else the promotion decision's reason (with the
    point its ratio was timed at, the key metric's), else the error or the gates'."""
    decision = summary.get("decision") or {}
    if summary["status"] == "failed" and summary.get("error"):  # not the decision made before it failed
        return summary["error"]
    if decision.get("reason"):
        at = f" at {_point(summary, specs)}" if decision.get("vs_champion") and _point(summary, specs) else ""
        return str(decision["reason"]) + at
    if summary.get("error"):
        return summary["error"]
    reasons = [r for g in summary.get("gates", []) for r in g["reasons"]]
    if reasons:
        return "; ".join(reasons)
    return {"promoted": "passed every gate; the alias moved to it",
            "passed": "passed every gate"}.get(summary["status"], "")


def _version(summary: dict[str, Any], specs: Any) -> str:
    """The registry version, marked with the pipeline's alias (e.g. `v2 @champion`) when it holds it; a
    candidate not registered this run (pending, or rejected today) whose engine is the champion shows the
    champion's version."""
    decision = summary.get("decision") or {}
    holds = decision.get("holds_alias")
    version = summary.get("model_version") or (decision.get("champion") if holds else None)
    if not version:
        return "-"
    spec = specs.pipelines.get(summary["pipeline"])
    alias = spec.promotion.alias if spec is not None else "alias"
    return f"v{version}" + (f" @{alias}" if holds else "")


def _point(summary: dict[str, Any], specs: Any, short: bool = False) -> str:
    """The pipeline's gate point (`batch 8 × seq 128`, `decode step batch 4 × past 64`): where its gates, objective
    and decisions are read."""
    from tasks.config.spec import point_words

    spec = specs.pipelines.get(summary["pipeline"])
    return point_words(spec.gate_point, short) if spec is not None else ""


def _key_metric(summary: dict[str, Any], specs: Any) -> str:
    """The pipeline's objective at its gate point (throughput, or p99 latency), and when the decision timed
    it against the champion, that ratio first: the number the reason speaks of, at the same point."""
    spec = specs.pipelines.get(summary["pipeline"])
    metrics = summary.get("metrics") or {}
    if spec is not None and spec.performance.objective == "latency":
        value = f"{metrics['p99_ms']:.3g} ms p99" if "p99_ms" in metrics else ""
    else:
        value = f"{_figure(metrics['throughput'])}/s" if "throughput" in metrics else ""
    versus = (summary.get("decision") or {}).get("vs_champion") or {}
    if versus.get("ratio") is not None:
        value = f"{versus['ratio']:.3g}x vs v{versus.get('version')}" + (f", {value}" if value else "")
    if not value:
        return "-"
    compact = _point(summary, specs, short=True)
    return (f"{value} @ {compact}" if compact else value) + "".join(f" [{flag}]" for flag in _doubts(summary))


def _figure(value: float) -> str:
    """4 significant digits, without an exponent for the thousands a throughput usually is (16370, not 1.637e+04)."""
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e9 else f"{value:.4g}"


def _doubts(summary: dict[str, Any]) -> list[str]:
    """Why the key metric may not be the engine's: timed on a busy machine, or an interval too wide to tell."""
    doubts = []
    if ((summary.get("stages") or {}).get("benchmark") or {}).get("contended"):
        doubts.append("busy machine")
    versus = (summary.get("decision") or {}).get("vs_champion") or {}
    low, high = versus.get("ci") or (None, None)
    if versus.get("conclusive") is False and not (high is not None and high < 1):  # below 1 says "slower" enough
        doubts.append("inconclusive")
    return doubts


def summary_table(summaries: list[dict[str, Any]], specs: Any) -> str:
    """The table `smelter run` prints last: status, registry version, key metric and the reason."""
    rows = [("candidate", "status", "version", "key metric", "reason")]
    rows += [(s["candidate"], s["status"], _version(s, specs), _key_metric(s, specs),
              " ".join(_reason(s, specs).split()))  # one line a row, whatever a library's message held
             for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4]
                     for row in rows)


def cmd_compare(args: argparse.Namespace) -> int:
    from tasks.judge.compare import compare_versions, find_registered_model
    from tasks.runtime.store import ArtifactStore

    from tasks.config.spec import MAX_BATCH, MAX_SEQ

    owner = find_registered_model(_load(args, check_env=False), args.registered_model)
    _check_services(mlflow=True)
    for flag, bound in (("batch", MAX_BATCH), ("seq", MAX_SEQ)):
        value = getattr(args, flag)
        if value is not None and not 1 <= value <= bound:
            print(f"error: --{flag} must be an integer from 1 to {bound}, got {value}", file=sys.stderr)
            return EXIT_INVALID
    with contextlib.redirect_stdout(sys.stderr):
        result = compare_versions(owner, args.version_a, args.version_b, ArtifactStore(args.artifacts),
                                  batch=args.batch, seq=args.seq)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    low, high = result["ci"]
    if result["same_engine"]:  # timed twice on purpose: the noise floor, never a verdict
        print(f"{result['registered_model']} v{result['a']} against itself at {result['at']}: the same engine, "
              f"timed twice: {result['ratio']:.3g}x [{low:.3g}, {high:.3g}] is this machine's noise floor (95% "
              f"interval, {result['rounds']} rounds in {result['seconds']} s; other processes used "
              f"{result['host']['foreign_cpu_share']:.0%} of the CPU), not a comparison")
        return EXIT_OK
    verdict = "conclusive" if result["conclusive"] else "inconclusive"
    print(f"{result['registered_model']} v{result['b']} vs v{result['a']} at {result['at']}: "
          f"v{result['b']} is {result['ratio']:.3g}x as fast [{low:.3g}, {high:.3g}] "
          f"(95% interval, {result['rounds']} rounds in {result['seconds']} s, {verdict}; "
          f"other processes used {result['host']['foreign_cpu_share']:.0%} of the CPU)")
    return EXIT_OK


def cmd_capacity(args: argparse.Namespace) -> int:
    from tasks.measure import capacity
    from tasks.config.spec import SpecError, registered_model_name

    limits, where = capacity.Limits(), args.figures
    try:
        if args.figures:
            figures = capacity.figures_from_file(Path(args.figures))
        if args.registered_model or args.profiles_of:
            specs = _load(args, check_env=False)
            owners = [(s, t) for s in specs.pipelines.values() for t in s.targets
                      if s.name == args.profiles_of
                      or registered_model_name(s.name, t.name) == args.registered_model]
            if not owners:
                asked = f"--profiles-of {args.profiles_of}" if args.profiles_of else args.registered_model
                raise SpecError([f"{args.file}: capacity {asked}: no pipeline and target of this file match; "
                                 f"known: {', '.join(sorted(registered_model_name(s.name, t.name) for s in specs.pipelines.values() for t in s.targets))}"])
            spec, target = owners[0]
            if not spec.model.is_decoder:
                raise SpecError([f"{args.file}: capacity {args.registered_model or args.profiles_of}: pipeline "
                                 f"{spec.name} builds a {spec.model.task} model; a capacity plan needs a decoder's "
                                 "measured prefill and decode steps (model.task text-generation or "
                                 "text-generation-with-past)"])
            limits = capacity.limits_from_profiles(spec.profiles)
        if args.registered_model:
            from tasks.registry import tracking

            _check_services(mlflow=True)
            version = args.version or tracking.alias_version(args.registered_model, spec.promotion.alias)
            found = tracking.find_version(args.registered_model, version) if version else None
            if found is None:
                raise SpecError([f"capacity: {args.registered_model} has no version "
                                 f"{args.version or '@' + spec.promotion.alias} in the registry at "
                                 f"{tracking.shown_uri(tracking.tracking_uri())}"])
            where = f"{args.registered_model} v{found.version}"
            figures = capacity.figures_from_metrics(tracking.run_metrics(found.run_id), where,
                                                    found.tags.get("arch") or target.gpu_arch)
        workload = capacity.Workload(args.tokens_per_day, args.prompt, args.answer, args.slo_ms, args.utilisation,
                                     args.count, args.gpus_per_host)
        result = capacity.plan(figures, workload, limits)
    except ValueError as e:  # FiguresError included: the message names the source and the key
        raise SpecError([str(e)]) from e
    print(json.dumps(result.as_dict(), indent=2) if args.json else capacity.markdown(result), end="\n" if args.json else "")
    return EXIT_OK if result.gpus is not None else EXIT_FAILED


def cmd_notify(args: argparse.Namespace) -> int:
    from tasks.config.settings import RegistrySettings
    from tasks.judge.notify import retry_pending

    selected = _selected(_load(args), args)
    _check_services(mlflow=True, prefect=True)
    results = retry_pending([RegistrySettings.of(spec) for spec in selected])
    for r in results:
        print(json.dumps(r, default=str))
    if not results:
        print("nothing to send: no event of these pipelines' registered models is pending", file=sys.stderr)
    return EXIT_FAILED if any(r.get("status") in ("pending", "failed") for r in results) else EXIT_OK


def cmd_webhooks(args: argparse.Namespace) -> int:
    """`smelter webhooks sync`; a URL the server refuses is one line naming the setting to change (exit 2)."""
    from tasks.judge.mlflow_webhooks import sync
    from tasks.registry.tracking import tracking_server

    specs = _load(args)
    _check_services(mlflow=True)
    if tracking_server() is None:
        print("warning: MLFLOW_TRACKING_URI is not an `mlflow server`; registry webhooks fire only from a server",
              file=sys.stderr)
    changes = sync(specs)
    for change in changes:
        print(f"{change['action']:<8} {change['webhook']}  {change['url']}  {change['pipelines']}".rstrip())
    if not changes:
        print(f"nothing to sync: {args.file} names no webhooks and the server has none of smelter's")
    return EXIT_OK


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows import deploy

    specs = _load(args, check_env=not (args.pools or args.prefect_yaml))  # the workers hold the secrets
    plans = deploy.plan(specs, args.file, args.artifacts, fan_out=bool(args.pools or args.prefect_yaml))
    if not args.prefect_yaml:
        _need_a_lasting_prefect_server(args.file)
        _check_services(prefect=True)
    if args.prefect_yaml:
        try:
            _write_whole(Path(args.prefect_yaml), deploy.prefect_yaml(plans, args.file))
        except OSError as e:
            print(f"error: {args.file}: --prefect-yaml {args.prefect_yaml}: cannot write: {e.strerror or e}",
                  file=sys.stderr)
            return EXIT_INVALID
        print(f"{args.prefect_yaml}: {len(plans)} deployments")
        return EXIT_OK
    if not args.pools:
        if pooled := deploy.on_work_pools(plans):
            print(f"error: {args.file}: deploy: {', '.join(pooled)} run on work pools (`smelter deploy --pools` "
                  "registered them); serving them here would put the same names on this process, and the pools' "
                  "workers could not start their runs any more. Keep the pools (`smelter deploy --pools` again after "
                  "an edit), or remove them first: prefect deployment delete <name>", file=sys.stderr)
            return EXIT_INVALID
        _say_silent_runs_crash(deploy.crash_silent_runs())
        collector.loaded()  # this process runs the nightly flows from here on
        deploy.serve_schedules(plans)
        return EXIT_OK
    _say_silent_runs_crash(deploy.crash_silent_runs())
    needed = deploy.pools(specs)
    created = deploy.create_pools(list(needed))
    deploy.register(plans, str(Path.cwd()))
    for pool, targets in needed.items():
        print(f"pool {pool:<16} {'created' if created[pool] else 'exists':<8} builds {', '.join(targets)}")
    for p in plans:
        schedule = (f"cron {p.schedule.cron} {p.schedule.timezone}" if p.schedule
                    else "started by pipeline runs" if p.flow_name == deploy.BUILD_FLOW else "ad hoc")
        print(f"deployment {p.full_name:<36} pool {p.pool:<16} {schedule}")
    print("next: on each pool's hosts, from this checkout: "
          + "; ".join(f"prefect worker start --pool {pool}" for pool in needed))
    return EXIT_OK


def _say_silent_runs_crash(created: bool) -> None:
    from flows.deploy import SILENT_RUNS_AUTOMATION

    print(f"automation {SILENT_RUNS_AUTOMATION!r} {'created' if created else 'exists'}: a run whose process died "
          "ends Crashed")


def _need_a_lasting_prefect_server(file: str) -> None:
    """Deployments live in a Prefect server, and its scheduler makes the nightly runs. Without
    PREFECT_API_URL they would go to a temporary server that has no scheduler and that no worker or
    `prefect deployment run` can reach: served or registered, nothing would ever run."""
    from prefect.settings import PREFECT_API_URL

    from tasks.config.spec import SpecError

    if not PREFECT_API_URL.value():
        raise SpecError([f"{file}: deploy needs a lasting Prefect server (PREFECT_API_URL is not set): its scheduler "
                         "starts the nightly runs, and workers and `prefect deployment run` reach it; start one with "
                         "`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api (docs/fleet.md)"])


def _write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` at once (temp file + rename): an interrupted write leaves the old file."""
    from tasks.runtime.whole_file import write_whole

    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    write_whole(path, text)


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "validate": cmd_validate, "notify": cmd_notify, "deploy": cmd_deploy,
            "webhooks": cmd_webhooks, "compare": cmd_compare, "capacity": cmd_capacity}


def main(argv: list[str] | None = None) -> int:
    """The exit code: 2 for bad usage or an invalid pipelines file, reported before any work starts.

    The stop handlers come first, before any heavy import (pydantic, Prefect, torch): a Ctrl-C pressed right
    after Enter lands while they load, and without the handler Python's own killed the process with a
    traceback."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    stop_signals.received.clear()
    _delivered.clear()
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS
                # a SIGINT the shell ignores (a background job) stays ignored
                if in_main_thread and signal.getsignal(signum) is not signal.SIG_IGN}
    _unraisable_hooks[:] = [sys.unraisablehook]
    sys.unraisablehook = _record_swallowed_stop
    command = None
    try:
        from tasks.config.spec import SpecError

        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # argparse has printed the usage and why
            return e.code if isinstance(e.code, int) else EXIT_INVALID
        command = args.command
        _stores_beside_the_file(args)
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # and the client's too: on a terminal Prefect's first import prints a usage-data notice before any capture
        os.environ.setdefault("DO_NOT_TRACK", "1")
        # Prefect's temporary server gets 20 s to start by default; a busy 2-core machine needs longer.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        _bound_client_retries()
        _quiet_prefect_log_worker()
        if command not in ("validate", "plan"):
            from tasks.runtime import scratch

            scratch.activate()  # library temp files in a dir of this process's; a killed run's is removed
        try:
            return COMMANDS[command](args)
        except SpecError as e:
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
            return EXIT_INVALID
    except (KeyboardInterrupt, stop_signals.Terminated):
        return _stop_code(command, caught=sys.exc_info()[1])
    except Exception as e:
        if stop_signals.received:  # the interrupt, swallowed, left only a library's error behind
            return _stop_code(command)
        from tasks.registry.tracking import ServerLost

        if not isinstance(e, ServerLost):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        sys.unraisablehook = _unraisable_hooks[0]
        for signum, handler in previous.items():  # a stopped process ignores them while it exits (Python puts
            signal.signal(signum, signal.SIG_IGN if _delivered else handler)  # back the default, which kills)


# Waits on a server that stopped answering, bounded for this process unless the user set them: MLflow retries
# a call 7 times over ~4 minutes (120 s timeout each), Prefect 5 times over ~1 minute, and a run makes many.
# These ride out a restart or a busy spell of ~30 s a call (a SQLite Prefect server answers 503 at once while
# concurrent runs write to it: each retry is a fresh chance) and end a run on a dead server in tens of seconds.
CLIENT_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                         "MLFLOW_HTTP_REQUEST_TIMEOUT": "60", "PREFECT_CLIENT_MAX_RETRIES": "4"}


def _bound_client_retries() -> None:
    """See CLIENT_RETRY_DEFAULTS; a variable the user set is left as it is."""
    for name, value in CLIENT_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _quiet_prefect_log_worker() -> None:
    """Prefect's log worker reports a send that failed by writing `--- Error logging to API ---` and the error,
    with no newline, whenever its retries run out: on a server that died it lands in the middle of the line in
    which smelter names the lost server (or of a stage's line). smelter says that itself, so the worker is quiet
    for the whole command (as `logging.raiseExceptions = False` makes every logging handler)."""
    logging.raiseExceptions = False


STOP_SIGNALS = tuple(STOPPED)
_unraisable_hooks: list[Any] = []  # the hook `_record_swallowed_stop` replaced, which it hands each exception on to
_delivered: list[int] = []  # the stop signals this command's handler received


def _on_stop_signal(signum: int, frame: Any) -> None:
    """Record the signal, then raise it as an exception. The raise alone can be lost (raised inside a
    finalizer or a library's `except BaseException`); the record stops the run at its next safe point.

    A second one while the run already stops (Ctrl-C pressed twice, or once through `timeout`, which passes it
    on) is only recorded: raised, it would break the cleanup under way and print a traceback. A third ends the
    process at once, for a cleanup that hangs; the next run finishes it."""
    stop_signals.received.append(signum)
    _delivered.append(signum)
    quiet_neighbours.resume_all()  # a server paused while engines are timed: the stop path talks to it
    if len(_delivered) == 1:
        _shorten_prefect_retries()
        stop_signals.raise_for(signum)
    if len(_delivered) >= 3:
        code = EXIT_TERMINATED if stop_signals.received[0] == signal.SIGTERM else EXIT_INTERRUPTED
        os.write(2, b"smelter: stopped at once (a third stop signal); the next run finishes the cleanup\n")
        os._exit(code)


STOPPING_PREFECT_RETRIES = 2


def _shorten_prefect_retries() -> None:
    """A stopping run gives its slots back and marks its flow and task runs through the Prefect server while
    the user waits: each call then waits out at most 2 retries (about 6 s of a busy server), not the ~30 s a
    working run rides out (CLIENT_RETRY_DEFAULTS). A slot it could not give back is taken over by the next run
    on this host."""
    if "prefect.settings" not in sys.modules:  # stopped before Prefect was imported: nothing to give back
        return
    from flows.prefect_server import limit_prefect_retries

    limit_prefect_retries(STOPPING_PREFECT_RETRIES)


def _record_swallowed_stop(unraisable: Any) -> None:
    """Python's hook for an exception it ignores (raised in a finalizer): a stop signal's exception there,
    ours or Prefect's own TerminationSignal (which replaces our SIGTERM handler while a flow runs), is
    recorded so the run still stops at its next safe point. Then printed as Python prints it."""
    stop = unraisable.exc_value
    termination = getattr(sys.modules.get("prefect.exceptions"), "TerminationSignal", stop_signals.Terminated)
    if isinstance(stop, KeyboardInterrupt):
        stop_signals.received.append(signal.SIGINT)
    elif isinstance(stop, (stop_signals.Terminated, termination)):
        stop_signals.received.append(signal.SIGTERM)
    (_unraisable_hooks or [sys.__unraisablehook__])[0](unraisable)


def _stop_code(command: str | None, caught: BaseException | None = None) -> int | None:
    """The exit code and line of a stopped command (the signal received first wins), or None."""
    signum = stop_signals.received[0] if stop_signals.received else None
    if signum is None and caught is None:
        return None
    if signum == signal.SIGTERM or (signum is None and isinstance(caught, stop_signals.Terminated)):
        return _stopped(STOPPED[signal.SIGTERM], EXIT_TERMINATED, command)
    return _stopped(STOPPED[signal.SIGINT], EXIT_INTERRUPTED, command)


def _stopped(how: str, code: int, command: str | None) -> int:
    after = ("; the unfinished stage was dropped and its MLflow runs marked KILLED. Finished stages are kept: "
             "run again to go on.") if command == "run" else ""
    print(f"smelter: {how}{after}", file=sys.stderr)
    return code


def entry() -> None:
    """The `smelter` command: main's exit code. It loads with the cycle collector held off (tasks/runtime/
    collector.py): `run` and `deploy`'s serving resume it before their flows, the commands that only read
    and print keep it held to their end. A run stopped by a signal ends here with that code (130 / 143).
    Python itself would end such a process by SIGINT (exit -2, a traceback-less death a shell reads as killed)
    whenever a library ran code through PyRun_String while the first Ctrl-C was raised: that sets an interpreter
    flag nothing can clear. So after a stop the exit handlers run here and the process ends with its code."""
    collector.hold()
    code = main()
    if _delivered:
        import atexit

        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

