"""The promotion webhook as a deploy system relies on it: signed, verifiable, never lost while the
receiver is down, and the secret never ends up in MLflow."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from pydantic import ValidationError

from tasks.config.settings import RegistrySettings, RunSettings
from tasks.config.spec import PipelineSpec, WebhookSpec
from tasks.judge import notify
from tasks.metrics import stage_metrics
from tasks.outcome import CandidateOutcome
from tasks.registry import tracking
from tasks.runtime.redact import redacted_url
from tasks.runtime.store import ArtifactStore
from tests.fixtures.candidates import candidate_outcome, pipeline_spec
from tests.fixtures.judged import judged, promoted
from tests.fixtures.servers import WebhookReceiver

RETRIES = 2


def _spec(receiver: WebhookReceiver) -> PipelineSpec:
    hook = {"url": receiver.url, "secret_env": receiver.secret_env, "retries": RETRIES, "timeout_s": 2}
    return pipeline_spec(f"notify-{uuid.uuid4().hex[:8]}", webhooks=[hook])


def _promoted(spec: PipelineSpec, outcome: CandidateOutcome) -> list[dict]:
    """What the pipeline flow does after the gates: log, promote, notify; returns the deliveries."""
    promoted(spec, judged(spec, [outcome]))
    assert outcome.status == "promoted"
    return notify.notify_promotions(RegistrySettings.of(spec), [outcome], backoff_s=0.01)


def _events(outcome: CandidateOutcome) -> list[dict]:
    """The version's outbox as stored in MLflow."""
    tags = MlflowClient().get_model_version(outcome.model_name, outcome.model_version).tags
    return json.loads(tags[notify.EVENTS_TAG])


def _delivery(outcome: CandidateOutcome) -> dict:
    (record,) = _events(outcome)
    (delivery,) = record["deliveries"]
    return delivery


def test_signature_verifies_only_the_exact_body_secret_and_recent_timestamp() -> None:
    body = b'{"event": "engine.promoted"}'
    now = str(int(time.time()))
    headers = {"X-Smelter-Delivery-Id": "d1", "X-Smelter-Timestamp": now,
               "X-Smelter-Signature": notify.sign("s3cret", "d1", now, body)}
    assert notify.verify_signature("s3cret", headers, body)
    assert notify.verify_signature("s3cret", {k.lower(): v for k, v in headers.items()}, body)
    assert not notify.verify_signature("other", headers, body)
    assert not notify.verify_signature("s3cret", headers, body + b" ")
    assert not notify.verify_signature("s3cret", headers | {"X-Smelter-Delivery-Id": "d2"}, body)
    old = str(int(time.time()) - 3600)
    replayed = headers | {"X-Smelter-Timestamp": old, "X-Smelter-Signature": notify.sign("s3cret", "d1", old, body)}
    assert not notify.verify_signature("s3cret", replayed, body)


@pytest.mark.usefixtures("mlflow_server")
def test_promotion_sends_a_signed_event_the_receiver_verifies(webhook_receiver: WebhookReceiver,
                                                              tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    deliveries = _promoted(spec, outcome)

    assert [(d["status"], d["attempts"]) for d in deliveries] == [("delivered", 1)]
    assert webhook_receiver.rejected == 0 and len(webhook_receiver.events) == 1
    event = webhook_receiver.events[0]
    assert {k: event[k] for k in ("event", "pipeline", "target", "precision", "candidate", "registered_model",
                                  "version", "alias", "run_id")} == {
        "event": "engine.promoted", "pipeline": spec.name, "target": "cpu", "precision": "int8",
        "candidate": f"{spec.name}/int8/cpu", "registered_model": f"{spec.name}-cpu",
        "version": outcome.model_version, "alias": "champion", "run_id": outcome.run_id}
    assert event["metrics"]["throughput"] == 500.0 and "accuracy.cosine_mean" in event["metrics"]
    assert webhook_receiver.headers[0]["X-Smelter-Delivery-Id"] == event["delivery_id"]
    delivery = _delivery(outcome)
    assert (delivery["status"], delivery["attempts"]) == ("delivered", 1)
    assert delivery["delivery_id"] == event["delivery_id"]


@pytest.mark.usefixtures("mlflow_server")
@pytest.mark.parametrize("outage", ["503", "port closed"])
def test_event_stays_pending_while_receiver_is_down_and_retry_delivers_it_once(
        outage: str, webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    if outage == "503":
        webhook_receiver.down = True
    else:
        webhook_receiver.stop()
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    assert [d["status"] for d in _promoted(spec, outcome)] == ["pending"]

    assert webhook_receiver.events == []
    assert webhook_receiver.attempts == (RETRIES + 1 if outage == "503" else 0)
    delivery = _delivery(outcome)
    assert (delivery["status"], delivery["attempts"]) == ("pending", RETRIES + 1)
    assert delivery["last_error"]
    stored = json.loads(notify.body_of(_events(outcome)[0], delivery))

    webhook_receiver.down = False
    if outage == "port closed":
        webhook_receiver.start()
    results = notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01)
    assert [(r["status"], r["version"], r["delivery_id"]) for r in results] == [
        ("delivered", outcome.model_version, stored["delivery_id"])]
    assert webhook_receiver.events == [stored]
    assert _delivery(outcome)["status"] == "delivered"
    assert notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01) == []
    assert len(webhook_receiver.events) == 1


