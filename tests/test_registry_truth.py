"""What a user reads in the registry is today's measurement: when a quieter re-measurement replaces the
published one, the registered version's metric tags, description and engine card follow, dated and saying
how busy the machine was; an older measurement never overwrites a newer one."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tasks.config.settings import RegistrySettings
from tasks.config.spec import PipelineSpec
from tasks.outcome import CandidateOutcome
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tasks.stages.accuracy import eval_data
from tests.fixtures.candidates import _point, candidate_outcome, pipeline_spec
from tests.fixtures.judged import judged, promoted

pytestmark = pytest.mark.usefixtures("mlflow_server")


def _remeasured(store: ArtifactStore, spec: PipelineSpec, outcome: CandidateOutcome, *, throughput: float,
                cpu_share: float) -> CandidateOutcome:
    """The same engine in a later run whose benchmark measured again and replaced the published measurement
    (same key, as tasks/stages/benchmark.py does when the new one is less contended)."""
    key = outcome.stages["benchmark"].key
    with store.writing(spec.name, "benchmark", key) as w:
        points = [_point(1, 2.0, 5.0), _point(4, 4000 / throughput, 10.0)]
        w.outputs.update({"points": points, "gate_point": points[1],
                          "host": {"foreign_cpu_share": cpu_share, "contended": False, "contended_above": 0.25}})
    return CandidateOutcome(outcome.candidate, "passed", stages=outcome.stages | {"benchmark": w.result},
                            gates=list(outcome.gates))


def test_a_replaced_measurement_updates_the_versions_tags_description_and_card(tmp_path: Path) -> None:
    spec = pipeline_spec(f"truth-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    name = f"{spec.name}-cpu"
    earlier = candidate_outcome(store, spec, "fp32", "cpu", throughput=300.0)
    promoted(spec, judged(spec, [earlier]))
    first = candidate_outcome(store, spec, "int8", "cpu", throughput=400.0)
    promoted(spec, judged(spec, [first], vs_champion=1.3))  # promoted over `earlier`: its tags say vs_champion
    client = MlflowClient()
    tags = client.get_model_version(name, first.model_version).tags
    assert (tags["throughput"], tags["vs_champion"], tags[tracking.MEASURED_CONTENDED]) == ("400", "1.3", "false")
    first_measured = tags[tracking.MEASURED_AT]

    quieter = _remeasured(store, spec, first, throughput=480.0, cpu_share=0.02)
    promoted(spec, judged(spec, [quieter]))
    assert quieter.model_version == first.model_version and quieter.decision.holds_alias

    version = client.get_model_version(name, first.model_version)
    measured_at = version.tags[tracking.MEASURED_AT]
    taken = datetime.fromtimestamp(quieter.stages["benchmark"].manifest["created_unix"], UTC)
    assert measured_at == taken.isoformat(timespec="milliseconds") and measured_at > first_measured
    assert version.tags["throughput"] == "480" and version.tags[tracking.MEASURED_CPU_SHARE] == "0.02"
    assert version.tags[tracking.MEASURED_CONTENDED] == "false"
    assert version.tags[tracking.MEASURED_RUN] == quieter.run_id
    assert "vs_champion" not in version.tags, "a ratio to a former champion is no figure of today's"
    assert version.tags["status"] == "promoted", "the promotion record stays"
    assert f"Measured {measured_at} on a quiet machine (other processes used 2% of the CPU)" in version.description
    card = mlflow.artifacts.load_text(f"runs:/{first.run_id}/engine_card.md")  # the card the version's run shows
    assert "| throughput | 480 |" in card and f"Measured {measured_at}" in card and "| throughput | 400 |" not in card
    assert card.startswith(f"# {first.candidate.name}") and "## Identity" in card, "only the metric section changed"

    promoted(spec, judged(spec, [first]))  # another host still reading the older measurement
    assert client.get_model_version(name, first.model_version).tags["throughput"] == "480"


def test_the_champion_says_which_model_files_its_engine_was_built_from(tmp_path: Path) -> None:
    """The digest the export read is on the registered version, so a retrained model can supersede it
    (tasks/judge/decide.py) even where its engine comes from the registry."""
    spec = pipeline_spec(f"truth-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    outcome = candidate_outcome(store, spec, "fp32", "cpu", throughput=300.0)
    with store.writing(spec.name, "export", outcome.stages["build"].key) as w:
        w.outputs.update({"model_source": "c" * 64})
    outcome.stages["export"] = w.result
    promoted(spec, judged(spec, [outcome]))
    assert outcome.status == "promoted" and tracking.champion(RegistrySettings.of(spec), "cpu").model_source == "c" * 64


def _measured_on(outcome: CandidateOutcome, text: str) -> CandidateOutcome:
    """The candidate with its accuracy stage's record of the eval text it read (tasks/stages/accuracy.py `eval_data`)."""
    accuracy = outcome.stages["accuracy"]
    manifest = accuracy.manifest | {"inputs": accuracy.manifest.get("inputs", {}) | {"eval_data": text}}
    outcome.stages["accuracy"] = dataclasses.replace(accuracy, manifest=manifest)
    return outcome


