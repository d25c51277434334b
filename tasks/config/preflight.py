"""Checks of a pipeline against what lies outside its file: data files, the model's config, what
Optimum can export, the environment.

They run before any work, so an empty eval file or a task the model cannot be exported for fails
in a second instead of twenty seconds into an export. What cannot be known offline (a hub model
not in the local cache) is a warning, never an error.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config import exporter_support
from tasks.config.bounded_read import read_bounded
from tasks.config.yaml_source import clip, shown

if TYPE_CHECKING:
    from tasks.config.schema import PipelineSpec

MAX_DATA_BYTES = 256 << 20
MAX_CONFIG_BYTES = 16 << 20
# A sample far longer than any sequence: a file with no line breaks, say. Tokenizing 10 MB of one line
# for each row of a batch took minutes and gigabytes; 100000 characters is ~25000 tokens or more.
MAX_SAMPLE_CHARS = 100_000
# Structured formats a data file is not read as: each of their lines would become a sample, markup and all.
STRUCTURED_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
# Config keys that bound the positions a model can attend to, as transformers' architectures name them.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                 "max_seq_len")

# Model types whose learned positions are numbered from padding_idx + 1 (fairseq's make_positions, as
# transformers' create_position_ids_from_input_ids does): padding_idx + 1 rows of the table are never a position.
# padding_idx is config.pad_token_id (transformers' default 1), except for mpnet, which fixes it at 1.
PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert",
                        "longformer", "luke", "roberta-prelayernorm", "xmod", "esm", "mpnet")
FIXED_PADDING_IDX = {"mpnet": 1}
DEFAULT_PADDING_IDX = 1
# Model types whose exported graph is wrong beyond config.sliding_window (transformers 4.57, Optimum 2.1, tiny
# models with a window of 8 run at past 16 + seq 16): Gemma2's fails at ONNX Runtime (a broadcast in its
# attention), Gemma3's runs and differs from PyTorch by 0.2 in the logits. Mistral's, Phi3's and Qwen2's (window
# on) matched PyTorch to 2e-7 there, so their windows bound nothing: Phi-3-mini ships sliding_window 2047.
SLIDING_WINDOW_TYPES = ("gemma2", "gemma3", "gemma3_text")
# The heads each task's checkpoint must carry (transformers' class name suffixes; see tasks.stages.models' auto classes).
CLASSIFIER_HEADS = ("ForSequenceClassification",)
LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# Vision and audio models, told by their config: (kind, main input, keys only such a config has, whether a vocab_size
# clears it). A text model embeds token ids, so its config (or text_config) has vocab_size; a CTC speech model has
# one too (its output letters), so conv_dim (its waveform encoder) or num_mel_bins tells audio alone.
NON_TEXT_MODELS = (("image", "pixel_values", ("image_size", "num_channels"), True),
                   ("audio", "input_values (or input_features)", ("conv_dim", "num_mel_bins"), False))
SMELTER_TASKS = ("feature-extraction", "text-classification", "text-generation", "text-generation-with-past")

# What transformers loads a local model from: single-file weights, sharded checkpoints, tokenizers.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model")

Located = tuple[tuple[Any, ...], str]


@dataclass
class Checks:
    problems: list[Located] = field(default_factory=list)
    warnings: list[Located] = field(default_factory=list)


def check(spec: PipelineSpec, *, allow_outside_paths: bool, check_env: bool) -> Checks:
    found = Checks(problems=_data_problems(spec, allow_outside_paths),
                   warnings=_idle_precision_settings(spec) + _calibration_shape_warnings(spec) + _same_text(spec))
    _check_model(spec, found)
    if check_env:
        found.problems += [(("promotion", "webhooks", i, "secret_env"), f"environment variable {hook.secret_env} "
                                                                        "is not set")
                           for i, hook in enumerate(spec.promotion.webhooks) if not os.environ.get(hook.secret_env)]
    return found


def _same_text(spec: PipelineSpec) -> list[Located]:
    """Accuracy measured on the text int8 or fp8 was calibrated on is not held out: it flatters the engine."""
    try:
        same = spec.calibrates() and spec.resolve(spec.accuracy.data).resolve() == \
            spec.resolve(spec.calibration.data).resolve()
    except (OSError, RuntimeError):  # a missing package or a symlink loop: the data checks say so
        return []
    if not same:
        return []
    return [(("accuracy", "data"), f"{shown(spec.accuracy.data)} is calibration.data too: the accuracy gates would "
                                   "judge int8 or fp8 on the text they were calibrated on, not on held-out text")]


def _idle_precision_settings(spec: PipelineSpec) -> list[Located]:
    """A target's settings for a precision it builds no engine of change nothing: probably a missing precision."""
    built = {(c.target, c.precision) for c in spec.candidates()}
    idle = []
    for i, target in enumerate(spec.targets):
        for precision, keys in target.precision_settings.items():
            if (target.name, precision) in built:
                continue
            idle += [(("targets", i, key), f"target {target.name} builds no {precision} engine (precisions: "
                                          f"{', '.join(spec.precisions)}), so {key} changes nothing")
                     for key in keys if key in target.model_fields_set]
    return idle


