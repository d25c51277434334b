"""Make a tiny Llama-architecture causal LM with random weights and a locally trained tokenizer.

Tests and offline demos need a decoder that exports, quantizes and runs in seconds, with no hub
download. The weights are random but fixed by a seed, so every run writes the same files (and so
the same export cache key).

Usage: python scripts/make_tiny_llama.py [OUT_DIR]   (default models/tiny-llama)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "data" / "calibration.txt"
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def train_tokenizer(text_file: Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer learned from real text; prepends <s> like Llama's tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(text_file)], trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=512, **SPECIAL_TOKENS)


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """Small enough to export in seconds; grouped-query attention (2 KV heads) like real Llamas."""
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def make_tiny_llama(out_dir: Path, text_file: Path = DEFAULT_TEXT, seed: int = 0) -> Path:
    """Write config, random weights and tokenizer into out_dir (a from_pretrained-loadable directory)."""
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(text_file)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer)).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    target = make_tiny_llama(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "models" / "tiny-llama")
    print(f"made {target}: the tiny random-weight Llama of the example pipeline tiny-llama")
