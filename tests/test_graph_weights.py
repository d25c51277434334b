"""An engine's graphs share one weights file: each distinct tensor stored once, each graph given its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tasks.backends.inductor import graph_weights


def test_shared_and_tied_tensors_are_stored_once_and_a_differing_one_beside_them(tmp_path: Path) -> None:
    embed = torch.randn(32, 8)
    qkv = torch.randn(24, 8)
    prefill = {"embed": embed, "lm_head": embed.detach(), "qkv": torch.randint(-8, 8, (24, 8)).to(torch.float8_e4m3fn),
               "qkv_scale": torch.rand(1, 24)}
    decode = {"embed": embed.clone(), "lm_head": embed.clone(), "qkv": qkv}
    counts = graph_weights.save({"prefill": prefill, "decode": decode}, tmp_path / "w.safetensors")
    assert counts["names"] == 7 and counts["tensors_stored"] == 4, counts  # embed, fp8 qkv, scale, decode/qkv
    stored = graph_weights.WeightsFile(tmp_path / "w.safetensors", "cpu")
    loaded = {"prefill": stored.graph("prefill")}  # read alone first, as a runner that only prefills does
    loaded["decode"] = stored.graph("decode")
    for graph, original in (("prefill", prefill), ("decode", decode)):
        assert loaded[graph].keys() == original.keys()
        for name, tensor in original.items():
            assert loaded[graph][name].dtype == tensor.dtype and torch.equal(loaded[graph][name].float(), tensor.float())
    assert loaded["prefill"]["embed"] is loaded["decode"]["lm_head"], "one tensor in memory for every name of it"


def test_a_file_without_the_index_is_refused_by_name(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"other.safetensors: no smelter.graph_weights in its metadata"):
        graph_weights.WeightsFile(tmp_path / "other.safetensors", "cpu")


def test_a_bound_graph_runs_on_the_weights_it_holds() -> None:
    linear = torch.nn.Linear(4, 3)
    program = torch.export.export(graph_weights.WeightsAsInput(linear),
                                  (graph_weights.weights_of(linear), torch.randn(2, 4)), strict=False)
    assert not program.state_dict, "the exported program holds no weights"
    other = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}
    x = torch.randn(2, 4)
    torch.testing.assert_close(graph_weights.Bound(program.module(), other)(x), x.sum(-1, keepdim=True).expand(2, 3))


def test_the_weights_file_gets_the_mode_the_umask_gives_other_files(tmp_path: Path) -> None:
    graph_weights.save({"g": {"w": torch.zeros(2)}}, tmp_path / "w.safetensors")
    (tmp_path / "other").write_text("")
    assert (tmp_path / "w.safetensors").stat().st_mode == (tmp_path / "other").stat().st_mode
