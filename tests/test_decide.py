"""The decision rules, case by case: who takes the alias, who keeps it, and the reason each candidate gets.

Measurements here are written as the benchmark stage reports them (ratios with 95% intervals, measured
side by side); the rules themselves are plain functions of those, so every case is exact.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import pytest

from tasks.config.settings import DecisionSettings
from tasks.config.spec import Candidate, PipelineSpec
from tasks.judge.decide import decide
from tasks.outcome import CandidateOutcome, Champion, GateResult
from tasks.runtime.store import StageResult

SPEC = PipelineSpec.model_validate({
    "name": "enc", "model": {"id": "org/enc", "task": "feature-extraction"},
    "profiles": [{"batch": [1, 4, 8], "seq": [8, 16, 32]}], "precisions": ["fp32", "fp16", "int8"],
    "targets": [{"name": "cpu", "backend": "onnxruntime"}],
    "benchmark": {"batch_sizes": [1, 8], "seq_lens": [16], "precision": 0.05},
    "performance": {"min_improvement": 0.05},
})
CHAMPION = Champion("enc-cpu", "3", "run-3", "key-fp32", "fp32")


def candidate(precision: str, *, speedup: float = 2.0, vs_champion: tuple[float, float, float] | None = None,
              conclusive: bool = True, passed: bool = True, key: str | None = None,
              champion: dict[str, Any] | None = None, comparisons: list[dict[str, Any]] | None = None,
              model: str | None = None, at: dict[str, int] | None = None) -> CandidateOutcome:
    """A gated candidate whose target benchmark measured it at batch 8 (the throughput gate point);
    `comparisons`: the target's side-by-side ratios, as the benchmark stage shares them; `model`: the digest
    of the model files its export read; `at`: another gate point (a decode step's {batch, past})."""
    point = (at or {"batch": 8, "seq": 16}) | {"p50_ms": 10.0, "speedup_vs_reference": speedup,
             "speedup_vs_reference_ci": [speedup * 0.97, speedup * 1.03], "speedup_vs_reference_conclusive": True}
    if vs_champion is not None:
        ratio, low, high = vs_champion
        point |= {"vs_champion": ratio, "vs_champion_ci": [low, high], "vs_champion_conclusive": conclusive}
    outputs = {"points": [point], "gate_point": point, "champion": champion, "comparisons": comparisons or []}
    stages = {"build": StageResult("enc", "build", key or f"key-{precision}", Path("."), {"outputs": {}}),
              "benchmark": StageResult("enc", "benchmark", "bench", Path("."), {"outputs": outputs})}
    if model is not None:
        stages["export"] = StageResult("enc", "export", "export", Path("."), {"outputs": {"model_source": model}})
    gates = [GateResult("accuracy", passed, () if passed else ("cosine_mean 0.9 < min 0.99",))]
    return CandidateOutcome(Candidate("enc", precision, "cpu"), "passed" if passed else "rejected", stages=stages,
                            gates=gates)


def measured(label: str | None, **extra: Any) -> dict[str, Any]:
    return {"version": "3", "label": label, "build_key": "key-fp32", "unavailable": None, "permanent": False} | extra


def run(*outcomes: CandidateOutcome, champion: Champion | None = CHAMPION) -> dict[str, tuple[bool, bool, str]]:
    decide(DecisionSettings.of(SPEC), list(outcomes), {"cpu": champion})
    return {o.candidate.precision: (o.decision.take_alias, o.decision.holds_alias, o.decision.reason)
            for o in outcomes}


def test_without_a_champion_the_fastest_passing_candidate_takes_the_alias() -> None:
    result = run(candidate("fp32", speedup=1.5), candidate("int8", speedup=3.0),
                 candidate("fp16", speedup=9.0, passed=False), champion=None)
    assert result["int8"][:2] == (True, True) and result["int8"][2].startswith("no champion yet")
    assert result["fp32"] == (False, False, "no champion yet: enc/int8/cpu is faster")
    assert result["fp16"] == (False, False, "accuracy: cosine_mean 0.9 < min 0.99")


def side_by_side(engine: str, versus: str, ratio: float, low: float, high: float, step: str = "prefill") -> dict[str, Any]:
    """A row of the benchmark's comparison table at the gate point (or at the decode step after 64 tokens): `engine`
    is `ratio` times as fast as `versus`."""
    where = {"seq": 16, "past": 0} if step == "prefill" else {"seq": 1, "past": 64}
    return {"step": step, "batch": 8, **where, "engine": f"enc/{engine}/cpu",
            "versus": f"enc/{versus}/cpu", "ratio": ratio, "ci_low": low, "ci_high": high, "conclusive": True}


@pytest.mark.parametrize("lead, taker", [((1.03, 0.97, 1.09), "fp32"), ((1.20, 1.12, 1.28), "int8")])
def test_a_first_champion_is_not_crowned_on_noise(lead: tuple[float, float, float], taker: str) -> None:
    """int8's point estimate is ahead; its lead over fp32, measured side by side, decides: within noise
    (interval holds 1) the higher precision takes the alias, a lead beyond noise goes to the faster."""
    table = [side_by_side("int8", "fp32", *lead)]
    result = run(candidate("fp32", speedup=3.6, comparisons=table), candidate("int8", speedup=3.7, comparisons=table),
                 champion=None)
    assert [p for p, (take, _, _) in result.items() if take] == [taker]
    if taker == "fp32":
        assert result["fp32"][2] == ("no champion yet: a tie on speed (enc/int8/cpu vs enc/fp32/cpu 1.03x [0.97, 1.09]: "
                                     "the interval holds 1), so the higher precision takes it")
        assert result["int8"][2] == "no champion yet: enc/fp32/cpu takes it (a tie on speed)"
    else:
        assert result["int8"][2] == "no champion yet: fastest passing candidate"
        assert result["fp32"][2] == "no champion yet: enc/int8/cpu is faster"


def test_a_decode_step_gate_point_reads_the_decode_rounds_not_the_prefill() -> None:
    """With `performance.at: {batch, past}` the lead between candidates is the decode step's: int8's prefill lead is
    beyond noise, its decode step ties with fp32, so the higher precision takes the alias."""
    table = [side_by_side("int8", "fp32", 1.20, 1.12, 1.28), side_by_side("int8", "fp32", 1.01, 0.96, 1.06, "decode")]
    at = {"batch": 8, "past": 64}
    result = run(candidate("fp32", speedup=3.6, comparisons=table, at=at),
                 candidate("int8", speedup=3.7, comparisons=table, at=at), champion=None)
    assert [p for p, (take, _, _) in result.items() if take] == ["fp32"]
    assert "1.01x [0.96, 1.06]" in result["fp32"][2]


def test_only_the_tied_candidates_say_a_tie_a_slower_one_says_how_much_slower() -> None:
    """fp32 and int8 tie, fp32 takes it; fp16 is significantly slower than int8 and is told so, with the ratio."""
    table = [side_by_side("int8", "fp32", 1.03, 0.97, 1.09), side_by_side("int8", "fp16", 1.28, 1.26, 1.29)]
    result = run(candidate("fp32", speedup=3.6, comparisons=table), candidate("int8", speedup=3.7, comparisons=table),
                 candidate("fp16", speedup=2.9, comparisons=table), champion=None)
    assert result["fp32"][:2] == (True, True)
    assert result["int8"][2] == "no champion yet: enc/fp32/cpu takes it (a tie on speed)"
    assert result["fp16"] == (False, False, "no champion yet: enc/fp32/cpu takes it; this one is slower: "
                                            "0.781x [0.775, 0.794] vs enc/int8/cpu")


def test_a_tie_read_the_other_way_round_in_the_table_is_a_tie_too() -> None:
    """The table may hold the pair either way round: fp32 0.97x [0.92, 1.03] of int8 is the same tie."""
    table = [side_by_side("fp32", "int8", 0.97, 0.92, 1.03)]
    result = run(candidate("fp32", speedup=3.6, comparisons=table), candidate("int8", speedup=3.7, comparisons=table),
                 champion=None)
    assert result["fp32"][:2] == (True, True) and "a tie on speed" in result["fp32"][2]


def test_the_candidate_with_the_champions_build_key_is_the_champion_and_nothing_moves() -> None:
    label = "enc/fp32/cpu"
    result = run(candidate("fp32", champion=measured(label)),
                 candidate("int8", vs_champion=(0.62, 0.60, 0.64), champion=measured(label)))
    assert result["fp32"] == (False, True, "holds the alias (champion v3)")
    assert result["int8"][:2] == (False, False)
    assert result["int8"][2].startswith("slower: 0.62x [0.6, 0.64] vs champion v3 (a significant regression")


def test_a_conclusively_better_candidate_takes_the_alias() -> None:
    label = "enc/fp32/cpu"
    fp32 = candidate("fp32", champion=measured(label))
    int8 = candidate("int8", vs_champion=(1.15, 1.10, 1.20), champion=measured(label))
    result = run(fp32, int8)
    assert result["int8"][:2] == (True, True) and result["int8"][2].startswith("faster: 1.15x [1.1, 1.2]")
    assert result["fp32"] == (False, False, "loses the alias to enc/int8/cpu")
    assert int8.decision.vs_champion == {"version": "3", "ratio": 1.15, "ci": [1.10, 1.20], "conclusive": True}


@pytest.mark.parametrize(("ratio", "conclusive", "word"), [
    ((1.02, 0.99, 1.05), True, "not significant"),   # within noise
    ((1.04, 1.01, 1.07), True, "not significant"),   # real, but below min_improvement
    ((1.30, 0.90, 1.70), False, "inconclusive"),     # interval too wide: never moves
])
def test_small_or_uncertain_gains_move_nothing(ratio: tuple[float, float, float], conclusive: bool, word: str) -> None:
    label = "enc/fp32/cpu"
    result = run(candidate("fp32", champion=measured(label)),
                 candidate("int8", vs_champion=ratio, conclusive=conclusive, champion=measured(label)))
    assert result["int8"][:2] == (False, False) and result["int8"][2].startswith(word)
    assert result["fp32"][1], "the champion keeps the alias"


def test_a_regression_is_reported_even_when_the_interval_is_wider_than_the_precision() -> None:
    label = "enc/fp32/cpu"
    result = run(candidate("fp32", champion=measured(label)),
                 candidate("int8", vs_champion=(0.84, 0.79, 0.90), conclusive=False, champion=measured(label)))
    assert result["int8"][:2] == (False, False) and result["int8"][2].startswith("slower: 0.84x")


def test_a_champion_that_fails_todays_gates_gives_the_alias_to_the_fastest_passing_candidate() -> None:
    label = "enc/fp32/cpu"
    result = run(candidate("fp32", passed=False, champion=measured(label)),
                 candidate("int8", vs_champion=(0.98, 0.95, 1.01), champion=measured(label)))
    assert result["int8"][:2] == (True, True)
    assert result["int8"][2] == "champion v3 fails today's gates: fastest passing candidate"
    assert result["fp32"][:2] == (False, False)


def test_a_failing_champion_with_nobody_to_replace_it_keeps_the_alias_and_says_so() -> None:
    result = run(candidate("fp32", passed=False, champion=measured("enc/fp32/cpu")))
    assert result["fp32"][1] and "still holds the alias" in result["fp32"][2]


def test_a_champion_that_cannot_run_here_any_more_is_replaced_only_when_that_is_permanent() -> None:
    gone = measured(None, unavailable="BackendUnavailable: built for another CPU", permanent=True)
    result = run(candidate("int8", champion=gone, key="key-int8-new"))
    assert result["int8"][0] and "cannot run here" in result["int8"][2]
    flaky = measured(None, unavailable="ConnectionError: registry unreachable", permanent=False)
    result = run(candidate("int8", champion=flaky, key="key-int8-new"))
    assert result["int8"] == (False, False, "champion v3 cannot run here (ConnectionError: registry unreachable): "
                                            "nothing moves")


def test_a_champion_measured_as_its_own_engine_is_compared_like_a_candidate() -> None:
    # Tonight's fp32 has a new build key (a new toolchain): the old champion engine ran beside it.
    result = run(candidate("fp32", key="key-fp32-new", vs_champion=(1.2, 1.15, 1.25),
                           champion=measured("champion v3")))
    assert result["fp32"][:2] == (True, True)


def test_the_best_sibling_is_the_one_compared_with_the_champion() -> None:
    label = "champion v3"
    fp16 = candidate("fp16", key="k16", vs_champion=(1.08, 1.06, 1.10), champion=measured(label))
    int8 = candidate("int8", key="k8", vs_champion=(1.40, 1.35, 1.45), champion=measured(label))
    result = run(fp16, int8)
    assert result["int8"][0] and not result["fp16"][0]
    assert result["fp16"][2].endswith("; enc/int8/cpu is faster")


# --- issue 22: errors, mismatched engines, NaN samples, budgets and busy machines ---------------------------------

def busy(outcome: CandidateOutcome, share: float = 0.68) -> CandidateOutcome:
    """The candidate's target measurement was taken while other processes used `share` of the CPU; its gates as
    tasks/judge/gates.py judges them then (timing inconclusive, accuracy as measured)."""
    from tasks.judge.gates import performance_gate

    benchmark = outcome.stages["benchmark"]
    outputs = benchmark.outputs | {"host": {"foreign_cpu_share": share, "contended": True}}
    outcome.stages["benchmark"] = StageResult("enc", "benchmark", "bench", Path("."), {"outputs": outputs})
    contended = {"host.contended": 1.0, "host.foreign_cpu_share": share}
    outcome.gates = [*outcome.gates, performance_gate(SPEC.performance.gates, contended)]
    outcome.status = "passed" if outcome.passed_gates else "rejected"  # as the flow's gate task sets it
    return outcome


def test_a_champion_candidate_that_errored_moves_nothing() -> None:
    """An error (a crashed accuracy run, a full disk) is no verdict on the champion: nobody takes its alias."""
    fp32 = candidate("fp32", champion=measured("enc/fp32/cpu"))
    fp32.status, fp32.error = "failed", "accuracy failed: OSError: [Errno 28] No space left on device"
    result = run(fp32, candidate("int8", speedup=9.0, champion=measured("enc/fp32/cpu")))
    assert result["int8"][:2] == (False, False)
    assert "champion v3 errored today" in result["int8"][2] and result["int8"][2].endswith("nothing moves")
    assert result["fp32"][1] and "still holds the alias" in result["fp32"][2]


@pytest.mark.parametrize("backend", ["tensorrt", "inductor"])
def test_a_champion_candidate_whose_engine_mismatches_this_machine_gives_way(backend: str) -> None:
    fp32 = candidate("fp32", champion=measured("enc/fp32/cpu"))
    fp32.status = "failed"
    fp32.error = f"accuracy failed: EngineMismatch: {backend} engine built for another GPU or runtime"
    result = run(fp32, candidate("int8", champion=measured("enc/fp32/cpu")))
    assert result["int8"][:2] == (True, True)
    assert result["int8"][2].startswith("champion v3 cannot run here (accuracy failed: EngineMismatch")
    assert result["int8"][2].endswith("fastest passing candidate")


def _mismatch(backend: str) -> Exception:
    if backend == "tensorrt":
        from tasks.backends.tensorrt.plan import EngineMismatch
    else:
        from tasks.backends.inductor.backend import EngineMismatch
    return EngineMismatch(f"{backend} engine was built for another machine")


@pytest.mark.parametrize("backend", ["tensorrt", "inductor"])
def test_a_champion_engine_that_cannot_load_for_an_engine_mismatch_is_unavailable_for_good(backend: str) -> None:
    """What the benchmark records when the champion's engine does not load (tasks/stages/benchmark.py): any backend's
    EngineMismatch is permanent, so the alias may leave it; a registry that does not answer is not."""
    from tasks.stages.champion import ChampionUnavailable, cannot_run_here

    error = _mismatch(backend)
    gone = measured(None, unavailable=f"{type(error).__name__}: {error}", permanent=cannot_run_here(error))
    result = run(candidate("int8", champion=gone, key="key-int8-new"))
    assert result["int8"][:2] == (True, True)
    assert result["int8"][2] == (f"champion v3 cannot run here (EngineMismatch: {backend} engine was built for another "
                                 "machine): fastest passing candidate")
    assert not cannot_run_here(ChampionUnavailable("registry did not answer", permanent=False))
    assert not cannot_run_here(OSError("connection reset"))


def test_a_nan_in_one_sample_fails_the_accuracy_gate_and_names_the_sample() -> None:
    """A mean over samples that skips a NaN would pass; the gate sees it and says which sample."""
    import pandas as pd

    from tasks.stages.accuracy import _aggregate, nonfinite_samples
    from tasks.config.settings import GateSettings
    from tasks.judge.gates import evaluate

    table = pd.DataFrame({"sample": [0, 1, 2, 3], "cosine": [0.999, 0.998, float("nan"), 0.999],
                          "max_abs_error": [1e-3, 2e-3, float("nan"), 1e-3]})
    assert table["cosine"].mean() > 0.99  # what pandas would have reported
    spec = SPEC.model_copy(update={"accuracy": SPEC.accuracy.model_copy(update={"gates": {"cosine_mean": _min(0.99)}})})
    metrics = {"accuracy.cosine_mean": _aggregate(table["cosine"], "mean")}
    validity = {"finite": True, "points": {"min": True, "opt": True, "max": True}, "problems": [],
                "nonfinite_samples": nonfinite_samples(table)}
    accuracy = next(g for g in evaluate(GateSettings.of(spec), metrics, validity, None) if g.gate == "accuracy")
    assert not accuracy.passed
    assert "cosine_mean is NaN" in accuracy.reasons
    assert "cosine is NaN or Inf in sample 2" in accuracy.reasons


def _min(value: float) -> Any:
    from tasks.config.spec import Threshold

    return Threshold(min=value)


def test_a_budget_below_min_rounds_is_refused_by_validate() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="cannot fit 6 rounds"):
        PipelineSpec.model_validate(SPEC.model_dump() | {"benchmark": {"min_rounds": 3, "max_seconds": 0.001}})
    with pytest.raises(ValidationError, match="cannot fit 40 rounds"):
        PipelineSpec.model_validate(SPEC.model_dump() | {"benchmark": {"min_rounds": 40, "max_seconds": 1}})
    PipelineSpec.model_validate(SPEC.model_dump() | {"benchmark": {"min_rounds": 3, "max_seconds": 1}})
    for rounds in range(1, 41):  # the least the message names is accepted, whatever its float rounding
        with pytest.raises(ValidationError, match=r"give at least (\S+)") as refused:
            PipelineSpec.model_validate(SPEC.model_dump() | {"benchmark": {"min_rounds": max(3, rounds),
                                                                          "max_seconds": 0.001}})
        least = float(re.search(r"give at least (\S+)", str(refused.value)).group(1))
        PipelineSpec.model_validate(SPEC.model_dump() | {"benchmark": {"min_rounds": max(3, rounds), "max_seconds": least}})


