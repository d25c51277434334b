"""The model registry: registered models, their versions, aliases and version tags.

A version is known by its engine's identity (a sha256 over its files), so the same engine is never
registered twice; its metric tags are dated (MEASURED_*), so a reader knows how busy the machine was.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from tasks.config.settings import RegistrySettings
from tasks.outcome import CandidateOutcome, Champion
from tasks.registry.client import _client
from tasks.registry.runs import EVAL_DATA_TAG
from tasks.runtime.store import StageResult

MODEL_SOURCE_TAG = "model_source"  # the model files its engine was built from (tasks/stages/champion.py `built_from`)
ENGINE_IDENTITY_TAG = "engine_identity"  # a registry version's identity: `engine_identity`, its engine files' sha256
ENGINE_SIDECAR = "engine.json"  # what every backend writes beside its engine (tasks/backends: SIDECAR), build times too
OUTBOX_TAG = "smelter.events"  # a version's promotion events (tasks/judge/notify.py writes it)
OUTBOX_STATUS_TAG = "smelter.events.status"  # the same, in a few words
# Where a registry version's metric tags come from: when that benchmark ran, whether other processes competed
# for the CPU (and how much), its key and the run that read it. A less busy re-measurement replaces them.
MEASURED_AT, MEASURED_CONTENDED, MEASURED_CPU_SHARE = "measured_at", "measured_contended", "measured_cpu_share"
MEASURED_BENCHMARK, MEASURED_RUN = "measured_benchmark", "measured_run"


def measurement(outcome: CandidateOutcome) -> dict[str, str]:
    """When and how the candidate's figures were measured (MEASURED_* tags): what a registry version's metric
    tags and engine card are dated with; empty when it was not benchmarked."""
    benchmark = outcome.stages.get("benchmark")
    if benchmark is None:
        return {}
    host = benchmark.outputs.get("host") or {}
    created, share = benchmark.manifest.get("created_unix"), host.get("foreign_cpu_share")
    return {MEASURED_AT: datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds") if created else "",
            MEASURED_CONTENDED: str(bool(host.get("contended"))).lower(),
            MEASURED_CPU_SHARE: "" if share is None else f"{share:.3g}",
            MEASURED_BENCHMARK: benchmark.key, MEASURED_RUN: outcome.run_id or ""}


def measured_sentence(measured: dict[str, str]) -> str:
    """One line a reader of the registry dates the figures by."""
    share = measured.get(MEASURED_CPU_SHARE)
    busy = f" (other processes used {float(share):.0%} of the CPU)" if share else ""
    machine = "a busy machine: contended" if measured.get(MEASURED_CONTENDED) == "true" else "a quiet machine"
    run = f", read by run {measured[MEASURED_RUN]}" if measured.get(MEASURED_RUN) else ""
    return (f"Measured {measured.get(MEASURED_AT) or 'at an unknown time'} on {machine}{busy}; "
            f"benchmark {measured.get(MEASURED_BENCHMARK, '?')}{run}.")


def show_outbox(registered_model: str, version: str) -> None:
    """The version's outbox (`smelter.events`, a JSON list the notifier owns) as people read it: a short
    `smelter.events.status` tag ("delivered 2, pending 1") on the version, the JSON as an artifact of
    its run (`outbox/<model>-v<version>.json`)."""
    client = _client()
    found = client.get_model_version(registered_model, version)
    if OUTBOX_TAG not in found.tags:
        return
    events = json.loads(found.tags[OUTBOX_TAG])
    counts: dict[str, int] = {}
    for event in events:
        for delivery in event.get("deliveries", []):
            counts[delivery["status"]] = counts.get(delivery["status"], 0) + 1
    status = ", ".join(f"{status} {n}" for status, n in sorted(counts.items())) or "no webhooks"
    client.set_model_version_tag(registered_model, version, OUTBOX_STATUS_TAG,
                                 f"{len(events)} event(s): {status}")
    if found.run_id:
        client.log_text(found.run_id, json.dumps(events, indent=2, sort_keys=True),
                        f"outbox/{registered_model}-v{version}.json")


def champion(registry: RegistrySettings, target_name: str) -> Champion | None:
    """The version holding the promotion alias for (pipeline, target), or None."""
    name = registry.model_name(target_name)
    try:
        found = _client().get_model_version_by_alias(name, registry.alias)
    except MlflowException as e:
        if _alias_missing(e):
            return None
        raise
    return as_champion(name, found)


def as_champion(name: str, found: Any) -> Champion:
    """A registered version (MLflow's, or a RegisteredVersion) as the engine record benchmarks fetch and time."""
    return Champion(registered_model=name, version=str(found.version), run_id=found.run_id,
                    build_key=found.tags.get("cache_key") or None, precision=found.tags.get("precision"),
                    engine_identity=found.tags.get(ENGINE_IDENTITY_TAG) or None,
                    model_source=found.tags.get(MODEL_SOURCE_TAG) or None)


def previous_version(registry: RegistrySettings, target_name: str, precision: str, engine: StageResult | None,
                     eval_text: str | None) -> dict[str, Any] | None:
    """The newest registered version of the same (pipeline, precision, target) holding another engine than today's
    build `engine` (by engine identity, as promotion knows a version: a rebuild with other bytes under the same key
    is another engine, the same bytes under another key are not) and measured on `eval_text`, the text today's
    candidate was measured on (its run's EVAL_DATA_TAG; a run from before that was recorded, or a candidate without
    the record, counts as such), with its run's metrics: what the accuracy regression gate compares with. When every
    such version was measured on other text, the newest of them with `other_data` set instead: figures from another
    text are no yardstick."""
    name = registry.model_name(target_name)
    try:
        versions = find_versions(name, {"precision": precision})
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    same = {v.version for v in versions_of_engine(name, engine_identity(engine), engine.key)} if engine else set()
    others = [v for v in versions if v.version not in same]
    if not others:
        return None
    client = _client()
    for version in reversed(others):
        run = client.get_run(version.run_id)
        if eval_text is None or run.data.tags.get(EVAL_DATA_TAG, eval_text) == eval_text:
            return {"version": version.version, "metrics": dict(run.data.metrics)}
    return {"version": others[-1].version, "other_data": True}


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str
    tags: dict[str, str]


def _version(found) -> RegisteredVersion:
    return RegisteredVersion(found.name, str(found.version), found.run_id, dict(found.tags))


def _alias_missing(e: MlflowException) -> bool:
    """MLflow's answer when the registered model, or only the alias, does not exist."""
    return e.error_code == "RESOURCE_DOES_NOT_EXIST" or (
        e.error_code == "INVALID_PARAMETER_VALUE" and "not found" in e.message)


@dataclass(frozen=True)
class ModelInfo:
    """A registered model's description and tags, as they were before a refresh."""

    name: str
    description: str
    tags: dict[str, str]


def ensure_registered_model(name: str, description: str, tags: dict[str, str]) -> ModelInfo | None:
    """Create the registered model or refresh its description and tags.

    Returns None when it was created, else what the refresh replaced, for `restore_registered_model`.
    """
    client = _client()
    try:
        client.create_registered_model(name, tags=tags, description=description)
        return None
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    found = client.get_registered_model(name)
    before = ModelInfo(name, found.description or "", dict(found.tags))
    client.update_registered_model(name, description=description)
    for key, value in tags.items():
        client.set_registered_model_tag(name, key, value)
    return before


def restore_registered_model(before: ModelInfo, refreshed_tags: list[str]) -> None:
    """Undo `ensure_registered_model`'s refresh: its description, and the tags it set."""
    client = _client()
    client.update_registered_model(before.name, description=before.description)
    for key in refreshed_tags:
        if key in before.tags:
            client.set_registered_model_tag(before.name, key, before.tags[key])
        else:
            client.delete_registered_model_tag(before.name, key)


def delete_registered_model(name: str) -> None:
    _client().delete_registered_model(name)


def create_version(name: str, run_id: str, tags: dict[str, str], description: str = "") -> RegisteredVersion:
    """A registry version whose files are the run's `engine` artifacts (a plain dir, not an MLflow model)."""
    created = _client().create_model_version(name, source=f"runs:/{run_id}/engine", run_id=run_id,
                                                  tags=tags, description=description)
    return _version(created)


def delete_version(name: str, version: str, *, missing_ok: bool = False) -> None:
    """Delete a version; `missing_ok`: one already deleted (by another run that found the same duplicate) is fine."""
    try:
        _client().delete_model_version(name, version)
    except MlflowException as e:
        if not (missing_ok and e.error_code == "RESOURCE_DOES_NOT_EXIST"):
            raise


def alias_version(name: str, alias: str) -> str | None:
    """The version an alias points to, or None when the model or the alias does not exist."""
    try:
        return str(_client().get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if _alias_missing(e):
            return None
        raise


def set_alias(name: str, alias: str, version: str) -> None:
    _client().set_registered_model_alias(name, alias, version)


def delete_alias(name: str, alias: str) -> None:
    _client().delete_registered_model_alias(name, alias)


def set_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    client = _client()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)


def delete_version_tag(name: str, version: str, key: str) -> None:
    _client().delete_model_version_tag(name, version, key)


def get_version(name: str, version: str) -> RegisteredVersion:
    return _version(_client().get_model_version(name, version))


def find_versions(name: str, tags: dict[str, str]) -> list[RegisteredVersion]:
    """Versions of a registered model whose tags have these values, oldest first."""
    clauses = [f"name = '{name}'"] + [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    client, found, token = _client(), [], None
    while True:
        page = client.search_model_versions(" AND ".join(clauses), page_token=token)
        found += [_version(v) for v in page]
        token = page.token
        if not token:
            return sorted(found, key=lambda v: int(v.version))


def engine_identity(build: StageResult) -> str | None:
    """A registry version's identity: one sha256 over the engine's files as its build manifest records them (the
    hashes the upload and the check before registering verify on the bytes), less the backend's sidecar, whose
    build times differ on every rebuild; None when the manifest lists no engine file."""
    files = {name: meta for name, meta in (build.manifest.get("files") or {}).items() if name != ENGINE_SIDECAR}
    if not files:
        return None
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name].get('sha256')}\n".encode())
    return digest.hexdigest()


def versions_of_engine(name: str, identity: str | None, build_key: str | None) -> list[RegisteredVersion]:
    """The versions holding the engine with this identity, oldest first: those tagged with it, and those registered
    before versions carried one, known by their build key alone."""
    found = find_versions(name, {ENGINE_IDENTITY_TAG: identity}) if identity else []
    if build_key:
        found += [v for v in find_versions(name, {"cache_key": build_key}) if ENGINE_IDENTITY_TAG not in v.tags]
    return sorted(found, key=lambda v: int(v.version))


def version_description(name: str, version: str) -> str:
    return _client().get_model_version(name, version).description or ""


def set_version_description(name: str, version: str, description: str) -> None:
    _client().update_model_version(name, version, description=description)


def download_version(name: str, version: str, dest: Path) -> Path:
    """The files a registry version points to (its run's `engine` artifacts), into `dest`."""
    return Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(dest)))


def registered_model_exists(name: str) -> bool:
    try:
        _client().get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def find_version(name: str, version: str) -> RegisteredVersion | None:
    """A registry version, or None when the model or the version does not exist."""
    try:
        return get_version(name, version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