@pytest.mark.usefixtures("mlflow_server")
def test_pending_event_goes_out_with_the_next_promotion(webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    store = ArtifactStore(tmp_path)
    webhook_receiver.down = True
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    _promoted(spec, first)
    webhook_receiver.down = False
    second = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    assert [d["version"] for d in _promoted(spec, second)] == [first.model_version, second.model_version]
    assert [e["version"] for e in webhook_receiver.events] == [first.model_version, second.model_version]


def test_webhook_url_with_an_invalid_port_is_rejected_by_the_spec_and_never_crashes_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bad = "https://deploy.example:abc/hooks/engines"
    with pytest.raises(ValidationError, match="not a valid URL"):
        WebhookSpec(url=bad, secret_env="SMELTER_WEBHOOK_SECRET")
    with pytest.raises(ValidationError, match="not a valid URL"):
        pipeline_spec("bad-port", webhooks=[{"url": bad, "secret_env": "SMELTER_WEBHOOK_SECRET"}])

    monkeypatch.setenv("SMELTER_WEBHOOK_SECRET", "s3cret")
    unchecked = WebhookSpec.model_construct(url=bad, secret_env="SMELTER_WEBHOOK_SECRET", retries=1, timeout_s=1.0)
    status, attempts, error = notify.send(unchecked, "{}", "d1", backoff_s=0.01)
    assert (status, attempts) == ("pending", 2) and error.startswith("InvalidURL:")


@pytest.mark.usefixtures("mlflow_server")
def test_event_for_a_removed_webhook_is_abandoned_once_not_retried_forever(
        webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    webhook_receiver.down = True
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    assert [d["status"] for d in _promoted(spec, outcome)] == ["pending"]

    webhook_receiver.down = False
    removed = pipeline_spec(spec.name)
    results = notify.retry_pending([RegistrySettings.of(removed)], backoff_s=0.01)
    assert [(r["status"], r["attempts"]) for r in results] == [("abandoned", RETRIES + 1)]
    assert "no longer in pipelines.yaml" in results[0]["last_error"]
    assert _delivery(outcome)["status"] == "abandoned"
    assert notify.retry_pending([RegistrySettings.of(removed)], backoff_s=0.01) == []
    assert notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01) == [] and webhook_receiver.events == []


@pytest.mark.usefixtures("mlflow_server")
def test_secret_and_full_webhook_url_are_never_written_to_mlflow(webhook_receiver: WebhookReceiver,
                                                                 tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    webhook_receiver.down = True  # the failed attempts' errors name the webhook too
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    pending = _promoted(spec, outcome)
    webhook_receiver.down = False
    retried = notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01)
    assert [r["status"] for r in retried] == ["delivered"] and len(webhook_receiver.events) == 1

    redacted = redacted_url(webhook_receiver.url)
    assert redacted.startswith(f"http://127.0.0.1:{webhook_receiver.port}/…#")
    assert [d["url"] for d in pending + retried] == [redacted, redacted]
    assert pending[0]["last_error"] == f"HTTP 503 from {redacted}"
    client = MlflowClient()
    experiment = client.get_experiment_by_name(f"smelter/{spec.name}")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert json.loads(parent.data.params["promotion.webhooks"])[0]["url"] == redacted
    assert _delivery(outcome)["url"] == redacted
    written = [json.dumps([run.data.params, run.data.tags], ensure_ascii=False) for run in runs]
    written.append(json.dumps(client.get_model_version(outcome.model_name, outcome.model_version).tags))
    model = client.get_registered_model(outcome.model_name)
    written.append(json.dumps([model.tags, model.description]))
    written.append(tracking.engine_card(RunSettings.of(spec), outcome, stage_metrics(outcome.stages)))
    assert spec.promotion.webhooks[0].secret_env in "".join(written)
    for hidden in (webhook_receiver.secret, webhook_receiver.url, webhook_receiver.path):
        assert not any(hidden in text for text in written)


@pytest.mark.usefixtures("mlflow_server")
def test_a_refusing_receiver_fails_the_event_once_and_it_is_never_retried(
        webhook_receiver: WebhookReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(webhook_receiver)
    monkeypatch.setenv(webhook_receiver.secret_env, "not-the-receivers-secret")  # 401 from the receiver
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    assert [(d["status"], d["attempts"]) for d in _promoted(spec, outcome)] == [("failed", 1)]
    assert webhook_receiver.rejected == 1 and "HTTP 401" in _delivery(outcome)["last_error"]
    assert notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01) == []
    assert webhook_receiver.attempts == 1 and _delivery(outcome)["status"] == "failed"


@pytest.mark.usefixtures("mlflow_server")
def test_an_event_whose_alias_never_moved_is_abandoned_and_the_alias_holder_keeps_its_own(
        webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    """A run killed between recording v2's event and moving the alias: v2 was never promoted."""
    spec = _spec(webhook_receiver)
    store = ArtifactStore(tmp_path)
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    _promoted(spec, first)
    second = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    with tracking.pipeline_run(spec, "run", {}) as parent_id:
        second.run_id = tracking.log_candidate(parent_id, RunSettings.of(spec), second)
    version = tracking.create_version(first.model_name, second.run_id, {"cache_key": second.cache_key}).version
    registry = RegistrySettings.of(spec)
    event = notify.promotion_event(registry, second, first.model_name, version, {}, "2026-01-01T00:00:00+00:00")
    notify.record_event(first.model_name, version, notify.new_record(registry, event, first.model_version))

    results = notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01)
    assert [(r["version"], r["status"]) for r in results] == [(version, "abandoned")]
    assert "before the alias moved" in results[0]["last_error"]
    assert [e["version"] for e in webhook_receiver.events] == [first.model_version]


@pytest.mark.usefixtures("mlflow_server")
def test_an_alias_with_no_event_for_its_promotion_gets_one(webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    """The alias moved without an event (by hand, or by a run before the outbox): reconciliation announces it."""
    spec = _spec(webhook_receiver)
    store = ArtifactStore(tmp_path)
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    _promoted(spec, first)
    second = candidate_outcome(store, spec, "int8", "cpu", throughput=600.0, variant="night-2")
    _promoted(spec, second)
    tracking.set_alias(first.model_name, "champion", first.model_version)  # moved back by hand

    results = notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01)
    assert [(r["version"], r["status"]) for r in results] == [(first.model_version, "delivered")]
    assert [e["version"] for e in webhook_receiver.events] == [first.model_version, second.model_version,
                                                               first.model_version]
    announced = webhook_receiver.events[-1]
    assert (announced["candidate"], announced["precision"], announced["metrics"]["throughput"]) == (
        first.candidate.name, "int8", 400.0)
    assert len(_events(first)) == 2
    assert notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01) == [] and len(webhook_receiver.events) == 3