def test_a_contended_measurement_leaves_candidates_pending_and_the_champion_in_place() -> None:
    label = "enc/fp32/cpu"
    fp32 = busy(candidate("fp32", champion=measured(label)))
    int8 = busy(candidate("int8", vs_champion=(1.40, 1.30, 1.50), champion=measured(label)))
    result = run(fp32, int8)
    assert (fp32.status, int8.status) == ("pending", "pending")
    assert not result["int8"][0] and result["int8"][2].startswith("machine busy (other processes used 68%")
    assert result["fp32"][1], "the champion keeps the alias"
    assert not int8.passed_gates, "a pending candidate is not registered"
    gate = next(g for g in int8.gates if g.gate == "performance")
    assert gate.inconclusive and "machine busy" in gate.reasons[0]


def test_on_a_busy_machine_accuracy_still_rejects() -> None:
    bad = busy(candidate("fp16", passed=False))
    run(bad, busy(candidate("int8")), champion=None)
    assert bad.status == "rejected" and "cosine_mean 0.9 < min 0.99" in bad.decision.reason


def test_the_first_champion_is_never_crowned_on_contended_numbers() -> None:
    fp32, int8 = busy(candidate("fp32", speedup=1.5)), busy(candidate("int8", speedup=200.0))
    result = run(fp32, int8, champion=None)
    assert not any(take or holds for take, holds, _ in result.values())
    assert {fp32.status, int8.status} == {"pending"}


