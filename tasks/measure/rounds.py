"""Engines timed side by side in interleaved rounds until their ratios are known to a given precision.

Each round gives every contender one slot, in an order drawn afresh every other round (seeded, so a
run is repeatable) and reversed in the round after (ABBA): every engine runs before and after every
other one equally often, so an engine that leaves the machine warm or busy for whoever follows
(spinning thread pools, caches, clocks) biases no ratio. A plain rotation (ABC, BCA, CAB) would not
do: B always follows A. A slot is a few calls (enough to last SLOT_MS; its median is the round's
value), so a sub-millisecond engine is not timed on one noisy call; its first call (or two) is untimed
(the first calls after another engine ran refill the caches it evicted, a cost an engine serving alone
never pays, and in a slot of five calls one slow call moves the median). One untimed round runs
first (each engine's first slot after the others ran is its slowest). Rounds continue until every requested ratio's 95% interval is within
±precision (conclusive, checked from `min_rounds` on, so a lucky few rounds cannot end it), or
`max_seconds` is spent (inconclusive). The budget never stops the rounds before `min_rounds` and
MIN_ROUNDS (fewer rounds give no 95% interval): the rounds go on and `extended` says so. Every raw
call time is kept. Pattern from pyperf and MLPerf LoadGen: a minimum duration, then early stopping.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from tasks.measure.stats import MIN_ROUNDS, Ratio, paired_ratio, recent_widest, serial_inflation
from tasks.runtime import quiet_neighbours

SLOT_MS = 25.0
MAX_ROUNDS = 10_000  # where the rounds stop whatever they found; benchmark.min_rounds may not pass it
MAX_CALLS_PER_SLOT = 64
# Untimed calls that open every slot: at least one, and up to 2 where a slot has 8 timed calls or more. The first
# call after another engine ran is never timed: an engine serving alone never meets the caches, allocator and
# sleeping threads another engine left behind. Timing it made minilm's reference read 15% slower than alone on a
# quiet machine and up to 4x on a busy one (benchmarks/engine_alone.py); with it, fp32 vs int8 at batch 8 agreed
# with a timer that warms each block in 11 of 12 repeats, 7 of 12 without (benchmarks/interval_vs_timer.py).
SLOT_WARM_CALLS = 2
ORDER_SEED = 20261204  # the slot order of every round: drawn, but the same each run
# A pause before every slot: the OpenMP pool of the PyTorch reference spins for a moment after its last call,
# taking cores from the next engine's threads, which a timer of one engine alone never sees. ONNX Runtime's pool
# spun far longer (tens of ms to seconds): its engines stop spinning when a call returns (RUNTIME_CONFIG in
# tasks/backends/onnxruntime/backend.py), which no pause could replace. Checked by benchmarks/engine_alone.py.
SETTLE_S = 0.01

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
    extended: str | None = None  # the budget ran out before the minimum rounds: by how much it was exceeded
    # Per pair (either way round), the widening for alike consecutive rounds each look estimated, by its rounds
    looks: dict[frozenset[str], dict[int, float]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(next(iter(self.samples_ms.values()), []))

    def slot_ms(self, name: str) -> list[float]:
        """One value per round: the median call time of that contender's slot."""
        return [statistics.median(slot) for slot in self.samples_ms[name]]

    def calls_ms(self, name: str) -> list[float]:
        return [ms for slot in self.samples_ms[name] for ms in slot]

    def ratio(self, baseline: str, contender: str) -> Ratio:
        """How many times faster `contender` is than `baseline`, from the paired rounds, its interval widened
        at least as much as any look over the last half of the rounds estimated."""
        return paired_ratio(self.slot_ms(baseline), self.slot_ms(contender),
                            widen_at_least=recent_widest(self.looks.get(frozenset((baseline, contender)), {}),
                                                         self.count))

    def look(self, precision: float) -> bool:
        """Record each pair's widening at these rounds; whether every pair is now conclusive. The widening is
        estimated from the same few rounds as the ratio, and is lowest just when those rounds happen to be alike;
        were the rounds allowed to stop at such a dip, a ratio of correlated rounds would be covered 92-93% of the
        time instead of 94% (benchmarks/interval_coverage.py). So the interval is widened at least as much as any
        look over the last half of the rounds estimated: not over all of them, since the first looks, on ten-odd
        rounds, can estimate up to 8x, which then held minilm's int8 vs fp32 at 1.04x [0.64, 1.85] on a quiet
        machine, whatever the later rounds said."""
        conclusive = True
        for base, other in self.pairs:
            own = serial_inflation(np.log(self.slot_ms(base)) - np.log(self.slot_ms(other)))
            self.looks.setdefault(frozenset((base, other)), {})[self.count] = own
            conclusive = conclusive and self.ratio(base, other).conclusive(precision)
        return conclusive

    def conclusive(self, precision: float) -> bool:
        return all(self.ratio(base, other).conclusive(precision) for base, other in self.pairs)


