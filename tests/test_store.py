"""The artifact store: content-addressed keys, atomic publication, verified lookups, temp hygiene."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import onnx
import pytest

from tasks.runtime.store import CORRUPT_DIR, CORRUPT_KEEP_S, HASH_CACHE, ArtifactStore, stage_key, tree_digest

REPO = Path(__file__).resolve().parents[1]


def flip(path: Path, offset: int = 0, count: int = 64) -> None:
    """Damage a file in place, size kept (what a bad disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    offset = min(offset, max(len(data) - count, 0))
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def publish(store: ArtifactStore, key: str, files: dict[str, bytes], pipeline: str = "p") -> Path:
    with store.writing(pipeline, "export", key) as w:
        for name, data in files.items():
            (w.dir / name).parent.mkdir(parents=True, exist_ok=True)
            (w.dir / name).write_bytes(data)
        w.outputs["metric"] = 0.987654
    return store.path(pipeline, "export", key)


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
    assert hit.manifest == w.result.manifest, "a fresh result and its later lookup read the same manifest"
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


def onnx_with_external_data(directory: Path) -> dict[str, bytes]:
    """A real ONNX model whose weights live in an external data file beside it."""
    weight = onnx.numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "w")
    node = onnx.helper.make_node("MatMul", ["x", "w"], ["y"])
    io = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, 64]) for name in ("x", "y")]
    graph = onnx.helper.make_graph([node], "g", io[:1], io[1:], [weight])
    onnx.save_model(onnx.helper.make_model(graph), str(directory / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    return {name: (directory / name).read_bytes() for name in ("model.onnx", "model.onnx.data")}


@pytest.mark.parametrize("damaged", ["model.onnx", "model.onnx.data", "engine/plan.bin", "results.json"])
def test_any_file_damaged_with_its_size_kept_is_moved_aside(tmp_path: Path, damaged: str) -> None:
    store = ArtifactStore(tmp_path / "store")
    (tmp_path / "src").mkdir()
    files = onnx_with_external_data(tmp_path / "src") | {"engine/plan.bin": os.urandom(4096),
                                                         "results.json": json.dumps({"p99_ms": 1.25}).encode()}
    final = publish(store, "k", files)
    assert store.lookup("p", "export", "k") is not None  # hashes now cached: damage must still be seen
    size = (final / damaged).stat().st_size
    flip(final / damaged, offset=size // 2)
    assert (final / damaged).stat().st_size == size

    result, problem = ArtifactStore(tmp_path / "store").check("p", "export", "k")
    assert result is None
    assert problem and damaged in problem and "sha256" in problem
    assert not final.exists()
    [aside] = (final.parent / CORRUPT_DIR).iterdir()
    assert aside.name.startswith("k-") and (aside / damaged).stat().st_size == size, "kept for inspection"
    assert str(aside.relative_to(store.root)) in problem


def test_damaged_manifest_missing_file_or_extra_file_is_not_a_hit(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    manifest = publish(store, "a", {"model.onnx": b"graph"}) / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace("0.987654", "0.187654"))  # a result changed, still valid JSON
    assert "manifest.json does not match its own sha256" in store.check("p", "export", "a")[1]
    assert store.lookup("p", "export", "a") is None

    final = publish(store, "b", {"model.onnx": b"graph", "tokenizer.json": b"{}"})
    (final / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in store.check("p", "export", "b")[1]

    final = publish(store, "c", {"model.onnx": b"graph"})
    (final / "model.onnx.data").write_bytes(b"weights the manifest never listed")
    assert "model.onnx.data" in store.check("p", "export", "c")[1]

    final = publish(store, "d", {"model.onnx": b"graph"})
    (final / "manifest.json").write_text("{not json")
    assert "unreadable manifest" in store.check("p", "export", "d")[1]
    assert store.lookup("p", "export", "never-built") is None
    assert len(list((tmp_path / "p" / "export" / CORRUPT_DIR).iterdir())) == 4


def test_hash_cache_spares_rereading_and_is_never_trusted_blindly(tmp_path: Path) -> None:
    final = publish(ArtifactStore(tmp_path), "k", {"engine.bin": os.urandom(1 << 16)})
    warm = ArtifactStore(tmp_path)
    assert warm.lookup("p", "export", "k") is not None
    assert warm.hashes.hits == 1, "the hashes recorded at publication serve a later run's lookup"

    cache = tmp_path / HASH_CACHE
    saved = json.loads(cache.read_text())
    [entry] = saved["entries"].values()
    entry[1] = "0" * 64  # a forged hash: the cache's own digest no longer matches
    cache.write_text(json.dumps(saved))
    forged = ArtifactStore(tmp_path)
    assert forged.lookup("p", "export", "k") is not None and forged.hashes.hits == 0

    cache.write_text("\x00garbage")
    assert ArtifactStore(tmp_path).lookup("p", "export", "k") is not None

    flip(final / "engine.bin")
    assert ArtifactStore(tmp_path).lookup("p", "export", "k") is None


WRITER = """
import sys, time
from tasks.runtime.store import ArtifactStore
with ArtifactStore(sys.argv[1]).writing("p", "build", sys.argv[2]) as w:
    (w.dir / "engine.bin").write_bytes(b"partial")
    print("writing", flush=True)
    time.sleep(600)
"""


def start_writer(root: Path, key: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), key], stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_temp_dirs_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    publish(store, "done", {"a": b"x"})
    live, killed = start_writer(tmp_path, "live"), start_writer(tmp_path, "killed")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        temps = {p.name.split(".")[1]: p for p in (tmp_path / "p" / "build").glob(".*")}
        assert set(temps) == {"live", "killed"}
        old = tmp_path / "p" / "export" / ".k6.abc123"  # another host's (or an older) temp dir: its writer unknown
        young = tmp_path / "p" / "export" / ".k7.def456"
        for tmp in (old, young):
            tmp.mkdir()
        os.utime(old, (time.time() - 2 * 24 * 3600,) * 2)

        removed = store.clean("p")
        assert set(removed) == {temps["killed"], old}
        assert temps["live"].exists(), "a running writer's temp dir is never removed"
        assert young.exists()
        assert store.lookup("p", "export", "done") is not None
    finally:
        live.kill()
        live.wait()
    assert store.clean("p") == [temps["live"]]


def test_damaged_outputs_moved_aside_are_kept_a_week_then_removed(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    for key in ("old", "recent"):
        flip(publish(store, key, {"model.onnx": bytes(256)}) / "model.onnx")
        assert store.lookup("p", "export", key) is None
    corrupt = tmp_path / "p" / "export" / CORRUPT_DIR
    [old] = corrupt.glob("old-*")
    week_ago = datetime.now(timezone.utc) - timedelta(seconds=CORRUPT_KEEP_S + 60)
    old = old.rename(corrupt / f"old-{week_ago:%Y%m%dT%H%M%S.%fZ}")
    unknown = corrupt / "put-here-by-hand"
    unknown.mkdir()

    assert store.clean("p") == [old]
    assert sorted(p.name.split("-")[0] for p in corrupt.iterdir()) == ["put", "recent"], \
        "a recent repair, and anything whose name does not say when it was moved, stays"


def test_an_entry_copied_or_linked_from_another_key_is_not_a_hit(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    source = publish(store, "real", {"model.onnx": b"engine"})
    (source.parent / "linked").symlink_to(source)
    shutil.copytree(source, source.parent / "copied")
    for key in ("linked", "copied"):
        result, problem = store.check("p", "export", key, repair=False)
        assert result is None and "not this entry" in problem
    assert store.lookup("p", "export", "real") is not None


def test_an_unwritable_hash_cache_costs_hashing_not_the_lookup(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    publish(store, "k", {"model.onnx": b"engine"})
    cache = tmp_path / HASH_CACHE
    cache.unlink()
    cache.mkdir()  # something else where the cache file goes
    fresh = ArtifactStore(tmp_path)
    assert fresh.lookup("p", "export", "k") is not None
    assert cache.is_dir()


def test_tree_digest_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    first = tree_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert tree_digest(tmp_path) != first