def _data_problems(spec: PipelineSpec, allow_outside_paths: bool) -> list[Located]:
    sections = [("accuracy", spec.accuracy.data, spec.accuracy.samples)]
    if spec.calibrates():
        sections.append(("calibration", spec.calibration.data, spec.calibration.samples))
    problems = []
    for section, written, samples in sections:
        why = _data_problem(spec, section, written, samples, allow_outside_paths)
        if why:
            problems.append(((section, "data"), why))
    return problems


def _data_problem(spec: PipelineSpec, section: str, written: str, samples: int,
                  allow_outside_paths: bool) -> str | None:
    try:
        path = spec.resolve(written)
        root = spec.package_dir(written) if written.startswith("package://") else spec.base_dir
        real, real_root = path.resolve(), root.resolve()
    except FileNotFoundError as e:
        return str(e)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        return f"cannot resolve {shown(written)}: {clip(str(e))}"
    if not allow_outside_paths and not real.is_relative_to(real_root):
        return (f"{shown(written)} resolves to {clip(str(real))}, outside {clip(str(real_root))}; "
                "keep data files beside the pipelines file, or pass --allow-outside-paths")
    return text_file_problem(path, samples, f"{section}.samples")


def text_file_problem(path: Path, samples: int, wanted_by: str) -> str | None:
    """Why `path` is not a readable UTF-8 text file with at least `samples` non-empty lines, or None.

    Decoded as tasks.stages.inputs.read_texts reads it: a byte-order mark at the start is not part of the first sample."""
    where = clip(str(path))
    if path.suffix.lower() in STRUCTURED_DATA_SUFFIXES:
        return (f"{where} is a {path.suffix.lower()} file, which would be read as raw lines (its markup inside the "
                "samples); expected a UTF-8 text file with one sample per line")
    try:
        data = read_bounded(path, MAX_DATA_BYTES)
    except OSError as e:
        return f"expected a text file, cannot read {where}: {e.strerror}"
    if len(data) > MAX_DATA_BYTES:
        return f"{where} is larger than {MAX_DATA_BYTES >> 20} MiB; expected text, one sample per line"
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}"
    rows = text.splitlines()
    longest = max(range(len(rows)), key=lambda i: len(rows[i]), default=None)
    if longest is not None and len(rows[longest]) > MAX_SAMPLE_CHARS:
        return (f"{where} line {longest + 1} has {len(rows[longest])} characters; expected one sample per line, "
                f"each at most {MAX_SAMPLE_CHARS} (every sample is tokenized whole before it is cut to length)")
    lines = sum(1 for line in rows if line.strip())
    if lines == 0:
        return f"{where} has no text (empty, or blank lines only); expected one sample per line"
    if lines < samples:
        return f"{where} has only {lines} non-empty line{'s' if lines > 1 else ''}; {wanted_by} asks for {samples}"
    return None


