"""The engine card: the one page someone deciding on a deploy reads first, on each candidate's run.

Markdown (`engine_card.md`), and HTML with the run's summary figure inside, since the MLflow UI shows
.md files as text. Its key-metrics section is dated, and rewritten when a quieter re-measurement
replaces a registered version's figures.
"""

from __future__ import annotations

import base64
import html

import mlflow
from mlflow.exceptions import MlflowException

from tasks.config.settings import RunSettings
from tasks.measure import capacity
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome
from tasks.registry.client import _client
from tasks.registry.runs import (DESCRIPTION_TAG, MAX_TAG_CHARS, SUMMARY_FIGURE, _log_bytes, candidate_description,
                                 candidate_tags, gate_tag)
from tasks.registry.versions import measured_sentence, measurement

ENGINE_CARD = "engine_card.md"


def engine_card(record: RunSettings, outcome: CandidateOutcome, metrics: dict[str, float],
                figure: str | None = None) -> str:
    """A one-page summary someone deciding on a deploy reads before anything else; `figure`: the image
    (a path or a data: URI) of the run's summary figure, shown under the verdict."""
    tags = candidate_tags(record, outcome)
    lines = [f"# {outcome.candidate.name}", "",
             f"Status: **{outcome.status}**" + ("" if tags["gate"] == "pending" else f", gates {tags['gate']}"), "",
             f"Why: {outcome.reason}", ""]
    if figure:
        lines += [f"![every candidate of this run: speedup vs PyTorch, gate, champion]({figure})", ""]
    if outcome.model_version:
        lines += [f"Registry: `{outcome.model_name}` version {outcome.model_version}", ""]
    if outcome.error:
        lines += [f"Error in stage `{outcome.failed_stage}`: {outcome.error}", ""]
    lines += ["## Gates", "", "| gate | passed | reasons |", "|---|---|---|"]
    lines += [f"| {g.gate} | {'yes' if g.passed else 'no'} | {'; '.join(g.reasons)} |" for g in outcome.gates]
    for section in measured_sections(record, outcome, metrics):
        lines += ["", *section]
    if runtime := runtime_section(outcome):
        lines += ["", *runtime]
    lines += ["", "## Identity", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {tags[k]} |" for k in ("model", "precision", "target", "arch", "backend",
                                               "backend_version", "cache_key") if k in tags]
    lines += [f"| stage {name} | {stage.key} |" for name, stage in outcome.stages.items()]
    return "\n".join(lines) + "\n"


def measured_sections(record: RunSettings, outcome: CandidateOutcome, metrics: dict[str, float],
                      source: str | None = None) -> list[list[str]]:
    """The card's sections made from the measurement, which a re-measurement rewrites: the key metrics, dated,
    and, where the pipeline sets `capacity:`, the capacity plan (`source` names the figures' version)."""
    sections = [metrics_section(key_metrics(metrics), measurement(outcome))]
    if record.capacity is not None:
        sections.append(capacity_section(record, outcome, metrics, source))
    return sections


def runtime_section(outcome: CandidateOutcome) -> list[str]:
    """The settings the engine was measured with, which a deployment must use to see the same figures: the
    benchmark's threads and the session settings the backend recorded at build (ONNX Runtime's)."""
    build, benchmark = outcome.stages.get("build"), outcome.stages.get("benchmark")
    rows = [("threads", benchmark.outputs["threads"])] if benchmark and "threads" in benchmark.outputs else []
    options = dict(build.outputs.get("session_options", {})) if build else {}
    rows += [(name, value) for name, value in options.pop("config_entries", {}).items()]
    rows += [(name, value) for name, value in options.items() if name != "intra_op_num_threads"]
    if not rows:
        return []
    return (["## Runtime settings", "", "Measured with these; a deployment that sets them sees the same figures.", "",
             "| setting | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows])


def metrics_section(metrics: dict[str, float], measured: dict[str, str]) -> list[str]:
    """The engine card's key metrics, dated: the part a re-measurement rewrites on a registered version's card."""
    lines = ["## Key metrics", ""] + ([measured_sentence(measured), ""] if measured else [])
    return lines + ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())]


