"""The benchmark stage: every engine of a target, the reference and the champion timed in the same rounds.

Timings themselves are not asserted (two shared cores); what a user relies on is that every figure is
derived from the recorded samples, that the ratios come from paired rounds with their intervals, that
the champion is measured side by side (never from stored numbers), and that a measurement taken while
the machine was busy never replaces one already published.
"""

from __future__ import annotations

import multiprocessing
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest

from tasks.backends.base import BackendUnavailable
from tasks.config.spec import PipelineSpec, load
from tasks.config.stage_settings import BenchmarkConfig, BuildConfig, ExportConfig
from tasks.measure import hostload
from tasks.measure.hostload import CONTENDED_SHARE
from tasks.measure.stats import MIN_ROUNDS, looked_ratio
from tasks.metrics import stage_metrics
from tasks.outcome import Champion
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.benchmark import PLOT, REFERENCE, SAMPLES, LatencySamples, for_candidate, run_benchmark
from tasks.stages.build import run_build
from tasks.stages.export import run_export

TARGETS = [{"name": "cpu", "backend": "onnxruntime", "threads": 1},
           {"name": "cpu-basic", "backend": "onnxruntime", "threads": 1, "optimization_level": 1}]


def engines(spec: PipelineSpec, store: ArtifactStore) -> dict[str, StageResult]:
    """The exported graph taken as the fp32 precision output, built for every target of the spec."""
    exported = run_export(ExportConfig.of(spec), store)
    with store.writing(spec.name, "precision", f"fp32-{exported.key}", inputs={"export": exported.key}) as w:
        shutil.copy(exported.file("model.onnx"), w.dir / "model.onnx")
        w.outputs["precision"] = "fp32"
    return {t.name: run_build(BuildConfig.of(spec, t.name, "fp32"), w.result, store) for t in spec.targets}


@pytest.fixture
def encoder(pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, tmp_path: Path) -> tuple[PipelineSpec, ArtifactStore]:
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", targets=TARGETS)).pipelines["tiny"]
    return spec, ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
def encoder_judging_load(pipeline_factory: Callable[..., Path], tiny_bert_dir: Path,
                         tmp_path: Path) -> tuple[PipelineSpec, ArtifactStore]:
    """The encoder with the default contention threshold (the suite's other pipelines ignore the load)."""
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", targets=TARGETS,
                            benchmark={"contended_above": CONTENDED_SHARE})
    return load(path).pipelines["tiny"], ArtifactStore(tmp_path / "artifacts")


def test_latency_samples_derive_percentiles_and_throughput() -> None:
    summary = LatencySamples([float(ms) for ms in range(1, 101)]).summary(batch=4, tokens_per_call=64)
    assert summary["p50_ms"] == pytest.approx(50.5) and summary["p99_ms"] == pytest.approx(99.01)
    assert summary["mean_ms"] == pytest.approx(50.5)
    assert summary["throughput"] == pytest.approx(4 / 0.0505)
    assert summary["tokens_per_s"] == pytest.approx(64 / 0.0505)


def test_engines_of_a_target_and_the_reference_share_rounds_and_every_figure_comes_from_the_samples(
        encoder: tuple[PipelineSpec, ArtifactStore]) -> None:
    spec, store = encoder
    built = engines(spec, store)
    builds = {"tiny/fp32/cpu": built["cpu"], "tiny/fp32/cpu-basic": built["cpu-basic"]}
    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)
    samples = pd.read_csv(result.file(SAMPLES))
    assert list(samples.columns) == ["engine", "batch", "seq", "past", "step", "round", "call", "ms"]
    assert set(samples["engine"]) == {REFERENCE, *builds}
    assert result.outputs["host"]["cpu"] and result.outputs["host"]["load_start"] >= 0
    assert result.outputs["champion"] is None and result.file(PLOT).stat().st_size > 0

    for name in builds:
        view = for_candidate(result, name)
        points = view.outputs["points"]
        assert [(p["batch"], p["seq"]) for p in points] == [(1, 16), (2, 16)]
        assert view.outputs["gate_point"] == points[-1] and "engines" not in view.outputs
        for point in points:
            at = samples[(samples["batch"] == point["batch"]) & (samples["seq"] == point["seq"])]
            mine, reference = at[at["engine"] == name], at[at["engine"] == REFERENCE]
            assert point["rounds"] == mine["round"].nunique() == reference["round"].nunique() >= 3
            assert point["p50_ms"] == pytest.approx(mine["ms"].median())
            assert point["reference_p50_ms"] == pytest.approx(reference["ms"].median())
            per_round = [g["ms"].median() for _, g in mine.groupby("round")]
            per_round_reference = [g["ms"].median() for _, g in reference.groupby("round")]
            expected = looked_ratio(per_round_reference, per_round, max(spec.benchmark.min_rounds, MIN_ROUNDS))
            assert point["speedup_vs_reference"] == pytest.approx(expected.ratio)
            assert point["speedup_vs_reference_ci"] == pytest.approx([expected.low, expected.high])
            assert "vs_champion" not in point
        metrics = stage_metrics({"benchmark": view})
        assert metrics["speedup_vs_reference_ci_low"] <= metrics["speedup_vs_reference"] <= metrics[
            "speedup_vs_reference_ci_high"]
    again = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)
    assert again.key == result.key
    if not result.outputs["host"]["contended"]:  # a contended one is measured again (and kept unless bettered)
        assert again.cached


