"""The run's summary figure says the decision at a glance: each candidate's speedup with its interval,
the speed gate, the champion, colours by status."""

from __future__ import annotations

from matplotlib.colors import to_hex

from tasks.outcome import CandidateOutcome, Decision
from tasks.spec import Candidate, load
from tasks.summary_figure import COLOURS, summary_figure, summary_png


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
    axes = summary_figure(spec, outcomes).axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["enc/fp32/cpu", "enc/int8/cpu", "enc/fp16/cpu"]
    assert [(round(b.get_width(), 3), to_hex(b.get_facecolor())) for b in axes.patches] == [
        (2.5, COLOURS["promoted"]), (1.1, COLOURS["rejected"])]
    assert 1.2 in [line.get_xdata()[0] for line in axes.get_lines() if line.get_linestyle() == "--"], "the gate line"
    stars = [line for line in axes.get_lines() if line.get_marker() == "*"]
    assert len(stars) == 1 and stars[0].get_xdata()[0] == 2.5, "the champion is starred"
    texts = [t.get_text() for t in axes.texts]
    assert "2.5x  promoted @champion" in texts and "failed: not measured" in texts
    assert summary_png(spec, outcomes).startswith(b"\x89PNG")


def test_a_picture_is_drawn_once_and_a_changed_outcome_or_a_torn_file_draws_it_again(
        pipeline_factory, tiny_bert_dir, tmp_path) -> None:
    """A run whose stages are all cached shows what the last one showed: the same picture, not drawn again. Any
    change to what it shows (a status, a ratio, the champion) is a new picture; a file cut short is drawn again."""
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc")).pipelines["enc"]
    outcomes = [_outcome("fp32", "promoted", 2.5, holds=True), _outcome("int8", "passed", 3.0)]
    drawn = tmp_path / "drawn"
    first = summary_png(spec, outcomes, drawn)
    (kept,) = drawn.glob("*.png")
    assert kept.read_bytes() == first == summary_png(spec, outcomes)
    kept.write_bytes(b"\x89PNG\r\n\x1a\nnot a picture IEND\xaeB`\x82")  # what a reuse would return
    assert summary_png(spec, outcomes, drawn) == kept.read_bytes(), "a whole kept picture is reused, not drawn"

    changed = [_outcome("fp32", "passed", 2.5), _outcome("int8", "promoted", 3.0, holds=True)]
    assert summary_png(spec, changed, drawn) == summary_png(spec, changed) != first
    assert len(list(drawn.glob("*.png"))) == 2

    kept.write_bytes(first[: len(first) // 2])  # torn: a run killed while writing it (before the rename)
    assert summary_png(spec, outcomes, drawn) == first and kept.read_bytes() == first
