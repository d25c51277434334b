"""The run's summary figure says the decision at a glance: each candidate's speedup with its interval,
every other gated figure against its bound, the gate a rejected candidate missed, the champion, colours by status."""

from __future__ import annotations

from matplotlib.colors import to_hex

from tasks.config.settings import FigureSettings, GateSettings
from tasks.config.spec import Candidate, load
from tasks.judge import gates
from tasks.judge.summary_figure import COLOURS, MISSED, summary_figure, summary_png
from tasks.outcome import CandidateOutcome, Decision


def _outcome(precision: str, status: str, speedup: float | None, holds: bool = False) -> CandidateOutcome:
    metrics = {} if speedup is None else {"speedup_vs_reference": speedup, "speedup_vs_reference_ci_low": speedup * 0.9,
                                          "speedup_vs_reference_ci_high": speedup * 1.1}
    return CandidateOutcome(Candidate(pipeline="enc", precision=precision, target="cpu"), status, metrics=metrics,
                            decision=Decision("why", holds_alias=holds))


def test_bars_gate_champion_and_status_colours(pipeline_factory, tiny_bert_dir) -> None:
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                                 performance={"gates": {"speedup_vs_reference": {"min": 1.2}}})).pipelines["enc"]
    outcomes = [_outcome("fp32", "promoted", 2.5, holds=True), _outcome("int8", "rejected", 1.1),
                _outcome("fp16", "failed", None)]
    axes = summary_figure(FigureSettings.of(spec), outcomes).axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["enc/fp32/cpu", "enc/int8/cpu", "enc/fp16/cpu"]
    assert [(round(b.get_width(), 3), to_hex(b.get_facecolor())) for b in axes.patches] == [
        (2.5, COLOURS["promoted"]), (1.1, COLOURS["rejected"])]
    assert 1.2 in [line.get_xdata()[0] for line in axes.get_lines() if line.get_linestyle() == "--"], "the gate line"
    stars = [line for line in axes.get_lines() if line.get_marker() == "*"]
    assert len(stars) == 1 and stars[0].get_xdata()[0] == 2.5, "the champion is starred"
    texts = [t.get_text() for t in axes.texts]
    assert "2.5x  promoted @champion" in texts and "failed: not measured" in texts
    assert summary_png(FigureSettings.of(spec), outcomes).startswith(b"\x89PNG")


