"""How close a built engine is to the PyTorch FP32 reference, on held-out real text.

Encoders are judged on what users consume: mean-pooled sentence embeddings (cosine). Decoders on
what generation consumes: the next-token choice (top-1 agreement), the logits, and perplexity.
The engine is also run at every profile's min/opt/max shape point, because engines can be right
at the usual shape and wrong (NaN, wrong shape) only at the edges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tasks.backends.base import Runner, get_backend
from tasks.config.spec import ProfileSpec
from tasks.config.stage_settings import AccuracyConfig
from tasks.runtime import killpoints
from tasks.runtime.stage_runner import Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, file_digest, tool_versions
from tasks.stages.build import open_engine
from tasks.stages.inputs import decoder_feeds, encoder_feeds, point_feeds, read_texts, reference_outputs
from tasks.stages.models import load_reference, load_tokenizer

if TYPE_CHECKING:
    import torch

PER_SAMPLE = "per_sample.csv"
CHUNK = 8
THREE_WAY = "three_way.json"
TOOLS = ("torch", "transformers", "numpy")
CODE = ("tasks.stages.accuracy", "tasks.stages.inputs")  # what the stage computes: their source is part of the key


def eval_data(data_path: Path, samples: int) -> str:
    """Which text the metrics were measured on: the data file's sha256 and how many of its lines were read.
    Accuracy figures compare only when it is the same (the regression gate, tasks/registry/versions.py)."""
    return f"{file_digest(data_path)}:{samples}"


def measured_on(accuracy: StageResult | None) -> str | None:
    """The eval text an accuracy result was measured on (`eval_data`), as its stage recorded it; None for a result
    from before that was recorded."""
    return (accuracy.manifest.get("inputs") or {}).get("eval_data") if accuracy else None


def _settings(config: AccuracyConfig) -> dict[str, Any]:
    return {"task": config.source.model.task, "samples": config.samples, "seq_len": config.seq_len,
            "profiles": [p.model_dump(mode="json") for p in config.profiles]}


def accuracy_work(config: AccuracyConfig, build_result: StageResult, store: ArtifactStore | None) -> Work:
    """Metrics, a per-sample table and the validity verdict for one engine (`store` finds a TensorRT
    engine's ONNX graphs for the three-way comparison)."""
    settings, tools = _settings(config), tool_versions(*TOOLS)
    model = config.source.model

    def produce(w: StageWriter, _published: StageResult | None) -> None:
        profile = _eval_profile(config)
        batch = max(profile.batch[0], min(CHUNK, profile.batch[2]))
        past = profile.past[0] if model.has_past else 0
        texts = read_texts(config.data_path, config.samples)
        tokenizer, reference = load_tokenizer(config.source), load_reference(config.source)
        with open_engine(config.targets, build_result) as engine:
            if model.is_decoder:
                table, metrics = _decoder_accuracy(config, engine, tokenizer, reference, texts, batch, past)
            else:
                table, metrics = _encoder_accuracy(config, engine, tokenizer, reference, texts, batch)
            table.to_csv(w.dir / PER_SAMPLE, index=False)
            killpoints.reach("accuracy")
            validity = check_validity(config, engine, tokenizer, reference, texts) | {
                "nonfinite_samples": nonfinite_samples(table)}
            w.outputs.update({"metrics": metrics, "samples": len(texts), "seq_len": config.seq_len,
                              "past": past, "validity": validity})
            if (report := three_way(config, build_result, store, engine, tokenizer, reference, texts)) is not None:
                (w.dir / THREE_WAY).write_text(json.dumps(report, indent=2))
                w.outputs["three_way_passed"] = report["passed"]

    parts = {"upstream": {"build": build_result.key, "files": build_result.content}, "config": settings,
             "data": file_digest(config.data_path), "tools": tools}
    inputs = {"build": build_result.key, "eval_data": eval_data(config.data_path, config.samples)}
    return Work(config.source.pipeline, "accuracy", parts, CODE, produce, inputs=inputs, config=settings, tools=tools)


def run_accuracy(config: AccuracyConfig, build_result: StageResult, store: ArtifactStore,
                 force: bool = False) -> StageResult:
    """Metrics, a per-sample table and the validity verdict for one engine."""
    return run_stage(accuracy_work(config, build_result, store), store, force)


def _eval_profile(config: AccuracyConfig) -> ProfileSpec:
    """The first profile that accepts accuracy.seq_len (spec.py guarantees one does): it bounds the eval feeds."""
    seq = config.seq_len
    return next(p for p in config.profiles if p.seq[0] <= seq <= p.seq[2])


def _chunks(texts: list[str], batch: int) -> list[tuple[int, list[str]]]:
    """Consecutive groups of `batch` texts; the last one is topped up by cycling so shapes stay fixed."""
    return [(start, [texts[(start + i) % len(texts)] for i in range(batch)]) for start in range(0, len(texts), batch)]


def nonfinite_samples(table: pd.DataFrame) -> dict[str, list[int]]:
    """Per measured column, the samples whose value is NaN or Inf (an engine output with NaN, or the 0/0
    cosine of an all-zero one): the accuracy gate fails on any of them and names them."""
    found = {}
    for column in table.select_dtypes("number").columns.drop("sample", errors="ignore"):
        bad = ~np.isfinite(table[column].to_numpy(dtype=np.float64))
        if bad.any():
            found[column] = [int(s) for s in table["sample"].to_numpy()[bad]]
    return found


def _aggregate(values: pd.Series, how: str) -> float:
    """mean / min / max that keep a NaN (pandas skips it, and a gate would never see it)."""
    array = values.to_numpy(dtype=np.float64)
    return float({"mean": np.mean, "min": np.min, "max": np.max}[how](array))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity (float64, so near-1.0 values are not rounded to 1)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings as sentence encoders return them: token states averaged over the attention mask."""
    weights = mask[..., None].astype(np.float64)
    return (hidden * weights).sum(1) / np.maximum(weights.sum(1), 1.0)


def _encoder_accuracy(config: AccuracyConfig, runner: Runner, tokenizer: Any, reference: torch.nn.Module,
                      texts: list[str], batch: int) -> tuple[pd.DataFrame, dict[str, float]]:
    task, seq = config.source.model.task, config.seq_len
    output = "logits" if task == "text-classification" else "last_hidden_state"
    rows = []
    for start, chunk in _chunks(texts, batch):
        feeds = encoder_feeds(tokenizer, chunk, batch, seq, runner.input_names)
        mask = feeds.get("attention_mask", np.ones((batch, seq), dtype=np.int64))
        engine = runner.infer(feeds)[output]
        expected = reference_outputs(reference, feeds, task)[output]
        for i in range(min(batch, len(texts) - start)):
            row = {"sample": start + i, "text": chunk[i], "tokens": int(mask[i].sum())}
            if task == "text-classification":
                row |= {"label": int(engine[i].argmax()), "reference_label": int(expected[i].argmax()),
                        "cosine": float(cosine(engine[i], expected[i])),
                        "max_abs_error": float(np.abs(engine[i] - expected[i]).max())}
            else:
                valid = mask[i].astype(bool)
                pooled = mean_pool(engine[i:i + 1], mask[i:i + 1])
                pooled_ref = mean_pool(expected[i:i + 1], mask[i:i + 1])
                row |= {"cosine": float(cosine(pooled, pooled_ref)[0]),
                        "max_abs_error": float(np.abs(engine[i][valid] - expected[i][valid]).max())}
            rows.append(row)
    table = pd.DataFrame(rows)
    metrics = {"cosine_mean": _aggregate(table["cosine"], "mean"), "cosine_min": _aggregate(table["cosine"], "min"),
               "max_abs_error": _aggregate(table["max_abs_error"], "max")}
    if task == "text-classification":
        metrics["label_agreement"] = float((table["label"] == table["reference_label"]).mean())
    return table, metrics


def _next_token_nll(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each next token ([batch, seq-1]), computed in float64."""
    shifted = logits[:, :-1].astype(np.float64)
    peak = shifted.max(-1, keepdims=True)
    log_z = peak[..., 0] + np.log(np.exp(shifted - peak).sum(-1))
    chosen = np.take_along_axis(shifted, tokens[:, 1:, None], axis=-1)[..., 0]
    return log_z - chosen


def _decoder_accuracy(config: AccuracyConfig, runner: Runner, tokenizer: Any, reference: torch.nn.Module,
                      texts: list[str], batch: int, past: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """Whole-sequence forward after the profile's smallest real past: every position predicts the next token."""
    task, seq = config.source.model.task, config.seq_len
    rows, nll_engine, nll_reference = [], [], []
    for start, chunk in _chunks(texts, batch):
        feeds = decoder_feeds(tokenizer, reference, chunk, batch, seq, past, runner.input_names)
        engine = runner.infer(feeds)["logits"]
        expected = reference_outputs(reference, feeds, task)["logits"]
        tokens = feeds["input_ids"]
        nll, nll_ref = _next_token_nll(engine, tokens), _next_token_nll(expected, tokens)
        for i in range(min(batch, len(texts) - start)):
            error = np.abs(engine[i] - expected[i])
            rows.append({"sample": start + i, "text": chunk[i],
                         "top1_agreement": float((engine[i].argmax(-1) == expected[i].argmax(-1)).mean()),
                         "logit_max_abs_error": float(error.max()), "logit_mean_abs_error": float(error.mean()),
                         "perplexity": float(np.exp(nll[i].mean())),
                         "reference_perplexity": float(np.exp(nll_ref[i].mean()))})
            nll_engine.append(nll[i])
            nll_reference.append(nll_ref[i])
    table = pd.DataFrame(rows)
    metrics = {"top1_agreement": _aggregate(table["top1_agreement"], "mean"),
               "logit_max_abs_error": _aggregate(table["logit_max_abs_error"], "max"),
               "logit_mean_abs_error": _aggregate(table["logit_mean_abs_error"], "mean"),
               "perplexity": float(np.exp(np.concatenate(nll_engine).mean())),
               "reference_perplexity": float(np.exp(np.concatenate(nll_reference).mean()))}
    metrics["perplexity_delta"] = metrics["perplexity"] - metrics["reference_perplexity"]
    return table, metrics


def three_way(config: AccuracyConfig, build_result: StageResult, store: ArtifactStore | None, engine: Runner,
              tokenizer: Any, reference: torch.nn.Module, texts: list[str]) -> dict[str, Any] | None:
    """For a backend that compares three ways (Backend.compares_three_way): FP32 ONNX vs the precision graph the
    engine was built from vs the engine, at min/opt/max (where an error comes from).

    Recorded, not gated: the accuracy gates already judge the engine against PyTorch.
    """
    if not get_backend(build_result.outputs["backend"]).compares_three_way:
        return None
    from tasks.stages.three_way import compare_three_way

    pipeline = config.source.pipeline
    precision = store and store.lookup(pipeline, "precision", build_result.manifest["inputs"]["precision"])
    exported = precision and store.lookup(pipeline, "export", precision.manifest["inputs"]["export"])
    if not exported:
        raise FileNotFoundError(f"the ONNX graphs engine {build_result.key} was built from are gone from the store")
    feeds = {point: point_feeds(config.source.model, tokenizer, reference, texts, shape, engine.input_names,
                                real_tokens_only=True) for point, shape in config.profiles[0].shapes().items()}
    built_from = precision.file(build_result.outputs["source_model"])
    return compare_three_way(exported.file("model.onnx"), built_from, engine, feeds, config.validation.atol,
                             config.validation.rtol)


def check_validity(config: AccuracyConfig, runner: Runner, tokenizer: Any, reference: torch.nn.Module,
                   texts: list[str]) -> dict[str, Any]:
    """Run the engine at each profile's min/opt/max point: outputs finite and shaped like the reference's."""
    problems: list[str] = []
    points = {"min": True, "opt": True, "max": True}
    finite = True
    model = config.source.model
    for index, profile in enumerate(config.profiles):
        for point, shape in profile.shapes().items():
            where = f"profile {index} {point} {shape}"
            feeds = point_feeds(model, tokenizer, reference, texts, shape, runner.input_names,
                                real_tokens_only=True)  # every position of the point holds a real token
            try:
                outputs = runner.infer(feeds)
            except Exception as e:  # an engine that cannot run at a profile point is invalid, not a crash
                problems.append(f"{where}: the engine failed: {e}")
                points[point] = False
                continue
            expected = reference_outputs(reference, feeds, model.task)
            for name, value in outputs.items():
                bad = int(np.size(value) - np.isfinite(value).sum())
                if bad:
                    problems.append(f"{where}: output {name} has {bad} NaN/Inf values of {np.size(value)}")
                    finite = points[point] = False
                if name in expected and value.shape != expected[name].shape:
                    problems.append(f"{where}: output {name} has shape {list(value.shape)}, "
                                    f"expected {list(expected[name].shape)}")
                    points[point] = False
    return {"finite": finite, "points": points, "problems": problems}