def test_the_gate_point_gets_the_main_budget_and_other_points_the_survey_budget(
        pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, tmp_path: Path) -> None:
    """Rounds run until the budget is spent (a precision no interval reaches): the gate point, which
    gates and decisions read, runs for max_seconds; the other point's tiny survey budget is spent after
    one round, and the rounds go on to min_rounds, which the result says."""
    benchmark = {"batch_sizes": [1, 2], "seq_lens": [16], "warmup": 1, "min_rounds": 8, "max_seconds": 2,
                 "survey_seconds": 0.001, "precision": 1e-6, "threads": 1}
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", benchmark=benchmark)).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    built = engines(spec, store)
    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": built["cpu"]}, store)
    view = for_candidate(result, "tiny/fp32/cpu")
    survey, gate = view.outputs["points"]
    assert (gate["batch"], survey["batch"]) == (2, 1) and view.outputs["gate_point"] == gate
    assert gate["seconds"] >= 2, gate["seconds"]  # the survey's one round spent its budget: see the note below
    assert gate["rounds"] >= survey["rounds"] == 8
    assert [n.split(":")[0] for n in view.outputs["notes"]] == ["batch 1 seq 16"]
    assert "measured on to 8 rounds" in view.outputs["notes"][0]


def test_the_champion_engine_is_measured_in_the_same_rounds_unless_it_is_a_candidate(
        encoder: tuple[PipelineSpec, ArtifactStore]) -> None:
    spec, store = encoder
    built = engines(spec, store)
    champion = Champion("tiny-cpu", "7", "run-7", built["cpu-basic"].key, "fp32")
    fetched: list[str] = []

    def fetch() -> StageResult:
        fetched.append(champion.version)
        return built["cpu-basic"]

    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": built["cpu"]}, store, champion=champion,
                           champion_build=fetch)
    assert fetched == ["7"]
    assert {"label": "champion v7", "unavailable": None}.items() <= result.outputs["champion"].items()
    assert "champion v7" in set(pd.read_csv(result.file(SAMPLES))["engine"])
    gate = for_candidate(result, "tiny/fp32/cpu", champion).outputs["gate_point"]
    low, high = gate["vs_champion_ci"]
    assert low <= gate["vs_champion"] <= high and isinstance(gate["vs_champion_conclusive"], bool)
    assert {r["versus"] for r in result.outputs["comparisons"]} == {REFERENCE, "champion v7"}

    # The same engine as the champion is the champion: no comparison with itself, no extra engine.
    same = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu-basic": built["cpu-basic"]}, store,
                         champion=champion, champion_build=fetch)
    view = for_candidate(same, "tiny/fp32/cpu-basic", champion)
    assert fetched == ["7"] and view.outputs["champion"]["label"] == "tiny/fp32/cpu-basic"
    assert "vs_champion" not in view.outputs["gate_point"]


