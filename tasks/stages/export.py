"""HuggingFace model -> ONNX through Optimum's exporter, once per (model files, task, opset, toolchain).

Optimum knows how to trace each architecture (KV-cache inputs, dynamic axes, attention masks), so
smelter never writes its own torch.onnx.export. For text-generation-with-past the result is one
decoder graph with past_key_values.{i}.key/value inputs: a past of length 0 is the prefill step,
a longer past the decode step, so one engine serves both. Optimum's own check is skipped; the
validate stage compares against PyTorch at every profile shape instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from tasks.config.stage_settings import ExportConfig, ModelSource
from tasks.runtime import killpoints
from tasks.runtime.stage_runner import Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, tool_versions
from tasks.stages.models import classifier_pad_token_id, load_tokenizer, model_source_digest

ONNX_FILE = "model.onnx"
TOOLS = ("torch", "transformers", "optimum", "optimum-onnx", "onnx")
CODE = ("tasks.stages.export",)  # what the stage computes: its source is part of the key


def export_key(config: ExportConfig) -> str:
    return export_work(config).key


def export_work(config: ExportConfig) -> Work:
    """The export of the model's files for one task and opset (hashing the weights happens once, here)."""
    model, digest = config.source, model_source_digest(config.source)
    settings = {"task": model.model.task, "opset": config.opset}
    tools = tool_versions(*TOOLS)

    def produce(w: StageWriter, _published: StageResult | None) -> None:
        _export(model, w.dir, config.opset)
        killpoints.reach("export")
        load_tokenizer(model).save_pretrained(w.dir)
        w.outputs.update(describe_onnx(w.dir / ONNX_FILE) | {"task": model.model.task, "model_source": digest})

    return Work(model.pipeline, "export", {"upstream": digest, "config": settings, "tools": tools}, CODE, produce,
                inputs={"model_source": digest}, config=settings, tools=tools)


def run_export(config: ExportConfig, store: ArtifactStore, force: bool = False) -> StageResult:
    """Export the model to artifacts/<pipeline>/export/<key>/model.onnx with its tokenizer and config."""
    return run_stage(export_work(config), store, force)


def _export(model: ModelSource, out_dir: Path, opset: int) -> None:
    from optimum.exporters.onnx import main_export

    if model.directory is not None:
        source: dict[str, Any] = {"model_name_or_path": str(model.directory), "local_files_only": True}
    else:
        source = {"model_name_or_path": model.model.id, "revision": model.model.revision}
    # Optimum asks a classifier without config.pad_token_id for one (its CLI's --pad_token_id) and guesses the
    # tokenizer's pad only: give it the id the feeds are padded with, pad or else eos (ignored when the config has one)
    main_export(**source, output=out_dir, task=model.model.task, opset=opset, device="cpu",
                do_validation=False, library_name="transformers", pad_token_id=classifier_pad_token_id(model))
    if not (out_dir / ONNX_FILE).is_file():
        produced = sorted(p.name for p in out_dir.glob("*.onnx"))
        raise RuntimeError(f"pipeline {model.pipeline}: Optimum export of task {model.model.task} wrote {produced}, "
                           f"expected a single {ONNX_FILE}")


def _tensor_facts(value: onnx.ValueInfoProto) -> tuple[dict[str, Any], dict[str, str]]:
    tensor = value.type.tensor_type
    dims = [d.dim_param if d.dim_param else d.dim_value for d in tensor.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
    return {"dtype": dtype, "shape": dims}, {str(i): d for i, d in enumerate(dims) if isinstance(d, str)}


def describe_onnx(path: Path) -> dict[str, Any]:
    """Opset, input/output names, dtypes, shapes and dynamic axes, read from the exported graph itself."""
    model = onnx.load(str(path), load_external_data=False)
    facts: dict[str, Any] = {"inputs": {}, "outputs": {}, "dynamic_axes": {}}
    facts["opset"] = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    for kind, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
        for value in values:
            facts[kind][value.name], axes = _tensor_facts(value)
            if axes:
                facts["dynamic_axes"][value.name] = axes
    return facts
