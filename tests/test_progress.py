"""The terminal during `smelter run`: one line per stage, library noise in the run's log file, a final table."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows import progress
from flows.cli import summary_table
from tasks.spec import load
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
