"""Gate points: where a pipeline's performance gates, objective and decisions read an engine's speed.

A prefill `{batch, seq}` or a decoder's decode step `{batch, past}` (one new token after `past`); the
benchmark stage times both kinds (tasks/stages/benchmark.py) and rows of either kind carry the same figures.
"""

from __future__ import annotations

from typing import Any


def default_gate_point(at: dict[str, int] | None, objective: str, batch_sizes: list[int], first_seq: int,
                       past_len: int | None) -> dict[str, int]:
    """`performance.at`, else throughput is judged at the largest batch, latency at the smallest: on a decode step
    after `past_len` tokens for a decoder with a KV cache (`past_len` given: generating spends its time there, and an
    engine faster at the prompt's prefill may be slower at every new token), on a prefill of the first seq otherwise."""
    if at:
        return at
    batch = (max if objective == "throughput" else min)(batch_sizes)
    return {"batch": batch, "past": past_len} if past_len is not None else {"batch": batch, "seq": first_seq}


def is_decode_point(point: dict[str, int]) -> bool:
    """Whether a gate point names a decode step ({batch, past}) rather than a prefill ({batch, seq})."""
    return "past" in point


def point_words(point: dict[str, int], short: bool = False) -> str:
    """A gate point as a user reads it: `batch 8 × seq 128` or `decode step batch 4 × past 64`; `short`: `b8×s128`
    or `decode b4×p64`."""
    if is_decode_point(point):
        return (f"decode b{point['batch']}×p{point['past']}" if short
                else f"decode step batch {point['batch']} × past {point['past']}")
    return f"b{point['batch']}×s{point['seq']}" if short else f"batch {point['batch']} × seq {point['seq']}"


def at_point(point: dict[str, Any], at: dict[str, int]) -> bool:
    """Whether a timed point, an engine's row or a comparison row is at `at` (the gate point, or another row's
    point): a decode step {batch, past} or a prefill {batch, seq}."""
    decode = bool(point["decode"]) if "decode" in point else (
        point["step"] == "decode" if "step" in point else "seq" not in point)
    if is_decode_point(at):
        return decode and (point["batch"], point["past"]) == (at["batch"], at["past"])
    return not decode and (point["batch"], point["seq"]) == (at["batch"], at["seq"])
