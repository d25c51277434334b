"""Hostile pipelines files and command lines: every one refused before any work starts.

Each case goes through the real command line (`flows.cli.main`) and must give exit code 2, a
message naming the file, the line and the key (`file:line: key: message`), no Python traceback,
a short answer, and no artifacts. The cases are grouped by the class of mistake they stand for;
the few that could hang or exhaust memory if the bounds regressed (alias bombs, big files, deep
nesting, `smelter deploy`) run in a child process with a timeout.

The model directories hold a config.json, a tiny safetensors file and a stub tokenizer (the checks
read configs and weight headers, never weights), made once per session, so the whole module runs in
seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.cli import main

REPO = Path(__file__).resolve().parents[1]
MAX_OUTPUT_CHARS = 4000
CHILD_TIMEOUT_S = 120
CHILD_MAX_RSS_MB = 400
TOKEN = "s3cr3t-t0ken-in-url"

ENC = """\
pipelines:
  enc:
    model: {path: models/bert, task: feature-extraction}
    profiles:
      - {batch: [1, 2, 4], seq: [4, 16, 32]}
    precisions: [fp32, int8]
    targets:
      - {name: cpu, backend: onnxruntime}
    calibration: {data: data/calibration.txt, samples: 16}
    accuracy: {data: data/eval.txt, samples: 8, seq_len: 16, gates: {cosine_mean: {min: 0.99}}}
    benchmark: {batch_sizes: [1, 4], seq_lens: [16], warmup: 1}
    performance: {gates: {p99_ms: {max: 100}}}
"""
DEC = """\
pipelines:
  dec:
    model: {path: models/llama, task: text-generation-with-past}
    profiles:
      - {batch: [1, 2, 4], seq: [1, 16, 32], past: [0, 16, 64]}
    precisions: [fp32]
    targets:
      - {name: cpu, backend: onnxruntime}
    accuracy: {data: data/eval.txt, samples: 8, seq_len: 16, gates: {top1_agreement: {min: 0.9}}}
    benchmark: {batch_sizes: [1, 4], seq_lens: [16], past_len: 16, warmup: 1}
"""
MODEL_CONFIGS = {
    "bert": {"model_type": "bert", "max_position_embeddings": 128},
    "llama": {"model_type": "llama", "max_position_embeddings": 128},
    "distilbert": {"model_type": "distilbert", "max_position_embeddings": 512},
    "gpt2": {"model_type": "gpt2", "n_positions": 64},
    "florp": {"model_type": "florp-not-a-model", "max_position_embeddings": 512},
    "no-type": {"architectures": ["BertModel"]},
    "llama-odd": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 128,
                  "hidden_size": 64, "intermediate_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2},
}


def _safetensors(data_bytes: int) -> bytes:
    """A safetensors file holding one uint8 tensor of `data_bytes` bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(data_bytes)


def edit(base: str, old: str, new: str) -> str:
    assert old in base, old
    return base.replace(old, new, 1)


def enc(old: str, new: str) -> str:
    return edit(ENC, old, new)


def dec(old: str, new: str) -> str:
    return edit(DEC, old, new)


def hook(url: str, extra: str = "") -> str:
    """ENC with one webhook on line 13."""
    return ENC + f"    promotion: {{webhooks: [{{url: '{url}', secret_env: SMELTER_HOSTILE_SECRET{extra}}}]}}\n"


def target(line: str) -> str:
    """ENC with its target (line 8) replaced."""
    return enc("      - {name: cpu, backend: onnxruntime}", f"      - {line}")


@dataclass(frozen=True)
class Case:
    text: str | bytes | None  # the pipelines file; None: none is written
    line: int | None  # where the message must point (None: the file or the command line itself)
    key: str | None  # the key path (or the flag) the message must name
    fragment: str  # what it must say
    argv: tuple[str, ...] = ("validate", "-f", "FILE")
    absent: str = TOKEN  # never printed
    usage: bool = False  # refused by the argument parser, which names no file
    env: tuple[tuple[str, str], ...] = ()  # set for this case (a server or store the command needs)


