"""`smelter capacity`: GPUs per N tokens/day from measured prefill and decode figures, on recorded H200 figures."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import mlflow
import pytest

from flows.cli import _parser, main
from tasks.config.settings import RunSettings
from tasks.config.spec import Candidate, PipelineSpec
from tasks.measure import capacity
from tasks.measure.capacity import DecodePoint, Figures, FiguresError, Limits, PrefillPoint, Workload
from tasks.metrics import stage_metrics
from tasks.outcome import CandidateOutcome, GateResult
from tasks.registry import tracking
from tasks.registry.card import engine_card
from tasks.runtime.store import StageResult
from tests.fixtures.models import write_pipelines

REPO = Path(__file__).resolve().parents[1]
# The Llama-3.2-1B-shaped bf16 inductor engine on the H200, p90 per call (benchmarks/results/h200.json,
# `decoder.engine`, run of 2026-12-02): prefill 8x512, decode steps at past 512.
H200 = Figures("h200 recorded", "p90", (PrefillPoint(8, 512, 14.325),),
               (DecodePoint(1, 512, 1.072), DecodePoint(64, 512, 1.5966)), "sm90")
BILLION = 1e9


def _by_hand(batch: int, step_ms: float, prompt: int, answer: int, utilisation: float) -> tuple[float, int]:
    """The plan's arithmetic written out independently: request latency and GPUs for 1e9 tokens/day."""
    latency_ms = 14.325 / (8 * 512) * batch * prompt + answer * step_ms
    tokens_per_s = batch * (prompt + answer) / (latency_ms / 1000)
    return latency_ms, math.ceil(BILLION / (86400 * tokens_per_s * utilisation))


def test_billion_tokens_a_day_on_the_h200_engine_at_a_loose_slo_uses_batch_64() -> None:
    result = capacity.plan(H200, Workload(BILLION, prompt=512, answer=256, slo_ms=1000, utilisation=0.6,
                                          gpus_per_host=8))
    latency, gpus = _by_hand(64, 1.5966, 512, 256, 0.6)
    assert result.chosen.batch == 64
    assert result.chosen.latency_ms == pytest.approx(latency)
    assert result.gpus == gpus == 1 and result.hosts == 1
    assert result.tokens_per_day_per_gpu == pytest.approx(86400 * 64 * 768 / (latency / 1000))


def test_a_tight_slo_falls_back_to_the_batch_that_meets_it_and_needs_more_gpus() -> None:
    result = capacity.plan(H200, Workload(BILLION, prompt=512, answer=256, slo_ms=500, utilisation=0.6))
    latency, gpus = _by_hand(1, 1.072, 512, 256, 0.6)
    assert [(o.batch, o.meets_slo) for o in result.options] == [(1, True), (64, False)]
    assert result.chosen.batch == 1 and result.chosen.latency_ms == pytest.approx(latency)
    assert result.gpus == gpus == 7 and result.hosts is None


def test_counting_answer_tokens_only_needs_more_gpus() -> None:
    common = dict(prompt=512, answer=256, slo_ms=1000, utilisation=0.1)
    everything = capacity.plan(H200, Workload(BILLION, **common))
    answers = capacity.plan(H200, Workload(BILLION, count="answer", **common))
    assert answers.chosen.tokens_per_s == pytest.approx(everything.chosen.tokens_per_s * 256 / 768)
    assert answers.gpus > everything.gpus


def test_no_measured_batch_meeting_the_slo_is_an_answer_not_a_number() -> None:
    result = capacity.plan(H200, Workload(BILLION, prompt=512, answer=256, slo_ms=100))
    assert result.chosen is None and result.gpus is None
    assert "no measured batch meets the SLO" in capacity.markdown(result)


def test_markdown_states_the_assumptions_and_the_arithmetic() -> None:
    text = capacity.markdown(capacity.plan(H200, Workload(BILLION, prompt=512, answer=256, slo_ms=1000,
                                                          gpus_per_host=8)))
    for expected in ("p90 of per-call time", "target utilisation 60%", "14.32 ms for 8x512",
                     "512 prompt + 256 answer tokens", "latency ms = prefill + 256 x step",
                     "GPUs = ceil(1e+09 / (", "hosts = ceil(1 / 8) = **1**", "Answer: **1 GPU** on 1 host at batch 64"):
        assert expected in text, expected
    assert "batch 1: a prefill of fewer than 4096 tokens" in text  # the scaling caveat, where it applies


