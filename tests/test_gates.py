"""Gates: each threshold from pipelines.yaml, validity, and no accuracy regression vs the previous version of the
same precision (never another precision's numbers, never the champion's speed: that is the decision's job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.config.settings import GateSettings
from tasks.config.spec import PipelineSpec
from tasks.judge.gates import evaluate
from tasks.metrics import stage_metrics
from tasks.runtime.store import StageResult


def spec(**overrides: Any) -> PipelineSpec:
    body = {
        "name": "enc", "model": {"id": "org/enc", "task": "feature-extraction"},
        "profiles": [{"batch": [1, 2, 4], "seq": [4, 8, 16]}], "precisions": ["fp32"],
        "targets": [{"name": "cpu", "backend": "onnxruntime"}],
        "accuracy": {"gates": {"cosine_mean": {"min": 0.99}, "cosine_min": {"min": 0.97}}},
        "performance": {"gates": {"speedup_vs_reference": {"min": 1.2}, "p99_ms": {"max": 50}}},
    }
    return PipelineSpec.model_validate(body | overrides)


def accuracy(cosine_mean: float = 0.995, cosine_min: float = 0.98, finite: bool = True,
             points: dict[str, bool] | None = None, problems: list[str] | None = None) -> dict[str, Any]:
    return {"metrics": {"cosine_mean": cosine_mean, "cosine_min": cosine_min},
            "validity": {"finite": finite, "points": points or {"min": True, "opt": True, "max": True},
                         "problems": problems or []}}


def benchmark(speedup: float = 1.5, p99: float = 20.0) -> dict[str, Any]:
    return {"gate_point": {"batch": 4, "seq": 8, "p50_ms": p99 / 2, "p90_ms": p99 * 0.8, "p99_ms": p99,
                           "throughput": 400.0, "speedup_vs_reference": speedup,
                           "speedup_vs_reference_ci": [speedup * 0.95, speedup * 1.05]}}


def measured(acc: dict[str, Any], bench: dict[str, Any] | None) -> dict[str, float]:
    stages = {"accuracy": StageResult("enc", "accuracy", "k1", Path("."), {"outputs": acc})}
    if bench is not None:
        stages["benchmark"] = StageResult("enc", "benchmark", "k2", Path("."), {"outputs": bench})
    return stage_metrics(stages)


def judge(acc: dict[str, Any], bench: dict[str, Any] | None, previous: dict[str, Any] | None = None) -> dict:
    results = evaluate(GateSettings.of(spec()), measured(acc, bench), acc.get("validity"), previous)
    return {g.gate: (g.passed, g.reasons) for g in results}


def test_a_good_candidate_passes_every_gate() -> None:
    results = judge(accuracy(), benchmark())
    assert all(passed for passed, _ in results.values()), results
    assert set(results) == {"validity", "accuracy", "performance", "regression"}


@pytest.mark.parametrize(("acc", "bench", "gate", "reason"), [
    (accuracy(cosine_mean=0.95), benchmark(), "accuracy", "cosine_mean 0.95 < min 0.99"),
    (accuracy(cosine_min=float("nan")), benchmark(), "accuracy", "cosine_min is NaN"),
    (accuracy(), benchmark(speedup=1.1), "performance", "speedup_vs_reference 1.1 < min 1.2"),
    (accuracy(), benchmark(p99=80), "performance", "p99_ms 80 > max 50"),
    (accuracy(finite=False), benchmark(), "validity", "NaN or Inf"),
    (accuracy(points={"min": True, "opt": True, "max": False}), benchmark(), "validity", "max shape"),
    (accuracy(), None, "performance", "speedup_vs_reference was not measured"),
])
def test_each_missed_threshold_is_named(acc: dict, bench: dict | None, gate: str, reason: str) -> None:
    passed, reasons = judge(acc, bench)[gate]
    assert not passed
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize(("acc", "bench", "previous", "words"), [
    (accuracy(), benchmark(speedup=1.1, p99=80), None, ["speedup", "p99_ms"]),
    (accuracy(cosine_min=0.9), benchmark(), None, ["cosine_min"]),
    (accuracy(cosine_min=float("nan")), None, None, ["cosine_min", "speedup", "p99_ms"]),
    (accuracy(finite=False), benchmark(), None, ["validity"]),
    (accuracy(cosine_min=0.98), benchmark(), {"version": "3", "metrics": {"accuracy.cosine_min": 0.999}},
     ["regression"]),
])
def test_a_rejected_candidate_is_said_in_a_word_per_missed_gate(acc: dict, bench: dict | None,
                                                                  previous: dict | None, words: list[str]) -> None:
    """The words the summary figure labels a rejected bar with and the runs table's reason cell says: the gates'
    own, not parsed back from their reasons."""
    from tasks.config.spec import Candidate
    from tasks.outcome import CandidateOutcome

    gates = evaluate(GateSettings.of(spec()), measured(acc, bench), acc.get("validity"), previous)
    outcome = CandidateOutcome(Candidate("enc", "fp32", "cpu"), "rejected", gates=gates)
    assert outcome.missed_gates == words


def test_a_missed_speed_threshold_shows_its_interval() -> None:
    _, reasons = judge(accuracy(), benchmark(speedup=1.1))["performance"]
    assert reasons == ("speedup_vs_reference 1.1 < min 1.2 (95% interval [1.04, 1.16])",)


def test_accuracy_regression_is_judged_against_the_previous_version_of_the_same_precision() -> None:
    # The previous version of the same precision is the yardstick: 0.994 against its 0.995 is within 1%.
    previous = {"version": "4", "metrics": {"accuracy.cosine_mean": 0.995}}
    assert judge(accuracy(cosine_mean=0.994), benchmark(), previous)["regression"] == (True, ())
    passed, reasons = judge(accuracy(cosine_mean=0.97), benchmark(), previous)["regression"]
    assert not passed and reasons[0].startswith("accuracy.cosine_mean 0.97 regresses vs v4 of the same precision")
    assert judge(accuracy(), benchmark(), None)["regression"] == (True, ())


def test_accuracy_measured_on_other_eval_data_is_not_compared_and_the_gate_says_why() -> None:
    """The previous version scored 0.999 on another text: 0.97 on today's is no regression of anything known."""
    previous = {"version": "3", "other_data": True}
    passed, reasons = judge(accuracy(cosine_mean=0.97), benchmark(), previous)["regression"]
    assert passed and reasons == ("not compared: v3 of the same precision, and every earlier one, was measured on "
                                  "other eval data (data/eval.txt or accuracy.samples changed since)",)


