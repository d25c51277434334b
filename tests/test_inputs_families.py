"""Feeds for decoder families whose KV cache differs from Llama's, and validation that sees every input.

Falcon names its kv-head count its own way (multi_query / num_kv_heads), GPTBigCode returns its
cache as an EncoderDecoderCache, and a RoBERTa-family encoder only fails on real tokens at its
longest positions: each is a real tiny model, a real Optimum export and real ONNX Runtime here.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import numpy_helper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tasks.config import spec as spec_module
from tasks.config.stage_settings import ExportConfig, ModelSource, ValidateConfig
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.export import run_export
from tasks.stages.inputs import decoder_feeds, filled_encoder_feeds
from tasks.stages.models import load_reference, load_tokenizer
from tasks.stages.validate import ValidationFailed, feed_shape_problems, run_validate
from tests.fixtures.models import REPO, TEXTS, assert_decoder_step_matches_reference, write_pipelines

SHORT_TEXTS = "Rain today.\nShe smiled.\nThe bus is late.\nCold tea.\n"

# family -> (config class, model class, config kwargs, kv heads the graph declares)
DECODERS = {
    "falcon-multi-query": (transformers.FalconConfig, transformers.FalconForCausalLM,
                           {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}, 1),
    "falcon-multi-head": (transformers.FalconConfig, transformers.FalconForCausalLM,
                          {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                           "multi_query": False}, 2),
    # num_kv_heads below num_attention_heads does not export: transformers caches every head's key,
    # Optimum's dummy cache has num_kv_heads (a preflight matter, not a feeds one)
    "falcon-new-architecture": (transformers.FalconConfig, transformers.FalconForCausalLM,
                                {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "new_decoder_architecture": True, "num_kv_heads": 2}, 2),
    "gpt-bigcode": (transformers.GPTBigCodeConfig, transformers.GPTBigCodeForCausalLM,
                    {"n_embd": 64, "n_layer": 2, "n_head": 2}, 1),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, {"n_embd": 64, "n_layer": 2, "n_head": 2}, 2),
}


def _make_decoder(out: Path, tokenizer_dir: Path, family: str) -> Path:
    config_class, model_class, kwargs, _ = DECODERS[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    model_class(config_class(vocab_size=len(tokenizer), **ids, **kwargs)).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=[*DECODERS, "llama"])
def decoder(request, tiny_llama_dir, tmp_path_factory):
    """(family, spec, store, with-past export) of one tiny decoder; Llama is the reference family."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model_dir = tiny_llama_dir if family == "llama" else _make_decoder(root / "model", tiny_llama_dir, family)
    spec = spec_module.load(write_pipelines(root, model_dir, "text-generation-with-past")).pipelines["tiny"]
    store = ArtifactStore(root / "artifacts")
    return family, spec, store, run_export(ExportConfig.of(spec), store)


def _declared(export: StageResult) -> dict[str, list]:
    return {name: facts["shape"] for name, facts in export.outputs["inputs"].items()}


def test_empty_cache_takes_the_heads_the_graph_declares(decoder):
    family, spec, _, export = decoder
    tokenizer, reference = load_tokenizer(ModelSource.of(spec)), load_reference(ModelSource.of(spec))
    declared = _declared(export)
    heads, head_dim = declared["past_key_values.0.key"][1], declared["past_key_values.0.key"][3]
    if family != "llama":
        assert heads == DECODERS[family][3], "the test model has the kv-head count it was meant to"
    from_graph = decoder_feeds(tokenizer, reference, TEXTS, 2, 4, 0, list(declared), declared)
    from_reference = decoder_feeds(tokenizer, reference, TEXTS, 2, 4, 0, list(declared))
    for feeds in (from_graph, from_reference):
        assert feeds["past_key_values.1.value"].shape == (2, heads, 0, head_dim)
        assert not feed_shape_problems(feeds, declared, "prefill")


@pytest.mark.parametrize("batch, seq, past", [(1, 4, 0), (2, 1, 8)])
def test_onnx_matches_reference_from_names_alone(decoder, batch, seq, past):
    """What the accuracy and benchmark stages do: feeds from the engine's input names, no declared dims."""
    _, spec, _, export = decoder
    tokenizer, reference = load_tokenizer(ModelSource.of(spec)), load_reference(ModelSource.of(spec))
    assert_decoder_step_matches_reference(export.file("model.onnx"), tokenizer, reference, spec.model.task,
                                          batch, seq, past, atol=1e-4, rtol=1e-3)


def test_validation_passes_with_past(decoder):
    _, spec, store, export = decoder
    outputs = run_validate(ValidateConfig.of(spec), export, store).outputs
    assert outputs["passed"] is True
    assert "prefill" in outputs["outputs"]["present.0.key"]


