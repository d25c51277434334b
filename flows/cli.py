"""`smelter`: run, plan, validate, notify and deploy from the command line.

Exit codes: 0 every stage ran (a candidate a gate rejected is a result, not an error);
1 a stage failed; 2 an invalid pipelines.yaml or bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
DEFAULT_FILE = "pipelines.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smelter", description="Build, validate, benchmark and promote inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_file(p: argparse.ArgumentParser, *, select: bool = True) -> argparse.ArgumentParser:
        p.add_argument("-f", "--file", default=DEFAULT_FILE, help="pipelines file (default: %(default)s)")
        p.add_argument("--artifacts", default=os.environ.get("SMELTER_ARTIFACTS", "artifacts"),
                       help="artifact store root (default: %(default)s)")
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
    with_file(sub.add_parser("plan", help="show the graph that would run, cached or to-run"))
    with_file(sub.add_parser("validate", help="check the pipelines file and exit"))
    notify = with_file(sub.add_parser("notify", help="webhook deliveries"))
    notify.add_argument("--retry", action="store_true", required=True, help="send every pending event again")
    with_file(sub.add_parser("deploy", help="serve the nightly deployments on their schedules"), select=False)
    compare = with_file(sub.add_parser("compare", help="time two registered engine versions side by side here"),
                        select=False)
    compare.add_argument("registered_model", help="e.g. minilm-cpu (<pipeline>-<target>)")
    compare.add_argument("version_a", help="the baseline version")
    compare.add_argument("version_b", help="the version compared with it")
    compare.add_argument("--batch", type=int, help="batch size (default: the pipeline's gate point)")
    compare.add_argument("--seq", type=int, help="sequence length (default: the pipeline's gate point)")
    compare.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def _load(args: argparse.Namespace, *, check_env: bool = True) -> Any:
    """The checked pipelines file; its warnings (other pipelines' problems, unchecked hub models) on stderr."""
    from tasks.spec import SpecError, load

    artifacts = Path(args.artifacts)
    if artifacts.exists() and not artifacts.is_dir():
        raise SpecError([f"{args.file}: --artifacts {args.artifacts}: is not a directory"])
    specs = load(args.file, pipelines=getattr(args, "pipeline", None) or None, check_env=check_env,
                 allow_outside_paths=args.allow_outside_paths)
    for note in specs.warnings:
        print(f"warning: {note}", file=sys.stderr)
    return specs


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
    count = sum(len(s.candidates()) for s in selected)
    print(f"{args.file}: ok ({len(selected)} pipelines, {count} candidates)")
    return EXIT_OK


def _champions(specs: Any) -> dict[str, dict[str, Any]]:
    """Each (pipeline, target)'s champion from the registry; none when the registry cannot be read."""
    from tasks import tracking

    try:
        return {s.name: {t.name: tracking.champion(s, t.name) for t in s.targets} for s in specs.pipelines.values()}
    except Exception as e:  # noqa: BLE001 - plan still shows what it can; benchmark keys assume no champion
        print(f"warning: cannot read champions from the registry ({type(e).__name__}: {e}); "
              "benchmark rows assume none", file=sys.stderr)
        return {}


def cmd_plan(args: argparse.Namespace) -> int:
    specs = _load(args, check_env=False)
    from flows.plan import plan_rows
    from tasks.spec import PipelinesFile
    from tasks.store import ArtifactStore

    selected = PipelinesFile(path=specs.path, pipelines={s.name: s for s in _selected(specs, args)})
    for row in plan_rows(selected, ArtifactStore(args.artifacts), _champions(selected)):
        note = f"  ({row['note']})" if row["note"] else ""
        print(f"{row['node']:<34} {row['stage']:<10} {row['state']:<7} {row['key']}{note}")
    for spec in selected.pipelines.values():
        for candidate, why in spec.skipped():
            print(f"{candidate.name:<34} {'-':<10} skipped {why}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from tasks.spec import select

    specs = _load(args)
    selected = select(specs, args.pipeline, args.precision, args.target)
    from flows import progress
    from flows.nightly import nightly_flow

    for note in _warnings(_selected(specs, args)):
        print(note, file=sys.stderr)
    pipelines = args.pipeline or sorted({c.pipeline for c in selected}, key=list(specs.pipelines).index)
    progress.message(f"smelter: {len(selected)} candidates in {len(pipelines)} pipelines")
    with contextlib.redirect_stdout(sys.stderr):  # libraries print (MLflow's run links); stdout is the summary's
        summaries = nightly_flow(file=str(Path(args.file)), pipelines=pipelines, precisions=args.precision or None,
                                 targets=args.target or None, force=args.force, artifacts=args.artifacts,
                                 allow_outside_paths=args.allow_outside_paths)
    failed = [s for s in summaries if s["status"] == "failed" or s["error"]]
    if args.json:
        print(json.dumps({"file": args.file, "ok": not failed, "candidates": summaries}, indent=2, default=str))
    else:
        for s in summaries:
            print(_table_row(s))
    return EXIT_FAILED if failed else EXIT_OK


def _table_row(summary: dict[str, Any]) -> str:
    """candidate, status, version (with the alias when it holds it) and the one-line reason."""
    decision = summary.get("decision") or {}
    version = f"v{summary['model_version']}" if summary.get("model_version") else "-"
    if decision.get("holds_alias"):
        version += " @alias"
    reason = decision.get("reason") or summary.get("error") or "; ".join(
        r for g in summary.get("gates", []) for r in g["reasons"])
    return f"{summary['candidate']:<32} {summary['status']:<9} {version:<10} {reason}"


def cmd_compare(args: argparse.Namespace) -> int:
    from tasks.compare import compare_versions, find_registered_model
    from tasks.store import ArtifactStore

    from tasks.spec import MAX_BATCH, MAX_SEQ

    owner = find_registered_model(_load(args, check_env=False), args.registered_model)
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
    verdict = "conclusive" if result["conclusive"] else "inconclusive"
    print(f"{result['registered_model']} v{result['b']} vs v{result['a']} at batch {result['batch']} x seq "
          f"{result['seq']}: v{result['b']} is {result['ratio']:.3g}x as fast [{low:.3g}, {high:.3g}] "
          f"(95% interval, {result['rounds']} rounds in {result['seconds']} s, {verdict}; "
          f"other processes used {result['host']['foreign_cpu_share']:.0%} of the CPU)")
    return EXIT_OK


def cmd_notify(args: argparse.Namespace) -> int:
    from tasks.notify import retry_pending

    results = retry_pending(_selected(_load(args), args))
    for r in results:
        print(json.dumps(r, default=str))
    return EXIT_FAILED if any(r.get("status") not in ("delivered", "abandoned") for r in results) else EXIT_OK


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import serve_schedules

    serve_schedules(_load(args), args.file, args.artifacts)
    return EXIT_OK


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "validate": cmd_validate, "notify": cmd_notify, "deploy": cmd_deploy,
            "compare": cmd_compare}


def main(argv: list[str] | None = None) -> int:
    """The exit code: 2 for bad usage or an invalid pipelines file, reported before any work starts."""
    from tasks.spec import SpecError

    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and why
        return e.code if isinstance(e.code, int) else EXIT_INVALID
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary server gets 20 s to start by default; a busy 2-core machine needs longer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    try:
        return COMMANDS[args.command](args)
    except SpecError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