def test_every_pair_of_candidates_is_compared_so_any_of_them_can_become_the_champion(
        encoder: tuple[PipelineSpec, ArtifactStore]) -> None:
    spec, store = encoder
    built = engines(spec, store)
    builds = {"tiny/fp32/cpu": built["cpu"], "tiny/fp32/cpu-basic": built["cpu-basic"]}
    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)  # measured while there was no champion
    champion = Champion("tiny-cpu", "1", "run-1", built["cpu-basic"].key, "fp32")
    gate = for_candidate(result, "tiny/fp32/cpu", champion).outputs["gate_point"]
    row = next(r for r in result.outputs["comparisons"] if {r["engine"], r["versus"]} == set(builds)
               and r["step"] == "prefill" and r["batch"] == gate["batch"])
    forward = row["engine"] == "tiny/fp32/cpu"
    assert gate["vs_champion"] == pytest.approx(row["ratio"] if forward else 1 / row["ratio"])
    assert gate["vs_champion_ci"] == pytest.approx(
        [row["ci_low"], row["ci_high"]] if forward else [1 / row["ci_high"], 1 / row["ci_low"]])


def test_a_champion_that_cannot_be_loaded_is_recorded_with_the_reason(encoder: tuple[PipelineSpec, ArtifactStore]) -> None:
    spec, store = encoder
    built = engines(spec, store)
    champion = Champion("tiny-cpu", "2", "run-2", "gone-key", "fp32")

    def fetch() -> StageResult:
        raise BackendUnavailable("engine built for another CPU")

    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": built["cpu"]}, store, champion=champion,
                           champion_build=fetch)
    recorded = for_candidate(result, "tiny/fp32/cpu", champion).outputs["champion"]
    assert recorded["label"] is None and recorded["permanent"] and "another CPU" in recorded["unavailable"]
    assert "vs_champion" not in for_candidate(result, "tiny/fp32/cpu", champion).outputs["gate_point"]