def test_accuracy_regressions_are_judged_against_a_version_measured_on_todays_eval_data(tmp_path: Path) -> None:
    """fp32 v1 read today's text, v2 another: v1 is the yardstick. int8 has only a version measured on another
    text: none is, and the gate is told so."""
    spec = pipeline_spec(f"truth-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path)
    today, other = eval_data(spec.resolve(spec.accuracy.data), spec.accuracy.samples), "0" * 64 + ":8"
    same = _measured_on(candidate_outcome(store, spec, "fp32", "cpu", throughput=300.0), today)
    promoted(spec, judged(spec, [same]))
    promoted(spec, judged(spec, [_measured_on(candidate_outcome(store, spec, "fp32", "cpu", throughput=320.0), other)]))
    found = tracking.previous_version(RegistrySettings.of(spec), "cpu", "fp32", engine=None, eval_text=today)
    assert found["version"] == same.model_version and found["metrics"]["accuracy.cosine_mean"] == 0.9988
    int8 = _measured_on(candidate_outcome(store, spec, "int8", "cpu", throughput=500.0), other)
    promoted(spec, judged(spec, [int8]))
    assert tracking.previous_version(RegistrySettings.of(spec), "cpu", "int8", engine=None, eval_text=today) == {
        "version": int8.model_version, "other_data": True}


def test_a_card_rewrite_replaces_each_section_it_is_given_and_nothing_else() -> None:
    """A re-measurement rewrites the card's key metrics and, where the pipeline plans capacity, its capacity
    plan (figures of the same measurement); the other sections stay as they were."""
    client = MlflowClient()  # not mlflow.set_experiment: the process's active experiment is the pipelines' to set
    run_id = client.create_run(client.create_experiment(f"card-{uuid.uuid4().hex[:8]}")).info.run_id
    card = ("# enc/fp32/cpu\n\nStatus: **promoted**\n\n## Key metrics\n\n| throughput | 400 |\n\n"
            "## Capacity plan\n\nAnswer: **7 GPUs**\n\n## Identity\n\n| model | enc |\n")
    client.log_text(run_id, card, "engine_card.md")
    before = tracking.replace_card_sections(run_id, [["## Key metrics", "", "| throughput | 480 |"],
                                                     ["## Capacity plan", "", "Answer: **5 GPUs**"]])
    assert before == card
    now = mlflow.artifacts.load_text(f"runs:/{run_id}/engine_card.md")
    assert now == card.replace("| throughput | 400 |", "| throughput | 480 |").replace("**7 GPUs**", "**5 GPUs**")

    without = "# enc/fp32/cpu\n\n## Key metrics\n\n| throughput | 480 |\n\n## Identity\n\n| model | enc |\n"
    client.log_text(run_id, without, "engine_card.md")
    tracking.replace_card_sections(run_id, [["## Key metrics", "", "| throughput | 500 |"],
                                            ["## Capacity plan", "", "Answer: **5 GPUs**"]])
    assert mlflow.artifacts.load_text(f"runs:/{run_id}/engine_card.md") == without.replace("480", "500"), \
        "a card written before capacity was planned gains no section out of place"
