"""The one picture of a pipeline run: how many times faster than PyTorch each candidate is, with its
95% interval, against the speed gate, the champion marked and every bar coloured by what happened.

The parent MLflow run and every engine card carry it, so whoever opens either sees the decision
before any table. A picture is drawn once: drawing it (matplotlib's import and the PNG) costs about
1 s of CPU, a tenth of a run whose stages are all cached, and such a run draws what the last one drew.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.outcome import CandidateOutcome
from tasks.spec import PipelineSpec, point_words
from tasks.whole_file import write_whole

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FILE = "summary.png"
COLOURS = {"promoted": "#2e7d32", "passed": "#66bb6a", "pending": "#f9a825", "rejected": "#9e9e9e",
           "failed": "#c62828"}
RATIO = "speedup_vs_reference"


def summary_figure(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> Figure:
    """Horizontal bars, one per candidate; a candidate with no measurement (it failed before) gets its
    status written where its bar would be."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 1.2 + 0.55 * max(len(outcomes), 1)), layout="constrained")
    axes = figure.add_subplot()
    names = [o.candidate.name for o in outcomes]
    gate = spec.performance.gates.get(RATIO)
    for row, outcome in enumerate(outcomes):
        value = outcome.metrics.get(RATIO)
        colour = COLOURS[outcome.status]
        label = ("pending (machine busy)" if outcome.status == "pending" else outcome.status) + (
            f" @{spec.promotion.alias}" if _holds_alias(outcome) else "")
        if value is None or not math.isfinite(value):
            axes.text(0.02, row, f"{label}: not measured", va="center", transform=axes.get_yaxis_transform(),
                      color=colour)
            continue
        axes.barh(row, value, color=colour, height=0.6)
        low, high = outcome.metrics.get(f"{RATIO}_ci_low"), outcome.metrics.get(f"{RATIO}_ci_high")
        if low is not None and high is not None:
            axes.errorbar(value, row, xerr=[[max(value - low, 0)], [max(high - value, 0)]], color="black",
                          capsize=4, linewidth=1)
        axes.annotate(f"{value:.3g}x  {label}", (high if high is not None else value, row), xytext=(6, 0),
                      textcoords="offset points", va="center", fontsize=9,
                      fontweight="bold" if _holds_alias(outcome) else "normal")
        if _holds_alias(outcome):
            axes.plot([value], [row], marker="*", markersize=16, color="gold", markeredgecolor="black")
    axes.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    if gate is not None and gate.min is not None:
        axes.axvline(gate.min, color="#c62828", linewidth=1.2, linestyle="--", label=f"gate: ≥ {gate.min:g}x")
        axes.legend(loc="best", fontsize=8)
    axes.set_yticks(range(len(names)), names)
    axes.invert_yaxis()
    axes.set_xlim(0, _right_edge(outcomes, gate.min if gate is not None and gate.min is not None else 1.0))
    axes.set_xlabel(f"times faster than PyTorch ({point_words(spec.gate_point)}, 95% interval)")
    axes.set_title(f"{spec.name}: speedup vs the reference, by outcome")
    return figure


def summary_png(spec: PipelineSpec, outcomes: list[CandidateOutcome], drawn: Path | None = None) -> bytes:
    """The figure as PNG; with `drawn` (a folder), taken from there when the same picture was drawn before."""
    path = drawn / f"{_picture_digest(spec, outcomes)}.png" if drawn is not None else None
    if path is not None and path.is_file():
        png = path.read_bytes()
        if png.startswith(PNG_SIGNATURE) and png.endswith(PNG_END):  # a whole file, not a torn one
            return png
    buffer = io.BytesIO()
    summary_figure(spec, outcomes).savefig(buffer, format="png", dpi=110)
    png = buffer.getvalue()
    if path is not None:
        with contextlib.suppress(OSError):  # a picture not kept is drawn again next time
            _keep(path, png)
    return png


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"  # the last chunk of every PNG
DRAWN = "summary-figures"  # the folder of pictures drawn, under the artifact store's tool caches
KEEP_DRAWN = 64  # pictures kept; the oldest go first


def _picture_digest(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> str:
    """Everything the picture shows, and what draws it (this module, matplotlib's version)."""
    gate = spec.performance.gates.get(RATIO)
    shown: list[Any] = [hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), version("matplotlib"), spec.name,
                        spec.promotion.alias, spec.gate_point, gate.min if gate is not None else None]
    shown += [[o.candidate.name, o.status, _holds_alias(o)] + [o.metrics.get(f"{RATIO}{end}")
                                                             for end in ("", "_ci_low", "_ci_high")]
              for o in outcomes]
    return hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _keep(path: Path, png: bytes) -> None:
    """Written whole, then the oldest beyond KEEP_DRAWN removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, png)
    kept = sorted(path.parent.glob("*.png"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in kept[KEEP_DRAWN:]:
        old.unlink(missing_ok=True)


def _holds_alias(outcome: CandidateOutcome) -> bool:
    return outcome.decision is not None and outcome.decision.holds_alias


def _right_edge(outcomes: list[CandidateOutcome], gate: float) -> float:
    """Room right of the longest bar (or interval) for its label."""
    ends = [outcome.metrics.get(f"{RATIO}_ci_high", outcome.metrics.get(RATIO, 0.0)) for outcome in outcomes]
    finite = [end for end in ends if end is not None and math.isfinite(end)]
    return max([gate, 1.0, *finite]) * 1.45
