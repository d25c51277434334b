"""A saved exported program loads memoised into the same program as torch.export.load gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.backends.inductor.backend import export_decode, export_prefill
from tasks.backends.inductor.program_load import load_program, memoised_deserializer


@pytest.fixture(scope="module")
def saved_programs(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, dict[str, Path]]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("programs")
    paths = {"prefill": directory / "prefill.pt2", "decode": directory / "decode.pt2"}
    torch.export.save(export_prefill(model, True, 2, 8, weights_as_input=True).program, str(paths["prefill"]))
    torch.export.save(export_decode(model, torch.float32, weights_as_input=True).program, str(paths["decode"]))
    return model, paths


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_a_memoised_load_gives_the_program_a_plain_load_gives(saved_programs: tuple[LlamaForCausalLM, dict[str, Path]],
                                                              graph: str) -> None:
    _, paths = saved_programs
    plain = torch.export.load(str(paths[graph]))
    with memoised_deserializer() as memos:
        memoised = torch.export.load(str(paths[graph]))
    assert memos is not None, "this torch's deserializer no longer reads typing and sympy by those names"
    type_hints, expressions = memos
    assert type_hints.hits > 100 and expressions.hits > 10, "the memos answered no repeated question"
    assert str(memoised.graph) == str(plain.graph)
    assert str(memoised.range_constraints) == str(plain.range_constraints)
    assert memoised.call_spec == plain.call_spec and memoised.graph_signature == plain.graph_signature


def test_a_memoised_prefill_computes_the_model(saved_programs: tuple[LlamaForCausalLM, dict[str, Path]]) -> None:
    from tasks.backends.inductor import graph_weights

    model, paths = saved_programs
    program = load_program(paths["prefill"])
    graph = export_prefill(model, True, 2, 8, weights_as_input=True)
    ids = torch.randint(0, 128, (3, 5))
    with torch.no_grad():
        got = graph_weights.Bound(program.module(), graph.weights)(ids, torch.ones_like(ids))
        expected = model(ids).logits[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_deserializer_is_restored_after_a_load_even_a_failing_one(tmp_path: Path) -> None:
    from torch._export.serde import serialize

    before = (serialize.typing, serialize.sympy)
    (tmp_path / "broken.pt2").write_bytes(b"not a program")
    with pytest.raises(Exception):
        load_program(tmp_path / "broken.pt2")
    assert (serialize.typing, serialize.sympy) == before
