"""The table `smelter run` prints last: the alias by its name, and a key metric that is the number the
reason speaks of, at the point it was measured."""

from __future__ import annotations

import pytest

from flows.cli import summary_table
from tasks.config.spec import load
from tasks.stages.benchmark import LatencySamples


def _summary(candidate: str, status: str, **extra) -> dict:
    pipeline, precision, target = candidate.split("/")
    return {"candidate": candidate, "pipeline": pipeline, "precision": precision, "target": target,
            "status": status, "gates": [], "metrics": {"throughput": 519.8, "p99_ms": 8.25}, "error": None,
            "model_version": None} | extra


def test_the_alias_is_named_and_metric_and_reason_speak_of_one_ratio_at_one_point(pipeline_factory, tiny_bert_dir):
    specs = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", promotion={"alias": "prod"}))
    slower = {"ratio": 0.23, "ci": [0.184, 0.269], "version": "2", "conclusive": True}
    rows = summary_table([
        _summary("enc/fp32/cpu", "passed", model_version="2",
                 decision={"reason": "it is the champion: not compared with itself", "holds_alias": True}),
        _summary("enc/int8/cpu", "passed", model_version="3", decision={
            "reason": "slower: 0.23x [0.184, 0.269] vs champion v2 (a significant regression: the interval is below 1)",
            "vs_champion": slower, "holds_alias": False}),
    ], specs).splitlines()

    header, champion, candidate = rows
    assert "v2 @prod" in champion and "@alias" not in champion
    assert "519.8/s @ b2×s16" in champion, "the objective at the gate point (largest batch, first seq)"
    assert "0.23x vs v2, 519.8/s @ b2×s16" in candidate and " v3 " in candidate and "@prod" not in candidate
    assert candidate.endswith("below 1) at batch 2 × seq 16"), "the reason names the same point"


def test_a_measurement_on_a_busy_machine_or_too_wide_to_tell_is_flagged(pipeline_factory, tiny_bert_dir):
    specs = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc"))
    wide = {"ratio": 1.02, "ci": [0.9, 1.15], "version": "1", "conclusive": False}
    wide_but_slower = {"ratio": 0.77, "ci": [0.72, 0.83], "version": "1", "conclusive": False}
    busy, unsure, quiet, slower = summary_table([
        _summary("enc/fp32/cpu", "pending", stages={"benchmark": {"key": "k", "cached": False, "contended": True}},
                 decision={"reason": "timed on a busy machine: the next quiet run decides"}),
        _summary("enc/int8/cpu", "passed", model_version="2",
                 decision={"reason": "not conclusively faster than champion v1", "vs_champion": wide}),
        _summary("enc/fp16/cpu", "passed", model_version="3",
                 stages={"benchmark": {"key": "k", "cached": False, "contended": False}}),
        _summary("enc/bf16/cpu", "passed", model_version="4",
                 decision={"reason": "slower: 0.77x [0.72, 0.83] vs champion v1", "vs_champion": wide_but_slower}),
    ], specs).splitlines()[1:]
    assert "[busy machine]" in busy and "[inconclusive]" not in busy
    assert "[inconclusive]" in unsure and "[busy machine]" not in unsure
    assert "[" not in quiet
    assert "[inconclusive]" not in slower, "an interval wholly below 1 tells, however wide"


def test_a_champion_judged_pending_or_failing_today_shows_the_version_that_keeps_the_alias(pipeline_factory,
                                                                                          tiny_bert_dir):
    specs = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc"))
    pending, rejected, other = summary_table([
        _summary("enc/fp32/cpu", "pending", decision={
            "reason": "machine busy (champion v1 keeps the alias)", "holds_alias": True, "champion": "1"}),
        _summary("enc/int8/cpu", "rejected", decision={
            "reason": "p99_ms 61 > 50 (still holds the alias: no passing candidate can replace it)",
            "holds_alias": True, "champion": "4"}),
        _summary("enc/fp16/cpu", "pending", decision={"reason": "machine busy", "holds_alias": False,
                                                      "champion": "1"}),
    ], specs).splitlines()[1:]
    assert " v1 @champion " in pending, "the pending candidate is the champion's engine: its version and alias"
    assert " v4 @champion " in rejected
    assert " - " in other and "@champion" not in other, "a candidate that is not the champion has no version yet"


def test_a_reason_spanning_lines_keeps_its_row_on_one_line(pipeline_factory, tiny_bert_dir):
    specs = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc"))
    error = ("accuracy failed: InvalidArgument: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions\n"
             "for input: past_key_values.1.key for the following indices\n index: 1 Got: 2 Expected: 1\n")
    rows = summary_table([_summary("enc/fp32/cpu", "failed", error=error)], specs).splitlines()
    assert len(rows) == 2 and rows[1].endswith("index: 1 Got: 2 Expected: 1")


def test_the_throughput_shown_is_read_from_the_median_call_as_decisions_read_medians() -> None:
    """Nine calls of 10 ms and one of 1 s: the engine runs at 800 samples/s at batch 8; a mean would show 73."""
    summary = LatencySamples([10.0] * 9 + [1000.0]).summary(batch=8, tokens_per_call=8 * 128)
    assert summary["throughput"] == pytest.approx(800.0) and summary["tokens_per_s"] == pytest.approx(800.0 * 128)
    assert summary["mean_ms"] == pytest.approx(109.0), "the mean is still reported, as what it is"