def _check_model(spec: PipelineSpec, found: Checks) -> None:
    if spec.model.path:
        config, problem = _local_config(spec)
        if problem:
            found.problems.append((("model", "path"), problem))
            return
        source = f"{clip(str(spec.model_dir))}/config.json"
        found.problems += _pad_token_problems(spec, config, spec.model_dir, source)
    else:
        config, note = _cached_hub_config(spec.model.id or "", spec.model.revision)
        if note:
            found.warnings.append((("model", "id"), note))
            return
        source = f"the cached config.json of {spec.model.id}"
    found.problems += config_problems(spec, config, source)


def _pad_token_problems(spec: PipelineSpec, config: dict[str, Any], model_dir: Path | None,
                        source: str) -> list[Located]:
    """A classifier's batches are padded, and a decoder classifier finds each row's last real token by the pad
    id: Optimum refuses to export one without it. smelter uses config.json's pad_token_id, else the tokenizer's
    pad token, else its eos (tasks.stages.models.load_tokenizer); with none of them there is nothing to pad with.

    Refused only when the saved tokenizer lists its special tokens (as save_pretrained writes them) and neither
    is among them: without such files, the tokenizer class's defaults apply, which cannot be read here.
    """
    if spec.model.task != "text-classification" or model_dir is None or config.get("pad_token_id") is not None:
        return []
    named = _tokenizer_special_tokens(model_dir)
    if not named or named & {"pad_token", "eos_token"}:
        return []
    return [(_model_key(spec), f"{source} has no pad_token_id and its tokenizer names no pad_token or eos_token; "
                               "text-classification pads its batches and a decoder classifier reads each row's "
                               "last token by that id: expected a pad_token_id in config.json (or a pad_token in "
                               "tokenizer_config.json)")]


def _tokenizer_special_tokens(model_dir: Path) -> set[str]:
    """The special-token roles a saved tokenizer names (pad_token, eos_token, ...); empty without such files."""
    named: set[str] = set()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data, problem = _json_file(model_dir / name) if (model_dir / name).is_file() else ({}, None)
        named |= {key for key, value in data.items() if key.endswith("_token") and not problem and
                  (isinstance(value, str) and value or isinstance(value, dict) and value.get("content"))}
    return named


def _local_config(spec: PipelineSpec) -> tuple[dict[str, Any], str | None]:
    try:
        model_dir = spec.model_dir
    except FileNotFoundError as e:
        return {}, str(e)
    assert model_dir is not None
    if not model_dir.is_dir():
        return {}, f"expected a model directory with config.json, {clip(str(model_dir))} is not a directory"
    config, problem = read_config(model_dir / "config.json")
    if problem and (model_dir / "modules.json").is_file():
        problem += ("; this looks like a sentence-transformers folder: point model.path at its transformer "
                    "module (the folder holding config.json and the weights)")
    if not problem:  # before its files: an image model's folder has no tokenizer, which is not the point
        problem = non_text_problem(config, f"{clip(str(model_dir))}/config.json")
    return config, problem or model_files_problem(model_dir)


def non_text_problem(config: dict[str, Any], source: str) -> str | None:
    """Why the model is not a text model (a vision or audio one: pixel_values or input_values in), or None.

    Told by its config, not by loading its class (that imports torch: seconds for every `smelter validate`).
    """
    has_vocab = any("vocab_size" in scope for scope in _scopes(config))
    for kind, main_input, keys, needs_no_vocab in NON_TEXT_MODELS:
        shows = [key for key in keys if key in config]
        if shows and not (needs_no_vocab and has_vocab):
            return (f"{kind} model: {source} ({shown(config.get('model_type'))}) has {' and '.join(shows)}"
                    f"{' and no vocab_size' if needs_no_vocab else ''}, so its input is {main_input}: smelter builds "
                    "engines for text models (token ids in) only")
    return None


