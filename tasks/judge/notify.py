"""Signed `engine.promoted` webhooks through an outbox: no promotion is ever lost or announced twice.

The outbox is one model-version tag, `smelter.events`, holding the JSON list of that version's
promotion events. Promotion appends the new event (every delivery `pending`, each with a delivery
id kept on every retry) in ONE tag write, before the alias moves. Delivery states:

    pending    not yet accepted: retried with backoff (5xx, 408, 429, network errors), on this run,
               the next run and `smelter notify --retry`
    delivered  the receiver answered 2xx
    failed     the receiver refused it (another 4xx): not retried, reported
    abandoned  nothing will send it: its webhook is gone from pipelines.yaml (or its URL changed),
               it stayed pending for more than MAX_PENDING_DAYS, or the run stopped before the
               alias moved (nothing was promoted)

Every run and `smelter notify --retry` reconcile each registered model under its promotion lock
(tasks/runtime/locks.py): an event counts as a real promotion when the alias reached its version (the alias
is on it now, the next event was recorded while the alias was on it, or a delivery was attempted);
the alias's version gets
an event when its promotion has none (a run killed between record and alias, an alias moved by
hand), then every pending delivery is sent, oldest first. A run killed after a send but before the
record says `delivered` sends it again with the same delivery id, so a receiver drops duplicates.
Versions recorded with the earlier per-field tags (`smelter.notify.<i>.*`) are read as events
(already promoted) and rewritten in this form at their next change.

Signing follows MLflow's own webhooks. Headers:

    X-Smelter-Delivery-Id: <id>          unique per (event, webhook), the same on every retry
    X-Smelter-Timestamp:   <unix seconds> when this attempt was sent
    X-Smelter-Signature:   v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<raw body>")>

A receiver checks them with `verify_signature(secret, request.headers, raw_body)`. The secret comes
only from the environment variable the webhook names; it is never logged nor stored in MLflow.
Nor is the webhook URL, which may carry a token: MLflow holds `redact.redacted_url`, whose hash
finds the configured webhook again at retry time.
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
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tasks.config.settings import RegistrySettings
from tasks.config.spec import WebhookSpec
from tasks.metrics import key_metrics
from tasks.outcome import CandidateOutcome
from tasks.registry import tracking
from tasks.runtime import killpoints, locks
from tasks.runtime.redact import redacted_url

EVENT = "engine.promoted"
DELIVERY_ID_HEADER = "X-Smelter-Delivery-Id"
TIMESTAMP_HEADER = "X-Smelter-Timestamp"
SIGNATURE_HEADER = "X-Smelter-Signature"
SIGNATURE_VERSION = "v1"
EVENTS_TAG = "smelter.events"
LEGACY_PREFIX = "smelter.notify."
MAX_PENDING_DAYS = 7
MAX_SIGNATURE_AGE_S = 300
_MAX_HEADER_CHARS = 1024
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_LEGACY_STATUS_TAG = re.compile(r"^smelter\.notify\.(\d+)\.status$")

log = logging.getLogger(__name__)


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
    status: str  # delivered | pending | failed | abandoned
    attempts: int
    last_error: str


def promotion_event(registry: RegistrySettings, outcome: CandidateOutcome, registered_model: str, version: str,
                    metrics: dict[str, float], timestamp: str) -> dict:
    """The event body, less the delivery id (which is per webhook)."""
    candidate = outcome.candidate
    return {"event": EVENT, "pipeline": candidate.pipeline, "target": candidate.target,
            "precision": candidate.precision, "candidate": candidate.name,
            "registered_model": registered_model, "version": str(version), "alias": registry.alias,
            "metrics": key_metrics(metrics), "run_id": outcome.run_id, "timestamp": timestamp}


def new_record(registry: RegistrySettings, event: dict, previous: str | None) -> dict:
    """One outbox entry: the event, the alias's version before it moved, a pending delivery per webhook."""
    return {"event": event, "previous": previous, "recorded_at": datetime.now(UTC).isoformat(),
            "deliveries": [{"webhook": index, "url": redacted_url(hook.url), "delivery_id": uuid.uuid4().hex,
                            "status": "pending", "attempts": 0, "last_error": ""}
                           for index, hook in enumerate(registry.webhooks)]}


def read_events(tags: Mapping[str, str]) -> list[dict]:
    """A version's outbox entries; the earlier per-field tags are read as one already-promoted entry."""
    if EVENTS_TAG in tags:
        return json.loads(tags[EVENTS_TAG])
    indexes = sorted(int(m.group(1)) for k in tags if (m := _LEGACY_STATUS_TAG.match(k)))
    if not indexes:
        return []
    deliveries, event = [], {}
    for index in indexes:
        field = lambda name: tags.get(f"{LEGACY_PREFIX}{index}.{name}", "")  # noqa: E731
        body = json.loads(field("event") or "{}")
        event = {k: v for k, v in body.items() if k != "delivery_id"} or event
        deliveries.append({"webhook": index, "url": field("url"), "delivery_id": body.get("delivery_id", ""),
                           "status": field("status") or "pending", "attempts": int(field("attempts") or 0),
                           "last_error": field("last_error")})
    return [{"event": event, "previous": None, "recorded_at": event.get("timestamp", ""), "migrated": True,
             "deliveries": deliveries}]


