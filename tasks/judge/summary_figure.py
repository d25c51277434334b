"""The one picture of a pipeline run: every gate that decides, each candidate's value against its bound.

One panel per gated figure, candidates as rows: the speed panel (times faster than PyTorch, with its
95% interval, the champion starred) and one panel for each other bound the file declares (latency,
throughput, accuracy). A value on the wrong side of its bound is drawn red and crossed, and a rejected
bar names the gate that rejected it, so a candidate right of the speed line that is rejected reads as
what it is: fast enough, and too slow at p99 (or not accurate enough).

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

from tasks.config.settings import FigureSettings
from tasks.config.spec import Threshold, point_words
from tasks.judge.gate_words import RATIO, gated_figures, misses
from tasks.metrics import short_name
from tasks.outcome import CandidateOutcome
from tasks.runtime.whole_file import write_whole

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FILE = "summary.png"
COLOURS = {"promoted": "#2e7d32", "passed": "#66bb6a", "pending": "#f9a825", "rejected": "#9e9e9e",
           "failed": "#c62828"}
MISSED = "#c62828"  # a value on the wrong side of its bound


def status_label(settings: FigureSettings, outcome: CandidateOutcome) -> str:
    """`promoted @champion`, `rejected: p99_ms`, `pending (machine busy)`, ..."""
    if outcome.status == "pending":
        label = "pending (machine busy)"
    elif outcome.status == "rejected" and (why := outcome.missed_gates):
        label = f"rejected: {', '.join(why)}"
    else:
        label = outcome.status
    return label + (f" @{settings.alias}" if _holds_alias(outcome) else "")


def summary_figure(settings: FigureSettings, outcomes: list[CandidateOutcome]) -> Figure:
    """One row per candidate, one panel per gated figure (speed first); a candidate with no measurement (it
    failed before) gets its status written where its bar would be."""
    from matplotlib.figure import Figure

    figures = gated_figures(settings.gates)
    others = [metric for metric in figures if metric != RATIO]
    rows = 1.2 + 0.55 * max(len(outcomes), 1)  # inches a row of panels takes
    # the speed panel on top, the other bounds side by side under it: a picture about as tall as wide, so
    # MLflow's artifact viewer, which fits it to its width, keeps the labels readable
    figure = Figure(figsize=(9, rows * (2 if others else 1) + 0.4), layout="constrained")
    grid = figure.add_gridspec(2 if others else 1, max(len(others), 1))
    speed = figure.add_subplot(grid[0, :])
    _speed_panel(speed, settings, outcomes, figures[RATIO])
    names = [o.candidate.name for o in outcomes]
    for column, metric in enumerate(others):
        axes = figure.add_subplot(grid[1, column], sharey=speed)
        _bound_panel(axes, metric, figures[metric], outcomes)
        axes.tick_params(axis="y", labelleft=column == 0)
    speed.set_yticks(range(len(outcomes)), names)
    speed.set_ylim(len(outcomes) - 0.5, -0.5)
    rejected = sum(o.status == "rejected" for o in outcomes)
    figure.suptitle(f"{settings.pipeline}: every gate, each candidate against its bound"
                    + (f" ({rejected} rejected; the bound missed in red)" if rejected else ""), fontsize=11)
    return figure


def _speed_panel(axes: Axes, settings: FigureSettings, outcomes: list[CandidateOutcome],
                 gate: Threshold | None) -> None:
    for row, outcome in enumerate(outcomes):
        value = outcome.metrics.get(RATIO)
        colour = COLOURS[outcome.status]
        label = status_label(settings, outcome)
        if value is None or not math.isfinite(value):
            axes.text(0.02, row, f"{label}: not measured", va="center", transform=axes.get_yaxis_transform(),
                      color=colour)
            continue
        missed = gate is not None and misses(gate, value)
        axes.barh(row, value, color=colour, height=0.6, edgecolor=MISSED if missed else "none",
                  hatch="//" if missed else None, linewidth=1.5 if missed else 0)
        low, high = outcome.metrics.get(f"{RATIO}_ci_low"), outcome.metrics.get(f"{RATIO}_ci_high")
        if low is not None and high is not None:
            axes.errorbar(value, row, xerr=[[max(value - low, 0)], [max(high - value, 0)]], color="black",
                          capsize=4, linewidth=1)
        axes.annotate(f"{value:.3g}x  {label}", (high if high is not None else value, row), xytext=(6, 0),
                      textcoords="offset points", va="center", fontsize=9,
                      color=MISSED if outcome.status == "rejected" else "black",
                      fontweight="bold" if _holds_alias(outcome) or outcome.status == "rejected" else "normal")
        if _holds_alias(outcome):
            axes.plot([value], [row], marker="*", markersize=16, color="gold", markeredgecolor="black")
    axes.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    bound = gate.min if gate is not None else None
    if bound is not None:
        axes.axvline(bound, color=MISSED, linewidth=1.2, linestyle="--", label=f"gate: ≥ {bound:g}x")
        axes.legend(loc="lower right", fontsize=8)
    axes.set_xlim(0, _right_edge(outcomes, bound if bound is not None else 1.0))
    axes.set_xlabel(f"times faster than PyTorch ({point_words(settings.gate_point)}, 95% interval)")
    axes.set_title("speedup vs the reference" + (f" (gate ≥ {bound:g}x)" if bound is not None else ""), fontsize=10)


def _bound_panel(axes: Axes, metric: str, bound: Threshold | None, outcomes: list[CandidateOutcome]) -> None:
    """A dot per candidate against the bound line(s); one that misses is a red cross with its value."""
    from matplotlib.ticker import MaxNLocator

    shown = []
    for row, outcome in enumerate(outcomes):
        value = outcome.metrics.get(metric)
        if value is None or not math.isfinite(value):
            axes.text(0.5, row, "not measured", ha="center", va="center", fontsize=8, color="#616161",
                      transform=axes.get_yaxis_transform())
            continue
        missed = bound is not None and misses(bound, value)
        axes.plot([value], [row], marker="X" if missed else "o", markersize=10 if missed else 7, linestyle="none",
                  color=MISSED if missed else COLOURS["passed"], markeredgecolor="black", markeredgewidth=0.5)
        axes.annotate(f"{value:.4g}" + ("  ✗" if missed else ""), (value, row), xytext=(0, 9),
                      textcoords="offset points", ha="center", fontsize=8, color=MISSED if missed else "black",
                      fontweight="bold" if missed else "normal")
        shown.append(value)
    limits = [b for b in (bound.min, bound.max) if b is not None] if bound is not None else []
    for limit in limits:
        axes.axvline(limit, color=MISSED, linewidth=1.2, linestyle="--")
    low, high = min(shown + limits, default=0.0), max(shown + limits, default=1.0)
    pad = (high - low) * 0.25 or abs(high) * 0.05 or 1.0
    axes.set_xlim(low - pad, high + pad)
    axes.set_title(f"{short_name(metric)} ({_bound_words(bound)})", fontsize=10)
    axes.set_xlabel(short_name(metric))
    axes.tick_params(axis="both", labelsize=8)
    axes.xaxis.set_major_locator(MaxNLocator(4))  # room for 0.9975-like labels on a narrow panel


def _bound_words(bound: Threshold | None) -> str:
    if bound is None:
        return "no bound"
    limits = (("≥", bound.min), ("≤", bound.max))
    return " and ".join(f"{sign} {limit:g}" for sign, limit in limits if limit is not None)


def summary_png(settings: FigureSettings, outcomes: list[CandidateOutcome], drawn: Path | None = None) -> bytes:
    """The figure as PNG; with `drawn` (a folder), taken from there when the same picture was drawn before."""
    path = drawn / f"{_picture_digest(settings, outcomes)}.png" if drawn is not None else None
    if path is not None and path.is_file():
        png = path.read_bytes()
        if png.startswith(PNG_SIGNATURE) and png.endswith(PNG_END):  # a whole file, not a torn one
            return png
    buffer = io.BytesIO()
    summary_figure(settings, outcomes).savefig(buffer, format="png", dpi=110)
    png = buffer.getvalue()
    if path is not None:
        with contextlib.suppress(OSError):  # a picture not kept is drawn again next time
            _keep(path, png)
    return png


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"  # the last chunk of every PNG
DRAWN = "summary-figures"  # the folder of pictures drawn, under the artifact store's tool caches
KEEP_DRAWN = 64  # pictures kept; the oldest go first


def _picture_digest(settings: FigureSettings, outcomes: list[CandidateOutcome]) -> str:
    """Everything the picture shows, and what draws it (this module, matplotlib's version)."""
    figures = gated_figures(settings.gates)
    shown: list[Any] = [hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), version("matplotlib"),
                        settings.pipeline, settings.alias, settings.gate_point,
                        [[m, b.min, b.max] if b is not None else [m] for m, b in figures.items()]]
    shown += [[o.candidate.name, o.status, _holds_alias(o), status_label(settings, o)]
              + [o.metrics.get(f"{RATIO}{end}") for end in ("_ci_low", "_ci_high")]
              + [o.metrics.get(metric) for metric in figures]
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
    return max([gate, 1.0, *finite]) * 1.8