def test_the_profile_bounds_the_batch_and_the_context() -> None:
    workload = Workload(BILLION, prompt=512, answer=256, slo_ms=1000)
    result = capacity.plan(H200, workload, Limits(max_batch=32))
    assert [o.batch for o in result.options] == [1] and result.chosen.batch == 1
    assert any("beyond the profile's max batch 32" in w for w in result.warnings)
    with pytest.raises(ValueError, match="prompt \\+ answer = 768 tokens is beyond the engine's profile"):
        capacity.plan(H200, workload, Limits(max_context=600))


def test_figures_from_the_recorded_h200_results_file() -> None:
    figures = capacity.figures_from_file(REPO / "benchmarks" / "results" / "h200.json")
    assert figures.arch == "sm90" and figures.statistic == "p90"
    assert [(p.batch, p.seq) for p in figures.prefill] == [(8, 512)]
    assert [(d.batch, d.past) for d in figures.decode] == [(1, 512), (64, 512)]
    result = capacity.plan(figures, Workload(BILLION, prompt=512, answer=256, slo_ms=1000))
    assert result.gpus is not None and result.gpus >= 1


def test_figures_from_run_metrics_prefer_p99() -> None:
    metrics = {"b8_s512.p99_ms": 15.0, "b8_s512.p50_ms": 14.0, "decode_b1_p512.p99_ms": 1.2,
               "decode_b1_p512.p50_ms": 1.1, "decode_b64_p512.p99_ms": 1.7, "b8_s512.throughput": 500.0}
    figures = capacity.figures_from_metrics(metrics, "llama-sm90 v3", "sm90")
    assert figures.statistic == "p99"
    assert figures.prefill == (PrefillPoint(8, 512, 15.0),)
    assert figures.decode == (DecodePoint(1, 512, 1.2), DecodePoint(64, 512, 1.7))
    with pytest.raises(FiguresError, match="llama-sm90 v3: expected prefill metrics .* found 1 prefill and 0 decode"):
        capacity.figures_from_metrics({"b8_s128.p99_ms": 3.0}, "llama-sm90 v3")


@pytest.mark.parametrize(("content", "message"), [
    ("{", "expected JSON"),
    ("[1]", "expected a JSON object, got list"),
    ('{"prefill": [], "decode": [{"batch": 1, "past": 8, "ms": 1}]}', "prefill: expected a non-empty list"),
    ('{"prefill": [{"batch": 8, "seq": 512, "ms": 14}], "decode": [{"batch": 1, "past": 8, "ms": "fast"}]}',
     "decode\\[0\\].ms: expected a positive number of milliseconds, got 'fast'"),
    ('{"prefill": [{"batch": 0, "seq": 512, "ms": 14}], "decode": [{"batch": 1, "past": 8, "ms": 1}]}',
     "prefill\\[0\\].batch: expected an integer >= 1, got 0"),
    ('{"decoder": {"engine": {}}}', "decoder: expected engine.prefill.p90_ms"),
])
def test_bad_figures_files_name_the_file_and_the_key(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "figures.json"
    path.write_text(content)
    with pytest.raises(FiguresError, match=f"^{path}: .*{message}"):
        capacity.figures_from_file(path)


def test_cli_answers_from_a_figures_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"arch": "sm90", "statistic": "p99", "prefill": [{"batch": 8, "seq": 512, "ms": 14.325}],
                                "decode": [{"batch": 1, "past": 512, "ms": 1.072},
                                           {"batch": 64, "past": 512, "ms": 1.5966}]}))
    args = ["capacity", "--figures", str(path), "--tokens-per-day", "1e9", "--prompt", "512", "--answer", "256",
            "--slo-ms", "1000"]
    assert main(args) == 0
    assert "Answer: **1 GPU** at batch 64" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == 1
    assert main([*args[:-1], "10"]) == 1  # no batch meets a 10 ms SLO
    assert main([*args[:3], "--tokens-per-day", "0", *args[5:]]) == 2
    assert capsys.readouterr().err.strip().endswith("tokens_per_day: expected a positive number, got 0.0")


