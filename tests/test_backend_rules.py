"""A rule of one backend is asked of that backend only: the core knows no backend's name or quirks.

A third party's backend here is a TargetSpec subclass declared as a plugin declares one; it is not
registered (a registered one is tests/test_backend_plugin.py's), so the pipeline holding it is made by
copying a validated one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

from tasks.backends.base import TargetSpec
from tasks.config.preflight import config_problems
from tasks.config.spec import PipelineSpec


class AnyModelFp8Target(TargetSpec):
    """A backend with fp8 kernels of its own for any model: it declares no model rule."""

    devices: ClassVar = ("gpu",)
    source: ClassVar = "torch"
    precisions: ClassVar = ("bf16", "fp8")
    implementation: ClassVar = "any_fp8:AnyFp8Backend"

    backend: Literal["any-fp8"]


def encoder_spec(model_dir: Path, target: dict) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "enc", "model": {"path": str(model_dir), "task": "feature-extraction"},
        "profiles": [{"batch": [1, 2, 4], "seq": [8, 16, 32]}], "precisions": ["bf16", "fp8"], "targets": [target]})


def test_an_fp8_target_is_judged_by_its_own_backends_rules_only(tiny_bert_dir: Path) -> None:
    """Inductor builds fp8 for Llama-family decoders and BERT-family encoders alone: it admits the BERT and says
    so of a DistilBERT; another backend's fp8 target is not told so."""
    config = json.loads((tiny_bert_dir / "config.json").read_text())
    inductor = encoder_spec(tiny_bert_dir, {"name": "h200", "backend": "inductor", "arch": "sm90"})
    assert config_problems(inductor, config, "config.json") == []
    distilbert = {**config, "model_type": "distilbert"}
    assert config_problems(inductor, distilbert, "config.json") == [
        (("precisions", 1), "fp8 is built for Llama-family decoders and BERT-family encoders only: the encoder graph "
                            "supports model_type bert; this model is distilbert (config.json)")]
    other = inductor.model_copy(update={"targets": [AnyModelFp8Target(name="h200", backend="any-fp8")]})
    assert [c.name for c in other.candidates()] == ["enc/bf16/h200", "enc/fp8/h200"]
    assert config_problems(other, distilbert, "config.json") == []


def test_a_problem_of_the_precision_is_said_once_and_a_targets_own_setting_at_that_target(tiny_llama_dir: Path) -> None:
    """Two inductor fp8 targets: the model's fp8 problem is one problem of the precision; a glob of fp8_exclude
    that names no product is located at the target that wrote it."""
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    spec = PipelineSpec.model_validate({
        "name": "dec", "model": {"path": str(tiny_llama_dir), "task": "text-generation"},
        "profiles": [{"batch": [1, 2, 3], "seq": [1, 4, 16]}], "precisions": ["bf16", "fp8"],
        "targets": [{"name": "h100", "backend": "inductor", "arch": "sm90"},
                    {"name": "h200", "backend": "inductor", "arch": "sm90", "fp8_exclude": ["layers.0.*", "mlp.*"]}]})
    problems = config_problems(spec, config, "config.json")
    assert [where for where, _ in problems] == [("targets", 1, "fp8_exclude", 1)]
    odd = config_problems(spec, {**config, "intermediate_size": 100}, "config.json")
    assert odd == [(("precisions", 1), "fp8 products need sizes divisible by 16; this model has intermediate_size "
                                       "= 100 (config.json)")]
