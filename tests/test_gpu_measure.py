"""The arithmetic behind GPU figures, checked on the CPU: statistics, FLOP and byte counts."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, LlamaConfig

from tasks.measure import gpu_measure as gm

LLAMA_32_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)


def test_summary_of_cpu_tensors_and_lists_gives_median_and_spread() -> None:
    samples = torch.arange(1, 101, dtype=torch.float32)
    stats = gm.summary(samples)
    assert stats["median_ms"] == pytest.approx(50.5) and stats["min_ms"] == 1.0 and stats["n"] == 100
    assert stats["p10_ms"] == pytest.approx(10.9) and stats["p90_ms"] == pytest.approx(90.1)
    assert gm.summary([3.0, 1.0, 2.0])["median_ms"] == 2.0
    with pytest.raises(ValueError, match="no samples"):
        gm.summary([])


def test_llama_1b_prefill_is_8_25_tflop_with_last_token_logits() -> None:
    shape = gm.DecoderShape.from_config(LLAMA_32_1B)
    assert shape.matrix_params == pytest.approx(1.236e9, rel=2e-3)
    assert shape.prefill_flops(8, 512) / 1e12 == pytest.approx(8.25, abs=0.01)
    every_position = shape.prefill_flops(8, 512, last_token_logits=False)
    assert every_position - shape.prefill_flops(8, 512) == 2 * (4096 - 8) * 128256 * 2048


def test_decode_bytes_count_weights_once_and_the_cache_actually_read() -> None:
    shape = gm.DecoderShape.from_config(LLAMA_32_1B)
    weights = shape.decode_bytes(1, 0, 2)
    assert weights / 1e9 == pytest.approx(2.47, abs=0.01)
    kv_b64_past512 = 2 * 16 * 64 * 8 * 64 * 512 * 2
    assert shape.decode_bytes(64, 512, 2) - weights == kv_b64_past512
    assert gm.bytes_bound_ms(weights, 4.3) == pytest.approx(0.575, abs=0.002)
    assert gm.bound_ms(8.25e12, 744) == pytest.approx(11.09, abs=0.01)


def test_bert_base_encoder_flops() -> None:
    flops = gm.encoder_flops(BertConfig(), 8, 512)
    linear = 12 * 2 * 4096 * (4 * 768 * 768 + 2 * 768 * 3072)
    assert flops == linear + 12 * 4 * 8 * 512 * 512 * 768


def test_logit_agreement_counts_flipped_choices_and_says_how_close_the_reference_was() -> None:
    reference = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.9, 0.0], [0.0, 0.0, 5.0], [2.0, 0.0, 1.0]])
    candidate = reference.clone()
    candidate[1] = torch.tensor([0.9, 1.0, 0.0])  # the near-tie flips
    got = gm.logit_agreement([reference[:2], reference[2:]], [candidate[:2], candidate[2:]])
    assert got["positions"] == 4 and got["top1"] == 0.75
    assert got["top1_95"][0] < 0.75 < got["top1_95"][1]  # 3 of 4 says little
    assert got["reference_margin_median"] == pytest.approx(1.5)  # margins 2, 0.1, 5, 1
    assert got["relative_error"] == pytest.approx(float(torch.tensor(0.1 * 2 ** 0.5) / reference.norm()), rel=1e-3)
    assert gm.logit_agreement([reference], [reference])["top1"] == 1.0
    with pytest.raises(ValueError, match=r"reference logits \(4, 3\) and candidate logits \(4, 2\) differ"):
        gm.logit_agreement([reference], [reference[:, :2]])