def model_files_problem(model_dir: Path) -> str | None:
    """Why the weights or the tokenizer of a local model cannot be loaded, or None.

    Read from the file headers only (no weights are loaded), so a zero-byte, truncated or missing file
    is named in a second instead of as a loader error deep inside the export.
    """
    where = clip(str(model_dir))
    for name in (*WEIGHT_FILES, *WEIGHT_INDEXES, *TOKENIZER_FILES, "tokenizer_config.json"):
        path = model_dir / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            return f"{clip(str(path))} is not a regular file (a directory, a device, a FIFO or a dangling link)"
    weights = [model_dir / name for name in WEIGHT_FILES if (model_dir / name).is_file()]
    for index in WEIGHT_INDEXES:
        if (model_dir / index).is_file():
            shards, problem = _index_shards(model_dir / index)
            if problem:
                return problem
            weights += shards
    if not weights:
        return (f"{where} has no weights; expected {' or '.join(WEIGHT_FILES)} (or a sharded "
                f"{' / '.join(WEIGHT_INDEXES)} with its shards)")
    for path in weights:
        problem = weights_problem(path)
        if problem:
            return problem
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return (f"{where} has no tokenizer; expected one of {', '.join(TOKENIZER_FILES)} beside config.json "
                "(the calibration and evaluation text are tokenized with the model's own tokenizer)")
    return None


def _index_shards(index: Path) -> tuple[list[Path], str | None]:
    """The shard files a sharded checkpoint's index names, or why they cannot all be found."""
    config, problem = _json_file(index)
    weight_map = config.get("weight_map") if not problem else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [], problem or f"{clip(str(index))} has no weight_map of tensor name: shard file"
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file() or shard.parent != index.parent:
            return [], f"{clip(str(index))} names shard {shown(shard.name)}, which is not a file beside it"
    return shards, None


def weights_problem(path: Path) -> str | None:
    """Why a weights file is damaged (empty, truncated, not the format its name says), or None."""
    where = clip(str(path))
    size = path.stat().st_size
    if size == 0:
        return f"{where} is empty (0 bytes); copy the model's weights again"
    if path.suffix == ".safetensors":
        return _safetensors_problem(path, size)
    if path.suffix == ".bin" and not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            legacy = f.read(1) == b"\x80"  # a pickle from torch before 1.6, not a zip archive
        if not legacy:
            return f"{where} is not a PyTorch checkpoint (truncated or damaged: no zip directory at its end)"
    return None


def _safetensors_problem(path: Path, size: int) -> str | None:
    where = clip(str(path))
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else None
        if header_size is None or header_size > min(size - 8, MAX_CONFIG_BYTES):
            return f"{where} is not a safetensors file (truncated at {size} bytes, or another format)"
        raw = f.read(header_size)
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{where} has a damaged safetensors header"
    expected = 8 + header_size + end
    if expected != size:
        return (f"{where} is {'truncated' if size < expected else 'damaged'}: its header describes {expected} "
                f"bytes, the file has {size}; copy the model's weights again")
    return None


def _json_file(path: Path) -> tuple[dict[str, Any], str | None]:
    where = clip(str(path))
    try:
        data = json.loads(read_bounded(path, MAX_CONFIG_BYTES)[:MAX_CONFIG_BYTES].decode("utf-8"))
    except OSError as e:
        return {}, f"cannot read {where}: {e.strerror}"
    except ValueError:
        return {}, f"{where} is not valid JSON"
    return (data, None) if isinstance(data, dict) else ({}, f"{where} is not a JSON object")


def read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """A model's config.json as a mapping, or why it cannot be read."""
    where = clip(str(path))
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES)
    except OSError as e:
        return {}, f"expected a model directory with config.json, cannot read {where}: {e.strerror}"
    if len(data) > MAX_CONFIG_BYTES:
        return {}, f"{where} is larger than {MAX_CONFIG_BYTES >> 20} MiB; not a model config"
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return {}, f"{where} is not UTF-8 text"
    except ValueError as e:
        return {}, f"{where} is not valid JSON: {clip(str(e), 100)}"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return {}, f"{where} has no model_type; expected a transformers model config"
    return config, None


