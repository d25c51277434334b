"""MLflow's own registry webhooks, as tasks/judge/mlflow_webhooks.py syncs them with pipelines.yaml."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.registry.client import _client


@dataclass(frozen=True)
class RegistryWebhook:
    """One of MLflow's own registry webhooks (its secret is write-only: MLflow never returns it)."""

    webhook_id: str
    name: str
    url: str
    events: tuple[str, ...]
    description: str


def list_webhooks() -> list[RegistryWebhook]:
    """Every registry webhook of the MLflow server (webhooks need `mlflow server` with a SQL store)."""
    client, found, token = _client(), [], None
    while True:
        page = client.list_webhooks(page_token=token)
        found += [RegistryWebhook(w.webhook_id, w.name, w.url, tuple(str(e) for e in w.events), w.description or "")
                  for w in page]
        token = page.token
        if not token:
            return found


def create_webhook(name: str, url: str, events: list[str], secret: str, description: str) -> None:
    _client().create_webhook(name=name, url=url, events=events, secret=secret, description=description,
                                  status="ACTIVE")


def update_webhook(webhook_id: str, url: str, events: list[str], secret: str, description: str) -> None:
    _client().update_webhook(webhook_id, url=url, events=events, secret=secret, description=description,
                                  status="ACTIVE")


def delete_webhook(webhook_id: str) -> None:
    _client().delete_webhook(webhook_id)
