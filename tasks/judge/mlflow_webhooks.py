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

import concurrent.futures
import hashlib
import hmac
import ipaddress
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from tasks.config.spec import PipelinesFile, SpecError
from tasks.config.yaml_source import key_path
from tasks.judge.notify import sign
from tasks.registry import tracking
from tasks.runtime.redact import redacted_url

PREFIX = "smelter-"
EVENTS = ["model_version_alias.created"]
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
SIGNATURE_HEADER = "X-MLflow-Signature"
MAX_SIGNATURE_AGE_S = 300
RESOLVE_TIMEOUT_S = 3.0
SCHEMES_SETTING = "MLFLOW_WEBHOOK_ALLOWED_SCHEMES"
PRIVATE_SETTING = "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS"


@dataclass(frozen=True)
class WantedWebhook:
    name: str
    url: str
    secret_env: str
    pipelines: tuple[str, ...]
    where: str  # the first place in the file that names it, for messages

    @property
    def description(self) -> str:
        return (f"smelter: alias moves of every registered model, for pipelines {', '.join(self.pipelines)}; "
                f"signed with ${self.secret_env}. Managed by `smelter webhooks sync`.")


def wanted(specs: PipelinesFile) -> list[WantedWebhook]:
    """One MLflow webhook per distinct (url, secret_env) in the file, with the pipelines that name it."""
    found: dict[tuple[str, str], list[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for spec in specs.pipelines.values():
        for i, hook in enumerate(spec.promotion.webhooks):
            found.setdefault((hook.url, hook.secret_env), []).append(spec.name)
            where.setdefault((hook.url, hook.secret_env),
                             f"{specs.path}: {key_path(['pipelines', spec.name, 'promotion', 'webhooks', i, 'url'])}")
    return [WantedWebhook(_name(url, env), url, env, tuple(pipelines), where[url, env])
            for (url, env), pipelines in found.items()]


def _name(url: str, secret_env: str) -> str:
    return PREFIX + hashlib.sha256(f"{url}\n{secret_env}".encode()).hexdigest()[:16]


def sync(specs: PipelinesFile) -> list[dict[str, str]]:
    """Make the server's smelter webhooks match the file; returns what was done to each (URLs redacted)."""
    missing = sorted({w.secret_env for w in wanted(specs) if not os.environ.get(w.secret_env)})
    if missing:
        raise SpecError([f"{specs.path}: environment variables {', '.join(missing)} are not set: MLflow signs "
                         "each delivery with the webhook's secret"])
    existing = {w.name: w for w in tracking.list_webhooks() if w.name.startswith(PREFIX)}
    done = []
    for hook in wanted(specs):
        secret = os.environ[hook.secret_env]
        try:
            if hook.name in existing:
                tracking.update_webhook(existing[hook.name].webhook_id, hook.url, EVENTS, secret, hook.description)
                action = "updated"
            else:
                tracking.create_webhook(hook.name, hook.url, EVENTS, secret, hook.description)
                action = "created"
        except Exception as e:  # noqa: BLE001 - MLflow says a refusal only in its message (RestException)
            refusal = server_refusal(hook.url, str(e))
            if refusal is None:
                raise
            raise SpecError([f"{hook.where}: {refusal}"]) from None
        existing.pop(hook.name, None)
        done.append({"webhook": hook.name, "action": action, "url": redacted_url(hook.url),
                     "pipelines": ", ".join(hook.pipelines)})
    for stale in existing.values():
        tracking.delete_webhook(stale.webhook_id)
        done.append({"webhook": stale.name, "action": "deleted", "url": redacted_url(stale.url),
                     "pipelines": ""})
    return done


def server_refusal(url: str, message: str) -> str | None:
    """What to change when the MLflow server refused `url` (its error `message`); None for other errors.

    MLflow's server guards webhook URLs by default: https only, and a host that resolves to public
    addresses only. The fix is a setting where the server runs, or another URL, so the answer names both.
    """
    shown = redacted_url(url)
    host = urlsplit(url).hostname or ""
    if "Invalid webhook URL scheme" in message:
        return (f"the MLflow server refuses {shown}: it accepts only https:// receivers unless it runs with "
                f"{SCHEMES_SETTING}=http,https; set that where the server runs, or use an https:// URL")
    if "must not resolve to a non-public IP address" in message:
        return (f"the MLflow server refuses {shown}: {host} resolves to a private address; set "
                f"{PRIVATE_SETTING}=true where the server runs, or use a public host")
    if "Cannot resolve Webhook URL hostname" in message:
        return (f"the MLflow server refuses {shown}: it cannot resolve {host}; expected a reachable host "
                f"(one the server's DNS knows), or {PRIVATE_SETTING}=true where the server runs, which skips the check")
    return None


def default_guard_warnings(specs: PipelinesFile) -> list[str]:
    """The webhook URLs an MLflow server with its default guard would refuse at `smelter webhooks sync`.

    Checked from this machine (the server may resolve names differently, or run with the guard
    relaxed), so `smelter validate` shows them as warnings: smelter's own deliveries are unaffected.
    """
    notes = []
    for hook in wanted(specs):
        problem = _guard_problem(hook.url)
        if problem:
            notes.append(f"{hook.where}: {problem} (smelter's own deliveries still go out)")
    return notes


def _guard_problem(url: str) -> str | None:
    parts = urlsplit(url)
    shown, host = redacted_url(url), parts.hostname or ""
    if parts.scheme != "https":
        return (f"an MLflow server refuses {shown} at `smelter webhooks sync` unless it runs with "
                f"{SCHEMES_SETTING}=http,https")
    addresses = _resolve(host)
    if addresses is None:
        return (f"{host} does not resolve here; an MLflow server refuses a webhook host it cannot resolve "
                "(expected a reachable host)")
    private = [a for a in addresses if not a.is_global]
    if private:
        return (f"{host} resolves to the private address {private[0]}; an MLflow server refuses it unless it "
                f"runs with {PRIVATE_SETTING}=true")
    return None


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address] | None:
    """The host's addresses, or None when it does not resolve within RESOLVE_TIMEOUT_S."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        infos = pool.submit(socket.getaddrinfo, host, None).result(timeout=RESOLVE_TIMEOUT_S)
    except (OSError, UnicodeError, concurrent.futures.TimeoutError):
        return None
    finally:
        pool.shutdown(wait=False)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


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