def test_feed_shape_problems_name_input_fed_and_declared_shape():
    declared = {"input_ids": ["batch_size", "sequence_length"],
                "past_key_values.0.key": ["batch_size", 1, "past_sequence_length", 32]}
    good = {"input_ids": np.zeros((2, 4), np.int64), "past_key_values.0.key": np.zeros((2, 1, 0, 32), np.float32)}
    assert feed_shape_problems(good, declared, "prefill") == []
    zero_size = dict(good, **{"past_key_values.0.key": np.zeros((2, 2, 0, 32), np.float32)})
    assert feed_shape_problems(zero_size, declared, "prefill") == [
        "input 'past_key_values.0.key' at prefill: fed shape [2, 2, 0, 32], the graph declares "
        "['batch_size', 1, 'past_sequence_length', 32] (axis 1 must be 1)"]
    other_batch = dict(good, **{"past_key_values.0.key": np.zeros((3, 1, 0, 32), np.float32)})
    [problem] = feed_shape_problems(other_batch, declared, "max")
    assert "axis 0 'batch_size' is 3, but 2 in 'input_ids'" in problem


def test_validation_refuses_feeds_the_graph_does_not_declare(tiny_llama_dir, tmp_path):
    """A graph that declares 1 kv head while the reference caches 2: reported before any comparison."""
    spec = spec_module.load(write_pipelines(tmp_path, tiny_llama_dir, "text-generation-with-past")).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    export = run_export(ExportConfig.of(spec), store)
    manifest = copy.deepcopy(export.manifest)
    manifest["outputs"]["inputs"]["past_key_values.0.key"]["shape"][1] = 1
    edited = StageResult(export.pipeline, "export", f"{export.key}-edited", export.path, manifest)
    with pytest.raises(ValidationFailed) as failed:
        run_validate(ValidateConfig.of(spec), edited, store)
    assert ("input 'past_key_values.0.key' at max: fed shape [3, 2, 24, 16], the graph declares "
            "['batch_size', 1, 'past_sequence_length', 16] (axis 1 must be 1)") in str(failed.value)


def _make_xlmr(out: Path, max_positions: int) -> Path:
    """A tiny XLM-R classifier with pad_token_id 3: its positions start at 4, so it takes max_positions - 4 tokens."""
    special = {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
               "mask_token": "[MASK]"}
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train([str(REPO / "data" / "calibration.txt")],
                  trainers.WordPieceTrainer(vocab_size=300, special_tokens=list(special.values()), show_progress=False))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", backend.token_to_id("[CLS]")),
                                                 ("[SEP]", backend.token_to_id("[SEP]"))])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=512,
                                                     model_input_names=["input_ids", "attention_mask"], **special)
    assert tokenizer.pad_token_id == 3
    config = transformers.XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64, num_labels=3,
                                           max_position_embeddings=max_positions, pad_token_id=3)
    torch.manual_seed(0)
    transformers.XLMRobertaForSequenceClassification(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory) -> Path:
    return _make_xlmr(tmp_path_factory.mktemp("xlmr"), max_positions=24)


def _xlmr_export(root: Path, model_dir: Path):
    """An export whose profile reaches the model's last usable position (20 tokens), validated on short texts,
    which padding would leave far from that position."""
    spec = spec_module.load(write_pipelines(root, model_dir, "text-classification",
                                            profiles=[{"batch": [1, 1, 2], "seq": [4, 8, 20]}])).pipelines["tiny"]
    (root / "data" / "eval.txt").write_text(SHORT_TEXTS)
    store = ArtifactStore(root / "artifacts")
    return spec, store, run_export(ExportConfig.of(spec), store)


def _fewer_positions(export: StageResult, out: Path, rows: int) -> StageResult:
    """A copy of an export whose position table keeps only its first `rows` rows: an engine that cannot
    take the profile's longest real input, though the profile is legal for the model."""
    shutil.copytree(export.path, out)
    graph = onnx.load(str(out / "model.onnx"))
    table = next(t for t in graph.graph.initializer if "position_embeddings" in t.name)
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table)[:rows].copy(), table.name))
    onnx.save(graph, str(out / "model.onnx"))
    return StageResult(export.pipeline, "export", f"{export.key}-fewer-positions", out, export.manifest)


def test_filled_encoder_feeds_have_no_padding(xlmr_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(xlmr_dir, local_files_only=True)
    feeds = filled_encoder_feeds(tokenizer, SHORT_TEXTS.split("\n")[:4], 3, 20, ["input_ids", "attention_mask"])
    assert feeds["input_ids"].shape == (3, 20) and feeds["attention_mask"].all()
    assert (feeds["input_ids"] != tokenizer.pad_token_id).all()
    assert (feeds["input_ids"][0] != feeds["input_ids"][1]).any(), "rows start from different texts"


def test_validation_runs_real_tokens_at_every_position(xlmr_dir, tmp_path):
    """20 real tokens take positions 4..23; padded short texts would only reach position 8 (pads sit at 3)."""
    spec, store, export = _xlmr_export(tmp_path, xlmr_dir)
    assert run_validate(ValidateConfig.of(spec), export, store).outputs["passed"] is True
    short_table = _fewer_positions(export, tmp_path / "short-table", rows=20)
    with pytest.raises(ValidationFailed, match=r"onnxruntime failed at max shape \{'batch': 2, 'seq': 20\}"):
        run_validate(ValidateConfig.of(spec), short_table, store)