def _cached_hub_config(repo_id: str, revision: str) -> tuple[dict[str, Any], str | None]:
    """The hub model's config.json from the local cache only: checking a file never waits on the network."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:
        cached = None
    if not isinstance(cached, str):
        return {}, (f"config.json of {shown(repo_id)} is not in the local Hugging Face cache; its task and "
                    "positions are checked when it is exported")
    config, problem = read_config(Path(cached))
    return config, problem


def config_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """The model's kind and head against the task, the task against what Optimum exports for this model type,
    each target's own rules for the precisions it builds, every shape against the model's positions and
    attention window."""
    if not_text := non_text_problem(config, source):
        return [(_model_key(spec), not_text)]
    if config.get("is_encoder_decoder") is True:
        return [_encoder_decoder_problem(spec, config, source)]
    problems = _task_problems(spec, config, source)
    problems += _head_problems(spec, config, source)
    problems += _single_output_gate_problems(spec, config, source)
    problems += _falcon_cache_problems(spec, config, source)
    problems += _model_precision_problems(spec, config, source)
    problems += _length_problems(spec, config, source)
    return problems


def _model_key(spec: PipelineSpec) -> tuple[str, str]:
    """Where the model's own files are named: a fault of the checkpoint is reported there."""
    return ("model", "path") if spec.model.path else ("model", "id")


def _encoder_decoder_problem(spec: PipelineSpec, config: dict[str, Any], source: str) -> Located:
    """Every stage feeds one stack (input_ids, attention_mask, maybe a KV cache); an encoder-decoder also
    needs decoder_input_ids, which no stage makes, so it would fail inside the first stage that runs it."""
    return (_model_key(spec), f"{source} has is_encoder_decoder: true ({shown(config['model_type'])} is an "
                              "encoder-decoder); expected an encoder-only model (feature-extraction, "
                              "text-classification) or a decoder-only one (text-generation, "
                              "text-generation-with-past)")


def _task_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """The task against Optimum's exporter, naming only the tasks smelter could build instead."""
    model_type = config["model_type"]
    try:
        tasks = exporter_support.supported_tasks(model_type)
    except ImportError as e:
        return [(("model", "task"), f"cannot check the task: Optimum's ONNX exporter does not import ({clip(str(e))})")]
    if tasks is None:
        return [(("model", "task"), f"Optimum's ONNX exporter cannot export model type {shown(model_type)} "
                                    f"({source})")]
    if spec.model.task in tasks:
        return []
    ours = [task for task in SMELTER_TASKS if task in tasks]
    offered = (f"it supports {', '.join(ours)} (of smelter's tasks)" if ours else
               f"it supports none of smelter's tasks ({', '.join(SMELTER_TASKS)})")
    return [(("model", "task"), f"Optimum's ONNX exporter cannot export {shown(model_type)} models for "
                                f"{spec.model.task}; {offered}")]


def _head_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """A checkpoint without the task's head loads with that head random: refused now, by its `architectures`.

    Only a clear mismatch is refused: no `architectures`, or one with the head, passes. A decoder checkpoint
    without an LM head still works when its output embeddings are tied to the input ones, so only an explicit
    tie_word_embeddings: false refuses it.
    """
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return []
    if spec.model.task == "text-classification":
        needed, head = CLASSIFIER_HEADS, "a sequence-classification head (*ForSequenceClassification)"
    elif spec.model.is_decoder and config.get("tie_word_embeddings") is False:
        needed, head = LM_HEADS, "a language-model head (*ForCausalLM or *LMHeadModel)"
    else:
        return []
    if any(name.endswith(needed) for name in names):
        return []
    return [(("model", "task"), f"{source} has architectures {clip(', '.join(names))}, a checkpoint without "
                                f"{head}; {spec.model.task} needs one (its weights would be random): use the "
                                "checkpoint fine-tuned for the task, or a task this checkpoint has a head for")]