def test_contended_numbers_that_passed_the_gates_still_move_nothing() -> None:
    """No performance gate configured (every gate passes): the busy speedups still crown nobody."""
    fp32, int8 = candidate("fp32", speedup=1.5), candidate("int8", speedup=200.0)
    for outcome in (fp32, int8):
        outputs = outcome.stages["benchmark"].outputs | {"host": {"foreign_cpu_share": 0.8, "contended": True}}
        outcome.stages["benchmark"] = StageResult("enc", "benchmark", "bench", Path("."), {"outputs": outputs})
    result = run(fp32, int8, champion=None)
    assert not any(take for take, _, _ in result.values()) and int8.status == "pending"


# --- identity by engine bytes, and the alias moved meanwhile --------------------------------------------------------

def with_bytes(outcome: CandidateOutcome, sha256: str) -> CandidateOutcome:
    """The candidate's build manifest lists one engine file with this sha256: what identifies the engine."""
    build = outcome.stages["build"]
    manifest = build.manifest | {"files": {"model.plan": {"sha256": sha256, "bytes": 1}}}
    outcome.stages["build"] = StageResult("enc", "build", build.key, Path("."), manifest)
    return outcome


def champion_of(sha256: str) -> Champion:
    from tasks.registry.tracking import engine_identity

    digest = engine_identity(with_bytes(candidate("fp32"), sha256).stages["build"])
    return Champion("enc-cpu", "3", "run-3", "key-fp32", "fp32", engine_identity=digest)


