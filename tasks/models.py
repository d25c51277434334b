"""The source model: its tokenizer, its PyTorch reference, and its identity for cache keys.

A local directory (model.path) wins over the hub id, and is read with local_files_only so an
offline machine never waits on the network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tasks.spec import PipelineSpec
from tasks.store import tree_digest

if TYPE_CHECKING:
    import torch

# transformers class names, looked up on use: a cached run never imports transformers
_AUTO_CLASSES = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "text-generation": "AutoModelForCausalLM",
    "text-generation-with-past": "AutoModelForCausalLM",
}


def _source(spec: PipelineSpec) -> tuple[str, dict[str, Any]]:
    """What from_pretrained reads, and how: the local dir offline, or the hub id at its revision."""
    model_dir = spec.model_dir
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"pipeline {spec.name}: model.path {model_dir} has no config.json")
        return str(model_dir), {"local_files_only": True}
    return spec.model.id, {"revision": spec.model.revision}


def load_tokenizer(spec: PipelineSpec) -> Any:
    """The model's tokenizer; decoders without a pad token pad with eos so batches can be padded."""
    from transformers import AutoTokenizer

    source, kwargs = _source(spec)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if spec.model.is_decoder and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reference(spec: PipelineSpec) -> torch.nn.Module:
    """The fp32 PyTorch model on CPU in eval mode: the ground truth every engine is compared to."""
    import torch
    import transformers

    source, kwargs = _source(spec)
    auto_class = getattr(transformers, _AUTO_CLASSES[spec.model.task])
    model, loading = auto_class.from_pretrained(source, dtype=torch.float32, output_loading_info=True, **kwargs)
    missing = loading.get("missing_keys") or []
    if missing:  # transformers would fill them with random numbers and only log a warning
        raise ValueError(f"pipeline {spec.name}: the weights in {source} do not fit its config.json and task "
                         f"{spec.model.task}: {len(missing)} tensors are missing ({', '.join(sorted(missing)[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}), so they would be random; use the checkpoint "
                         "the config belongs to")
    return model.to("cpu").eval()


def model_source_digest(spec: PipelineSpec) -> str:
    """The model's identity: a hash of the local files, or the hub commit the revision points at now.

    Resolving a branch like `main` to its commit is what makes a model pushed overnight rebuild.
    Offline, the revision name is all there is.
    """
    model_dir = spec.model_dir
    if model_dir is not None:
        return tree_digest(model_dir)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        commit = HfApi().model_info(spec.model.id, revision=spec.model.revision).sha
    except (OSError, HfHubHTTPError):
        commit = None
    return f"hub:{spec.model.id}@{commit or spec.model.revision}"
