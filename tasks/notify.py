"""Signed `engine.promoted` webhooks that survive a receiver being down.

Promotion writes each event as tags on the promoted model version (status pending) inside its
transaction; `notify_promotions` then sends it. A receiver that is down only delays it: the event
stays pending and goes out with the pipeline's next notification or with `retry_pending`
(`smelter notify --retry`). Re-sends keep
the delivery id, so a receiver can drop duplicates.

Signing follows MLflow's own webhooks. Headers:

    X-Smelter-Delivery-Id: <id>          unique per (event, webhook), the same on every retry
    X-Smelter-Timestamp:   <unix seconds> when this attempt was sent
    X-Smelter-Signature:   v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<raw body>")>

A receiver checks them with `verify_signature(secret, request.headers, raw_body)`. The secret comes
only from the environment variable the webhook names; it is never logged nor stored in MLflow.
Nor is the webhook URL, which may carry a token: MLflow holds `tracking.redacted_url`, whose hash
finds the configured webhook again at retry time. An event whose webhook was removed from
pipelines.yaml (or whose URL changed) is `abandoned`: nothing can send it any more.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import httpx

from tasks import tracking
from tasks.metrics import key_metrics
from tasks.outcome import CandidateOutcome
from tasks.spec import PipelineSpec, WebhookSpec

EVENT = "engine.promoted"
DELIVERY_ID_HEADER = "X-Smelter-Delivery-Id"
TIMESTAMP_HEADER = "X-Smelter-Timestamp"
SIGNATURE_HEADER = "X-Smelter-Signature"
SIGNATURE_VERSION = "v1"
PENDING_TAG = "smelter.notify.pending"
MAX_SIGNATURE_AGE_S = 300
_MAX_HEADER_CHARS = 1024
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_STATUS_TAG = re.compile(r"^smelter\.notify\.(\d+)\.status$")

log = logging.getLogger(__name__)


def _tag(index: int, field: str) -> str:
    return f"smelter.notify.{index}.{field}"


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The X-Smelter-Signature value for one delivery attempt."""
    message = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
    return value


def verify_signature(secret: str, headers: Mapping[str, str], body: bytes, *,
                     max_age_s: float = MAX_SIGNATURE_AGE_S) -> bool:
    """True when the body was signed with `secret` less than `max_age_s` ago; False for anything else.

    `headers` is any mapping (case-insensitive lookup); `body` the raw bytes as received, before
    any JSON parsing. The age check stops an old captured request from being replayed. Whatever a
    sender puts in the headers (non-ASCII, a 400-digit timestamp, nothing at all), the answer is
    False, never an exception: a receiver must not crash on hostile requests.
    """
    if not isinstance(secret, str) or not secret or not isinstance(body, bytes | bytearray | memoryview):
        return False
    try:
        delivery_id = _header(headers, DELIVERY_ID_HEADER)
        timestamp = _header(headers, TIMESTAMP_HEADER)
        signature = _header(headers, SIGNATURE_HEADER)
    except (AttributeError, TypeError):  # not a mapping of names to values
        return False
    if not all(isinstance(v, str) and 0 < len(v) <= _MAX_HEADER_CHARS for v in (delivery_id, timestamp, signature)):
        return False
    if not (_TIMESTAMP.fullmatch(timestamp) and signature.isascii() and delivery_id.isprintable()):
        return False
    if abs(time.time() - int(timestamp)) > max_age_s:
        return False
    try:
        expected = sign(secret, delivery_id, timestamp, bytes(body))
    except UnicodeEncodeError:  # a lone surrogate in the id or the secret
        return False
    return hmac.compare_digest(expected.encode(), signature.encode())


@dataclass(frozen=True)
class Delivery:
    """What happened to one event for one webhook in this call."""

    registered_model: str
    version: str
    webhook: int
    url: str
    delivery_id: str
    status: str  # delivered | pending | abandoned (its webhook is no longer configured)
    attempts: int
    last_error: str


def promotion_event(spec: PipelineSpec, outcome: CandidateOutcome, registered_model: str, version: str,
                    metrics: dict[str, float], timestamp: str) -> dict:
    """The event body, less the delivery id (which is per webhook)."""
    candidate = outcome.candidate
    return {"event": EVENT, "pipeline": candidate.pipeline, "target": candidate.target,
            "precision": candidate.precision, "candidate": candidate.name,
            "registered_model": registered_model, "version": str(version), "alias": spec.promotion.alias,
            "metrics": key_metrics(metrics), "run_id": outcome.run_id, "timestamp": timestamp}


