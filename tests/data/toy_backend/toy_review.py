"""A judging step from outside smelter: each gated candidate's run gets the verdict it had before decide.

One `Judge` and one entry point (`smelter.judges`): the graph places it after each candidate's gate and
before smelter's decide, `smelter plan` lists it and the flow runs it as a Prefect task named `toy-review`.
"""

from __future__ import annotations

from mlflow import MlflowClient

from tasks.judge.steps import Judge, Judging


def review(judging: Judging, node: str) -> Judging:
    outcome = judging.outcome(node)
    if outcome.run_id:
        MlflowClient().set_tag(outcome.run_id, "toy.review", outcome.status)
    return judging


REVIEW = Judge("toy-review", "candidate", after=("gate",), before=("decide",), act=review,
               reads=lambda registry: "the candidate's gated verdict")