def capacity_section(record: RunSettings, outcome: CandidateOutcome, metrics: dict[str, float],
                     source: str | None = None) -> list[str]:
    """The pipeline's `capacity:` deployment planned on this engine's measured figures, as `smelter capacity`
    prints it; one line instead when it cannot be planned. Never raises: the card is written after promotion."""
    if source is None:
        source = f"{outcome.model_name} v{outcome.model_version}" if outcome.model_version else outcome.candidate.name
    head = ["## Capacity plan", ""]
    try:
        figures = capacity.figures_from_metrics(metrics, source, record.target(outcome.candidate.target).gpu_arch)
        limits = capacity.limits_from_profiles(list(record.profiles))
        result = capacity.plan(figures, record.capacity.workload(), limits)
        return capacity.markdown(result).rstrip("\n").split("\n")
    except capacity.FiguresError as e:
        found = str(e).rpartition("; found ")[2]
        return head + ["Not planned: the `capacity:` plan needs this engine's measured prefill figures "
                       "(`b<batch>_s<seq>.p99_ms`) and decode-step figures (`decode_b<batch>_p<past>.p99_ms`), and "
                       f"this engine was not measured with them (found {found or 'none'})."]
    except Exception as e:  # noqa: BLE001 - arithmetic on recorded figures must not cost the card
        return head + [f"Not planned: {type(e).__name__}: {e}"]


def replace_card_sections(run_id: str, sections: list[list[str]]) -> str | None:
    """Put each of `sections` (lines, the first its `## ` title) in place of the section of that title on the
    run's engine card; returns the card as it was, or None (and changes nothing) when the run has no card
    with its first section. A section the card does not have is left out."""
    try:
        before = mlflow.artifacts.load_text(f"runs:/{run_id}/{ENGINE_CARD}")
    except (MlflowException, OSError):
        return None
    card = before
    for number, section in enumerate(sections):
        start = card.find(f"\n{section[0]}\n")
        if start < 0:
            if number == 0:
                return None
            continue
        end = card.find("\n## ", start + 1)
        card = card[:start + 1] + "\n".join(section) + "\n" + (card[end:] if end >= 0 else "")
    _client().log_text(run_id, card, ENGINE_CARD)
    return before


def restore_card(run_id: str, text: str) -> None:
    _client().log_text(run_id, text, ENGINE_CARD)


def finish_candidate(run_id: str, record: RunSettings, outcome: CandidateOutcome, figure: bytes | None = None) -> None:
    """Record what was decided on the candidate's run: final status, the reason, the engine card (as
    markdown, and as HTML with the run's summary figure `figure` inside, which the UI shows as a page)."""
    tags = {"status": outcome.status, "gate": gate_tag(outcome), "decision_reason": outcome.reason[:MAX_TAG_CHARS],
            DESCRIPTION_TAG: candidate_description(outcome)}
    if outcome.model_name:
        tags |= {"registered_model": outcome.model_name, "model_version": str(outcome.model_version)}
    client = _client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    metrics = stage_metrics(outcome.stages)
    client.log_text(run_id, engine_card(record, outcome, metrics, SUMMARY_FIGURE if figure else None),
                    "engine_card.md")
    if figure:
        _log_bytes(client, run_id, figure, SUMMARY_FIGURE)
        embedded = f"data:image/png;base64,{base64.b64encode(figure).decode()}"
        client.log_text(run_id, _html(outcome.candidate.name, engine_card(record, outcome, metrics, embedded)),
                        "engine_card.html")


def _html(title: str, markdown: str) -> str:
    """A markdown card as a page the MLflow UI shows as such (it shows .md files as text)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(markdown)
    style = ("body{font-family:sans-serif;max-width:60em;margin:1em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{body}</body></html>")
