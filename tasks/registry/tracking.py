"""What smelter records in MLflow, for the rest of the code: the names tasks/registry/ offers outside.

mlflow stays inside tasks/registry/ (its __init__ says how it is split); this module only re-exports,
so `from tasks import tracking; tracking.X` is how stages, flows and tests reach it. Callers look the
names up here when they call, so a test that patches `tracking.X` reaches them (not calls inside the
package).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tasks.registry import versions as _versions
from tasks.registry.candidates import candidate_outcomes, log_candidate, record_gates
from tasks.registry.card import engine_card, finish_candidate, measured_sections, replace_card_sections, restore_card
from tasks.registry.client import ServerLost, server_lost, shown_uri, store_problem, tracking_server, tracking_uri
from tasks.registry.runs import (MAX_TAG_CHARS, OWNER_TAG, describe_pipeline_run, experiment_name, log_directory,
                                 local_ui_port, log_summary_figure, owner_tag, pipeline_run, run_metrics, run_url)
from tasks.registry.uploads import (engine_check_verdict, engine_dir, engine_source, hold_engine_files,
                                    record_engine_check, uploaded_engine_digest)
from tasks.registry.versions import (ENGINE_IDENTITY_TAG, MEASURED_AT, MEASURED_CONTENDED, MEASURED_CPU_SHARE,
                                     MEASURED_RUN, MODEL_SOURCE_TAG, RegisteredVersion, alias_version, as_champion,
                                     champion, delete_alias, delete_registered_model, delete_version,
                                     delete_version_tag, download_version, engine_identity,
                                     find_version, find_versions, get_version, measured_sentence, measurement,
                                     previous_version, registered_model_exists, restore_registered_model,
                                     set_version_description, set_version_tags, show_outbox, version_description,
                                     versions_of_engine)
from tasks.registry.webhooks import create_webhook, delete_webhook, list_webhooks, update_webhook
from tasks.runtime import locks, stop_signals


def _while_held(write: Callable[..., Any]) -> Callable[..., Any]:
    """Checked before a registry version is made, a registered model created or an alias moved: a run whose
    promotion slot may have passed to another run meanwhile (its lease unconfirmed: tasks/runtime/locks.py) stops."""
    @functools.wraps(write)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        locks.raise_if_lease_lost()
        return write(*args, **kwargs)
    return guarded


def _unless_stopped(write: Callable[..., Any]) -> Callable[..., Any]:
    """Checked before a registry version is made or a registered model created: a run whose interrupt was
    swallowed on the way (raised inside a finalizer) must not promote."""
    @functools.wraps(write)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        stop_signals.raise_if_stopped()
        return write(*args, **kwargs)
    return guarded


ensure_registered_model = _while_held(_unless_stopped(_versions.ensure_registered_model))
create_version = _while_held(_unless_stopped(_versions.create_version))
set_alias = _while_held(_versions.set_alias)