def record_event(registered_model: str, version: str, record: dict) -> str | None:
    """Append `record` to the version's outbox in one tag write; returns the tag's previous value (for undo)."""
    tags = tracking.get_version(registered_model, version).tags
    before = tags.get(EVENTS_TAG)
    events = read_events(tags) + [record]
    killpoints.reach("event.composed")
    tracking.set_version_tags(registered_model, version, {EVENTS_TAG: json.dumps(events, sort_keys=True)})
    return before


def restore_events(registered_model: str, version: str, before: str | None) -> None:
    """Put a version's outbox back as `record_event` found it."""
    if before is None:
        tracking.delete_version_tag(registered_model, version, EVENTS_TAG)
    else:
        tracking.set_version_tags(registered_model, version, {EVENTS_TAG: before})


def send(hook: WebhookSpec, body: str, delivery_id: str, *, backoff_s: float = 1.0) -> tuple[str, int, str]:
    """POST one signed event with retries; returns (delivered | pending | failed, attempts made, last error)."""
    secret = os.environ.get(hook.secret_env)
    if not secret:
        return "pending", 0, f"environment variable {hook.secret_env} is not set; the event cannot be signed"
    raw, where, error = body.encode(), redacted_url(hook.url), ""
    for attempt in range(hook.retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        timestamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", "User-Agent": "smelter",
                   DELIVERY_ID_HEADER: delivery_id, TIMESTAMP_HEADER: timestamp,
                   SIGNATURE_HEADER: sign(secret, delivery_id, timestamp, raw)}
        killpoints.reach("notify.sending")
        try:
            response = httpx.post(hook.url, content=raw, headers=headers, timeout=hook.timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL) as e:  # InvalidURL is no HTTPError
            error = f"{type(e).__name__}: {e}".replace(hook.url, where)
            continue
        if response.is_success:
            killpoints.reach("notify.sent")
            return "delivered", attempt + 1, ""
        error = f"HTTP {response.status_code} from {where}"
        if response.status_code < 500 and response.status_code not in (408, 429):
            return "failed", attempt + 1, error
    return "pending", hook.retries + 1, error


def body_of(record: dict, delivery: dict) -> str:
    """The exact bytes sent for one delivery: the same on every retry."""
    return json.dumps(record["event"] | {"delivery_id": delivery["delivery_id"]}, sort_keys=True)


@dataclass
class _Entry:
    version: str
    index: int
    record: dict


def _outbox(registered_model: str) -> tuple[dict[str, list[dict]], list[_Entry]]:
    """Every version's outbox, and all entries in the order they were recorded."""
    boxes = {v.version: read_events(v.tags) for v in tracking.find_versions(registered_model, {})}
    entries = [_Entry(version, i, record) for version, records in boxes.items() for i, record in enumerate(records)]
    return boxes, sorted(entries, key=lambda e: (e.record.get("recorded_at", ""), int(e.version), e.index))


def _reached_alias(entries: list[_Entry], alias_version: str | None) -> list[bool]:
    """Whether each entry's promotion happened: the alias reached its version (see the module docstring)."""
    reached = []
    for i, entry in enumerate(entries):
        if entry.record.get("migrated") or any(d["attempts"] for d in entry.record["deliveries"]):
            reached.append(True)  # sending starts only once the alias is on the version
        elif i + 1 < len(entries):
            reached.append(entries[i + 1].record.get("previous") == entry.version)
        else:
            reached.append(alias_version == entry.version)
    return reached