def test_a_rebuild_with_the_champions_build_key_but_other_bytes_is_a_challenger_not_the_champion() -> None:
    """TensorRT builds are not bit-reproducible: after `--force` or a repair the same inputs give other bytes,
    which are measured against the registered champion like any candidate, and win only on the usual terms."""
    rebuilt = with_bytes(candidate("fp32", vs_champion=(1.01, 0.99, 1.03), champion=measured("champion v3")), "b" * 64)
    result = run(rebuilt, champion=champion_of("a" * 64))
    assert result["fp32"] == (False, False, "not significant: 1.01x [0.99, 1.03] vs champion v3 (needs ≥ 1.05x "
                                            "with the interval above 1)")
    faster = with_bytes(candidate("fp32", vs_champion=(1.2, 1.15, 1.25), champion=measured("champion v3")), "b" * 64)
    assert run(faster, champion=champion_of("a" * 64))["fp32"][:2] == (True, True)

    same = with_bytes(candidate("fp32", key="key-fp32-other-toolchain", champion=measured("enc/fp32/cpu")), "a" * 64)
    assert run(same, champion=champion_of("a" * 64))["fp32"] == (False, True, "holds the alias (champion v3)"), \
        "the same bytes are the champion, whatever key built them"


def test_a_decision_records_the_champion_it_saw_and_the_alias_moved_while_measuring_moves_nothing() -> None:
    """Promotion moves the alias only from `Decision.champion` (compare-and-set, tasks/judge/promote.py); and when the
    benchmark timed another version than the run's champion, the comparison is with the wrong engine."""
    int8 = candidate("int8", vs_champion=(1.4, 1.3, 1.5), champion=measured("champion v3"))
    run(int8)
    assert int8.decision.take_alias and int8.decision.champion == "3"
    none_yet = candidate("int8")
    run(none_yet, champion=None)
    assert none_yet.decision.take_alias and none_yet.decision.champion is None

    moved = candidate("int8", vs_champion=(1.4, 1.3, 1.5), champion=measured("champion v4", version="4"))
    result = run(moved)
    assert result["int8"][:2] == (False, False)
    assert result["int8"][2].startswith("the champion measured, v4, is not v3, which held the alias when this run "
                                        "started: the alias moved meanwhile; nothing moves")


