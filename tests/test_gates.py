"""Gates: each threshold from pipelines.yaml, validity, and no regression vs the champion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.gates import evaluate
from tasks.metrics import stage_metrics
from tasks.spec import PipelineSpec
from tasks.store import StageResult


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
                           "throughput": 400.0, "speedup_vs_reference": speedup}}


def measured(acc: dict[str, Any], bench: dict[str, Any] | None) -> dict[str, float]:
    stages = {"accuracy": StageResult("enc", "accuracy", "k1", Path("."), {"outputs": acc})}
    if bench is not None:
        stages["benchmark"] = StageResult("enc", "benchmark", "k2", Path("."), {"outputs": bench})
    return stage_metrics(stages)


def judge(acc: dict[str, Any], bench: dict[str, Any] | None, champion: dict[str, Any] | None = None) -> dict:
    results = evaluate(spec(), measured(acc, bench), acc.get("validity"), champion)
    return {g.gate: (g.passed, g.reasons) for g in results}


def test_a_good_candidate_passes_every_gate() -> None:
    results = judge(accuracy(), benchmark())
    assert all(passed for passed, _ in results.values()), results
    assert set(results) == {"validity", "accuracy", "performance", "champion"}


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


def test_champion_regression_uses_the_side_by_side_speedup() -> None:
    metrics = measured(accuracy(), benchmark(speedup=1.5))
    champion = {"version": "3", "metrics": metrics | {"speedup_vs_reference": 1.8}}
    passed, reasons = judge(accuracy(), benchmark(speedup=1.5), champion)["champion"]
    assert not passed and "regresses vs champion v3" in reasons[0]
    within_noise = {"version": "3", "metrics": metrics | {"speedup_vs_reference": 1.55}}
    assert judge(accuracy(), benchmark(speedup=1.5), within_noise)["champion"][0]


def test_champion_accuracy_regression_beyond_tolerance_fails() -> None:
    champion = {"version": "1", "metrics": {"accuracy.cosine_mean": 0.999, "speedup_vs_reference": 1.0}}
    passed, reasons = judge(accuracy(cosine_mean=0.991), benchmark(), champion)["champion"]
    assert not passed and "accuracy.cosine_mean" in reasons[0]
    assert judge(accuracy(cosine_mean=0.998), benchmark(), champion)["champion"][0]


def test_metrics_are_flattened_with_shared_names() -> None:
    metrics = measured(accuracy(), benchmark())
    assert metrics["accuracy.cosine_mean"] == 0.995
    assert metrics["p99_ms"] == 20.0 and metrics["speedup_vs_reference"] == 1.5