FILE_CASES = {
    # --- reading the file: encoding, size, kind of file
    "not-utf8-value": Case(ENC.encode().replace(b"warmup: 1", b"warmup: \xff1"), 11, "pipelines.enc.benchmark",
                           "not UTF-8: byte 0xff"),
    "not-utf8-comment": Case(b"# caf\xe9\n" + ENC.encode(), 1, "(top level)", "not UTF-8: byte 0xe9 at column 6"),
    "latin1-file": Case(enc("task: feature-extraction", "task: feature-extraction  # café").encode("latin-1"),
                        3, "pipelines.enc.model", "not UTF-8: byte 0xe9"),
    "utf16-file": Case(ENC.encode("utf-16"), 1, "(top level)", "not UTF-8: byte 0xff at column 1"),
    "nul-byte": Case(enc("warmup: 1", "warmup: 1\0"), 11, "pipelines.enc.benchmark", "is not allowed in YAML"),
    "bell-character": Case(enc("name: cpu", "name: c\apu"), 8, "pipelines.enc.targets", "is not allowed in YAML"),
    "empty-file": Case("", None, None, "expected a mapping with 'pipelines'"),
    "comments-only": Case("# nothing here\n", None, None, "expected a mapping with 'pipelines'"),
    "directory": Case(None, None, None, "cannot read: Is a directory",
                      argv=("validate", "-f", "DIR")),
    "fifo": Case(None, None, None, "cannot read: not a regular file", argv=("validate", "-f", "FIFO")),
    "missing-file": Case(None, None, None, "cannot read: No such file or directory"),
    "dev-zero": Case(None, None, None, "cannot read: not a regular file", argv=("validate", "-f", "/dev/zero")),
    # --- YAML structure: keys must be names written once
    "list-as-key": Case(enc("    precisions:", "    ? [a, b]\n    : 1\n    precisions:"), 6, "pipelines.enc",
                        "a key must be a plain name, not a list or mapping"),
    "mapping-as-key": Case(enc("    precisions:", "    ? {a: 1}\n    : 1\n    precisions:"), 6, "pipelines.enc",
                           "a key must be a plain name"),
    "duplicate-key": Case(enc("    performance:", "    precisions: [fp32]\n    performance:"), 12, "pipelines.enc",
                          "duplicate key 'precisions' (first written on line 6)"),
    "duplicate-pipeline": Case(ENC + ENC.split("pipelines:\n")[1], 13, "pipelines",
                               "duplicate key 'enc' (first written on line 2)"),
    "duplicate-flow-key": Case(target("{name: cpu, backend: onnxruntime, name: cpu2}"), 8, "pipelines.enc.targets.0",
                               "duplicate key 'name'"),
    "boolean-key": Case(ENC.replace("  enc:", "  yes:"), 2, "pipelines", "key True is read as a boolean; keys are names"),
    "number-key": Case(ENC + "    validation: {outputs: {1: {atol: 0.1}}}\n", 13, "pipelines.enc.validation.outputs",
                       "key 1 is read as a number"),
    "null-key": Case(ENC + "    ~: 1\n", 13, "pipelines.enc", "key None is read as null"),
    # --- YAML syntax and tags
    "unclosed-list": Case(enc("[fp32, int8]", "[fp32, int8"), 7, "pipelines.enc.precisions", "YAML syntax error"),
    "bad-indentation": Case(enc("    targets:", "   targets:"), 7, "pipelines", "YAML syntax error"),
    "tab-indentation": Case(enc("    targets:", "\ttargets:"), 7, "pipelines.enc", "YAML syntax error"),
    "unterminated-quote": Case(enc("path: models/bert", "path: 'models/bert"), 3, "pipelines.enc.model.path",
                               "YAML syntax error: found unexpected end of stream"),
    "python-tag": Case(enc("path: models/bert", "path: !!python/object/apply:os.system [ls]"), 3,
                       "pipelines.enc.model.path", "could not determine a constructor for the tag"),
    "custom-tag": Case(enc("warmup: 1", "warmup: !many 3"), 11, "pipelines.enc.benchmark.warmup",
                       "could not determine a constructor for the tag '!many'"),
    "undefined-alias": Case(enc("precisions: [fp32, int8]", "precisions: *all"), 6, "pipelines.enc.precisions",
                            "found undefined alias 'all'"),
    "recursive-alias": Case(enc("precisions: [fp32, int8]", "precisions: &p [fp32, *p]"), 6,
                            "pipelines.enc.precisions.1", "recursive alias"),
    "two-documents": Case(ENC + "---\npipelines: {}\n", 13, "(top level)", "expected a single document"),
    "merge-non-mapping": Case(enc("    performance:", "    <<: 1\n    performance:"), 12, "pipelines.enc",
                              "expected a mapping or list of mappings for merging"),
    # --- the document's shape
    "top-level-list": Case("- pipelines\n", 1, "(top level)", "expected a mapping with 'pipelines'"),
    "top-level-scalar": Case("pipelines\n", 1, "(top level)", "expected a mapping with 'pipelines'"),
    "unknown-top-key": Case("pipeline:\n" + ENC, 1, "pipeline", "unknown key; expected 'defaults' or 'pipelines'"),
    "no-pipelines": Case("pipelines: {}\n", 1, "pipelines", "expected a non-empty mapping of name: pipeline"),
    "pipelines-list": Case("pipelines: [enc]\n", 1, "pipelines", "expected a non-empty mapping"),
    "defaults-list": Case("defaults: [1]\n" + ENC, 1, "defaults", "expected a mapping"),
    "pipeline-scalar": Case("pipelines:\n  enc: 3\n", 2, "pipelines.enc", "expected a mapping"),
    "pipeline-bad-name": Case(ENC.replace("  enc:", "  Enc Model:"), 2, "pipelines.Enc Model.name",
                              "String should match pattern"),
    "pipeline-sets-name": Case(enc("    precisions:", "    name: other\n    precisions:"), 2, "pipelines.enc",
                               "'name'/'base_dir' are set by smelter"),
    "unknown-pipeline-key": Case(enc("    precisions:", "    precisoins: [fp32]\n    precisions:"), 6,
                                 "pipelines.enc.precisoins", "unknown key"),
    "long-key-name": Case(enc("    precisions:", f"    ? {'k' * 5000}\n    : 1\n    precisions:"), 6,
                          "pipelines.enc.kkkkkkkk", "unknown key"),
    "escape-sequence-key": Case(enc("    precisions:", '    "\\e[2J\\e[31m": 1\n    precisions:'), 6,
                                "pipelines.enc.\\x1b[2J\\x1b[31m", "unknown key", absent="\x1b"),
    "many-problems": Case(enc("    precisions:", "".join(f"    unknown{i}: 1\n" for i in range(500)) + "    precisions:"),
                          6, "pipelines.enc.unknown0", "... and 480 more"),
    "huge-value": Case(enc("warmup: 1", f"warmup: {'9' * 20000}x"), 11, "pipelines.enc.benchmark.warmup",
                       "(20003 characters)"),
    # --- strict types: no bool or float where an integer is meant, no strings for numbers
    "bool-as-int": Case(enc("samples: 8", "samples: true"), 10, "pipelines.enc.accuracy.samples",
                        "Input should be a valid integer (got True)"),
    "float-as-int": Case(enc("warmup: 1", "warmup: 3.0"), 11, "pipelines.enc.benchmark.warmup",
                         "Input should be a valid integer"),
    "exponent-as-int": Case(enc("warmup: 1", "warmup: 1e23"), 11, "pipelines.enc.benchmark.warmup",
                            "Input should be a valid integer (got 1e+23)"),
    "huge-float-batch": Case(enc("batch: [1, 2, 4]", "batch: [1, 8, 1e12]"), 5, "pipelines.enc.profiles.0.batch.2",
                             "Input should be a valid integer"),
    "samples-1e20": Case(enc("samples: 16", "samples: 1e20"), 9, "pipelines.enc.calibration.samples",
                         "Input should be a valid integer"),
    "string-as-int": Case(enc("samples: 8", "samples: '8'"), 10, "pipelines.enc.accuracy.samples",
                          "Input should be a valid integer (got '8')"),
    "string-as-bool": Case(target("{name: sm90, backend: tensorrt, arch: sm90, version_compatible: 'yes'}"), 8,
                           "pipelines.enc.targets.0.version_compatible", "Input should be a valid boolean"),
    "int-as-bool": Case(target("{name: sm90, backend: tensorrt, arch: sm90, version_compatible: 1}"), 8,
                        "pipelines.enc.targets.0.version_compatible", "Input should be a valid boolean"),
    "bool-as-float": Case(enc("min: 0.99", "min: true"), 10, "pipelines.enc.accuracy.gates.cosine_mean.min",
                          "Input should be a valid number"),
    "list-as-string": Case(enc("path: models/bert", "path: [models/bert]"), 3, "pipelines.enc.model.path",
                           "Input should be a valid string"),
    "date-as-revision": Case(enc("path: models/bert", "id: org/m, revision: 2024-01-01"), 3,
                             "pipelines.enc.model.revision", "Input should be a valid string"),
    "number-as-list": Case(enc("batch_sizes: [1, 4]", "batch_sizes: 4"), 11,
                           "pipelines.enc.benchmark.batch_sizes", "Input should be a valid list"),
    "opset-float": Case(ENC + "    export: {opset: 17.5}\n", 13, "pipelines.enc.export.opset",
                        "Input should be a valid integer"),
    # --- finite thresholds and tolerances
    "nan-threshold": Case(enc("min: 0.99", "min: .nan"), 10, "pipelines.enc.accuracy.gates.cosine_mean.min",
                          "Input should be a finite number"),
    "inf-threshold": Case(enc("max: 100", "max: .inf"), 12, "pipelines.enc.performance.gates.p99_ms.max",
                          "Input should be a finite number"),
    "minus-inf-threshold": Case(enc("{p99_ms: {max: 100}}", "{speedup_vs_reference: {min: -.inf}}"), 12,
                                "pipelines.enc.performance.gates.speedup_vs_reference.min", "finite number"),
    "nan-tolerance": Case(ENC + "    validation: {atol: .NaN}\n", 13, "pipelines.enc.validation.atol",
                          "Input should be a finite number"),
    "inf-timeout": Case(hook("https://hooks.example/x", ", timeout_s: .inf"), 13,
                        "pipelines.enc.promotion.webhooks.0.timeout_s", "finite number"),
    "huge-threshold": Case(enc("max: 100", "max: 1.0e+300"), 12, "pipelines.enc.performance.gates.p99_ms.max",
                           "less than or equal to 1000000000000"),
    "min-above-max": Case(enc("{max: 100}", "{min: 200, max: 100}"), 12, "pipelines.enc.performance.gates.p99_ms",
                          "min 200.0 is above max 100.0"),
    "threshold-without-bound": Case(enc("{max: 100}", "{}"), 12, "pipelines.enc.performance.gates.p99_ms",
                                    "a threshold needs 'min' or 'max'"),
    "cosine-above-one": Case(enc("min: 0.99", "min: 1.5"), 10, "pipelines.enc.accuracy.gates.cosine_mean",
                             "threshold 1.5 is outside [0, 1]"),
    "negative-latency": Case(enc("max: 100", "max: -1"), 12, "pipelines.enc.performance.gates.p99_ms",
                             "must not be negative"),
    # --- upper bounds, each with the bound in the message
    "batch-too-large": Case(enc("batch: [1, 2, 4]", "batch: [1, 2, 5000]"), 5, "pipelines.enc.profiles.0.batch.2",
                            "less than or equal to 4096"),
    "seq-too-long": Case(enc("seq: [4, 16, 32]", "seq: [4, 16, 1000000]"), 5, "pipelines.enc.profiles.0.seq.2",
                         "less than or equal to 262144"),
    "past-too-long": Case(dec("past: [0, 16, 64]", "past: [0, 16, 9999999]"), 5, "pipelines.dec.profiles.0.past.2",
                          "less than or equal to 262144"),
    "calibration-samples-bound": Case(enc("samples: 16", "samples: 1000000"), 9, "pipelines.enc.calibration.samples",
                                      "less than or equal to 100000"),
    "accuracy-samples-bound": Case(enc("samples: 8", "samples: 100001"), 10, "pipelines.enc.accuracy.samples",
                                   "less than or equal to 100000"),
    "warmup-bound": Case(enc("warmup: 1", "warmup: 1000000"), 11, "pipelines.enc.benchmark.warmup",
                         "less than or equal to 10000"),
    "rounds-bound": Case(enc("warmup: 1", "warmup: 1, min_rounds: 10000000"), 11,
                         "pipelines.enc.benchmark.min_rounds", "less than or equal to 10000"),
    "rounds-too-few": Case(enc("warmup: 1", "warmup: 1, min_rounds: 1"), 11, "pipelines.enc.benchmark.min_rounds",
                           "greater than or equal to 3"),
    "rounds-as-float": Case(enc("warmup: 1", "warmup: 1, min_rounds: 1e23"), 11,
                            "pipelines.enc.benchmark.min_rounds", "Input should be a valid integer"),
    "seconds-bound": Case(enc("warmup: 1", "warmup: 1, max_seconds: 1e9"), 11, "pipelines.enc.benchmark.max_seconds",
                          "less than or equal to 3600"),
    "seconds-infinite": Case(enc("warmup: 1", "warmup: 1, max_seconds: .inf"), 11,
                             "pipelines.enc.benchmark.max_seconds", "Input should be a finite number"),
    "seconds-zero": Case(enc("warmup: 1", "warmup: 1, max_seconds: 0"), 11, "pipelines.enc.benchmark.max_seconds",
                         "greater than 0"),
    "benchmark-precision-nan": Case(enc("warmup: 1", "warmup: 1, precision: .nan"), 11,
                                    "pipelines.enc.benchmark.precision", "Input should be a finite number"),
    "benchmark-precision-bound": Case(enc("warmup: 1", "warmup: 1, precision: 5"), 11,
                                      "pipelines.enc.benchmark.precision", "less than or equal to 1"),
    "benchmark-precision-bool": Case(enc("warmup: 1", "warmup: 1, precision: true"), 11,
                                     "pipelines.enc.benchmark.precision", "Input should be a valid number"),
    "min-improvement-bound": Case(enc("performance: {", "performance: {min_improvement: 100, "), 12,
                                  "pipelines.enc.performance.min_improvement", "less than or equal to 10"),
    "min-improvement-nan": Case(enc("performance: {", "performance: {min_improvement: .nan, "), 12,
                                "pipelines.enc.performance.min_improvement", "Input should be a finite number"),
    "regression-tolerance-bound": Case(enc("seq_len: 16,", "seq_len: 16, regression_tolerance: 2,"), 10,
                                       "pipelines.enc.accuracy.regression_tolerance", "less than or equal to 1"),
    "old-key-repeats": Case(enc("warmup: 1", "warmup: 1, repeats: 50"), 11, "pipelines.enc.benchmark.repeats",
                            "unknown key"),
    "negative-warmup": Case(enc("warmup: 1", "warmup: -1"), 11, "pipelines.enc.benchmark.warmup",
                            "greater than or equal to 0"),
    "threads-bound": Case(target("{name: cpu, backend: onnxruntime, threads: 5000}"), 8,
                          "pipelines.enc.targets.0.threads", "less than or equal to 1024"),
    "threads-zero": Case(target("{name: cpu, backend: onnxruntime, threads: 0}"), 8,
                         "pipelines.enc.targets.0.threads", "greater than or equal to 1"),
    "retries-bound": Case(hook("https://hooks.example/x", ", retries: 100"), 13,
                          "pipelines.enc.promotion.webhooks.0.retries", "less than or equal to 10"),
    "timeout-bound": Case(hook("https://hooks.example/x", ", timeout_s: 3600"), 13,
                          "pipelines.enc.promotion.webhooks.0.timeout_s", "less than or equal to 300"),
    "opset-bound": Case(ENC + "    export: {opset: 99}\n", 13, "pipelines.enc.export.opset",
                        "less than or equal to 23"),
    "optimization-level-bound": Case(target("{name: cpu, backend: onnxruntime, optimization_level: 9}"), 8,
                                     "pipelines.enc.targets.0.optimization_level", "less than or equal to 5"),
    "workspace-bound": Case(target("{name: sm90, backend: tensorrt, arch: sm90, workspace: 10TiB}"), 8,
                            "pipelines.enc.targets.0.workspace", "must be between 1 byte and 1TiB"),
    "workspace-list": Case(target("{name: sm90, backend: tensorrt, arch: sm90, workspace: [4GiB]}"), 8,
                           "pipelines.enc.targets.0.workspace: Input should be a valid", "(got ['4GiB'])"),
    "past-as-text": Case(dec("past: [0, 16, 64]", "past: '0, 16, 64'"), 5,
                         "pipelines.dec.profiles.0.past: Input should be a valid list", "(got '0, 16, 64')"),
    "workspace-words": Case(target("{name: sm90, backend: tensorrt, arch: sm90, workspace: lots}"), 8,
                            "pipelines.enc.targets.0.workspace", "expected a size like '4GiB'"),
    "calibration-seq-bound": Case(enc("samples: 16}", "samples: 16, seq_len: 300000}"), 9,
                                  "pipelines.enc.calibration.seq_len", "less than or equal to 262144"),
    "calibration-batch-bound": Case(enc("samples: 16}", "samples: 16, batch_size: 100000}"), 9,
                                    "pipelines.enc.calibration.batch_size", "less than or equal to 4096"),
    "past-len-bound": Case(dec("past_len: 16", "past_len: 1000000"), 10, "pipelines.dec.benchmark.past_len",
                           "less than or equal to 262144"),
    "too-many-profiles": Case(enc("      - {batch: [1, 2, 4], seq: [4, 16, 32]}\n",
                                  "      - {batch: [1, 2, 4], seq: [4, 16, 32]}\n" * 17), 4,
                              "pipelines.enc.profiles", "List should have at most 16 items"),
    "too-many-batch-sizes": Case(enc("batch_sizes: [1, 4]", f"batch_sizes: {list(range(1, 40))}"), 11,
                                 "pipelines.enc.benchmark.batch_sizes", "List should have at most 32 items"),
    # --- webhooks: parsed, and shown only redacted
    "port-99999": Case(hook(f"https://hooks.example:99999/{TOKEN}"), 13, "pipelines.enc.promotion.webhooks.0.url",
                       "is not a valid URL: expected host[:port] with a port 1-65535"),
    "port-zero": Case(hook(f"https://hooks.example:0/{TOKEN}"), 13, "pipelines.enc.promotion.webhooks.0.url",
                      "port 0; expected a port 1-65535"),
    "port-letters": Case(hook(f"https://hooks.example:{TOKEN}/x"), 13, "pipelines.enc.promotion.webhooks.0.url",
                         "is not a valid URL"),
    "ftp-scheme": Case(hook(f"ftp://hooks.example/{TOKEN}"), 13, "pipelines.enc.promotion.webhooks.0.url",
                       "expected http:// or https://, got 'ftp'"),
    "no-host": Case(hook(f"https:///{TOKEN}"), 13, "pipelines.enc.promotion.webhooks.0.url", "it has no host"),
    "space-in-url": Case(hook(f"https://hooks.example/a {TOKEN}"), 13, "pipelines.enc.promotion.webhooks.0.url",
                         "contains spaces or control characters"),
    "token-in-query-unset-secret": Case(hook(f"https://hooks.example/h?key={TOKEN}"), 13,
                                        "pipelines.enc.promotion.webhooks.0.secret_env",
                                        "environment variable SMELTER_HOSTILE_SECRET is not set"),
    "url-not-a-string": Case(hook(f"https://hooks.example/{TOKEN}").replace(f"url: 'https://hooks.example/{TOKEN}'",
                                                                            "url: [1, 2]"),
                             13, "pipelines.enc.promotion.webhooks.0.url", "Input should be a valid string"),
    "bad-secret-env": Case(hook("https://hooks.example/x").replace("secret_env: SMELTER_HOSTILE_SECRET",
                                                                   "secret_env: 'MY SECRET'"),
                           13, "pipelines.enc.promotion.webhooks.0.secret_env",
                           "expected an environment variable name"),
    # --- schedules: as Prefect's Cron schedule and the IANA database accept them
    "cron-garbage": Case(ENC + "    schedule: {cron: '99 99 foo bar baz'}\n", 13, "pipelines.enc.schedule.cron",
                         "not a cron expression Prefect accepts"),
    "cron-four-fields": Case(ENC + "    schedule: {cron: '0 2 * *'}\n", 13, "pipelines.enc.schedule.cron",
                             "expected a 5-field cron expression"),
    "cron-hashed": Case(ENC + "    schedule: {cron: 'H 2 * * *'}\n", 13, "pipelines.enc.schedule.cron",
                        "not a cron expression Prefect accepts"),
    "cron-month-13": Case(ENC + "    schedule: {cron: '0 2 1 13 *'}\n", 13, "pipelines.enc.schedule.cron",
                          "not a cron expression Prefect accepts"),
    "timezone-mars": Case(ENC + "    schedule: {cron: '0 2 * * *', timezone: Mars/Olympus_Mons}\n", 13,
                          "pipelines.enc.schedule.timezone", "unknown timezone 'Mars/Olympus_Mons'"),
    "timezone-path": Case(ENC + "    schedule: {cron: '0 2 * * *', timezone: ../../etc/passwd}\n", 13,
                          "pipelines.enc.schedule.timezone", "expected an IANA name"),
    # --- data files: readable, UTF-8, non-empty, enough lines, inside the pipelines file's directory
    "data-etc-passwd": Case(enc("data: data/eval.txt", "data: ../../../../../../etc/passwd"), 10,
                            "pipelines.enc.accuracy.data", "outside", absent="root:x:0:0"),
    "data-absolute-outside": Case(enc("data: data/eval.txt", "data: OUTSIDE"), 10, "pipelines.enc.accuracy.data",
                                  "pass --allow-outside-paths"),
    "data-symlink-outside": Case(enc("data: data/eval.txt", "data: data/escape.txt"), 10,
                                 "pipelines.enc.accuracy.data", "outside"),
    "data-home": Case(enc("data: data/eval.txt", "data: ~/eval.txt"), 10, "pipelines.enc.accuracy.data", "outside"),
    "data-symlink-loop": Case(enc("data: data/eval.txt", "data: data/loop.txt"), 10, "pipelines.enc.accuracy.data",
                              "cannot resolve 'data/loop.txt'"),
    "data-empty": Case(enc("data: data/eval.txt", "data: data/empty.txt"), 10, "pipelines.enc.accuracy.data",
                       "has no text (empty, or blank lines only)"),
    "data-blank-lines": Case(enc("data: data/eval.txt", "data: data/blank.txt"), 10, "pipelines.enc.accuracy.data",
                             "has no text"),
    "data-latin1": Case(enc("data: data/eval.txt", "data: data/latin1.txt"), 10, "pipelines.enc.accuracy.data",
                        "is not UTF-8 text: byte 0xe9 on line 2"),
    "data-binary": Case(enc("data: data/calibration.txt", "data: data/binary.bin"), 9,
                        "pipelines.enc.calibration.data", "is not UTF-8 text"),
    "data-directory": Case(enc("data: data/eval.txt", "data: data"), 10, "pipelines.enc.accuracy.data",
                           "expected a text file, cannot read"),
    "data-fifo": Case(enc("data: data/eval.txt", "data: data/fifo"), 10, "pipelines.enc.accuracy.data",
                      "data/fifo: not a regular file"),
    "data-missing": Case(enc("data: data/eval.txt", "data: data/nowhere.txt"), 10, "pipelines.enc.accuracy.data",
                         "No such file or directory"),
    "data-too-few-lines": Case(enc("samples: 8", "samples: 30"), 10, "pipelines.enc.accuracy.data",
                               "has only 20 non-empty lines; accuracy.samples asks for 30"),
    "data-one-huge-line": Case(enc("data: data/eval.txt", "data: data/one-line.txt"), 10, "pipelines.enc.accuracy.data",
                               "one-line.txt line 3 has 2000000 characters; expected one sample per line, each at most 100000"),
    "calibration-one-huge-line": Case(enc("data: data/calibration.txt", "data: data/one-line.txt"), 9,
                                      "pipelines.enc.calibration.data", "line 3 has 2000000 characters"),
    "calibration-too-few-lines": Case(enc("data: data/calibration.txt", "data: data/short.txt"), 9,
                                      "pipelines.enc.calibration.data", "calibration.samples asks for 16"),
    "package-missing": Case(enc("data: data/eval.txt", "data: package://no_such_package_here/eval.txt"), 10,
                            "pipelines.enc.accuracy.data", "python package 'no_such_package_here' is not installed"),
    "package-escape": Case(enc("data: data/eval.txt", "data: package://json/../../../../../../etc/passwd"), 10,
                           "pipelines.enc.accuracy.data", "outside", absent="root:x:0:0"),
    # --- the model: its config, what Optimum exports for it, its positions, KV cache
    "model-dir-missing": Case(enc("path: models/bert", "path: models/nowhere"), 3, "pipelines.enc.model.path",
                              "is not a directory"),
    "model-path-file": Case(enc("path: models/bert", "path: data/eval.txt"), 3, "pipelines.enc.model.path",
                            "is not a directory"),
    "model-no-config": Case(enc("path: models/bert", "path: models/empty"), 3, "pipelines.enc.model.path",
                            "cannot read"),
    "model-config-not-json": Case(enc("path: models/bert", "path: models/not-json"), 3, "pipelines.enc.model.path",
                                  "is not valid JSON"),
    "model-config-no-type": Case(enc("path: models/bert", "path: models/no-type"), 3, "pipelines.enc.model.path",
                                 "has no model_type"),
    "model-config-latin1": Case(enc("path: models/bert", "path: models/latin1"), 3, "pipelines.enc.model.path",
                                "is not UTF-8 text"),
    "model-config-list": Case(enc("path: models/bert", "path: models/list-json"), 3, "pipelines.enc.model.path",
                              "has no model_type"),
    "model-no-weights": Case(enc("path: models/bert", "path: models/no-weights"), 3, "pipelines.enc.model.path",
                             "has no weights; expected model.safetensors or pytorch_model.bin"),
    "model-zero-byte-weights": Case(enc("path: models/bert", "path: models/zero-weights"), 3,
                                    "pipelines.enc.model.path", "model.safetensors is empty (0 bytes)"),
    "model-truncated-safetensors": Case(enc("path: models/bert", "path: models/truncated-weights"), 3,
                                        "pipelines.enc.model.path",
                                        f"model.safetensors is truncated: its header describes {len(_safetensors(100))} bytes, the file has 120"),
    "model-safetensors-header-cut": Case(enc("path: models/bert", "path: models/header-cut"), 3,
                                         "pipelines.enc.model.path", "is not a safetensors file (truncated at 30 bytes"),
    "model-truncated-bin": Case(enc("path: models/bert", "path: models/truncated-bin"), 3, "pipelines.enc.model.path",
                                "pytorch_model.bin is not a PyTorch checkpoint (truncated or damaged"),
    "model-weights-fifo": Case(enc("path: models/bert", "path: models/weights-fifo"), 3, "pipelines.enc.model.path",
                               "model.safetensors is not a regular file"),
    "model-shard-missing": Case(enc("path: models/bert", "path: models/shard-missing"), 3, "pipelines.enc.model.path",
                                "names shard 'model-00002-of-00002.safetensors', which is not a file beside it"),
    "model-no-tokenizer": Case(enc("path: models/bert", "path: models/no-tokenizer"), 3, "pipelines.enc.model.path",
                               "has no tokenizer; expected one of tokenizer.json"),
    "model-sentence-transformers-root": Case(enc("path: models/bert", "path: models/st-layout"), 3,
                                             "pipelines.enc.model.path",
                                             "looks like a sentence-transformers folder: point model.path at its "
                                             "transformer module"),
    "task-not-exported": Case(dec("path: models/llama", "path: models/distilbert"), 3, "pipelines.dec.model.task",
                              "cannot export 'distilbert' models for text-generation-with-past; it supports"),
    "model-type-unknown": Case(enc("path: models/bert", "path: models/florp"), 3, "pipelines.enc.model.task",
                               "cannot export model type 'florp-not-a-model'"),
    "seq-beyond-positions": Case(enc("seq: [4, 16, 32]", "seq: [4, 16, 200]"), 5, "pipelines.enc.profiles.0.seq",
                                 "seq max 200 = 200 tokens is beyond the model's max_position_embeddings 128"),
    "seq-plus-past-beyond-positions": Case(dec("past: [0, 16, 64]", "past: [0, 16, 100]"), 5,
                                           "pipelines.dec.profiles.0.past",
                                           "seq max 32 + past max 100 = 132 tokens is beyond the model's "
                                           "max_position_embeddings 128"),
    "gpt2-n-positions": Case(enc("path: models/bert", "path: models/gpt2").replace("seq: [4, 16, 32]",
                                                                                  "seq: [4, 16, 65]"),
                             5, "pipelines.enc.profiles.0.seq", "beyond the model's n_positions 64"),
    "calibration-beyond-positions": Case(enc("samples: 16}", "samples: 16, seq_len: 129}"), 9,
                                         "pipelines.enc.calibration.seq_len",
                                         "129 tokens is beyond the model's max_position_embeddings 128"),
    "past-without-kv-cache": Case(enc("seq: [4, 16, 32]}", "seq: [4, 16, 32], past: [0, 1, 2]}"), 5,
                                  "pipelines.enc.profiles.0.past", "has no KV cache"),
    "kv-cache-without-past": Case(dec(", past: [0, 16, 64]", ""), 5, "pipelines.dec.profiles.0",
                                  "text-generation-with-past needs 'past: [min, opt, max]'"),
    "no-model-source": Case(enc("path: models/bert, ", ""), 3, "pipelines.enc.model",
                            "either 'id' (a hub id) or 'path' (a local directory) is required"),
    "hub-id-path-traversal": Case(enc("path: models/bert", "id: ../../etc/passwd"), 3, "pipelines.enc.model.id",
                                  "String should match pattern"),
    "unknown-task": Case(enc("task: feature-extraction", "task: image-segmentation"), 3,
                         "pipelines.enc.model.task", "Input should be 'feature-extraction'"),
    # --- targets: one backend table, each backend's own settings
    "unknown-backend": Case(target("{name: cpu, backend: tflite}"), 8, "pipelines.enc.targets.0.backend",
                            "unknown backend 'tflite'; expected one of inductor, onnxruntime, tensorrt"),
    "missing-backend": Case(target("{name: cpu}"), 8, "pipelines.enc.targets.0.backend",
                            "required key is missing; expected one of inductor, onnxruntime"),
    "tensorrt-setting-on-ort": Case(target("{name: cpu, backend: onnxruntime, workspace: 4GiB}"), 8,
                                    "pipelines.enc.targets.0.workspace",
                                    "not a setting of backend onnxruntime; it is a setting of tensorrt"),
    "ort-setting-on-tensorrt": Case(target("{name: sm90, backend: tensorrt, arch: sm90, threads: 4}"), 8,
                                    "pipelines.enc.targets.0.threads",
                                    "not a setting of backend tensorrt; it is a setting of inductor and onnxruntime"),
    "inductor-setting-on-tensorrt": Case(target("{name: sm90, backend: tensorrt, arch: sm90, format: aoti}"), 8,
                                         "pipelines.enc.targets.0.format", "it is a setting of inductor"),
    "tensorrt-without-arch": Case(target("{name: sm90, backend: tensorrt}"), 8, "pipelines.enc.targets.0.arch",
                                  "required key is missing"),
    "arch-not-an-arch": Case(target("{name: gpu, backend: tensorrt, arch: ampere}"), 8,
                             "pipelines.enc.targets.0.arch", "String should match pattern"),
    "hardware-compat-typo": Case(target("{name: sm90, backend: tensorrt, arch: sm90, hardware_compatibility: all}"),
                                 8, "pipelines.enc.targets.0.hardware_compatibility", "got 'all'"),
    "inductor-cuda-without-arch": Case(target("{name: h200, backend: inductor}"), 8, "pipelines.enc.targets.0",
                                       "an inductor target on device cuda needs 'arch'"),
    "inductor-cpu-with-arch": Case(target("{name: pt, backend: inductor, device: cpu, arch: sm90}"), 8,
                                   "pipelines.enc.targets.0", "'arch' is a setting of device cuda"),
    "inductor-cuda-with-threads": Case(target("{name: h200, backend: inductor, arch: sm90, threads: 8}"), 8,
                                       "pipelines.enc.targets.0", "'threads' is a setting of device cpu"),
    "inductor-cpu-cuda-graphs": Case(target("{name: pt, backend: inductor, device: cpu, cuda_graphs: true}"), 8,
                                     "pipelines.enc.targets.0", "'cuda_graphs' needs device cuda"),
    "inductor-device-typo": Case(target("{name: pt, backend: inductor, device: gpu}"), 8,
                                 "pipelines.enc.targets.0.device", "got 'gpu'"),
    "inductor-format-typo": Case(target("{name: h200, backend: inductor, arch: sm90, format: tflite}"), 8,
                                 "pipelines.enc.targets.0.format", "Input should be 'compiled' or 'aoti'"),
    "inductor-mode-typo": Case(target("{name: h200, backend: inductor, arch: sm90, compile_mode: fast}"), 8,
                               "pipelines.enc.targets.0.compile_mode", "got 'fast'"),
    "target-is-a-string": Case(enc("      - {name: cpu, backend: onnxruntime}", "      - cpu"), 8,
                               "pipelines.enc.targets.0", "got 'cpu'"),
    "target-name-uppercase": Case(target("{name: CPU, backend: onnxruntime}"), 8, "pipelines.enc.targets.0.name",
                                  "String should match pattern"),
    "duplicate-target-names": Case(enc("      - {name: cpu, backend: onnxruntime}",
                                       "      - {name: cpu, backend: onnxruntime}\n"
                                       "      - {name: cpu, backend: onnxruntime}"), 9, "pipelines.enc.targets.1",
                                   "duplicate names ['cpu']"),
    # --- precisions: known, and built by some target
    "unknown-precision": Case(enc("[fp32, int8]", "[fp32, int4]"), 6, "pipelines.enc.precisions.1",
                              "Input should be 'fp32', 'fp16', 'bf16', 'int8' or 'fp8'"),
    "duplicate-precision": Case(enc("[fp32, int8]", "[fp32, fp32]"), 6, "pipelines.enc.precisions.1",
                                "duplicate names ['fp32']"),
    "fp8-on-onnxruntime-only": Case(enc("[fp32, int8]", "[fp32, fp8]"), 6, "pipelines.enc.precisions.1",
                                    "no target builds fp8 (cpu: backend onnxruntime does not build fp8"),
    "fp8-before-sm89": Case(enc("[fp32, int8]", "[bf16, fp8]").replace(
        "{name: cpu, backend: onnxruntime}", "{name: a100, backend: inductor, arch: sm80}"), 6,
        "pipelines.enc.precisions.1", "a100: fp8 needs device cuda with arch sm89 or newer"),
    "fp8-on-a-distilbert": Case(enc("[fp32, int8]", "[bf16, fp8]").replace(
        "{name: cpu, backend: onnxruntime}", "{name: h200, backend: inductor, arch: sm90}").replace(
        "models/bert,", "models/distilbert,"), 6, "pipelines.enc.precisions.1",
        "fp8 is built for Llama-family decoders and BERT-family encoders only: the encoder graph supports model_type "
        "bert; this model is distilbert"),
    "fp8-sizes-not-multiples-of-16": Case(dec("[fp32]", "[bf16, fp8]").replace(
        "{name: cpu, backend: onnxruntime}", "{name: h200, backend: inductor, arch: sm90}").replace(
        "models/llama,", "models/llama-odd,"), 6, "pipelines.dec.precisions.1",
        "fp8 products need sizes divisible by 16; this model has intermediate_size = 100"),
    "bf16-on-tensorrt-only": Case(enc("[fp32, int8]", "[bf16]").replace(
        "{name: cpu, backend: onnxruntime}", "{name: sm90, backend: tensorrt, arch: sm90}"), 6,
        "pipelines.enc.precisions.0", "backend tensorrt does not build bf16"),
    "no-precisions": Case(enc("[fp32, int8]", "[]"), 6, "pipelines.enc.precisions",
                          "List should have at least 1 item"),
    # --- gates and the points they read
    "unknown-accuracy-metric": Case(enc("cosine_mean:", "top1_agreement:"), 10,
                                    "pipelines.enc.accuracy.gates.top1_agreement",
                                    "unknown metric for task feature-extraction"),
    "unknown-performance-metric": Case(enc("p99_ms:", "p95_ms:"), 12, "pipelines.enc.performance.gates.p95_ms",
                                       "unknown metric; expected one of"),
    "gate-point-not-benchmarked": Case(enc("performance: {", "performance: {at: {batch: 2, seq: 16}, "), 12,
                                       "pipelines.enc.performance.at", "is not one of the benchmarked"),
    "gate-point-extra-key": Case(enc("performance: {", "performance: {at: {batch: 4, seq: 16, past: 1}, "), 12,
                                 "pipelines.enc.performance.at", "at most 2 items"),
    "profile-unordered": Case(enc("seq: [4, 16, 32]", "seq: [64, 16, 8]"), 5, "pipelines.enc.profiles.0",
                              "seq must satisfy min <= opt <= max"),
    "benchmark-outside-profiles": Case(enc("seq_lens: [16]", "seq_lens: [64]"), 11,
                                       "pipelines.enc.benchmark.seq_lens.0", "64 is outside every profile's seq range"),
    "default-outside-profiles": Case(enc("seq_lens: [16], ", ""), 11, "pipelines.enc.benchmark.seq_lens.0",
                                     "128 is outside every profile's seq range (not written in the file: "
                                     "smelter's default; set it to change it)"),
    "registered-model-collision": Case(ENC.replace("  enc:", "  enc-a:") + ENC.split("pipelines:\n")[1].replace(
        "name: cpu", "name: a-cpu"), 19, "pipelines.enc.targets.0.name",
        "registers MLflow model 'enc-a-cpu', which pipeline enc-a's target cpu registers too"),
    "reserved-alias-latest": Case(ENC + "    promotion: {alias: latest}\n", 13, "pipelines.enc.promotion.alias",
                                  "reserved by the MLflow registry"),
    "reserved-alias-version": Case(ENC + "    promotion: {alias: v3}\n", 13, "pipelines.enc.promotion.alias",
                                   "reserved by the MLflow registry"),
}

