"""Model families smelter had not seen, refused by `smelter validate` before any stage instead of deep inside one.

Each model is real: a tiny transformers config with random weights, saved with a BPE tokenizer trained here.
Each refusal must name the pipelines file, the key to change, the model's config.json and what was expected;
the legal neighbour of each case must still pass. Only the pad-token case exports (its fix is in the export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from tasks.config import spec as spec_module
from tasks.config.spec import SpecError
from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore
from tasks.stages import inputs
from tasks.stages.export import run_export
from tasks.stages.models import load_reference, load_tokenizer
from tests.fixtures.models import REPO, load_llama_maker, write_pipelines

SIZES = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
ENCODER_PROFILE = {"batch": [1, 1, 2], "seq": [4, 16, 32]}


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """One BPE tokenizer (512 tokens with <unk> <s> </s> <pad>) for every model here: training costs a second."""
    return load_llama_maker().train_tokenizer(REPO / "data" / "calibration.txt")


def tokenizer_with(base: PreTrainedTokenizerFast, *roles: str) -> PreTrainedTokenizerFast:
    """The same vocabulary naming only these special tokens (a checkpoint that ships no pad, or no eos either)."""
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    return PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, model_max_length=512,
                                   **{role: specials[role] for role in roles})


def save_model(out: Path, model_class: str, config: Any, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A from_pretrained-loadable folder: config.json, random weights of `model_class`, the tokenizer."""
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def validate(directory: Path, model_dir: Path, task: str, **overrides: Any) -> tuple[Path, str]:
    """(the pipelines file, what `smelter validate` says about it: its problems, '' when it loads)."""
    path = write_pipelines(directory, model_dir, task, **overrides)
    try:
        spec_module.load(path, check_env=False)
    except SpecError as e:
        return path, str(e)
    return path, ""


def refused(message: str, path: Path, key: str, *fragments: str) -> None:
    """The message names the file, the key a user changes and the expectation."""
    line = next((line for line in message.splitlines() if f"pipelines.tiny.{key}: " in line), None)
    assert line is not None, message
    assert line.startswith(f"{path}:"), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


# --- A: RoBERTa-style positions start after the pad token


@pytest.mark.parametrize(("model_type", "pad", "usable", "why"), [
    ("XLMRoberta", 3, 36, "usable positions 36 (max_position_embeddings 40 less 4: its positions start after "
                          "pad_token_id 3)"),
    ("MPNet", 0, 38, "usable positions 38 (max_position_embeddings 40 less 2: its positions start after "
                     "pad_token_id 1)"),  # mpnet numbers from 1 + 1 whatever its config's pad_token_id
    ("Bert", 0, 40, None),  # positions from 0: the whole table
])
def test_usable_positions_are_what_the_model_can_embed(tmp_path: Path, bpe_tokenizer: PreTrainedTokenizerFast,
                                                       model_type: str, pad: int, usable: int, why: str | None) -> None:
    """The limit validate uses is the longest input the PyTorch model itself takes: one token more fails there."""
    config = getattr(transformers, f"{model_type}Config")(vocab_size=len(bpe_tokenizer), pad_token_id=pad,
                                                           max_position_embeddings=40, **SIZES)
    model_dir = save_model(tmp_path / "model", f"{model_type}Model", config, bpe_tokenizer)
    model = getattr(transformers, f"{model_type}Model").from_pretrained(model_dir).eval()
    tokens = torch.full((1, usable + 1), 10)  # 10 is no pad id
    with torch.no_grad():
        model(input_ids=tokens[:, :usable])
        if why:
            with pytest.raises(IndexError):
                model(input_ids=tokens)

    _, ok = validate(tmp_path, model_dir, "feature-extraction", profiles=[{"batch": [1, 1, 2], "seq": [4, 16, usable]}])
    assert ok == ""
    path, message = validate(tmp_path, model_dir, "feature-extraction",
                             profiles=[{"batch": [1, 1, 2], "seq": [4, 16, usable + 1]}])
    refused(message, path, "profiles.0.seq", f"seq max {usable + 1} = {usable + 1} tokens is beyond the model's "
                                             f"{why or 'max_position_embeddings 40'} ({model_dir}/config.json)")


# --- B: encoder-decoders, and the tasks named when Optimum cannot export one