@pytest.mark.usefixtures("mlflow_server")
def test_cli_reads_a_registered_versions_measured_figures(tmp_path: Path, tiny_llama_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    pipeline = f"llm-{uuid.uuid4().hex[:8]}"
    pipelines = write_pipelines(tmp_path, tiny_llama_dir, "text-generation-with-past", name=pipeline,
                                profiles=[{"batch": [1, 8, 64], "seq": [1, 128, 256], "past": [0, 128, 256]}])
    name = f"{pipeline}-cpu"
    with mlflow.start_run() as run:
        mlflow.log_metrics({"b8_s512.p99_ms": 14.325, "decode_b1_p512.p99_ms": 1.072,
                            "decode_b64_p512.p99_ms": 1.5966})
    tracking.ensure_registered_model(name, "", {})
    version = tracking.create_version(name, run.info.run_id, {"arch": "sm90"})
    tracking.set_alias(name, "champion", version.version)
    mix = ["--tokens-per-day", "1e9", "--prompt", "128", "--answer", "64", "--slo-ms", "1000"]
    assert main(["capacity", name, "-f", str(pipelines), *mix]) == 0
    out = capsys.readouterr().out
    assert f"figures: {name} v{version.version}, p99 of per-call time" in out and "GPUs (sm90)" in out
    assert "Answer: **1 GPU** at batch 64" in out
    assert "measured at past 512; this mix's mean context while decoding is 159.5 tokens" in out
    assert main(["capacity", name, "-f", str(pipelines), *mix[:4], "--answer", "200", *mix[6:]]) == 2
    assert "prompt + answer = 328 tokens is beyond the engine's profile (at most 257" in capsys.readouterr().err
    assert main(["capacity", name, "--version", "99", "-f", str(pipelines), *mix]) == 2
    assert f"{name} has no version 99" in capsys.readouterr().err


def test_a_cpu_engine_is_planned_in_machines_not_gpus() -> None:
    figures = capacity.figures_from_metrics({"b4_s64.p99_ms": 5.0, "decode_b4_p64.p99_ms": 2.0}, "llm-cpu v2")
    text = capacity.markdown(capacity.plan(figures, Workload(1e6, prompt=32, answer=32, slo_ms=1000)))
    assert "Question: CPU machines to serve" in text and "Answer: **1 CPU machine** at batch 4" in text
    assert "GPU" not in text


def test_cli_refuses_a_plan_for_an_encoder_before_reading_the_registry(
        tmp_path: Path, tiny_bert_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipelines = write_pipelines(tmp_path, tiny_bert_dir, "feature-extraction", name="enc")
    assert main(["capacity", "enc-cpu", "-f", str(pipelines), "--tokens-per-day", "1e6", "--prompt", "32",
                 "--answer", "32", "--slo-ms", "1000"]) == 2
    err = capsys.readouterr().err
    assert f"{pipelines}: capacity enc-cpu: pipeline enc builds a feature-extraction model" in err
    assert "needs a decoder" in err and "Traceback" not in err


# --- the plan on the engine card: the pipeline's `capacity:` mix on a candidate's measured figures ---

def _llama_spec(capacity_settings: dict | None) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "llama", "model": {"id": "org/llama", "task": "text-generation-with-past"},
        "profiles": [{"batch": [1, 8, 64], "seq": [1, 512, 1024], "past": [0, 512, 1024]}], "precisions": ["bf16"],
        "targets": [{"name": "sm90", "backend": "inductor", "arch": "sm90"}],
        "benchmark": {"batch_sizes": [8], "seq_lens": [512], "past_len": 512}}
        | ({"capacity": capacity_settings} if capacity_settings is not None else {}))


