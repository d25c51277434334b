"""Mistakes new users made in their pipelines files and data files, refused by `smelter validate` before any work.

Each refusal is one line naming the file (with the line), the key to change and what was expected; the legal
neighbour of each case still loads. Models here are a config.json and file headers (no weights are loaded).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tasks.config.spec import SpecError, load
from tasks.stages.inputs import read_texts
from tests.fixtures.project_files import COSINE, PIPELINE, header_only_project


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return header_only_project(tmp_path)


def write(workdir: Path, text: str = PIPELINE, *, task: str = "feature-extraction", gates: str = COSINE,
          extra: str = "") -> Path:
    path = workdir / "pipelines.yaml"
    path.write_text(textwrap.dedent(text).replace("TASK", task).replace("GATES", gates) + extra)
    return path


def refusal(path: Path, key: str) -> str:
    """The one line of `smelter validate`'s refusal at `key`, checked to name the file and a line of it."""
    with pytest.raises(SpecError) as err:
        load(path, check_env=False)
    lines = [line for line in err.value.problems if f": {key}: " in line]
    assert len(lines) == 1, err.value.problems
    assert re.match(rf"{re.escape(str(path))}:\d+: {re.escape(key)}: ", lines[0]), lines[0]
    return lines[0]


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# --- 1: a gate bound on the side where engines get better


@pytest.mark.parametrize(("task", "section", "metric", "wrong", "right", "kind"), [
    ("text-classification", "accuracy", "label_agreement", "{max: 0.99}", "min", "higher-is-better"),
    ("feature-extraction", "accuracy", "max_abs_error", "{min: 0.001}", "max", "lower-is-better"),
    ("feature-extraction", "performance", "throughput", "{max: 0}", "min", "higher-is-better"),
    ("feature-extraction", "performance", "p99_ms", "{min: 5}", "max", "lower-is-better"),
])
def test_a_gate_bound_that_rejects_better_engines_is_refused(workdir: Path, task: str, section: str, metric: str,
                                                             wrong: str, right: str, kind: str) -> None:
    gates = f"{{cosine_mean: {{min: 0.99}}, {metric}: {wrong}}}"
    text = PIPELINE if section == "accuracy" else PIPELINE.replace("{p99_ms: {max: 100}}", f"{{{metric}: {wrong}}}")
    path = write(workdir, text, task=task, gates=gates if section == "accuracy" else COSINE)
    bound = "max" if right == "min" else "min"
    line = refusal(path, f"pipelines.enc.{section}.gates.{metric}.{bound}")
    assert line.endswith(f"`{bound}` on a {kind} metric rejects better engines; expected `{right}`"), line
    assert line.startswith(f"{path}:{line_of(path, metric)}:")

    fixed = wrong.replace(bound, right)
    gates = f"{{cosine_mean: {{min: 0.99}}, {metric}: {fixed}}}"
    text = PIPELINE if section == "accuracy" else PIPELINE.replace("{p99_ms: {max: 100}}", f"{{{metric}: {fixed}}}")
    assert "enc" in load(write(workdir, text, task=task, gates=gates if section == "accuracy" else COSINE)).pipelines


# --- 2: an op type that is no ONNX operator matches nothing


def test_an_op_type_that_is_no_onnx_operator_is_refused_with_the_close_match(workdir: Path) -> None:
    path = write(workdir, extra="    quantization: {exclude_op_types: [Gemm, MatMull, Zqxjv]}\n")
    line = refusal(path, "pipelines.enc.quantization.exclude_op_types.1")
    assert line.startswith(f"{path}:{line_of(path, 'MatMull')}:")
    assert line.endswith("unknown op type 'MatMull'; expected an ONNX operator name like MatMul or Gemm "
                         "(did you mean MatMul?)"), line
    far = refusal(path, "pipelines.enc.quantization.exclude_op_types.2")
    assert far.endswith("expected an ONNX operator name like MatMul or Gemm"), far
    ok = load(write(workdir, extra="    quantization: {exclude_op_types: [MatMul, Gemm, Attention, FusedMatMul]}\n"))
    assert ok.pipelines["enc"].quantization.exclude_op_types == ["MatMul", "Gemm", "Attention", "FusedMatMul"]