@pytest.mark.parametrize("task", ["feature-extraction", "text-generation"])
def test_an_encoder_decoder_is_refused_at_its_path(tmp_path: Path, bpe_tokenizer: PreTrainedTokenizerFast,
                                                   task: str) -> None:
    config = transformers.T5Config(vocab_size=len(bpe_tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                   num_heads=2, decoder_start_token_id=0)
    model_dir = save_model(tmp_path / "t5", "T5Model", config, bpe_tokenizer)
    path, message = validate(tmp_path, model_dir, task, profiles=[ENCODER_PROFILE])
    refused(message, path, "model.path", f"{model_dir}/config.json has is_encoder_decoder: true",
            "expected an encoder-only model (feature-extraction, text-classification) or a decoder-only one")
    assert "text2text-generation" not in message  # Optimum's tasks for it are no help: smelter builds none


def test_a_task_optimum_cannot_export_names_smelters_tasks_it_can(tmp_path: Path,
                                                                  bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    config = transformers.ElectraConfig(vocab_size=len(bpe_tokenizer), embedding_size=32, **SIZES)
    model_dir = save_model(tmp_path / "electra", "ElectraModel", config, bpe_tokenizer)
    path, message = validate(tmp_path, model_dir, "text-generation")
    refused(message, path, "model.task", "cannot export 'electra' models for text-generation; "
                                         "it supports feature-extraction, text-classification (of smelter's tasks)")
    assert "fill-mask" not in message and "question-answering" not in message


# --- C: attention windows


def gemma2(tmp_path: Path, tokenizer: PreTrainedTokenizerFast, window: int) -> Path:
    config = transformers.Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       sliding_window=window, max_position_embeddings=256, pad_token_id=3)
    return save_model(tmp_path / f"gemma2-sw{window}", "Gemma2ForCausalLM", config, tokenizer)


def test_profiles_beyond_the_sliding_window_are_refused(tmp_path: Path,
                                                        bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """The decoder profile's longest is seq 16 + past 24 = 40 tokens."""
    _, ok = validate(tmp_path, gemma2(tmp_path, bpe_tokenizer, 40), "text-generation-with-past")
    assert ok == ""
    model_dir = gemma2(tmp_path, bpe_tokenizer, 8)
    path, message = validate(tmp_path, model_dir, "text-generation-with-past")
    refused(message, path, "profiles.0.past", "seq max 16 + past max 24 = 40 tokens is beyond the model's "
                                              "sliding_window 8", "expected every profile's seq + past at most 8",
            f"{model_dir}/config.json")


def test_a_sliding_window_whose_graph_holds_beyond_it_bounds_nothing(tmp_path: Path,
                                                                     bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """Mistral's, Phi3's and Qwen2's exported graphs match PyTorch beyond their window (Phi-3-mini ships 2047 and
    serves 4096), so a window of 8 under a profile of 40 tokens is no reason to refuse; nor is Qwen2.5's window
    that its config turns off."""
    sizes = {"vocab_size": len(bpe_tokenizer), "num_key_value_heads": 1, "max_position_embeddings": 256, **SIZES}
    for name, config in (("qwen2-off", transformers.Qwen2Config(use_sliding_window=False, sliding_window=8, **sizes)),
                         ("qwen2-on", transformers.Qwen2Config(use_sliding_window=True, sliding_window=8,
                                                               max_window_layers=0, **sizes)),
                         ("mistral", transformers.MistralConfig(sliding_window=8, **sizes))):
        architecture = "Qwen2ForCausalLM" if name.startswith("qwen2") else "MistralForCausalLM"
        model_dir = save_model(tmp_path / name, architecture, config, bpe_tokenizer)
        _, ok = validate(tmp_path, model_dir, "text-generation-with-past")
        assert ok == "", (name, ok)


# --- D: a decoder classifier without a pad token


def neox_classifier(out: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """GPT-NeoX with a sequence-classification head and no pad_token_id in its config.json, as such
    checkpoints ship."""
    config = transformers.GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                        num_labels=3, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return save_model(out, "GPTNeoXForSequenceClassification", config, tokenizer)


def test_a_classifier_with_no_pad_and_no_eos_is_refused(tmp_path: Path,
                                                        bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    model_dir = neox_classifier(tmp_path / "neox", tokenizer_with(bpe_tokenizer, "unk_token", "bos_token"))
    path, message = validate(tmp_path, model_dir, "text-classification")
    refused(message, path, "model.path", f"{model_dir}/config.json has no pad_token_id and its tokenizer names "
                                         "no pad_token or eos_token", "expected a pad_token_id in config.json")


def test_a_classifier_without_a_pad_token_exports_and_pads_with_eos(tmp_path: Path,
                                                                    bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """Optimum would ask for --pad_token_id; smelter gives it eos, and the graph, the PyTorch reference and the
    padded feeds agree on it: the logits match on a batch whose rows are padded to different lengths."""
    model_dir = neox_classifier(tmp_path / "neox", tokenizer_with(bpe_tokenizer, "unk_token", "bos_token",
                                                                  "eos_token"))
    path, ok = validate(tmp_path, model_dir, "text-classification")
    assert ok == ""
    spec = spec_module.load(path, check_env=False).pipelines["tiny"]
    exported = run_export(ExportConfig.of(spec), ArtifactStore(tmp_path / "artifacts"))

    source = ModelSource.of(spec)
    tokenizer, reference = load_tokenizer(source), load_reference(source)
    assert tokenizer.pad_token_id == reference.config.pad_token_id == bpe_tokenizer.eos_token_id
    session = ort.InferenceSession(str(exported.file("model.onnx")), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = inputs.encoder_feeds(tokenizer, ["a short one", "a rather longer sentence than the first one is"], 2, 16,
                                 names)
    assert (feeds["input_ids"][0] == tokenizer.pad_token_id).any()  # the first row is padded
    (logits,) = session.run(["logits"], feeds)
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-3)


# --- E: the checkpoint's head against the task


def test_a_checkpoint_without_the_tasks_head_is_refused(tmp_path: Path,
                                                        bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    config = transformers.ElectraConfig(vocab_size=len(bpe_tokenizer), embedding_size=32, num_labels=2, **SIZES)
    classifier = save_model(tmp_path / "electra-cls", "ElectraForSequenceClassification", config, bpe_tokenizer)
    _, ok = validate(tmp_path, classifier, "text-classification")
    assert ok == ""
    _, ok = validate(tmp_path, classifier, "feature-extraction")  # AutoModel drops a head: any checkpoint will do
    assert ok == ""
    base = save_model(tmp_path / "electra", "ElectraModel", config, bpe_tokenizer)
    path, message = validate(tmp_path, base, "text-classification")
    refused(message, path, "model.task", f"{base}/config.json has architectures ElectraModel, a checkpoint without "
                                         "a sequence-classification head (*ForSequenceClassification); "
                                         "text-classification needs one")


def test_a_decoder_without_an_lm_head_is_refused_unless_tied(tmp_path: Path,
                                                             bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """With tied embeddings the LM head is the input embedding, which a base checkpoint has: it still loads."""
    sizes = {"vocab_size": len(bpe_tokenizer), "num_key_value_heads": 1, "max_position_embeddings": 256, **SIZES}
    untied = save_model(tmp_path / "llama", "LlamaModel", transformers.LlamaConfig(tie_word_embeddings=False, **sizes),
                        bpe_tokenizer)
    path, message = validate(tmp_path, untied, "text-generation")
    refused(message, path, "model.task", "has architectures LlamaModel, a checkpoint without a language-model head")
    tied = save_model(tmp_path / "llama-tied", "LlamaModel",
                      transformers.LlamaConfig(tie_word_embeddings=True, **sizes), bpe_tokenizer)
    _, ok = validate(tmp_path, tied, "text-generation")
    assert ok == ""


# --- F: calibration shapes


def test_calibration_seq_len_outside_the_profiles_is_a_warning(tmp_path: Path,
                                                              bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """Written outside every profile's seq range it is named (int8 would be calibrated on lengths no engine
    serves); within one, or left at its default, nothing is said."""
    config = transformers.BertConfig(vocab_size=len(bpe_tokenizer), max_position_embeddings=128, **SIZES)
    model_dir = save_model(tmp_path / "bert", "BertModel", config, bpe_tokenizer)
    calibration = {"data": "data/calibration.txt", "samples": 16, "batch_size": 8}
    path = write_pipelines(tmp_path, model_dir, "feature-extraction", precisions=["fp32", "int8"],
                           calibration=calibration | {"seq_len": 64})
    warnings = spec_module.load(path, check_env=False).warnings
    assert any(w.startswith(f"{path}:") and "pipelines.tiny.calibration.seq_len: 64 is outside every profile's seq "
               "range ([8, 32])" in w for w in warnings), warnings
    for within in ({"seq_len": 32}, {}):
        path = write_pipelines(tmp_path, model_dir, "feature-extraction", precisions=["fp32", "int8"],
                               calibration=calibration | within)
        assert spec_module.load(path, check_env=False).warnings == []


def test_calibration_with_its_kv_cache_beyond_the_positions_is_refused(tmp_path: Path,
                                                                      bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """A decoder calibrates after a KV cache of the first profile's typical past (8 here): 28 + 8 > 32."""
    config = transformers.LlamaConfig(vocab_size=len(bpe_tokenizer), num_key_value_heads=1, max_position_embeddings=40,
                                      **SIZES)
    model_dir = save_model(tmp_path / "llama", "LlamaForCausalLM", config, bpe_tokenizer)
    calibration = {"data": "data/calibration.txt", "samples": 16, "batch_size": 2}
    path, message = validate(tmp_path, model_dir, "text-generation-with-past", precisions=["fp32", "int8"],
                             calibration=calibration | {"seq_len": 36})
    refused(message, path, "calibration.seq_len", "36 + past 8 tokens is beyond the model's max_position_embeddings 40")
    _, ok = validate(tmp_path, model_dir, "text-generation-with-past", precisions=["fp32", "int8"],
                     calibration=calibration | {"seq_len": 16})
    assert ok == ""


# --- a regression head's blind gates


def test_a_regression_head_is_not_gated_on_what_one_output_cannot_show(tmp_path: Path,
                                                                      bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    config = transformers.BertConfig(vocab_size=len(bpe_tokenizer), num_labels=1, max_position_embeddings=64,
                                     **SIZES)
    model_dir = save_model(tmp_path / "regressor", "BertForSequenceClassification", config, bpe_tokenizer)
    path, message = validate(tmp_path, model_dir, "text-classification",
                             accuracy={"gates": {"label_agreement": {"min": 0.9}, "max_abs_error": {"max": 0.1}}})
    refused(message, path, "accuracy.gates.label_agreement", "one label (a regression head)",
            "expected max_abs_error")
    assert "max_abs_error is" not in message
    _, ok = validate(tmp_path, model_dir, "text-classification", accuracy={"gates": {"max_abs_error": {"max": 0.1}}})
    assert ok == ""


def test_a_falcon_whose_cache_optimum_cannot_export_is_refused_with_past_only(tmp_path: Path,
                                                                            bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    config = transformers.FalconConfig(vocab_size=len(bpe_tokenizer), hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)
    model_dir = save_model(tmp_path / "falcon", "FalconForCausalLM", config, bpe_tokenizer)
    path, message = validate(tmp_path, model_dir, "text-generation-with-past")
    refused(message, path, "model.task", "num_kv_heads 2 < num_attention_heads 4",
            "expected task text-generation (no KV cache)")
    _, ok = validate(tmp_path, model_dir, "text-generation")
    assert ok == ""


# --- image and audio models: not token ids in


@pytest.mark.parametrize(("model_class", "task", "kind", "shows"), [
    ("ViTModel", "feature-extraction", "image", "has image_size and num_channels and no vocab_size, so its input is "
                                                "pixel_values"),
    ("ViTForImageClassification", "text-classification", "image", "so its input is pixel_values"),
    ("Wav2Vec2Model", "feature-extraction", "audio", "has conv_dim, so its input is input_values"),
])
def test_an_image_or_audio_model_is_refused_as_such(tmp_path: Path, bpe_tokenizer: PreTrainedTokenizerFast,
                                                    model_class: str, task: str, kind: str, shows: str) -> None:
    """Refused for what it is, not for a missing tokenizer, nor let through to fail in the export: Optimum exports a
    ViT for feature-extraction, and its folder may well hold a tokenizer (here one, so only the kind can refuse)."""
    if kind == "image":
        config = transformers.ViTConfig(image_size=32, patch_size=16, num_labels=3, **SIZES)
    else:
        config = transformers.Wav2Vec2Config(vocab_size=len(bpe_tokenizer), conv_dim=(8, 8), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=2, **SIZES)
    model_dir = save_model(tmp_path / "model", model_class, config, bpe_tokenizer)
    path, message = validate(tmp_path, model_dir, task)
    refused(message, path, "model.path", f"{kind} model: {model_dir}/config.json", shows,
            "smelter builds engines for text models (token ids in) only")
    assert len(message.splitlines()) == 1, message
    (model_dir / "tokenizer.json").unlink()
    _, message = validate(tmp_path, model_dir, task)
    assert f"{kind} model" in message and "has no tokenizer" not in message