def test_a_metric_the_previous_version_had_but_this_one_lacks_fails_the_regression_gate() -> None:
    previous = {"version": "2", "metrics": {"accuracy.cosine_min": 0.98}}
    acc = accuracy()
    del acc["metrics"]["cosine_min"]
    passed, reasons = judge(acc, benchmark(), previous)["regression"]
    assert not passed and "accuracy.cosine_min was not measured" in reasons[0]


def test_errors_below_one_regress_only_beyond_the_tolerance_of_one() -> None:
    body = spec().model_dump(exclude={"base_dir"}) | {"accuracy": {"gates": {"max_abs_error": {"max": 1.0}},
                                                                   "regression_tolerance": 0.01}}
    errors = PipelineSpec.model_validate(body)
    previous = {"version": "1", "metrics": {"accuracy.max_abs_error": 1e-6}}

    def gate(value: float) -> bool:
        stages = {"accuracy": StageResult("enc", "accuracy", "k", Path("."), {"outputs": {"metrics": {
            "max_abs_error": value}}})}
        return evaluate(GateSettings.of(errors), stage_metrics(stages), accuracy()["validity"], previous)[3].passed

    assert gate(2e-6) and gate(0.009) and not gate(0.02)


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_threshold_is_refused_instead_of_disabling_its_gate(bound: float) -> None:
    body = spec().model_dump(exclude={"base_dir"})
    body["accuracy"]["gates"]["cosine_mean"] = {"min": bound}
    with pytest.raises(ValueError, match="should be a finite number"):
        PipelineSpec.model_validate(body)


def test_metrics_are_flattened_with_shared_names() -> None:
    metrics = measured(accuracy(), benchmark())
    assert metrics["accuracy.cosine_mean"] == 0.995
    assert metrics["p99_ms"] == 20.0 and metrics["speedup_vs_reference"] == 1.5