# Called after every round with the rounds so far and the precision asked for, so a progress display can
# follow a long measurement (flows/progress.py sets it; measuring never depends on it).
round_observer: Callable[[Rounds, float], None] | None = None


def _calls_per_slot(timer: Timer) -> int:
    one = max(statistics.median(timer(3)), 1e-3)
    return max(1, min(MAX_CALLS_PER_SLOT, math.ceil(SLOT_MS / one)))


def _slot(timer: Timer, calls: int) -> list[float]:
    """One slot's timed calls, after its untimed opening ones."""
    warm = max(1, min(SLOT_WARM_CALLS, calls // 4))
    return timer(warm + calls)[warm:]


def slot_orders(names: list[str], seed: int = ORDER_SEED) -> Iterator[list[str]]:
    """Round after round, the order of the slots: a seeded random permutation, then the same reversed
    (ABBA), so every pair runs in both orders in every two rounds."""
    rng = random.Random(seed)
    while True:
        order = list(names)
        rng.shuffle(order)
        yield order
        yield order[::-1]


def measure_rounds(contenders: list[Contender], pairs: list[tuple[str, str]], *, warmup: int, min_rounds: int,
                   max_seconds: float, precision: float, min_seconds: float = 0.0) -> Rounds:
    """Interleave the contenders until every (baseline, contender) pair in `pairs` is conclusive or time is up.

    `warmup` calls of each contender run first and are not kept, then one untimed round. The rounds span
    at least `min_seconds` (at most `max_seconds`): a machine's state (clock, cache and memory traffic of
    its neighbours) lasts seconds, and rounds crowded into less than that all see one state, so their
    interval is narrow around a ratio that the next few seconds do not repeat.
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
    with quiet_neighbours.paused():
        return _interleaved(contenders, pairs, calls, min_rounds=min_rounds, max_seconds=max_seconds,
                            precision=precision, min_seconds=min_seconds)


def _interleaved(contenders: list[Contender], pairs: list[tuple[str, str]], calls: dict[str, int], *,
                 min_rounds: int, max_seconds: float, precision: float, min_seconds: float) -> Rounds:
    """The untimed round, then rounds until the ratios are known or the budget is spent."""
    names = [c.name for c in contenders]
    by_name = {c.name: c for c in contenders}
    for name in names:  # the untimed round
        time.sleep(SETTLE_S)
        by_name[name].timer(calls[name])
    orders = slot_orders(names)
    rounds = Rounds(names, calls, {name: [] for name in names}, pairs=list(pairs))
    floor = max(min_rounds, MIN_ROUNDS)
    span = min(min_seconds, max_seconds)
    spent_at = None  # rounds done when the budget ran out
    started = time.monotonic()
    for index in range(MAX_ROUNDS):
        for name in next(orders):
            time.sleep(SETTLE_S)
            rounds.samples_ms[name].append(_slot(by_name[name].timer, calls[name]))
        rounds.seconds = time.monotonic() - started
        if round_observer is not None:
            round_observer(rounds, precision)
        if spent_at is None and rounds.seconds >= max_seconds:
            spent_at = index + 1
        if index + 1 >= floor:
            conclusive = rounds.look(precision)
            if spent_at is not None or (rounds.seconds >= span and conclusive):
                break
    if spent_at is not None and spent_at < floor:
        rounds.extended = (f"the {max_seconds:g}s budget ran out after {spent_at} round(s); measured on to {floor} "
                           f"rounds ({rounds.seconds:.1f}s): fewer give no 95% interval or fall short of min_rounds")
    return rounds
