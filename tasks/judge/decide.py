"""Which passing candidate of each target takes the promotion alias, and why each one does or does not.

The rules (docs/decisions.md, "How smelter decides"), applied per (pipeline, target):
- Only a candidate that passed every gate may take the alias.
- The champion's engine is the candidate with its very bytes (tasks/stages/champion.py `same_engine`); a
  rebuild from the same inputs with other bytes is a challenger, measured against it like any other.
- With no champion, the fastest passing candidate takes it (all were timed in the same rounds); when
  its lead over another passing candidate is within noise (their side-by-side 95% interval holds 1),
  the higher precision of those tied takes it, so a first crowning does not follow the noise.
- When today's candidates were built from other model files than the champion's engine (the model's digest in
  their build records, tasks/stages/champion.py `built_from`), the champion is superseded: the fastest passing
  candidate takes it as with no champion (ties as above). A speed comparison cannot retire a retrained
  model's predecessor; only the model files count, not a toolchain upgrade. A champion with no recorded
  model digest (older versions) is judged as below.
- When the champion fails today's gates, or its engine cannot run on this machine any more (its
  backend is missing, or an EngineMismatch of any backend), the fastest passing candidate takes it.
  A champion candidate that errored for any other reason moves nothing.
- Numbers taken on a busy machine (a contended measurement) decide nothing: its candidates end
  `pending`, no champion is crowned and the alias does not move; accuracy gates still reject.
- Otherwise the fastest passing candidate takes it only if it beats the champion, measured side by
  side, by more than `performance.min_improvement`, with the 95% interval above 1 and conclusive
  (half-width within `benchmark.precision`). Anything else leaves the alias where it is.
"Fastest" is read at the gate point (`performance.at`; by default the largest batch for the
throughput objective, the smallest for latency). This module only decides; promote.py applies it.
"""

from __future__ import annotations

from typing import Any

from tasks.config.settings import DecisionSettings
from tasks.config.spec import at_point
from tasks.outcome import CandidateOutcome, Champion, Decision
from tasks.stages.champion import built_from, same_engine, says_cannot_run_here


def _gate_point(outcome: CandidateOutcome) -> dict[str, Any]:
    benchmark = outcome.stages.get("benchmark")
    return (benchmark.outputs.get("gate_point") or {}) if benchmark else {}


def _measured_champion(outcomes: list[CandidateOutcome]) -> dict[str, Any] | None:
    """What the target's benchmark recorded about the champion (label, or why it could not be measured)."""
    for outcome in outcomes:
        if (benchmark := outcome.stages.get("benchmark")) and benchmark.outputs.get("champion"):
            return benchmark.outputs["champion"]
    return None


def _speed(outcome: CandidateOutcome, champion_label: str | None) -> float:
    """How fast a candidate is at the gate point, on the yardstick every sibling shares in those rounds."""
    point = _gate_point(outcome)
    if champion_label is not None:
        return 1.0 if outcome.candidate.name == champion_label else point.get("vs_champion", float("-inf"))
    return point.get("speedup_vs_reference", float("-inf"))


# Which of candidates tied on speed takes the alias first: the widest number format, the safest engine
PRECISION_PREFERENCE = ("fp32", "bf16", "fp16", "fp8", "int8")


def _lead(best: CandidateOutcome, other: CandidateOutcome) -> tuple[float, float, float] | None:
    """How many times as fast `best` is as `other` at the gate point (ratio, 95% interval), read from the
    rounds that timed both side by side; None where they were not."""
    point, benchmark = _gate_point(best), best.stages.get("benchmark")
    names = best.candidate.name, other.candidate.name
    for row in (benchmark.outputs.get("comparisons") or []) if benchmark else []:
        if not point or not at_point(row, point):
            continue
        if (row["engine"], row["versus"]) == names:
            return row["ratio"], row["ci_low"], row["ci_high"]
        if (row["engine"], row["versus"]) == names[::-1]:
            return 1 / row["ratio"], 1 / row["ci_high"], 1 / row["ci_low"]
    return None