# --- 3: data files: structured formats are not text lines; a byte-order mark is not text


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".tsv", ".parquet"])
def test_a_structured_data_file_is_refused(workdir: Path, suffix: str) -> None:
    (workdir / f"eval{suffix}").write_text('{"text": "one sentence"}\n{"text": "another sentence"}\n')
    path = write(workdir, PIPELINE.replace("data: eval.txt", f"data: eval{suffix}"))
    line = refusal(path, "pipelines.enc.accuracy.data")
    assert line.endswith(f"eval{suffix} is a {suffix} file, which would be read as raw lines (its markup inside "
                         "the samples); expected a UTF-8 text file with one sample per line"), line


def test_a_byte_order_mark_is_not_part_of_the_first_sample(workdir: Path) -> None:
    data = workdir / "bom.txt"
    data.write_bytes("\ufefffirst sample\nsecond sample\n".encode())
    assert read_texts(data) == ["first sample", "second sample"]

    data.write_bytes("\ufeff\n\n".encode())  # a mark and blank lines: no text, as the stages will find
    path = write(workdir, PIPELINE.replace("data: eval.txt", "data: bom.txt"))
    assert refusal(path, "pipelines.enc.accuracy.data").endswith(
        "bom.txt has no text (empty, or blank lines only); expected one sample per line")
    with pytest.raises(ValueError, match="found none"):
        read_texts(data)

    data.write_bytes(b"\xef\xbb\xbfone\n\xff\n")  # the byte named is the bad one, not one of the mark's
    assert refusal(path, "pipelines.enc.accuracy.data").endswith("bom.txt is not UTF-8 text: byte 0xff on line 2")


# --- 4: int8's accuracy fallback with no gate to aim at


def test_an_accuracy_fallback_without_a_cosine_gate_is_refused_as_the_stage_would(workdir: Path) -> None:
    from tasks.stages.int8_fallback import gated_metrics

    fallback = "    quantization: {accuracy_fallback: {max_float_share: 0.2}}\n"
    path = write(workdir, gates="{max_abs_error: {max: 0.1}}", extra=fallback)
    why = ("expected an accuracy gate on cosine_mean or cosine_min (accuracy.gates) to aim at; found max_abs_error")
    line = refusal(path, "pipelines.enc.quantization.accuracy_fallback")
    assert line == f"{path}:{line_of(path, 'accuracy_fallback')}: pipelines.enc.quantization.accuracy_fallback: {why}"

    spec = load(write(workdir, extra=fallback)).pipelines["enc"]
    assert list(gated_metrics(spec)) == ["cosine_mean"]
    ungated = spec.model_copy(update={"accuracy": spec.accuracy.model_copy(update={"gates": {}})})
    with pytest.raises(ValueError) as err:  # the stage's guard says the same, from the same rule
        gated_metrics(ungated)
    assert str(err.value) == f"pipeline enc: quantization.accuracy_fallback: {why.replace('max_abs_error', 'none')}"

    fp32_only = load(write(workdir, PIPELINE.replace("[fp32, int8]", "[fp32]"), gates="{max_abs_error: {max: 0.1}}",
                           extra=fallback))  # no int8 engine: the fallback never runs
    assert "enc" in fp32_only.pipelines


# --- 6: a mistake under defaults: is reported once, where it is written


def test_a_typo_under_defaults_is_reported_once_at_defaults(workdir: Path) -> None:
    second = PIPELINE.split("pipelines:\n")[1].replace("  enc:", "  dec:")
    text = PIPELINE.replace("defaults:\n", "defaults:\n  calibraton: {samples: 2}\n") + second
    path = write(workdir, text)
    with pytest.raises(SpecError) as err:
        load(path, check_env=False)
    assert err.value.problems == [f"{path}:{line_of(path, 'calibraton')}: defaults.calibraton: unknown key"]

    text = PIPELINE.replace("defaults:\n", "defaults:\n  calibration: {sampels: 2}\n")
    assert refusal(write(workdir, text), "defaults.calibration.sampels").endswith(": unknown key")
    text = PIPELINE.replace("    calibration: {samples: 2}\n", "    calibration: {samples: 2, sampels: 2}\n")
    assert refusal(write(workdir, text), "pipelines.enc.calibration.sampels").endswith(": unknown key")


# --- 7: a benchmark shape listed twice


def test_a_benchmark_shape_listed_twice_is_refused_like_a_precision(workdir: Path) -> None:
    path = write(workdir, PIPELINE.replace("{batch_sizes: [1, 4], seq_lens: [16]",
                                           "{batch_sizes: [2, 2], seq_lens: [16, 16]"))
    assert refusal(path, "pipelines.enc.benchmark.batch_sizes.1").endswith(": duplicate values [2]")
    assert refusal(path, "pipelines.enc.benchmark.seq_lens.1").endswith(": duplicate values [16]")
    precisions = write(workdir, PIPELINE.replace("[fp32, int8]", "[fp32, fp32]"))
    assert refusal(precisions, "pipelines.enc.precisions.1").endswith(": duplicate names ['fp32']")
    unordered = write(workdir, PIPELINE.replace("{batch_sizes: [1, 4], seq_lens: [16]",
                                                "{batch_sizes: [4, 1], seq_lens: [16, 8]"))
    assert load(unordered).pipelines["enc"].benchmark.batch_sizes == [4, 1]