# Gates that say nothing of a classifier with one output (a regression head): argmax of one value always
# agrees, and the cosine of two single values only compares their signs.
SINGLE_OUTPUT_BLIND_GATES = ("label_agreement", "cosine_mean", "cosine_min")


def _single_output_gate_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """A regression head (one label) gated on what cannot tell its engines apart passes any engine."""
    labels = config.get("id2label")
    if spec.model.task != "text-classification" or not isinstance(labels, dict) or len(labels) != 1:
        return []
    return [(("accuracy", "gates", gate), f"{source} has one label (a regression head): {gate} is the same for "
                                          "any engine with one output; expected max_abs_error, which compares "
                                          "the values")
            for gate in spec.accuracy.gates if gate in SINGLE_OUTPUT_BLIND_GATES]


def _falcon_cache_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """Falcon's new decoder architecture with fewer KV heads than heads: transformers caches a key per head while
    Optimum's export builds a cache of num_kv_heads, so the export with a KV cache fails (transformers 4.57,
    Optimum 2.1)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_kv_heads")
    if (config.get("model_type") != "falcon" or not spec.model.has_past or not config.get("new_decoder_architecture")
            or not (_positive_int(heads) and _positive_int(kv_heads)) or kv_heads >= heads):
        return []
    return [(("model", "task"), f"{source} is a Falcon with new_decoder_architecture and num_kv_heads {kv_heads} < "
                                f"num_attention_heads {heads}: Optimum's ONNX export with a KV cache fails for it; "
                                "expected task text-generation (no KV cache)")]


def _length_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """Every profile's longest sequence (with its KV cache) within the model's usable positions and its
    attention window, and calibration's sequence within the positions."""
    problems: list[Located] = []
    _, limit, why = usable_positions(config)
    if limit is not None:
        problems += [(where, f"{longest} tokens is beyond the model's {why} ({source})")
                     for where, longest, tokens in _profile_lengths(spec) if tokens > limit]
        past = _calibration_past(spec)
        if spec.calibrates() and spec.calibration.seq_len + past > limit:
            tokens = f"{spec.calibration.seq_len} + past {past}" if past else f"{spec.calibration.seq_len}"
            problems.append((("calibration", "seq_len"), f"{tokens} tokens is beyond the model's {why} ({source})"))
    window, window_key = sliding_window(config)
    if window is not None:
        problems += [(where, f"{longest} tokens is beyond the model's {window_key} {window}; expected every "
                             f"profile's seq + past at most {window} (the exported graph's sliding-window mask "
                             f"fails at ONNX Runtime beyond it) ({source})")
                     for where, longest, tokens in _profile_lengths(spec) if tokens > window]
    return problems


def _profile_lengths(spec: PipelineSpec) -> list[tuple[tuple[Any, ...], str, int]]:
    """(where, how it adds up, tokens) of each profile's longest sequence, KV cache included."""
    lengths = []
    for i, profile in enumerate(spec.profiles):
        past = profile.past[2] if profile.past else 0
        longest = f"seq max {profile.seq[2]} + past max {past}" if profile.past else f"seq max {profile.seq[2]}"
        lengths.append((("profiles", i, "past" if profile.past else "seq"), f"{longest} = {profile.seq[2] + past}",
                        profile.seq[2] + past))
    return lengths


def _calibration_past(spec: PipelineSpec) -> int:
    """The KV cache calibration feeds come after (tasks.stages.calibration_feeds: the first profile's typical past)."""
    first = spec.profiles[0]
    return first.past[1] if spec.model.has_past and first.past else 0


