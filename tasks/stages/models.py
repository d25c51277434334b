"""The source model: its tokenizer, its PyTorch reference, and its identity for cache keys.

A local directory (model.path) wins over the hub id, and is read with local_files_only so an
offline machine never waits on the network.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config.stage_settings import ModelSource
from tasks.runtime.store import tree_digest

if TYPE_CHECKING:
    import torch

# transformers class names, looked up on use: a cached run never imports transformers
_AUTO_CLASSES = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "text-generation": "AutoModelForCausalLM",
    "text-generation-with-past": "AutoModelForCausalLM",
}


def _source(source: ModelSource) -> tuple[str, dict[str, Any]]:
    """What from_pretrained reads, and how: the local dir offline, or the hub id at its revision."""
    model_dir = source.directory
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"pipeline {source.pipeline}: model.path {model_dir} has no config.json")
        return str(model_dir), {"local_files_only": True}
    return source.model.id, {"revision": source.model.revision}


def load_tokenizer(source: ModelSource) -> Any:
    """The model's tokenizer; decoders and classifiers without a pad token pad with eos so batches can be padded
    (a decoder classifier, GPT-NeoX's say, often ships none)."""
    from transformers import AutoTokenizer

    where, kwargs = _source(source)
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    if (source.model.is_decoder or source.model.task == "text-classification") and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def classifier_pad_token_id(source: ModelSource) -> int | None:
    """The pad id a classifier is exported and run with when its config.json has none: the one its batches are
    padded with (load_tokenizer's). A decoder classifier reads each row's last real token by it, so the graph,
    the PyTorch reference and the feeds must agree; None for other tasks, or a tokenizer without pad or eos."""
    if source.model.task != "text-classification":
        return None
    return load_tokenizer(source).pad_token_id


def load_reference(source: ModelSource) -> torch.nn.Module:
    """The fp32 PyTorch model on CPU in eval mode: the ground truth every engine is compared to."""
    import torch
    import transformers

    where, kwargs = _source(source)
    auto_class = getattr(transformers, _AUTO_CLASSES[source.model.task])
    model, loading = auto_class.from_pretrained(where, dtype=torch.float32, output_loading_info=True, **kwargs)
    missing = loading.get("missing_keys") or []
    if missing:  # transformers would fill them with random numbers and only log a warning
        raise ValueError(f"pipeline {source.pipeline}: the weights in {where} do not fit its config.json and task "
                         f"{source.model.task}: {len(missing)} tensors are missing ({', '.join(sorted(missing)[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}), so they would be random; use the checkpoint "
                         "the config belongs to")
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = classifier_pad_token_id(source)  # as the export was made with it
    return model.to("cpu").eval()


def model_source_digest(source: ModelSource) -> str:
    """The model's identity: a hash of the local files, or the hub commit the revision points at now.

    Resolving a branch like `main` to its commit is what makes a model pushed overnight rebuild. When the
    hub does not answer, the commit the local hub cache resolves the revision to (what an offline load
    reads), so a night without the hub sees the same model as the night before, not "other model files";
    with nothing cached either, the revision name is all there is.
    """
    if source.directory is not None:
        return tree_digest(source.directory)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        commit = HfApi().model_info(source.model.id, revision=source.model.revision).sha
    except (OSError, HfHubHTTPError):
        commit = cached_commit(source.model.id, source.model.revision)
    return f"hub:{source.model.id}@{commit or source.model.revision}"


COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub commit hash


def cached_commit(model_id: str, revision: str) -> str | None:
    """The commit the local hub cache holds for `revision` (a commit is its own), or None."""
    from huggingface_hub import constants

    if COMMIT.fullmatch(revision):
        return revision
    ref = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if COMMIT.fullmatch(commit) else None
