"""A Prefect event per promotion, so Prefect automations can react to it (a CallWebhook action,
a deployment triggered on `smelter.engine.promoted`, a notification).

The resource names the model version in MLflow's registry (`mlflow.model-version.<model>.<version>`),
so an automation can match one registered model with a resource filter.
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

from tasks.outcome import CandidateOutcome

EVENT = "smelter.engine.promoted"


def resource_id(registered_model: str, version: str) -> str:
    return f"mlflow.model-version.{registered_model}.{version}"


def announce_promotions(outcomes: list[CandidateOutcome]) -> list[Any]:
    """Emit `smelter.engine.promoted` for each candidate this run promoted; returns the events sent."""
    sent = []
    for outcome in outcomes:
        if outcome.status != "promoted" or not outcome.model_name:
            continue
        candidate, version = outcome.candidate, str(outcome.model_version)
        sent.append(emit_event(
            event=EVENT,
            resource={"prefect.resource.id": resource_id(outcome.model_name, version),
                      "prefect.resource.name": f"{outcome.model_name} v{version}",
                      "smelter.pipeline": candidate.pipeline, "smelter.target": candidate.target,
                      "smelter.precision": candidate.precision},
            related=[{"prefect.resource.id": f"mlflow.registered-model.{outcome.model_name}",
                      "prefect.resource.role": "registered-model"}],
            payload={"candidate": candidate.name, "registered_model": outcome.model_name, "version": version,
                     "mlflow_run_id": outcome.run_id, "metrics": outcome.metrics}))
    return [event for event in sent if event is not None]