def test_a_picture_is_drawn_once_and_a_changed_outcome_or_a_torn_file_draws_it_again(
        pipeline_factory, tiny_bert_dir, tmp_path) -> None:
    """A run whose stages are all cached shows what the last one showed: the same picture, not drawn again. Any
    change to what it shows (a status, a ratio, the champion) is a new picture; a file cut short is drawn again."""
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc")).pipelines["enc"]
    settings = FigureSettings.of(spec)
    outcomes = [_outcome("fp32", "promoted", 2.5, holds=True), _outcome("int8", "passed", 3.0)]
    drawn = tmp_path / "drawn"
    first = summary_png(settings, outcomes, drawn)
    (kept,) = drawn.glob("*.png")
    assert kept.read_bytes() == first == summary_png(settings, outcomes)
    kept.write_bytes(b"\x89PNG\r\n\x1a\nnot a picture IEND\xaeB`\x82")  # what a reuse would return
    assert summary_png(settings, outcomes, drawn) == kept.read_bytes(), "a whole kept picture is reused, not drawn"

    changed = [_outcome("fp32", "passed", 2.5), _outcome("int8", "promoted", 3.0, holds=True)]
    assert summary_png(settings, changed, drawn) == summary_png(settings, changed) != first
    assert len(list(drawn.glob("*.png"))) == 2

    kept.write_bytes(first[: len(first) // 2])  # torn: a run killed while writing it (before the rename)
    assert summary_png(settings, outcomes, drawn) == first and kept.read_bytes() == first


def _judged(spec, precision: str, speedup: float, p99_ms: float, cosine_min: float) -> CandidateOutcome:
    """A candidate judged by the real gates on these figures: rejected when one misses its bound."""
    metrics = {"speedup_vs_reference": speedup, "speedup_vs_reference_ci_low": speedup * 0.95,
               "speedup_vs_reference_ci_high": speedup * 1.05, "p99_ms": p99_ms,
               "accuracy.cosine_mean": 0.999, "accuracy.cosine_min": cosine_min}
    verdicts = gates.evaluate(GateSettings.of(spec), metrics, {"finite": True}, None)
    status = "passed" if all(g.passed for g in verdicts) else "rejected"
    return CandidateOutcome(Candidate(pipeline="enc", precision=precision, target="cpu"), status, metrics=metrics,
                            gates=verdicts, decision=Decision("why"))


def test_every_gate_has_a_panel_and_a_rejected_bar_names_the_bound_it_missed(pipeline_factory, tiny_bert_dir) -> None:
    """Three candidates all right of the speed line: one passes, one is rejected by its p99 latency, one by its
    accuracy. The figure shows each figure against its bound and says which gate rejected which bar."""
    spec = load(pipeline_factory(
        tiny_bert_dir, "feature-extraction", name="enc",
        performance={"gates": {"speedup_vs_reference": {"min": 1.2}, "p99_ms": {"max": 50}}},
        accuracy={"data": "data/eval.txt", "samples": 8, "seq_len": 16,
                  "gates": {"cosine_mean": {"min": 0.99}, "cosine_min": {"min": 0.97}}})).pipelines["enc"]
    outcomes = [_judged(spec, "fp32", 1.65, 30.0, 0.999), _judged(spec, "fp16", 1.52, 106.9, 0.998),
                _judged(spec, "int8", 1.44, 41.0, 0.95)]
    assert [o.status for o in outcomes] == ["passed", "rejected", "rejected"]
    figure = summary_figure(FigureSettings.of(spec), outcomes)
    speed, p99, cosine_mean, cosine_min = figure.axes  # speed on top, the bounds under it
    assert [a.get_title() for a in (p99, cosine_mean, cosine_min)] == [
        "p99_ms (≤ 50)", "cosine_mean (≥ 0.99)", "cosine_min (≥ 0.97)"]
    labels = [t.get_text() for t in speed.texts]
    assert labels == ["1.65x  passed", "1.52x  rejected: p99_ms", "1.44x  rejected: cosine_min"]
    hatched = [to_hex(b.get_edgecolor()) == MISSED for b in speed.patches]
    assert hatched == [False, False, False], "every bar clears the speed gate: none is drawn as missing it"

    def crossed(axes) -> list[float]:
        """Values drawn as missing the panel's bound (a red cross)."""
        return [line.get_xdata()[0] for line in axes.get_lines() if line.get_marker() == "X"]

    assert crossed(p99) == [106.9] and crossed(cosine_min) == [0.95] and crossed(cosine_mean) == []
    assert [line.get_xdata()[0] for line in p99.get_lines() if line.get_linestyle() == "--"] == [50]
    assert "106.9  ✗" in [t.get_text() for t in p99.texts]


def test_a_bar_under_the_speed_gate_is_marked_and_a_changed_bound_draws_a_new_picture(
        pipeline_factory, tiny_bert_dir, tmp_path) -> None:
    faster = {"gates": {"speedup_vs_reference": {"min": 1.5}}}
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", performance=faster)).pipelines["enc"]
    outcomes = [_judged(spec, "fp32", 1.65, 30.0, 0.999), _judged(spec, "int8", 1.44, 41.0, 0.999)]
    speed = summary_figure(FigureSettings.of(spec), outcomes).axes[0]
    assert [to_hex(b.get_edgecolor()) == MISSED for b in speed.patches] == [False, True]
    assert [t.get_text() for t in speed.texts][1] == "1.44x  rejected: speedup"
    looser = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                                   performance={"gates": {"speedup_vs_reference": {"min": 1.5},
                                                          "p99_ms": {"max": 35}}})).pipelines["enc"]
    drawn = tmp_path / "drawn"
    assert summary_png(FigureSettings.of(spec), outcomes, drawn) != summary_png(FigureSettings.of(looser), outcomes, drawn), \
        "a new bound is a new picture"