@pytest.mark.usefixtures("mlflow_server")
def test_events_recorded_in_the_earlier_per_field_tags_are_still_delivered_with_their_id(
        webhook_receiver: WebhookReceiver, tmp_path: Path) -> None:
    spec = _spec(webhook_receiver)
    outcome = candidate_outcome(ArtifactStore(tmp_path), spec, "int8", "cpu", throughput=500.0)
    promoted(spec, judged(spec, [outcome]))
    name, version = outcome.model_name, outcome.model_version
    tracking.delete_version_tag(name, version, notify.EVENTS_TAG)
    body = json.dumps({"event": "engine.promoted", "version": version, "delivery_id": "legacy-id-1"})
    tracking.set_version_tags(name, version, {
        "smelter.notify.0.url": redacted_url(webhook_receiver.url), "smelter.notify.0.status": "pending",
        "smelter.notify.0.attempts": "3", "smelter.notify.0.last_error": "HTTP 503", "smelter.notify.0.event": body,
        "smelter.notify.pending": "true"})

    results = notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01)
    assert [(r["status"], r["delivery_id"], r["attempts"]) for r in results] == [("delivered", "legacy-id-1", 4)]
    assert webhook_receiver.events == [json.loads(body)]
    assert notify.retry_pending([RegistrySettings.of(spec)], backoff_s=0.01) == [] and len(webhook_receiver.events) == 1
