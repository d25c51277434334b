"""Engines timed side by side in interleaved rounds until their ratios are known to a given precision.

Each round gives every contender one slot, in an order that rotates from round to round (ABC,
BCA, CAB, ...), so no engine always runs right after the same other one. A slot is a few calls
(enough to last SLOT_MS; its median is the round's value), so a sub-millisecond engine is not
timed on one noisy call. Rounds continue until every requested ratio's 95% interval is within
±precision (conclusive, checked from `min_rounds` on, so a lucky few rounds cannot end it), or
`max_seconds` is spent (inconclusive; the budget holds even before `min_rounds`, so a busy machine
cannot make the stage run for ever). Every raw
call time is kept. Pattern from pyperf and MLPerf LoadGen: a minimum duration, then early stopping.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.stats import Ratio, paired_ratio

SLOT_MS = 25.0
MAX_CALLS_PER_SLOT = 64
MAX_ROUNDS = 2000

# Times `n` calls of one engine and returns each call's milliseconds.
Timer = Callable[[int], list[float]]


@dataclass(frozen=True)
class Contender:
    name: str
    timer: Timer


@dataclass
class Rounds:
    """Raw call times per contender per round, and the ratios asked for."""

    names: list[str]
    calls_per_slot: dict[str, int]
    samples_ms: dict[str, list[list[float]]] = field(default_factory=dict)
    seconds: float = 0.0
    pairs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(next(iter(self.samples_ms.values()), []))

    def slot_ms(self, name: str) -> list[float]:
        """One value per round: the median call time of that contender's slot."""
        return [statistics.median(slot) for slot in self.samples_ms[name]]

    def calls_ms(self, name: str) -> list[float]:
        return [ms for slot in self.samples_ms[name] for ms in slot]

    def ratio(self, baseline: str, contender: str) -> Ratio:
        """How many times faster `contender` is than `baseline`, from the paired rounds."""
        return paired_ratio(self.slot_ms(baseline), self.slot_ms(contender))

    def conclusive(self, precision: float) -> bool:
        return all(self.ratio(base, other).conclusive(precision) for base, other in self.pairs)


def _calls_per_slot(timer: Timer) -> int:
    one = max(statistics.median(timer(3)), 1e-3)
    return max(1, min(MAX_CALLS_PER_SLOT, math.ceil(SLOT_MS / one)))


def measure_rounds(contenders: list[Contender], pairs: list[tuple[str, str]], *, warmup: int, min_rounds: int,
                   max_seconds: float, precision: float) -> Rounds:
    """Interleave the contenders until every (baseline, contender) pair in `pairs` is conclusive or time is up.

    `warmup` calls of each contender run first and are not kept.
    """
    names = [c.name for c in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be unique, got {names}")
    unknown = {n for pair in pairs for n in pair} - set(names)
    if unknown:
        raise ValueError(f"ratios asked for contenders that are not measured: {sorted(unknown)}")
    for contender in contenders:
        if warmup:
            contender.timer(warmup)
    calls = {c.name: _calls_per_slot(c.timer) for c in contenders}
    rounds = Rounds(names, calls, {name: [] for name in names}, pairs=list(pairs))
    started = time.monotonic()
    for index in range(MAX_ROUNDS):
        shift = index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            rounds.samples_ms[contender.name].append(contender.timer(calls[contender.name]))
        rounds.seconds = time.monotonic() - started
        if rounds.seconds >= max_seconds or (index + 1 >= min_rounds and rounds.conclusive(precision)):
            break
    return rounds
