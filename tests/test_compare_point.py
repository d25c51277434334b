"""Where `smelter compare` times two versions: the point the user names, else the pipeline's gate point, a decode
step for a decoder with a KV cache (the point its decisions were made at)."""

from __future__ import annotations

from typing import Any

from tasks.config.spec import PipelineSpec
from tasks.config.stage_settings import BenchmarkConfig
from tasks.judge.compare import compared_point


def decoder(task: str, **performance: Any) -> PipelineSpec:
    profile = {"batch": [1, 2, 4], "seq": [1, 16, 64]} | ({"past": [0, 16, 64]} if task.endswith("with-past") else {})
    return PipelineSpec.model_validate({
        "name": "dec", "model": {"id": "org/dec", "task": task}, "profiles": [profile], "precisions": ["fp32"],
        "targets": [{"name": "cpu", "backend": "onnxruntime"}],
        "benchmark": {"batch_sizes": [1, 4], "seq_lens": [16], "past_len": 32}, "performance": performance})


def at(spec: PipelineSpec, batch: int | None, seq: int | None) -> tuple[dict[str, int], dict[str, int]]:
    return compared_point(BenchmarkConfig.of(spec, "cpu"), batch, seq)


def test_a_decoder_with_a_kv_cache_is_compared_at_its_decode_step_unless_a_seq_is_named() -> None:
    spec = decoder("text-generation-with-past")
    assert at(spec, None, None) == ({"batch": 4, "past": 32}, {"batch": 4, "seq": 1, "past": 32})
    assert at(spec, 2, None) == ({"batch": 2, "past": 32}, {"batch": 2, "seq": 1, "past": 32})
    assert at(spec, None, 64) == ({"batch": 4, "seq": 64}, {"batch": 4, "seq": 64, "past": 0})


def test_a_decoder_without_a_cache_rereads_its_prefix_at_a_decode_step_and_a_prefill_gate_point_stays() -> None:
    spec = decoder("text-generation", at={"batch": 1, "past": 32})
    assert at(spec, None, None) == ({"batch": 1, "past": 32}, {"batch": 1, "seq": 33, "past": 0})
    prefill = decoder("text-generation-with-past", at={"batch": 1, "seq": 16})
    assert at(prefill, None, None) == ({"batch": 1, "seq": 16}, {"batch": 1, "seq": 16, "past": 0})
