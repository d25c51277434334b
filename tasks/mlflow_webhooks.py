"""`smelter webhooks sync`: MLflow's own registry webhooks mirror the ones in pipelines.yaml.

Then MLflow itself announces every alias move (`model_version_alias.created`), whoever made it,
beside smelter's own `engine.promoted` events. MLflow cannot filter webhooks by model, so one
MLflow webhook stands for each distinct (url, secret_env) in the file and fires for every
registered model of the server. Its name (`smelter-<hash>`) marks it as ours: a sync creates the
missing ones, refreshes the others (the secret, read from the environment, cannot be compared)
and deletes the ones of ours the file no longer has; webhooks made by others are left alone.
MLflow must hold the full URL to deliver to it, in its own database (never in runs or tags).

The server side needs (MLflow's own settings): a SQL backend store (`mlflow server
--backend-store-uri postgresql://...` or `sqlite:///...`; webhooks never fire from a client
writing to a store directly); MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY (a Fernet key) when it runs
several workers; MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true
for receivers on plain http or private addresses. Deliveries are MLflow's: three tries, no queue.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tasks import tracking
from tasks.notify import sign
from tasks.redact import redacted_url
from tasks.spec import PipelinesFile

PREFIX = "smelter-"
EVENTS = ["model_version_alias.created"]
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
SIGNATURE_HEADER = "X-MLflow-Signature"
MAX_SIGNATURE_AGE_S = 300


@dataclass(frozen=True)
class WantedWebhook:
    name: str
    url: str
    secret_env: str
    pipelines: tuple[str, ...]

    @property
    def description(self) -> str:
        return (f"smelter: alias moves of every registered model, for pipelines {', '.join(self.pipelines)}; "
                f"signed with ${self.secret_env}. Managed by `smelter webhooks sync`.")


def wanted(specs: PipelinesFile) -> list[WantedWebhook]:
    """One MLflow webhook per distinct (url, secret_env) in the file, with the pipelines that name it."""
    found: dict[tuple[str, str], list[str]] = {}
    for spec in specs.pipelines.values():
        for hook in spec.promotion.webhooks:
            found.setdefault((hook.url, hook.secret_env), []).append(spec.name)
    return [WantedWebhook(_name(url, env), url, env, tuple(pipelines)) for (url, env), pipelines in found.items()]


def _name(url: str, secret_env: str) -> str:
    return PREFIX + hashlib.sha256(f"{url}\n{secret_env}".encode()).hexdigest()[:16]


def sync(specs: PipelinesFile) -> list[dict[str, str]]:
    """Make the server's smelter webhooks match the file; returns what was done to each (URLs redacted)."""
    missing = sorted({w.secret_env for w in wanted(specs) if not os.environ.get(w.secret_env)})
    if missing:
        raise RuntimeError(f"environment variables {', '.join(missing)} are not set: MLflow signs each "
                           "delivery with the webhook's secret")
    existing = {w.name: w for w in tracking.list_webhooks() if w.name.startswith(PREFIX)}
    done = []
    for hook in wanted(specs):
        secret = os.environ[hook.secret_env]
        if hook.name in existing:
            tracking.update_webhook(existing.pop(hook.name).webhook_id, hook.url, EVENTS, secret, hook.description)
            action = "updated"
        else:
            tracking.create_webhook(hook.name, hook.url, EVENTS, secret, hook.description)
            action = "created"
        done.append({"webhook": hook.name, "action": action, "url": redacted_url(hook.url),
                     "pipelines": ", ".join(hook.pipelines)})
    for stale in existing.values():
        tracking.delete_webhook(stale.webhook_id)
        done.append({"webhook": stale.name, "action": "deleted", "url": redacted_url(stale.url),
                     "pipelines": ""})
    return done


def verify_signature(secret: str, headers: Mapping[str, str], body: bytes, *,
                     max_age_s: float = MAX_SIGNATURE_AGE_S) -> bool:
    """True when MLflow signed this delivery with `secret` less than `max_age_s` ago (raw body, any header case)."""
    lower = {k.lower(): v for k, v in headers.items()}
    delivery_id = lower.get(DELIVERY_ID_HEADER.lower())
    timestamp = lower.get(TIMESTAMP_HEADER.lower())
    signature = lower.get(SIGNATURE_HEADER.lower())
    if not (delivery_id and timestamp and signature and timestamp.isdigit() and len(timestamp) < 20):
        return False
    if abs(time.time() - int(timestamp)) > max_age_s:
        return False
    return hmac.compare_digest(sign(secret, delivery_id, timestamp, body).encode(), signature.encode())
