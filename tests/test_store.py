"""The artifact store: content-addressed keys, atomic publication, damaged outputs never count as done."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tasks.store import ArtifactStore, stage_key, tree_digest


def test_key_is_stable_and_covers_every_part() -> None:
    base = stage_key("build", upstream="abc", config={"threads": 2, "level": 3}, tools={"onnxruntime": "1.0"})
    assert base == stage_key("build", config={"level": 3, "threads": 2}, tools={"onnxruntime": "1.0"}, upstream="abc")
    assert base != stage_key("build", upstream="abd", config={"threads": 2, "level": 3}, tools={"onnxruntime": "1.0"})
    assert base != stage_key("build", upstream="abc", config={"threads": 4, "level": 3}, tools={"onnxruntime": "1.0"})
    assert base != stage_key("build", upstream="abc", config={"threads": 2, "level": 3}, tools={"onnxruntime": "1.1"})
    assert base != stage_key("export", upstream="abc", config={"threads": 2, "level": 3}, tools={"onnxruntime": "1.0"})


def test_published_output_is_found_with_manifest(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with store.writing("p", "export", "k1", inputs={"model": "m"}, config={"opset": 17}, tools={"onnx": "1"}) as w:
        (w.dir / "model.onnx").write_bytes(b"graph")
        w.outputs["opset"] = 17
    assert w.result is not None and not w.result.cached
    hit = store.lookup("p", "export", "k1")
    assert hit is not None and hit.cached
    assert hit.file("model.onnx").read_bytes() == b"graph"
    assert hit.outputs == {"opset": 17}
    manifest = json.loads((hit.path / "manifest.json").read_text())
    assert manifest["config"] == {"opset": 17}
    assert manifest["files"]["model.onnx"]["bytes"] == 5
    assert len(manifest["files"]["model.onnx"]["sha256"]) == 64
    assert manifest["host"]["cpu_count"] >= 1


def test_failed_stage_leaves_nothing_behind(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError), store.writing("p", "build", "k2") as w:
        (w.dir / "engine.bin").write_bytes(b"half")
        raise RuntimeError("builder crashed")
    assert store.lookup("p", "build", "k2") is None
    assert list((tmp_path / "p" / "build").iterdir()) == []


def test_failed_rebuild_keeps_the_previous_output(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with store.writing("p", "build", "k3") as w:
        (w.dir / "engine.bin").write_bytes(b"good")
    with pytest.raises(RuntimeError), store.writing("p", "build", "k3") as w:
        raise RuntimeError("second build failed")
    assert store.lookup("p", "build", "k3").file("engine.bin").read_bytes() == b"good"


def test_damaged_or_missing_output_is_not_a_hit(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with store.writing("p", "export", "k4") as w:
        (w.dir / "model.onnx").write_bytes(b"graph")
    (store.path("p", "export", "k4") / "model.onnx").write_bytes(b"gr")
    assert store.lookup("p", "export", "k4") is None
    (store.path("p", "export", "k4") / "model.onnx").unlink()
    assert store.lookup("p", "export", "k4") is None
    assert store.lookup("p", "export", "never-built") is None


def test_clean_temp_removes_only_unfinished_dirs(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with store.writing("p", "export", "k5") as w:
        (w.dir / "a").write_text("x")
    stale = store.path("p", "export", "k6").parent / ".k6.abc123"
    fresh = store.path("p", "export", "k7").parent / ".k7.def456"
    other = store.path("q", "export", "k8").parent / ".k8.ghi789"
    for tmp in (stale, fresh, other):
        tmp.mkdir(parents=True)
    old = time.time() - 2 * 24 * 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    store.clean_temp("p")
    assert not stale.exists()
    assert fresh.exists(), "a temp dir this young may belong to a run still writing it"
    assert other.exists(), "another pipeline's temp dirs are left to its own runs"
    assert store.lookup("p", "export", "k5") is not None


def test_tree_digest_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    first = tree_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert tree_digest(tmp_path) != first