def _first_pick(passing: list[CandidateOutcome], best: CandidateOutcome
                ) -> tuple[CandidateOutcome, str | None, set[str]]:
    """Who takes an alias that no measured champion defends: `best` unless its lead over another passing
    candidate is within noise, then the higher precision of those tied (with the sentence that says so, and
    the names of those tied)."""
    ties = {o.candidate.name: lead for o in passing if o is not best
            and (lead := _lead(best, o)) is not None and lead[1] <= 1}
    if not ties:
        return best, None, set()
    tied = [best] + [o for o in passing if o.candidate.name in ties]
    rank = {p: i for i, p in enumerate(PRECISION_PREFERENCE)}
    taker = min(tied, key=lambda o: rank.get(o.candidate.precision, len(rank)))
    shown = ", ".join(f"{name} {r:.3g}x [{lo:.3g}, {hi:.3g}]" for name, (r, lo, hi) in ties.items())
    return (taker, f"a tie on speed ({best.candidate.name} vs {shown}: the interval holds 1), so the higher precision "
            "takes it", {o.candidate.name for o in tied})


def _beaten(outcome: CandidateOutcome, best: CandidateOutcome) -> str:
    """How much slower than `best` a candidate outside a tie is, measured side by side (when it was)."""
    if (lead := _lead(outcome, best)) is None:
        return ""
    return f"; this one is slower: {lead[0]:.3g}x [{lead[1]:.3g}, {lead[2]:.3g}] vs {best.candidate.name}"


def _short(digest: str) -> str:
    return digest if digest.startswith("hub:") else f"…{digest[-12:]}"


def _retrained(champion: Champion, measured: dict[str, Any] | None, passing: list[CandidateOutcome]) -> str | None:
    """Why the champion is superseded when today's candidates come from other model files than its engine (its
    version's record, else what the benchmark read in its build manifest); None when they do not, or one is unknown."""
    theirs = champion.model_source or (measured or {}).get("model_source")
    ours = sorted({source for o in passing if (source := built_from(o.stages))})
    if not theirs or not ours or theirs in ours:
        return None
    return (f"champion v{champion.version} was built from other model files ({_short(theirs)}), today's are "
            f"({', '.join(map(_short, ours))}): the new model takes the alias")


def _comparison(outcome: CandidateOutcome, champion: Champion) -> dict[str, Any] | None:
    point = _gate_point(outcome)
    if "vs_champion" not in point:
        return None
    return {"version": champion.version, "ratio": point["vs_champion"], "ci": point["vs_champion_ci"],
            "conclusive": bool(point["vs_champion_conclusive"])}


def _verdict(settings: DecisionSettings, comparison: dict[str, Any]) -> tuple[bool, str]:
    """(beats the champion enough to take the alias, the sentence that says so or why not)."""
    ratio, (low, high) = comparison["ratio"], comparison["ci"]
    needed = 1 + settings.min_improvement
    shown = f"{ratio:.3g}x [{low:.3g}, {high:.3g}] vs champion v{comparison['version']}"
    if high < 1:
        return False, f"slower: {shown} (a significant regression: the interval is below 1)"
    if not comparison["conclusive"]:
        half = (high - low) / (2 * ratio)
        return False, (f"inconclusive: {shown}, interval ±{half:.1%} is wider than benchmark.precision "
                       f"±{settings.precision:.0%}")
    if low > 1 and ratio >= needed:
        return True, f"faster: {shown} (needs ≥ {needed:.3g}x with the interval above 1)"
    return False, f"not significant: {shown} (needs ≥ {needed:.3g}x with the interval above 1)"


def busy_share(outcome: CandidateOutcome) -> float | None:
    """The share of the CPU other processes used while the candidate was timed, when that made it contended."""
    benchmark = outcome.stages.get("benchmark")
    host = (benchmark.outputs.get("host") or {}) if benchmark else {}
    return float(host.get("foreign_cpu_share") or 0.0) if host.get("contended") else None


def _hold_pending(outcome: CandidateOutcome, share: float | None = None) -> bool:
    """Make a candidate judged on busy numbers `pending` when nothing but timing was left undecided."""
    share = busy_share(outcome) if share is None else share
    if outcome.status == "failed" or share is None or not all(g.passed or g.inconclusive for g in outcome.gates):
        return False
    outcome.status = "pending"
    outcome.decision = Decision(f"machine busy (other processes used {share:.0%} of the CPU while it was "
                                "timed); speed not judged, the next quiet run decides")
    return True


def _outside_reason(outcome: CandidateOutcome) -> str:
    if outcome.status == "failed":
        return outcome.error or "failed"
    return "; ".join(outcome.gate_reasons) or "rejected"