def pending_record(spec: PipelineSpec, event: dict) -> dict[str, str]:
    """Version tags that hold one pending delivery per webhook; the summary tag goes last."""
    tags: dict[str, str] = {}
    for index, hook in enumerate(spec.promotion.webhooks):
        body = json.dumps(event | {"delivery_id": uuid.uuid4().hex}, sort_keys=True)
        tags |= {_tag(index, "url"): tracking.redacted_url(hook.url), _tag(index, "status"): "pending",
                 _tag(index, "attempts"): "0", _tag(index, "last_error"): "", _tag(index, "event"): body}
    if tags:
        tags[PENDING_TAG] = "true"
    return tags


def send(hook: WebhookSpec, body: str, delivery_id: str, *, backoff_s: float = 1.0) -> tuple[bool, int, str]:
    """POST one signed event with retries; returns (delivered, attempts made, last error)."""
    secret = os.environ.get(hook.secret_env)
    if not secret:
        return False, 0, f"environment variable {hook.secret_env} is not set; the event cannot be signed"
    raw, where, error = body.encode(), tracking.redacted_url(hook.url), ""
    for attempt in range(hook.retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        timestamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", "User-Agent": "smelter",
                   DELIVERY_ID_HEADER: delivery_id, TIMESTAMP_HEADER: timestamp,
                   SIGNATURE_HEADER: sign(secret, delivery_id, timestamp, raw)}
        try:
            response = httpx.post(hook.url, content=raw, headers=headers, timeout=hook.timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL) as e:  # InvalidURL is no HTTPError
            error = f"{type(e).__name__}: {e}".replace(hook.url, where)
            continue
        if response.is_success:
            return True, attempt + 1, ""
        error = f"HTTP {response.status_code} from {where}"
        if response.status_code < 500 and response.status_code not in (408, 429):
            return False, attempt + 1, error
    return False, hook.retries + 1, error


def _deliver_version(version: tracking.RegisteredVersion, hooks: dict[str, WebhookSpec],
                     backoff_s: float) -> list[Delivery]:
    tags, results, updates = version.tags, [], {}
    pending = sorted(int(m.group(1)) for k, v in tags.items() if (m := _STATUS_TAG.match(k)) and v == "pending")
    for index in pending:
        url, body = tags[_tag(index, "url")], tags[_tag(index, "event")]
        delivery_id = json.loads(body)["delivery_id"]
        total = int(tags.get(_tag(index, "attempts"), "0"))
        hook = hooks.get(url)
        if hook is None:
            status, error = "abandoned", "this webhook is no longer in pipelines.yaml"
        else:
            delivered, attempts, error = send(hook, body, delivery_id, backoff_s=backoff_s)
            status, total = "delivered" if delivered else "pending", total + attempts
        updates |= {_tag(index, "status"): status, _tag(index, "attempts"): str(total),
                    _tag(index, "last_error"): error}
        if status == "delivered":
            updates[_tag(index, "delivered_at")] = datetime.now(UTC).isoformat()
        else:
            log.warning("%s version %s: webhook %s %s after %d attempts: %s",
                        version.name, version.version, url, status, total, error)
        results.append(Delivery(version.name, version.version, index, url, delivery_id, status, total, error))
    still_pending = any(r.status == "pending" for r in results)
    updates[PENDING_TAG] = "true" if still_pending else "false"
    tracking.set_version_tags(version.name, version.version, updates)
    return results


def notify_promotions(spec: PipelineSpec, outcomes: list[CandidateOutcome], *,
                      backoff_s: float = 1.0) -> list[dict]:
    """Send the events promotion recorded for these outcomes, plus any still pending on the same
    registered models from earlier runs (oldest first, so a receiver ends on the newest)."""
    names = sorted({o.model_name for o in outcomes if o.model_name})
    return [asdict(d) for name in names for d in _deliver_model(spec, name, backoff_s)]


def retry_pending(specs: PipelineSpec | Iterable[PipelineSpec], *, backoff_s: float = 1.0) -> list[dict]:
    """Send every event still pending for these pipelines (`smelter notify --retry`)."""
    results = []
    for spec in [specs] if isinstance(specs, PipelineSpec) else list(specs):
        for target in spec.targets:
            name = tracking.registered_model_name(spec.name, target.name)
            results += [asdict(d) for d in _deliver_model(spec, name, backoff_s)]
    return results


def _deliver_model(spec: PipelineSpec, registered_model: str, backoff_s: float) -> list[Delivery]:
    hooks = {tracking.redacted_url(hook.url): hook for hook in spec.promotion.webhooks}
    return [delivery for version in tracking.find_versions(registered_model, {PENDING_TAG: "true"})
            for delivery in _deliver_version(version, hooks, backoff_s)]