OLD_MODEL, NEW_MODEL = "a" * 52 + "0123456789ab", "b" * 52 + "ba9876543210"


@pytest.mark.parametrize("recorded", ["version", "benchmark"])
def test_a_retrained_model_takes_the_alias_though_it_is_no_faster_than_the_champion(recorded: str) -> None:
    """The champion's engine came from other model files: today's fastest passing candidate replaces it, whatever
    the speed comparison says. Its version records the digest, or the benchmark read it in the champion's build."""
    champion = Champion("enc-cpu", "3", "run-3", "key-fp32", "fp32", model_source=OLD_MODEL if recorded == "version"
                        else None)
    seen = measured("champion v3", model_source=OLD_MODEL if recorded == "benchmark" else None)
    result = run(candidate("fp32", vs_champion=(0.989, 0.97, 1.01), champion=seen, model=NEW_MODEL, key="new-fp32"),
                 candidate("int8", vs_champion=(0.95, 0.93, 0.97), champion=seen, model=NEW_MODEL),
                 champion=champion)
    why = ("champion v3 was built from other model files (…0123456789ab), today's are (…ba9876543210): "
           "the new model takes the alias")
    assert result["fp32"] == (True, True, f"{why}: fastest passing candidate")
    assert result["int8"] == (False, False, f"{why}: enc/fp32/cpu is faster")