def _calibration_shape_warnings(spec: PipelineSpec) -> list[Located]:
    """A calibration.seq_len written outside every profile's seq range calibrates int8 ranges on sequences no
    engine serves. A warning, not an error as accuracy.seq_len's is: calibration runs the fp32 graph (or the
    PyTorch model), never an engine, so it works, and its default (128) is left alone. Its batch size is not
    checked: it only sets how many samples go through at once."""
    if not spec.calibrates() or "seq_len" not in spec.calibration.model_fields_set:
        return []
    seq_len = spec.calibration.seq_len
    if any(p.seq[0] <= seq_len <= p.seq[2] for p in spec.profiles):
        return []
    ranges = ", ".join(f"[{p.seq[0]}, {p.seq[2]}]" for p in spec.profiles)
    return [(("calibration", "seq_len"), f"{seq_len} is outside every profile's seq range ({ranges}): int8 is "
                                         "calibrated on sequences the engines never serve; expected a length within "
                                         "a profile")]


def _model_precision_problems(spec: PipelineSpec, config: dict[str, Any], source: str) -> list[Located]:
    """What each target's backend says of building its precisions for this model (TargetSpec.model_problems):
    a problem of the precision itself once, at the precision, however many targets build it."""
    problems: list[Located] = []
    for candidate in spec.candidates():
        index, target = next((i, t) for i, t in enumerate(spec.targets) if t.name == candidate.target)
        for where, why in target.model_problems(candidate.precision, config, spec.model.is_decoder):
            key = ("targets", index, *where) if where else ("precisions", spec.precisions.index(candidate.precision))
            if (key, f"{why} ({source})") not in problems:
                problems.append((key, f"{why} ({source})"))
    return problems


def max_positions(config: dict[str, Any]) -> tuple[str | None, int | None]:
    """The config key bounding the model's positions and its value, looking into text_config too."""
    for scope in _scopes(config):
        for key in POSITION_KEYS:
            value = scope.get(key)
            if _positive_int(value):
                return key, value
    return None, None


def usable_positions(config: dict[str, Any]) -> tuple[str | None, int | None, str]:
    """(key, the longest sequence the model can take, that limit in words for a message).

    RoBERTa-family models number positions from padding_idx + 1, so max_position_embeddings 514 with
    pad_token_id 1 takes 512 tokens: 514 would index past the table (a Gather error in the engine).
    """
    key, table = max_positions(config)
    if key is None or table is None:
        return None, None, ""
    offset, pad = position_offset(config)
    if key != "max_position_embeddings" or not offset:
        return key, table, f"{key} {table}"
    return key, table - offset, (f"usable positions {table - offset} ({key} {table} less {offset}: its positions "
                                 f"start after pad_token_id {pad})")


def position_offset(config: dict[str, Any]) -> tuple[int, int | None]:
    """(rows of the position table no token uses, the padding_idx they follow) for RoBERTa-style models."""
    model_type = config.get("model_type")
    if model_type not in PADDING_OFFSET_TYPES or config.get("position_embedding_type", "absolute") != "absolute":
        return 0, None
    pad = FIXED_PADDING_IDX.get(model_type, config.get("pad_token_id", DEFAULT_PADDING_IDX))
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        return 0, None
    return pad + 1, pad


def sliding_window(config: dict[str, Any]) -> tuple[int | None, str]:
    """(the attention window a model's exported graph is bound by, its key), or (None, "") when it has none.

    Only for model types whose attention applies it, and not when the config turns it off
    (use_sliding_window: false, as Qwen2/Qwen3 ship) or no layer is a sliding one (layer_types).
    """
    for scope in _scopes(config):
        if scope.get("model_type", config.get("model_type")) not in SLIDING_WINDOW_TYPES:
            continue
        window = scope.get("sliding_window")
        layers = scope.get("layer_types")
        if not _positive_int(window) or scope.get("use_sliding_window") is False:
            continue
        if isinstance(layers, list) and "sliding_attention" not in layers:
            continue
        return window, "sliding_window"
    return None, ""


def _scopes(config: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The config and, for a multimodal one, its text_config: where a language model's sizes are."""
    text = config.get("text_config")
    return (config, text) if isinstance(text, dict) else (config,)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