def _reconcile(registry: RegistrySettings, registered_model: str, boxes: dict[str, list[dict]],
               entries: list[_Entry]) -> list[_Entry]:
    """Give the alias's version an event when its promotion has none; returns the entries, with it."""
    alias_version = tracking.alias_version(registered_model, registry.alias)
    if alias_version is None or alias_version not in boxes:
        return entries
    reached = _reached_alias(entries, alias_version)
    current = next((e for e, ok in zip(reversed(entries), reversed(reached)) if ok), None)
    if current is not None and current.version == alias_version:
        return entries
    version = tracking.get_version(registered_model, alias_version)
    metrics = key_metrics({k: float(v) for k, v in version.tags.items() if _is_number(v)})
    event = {"event": EVENT, "pipeline": registry.pipeline, "target": version.tags.get("target", ""),
             "precision": version.tags.get("precision", ""), "candidate": version.tags.get("candidate", ""),
             "registered_model": registered_model, "version": alias_version, "alias": registry.alias,
             "metrics": metrics, "run_id": version.run_id, "timestamp": datetime.now(UTC).isoformat()}
    record = new_record(registry, event, current.version if current else None)
    log.warning("%s: alias %s is on version %s but no event announces it; recording one",
                registered_model, registry.alias, alias_version)
    record_event(registered_model, alias_version, record)
    boxes[alias_version].append(record)
    return entries + [_Entry(alias_version, len(boxes[alias_version]) - 1, record)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _settle(registry: RegistrySettings, registered_model: str, backoff_s: float) -> list[Delivery]:
    """Reconcile one registered model's alias with its outbox, then send what is pending, oldest first."""
    hooks = {redacted_url(hook.url): hook for hook in registry.webhooks}
    boxes, entries = _outbox(registered_model)
    entries = _reconcile(registry, registered_model, boxes, entries)
    reached = _reached_alias(entries, tracking.alias_version(registered_model, registry.alias))
    too_old = (datetime.now(UTC) - timedelta(days=MAX_PENDING_DAYS)).isoformat()
    results = []
    for entry, happened in zip(entries, reached):
        for delivery in entry.record["deliveries"]:
            if delivery["status"] != "pending":
                continue
            hook = hooks.get(delivery["url"])
            if not happened:
                status, attempts, error = "abandoned", 0, "the run stopped before the alias moved: nothing was promoted"
            elif "" < entry.record.get("recorded_at", "") < too_old:
                status, attempts, error = "abandoned", 0, f"still pending after {MAX_PENDING_DAYS} days"
            elif hook is None:
                status, attempts, error = "abandoned", 0, "this webhook is no longer in pipelines.yaml"
            else:
                status, attempts, error = send(hook, body_of(entry.record, delivery), delivery["delivery_id"],
                                               backoff_s=backoff_s)
            delivery.update(status=status, attempts=delivery["attempts"] + attempts, last_error=error)
            if status == "delivered":
                delivery["delivered_at"] = datetime.now(UTC).isoformat()
            else:
                log.warning("%s version %s: webhook %s %s after %d attempts: %s", registered_model,
                            entry.version, delivery["url"], status, delivery["attempts"], error)
            tracking.set_version_tags(registered_model, entry.version,  # after each send: a crash loses least
                                      {EVENTS_TAG: json.dumps(boxes[entry.version], sort_keys=True)})
            results.append(Delivery(registered_model, entry.version, delivery["webhook"], delivery["url"],
                                    delivery["delivery_id"], status, delivery["attempts"], error))
    return results


def settle_model(registry: RegistrySettings, registered_model: str, *, backoff_s: float = 1.0) -> list[Delivery]:
    """`_settle` under the model's promotion lock, so two runs never send the same delivery at once."""
    with promotion_lock(registered_model):
        if not tracking.registered_model_exists(registered_model):
            return []
        return _settle(registry, registered_model, backoff_s)


def promotion_lock(registered_model: str):
    """Held while promoting within, or delivering the events of, one registered model."""
    return locks.exclusive(f"promote {registered_model}", tracking.tracking_uri())


def notify_promotions(registry: RegistrySettings, outcomes: list[CandidateOutcome], *,
                      backoff_s: float = 1.0) -> list[dict]:
    """Send the events promotion recorded for these outcomes, plus any still pending on the same
    registered models from earlier runs (oldest first, so a receiver ends on the newest)."""
    names = sorted({o.model_name for o in outcomes if o.model_name})
    return [asdict(d) for name in names for d in settle_model(registry, name, backoff_s=backoff_s)]


def retry_pending(registries: Iterable[RegistrySettings], *, backoff_s: float = 1.0) -> list[dict]:
    """Reconcile and send every event still pending for these pipelines (`smelter notify --retry`)."""
    results = []
    for registry in registries:
        for target in registry.targets:
            results += [asdict(d) for d in settle_model(registry, registry.model_name(target), backoff_s=backoff_s)]
    for warning in show_outboxes((r["registered_model"], r["version"]) for r in results):
        log.warning(warning)  # only a run refreshed them: a delivered event read "pending 1" until the next
    return results


def show_outboxes(versions: Iterable[tuple[str, Any]]) -> list[str]:
    """A readable outbox (status tag, JSON artifact) on each (registered model, version); a warning for each one
    that could not be shown (the outbox itself is intact: only its display is stale)."""
    warnings = []
    for name, version in sorted({(name, str(version)) for name, version in versions}):
        try:
            tracking.show_outbox(name, version)
        except Exception as e:  # noqa: BLE001 - see the docstring
            warnings.append(f"warning: {name} v{version}: outbox status not shown: {type(e).__name__}: {e}")
    return warnings
