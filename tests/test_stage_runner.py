"""The stage runner: code versions in keys, repair of damaged outputs, one build per key across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.runtime.stage_runner import Work, code_version, run_stage
from tasks.runtime.store import ArtifactStore, StageWriter

REPO = Path(__file__).resolve().parents[1]


def module_work(module: str, calls: list[str]) -> Work:
    """A stage whose code is `module` (a real file on sys.path)."""

    def produce(w: StageWriter, _published: object) -> None:
        calls.append(module)
        (w.dir / "out.txt").write_text("computed")

    return Work("p", "toy", {"config": {"n": 1}}, (module,), produce)


@pytest.fixture
def stage_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    code = tmp_path / "code"
    code.mkdir()
    source = code / "toy_stage.py"
    source.write_text('"""Toy stage."""\n\n\ndef compute(x):\n    """Double it."""\n    return 2 * x  # twice\n')
    monkeypatch.syspath_prepend(str(code))
    return "toy_stage", source


def test_a_change_to_what_a_stage_computes_changes_its_key(tmp_path: Path, stage_module: tuple[str, Path]) -> None:
    name, source = stage_module
    store, calls = ArtifactStore(tmp_path / "store"), []
    first = run_stage(module_work(name, calls), store)
    assert run_stage(module_work(name, calls), store).cached and calls == [name]

    source.write_text('"""Toy stage, reworded."""\n\n\ndef compute(x):\n    """Twice x."""\n\n    return 2 * x\n')
    code_version.cache_clear()
    same = run_stage(module_work(name, calls), store)
    assert same.cached and same.key == first.key, "documentation and layout are not what a stage computes"

    source.write_text('"""Toy stage."""\n\n\ndef compute(x):\n    return 3 * x\n')
    code_version.cache_clear()
    fixed = run_stage(module_work(name, calls), store)
    assert fixed.key != first.key and not fixed.cached and len(calls) == 2, "a fix takes effect without --force"


def test_every_stage_key_covers_its_code() -> None:
    from tasks.stages import accuracy, benchmark, build, export, precision, validate

    for module in (export, validate, precision, build, accuracy, benchmark):
        assert module.__name__ in module.CODE
        assert len(code_version(module.CODE)) == 16


def test_a_damaged_output_is_rebuilt_and_reported(tmp_path: Path, stage_module: tuple[str, Path]) -> None:
    name, _ = stage_module
    store, calls = ArtifactStore(tmp_path), []
    first = run_stage(module_work(name, calls), store)
    first.file("out.txt").write_text("tampered")  # same size
    again = run_stage(module_work(name, calls), store)
    assert not again.cached and len(calls) == 2
    assert again.repaired and "out.txt does not match its sha256" in again.repaired and "_corrupt" in again.repaired
    assert again.file("out.txt").read_text() == "computed"
    assert run_stage(module_work(name, calls), store).repaired is None


BUILDER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from tasks.runtime.stage_runner import Work, run_stage, shared_key_lock
    from tasks.runtime.store import ArtifactStore

    root, log, go, use_prefect = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "prefect"
    force = sys.argv[4] == "force"

    def produce(w, _published):
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": "start", "t": time.time()}) + "\\n")
        time.sleep(1.5)
        (w.dir / "engine.bin").write_text(str(os.getpid()))
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": "end", "t": time.time()}) + "\\n")

    if use_prefect:
        from flows.stages import global_key_lock
        shared_key_lock.set(global_key_lock)
    while not go.exists():
        time.sleep(0.01)
    result = run_stage(Work("p", "build", {"config": "same"}, ("tasks.runtime.stage_runner",), produce), ArtifactStore(root), force)
    print(json.dumps({"key": result.key, "cached": result.cached, "engine": result.file("engine.bin").read_text()}))
""")


def race(roots: list[Path], tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> tuple[list[dict], list]:
    """Start one builder process per root on the same key at the same instant; their results and produce log."""
    log, go = tmp_path / "produce.log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(root), str(log), str(go), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": str(REPO)} | (env or {})) for root in roots]
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results, [json.loads(line) for line in log.read_text().splitlines()]


def test_two_processes_building_one_key_build_it_once(tmp_path: Path) -> None:
    results, events = race([tmp_path / "store"] * 2, tmp_path, "file")
    assert [e["event"] for e in events] == ["start", "end"], "one process built, the other waited and reused it"
    assert results[0]["key"] == results[1]["key"]
    assert results[0]["engine"] == results[1]["engine"]
    assert sorted(r["cached"] for r in results) == [False, True]


def test_two_forced_runs_at_once_build_once_and_neither_replaces_what_the_other_reads(tmp_path: Path) -> None:
    """`--force` ignores what was published before it asked; an output another run published while this one
    waited for the key is fresh. Rebuilding it again replaced the directory the first run was reading (its
    engine check then failed: "the cached engine changed since it was built")."""
    store, before, now = tmp_path / "store", tmp_path / "before", tmp_path / "now"
    before.mkdir()
    now.mkdir()
    race([store], before, "file")  # published before either forced run asked
    results, events = race([store] * 2, now, "force")
    assert [e["event"] for e in events] == ["start", "end"], "one forced run rebuilt, the other reused that build"
    assert results[0]["engine"] == results[1]["engine"]
    assert sorted(r["cached"] for r in results) == [False, True]


@pytest.mark.slow
def test_prefect_global_limit_serialises_builders_of_one_key_across_stores(tmp_path: Path,
                                                                           prefect_server: None) -> None:
    """Two hosts do not share a file lock: with separate stores only the global concurrency limit keeps the
    two builds of one key apart in time."""
    from prefect.settings import PREFECT_API_URL

    results, events = race([tmp_path / "host-a", tmp_path / "host-b"], tmp_path, "prefect",
                           {"PREFECT_API_URL": PREFECT_API_URL.value()})
    assert [e["event"] for e in events] == ["start", "end", "start", "end"], "the builds did not overlap"
    assert results[0]["key"] == results[1]["key"]