CLI_CASES = {
    # --- the command line: bad usage is exit 2 before anything is read or written
    "no-command": Case(ENC, None, None, "the following arguments are required: command", argv=()),
    "unknown-command": Case(ENC, None, None, "invalid choice: 'build'", argv=("build",)),
    "unknown-flag": Case(ENC, None, None, "unrecognized arguments: --no-such-flag",
                         argv=("run", "-f", "FILE", "--no-such-flag"), usage=True),
    "notify-without-retry": Case(ENC, None, None, "the following arguments are required: --retry",
                                 argv=("notify", "-f", "FILE"), usage=True),
    "deploy-takes-no-pipeline": Case(ENC, None, None, "unrecognized arguments: --pipeline",
                                     argv=("deploy", "-f", "FILE", "--pipeline", "enc"), usage=True),
    "unknown-pipeline": Case(ENC, None, "--pipeline nope", "no such pipeline; have enc",
                             argv=("validate", "-f", "FILE", "--pipeline", "nope")),
    "run-unknown-pipeline": Case(ENC, None, "--pipeline nope", "no such pipeline",
                                 argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS", "--pipeline", "nope")),
    "run-undeclared-precision": Case(ENC, None, "--precision fp16", "not a candidate of the selected pipelines",
                                     argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS", "--precision", "fp16")),
    "run-undeclared-target": Case(ENC, None, "--target sm90", "not a candidate of the selected pipelines",
                                  argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS", "--target", "sm90")),
    "artifacts-is-a-file": Case(ENC, None, "--artifacts", "is not a directory",
                                argv=("run", "-f", "FILE", "--artifacts", "FILE")),
    "artifacts-below-a-file": Case(ENC, None, "--artifacts", "is not a directory",
                                   argv=("run", "-f", "FILE", "--artifacts", "FILE/sub")),
    "artifacts-logs-is-a-file": Case(ENC, None, "--artifacts", "cannot keep the run's log in",
                                     argv=("run", "-f", "FILE", "--artifacts", "LOGS_IS_A_FILE")),
    "artifacts-empty": Case(ENC, None, "--artifacts", "expected a directory path",
                            argv=("run", "-f", "FILE", "--artifacts", "")),
    "file-empty": Case(None, None, None, "-f/--file: expected the path of a pipelines file", argv=("validate", "-f", "")),
    "prefect-yaml-in-missing-dir": Case(ENC, None, "--prefect-yaml", "cannot write: No such file or directory",
                                        argv=("deploy", "-f", "FILE", "--prefect-yaml", "MISSING/prefect.yaml")),
    "prefect-yaml-is-a-dir": Case(ENC, None, "--prefect-yaml", "cannot write: Is a directory",
                                  argv=("deploy", "-f", "FILE", "--prefect-yaml", "DIR")),
    "run-selected-pipeline-collides": Case(
        ENC.replace("  enc:", "  enc-a:") + ENC.split("pipelines:\n")[1].replace("name: cpu", "name: a-cpu"), 19,
        "pipelines.enc.targets.0.name", "registers MLflow model 'enc-a-cpu'",
        argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS", "--pipeline", "enc")),
    "mlflow-uri-unknown-scheme": Case(ENC, None, "MLFLOW_TRACKING_URI", "not a store MLflow can use; expected a path or one of",
                                      argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS"),
                                      env=(("MLFLOW_TRACKING_URI", "foo://bar"),)),
    "mlflow-sqlite-dir-missing": Case(ENC, None, "MLFLOW_TRACKING_URI", "the directory of the database",
                                      argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS"),
                                      env=(("MLFLOW_TRACKING_URI", "sqlite:////no/such/dir/mlflow.db"),)),
    "mlflow-sqlite-not-a-database": Case(ENC, None, "MLFLOW_TRACKING_URI", "MLflow cannot open this store",
                                         argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS"),
                                         env=(("MLFLOW_TRACKING_URI", "sqlite:///ARENA/not-a-database.db"),)),
    "mlflow-server-dead": Case(ENC, None, "MLFLOW_TRACKING_URI", "the MLflow server does not answer (ConnectError)",
                               argv=("notify", "--retry", "-f", "FILE", "--artifacts", "ARTIFACTS"),
                               env=(("MLFLOW_TRACKING_URI", f"http://user:{TOKEN}@127.0.0.1:9"),)),
    "mlflow-uri-password-hidden": Case(ENC, None, "MLFLOW_TRACKING_URI", "postgresqlx://db/…#",
                                       argv=("compare", "-f", "FILE", "--artifacts", "ARTIFACTS", "enc-cpu", "1", "2"),
                                       env=(("MLFLOW_TRACKING_URI", f"postgresqlx://bob:{TOKEN}@db/x"),)),
    "run-missing-file": Case(None, None, None, "cannot read: No such file or directory",
                             argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS")),
    "run-bad-file": Case(enc("warmup: 1", "warmup: 1e23"), 11, "pipelines.enc.benchmark.warmup",
                         "Input should be a valid integer", argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS")),
    "plan-bad-file": Case(enc("min: 0.99", "min: .nan"), 10, "pipelines.enc.accuracy.gates.cosine_mean.min",
                          "finite number", argv=("plan", "-f", "FILE", "--artifacts", "ARTIFACTS")),
    "notify-bad-file": Case(hook(f"https://hooks.example:99999/{TOKEN}"), 13,
                            "pipelines.enc.promotion.webhooks.0.url", "port 1-65535",
                            argv=("notify", "--retry", "-f", "FILE", "--artifacts", "ARTIFACTS")),
    "run-selected-pipeline-broken": Case(ENC + DEC.split("pipelines:\n")[1].replace("models/llama", "models/nowhere"),
                                         14, "pipelines.dec.model.path", "is not a directory",
                                         argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS", "--pipeline", "dec")),
}


@pytest.fixture(scope="session")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding model configs and data files, good and bad, beside the pipelines files."""
    root = tmp_path_factory.mktemp("hostile")
    outside = tmp_path_factory.mktemp("outside") / "secret.txt"
    outside.write_text("\n".join(f"outside line {i}" for i in range(20)) + "\n")
    for name, config in MODEL_CONFIGS.items():
        _model_dir(root / "models" / name, config)
    bert = MODEL_CONFIGS["bert"]
    _model_dir(root / "models" / "no-weights", bert, weights={})
    _model_dir(root / "models" / "no-tokenizer", bert, tokenizer=False)
    _model_dir(root / "models" / "zero-weights", bert, weights={"model.safetensors": b""})
    _model_dir(root / "models" / "truncated-weights", bert, weights={"model.safetensors": _safetensors(100)[:120]})
    _model_dir(root / "models" / "header-cut", bert, weights={"model.safetensors": _safetensors(100)[:30]})
    _model_dir(root / "models" / "truncated-bin", bert, weights={"pytorch_model.bin": b"PK\x03\x04" + bytes(60)})
    _model_dir(root / "models" / "weights-fifo", bert, weights={})
    os.mkfifo(root / "models" / "weights-fifo" / "model.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    _model_dir(root / "models" / "shard-missing", bert, weights={
        "model.safetensors.index.json": json.dumps(index).encode(), "model-00001-of-00002.safetensors": _safetensors(4)})
    (root / "models" / "st-layout").mkdir()
    (root / "models" / "st-layout" / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]))
    _model_dir(root / "models" / "st-layout" / "0_Transformer", bert)
    for name, raw in {"not-json": b"{model_type: bert", "latin1": b'{"model_type": "b\xe9rt"}',
                      "list-json": b"[1, 2]"}.items():
        (root / "models" / name).mkdir()
        (root / "models" / name / "config.json").write_bytes(raw)
    (root / "models" / "empty").mkdir()
    (root / "not-a-database.db").write_bytes(b"these bytes are no SQLite database\n" * 200)
    data = root / "data"
    data.mkdir()
    (data / "eval.txt").write_text("\n".join(f"evaluation sentence {i}" for i in range(20)) + "\n")
    (data / "calibration.txt").write_text("\n".join(f"calibration sentence {i}" for i in range(40)) + "\n")
    (data / "empty.txt").write_text("")
    (data / "blank.txt").write_text("\n   \n\t\n")
    (data / "latin1.txt").write_bytes(b"plain\ncaf\xe9\n")
    (data / "short.txt").write_text("one\ntwo\n")
    (data / "one-line.txt").write_text("a\n\n" + "word " * 400_000 + "\n" + "\n".join(["line"] * 40) + "\n")
    (data / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (data / "escape.txt").symlink_to(outside)
    (data / "loop.txt").symlink_to(data / "loop.txt")
    os.mkfifo(data / "fifo")
    os.mkfifo(root / "pipelines.fifo")
    (root / "pipelines.dir").mkdir()
    (root / "logs-is-a-file").mkdir()
    (root / "logs-is-a-file" / "_logs").write_text("a file where the run logs go\n")
    (root / "OUTSIDE").write_text(str(outside))
    return root


def _model_dir(path: Path, config: dict, weights: dict[str, bytes] | None = None, tokenizer: bool = True) -> None:
    """A model folder the checks accept apart from what the arguments break: the checks read the config and
    the weights' headers, never the weights, so a tiny safetensors file and a stub tokenizer do."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, raw in ({"model.safetensors": _safetensors(4)} if weights is None else weights).items():
        (path / name).write_bytes(raw)
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")


def _argv(case: Case, path: Path, arena: Path, name: str) -> list[str]:
    places = {"FILE": str(path), "DIR": str(arena / "pipelines.dir"), "FIFO": str(arena / "pipelines.fifo"),
              "ARTIFACTS": str(arena / "artifacts" / name), "FILE/sub": str(path / "sub"),
              "MISSING/prefect.yaml": str(arena / "no-such-dir" / "prefect.yaml"),
              "LOGS_IS_A_FILE": str(arena / "logs-is-a-file")}
    return [places.get(arg, arg) for arg in case.argv]


def _write(case: Case, path: Path, arena: Path) -> None:
    if case.text is None:
        return
    raw = case.text if isinstance(case.text, bytes) else case.text.encode()
    path.write_bytes(raw.replace(b"OUTSIDE", (arena / "OUTSIDE").read_bytes()))


def _assert_refused(case: Case, path: Path, code: int, output: str) -> None:
    assert code == 2, output
    if case.line is not None:
        assert f"{path}:{case.line}: {case.key}" in output, output
    elif case.env and case.key is not None:  # the environment, not the file, is at fault
        assert f"error: {case.key} " in output, output
    elif case.key is not None:
        assert f"{path}: {case.key}" in output, output
    elif case.argv[1:3] == ("-f", "FILE") and not case.usage:
        assert str(path) in output, output
    assert case.fragment in output, output
    assert "Traceback" not in output, output
    assert len(output) < MAX_OUTPUT_CHARS, len(output)
    assert case.absent not in output, output


def test_the_two_base_files_are_valid(arena: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """So every case below is refused for the one change it makes."""
    for name, text in (("enc", ENC), ("dec", DEC)):
        path = arena / f"base-{name}.yaml"
        path.write_text(text)
        assert main(["validate", "-f", str(path)]) == 0, capsys.readouterr().err
    assert "ok (1 pipelines" in capsys.readouterr().out


@pytest.mark.parametrize("name", [*FILE_CASES, *CLI_CASES])
def test_refused_before_any_work(name: str, arena: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    case = FILE_CASES.get(name) or CLI_CASES[name]
    monkeypatch.delenv("SMELTER_HOSTILE_SECRET", raising=False)
    monkeypatch.setenv("HOME", str(arena.parent))
    for variable, value in case.env:
        monkeypatch.setenv(variable, value.replace("ARENA", str(arena)))
    path = arena / f"{name}.yaml"
    _write(case, path, arena)
    code = main(_argv(case, path, arena, name))
    captured = capsys.readouterr()
    _assert_refused(case, path, code, captured.out + captured.err)
    assert not (arena / "artifacts" / name).exists()


# The child's own peak memory: VmHWM belongs to the process image (ru_maxrss would include the parent's).
CHILD = ("import re, sys\n"
         "from flows.cli import main\n"
         "code = main(sys.argv[1:])\n"
         "peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
         "print(f'maxrss_kb={peak}', file=sys.stderr)\n"
         "sys.exit(code)\n")


def _bomb(levels: int, width: int) -> str:
    lines = ["anchors:", f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n" + ENC.replace("precisions: [fp32, int8]", f"precisions: *l{levels - 1}")


CHILD_CASES = {
    "alias-bomb": Case(_bomb(8, 9), 6, "anchors.l4.1", "alias *l3 expands to 7381 values (an alias bomb?)"),
    "alias-bomb-in-merge": Case(_bomb(8, 9).replace("  enc:\n", "  enc:\n    <<: *l7\n"), 6, "anchors.l4.1",
                                "an alias bomb?"),
    "deep-alias-chain": Case("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: &b [[[[[[[[[[[[[[[[[[[[[[[[[*a]]]]]]]]]]]]]]]]]]]]]]]]]\n",
                             2, "b.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0", "nested deeper than 64 levels"),
    "deep-nesting": Case("a: " + "[" * 100 + "]" * 100 + "\n", 1, "a.0.0.0", "nested deeper than 64 levels"),
    "very-deep-nesting": Case("a: " + "[" * 100_000 + "]" * 100_000 + "\n", 1, "a", "nest"),
    "file-too-large": Case(ENC + "# " + "x" * (300 << 10) + "\n", None, None, "is larger than 262144 bytes"),
    "too-many-values": Case("a: [" + ", ".join(["1"] * 30_000) + "]\n", 1, "a.", "more than 20000 values in the file"),
    # Prefect reads its settings once per process: set before the child starts
    "prefect-server-dead": Case(ENC, None, "PREFECT_API_URL", "the Prefect server does not answer (ConnectError)",
                                argv=("run", "-f", "FILE", "--artifacts", "ARTIFACTS"),
                                env=(("PREFECT_API_URL", f"http://127.0.0.1:9/api/{TOKEN}"),)),
    "deploy-bad-cron": Case(ENC + "    schedule: {cron: '99 99 foo bar baz', timezone: Mars/Olympus_Mons}\n", 13,
                            "pipelines.enc.schedule.cron", "not a cron expression Prefect accepts",
                            argv=("deploy", "-f", "FILE", "--artifacts", "ARTIFACTS")),
}


@pytest.mark.parametrize("name", list(CHILD_CASES))
def test_refused_in_bounded_time_and_memory(name: str, arena: Path) -> None:
    """In a child process with a timeout: a regression fails here instead of hanging the suite."""
    case = CHILD_CASES[name]
    path = arena / f"{name}.yaml"
    _write(case, path, arena)
    env = os.environ | {"PYTHONPATH": str(REPO), "SMELTER_HOSTILE_SECRET": ""} | dict(case.env)
    child = subprocess.run([sys.executable, "-c", CHILD, *_argv(case, path, arena, name)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    output = child.stdout + child.stderr
    rss = re.search(r"maxrss_kb=(\d+)", output)
    assert rss and int(rss.group(1)) < CHILD_MAX_RSS_MB * 1024, output[-2000:]
    _assert_refused(case, path, child.returncode, output.replace(rss.group(0), ""))
    assert not (arena / "artifacts" / name).exists()


def test_each_hostile_input_is_its_own_input_with_its_own_refusal() -> None:
    """The tests above refuse every case for what it states. Here: no case repeats another's input (a
    copy counts as coverage and tests nothing new), no name is in two tables (one would never run), and
    each states what its refusal must say."""
    cases = {**FILE_CASES, **CLI_CASES, **CHILD_CASES}
    assert len(cases) == len(FILE_CASES) + len(CLI_CASES) + len(CHILD_CASES)
    same_input: dict[tuple, list[str]] = {}
    for name, case in cases.items():
        assert case.fragment.strip() and case.fragment != case.absent, name
        same_input.setdefault((case.text, case.argv, case.env), []).append(name)
    assert [names for names in same_input.values() if len(names) > 1] == []
