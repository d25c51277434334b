"""The terminal during `smelter run`: one line per stage, library noise in the run's log file, a final table."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows import progress
from flows.cli import summary_table
from tasks.config.spec import load
from tests.fixtures.fleet import project_env

NOISY_RUN = textwrap.dedent("""
    import os, sys, warnings
    from pathlib import Path
    from flows import progress
    with progress.captured_output(Path(sys.argv[1])):
        print("View run enc/fp32/cpu at: http://mlflow/#/runs/1")
        warnings.warn("torch.tensor results are registered as constants in the trace")
        os.write(2, b"Weight deduplication check in the ONNX export requires accelerate\\n")
        os.write(1, b"native stdout\\n")
        progress.stage_done("enc/fp32/cpu", "build", cached=True)
    print("the summary")
""")


def test_library_output_goes_to_the_log_file_and_stage_lines_to_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "_logs" / "run.log"
    done = subprocess.run([sys.executable, "-c", NOISY_RUN, str(log)], capture_output=True, text=True,
                          env=project_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the summary\n"
    assert [line.split() for line in done.stderr.splitlines()] == [["✔", "enc/fp32/cpu", "build", "cached"]]
    captured = log.read_text()
    for noise in ("View run", "registered as constants", "requires accelerate", "native stdout"):
        assert noise in captured


def test_a_stage_that_ran_again_but_kept_its_output_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Not "cached": it took the time of a new run, and the line says why its result was not used."""
    progress.stage_started("enc/fp32/cpu", "benchmark")
    progress.stage_done("enc/fp32/cpu", "benchmark", cached=True, kept="the published measurement stands")
    line = capsys.readouterr().err
    assert "benchmark" in line and "kept" in line and "the published measurement stands" in line
    assert "cached" not in line


def test_quiet_keeps_only_failures(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        progress.set_level(progress.QUIET)
        progress.stage_done("enc/fp32/cpu", "build", cached=False)
        progress.candidate_done("enc/fp32/cpu", "rejected", ["p99_ms: 80 > max 50"])
        progress.stage_failed("enc/fp32/sm90", "build", "BuildUnavailable: TensorRT is not installed\nmore")
    finally:
        progress.set_level(progress.NORMAL)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "TensorRT is not installed" in lines[0] and "more" not in lines[0]


def _summary(candidate: str, status: str, **extra) -> dict:
    pipeline, precision, target = candidate.split("/")
    return {"candidate": candidate, "pipeline": pipeline, "precision": precision, "target": target,
            "status": status, "gates": [], "metrics": {"throughput": 1234.5, "p99_ms": 8.25}, "error": None,
            "model_version": None} | extra


def test_final_table_shows_version_key_metric_and_reason(pipeline_factory, tiny_bert_dir) -> None:
    specs = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc"))
    rows = summary_table([
        _summary("enc/fp32/cpu", "promoted", model_version="4",
                 decision={"reason": "beats champion v3 by 12% (95% CI 8-16%)"}),
        _summary("enc/int8/cpu", "rejected", gates=[{"gate": "accuracy", "passed": False,
                                                     "reasons": ["cosine_min: 0.91 < min 0.97"]}]),
        _summary("enc/fp16/cpu", "failed", metrics={}, error="build failed: RuntimeError: out of memory"),
    ], specs).splitlines()
    assert rows[0].split() == ["candidate", "status", "version", "key", "metric", "reason"]
    assert rows[1].split()[:4] == ["enc/fp32/cpu", "promoted", "v4", "1234/s"]
    assert rows[1].endswith("beats champion v3 by 12% (95% CI 8-16%)")
    assert rows[2].split()[:4] == ["enc/int8/cpu", "rejected", "-", "1234/s"]
    assert rows[2].endswith("  cosine_min: 0.91 < min 0.97")
    assert rows[3].split()[:4] == ["enc/fp16/cpu", "failed", "-", "-"] and rows[3].endswith("out of memory")


LIVE_BENCHMARK = textwrap.dedent("""
    import random, sys
    from pathlib import Path
    from flows import progress
    from tasks.measure.rounds import Contender, measure_rounds
    rng = random.Random(0)
    timer = lambda n: [1.0 + rng.random() * 0.01 for _ in range(n)]
    with progress.captured_output(Path(sys.argv[1])):
        progress.stage_started("enc/cpu", "benchmark")
        measure_rounds([Contender("reference", timer), Contender("enc/fp32/cpu", timer)],
                       [("reference", "enc/fp32/cpu")], warmup=1, min_rounds=8, max_seconds=30, precision=0.05)
        progress.stage_done("enc/cpu", "benchmark", cached=False)
""")


def test_on_a_terminal_a_live_line_follows_the_running_benchmark(tmp_path: Path) -> None:
    """Rounds and the interval's half-width against the target while it runs; cleared for the done line."""
    import os
    import pty

    main, child = pty.openpty()
    done = subprocess.run([sys.executable, "-c", LIVE_BENCHMARK, str(tmp_path / "run.log")], stderr=child,
                          stdout=subprocess.DEVNULL,
                          env=project_env() | {"COLUMNS": "200"}, timeout=120)
    os.close(child)
    shown = b""
    with contextlib.suppress(OSError):  # the pty's reader sees EIO once everything written is read
        while chunk := os.read(main, 65536):
            shown += chunk
    os.close(main)
    assert done.returncode == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown.decode())  # colours off; the line clears (\x1b[2K) stay
    assert "\x1b[2K⏳ enc/cpu benchmark 0s" in text, "the live line appears when the stage starts"
    assert re.search(r"⏳ enc/cpu benchmark \d+s \(round 8, ±[\d.]+% of ±5% target\)", text), text
    last = text.replace("\r\n", "\n").split("\r")[-1]
    assert last.startswith("\x1b[2K✔ enc/cpu") and "benchmark" in last and "done" in last, repr(last)


IN_A_WORKER = textwrap.dedent("""
    from prefect import flow

    from flows import progress

    @flow(name="progress-inner")
    def inner():
        progress.stage_done("enc/fp32/cpu", "build", cached=True)

    @flow(name="progress-outer")
    def outer():
        inner()

    outer()
""")


def test_inside_a_flow_run_a_line_reaches_the_console_once(prefect_server: None) -> None:
    """A worker's output: Prefect's console handler prints the run logger's line; smelter adds no copy,
    in a subflow too (a deployed pipeline runs as one). In a process of its own, as a worker's flow run is."""
    from prefect.settings import PREFECT_API_URL

    done = subprocess.run([sys.executable, "-c", IN_A_WORKER], capture_output=True, text=True, timeout=180,
                          env=project_env(PREFECT_API_URL=PREFECT_API_URL.value()))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "enc/fp32/cpu" in line]
    assert len(lines) == 1, lines
