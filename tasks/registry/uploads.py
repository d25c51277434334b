"""The engine's files in MLflow: uploaded once per distinct engine, so nightly re-runs add no copies.

A run either holds the engine as its `engine` artifacts (with an MLmodel file naming its signature, for
the registry's version page) or names the copy it reuses (`engine_source`): a registry version of the
same bytes, or an earlier run that uploaded them. Files are checked against their sha256 before upload.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import yaml
from mlflow.models import ModelSignature
from mlflow.types import Schema, TensorSpec

from tasks.config.spec import registered_model_name
from tasks.outcome import CandidateOutcome
from tasks.registry.client import _client
from tasks.registry.runs import experiment_name
from tasks.registry.versions import engine_identity, versions_of_engine
from tasks.runtime import killpoints
from tasks.runtime.store import StageResult
from tasks.stages import engine_check

ENGINE_DIGEST_TAG = "engine_sha256"
ENGINE_SOURCE_TAG = "engine_source"  # the engine's copy in MLflow when the run did not upload one itself
ENGINE_CHECK_TAG = "engine_check"  # "passed", or why not: the verdict of the host that built the engine


def _log_engine(pipeline: str, outcome: CandidateOutcome) -> None:
    """Upload the engine unless MLflow already holds this exact one: nightly re-runs add no copies.

    Held already: by a registry version of these very bytes, or by an earlier run of this
    pipeline that uploaded these very files (a rejected engine re-judged every night); the run then
    names that copy in its `engine_source` tag. The files must match their build manifest's sha256
    first (a file that rotted in the cache is never uploaded: EngineRejected fails the candidate);
    the digest of what was uploaded is tagged on the run, and registration checks the files against
    it again.
    """
    build = outcome.stages.get("build")
    if build is None:
        return
    name = registered_model_name(pipeline, outcome.candidate.target)
    holder = versions_of_engine(name, engine_identity(build), build.key) if build.cached else []
    if holder:
        mlflow.set_tag(ENGINE_SOURCE_TAG, f"models:/{name}/{holder[0].version}")
        return
    digest = engine_check.engine_digest(build, engine_check.verify_files(build))
    earlier = _earlier_upload(pipeline, build.key, digest) if build.cached else None
    if earlier:
        mlflow.set_tags({ENGINE_SOURCE_TAG: f"runs:/{earlier}/engine", ENGINE_DIGEST_TAG: digest})
        return
    run_id = mlflow.active_run().info.run_id
    _upload_engine(run_id, build.path, outcome.stages)
    if engine_check.engine_digest(build) != digest:
        raise engine_check.EngineRejected(f"{build.path}: the engine's files changed while they were uploaded")
    mlflow.set_tag(ENGINE_DIGEST_TAG, digest)


def _upload_engine(run_id: str, files: Path, stages: dict[str, StageResult]) -> None:
    """The engine's files as the run's `engine` artifacts, with an MLmodel file naming its signature."""
    client = _client()
    for index, path in enumerate(sorted(p for p in files.rglob("*") if p.is_file() and p.name != "MLmodel")):
        if index == 1:
            killpoints.reach("upload")
        folder = path.parent.relative_to(files).as_posix()
        client.log_artifact(run_id, str(path), "engine" if folder == "." else f"engine/{folder}")
    if (signature := engine_signature(stages)) is not None:
        client.log_text(run_id, _mlmodel(signature, run_id), "engine/MLmodel")


def hold_engine_files(outcome: CandidateOutcome, work_dir: Path) -> None:
    """Upload the engine into the candidate's own run when that run only names an earlier run's copy.

    MLflow accepts a version's source only inside the version's run, and the version must point at
    the run that judged it. So the one upload a rejected engine's later runs skipped is made when
    one of them is about to be registered: from the build here, else from that copy, checked
    against the digest it was uploaded with.
    """
    client = _client()
    tags = client.get_run(outcome.run_id).data.tags
    if not tags.get(ENGINE_SOURCE_TAG, "").startswith("runs:/"):
        return
    build = outcome.stages["build"]
    files = engine_dir(outcome, work_dir)
    if engine_check.engine_digest(dataclasses.replace(build, path=files)) != tags.get(ENGINE_DIGEST_TAG):
        raise engine_check.EngineRejected(f"{tags[ENGINE_SOURCE_TAG]}: the engine's files differ from the digest "
                                          "recorded when they were uploaded")
    _upload_engine(outcome.run_id, files, outcome.stages)
    client.delete_tag(outcome.run_id, ENGINE_SOURCE_TAG)


def _earlier_upload(pipeline: str, build_key: str, digest: str) -> str | None:
    """The oldest finished run of this pipeline that uploaded the engine files with this digest itself."""
    client = _client()
    experiment = client.get_experiment_by_name(experiment_name(pipeline))
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], max_results=50, order_by=["attributes.start_time ASC"],
                              filter_string=f"tags.cache_key = '{build_key}' AND tags.{ENGINE_DIGEST_TAG} = "
                                            f"'{digest}' AND attributes.status = 'FINISHED'")
    return next((r.info.run_id for r in runs if ENGINE_SOURCE_TAG not in r.data.tags), None)


def engine_source(run_id: str) -> str:
    """Where a candidate run's engine files are in MLflow: its own `engine` artifacts, or the copy it names."""
    return _client().get_run(run_id).data.tags.get(ENGINE_SOURCE_TAG) or f"runs:/{run_id}/engine"


def record_engine_check(run_id: str, verdict: str) -> None:
    _client().set_tag(run_id, ENGINE_CHECK_TAG, verdict[:500])


def engine_check_verdict(run_id: str) -> str | None:
    """What the host that built this run's engine found when it checked it (None: not checked there)."""
    return _client().get_run(run_id).data.tags.get(ENGINE_CHECK_TAG)


def uploaded_engine_digest(run_id: str) -> str | None:
    """The sha256 `_log_engine` recorded for the engine it uploaded to this run, if it uploaded one."""
    return _client().get_run(run_id).data.tags.get(ENGINE_DIGEST_TAG)


def engine_signature(stages: dict[str, StageResult]) -> ModelSignature | None:
    """The engine's input and output tensors (dynamic dimensions as -1), from the build manifest when
    it records them, else from the exported graph the engine was built from."""
    for name in ("build", "export"):
        stage = stages.get(name)
        if stage and stage.outputs.get("inputs") and stage.outputs.get("outputs"):
            io = stage.outputs
            break
    else:
        return None

    def schema(tensors: dict[str, Any]) -> Schema:
        return Schema([TensorSpec(np.dtype(t["dtype"]), tuple(d if isinstance(d, int) and d > 0 else -1
                                                              for d in t["shape"]), name)
                       for name, t in tensors.items()])

    return ModelSignature(inputs=schema(io["inputs"]), outputs=schema(io["outputs"]))


def _mlmodel(signature: ModelSignature, run_id: str) -> str:
    """A minimal MLmodel file: the registry's model version page reads the signature from it."""
    return yaml.safe_dump({"artifact_path": "engine", "flavors": {}, "run_id": run_id,
                           "mlflow_version": mlflow.__version__, "signature": signature.to_dict()}, sort_keys=False)


def engine_dir(outcome: CandidateOutcome, dest: Path) -> Path:
    """The candidate's engine on this host: its build directory when the store has it, else the run's
    `engine` artifacts (or the registry version it points to) downloaded into `dest`."""
    build = outcome.stages["build"]
    if build.path.is_dir():
        return build.path
    source = engine_source(outcome.run_id)
    dest.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(source, dst_path=str(dest)))