def decide_target(settings: DecisionSettings, outcomes: list[CandidateOutcome], champion: Champion | None) -> None:
    """Set `decision` on every candidate of one target."""
    pending = [o for o in outcomes if _hold_pending(o)]
    passing = [o for o in outcomes if o.passed_gates]
    holder = next((o for o in outcomes
                   if champion and "build" in o.stages and same_engine(champion, o.stages["build"])), None)
    if pending and holder in pending:
        holder.decision = Decision(holder.decision.reason + f" (champion v{champion.version} keeps the alias)",
                                   holds_alias=True, champion=champion.version)
    for outcome in outcomes:
        if not outcome.passed_gates and outcome not in pending:
            kept = " (still holds the alias: no passing candidate can replace it)" if outcome is holder and not passing else ""
            outcome.decision = Decision(_outside_reason(outcome) + kept, holds_alias=bool(kept),
                                        champion=champion.version if champion else None)
    if not passing:
        return
    busy = next((share for o in outcomes if (share := busy_share(o)) is not None), None)
    if busy is not None:  # the target's candidates share one measurement: busy for one is busy for all
        for outcome in passing:
            _hold_pending(outcome, busy)
        return
    measured = _measured_champion(outcomes) if champion else None
    label = measured.get("label") if measured else None
    best = max(sorted(passing, key=lambda o: o.candidate.name), key=lambda o: _speed(o, label))
    comparisons = {o.candidate.name: _comparison(o, champion) for o in passing} if champion else {}

    def decide(outcome: CandidateOutcome, reason: str, take: bool = False, holds: bool = False) -> None:
        outcome.decision = Decision(reason, take, comparisons.get(outcome.candidate.name), holds or take,
                                    champion.version if champion else None)

    first, tie, tied = _first_pick(passing, best)

    def crown(why: str) -> None:
        """Give the alias to `first`, as nothing defends it."""
        for outcome in passing:
            if outcome is first:
                decide(outcome, f"{why}: {tie or 'fastest passing candidate'}", take=True)
            elif outcome.candidate.name in tied:
                decide(outcome, f"{why}: {first.candidate.name} takes it (a tie on speed)")
            elif tie:
                decide(outcome, f"{why}: {first.candidate.name} takes it{_beaten(outcome, best)}")
            else:
                decide(outcome, f"{why}: {first.candidate.name} is faster")

    if champion is None:
        crown("no champion yet")
        return
    if measured and measured.get("version") not in (None, champion.version):
        why = (f"the champion measured, v{measured['version']}, is not v{champion.version}, which held the alias when "
               "this run started: the alias moved meanwhile; nothing moves, the next run compares with the new one")
        for outcome in passing:
            decide(outcome, why)
        return
    if retrained := _retrained(champion, measured, passing):
        crown(retrained)
        return
    if holder is not None and holder.status == "failed":
        mismatch = says_cannot_run_here(holder.error or "")
        why = f"champion v{champion.version} " + (f"cannot run here ({holder.error})" if mismatch
                                                   else f"errored today ({holder.error}), so it was not judged")
        if mismatch:
            crown(why)
            return
        for outcome in passing:
            decide(outcome, f"{why}: nothing moves")
        holder.decision = Decision(f"{holder.error} (still holds the alias: an error is no verdict)", holds_alias=True)
        return
    if holder is not None and not holder.passed_gates:
        crown(f"champion v{champion.version} fails today's gates")
        return
    if measured and measured.get("unavailable"):
        permanent = measured.get("permanent", False)
        why = f"champion v{champion.version} cannot run here ({measured['unavailable']})"
        if permanent:
            crown(why)
        else:
            for outcome in passing:
                decide(outcome, f"{why}: nothing moves")
        return
    verdicts = {o.candidate.name: _verdict(settings, c) for o in passing if (c := comparisons.get(o.candidate.name))}
    taker = best if verdicts.get(best.candidate.name, (False,))[0] else None
    for outcome in passing:
        if outcome is taker:
            decide(outcome, verdicts[outcome.candidate.name][1], take=True)
        elif outcome is holder:
            decide(outcome, f"loses the alias to {taker.candidate.name}" if taker
                   else f"holds the alias (champion v{champion.version})", holds=taker is None)
        elif outcome.candidate.name not in verdicts:
            decide(outcome, f"not compared with champion v{champion.version}: no side-by-side measurement")
        else:
            beats, sentence = verdicts[outcome.candidate.name]
            decide(outcome, f"{sentence}; {best.candidate.name} is faster" if beats else sentence)


def decide(settings: DecisionSettings, outcomes: list[CandidateOutcome],
           champions: dict[str, Champion | None]) -> list[CandidateOutcome]:
    """Set `decision` on every candidate, target by target; at most one per target takes the alias."""
    for target in settings.targets:
        mine = [o for o in outcomes if o.candidate.target == target]
        if mine:
            decide_target(settings, mine, champions.get(target))
    return outcomes