def _spin(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        pass


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """Two processes spinning on the CPU, as a concurrent run or a noisy neighbour would."""
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for process in spinners:
        process.start()
    yield
    stop.set()
    for process in spinners:
        process.join(timeout=10)


def _cpu_ticks(pid: int) -> int:
    """A process's user + system time in clock ticks (proc(5): fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.fixture
def counted_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """A load this test starts and the only one the benchmark's host watch counts: the CPU the machine's other
    processes use (other tests, neighbours) comes and goes, so a watch of the whole host made this test depend
    on how busy the machine happened to be. `start(n)` spins n processes; until then nothing else counts."""
    stop = multiprocessing.Event()
    spinners: list[multiprocessing.Process] = []
    monkeypatch.setattr(hostload, "_busy_ticks",
                        lambda: hostload._own_ticks() + sum(_cpu_ticks(p.pid) for p in spinners))

    def start(processes: int) -> None:
        for _ in range(processes):
            spinner = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
            spinner.start()
            spinners.append(spinner)

    yield start
    stop.set()
    for spinner in spinners:
        spinner.join(timeout=10)


def test_a_contended_measurement_never_replaces_a_published_one(
        pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, tmp_path: Path,
        counted_load: Callable[[int], None]) -> None:
    """Published on a quiet machine (nothing counted), measured again while two processes spin: the second
    measurement is contended and the published one stands, samples and all."""
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", targets=TARGETS,
                                 benchmark={"contended_above": 0.05})).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    builds = {"tiny/fp32/cpu": engines(spec, store)["cpu"]}
    published = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)
    assert published.outputs["host"]["foreign_cpu_share"] == 0.0 and not published.outputs["host"]["contended"]
    before = published.file(SAMPLES).read_bytes()
    counted_load(2)
    again = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store, force=True)
    assert again.key == published.key and again.cached
    assert again.file(SAMPLES).read_bytes() == before
    assert again.kept.startswith("measured again, but other processes used") and not published.kept


def test_a_measurement_published_under_contention_is_taken_again_and_kept_saying_why(
        encoder_judging_load: tuple[PipelineSpec, ArtifactStore], request: pytest.FixtureRequest) -> None:
    spec, store = encoder_judging_load
    builds = {"tiny/fp32/cpu": engines(spec, store)["cpu"]}
    request.getfixturevalue("busy_machine")
    first = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)  # nothing published yet: published, contended
    assert first.outputs["host"]["contended"] and not first.kept
    again = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)  # not reused as is: measured again
    assert again.key == first.key
    if again.kept:  # at least as busy: the published one stands
        assert again.kept.startswith("measured again") and again.cached
        assert again.file(SAMPLES).read_bytes() == first.file(SAMPLES).read_bytes()
    else:  # quieter: it replaces the published one
        assert again.outputs["host"]["foreign_cpu_share"] < first.outputs["host"]["foreign_cpu_share"]


def test_a_less_contended_measurement_replaces_a_busier_published_one() -> None:
    """A re-measurement at 34% of the CPU used by others is kept over one taken at 75%; one at 80% is not."""
    from tasks.stages.benchmark import _busier_than

    published = StageResult("tiny", "benchmark", "k", Path("."),
                            {"outputs": {"host": {"contended": True, "foreign_cpu_share": 0.75}}})
    assert not _busier_than({"foreign_cpu_share": 0.34, "contended": True}, published)
    assert _busier_than({"foreign_cpu_share": 0.80, "contended": True}, published)


def test_decoder_measures_prefill_and_decode_step(pipeline_factory: Callable[..., Path], tiny_llama_dir: Path,
                                                  tmp_path: Path) -> None:
    spec = load(pipeline_factory(tiny_llama_dir, "text-generation-with-past")).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), {"tiny/fp32/cpu": engines(spec, store)["cpu"]}, store)
    view = for_candidate(result, "tiny/fp32/cpu")
    assert [(d["batch"], d["past"]) for d in view.outputs["decode"]] == [(1, 8), (2, 8)]
    for step in view.outputs["decode"]:
        assert step["p50_ms"] <= step["p99_ms"] and step["tokens_per_s"] == pytest.approx(step["throughput"])
        assert step["speedup_vs_reference_ci"][0] <= step["speedup_vs_reference"] <= step["speedup_vs_reference_ci"][1]
    samples = pd.read_csv(result.file(SAMPLES))
    assert set(samples[samples["step"] == "decode"]["seq"]) == {1}
    assert all(p["tokens_per_s"] == pytest.approx(p["throughput"] * 16) for p in view.outputs["points"])


def test_a_decode_step_gate_point_gets_the_main_budget_and_decides_on_decode_ratios(
        pipeline_factory: Callable[..., Path], tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`performance.at: {batch, past}`: a decoder is judged on a decode step (what generating spends its time on), not
    on its prefill. The decode step gets the gate point's budget, the gate point row is that step's, and the ratio
    against the champion and between candidates is read from the decode rounds, not the prefill's."""
    benchmark = {"batch_sizes": [1, 2], "seq_lens": [16], "past_len": 8, "warmup": 1, "min_rounds": 3,
                 "max_seconds": 1.5, "min_seconds": 0, "survey_seconds": 0.001, "precision": 1e-6, "threads": 1,
                 "contended_above": 1.0}
    path = pipeline_factory(tiny_llama_dir, "text-generation-with-past", targets=TARGETS, benchmark=benchmark,
                            performance={"at": {"batch": 2, "past": 8}})
    spec = load(path).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    built = engines(spec, store)
    builds = {"tiny/fp32/cpu": built["cpu"], "tiny/fp32/cpu-basic": built["cpu-basic"]}
    result = run_benchmark(BenchmarkConfig.of(spec, "cpu"), builds, store)
    champion = Champion("tiny-cpu", "1", "run-1", built["cpu-basic"].key, "fp32")
    view = for_candidate(result, "tiny/fp32/cpu", champion).outputs
    gate = view["gate_point"]
    assert (gate["batch"], gate["past"]) == (2, 8) and "seq" not in gate and gate in view["decode"]
    others = [row for row in view["points"] + view["decode"] if row is not gate]
    assert gate["seconds"] >= 1.5 and {row["rounds"] for row in others} == {MIN_ROUNDS}, \
        "the gate point spends the budget; every other point stops at the fewest rounds once its survey time is spent"
    decode_row = next(r for r in result.outputs["comparisons"] if {r["engine"], r["versus"]} == set(builds)
                      and r["step"] == "decode" and r["batch"] == 2)
    forward = decode_row["engine"] == "tiny/fp32/cpu"
    assert gate["vs_champion"] == pytest.approx(decode_row["ratio"] if forward else 1 / decode_row["ratio"])
    assert stage_metrics({"benchmark": for_candidate(result, "tiny/fp32/cpu")})["p50_ms"] == gate["p50_ms"]
