"""pipelines.yaml checking: every bad input names file, line, key and what was expected, and exits 2."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flows.cli import main
from tasks.spec import SpecError, load, parse_bytes, select

VALID = """\
defaults:
  benchmark: {batch_sizes: [1, 4], seq_lens: [16], warmup: 1, min_rounds: 3}
pipelines:
  enc:
    model: {path: MODEL, task: feature-extraction}
    profiles:
      - {batch: [1, 2, 4], seq: [4, 16, 32]}
    precisions: [fp32, int8]
    targets:
      - {name: cpu, backend: onnxruntime}
    accuracy: {data: eval.txt, seq_len: 16, gates: {cosine_mean: {min: 0.99}}}
    performance: {gates: {p99_ms: {max: 100}}}
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "eval.txt").write_text("one sentence\nanother sentence\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "calibration.txt").write_text("calibration text\n")
    return tmp_path


def write(workdir: Path, text: str) -> Path:
    path = workdir / "pipelines.yaml"
    path.write_text(textwrap.dedent(text).replace("MODEL", str(workdir / "model")))
    return path


def problems(path: Path) -> str:
    with pytest.raises(SpecError) as err:
        load(path)
    return str(err.value)


def test_valid_file_merges_defaults_and_lists_candidates(workdir: Path) -> None:
    specs = load(write(workdir, VALID))
    enc = specs.pipelines["enc"]
    assert enc.benchmark.batch_sizes == [1, 4]
    assert enc.calibration.samples == 128
    assert [c.name for c in enc.candidates()] == ["enc/fp32/cpu", "enc/int8/cpu"]
    assert enc.gate_point == {"batch": 4, "seq": 16}
    assert enc.profiles[0].shapes()["max"] == {"batch": 4, "seq": 32}


BAD_CASES = {
    "yaml syntax": (VALID.replace("precisions: [fp32, int8]", "precisions: [fp32, int8"), 9, "YAML syntax error"),
    "unknown key": (VALID.replace("    precisions:", "    precisoins: [fp32]\n    precisions:"), 8,
                    "pipelines.enc.precisoins: unknown key"),
    "wrong type": (VALID.replace("min_rounds: 3", "min_rounds: many"), 2, "pipelines.enc.benchmark.min_rounds"),
    "missing model path": (VALID.replace("path: MODEL", "path: /nonexistent/model"), 5,
                           "pipelines.enc.model.path: expected a model directory with config.json"),
    "unsupported task": (VALID.replace("feature-extraction", "image-segmentation"), 5, "pipelines.enc.model.task"),
    "min > opt > max": (VALID.replace("seq: [4, 16, 32]", "seq: [64, 16, 8]"), 7,
                        "seq must satisfy min <= opt <= max"),
    "threshold out of range": (VALID.replace("cosine_mean: {min: 0.99}", "cosine_mean: {min: 1.5}"), 11,
                               "outside [0, 1]"),
    "duplicate target names": (VALID.replace("- {name: cpu, backend: onnxruntime}",
                                             "- {name: cpu, backend: onnxruntime}\n      - {name: cpu, backend: onnxruntime}"),
                               11, "targets: duplicate names ['cpu']"),
    "duplicate precisions": (VALID.replace("[fp32, int8]", "[fp32, fp32]"), 8, "precisions: duplicate names"),
    "unknown precision": (VALID.replace("[fp32, int8]", "[fp32, int4]"), 8, "pipelines.enc.precisions.1"),
    "unknown gate metric": (VALID.replace("cosine_mean: {min", "top1_agreement: {min"), 11,
                            "unknown metric for task feature-extraction"),
    "gpu target without arch": (VALID.replace("backend: onnxruntime}", "backend: tensorrt}"), 10,
                                "a tensorrt target needs 'arch'"),
    "bad workspace": (VALID.replace("backend: onnxruntime}", "backend: tensorrt, arch: sm90, workspace: lots}"), 10,
                      "expected a size like '4GiB'"),
    "eval data missing": (VALID.replace("data: eval.txt", "data: nowhere.txt"), 11,
                          "pipelines.enc.accuracy.data: expected a text file"),
    "benchmark shape outside profiles": (VALID.replace("seq_lens: [16]", "seq_lens: [64]"), 2,
                                         "pipelines.enc.benchmark.seq_lens.0: 64 is outside every profile's seq range"),
    "accuracy seq_len outside profiles": (VALID.replace("seq_len: 16", "seq_len: 64"), 11,
                                          "pipelines.enc.accuracy.seq_len: 64 is outside every profile's seq range"),
    "gate point not benchmarked": (VALID.replace("performance: {", "performance: {at: {batch: 2, seq: 16}, "), 12,
                                   "is not one of the benchmarked batch_sizes x seq_lens"),
    "reserved alias": (VALID + "    promotion: {alias: latest}\n", 13, "reserved by the MLflow registry"),
    "duplicate pipeline names": (VALID + VALID.split("pipelines:\n")[1], 13,
                                 "duplicate key 'enc' (first written on line 4)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_names_file_line_and_key(workdir: Path, case: str) -> None:
    text, line, expected = BAD_CASES[case]
    path = write(workdir, text)
    message = problems(path)
    assert f"{path}:{line}" in message, message
    assert expected in message, message


def test_webhook_secret_must_be_set(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMELTER_TEST_SECRET", raising=False)
    text = VALID + "    promotion: {webhooks: [{url: 'http://127.0.0.1:9/hook', secret_env: SMELTER_TEST_SECRET}]}\n"
    path = write(workdir, text)
    message = problems(path)
    assert f"{path}:13: pipelines.enc.promotion.webhooks.0.secret_env" in message
    assert "SMELTER_TEST_SECRET is not set" in message
    monkeypatch.setenv("SMELTER_TEST_SECRET", "s3cret")
    assert load(path).pipelines["enc"].promotion.webhooks[0].secret_env == "SMELTER_TEST_SECRET"


def test_every_problem_is_reported_at_once(workdir: Path) -> None:
    text = VALID.replace("min_rounds: 3", "min_rounds: many").replace("[fp32, int8]", "[fp32, int4]")
    message = problems(write(workdir, text))
    assert "benchmark.min_rounds" in message and "precisions.1" in message


@pytest.mark.parametrize("case", ["yaml syntax", "unknown key", "missing model path"])
def test_cli_exits_2_before_any_work(workdir: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(workdir, BAD_CASES[case][0])
    artifacts = workdir / "artifacts"
    for command in (["validate"], ["run"], ["plan"]):
        assert main([*command, "-f", str(path), "--artifacts", str(artifacts)]) == 2
        assert str(path) in capsys.readouterr().err
    assert not artifacts.exists()


def test_cli_usage_errors_exit_2(workdir: Path) -> None:
    path = write(workdir, VALID)
    with pytest.raises(SystemExit) as err:
        main(["run", "--no-such-flag"])
    assert err.value.code == 2
    assert main(["run", "-f", str(path), "--pipeline", "nope"]) == 2
    assert main(["run", "-f", str(path), "--precision", "fp16"]) == 2


def test_select_filters_candidates(workdir: Path) -> None:
    specs = load(write(workdir, VALID))
    assert [c.name for c in select(specs, [], ["int8"], [])] == ["enc/int8/cpu"]
    assert len(select(specs, ["enc"], [], ["cpu"])) == 2


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    with pytest.raises(ValueError):
        parse_bytes("four")
