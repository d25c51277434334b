"""The source model: tokenizer, PyTorch reference and identity, from local directories (no hub)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ModelSource
from tasks.runtime.store import tree_digest
from tasks.stages.models import load_reference, load_tokenizer, model_source_digest
from tests.fixtures.models import load_llama_maker


def _spec(pipeline_factory, model_dir, task):
    return spec_module.load(pipeline_factory(model_dir, task)).pipelines["tiny"]


def _source(pipeline_factory, model_dir, task):
    return ModelSource.of(_spec(pipeline_factory, model_dir, task))


def test_reference_is_fp32_eval_model_for_the_task(tiny_bert_dir, tiny_llama_dir, pipeline_factory):
    encoder = load_reference(_source(pipeline_factory, tiny_bert_dir, "feature-extraction"))
    decoder = load_reference(_source(pipeline_factory, tiny_llama_dir, "text-generation-with-past"))
    assert type(encoder).__name__ == "BertModel"
    assert isinstance(decoder, LlamaForCausalLM)
    for model in (encoder, decoder):
        assert not model.training
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_decoder_tokenizer_without_pad_pads_with_eos(tiny_llama_dir, pipeline_factory, tmp_path):
    no_pad = tmp_path / "no-pad"
    shutil.copytree(tiny_llama_dir, no_pad)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((no_pad / name).read_text())
        config.pop("pad_token", None)
        (no_pad / name).write_text(json.dumps(config))
    tokenizer = load_tokenizer(_source(pipeline_factory, no_pad, "text-generation-with-past"))
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert load_tokenizer(_source(pipeline_factory, tiny_llama_dir, "text-generation")).pad_token == "<pad>"


def test_source_digest_follows_local_files_and_pins_hub_revision(tiny_bert_dir, pipeline_factory, tmp_path):
    spec = _spec(pipeline_factory, tiny_bert_dir, "feature-extraction")
    assert model_source_digest(ModelSource.of(spec)) == tree_digest(tiny_bert_dir)
    hub = spec.model_copy(update={"model": spec.model.model_copy(
        update={"id": "org/model", "path": None, "revision": "abc123"})})
    assert model_source_digest(ModelSource.of(hub)) == "hub:org/model@abc123"


def test_a_hub_model_offline_is_the_commit_its_local_cache_holds(tiny_bert_dir, pipeline_factory, tmp_path,
                                                                  monkeypatch):
    """Without the hub, the revision resolves through the local hub cache (what an offline load reads), so a night
    without the hub sees the same model as a night with it, not "other model files" that rebuild and move the alias."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    refs = tmp_path / "hub" / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = _spec(pipeline_factory, tiny_bert_dir, "feature-extraction")
    hub = spec.model_copy(update={"model": spec.model.model_copy(update={"id": "org/model", "path": None})})
    assert hub.model.revision == "main"
    assert model_source_digest(ModelSource.of(hub)) == f"hub:org/model@{commit}"
    (refs / "main").write_text("not a commit")
    assert model_source_digest(ModelSource.of(hub)) == "hub:org/model@main"


def test_missing_model_dir_is_named(tiny_bert_dir, pipeline_factory, tmp_path):
    shutil.copytree(tiny_bert_dir, tmp_path / "model")  # whole when the file is checked, then damaged
    spec = _spec(pipeline_factory, tmp_path / "model", "feature-extraction")
    (tmp_path / "model" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'model'} has no config.json"):
        load_reference(ModelSource.of(spec))


def test_tiny_llama_maker_is_deterministic(tmp_path):
    maker = load_llama_maker()
    first, second = maker.make_tiny_llama(tmp_path / "a"), maker.make_tiny_llama(tmp_path / "b")
    assert tree_digest(first) == tree_digest(second), "same seed and text must give the same files"
    tokenizer = AutoTokenizer.from_pretrained(first, local_files_only=True)
    assert tokenizer("Fresh bread.")["input_ids"][0] == tokenizer.bos_token_id
    assert {tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {
        "<unk>", "<s>", "</s>", "<pad>"}
    config = json.loads((first / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"], "grouped-query attention like Llama"



def test_weights_that_do_not_fit_the_config_are_refused_not_randomized(tiny_bert_dir, pipeline_factory, tmp_path):
    """A checkpoint whose tensor names do not match its config (another model's, a renamed export) would load as
    random weights with only a logged warning, and an engine of random weights could then pass its gates."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    tensors = load_file(model / "model.safetensors")
    save_file({f"other.{name}": t for name, t in tensors.items()}, model / "model.safetensors")
    spec = _spec(pipeline_factory, model, "feature-extraction")
    with pytest.raises(ValueError, match=r"do not fit its config.json and task feature-extraction: \d+ tensors are "
                                         r"missing \(embeddings\.LayerNorm\.bias, "):
        load_reference(ModelSource.of(spec))