def test_a_tab_that_indents_is_named_as_a_tab(workdir: Path) -> None:
    path = write(workdir, PIPELINE.replace("    precisions:", "\tprecisions:"))
    with pytest.raises(SpecError) as err:
        load(path)
    (line,) = err.value.problems
    assert line.startswith(f"{path}:{line_of(path, 'precisions')}:") and line.endswith(
        "it is a tab: YAML indents with spaces"), line


def test_accuracy_read_on_the_calibration_text_is_a_warning(workdir: Path) -> None:
    path = write(workdir, PIPELINE.replace("data: eval.txt", "data: data/calibration.txt"))
    (warning,) = [w for w in load(path).warnings if "accuracy.data" in w]
    assert "is calibration.data too: the accuracy gates would judge int8 or fp8 on the text they were calibrated on" \
        in warning, warning
    assert not [w for w in load(write(workdir)).warnings if "calibration.data too" in w]


# --- a decoder judged on its decode step


def test_a_decode_step_gate_point_must_be_one_the_benchmark_times(workdir: Path) -> None:
    """`performance.at: {batch, past}` names a decode step: a generating task's, at a benchmarked batch, after
    benchmark.past_len tokens (the past the steps are timed at); anything else is refused at the key to change."""
    encoder_config = (workdir / "model" / "config.json").read_text()
    (workdir / "model" / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    decode_at = PIPELINE.replace("{gates: {p99_ms: {max: 100}}}", "{gates: {p99_ms: {max: 100}}, at: POINT}")
    gates = "{top1_agreement: {min: 0.9}}"
    spec = load(write(workdir, decode_at.replace("POINT", "{batch: 4, past: 64}"), task="text-generation", gates=gates),
                check_env=False).pipelines["enc"]
    assert spec.gate_point == {"batch": 4, "past": 64}

    path = write(workdir, decode_at.replace("POINT", "{batch: 4, past: 32}"), task="text-generation", gates=gates)
    assert refusal(path, "pipelines.enc.performance.at.past").endswith(
        ": 32 is not benchmark.past_len (64): decode steps are timed after past_len tokens; "
        "set benchmark.past_len: 32")
    path = write(workdir, decode_at.replace("POINT", "{batch: 2, past: 64}"), task="text-generation", gates=gates)
    assert refusal(path, "pipelines.enc.performance.at.batch").endswith(
        ": 2 is not one of benchmark.batch_sizes [1, 4]")
    (workdir / "model" / "config.json").write_text(encoder_config)
    path = write(workdir, decode_at.replace("POINT", "{batch: 4, past: 64}"))
    assert refusal(path, "pipelines.enc.performance.at").endswith(
        ": {batch, past} names a decode step, and task feature-extraction generates no tokens; "
        "expected {batch: N, seq: N}")
    path = write(workdir, decode_at.replace("POINT", "{batch: 4, steps: 64}"))
    assert refusal(path, "pipelines.enc.performance.at").endswith(
        ": expected {batch: N, seq: N} (a prefill) or, for a decoder, {batch: N, past: N} (a decode step)")


def test_a_top_level_x_block_holds_anchors_for_the_pipelines(workdir: Path) -> None:
    """`x-common: &common {...}` at the top, merged with `<<: *common` (as Compose files do): read through the
    anchors, not refused as an unknown key; another unknown top-level key still is."""
    text = PIPELINE.replace("defaults:\n", "x-bench: &bench {batch_sizes: [1, 2], seq_lens: [16], warmup: 1}\n"
                                           "defaults:\n").replace(
        "    performance:", "    benchmark: {<<: *bench, past_len: 8}\n    performance:")
    spec = load(write(workdir, text)).pipelines["enc"]
    assert (spec.benchmark.batch_sizes, spec.benchmark.past_len) == ([1, 2], 8)
    assert refusal(write(workdir, "common:\n  a: 1\n" + PIPELINE), "common").endswith(
        ": unknown key; expected 'defaults' or 'pipelines' (or 'fleet'; keys starting with 'x-' hold YAML anchors "
        "and are not read)")