@pytest.mark.parametrize("champion_model", [None, NEW_MODEL])
def test_a_champion_of_the_same_or_an_unrecorded_model_is_judged_on_speed(champion_model: str | None) -> None:
    """Same model files (a toolchain upgrade changed the build key), or a version from before digests were
    recorded: speed decides, as ever."""
    champion = Champion("enc-cpu", "3", "run-3", "key-fp32", "fp32", model_source=champion_model)
    result = run(candidate("fp32", vs_champion=(0.989, 0.97, 1.01), champion=measured("champion v3"), model=NEW_MODEL,
                           key="new-fp32"), champion=champion)
    assert result["fp32"][:2] == (False, False) and result["fp32"][2].startswith("not significant: 0.989x")


@pytest.mark.parametrize("int8_passes", [True, False])
def test_a_champion_none_of_the_candidates_built_is_still_named_as_what_to_deploy(int8_passes: bool) -> None:
    """The champion's engine is of earlier settings, so no candidate of this run is it: whether one passed without
    taking the alias or all missed a gate, the alias stays on it, and `smelter run`'s last line says so (not
    "nothing to deploy yet")."""
    from flows.cli import _next_step
    from tasks.config.spec import PipelinesFile

    champion = Champion("enc-cpu", "3", "run-3", "key-of-earlier-settings", "int8")
    outcomes = [candidate("fp32", passed=False),
                candidate("int8", passed=int8_passes, vs_champion=(1.02, 0.92, 1.09), conclusive=False)]
    decide(DecisionSettings.of(SPEC), outcomes, {"cpu": champion})
    assert not any(o.decision.holds_alias for o in outcomes)
    specs = PipelinesFile(path=Path("pipelines.yaml"), pipelines={"enc": SPEC})
    line = _next_step([o.summary() for o in outcomes], specs, Path("run.log"))
    assert line == "nothing moved; models:/enc-cpu@champion (v3) stays what to deploy; each candidate's reason is above"