def _recorded_outcome(decode: bool = True) -> CandidateOutcome:
    """A promoted candidate whose benchmark stage recorded the H200 figures above as p99 (prefill 8x512; decode
    steps at batch 1 and 64, past 512), as the benchmark stage writes them."""
    point = {"batch": 8, "seq": 512, "p50_ms": 14.0, "p99_ms": 14.325, "throughput": 558.0}
    steps = [{"batch": 1, "past": 512, "p50_ms": 1.0, "p99_ms": 1.072},
             {"batch": 64, "past": 512, "p50_ms": 1.5, "p99_ms": 1.5966}]
    outputs = {"points": [point], "gate_point": point} | ({"decode": steps} if decode else {})
    stages = {"benchmark": StageResult("llama", "benchmark", "bench-key", Path("."), {"outputs": outputs})}
    return CandidateOutcome(Candidate("llama", "bf16", "sm90"), "promoted", stages=stages,
                            gates=[GateResult("accuracy", True)], model_name="llama-sm90", model_version="3")


def _card(capacity_settings: dict | None, decode: bool = True) -> str:
    spec, outcome = _llama_spec(capacity_settings), _recorded_outcome(decode)
    return engine_card(RunSettings.of(spec), outcome, stage_metrics(outcome.stages))


MIX = {"tokens_per_day": BILLION, "prompt": 512, "answer": 256, "slo_ms": 500, "gpus_per_host": 8}


def test_the_engine_card_plans_the_pipelines_capacity_mix_on_the_engines_own_figures() -> None:
    card = _card(MIX)
    figures = capacity.figures_from_metrics({"b8_s512.p99_ms": 14.325, "decode_b1_p512.p99_ms": 1.072,
                                             "decode_b64_p512.p99_ms": 1.5966}, "llama-sm90 v3", "sm90")
    expected = capacity.plan(figures, Workload(BILLION, 512, 256, 500, gpus_per_host=8),
                             capacity.limits_from_profiles(_llama_spec(MIX).profiles))
    _, gpus = _by_hand(1, 1.072, 512, 256, 0.6)
    assert expected.gpus == gpus == 7
    assert capacity.markdown(expected) in card  # the same block `smelter capacity` prints, word for word
    assert "figures: llama-sm90 v3, p99 of per-call time" in card and "GPUs (sm90) to serve 1e+09 tokens/day" in card
    assert f"Answer: **{gpus} GPUs** on 1 host at batch 1" in card
    # after the key metrics (which a re-measurement rewrites up to the next section) and before the identity
    assert card.index("## Key metrics") < card.index("## Capacity plan") < card.index("## Identity")
    assert "## Capacity" not in _card(None)


def test_an_engine_card_without_decode_figures_says_what_the_plan_needs() -> None:
    card = _card(MIX, decode=False)
    section = card[card.index("## Capacity plan"):card.index("## Identity")]
    assert "Not planned: the `capacity:` plan needs this engine's measured prefill figures" in section
    assert "`decode_b<batch>_p<past>.p99_ms`" in section
    assert "this engine was not measured with them (found 1 prefill and 0 decode points)" in section
    assert "Answer" not in section


def test_an_engine_card_says_when_no_measured_batch_meets_the_slo() -> None:
    card = _card(MIX | {"slo_ms": 100})
    assert "Answer: **no measured batch meets the SLO** (fastest: 276.2 ms at batch 1)" in card
    assert "Arithmetic" not in card


def test_the_setting_takes_the_clis_defaults_and_meanings() -> None:
    args = _parser().parse_args(["capacity", "m", "--tokens-per-day", "1e9", "--prompt", "512", "--answer", "256",
                                 "--slo-ms", "500"])
    spec = _llama_spec({"tokens_per_day": BILLION, "prompt": 512, "answer": 256, "slo_ms": 500})
    assert (spec.capacity.utilisation, spec.capacity.count, spec.capacity.gpus_per_host) == (
        args.utilisation, args.count, args.gpus_per_host)
    assert spec.capacity.workload() == Workload(args.tokens_per_day, args.prompt, args.answer, args.slo_ms,
                                                args.utilisation, args.count, args.gpus_per_host)


def test_figures_the_arithmetic_cannot_use_leave_a_line_not_a_failed_card() -> None:
    """The card is written after promotion: a plan that raises (here zero-time figures) costs one line, not the card."""
    spec, outcome = _llama_spec(MIX), _recorded_outcome()
    card = engine_card(RunSettings.of(spec), outcome, {"b8_s512.p99_ms": 0.0, "decode_b1_p512.p99_ms": 0.0})
    assert "## Capacity plan\n\nNot planned: ZeroDivisionError" in card and "## Identity" in card
