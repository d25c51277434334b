"""Python's cycle collector held off while a process loads its libraries, then pointed past them.

Loading MLflow, Prefect, ONNX Runtime, torch and transformers makes millions of objects that live as
long as the process, and next to no garbage. The collector runs every 700 new objects and, every
hundredth time, walks every object there is, those again and again. So a process holds it off from its
first line until its libraries are loaded, then freezes what they made (moves it where no collection
looks again, as `gc.freeze`'s documentation advises for long-lived state) and collects from there on:
what the work itself makes is collected as before, and each full collection skips the libraries. A warm
`smelter run` took 4.9 CPU-s against 6.6, Prefect's temporary server 3.1 against 3.5 to answer
(benchmarks/process_start.py).
"""

from __future__ import annotations

import gc

_holding = False  # this process held the collector off and has not resumed it yet


def hold() -> None:
    """Hold the collector off until `loaded()`: a process's entry point, before its imports."""
    global _holding
    if gc.isenabled():
        gc.disable()
        _holding = True


def loaded() -> None:
    """Everything made so far lives as long as the process: freeze it and collect again from here.
    Does nothing unless `hold()` held the collector off (a caller that imports smelter keeps its own)."""
    global _holding
    if _holding:
        _holding = False
        gc.freeze()
        gc.enable()
