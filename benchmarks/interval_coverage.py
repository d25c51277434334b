"""Does the 95% interval of a speed ratio cover the true ratio at every number of rounds where the rule can stop?

Seeded simulation of the measuring loop itself (tasks/measure/rounds.py's slot order, tasks/measure/stats.py's
interval), slot by slot: each engine has a true per-call time; every slot's time is that times the
machine's speed at that instant (a slow random walk plus a periodic swing: drift, shared by both
engines), the engine's own persistent state (an AR(1) per engine: correlated rounds), a carry-over
penalty for the slot that runs right after the other engine (order effect), heavy-tailed noise
(student-t with 3 degrees of freedom, or lognormal) and now and then a descheduled slot.

Two figures per scenario: coverage at a fixed number of rounds n (from MIN_ROUNDS, the fewest rounds
with a 95% interval, up to 60), and coverage where the sequential rule really stops (the first n
from min_rounds at which the interval is within ±precision, else the last, through tasks/measure/rounds.py's
own Rounds, which widen at least as much as any look over the last half of the rounds). The bar: ≥ 93%.

    .venv/bin/python benchmarks/interval_coverage.py            # ~1 min
    .venv/bin/python benchmarks/interval_coverage.py --trials 4000
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from tasks.measure.rounds import Rounds, slot_orders
from tasks.measure.stats import MIN_ROUNDS, Ratio, paired_ratio

TRUE_RATIO = 1.25  # engine b is 1.25x as fast as engine a
SIZES = (2, 3, 4, 5, MIN_ROUNDS, 7, 8, 10, 12, 15, 20, 30, 45, 60)


@dataclass(frozen=True)
class Scenario:
    name: str
    noise: float  # scale of the per-slot log noise
    tails: str  # "t3" or "lognormal"
    drift: float  # per-slot step of the shared random walk (log scale)
    swing: float  # amplitude of a periodic shared slowdown (log scale)
    rho: float  # AR(1) coefficient of each engine's own state, round to round
    state: float  # innovation scale of that state
    carry: float  # log penalty of a slot run right after the other engine
    spikes: float  # probability that a slot is descheduled


SCENARIOS = (
    Scenario("quiet, 2% lognormal", 0.02, "lognormal", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    Scenario("t3 tails 3% + spikes", 0.03, "t3", 0.0, 0.0, 0.0, 0.0, 0.0, 0.02),
    Scenario("drift + swing + t3", 0.02, "t3", 0.01, 0.15, 0.0, 0.0, 0.0, 0.01),
    Scenario("order effect 5%", 0.02, "lognormal", 0.005, 0.0, 0.0, 0.0, 0.05, 0.0),
    Scenario("correlated rounds rho .5", 0.02, "t3", 0.005, 0.0, 0.5, 0.015, 0.0, 0.01),
    Scenario("all of it (busy)", 0.05, "t3", 0.02, 0.2, 0.5, 0.02, 0.05, 0.05),
)


def _noise(rng: np.random.Generator, scenario: Scenario, size: int) -> np.ndarray:
    if scenario.tails == "t3":
        return scenario.noise * rng.standard_t(3, size) / math.sqrt(3)  # unit variance before scaling
    return rng.normal(0.0, scenario.noise, size)


def simulate(rng: np.random.Generator, scenario: Scenario, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-round slot values (ms) of engine a (slower) and engine b, in the loop's slot order."""
    base = {"a": 10.0, "b": 10.0 / TRUE_RATIO}
    out = {"a": np.empty(rounds), "b": np.empty(rounds)}
    state = {"a": 0.0, "b": 0.0}
    walk, clock, previous = 0.0, 0, None
    orders = slot_orders(["a", "b"], seed=int(rng.integers(2 ** 31)))
    for r in range(rounds):
        for name in ("a", "b"):
            state[name] = scenario.rho * state[name] + scenario.state * rng.standard_normal()
        for name in next(orders):
            walk += scenario.drift * rng.standard_normal()
            shared = walk + scenario.swing * math.sin(clock / 7.0)
            log_t = math.log(base[name]) + shared + state[name] + _noise(rng, scenario, 1)[0]
            if previous is not None and previous != name:
                log_t += scenario.carry
            if rng.random() < scenario.spikes:
                log_t += rng.exponential(1.0)
            out[name][r] = math.exp(log_t)
            previous, clock = name, clock + 1
    return out["a"], out["b"]


def stop(a: np.ndarray, b: np.ndarray, min_rounds: int, precision: float) -> tuple[int, Ratio]:
    """Where tasks/measure/rounds.py's rule stops on these rounds, and the ratio it reports there: a look after every
    round from the floor on (Rounds.look records each look's widening), the first conclusive one stops."""
    rounds = Rounds(["a", "b"], {"a": 1, "b": 1}, {"a": [], "b": []}, pairs=[("a", "b")])
    for n in range(1, a.size + 1):
        rounds.samples_ms["a"].append([float(a[n - 1])])
        rounds.samples_ms["b"].append([float(b[n - 1])])
        if n >= max(min_rounds, MIN_ROUNDS):
            if rounds.look(precision) or n == a.size:
                break
    return n, rounds.ratio("a", "b")


def coverage(scenario: Scenario, trials: int, seed: int, min_rounds: int, precision: float) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    fixed = {n: 0 for n in SIZES}
    conclusive_wrong = {n: 0 for n in SIZES}
    stopped_cover, stops = 0, []
    for _ in range(trials):
        a, b = simulate(rng, scenario, max(SIZES))
        for n in SIZES:
            ratio = paired_ratio(a[:n], b[:n])
            covered = not ratio.excludes(TRUE_RATIO)
            fixed[n] += covered
            conclusive_wrong[n] += ratio.conclusive(precision) and not covered
        n, ratio = stop(a, b, min_rounds, precision)
        stopped_cover += not ratio.excludes(TRUE_RATIO)
        stops.append(n)
    return {"fixed": {n: fixed[n] / trials for n in SIZES},
            "wrong": {n: conclusive_wrong[n] / trials for n in SIZES},
            "stopped": stopped_cover / trials, "median_stop": float(np.median(stops))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--min-rounds", type=int, default=10)
    parser.add_argument("--precision", type=float, default=0.05)
    args = parser.parse_args()
    print(f"coverage of the 95% interval of a {TRUE_RATIO}x ratio, {args.trials} seeded trials per cell "
          f"(conclusive needs n >= {MIN_ROUNDS} and ±{args.precision:.0%}); n < {MIN_ROUNDS}: never conclusive")
    header = f"{'scenario':<26}" + "".join(f"{'n=' + str(n):>7}" for n in SIZES) + f"{'at stop':>9}{'stop n':>8}"
    print(header)
    shortfalls = []
    for i, scenario in enumerate(SCENARIOS):
        got = coverage(scenario, args.trials, args.seed + i, args.min_rounds, args.precision)
        print(f"{scenario.name:<26}" + "".join(f"{got['fixed'][n]:>7.1%}" for n in SIZES)
              + f"{got['stopped']:>9.1%}{got['median_stop']:>8.0f}")
        print(f"{'  conclusive and wrong':<26}" + "".join(f"{got['wrong'][n]:>7.1%}" for n in SIZES))
        shortfalls += [(scenario.name, n, c) for n, c in got["fixed"].items() if n >= MIN_ROUNDS and c < 0.93]
        if got["stopped"] < 0.93:
            shortfalls.append((scenario.name, "stop", got["stopped"]))
    print("every stopping point covers >= 93%" if not shortfalls else f"below 93%: {shortfalls}")


if __name__ == "__main__":
    main()
