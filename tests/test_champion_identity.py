"""The champion is its engine's bytes, not its build key: a rebuild under the champion's key with other bytes
(TensorRT is not bit-reproducible; `--force`, a repair) is timed beside the registered champion engine, as a
challenger, and the champion is never taken from a store entry that holds other bytes under its key."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.config.spec import PipelineSpec, load
from tasks.config.stage_settings import BenchmarkConfig, BuildConfig, ExportConfig
from tasks.outcome import Champion
from tasks.registry.tracking import engine_identity
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.benchmark import for_candidate, run_benchmark
from tasks.stages.build import run_build
from tasks.stages.champion import CHAMPIONS_DIR, champion_build, same_engine
from tasks.stages.export import run_export

TARGETS = [{"name": "cpu", "backend": "onnxruntime", "threads": 1},
           {"name": "cpu-basic", "backend": "onnxruntime", "threads": 1, "optimization_level": 1}]
TwoEngines = tuple[PipelineSpec, ArtifactStore, StageResult, StageResult]


@pytest.fixture
def two_engines(pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, tmp_path: Path) -> TwoEngines:
    """One exported graph built for two targets: two engines of the same model with other bytes."""
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", targets=TARGETS)).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    exported = run_export(ExportConfig.of(spec), store)
    with store.writing(spec.name, "precision", f"fp32-{exported.key}", inputs={"export": exported.key}) as w:
        shutil.copy(exported.file("model.onnx"), w.dir / "model.onnx")
        w.outputs["precision"] = "fp32"
    first, second = (run_build(BuildConfig.of(spec, t, "fp32"), w.result, store) for t in ("cpu", "cpu-basic"))
    return spec, store, first, second


def test_a_rebuild_under_the_champions_key_is_measured_against_the_champions_own_engine(
        two_engines: TwoEngines) -> None:
    spec, store, rebuilt, registered = two_engines
    # The registry's champion has the build key tonight's engine was built from, but other bytes.
    champion = Champion("tiny-cpu", "7", "run-7", rebuilt.key, "fp32", engine_identity=engine_identity(registered))
    assert not same_engine(champion, rebuilt) and same_engine(champion, registered)
    fetched: list[str] = []

    def fetch() -> StageResult:
        fetched.append(champion.version)
        return registered

    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": rebuilt}, store, champion=champion,
                           champion_build=fetch)
    view = for_candidate(result, "tiny/fp32/cpu", champion)
    assert fetched == ["7"] and view.outputs["champion"]["label"] == "champion v7"
    low, high = view.outputs["gate_point"]["vs_champion_ci"]
    assert low <= view.outputs["gate_point"]["vs_champion"] <= high

    same_bytes = Champion("tiny-cpu", "7", "run-7", "a-key-from-another-toolchain", "fp32",
                          engine_identity=engine_identity(rebuilt))
    again = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": rebuilt}, store, champion=same_bytes,
                          champion_build=fetch)
    view = for_candidate(again, "tiny/fp32/cpu", same_bytes)
    assert fetched == ["7"], "the same bytes are the champion: not loaded twice"
    assert view.outputs["champion"]["label"] == "tiny/fp32/cpu" and "vs_champion" not in view.outputs["gate_point"]


def test_the_champion_is_never_taken_from_a_store_entry_with_other_bytes_under_its_key(two_engines: TwoEngines) -> None:
    spec, store, rebuilt, registered = two_engines
    champion = Champion("tiny-cpu", "7", "run-7", rebuilt.key, "fp32", engine_identity=engine_identity(registered))
    # the registered engine as an earlier run downloaded it from the registry
    shutil.copytree(registered.path, store.root / CHAMPIONS_DIR / "tiny-cpu" / "7")

    got = champion_build(spec.name, champion, store)
    assert got.path == store.root / CHAMPIONS_DIR / "tiny-cpu" / "7" and same_engine(champion, got)
    assert champion_build(spec.name, Champion("tiny-cpu", "8", "run-8", rebuilt.key, "fp32",
                                         engine_identity=engine_identity(rebuilt)), store).path == rebuilt.path
