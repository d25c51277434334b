"""PyTorch Inductor engines, built from the HF model itself with torch.export (no ONNX on this path).

An engine directory holds:
- `prefill.pt2`: the forward over a whole prompt, dynamic in batch and sequence (decoders return
  the next-token logits of each row's last real token, encoders the last hidden state); Llama-family
  decoders use smelter's own graph (tasks/backends/inductor/llama_graphs.py: fused products, fp8 possible),
  BERT-family encoders theirs (tasks/backends/inductor/encoder_graphs.py: one qkv product, fused attention
  with a key-padding bias, fp8 possible), other models the HF forward; encoders replay it with CUDA graphs (one
  recording per shape) where the target's `cuda_graphs` says so, decoders where its `compile_mode`
  does;
- `decode.pt2` (Llama-family decoders, format `compiled`): one decode step over a static KV cache
  (tasks/backends/inductor/llama_graphs.py), replayed with CUDA graphs on a GPU;
- format `compiled`: those are exported programs that take their weights as their first input,
  `weights.safetensors` holds the weights once for both (tasks/backends/inductor/graph_weights.py), and
  `compile_cache.bin` holds Inductor's compile artifacts (torch.compiler.save_cache_artifacts), so
  loading compiles from the cache instead of autotuning again. This is the format that runs where
  AOTInductor's loader does not;
- format `compiled`, where this torch can (tasks/backends/inductor/precompiled.py): `<graph>-<shape>.precompiled`,
  Dynamo's precompiled function of each graph at each shape the build warms, listed under
  `precompiled` in engine.json; a load calls them without reading the exported programs or tracing
  them (a decode session records its own CUDA graph of its step, and a runner its own of the prefill at
  each precompiled shape where the prefill is replayed), and takes any other shape (or an
  engine without them) through `torch.compile` as above; `triton_kernels.zip` holds the Triton
  kernels smelter's own decode ops compiled at build (tasks/backends/inductor/kernel_bundle.py);
- format `aoti`: `prefill.pt2` is an AOTInductor package, loaded without compiling;
- `engine.json`: what the engine is tied to (GPU, driver, torch/CUDA/Triton versions) and what
  building it cost (export and compile seconds, cache bytes).

Compiled kernels are for one GPU arch and one torch build: an engine is refused elsewhere.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.backends.base import Backend, BackendUnavailable, EngineMismatch, Runner, TargetSpec
from tasks.backends.inductor import graph_weights, kernel_bundle, precompiled
from tasks.backends.inductor.program_load import load_program
from tasks.backends.inductor.target import InductorTarget, fp8_rules
from tasks.config.profiles import ProfileSpec
from tasks.runtime.gpu import GpuInfo, detect_gpu

PREFILL = "prefill.pt2"
DECODE = "decode.pt2"
WEIGHTS = "weights.safetensors"
COMPILE_CACHE = "compile_cache.bin"
SIDECAR = "engine.json"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8": torch.bfloat16}  # fp8: the products' operands; everything else, and the outputs, in bf16
CAUSAL_TASKS = ("text-generation", "text-generation-with-past")
DECODE_KERNELS = True  # bf16/fp16 decode steps on a GPU read their weights through smelter::decode_linear
FP8_DECODE_HEAD = True  # an fp8 engine's decode step reads the LM head in e4m3 too
PRECOMPILE = True  # compiled engines: build precompiled graphs (and load them where an engine has them)
# Encoder graphs: GELU inside the up product's cuBLASLt epilogue (its tanh form, within 5e-4 of erf's, under
# bf16's rounding): on an H100, BERT-base at 8 × 512 went from 2.07 to 1.82 ms (a separate GELU pass read and
# wrote the 4096 × 3072 activations of every layer), cosine vs fp32 unchanged (0.99994 at least)
ENCODER_GELU_EPILOGUE = True
# Encoder graphs: attention through smelter::encoder_attention (Triton, reading the qkv product's output in
# place) instead of SDPA (cuDNN on an H100): MiniLM at 256 × 128 went from 2.28 to 2.17 ms, BERT-base at 8 × 512
# from 2.07 to 2.04 ms in one run of benchmarks/gpu_encoder_variants.py, cosine vs fp32 unchanged
ENCODER_OWN_ATTENTION = True
# Encoder graphs: the qkv and down products through cuBLAS always (smelter::cublas_linear), out of max-autotune's
# reach: autotuned, the same graph got Triton templates for one or both of them in two runs on an H100 (0.40-0.44
# ms per forward each, cuBLAS's 0.30-0.33); pinned, BERT-base at 8 × 512 went from 1.92 to 1.78 ms in one run
ENCODER_CUBLAS_PRODUCTS = True
# fp8 encoder graphs: smelter's attention writes a static fp8 o product's input in e4m3 itself, instead of a
# separate quantising pass over its bf16 output
ENCODER_FP8_ATTENTION_OUT = True


def versions() -> dict[str, str]:
    """torch, CUDA and Triton versions: a compiled engine and its cache are valid for exactly these."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "triton": triton_version}


def load_problem(sidecar: dict[str, Any], gpu: GpuInfo | None, here: dict[str, str]) -> str | None:
    """Why this machine must not load the engine `sidecar` describes, or None."""
    built_on = sidecar.get("gpu")
    if built_on:
        where = (f"built for {built_on['arch']} ({built_on['gpu_name']}, "
                 f"compute capability {built_on['compute_capability']})")
        if gpu is None:
            return f"inductor engine {where} needs that GPU; no CUDA GPU is visible here"
        if gpu.cc != built_on["compute_capability"]:
            return (f"inductor engine {where} cannot run on {gpu.name} (compute capability {gpu.cc}): its kernels "
                    f"are compiled for one arch; rebuild the target on a {built_on['arch']} GPU")
    built_torch = sidecar["versions"]["torch"]
    if built_torch != here["torch"]:
        return (f"inductor engine was compiled with torch {built_torch}; this machine has torch {here['torch']}: "
                f"rebuild it with this torch")
    return None


def _load_model(model_dir: Path, task: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    loader = AutoModelForCausalLM if task in CAUSAL_TASKS else AutoModel
    model = loader.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


class PrefillGraph(torch.nn.Module):
    """The HF model over a whole prompt (models without Llama-family graphs): next-token logits of each
    row's last real token, or the last hidden state."""

    def __init__(self, model: torch.nn.Module, causal: bool):
        super().__init__()
        self.model, self.causal = model, causal

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.causal:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            last = attention_mask.sum(dim=1).clamp(min=1) - 1
            return logits[torch.arange(logits.shape[0], device=logits.device), last]
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _exportable_masks(model: torch.nn.Module) -> None:
    """Build attention masks without vmap where transformers still uses it (4.x): a vmapped mask
    exports, but the exported program cannot be saved (its flat_apply node does not serialize)."""
    try:
        from transformers.integrations.executorch import sdpa_mask_without_vmap
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_without_vmap", sdpa_mask_without_vmap)
    ALL_ATTENTION_FUNCTIONS.register("sdpa_without_vmap", ALL_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = "sdpa_without_vmap"


def prefill_graph(model: torch.nn.Module, causal: bool, fp8: bool, kept: Collection[str] = (),
                  input_scales: Mapping[str, float] | None = None) -> torch.nn.Module:
    """smelter's own graph for Llama-family decoders and for BERT-family encoders (the two built in fp8, their
    `kept` products in bf16, their activations scaled per token or by `input_scales`), else the HF forward."""
    from tasks.backends.inductor.llama_graphs import LlamaPrefill

    if fp8:
        _require_fp8(model, causal)
    name = prefill_graph_name(model, causal)
    if name == "llama":
        return LlamaPrefill(model, fp8=fp8, kept=kept, input_scales=input_scales).eval()
    if name == "encoder":
        from tasks.backends.inductor.encoder_graphs import EncoderPrefill

        return EncoderPrefill(model, gelu_epilogue=ENCODER_GELU_EPILOGUE, own_attention=ENCODER_OWN_ATTENTION,
                              cublas_products=ENCODER_CUBLAS_PRODUCTS, fp8=fp8, kept=kept,
                              input_scales=input_scales, fp8_attention_out=ENCODER_FP8_ATTENTION_OUT).eval()
    _exportable_masks(model)
    return PrefillGraph(model, causal)


def prefill_graph_name(model: torch.nn.Module, causal: bool) -> str:
    """Which graph prefill_graph builds for this model (engine.json's `prefill_graph`)."""
    from tasks.backends.inductor import encoder_support
    from tasks.backends.inductor.llama_support import unsupported

    if causal:
        return "llama" if unsupported(model.config) is None else "hf"
    return "encoder" if encoder_support.unsupported(model.config) is None else "hf"


def _require_fp8(model: torch.nn.Module, causal: bool) -> None:
    problem = fp8_rules(causal)[0](model.config)
    if problem:
        raise BackendUnavailable(problem)


@dataclass
class Exported:
    """An exported graph. `weights` is None when the program holds its weights, else the weights it
    takes as its first input (graph_weights), which a saved engine stores once for all its graphs."""

    program: torch.export.ExportedProgram
    weights: dict[str, torch.Tensor] | None = None

    def module(self) -> torch.nn.Module:
        """The program as a module called on the graph's own inputs."""
        graph = self.program.module()
        return graph_weights.Bound(graph, self.weights) if self.weights is not None else graph


def _export(graph: torch.nn.Module, inputs: tuple[Any, ...], dynamic: tuple[Any, ...],
            weights_as_input: bool) -> Exported:
    with torch.no_grad():
        if not weights_as_input:
            return Exported(torch.export.export(graph, inputs, dynamic_shapes=dynamic, strict=False))
        weights = graph_weights.weights_of(graph)
        program = torch.export.export(graph_weights.WeightsAsInput(graph), (weights, *inputs),
                                      dynamic_shapes=(dict.fromkeys(weights), dynamic), strict=False)
    program.example_inputs = None  # they hold the weights, which a saved program must not
    return Exported(program, weights)


def export_prefill(model: torch.nn.Module, causal: bool, batch: int, seq: int, fp8: bool = False,
                   weights_as_input: bool = False, kept: Collection[str] = (),
                   input_scales: Mapping[str, float] | None = None) -> Exported:
    """Export (input_ids, attention_mask) -> output with batch and sequence dynamic (Dim.AUTO: named
    ranges hit guards Llama's attention adds)."""
    graph = prefill_graph(model, causal, fp8, kept, input_scales)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    return _export(graph, (ids, torch.ones_like(ids)), (auto, auto), weights_as_input)


def export_decode(model: torch.nn.Module, dtype: torch.dtype, weights_as_input: bool = False,
                  products: str = "torch", fp8_weights: bool = False, kept: Collection[str] = (),
                  fp8_head: bool = False) -> Exported:
    """Export the static-cache decode step, dynamic in batch and cache length (llama_graphs.StaticDecoder
    says what `products`, `fp8_weights`, `kept` and `fp8_head` choose)."""
    from tasks.backends.inductor.llama_graphs import StaticDecoder, empty_cache

    device = next(model.parameters()).device
    step = StaticDecoder(model, products=products, fp8_weights=fp8_weights, kept=kept, fp8_head=fp8_head).eval()
    k, v = empty_cache(model.config, 2, 32, dtype, device)
    tokens = torch.zeros(2, 1, dtype=torch.long, device=device)
    auto = torch.export.Dim.AUTO
    cache_dims = [{0: auto, 2: auto} for _ in k]
    return _export(step, (tokens, torch.tensor(3, device=device), k, v), ({0: auto}, None, cache_dims, cache_dims),
                   weights_as_input)


def _compile_options(target: InductorTarget, decode: bool, causal: bool = True) -> dict[str, Any]:
    """Inductor options. The prefill follows torch.compile's modes: `max-autotune*` autotune its
    products, `reduce-overhead` and `max-autotune` replay it with CUDA graphs (one recording per
    prompt shape), as `cuda_graphs` also does for an encoder's. The decode step is never autotuned (it
    reads weights, so cuBLAS is within a few percent of the best template, and autotuning 1B
    parameters' worth of shapes per batch size cost minutes on an H200) and is replayed with CUDA
    graphs where `cuda_graphs` asks."""
    if decode:
        return {"max_autotune": False, "triton.cudagraphs": target.cuda_graphs and target.device == "cuda"}
    return {"max_autotune": target.compile_mode.startswith("max-autotune"),
            "triton.cudagraphs": prefill_cuda_graphs(target, causal)}


def prefill_cuda_graphs(target: InductorTarget, causal: bool = True) -> bool:
    """Whether the prefill is replayed from CUDA graphs. An encoder's forward is all its engine runs, and
    launches dominate at the batches embedding services run (on an H100, MiniLM's shape at 32 × 128
    took 1.31 ms launched kernel by kernel, 0.51 ms replayed), so `cuda_graphs` decides it; a decoder's
    prefill follows compile_mode (its kernels are long: replay gained 1% on a 1B model)."""
    if target.device != "cuda":
        return False
    return target.compile_mode in ("reduce-overhead", "max-autotune") or (not causal and target.cuda_graphs)


class _CachedStep(torch.nn.Module):
    """The decode step with its KV cache at fixed addresses, which CUDA-graph replay needs."""

    def __init__(self, step: torch.nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        super().__init__()
        self.step = step
        for name, caches in (("k", k_caches), ("v", v_caches)):
            for i, cache in enumerate(caches):
                self.register_buffer(f"{name}{i}", cache)
                torch._dynamo.mark_static_address(cache)
        self.layers = len(k_caches)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.step(tokens, pos, [getattr(self, f"k{i}") for i in range(self.layers)],
                         [getattr(self, f"v{i}") for i in range(self.layers)])


class DecodeSession:
    """`batch` sequences decoding together: step(tokens [B,1], pos) -> logits [B,V] of the next token."""

    def __init__(self, step: torch.nn.Module, config: Any, batch: int, max_len: int, dtype: torch.dtype,
                 device: str):
        from tasks.backends.inductor.llama_graphs import empty_cache

        self.batch, self.max_len = batch, max_len
        self.module = _CachedStep(step, *empty_cache(config, batch, max_len, dtype, device))
        self._step: Any = self.module
        self._replayed = False
        self._pos = torch.zeros((), dtype=torch.long, device=device)
        self._precompiled: Any = None
        self.problem: str | None = None  # why a precompiled step was given up for torch.compile's

    def compile(self, options: dict[str, Any]) -> None:
        self._step = torch.compile(self.module, options=options, dynamic=False)
        self._replayed = options["triton.cudagraphs"]

    def caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        m = self.module
        return [getattr(m, f"k{i}") for i in range(m.layers)], [getattr(m, f"v{i}") for i in range(m.layers)]

    def key(self) -> list[Any]:
        """What a precompiled decode step must have been compiled for to run this session."""
        tokens = torch.empty(self.batch, 1, dtype=torch.long, device=self._pos.device)
        return precompiled.signature((tokens, self._pos, *self.caches()))

    def use_precompiled(self, fn: Any, options: dict[str, Any], fallback: Any) -> None:
        """Step through precompiled `fn` (called on this session's module, whose graph may be None),
        replayed from a CUDA graph of this session's own where `options` ask for CUDA graphs (a
        precompiled function is compiled without them: CUDA-graph trees do not survive its
        serialisation); tokens it was not compiled for go through `fallback()`'s module, compiled
        on first use."""
        self._precompiled, self._fallback = fn, fallback
        self._options = options
        self._graphed = self._replayed = options["triton.cudagraphs"]
        self._step = None
        self._graph: Any = None
        self._ran = False

    def _precompiled_takes(self, tokens: torch.Tensor) -> bool:
        return tokens.shape == (self.batch, 1) and tokens.dtype == torch.long and tokens.device == self._pos.device

    def _run_precompiled(self, tokens: torch.Tensor) -> torch.Tensor:
        """As CUDA-graph trees do: the first step runs (kernels load, Triton picks its configs), the
        second is recorded into a graph and replayed, later ones copy their tokens in and replay."""
        if not self._graphed or not self._ran:
            self._ran = True
            return self._precompiled(self.module, tokens.contiguous(), self._pos)
        if self._graph is None:
            self._tokens = tokens.clone(memory_format=torch.contiguous_format)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._out = self._precompiled(self.module, self._tokens, self._pos)
            self._graph = graph
        else:
            self._tokens.copy_(tokens)
        self._graph.replay()
        return self._out

    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        if not 0 <= pos < self.max_len:
            raise ValueError(f"position {pos} is outside this session's cache of {self.max_len} tokens")
        self._pos.fill_(pos)
        with torch.no_grad():
            logits = None
            if self._precompiled is not None and self._precompiled_takes(tokens):
                try:
                    logits = self._run_precompiled(tokens)
                except RuntimeError as e:  # a graph that cannot be recorded: torch.compile's from here on
                    if self._graph is not None or not self._ran:
                        raise
                    self.problem = f"recording the precompiled decode step failed: {e}"[:500]
                    self._precompiled = None
                    self._replayed = self._options["triton.cudagraphs"]
            if logits is None:
                if self._step is None:
                    self._step = torch.compile(_CachedStep(self._fallback(), *self.caches()), options=self._options,
                                               dynamic=False)
                logits = self._step(tokens, self._pos)
        # A replayed graph writes each output where it wrote the last one: hand out a copy the next step keeps.
        return logits.clone() if self._replayed else logits


@dataclass
class _Replay:
    """One shape's recorded prefill: its graph, the inputs it reads and the output it writes."""

    graph: Any = None
    inputs: Any = None
    out: Any = None
    failed: bool = False


class InductorRunner(Runner):
    """A loaded inductor engine; `infer` runs the prefill graph, `decoder()` opens decode sessions."""

    def __init__(self, engine_dir: Path, target: InductorTarget, sidecar: dict[str, Any]):
        self.sidecar = sidecar
        self.target = target
        self.device = target.device
        self.dtype = DTYPES[sidecar["precision"]]
        self.causal = sidecar["causal"]
        self.input_names = ["input_ids", "attention_mask"]
        self.output_names = ["logits" if self.causal else "last_hidden_state"]
        started = time.perf_counter()
        import tasks.backends.inductor.llama_graphs  # noqa: F401  (registers the smelter:: ops its graphs call)

        self.engine_dir = engine_dir
        decode_file = engine_dir / DECODE
        self._decode_file = decode_file if sidecar["format"] == "compiled" and decode_file.is_file() else None
        self._decode_graph: torch.nn.Module | None = None
        self._prefill: Any = None
        self._cache_loaded = False
        recorded = (sidecar.get("precompiled") or {}) if PRECOMPILE and sidecar["format"] == "compiled" else {}
        self._pre_prefill = precompiled.entries(engine_dir, recorded.get("prefill"))
        self._pre_decode = precompiled.entries(engine_dir, recorded.get("decode"))
        self._pre_decode_used: set[Path] = set()
        self.precompile_problems: list[str] = []  # precompiled functions that failed to load or run
        if sidecar["format"] == "aoti":
            self._prefill = torch._inductor.aoti_load_package(str(engine_dir / PREFILL))
        else:
            if not (engine_dir / WEIGHTS).is_file():
                raise EngineMismatch(f"inductor engine {engine_dir} has no {WEIGHTS}: it was built before its graphs "
                                     "shared one copy of their weights; rebuild it")
            if self.device == "cuda":
                kernel_bundle.install(engine_dir / kernel_bundle.FILE)
            self._weights = graph_weights.WeightsFile(engine_dir / WEIGHTS, self.device)
            self._prefill_weights = self._weights.graph("prefill")
            self._prefill_shell = graph_weights.Bound(None, self._prefill_weights)
            if not self._pre_prefill:
                self._compiled_prefill()
        self.load_seconds = time.perf_counter() - started
        self._prefill_replayed = sidecar["format"] == "compiled" and prefill_cuda_graphs(target, self.causal)
        self._prefill_graphs: dict[Path, _Replay] = {}  # the precompiled prefill recorded per shape (_replay)
        self._graph_pool: Any = None
        self._config = _Config(sidecar["decoder_config"]) if sidecar.get("decoder_config") else None

    def _load_compile_cache(self) -> None:
        """Inductor's compile artifacts, read before the first graph compiled through torch.compile."""
        cache = self.engine_dir / COMPILE_CACHE
        if not self._cache_loaded and cache.is_file():
            torch.compiler.load_cache_artifacts(cache.read_bytes())
        self._cache_loaded = True

    def _prefill_module(self) -> graph_weights.Bound:
        return graph_weights.Bound(load_program(self.engine_dir / PREFILL).module(), self._prefill_weights)

    def _compiled_prefill(self) -> Any:
        """The prefill through torch.compile (shapes no precompiled function takes), made on first use."""
        if self._prefill is None:
            self._load_compile_cache()
            self._prefill = torch.compile(self._prefill_module(),
                                          options=_compile_options(self.target, decode=False, causal=self.causal))
        return self._prefill

    def _precompiled_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        input_ids, attention_mask = input_ids.contiguous(), attention_mask.contiguous()
        for entry in self._pre_prefill:
            if entry.matches((input_ids, attention_mask)):
                try:
                    fn = entry.function()
                except Exception as e:  # noqa: BLE001 - any failure to load it: compile as before
                    self._drop(entry, self._pre_prefill, e)
                    return None
                if self._prefill_replayed:
                    return self._replay(entry, fn, input_ids, attention_mask)
                return fn(self._prefill_shell, input_ids, attention_mask)
        return None

    def _replay(self, entry: precompiled.Precompiled, fn: Any, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """The precompiled prefill from a CUDA graph of this runner's own, one per shape, as CUDA-graph
        trees do (a precompiled function is compiled without them: they do not survive its
        serialisation): the first call runs (kernels load), the second is recorded and replayed, later
        ones copy their inputs in and replay. The graphs share one memory pool: they never run at
        once, and prefill() copies each result out. A shape whose recording fails runs unrecorded."""
        replay = self._prefill_graphs.get(entry.path)
        if replay is None:
            self._prefill_graphs[entry.path] = _Replay()
            return fn(self._prefill_shell, input_ids, attention_mask)
        if replay.failed:
            return fn(self._prefill_shell, input_ids, attention_mask)
        if replay.graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            replay.inputs = (input_ids.clone(), attention_mask.clone())
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._graph_pool):
                    replay.out = fn(self._prefill_shell, *replay.inputs)
            except RuntimeError as e:
                replay.failed = True
                self.precompile_problems.append(f"{entry.path.name}: recording its CUDA graph failed: {e}"[:500])
                return fn(self._prefill_shell, input_ids, attention_mask)
            replay.graph = graph
        else:
            replay.inputs[0].copy_(input_ids)
            replay.inputs[1].copy_(attention_mask)
        replay.graph.replay()
        return replay.out

    def _drop(self, entry: precompiled.Precompiled, entries: list[precompiled.Precompiled], error: Exception) -> None:
        entries.remove(entry)
        self.precompile_problems.append(f"{entry.path.name}: {type(error).__name__}: {error}"[:500])

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Device-resident in and out: what the benchmark times. The result stays valid after the next
        call (with CUDA graphs, a copy out of the graph's memory)."""
        with torch.no_grad():
            out = self._precompiled_prefill(input_ids, attention_mask) if self._pre_prefill else None
            if out is None:
                out = self._compiled_prefill()(input_ids, attention_mask)
        return out.clone() if self._prefill_replayed else out

    def _device_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KeyError(f"inductor engine needs inputs {self.input_names}; missing {missing}")
        if self.causal:
            _require_right_padding(np.asarray(feeds["attention_mask"]))
        return {n: torch.as_tensor(np.asarray(feeds[n], dtype=np.int64), device=self.device) for n in self.input_names}

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.prefill(**self._device_feeds(feeds))
        return {self.output_names[0]: out.float().cpu().numpy()}

    def time_ms(self, feeds: dict[str, np.ndarray], warmup: int, repeats: int) -> list[float]:
        """CUDA-event latencies of the prefill with inputs and outputs on the device (host clock on a CPU)."""
        on_device = self._device_feeds(feeds)
        if self.device != "cuda":
            return super().time_ms(feeds, warmup, repeats)
        from tasks.measure.gpu_measure import cuda_times_ms

        return cuda_times_ms(lambda: self.prefill(**on_device), warmup, repeats)

    @property
    def has_decoder(self) -> bool:
        return self._config is not None and self._decode_file is not None

    def decoder(self, batch: int, max_len: int) -> DecodeSession:
        """A decode session over a fresh cache; compiled (with CUDA graphs where the target asks) on first
        step. The decode-step graph and its weights are read on the first call: a runner that only
        prefills never reads them."""
        if not self.has_decoder:
            raise BackendUnavailable("this inductor engine has no decode-step graph (encoders, format aoti, or an "
                                     "architecture the static decoder does not cover)")
        options = _compile_options(self.target, decode=True)
        if self._pre_decode:
            session = DecodeSession(graph_weights.Bound(None, self._weights.graph("decode")), self._config, batch,
                                    max_len, self.dtype, self.device)
            key = session.key()
            for entry in [e for e in self._pre_decode if e.signature == key]:
                try:
                    fn = entry.function()  # shared by the sessions of its shape: each records its own CUDA graph
                except Exception as e:  # noqa: BLE001 - any failure to load it: compile as before
                    self._drop(entry, self._pre_decode, e)
                    break
                self._pre_decode_used.add(entry.path)
                session.use_precompiled(fn, options, self._decode_module)
                return session
        session = DecodeSession(self._decode_module(), self._config, batch, max_len, self.dtype, self.device)
        session.compile(options)
        return session

    def _decode_module(self) -> graph_weights.Bound:
        """The decode step's exported graph over its weights, read on first use."""
        if self._decode_graph is None:
            self._load_compile_cache()
            self._decode_graph = graph_weights.Bound(load_program(self._decode_file).module(),
                                                     self._weights.graph("decode"))
        return self._decode_graph

    def precompile(self, prefill_shapes: list[tuple[int, int]], decode_shapes: list[tuple[int, int]],
                   vocab: int) -> dict[str, Any]:
        """Precompile each graph at each shape into the engine directory (precompiled.py); what the
        sidecar records under `precompiled` (a graph and shape that fails is left out, with why)."""
        problem = precompiled.unavailable()
        if problem:
            return {"unavailable": problem}
        started = time.perf_counter()
        done: dict[str, Any] = {"prefill": [], "decode": [], "failed": []}

        def attempt(graph: str, path: Path, compile_one: Any) -> None:
            try:
                done[graph].append(compile_one())
            except Exception as e:  # noqa: BLE001 - that shape then loads through torch.compile, as before
                path.unlink(missing_ok=True)
                done["failed"].append(f"{path.name}: {type(e).__name__}: {e}"[:1500])

        # compiled without CUDA graphs (their trees do not survive a precompiled function's serialisation):
        # where the prefill is replayed, the runner records its own (_replay)
        options = {**_compile_options(self.target, decode=False, causal=self.causal), "triton.cudagraphs": False}
        module = getattr(self._prefill, "_orig_mod", None) or self._prefill_module()
        for batch, seq in prefill_shapes:
            ids = torch.randint(0, vocab, (batch, seq), device=self.device)
            inputs = (ids, torch.ones_like(ids))
            path = self.engine_dir / f"prefill-{batch}x{seq}{precompiled.SUFFIX}"
            attempt("prefill", path, lambda: precompiled.compile_graph(
                module, self._prefill_shell, inputs, options, path, precompiled.signature(inputs)))
        if self.has_decoder:
            # compiled without CUDA graphs: a decode session records its own (DecodeSession.use_precompiled)
            options = {**_compile_options(self.target, decode=True), "triton.cudagraphs": False}
            shell = graph_weights.Bound(None, self._weights.graph("decode"))
            for batch, max_len in decode_shapes:
                session = DecodeSession(self._decode_module(), self._config, batch, max_len, self.dtype, self.device)
                tokens = torch.randint(0, vocab, (batch, 1), device=self.device)
                path = self.engine_dir / f"decode-b{batch}-len{max_len}{precompiled.SUFFIX}"
                attempt("decode", path, lambda: precompiled.compile_graph(
                    session.module, _CachedStep(shell, *session.caches()), (tokens, session._pos), options, path,
                    session.key()))
                del session
        done["seconds"] = round(time.perf_counter() - started, 3)
        return done


def _require_right_padding(mask: np.ndarray) -> None:
    """The prefill reads each row's last real token where its 1s end: a 1 after a 0 would be misread."""
    if mask.ndim == 2 and mask.shape[1] > 1 and (np.diff(mask.astype(np.int8), axis=1) > 0).any():
        raise ValueError("inductor decoder engines take right-padded prompts (attention_mask 1s, then 0s); "
                         "this attention_mask has a 1 after a 0 (left padding?)")


class _Config:
    """The few config fields a KV cache's shape needs, from the sidecar (no transformers import at load)."""

    def __init__(self, fields: dict[str, int]):
        self.__dict__.update(fields)


def _decoder_config(config: Any) -> dict[str, int]:
    heads = config.num_attention_heads
    return {"num_hidden_layers": config.num_hidden_layers, "num_attention_heads": heads,
            "num_key_value_heads": config.num_key_value_heads or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}


def decode_products_for(precision: str, target: InductorTarget, excluded: list[str]) -> dict[str, Any]:
    """How the decode step runs its products (llama_graphs.StaticDecoder). fp8: e4m3 weights with
    per-channel scales for every layer product but those fp8_exclude names (the products the
    sensitivity measurement keeps are chosen for the prefill's e4m3 activations; the decode step's
    activations stay bf16 at small batch) and, with FP8_DECODE_HEAD, the LM head: half the bytes.
    Other precisions on a GPU: the model's weights through smelter::decode_linear where
    DECODE_KERNELS says so, else F.linear."""
    if precision == "fp8":
        return {"products": "smelter", "fp8_weights": True, "kept": list(excluded), "fp8_head": FP8_DECODE_HEAD}
    products = "smelter" if DECODE_KERNELS and target.device == "cuda" else "torch"
    return {"products": products, "fp8_weights": False, "kept": [], "fp8_head": False}


def _kept_products(target: InductorTarget, config: Any, causal: bool) -> list[str]:
    """The products target.fp8_exclude keeps in bf16 (smelter validate has checked them against the config)."""
    from tasks.backends.inductor.llama_support import fp8_kept

    kept, problems = fp8_kept(target.fp8_exclude, config.num_hidden_layers, fp8_rules(causal)[1])
    if problems:
        raise ValueError(f"target {target.name}: fp8_exclude[{problems[0][0]}]: {problems[0][1]}")
    return kept


def _device_batches(model: torch.nn.Module, target: InductorTarget,
                    calibration: Sequence[Mapping[str, np.ndarray]] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The calibration feeds as (input_ids, attention_mask) on the model's device."""
    if not calibration:
        raise ValueError(f"target {target.name} calibrates its fp8 build (fp8_scaling static or fp8_bf16_share), "
                         "and no calibration feeds were given")
    device = next(model.parameters()).device
    return [(torch.as_tensor(np.asarray(f["input_ids"], dtype=np.int64), device=device),
             torch.as_tensor(np.asarray(f["attention_mask"], dtype=np.int64), device=device)) for f in calibration]


def _fp8_graphs(causal: bool) -> Any:
    """The module of the graphs an fp8 build of this task comes from (its calibrate_input_amax and
    fp8_sensitivity)."""
    if causal:
        from tasks.backends.inductor import llama_graphs

        return llama_graphs
    from tasks.backends.inductor import encoder_graphs

    return encoder_graphs


def _static_fp8(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                causal: bool) -> dict[str, Any]:
    """Static fp8 input scales from the calibration feeds, with what they were measured on."""
    from tasks.backends.inductor.fp8_linear import FP8_MAX

    amax = _fp8_graphs(causal).calibrate_input_amax(model, batches)
    return {"scales": {name: max(value, 1e-12) / FP8_MAX for name, value in amax.items()},
            "batches": len(batches), "tokens": int(sum(int(mask.sum()) for _, mask in batches)),
            "input_amax": {name: float(f"{value:.4g}") for name, value in amax.items()}}


def _sensitive_kept(model: torch.nn.Module, target: InductorTarget, kept: list[str],
                    batches: list[tuple[torch.Tensor, torch.Tensor]],
                    scales: Mapping[str, float] | None, causal: bool) -> tuple[list[str], dict[str, Any]]:
    """`kept` and the products fp8 rounds worst per unit of arithmetic, up to target.fp8_bf16_share of it,
    with the measurement they were chosen by (the error of a decoder's logits, of an encoder's last
    hidden state)."""
    from tasks.backends.inductor import encoder_support, llama_support

    started = time.perf_counter()
    errors = _fp8_graphs(causal).fp8_sensitivity(model, batches, scales)
    costs = (llama_support if causal else encoder_support).product_costs(model.config)
    chosen = llama_support.keep_sensitive(errors, costs, target.fp8_bf16_share, kept)
    total = sum(errors.values())
    return chosen, {
        "share": target.fp8_bf16_share, "kept_share": round(sum(costs[n] for n in chosen) / sum(costs.values()), 4),
        "error_kept_share": round(sum(errors[n] for n in chosen) / total, 4) if total else 0.0,
        "seconds": round(time.perf_counter() - started, 3),
        # what each product's error was measured on: a decoder's logits, an encoder's last hidden state
        "logit_mse" if causal else "hidden_mse": {name: float(f"{value:.4g}") for name, value in errors.items()}}


def warm_shapes(profiles: list[ProfileSpec]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """What a build compiles ahead. Prefill: each prompt profile's opt (batch, seq), a prompt profile
    being one without `past` (all profiles if none is). Decode: each profile with `past`, at its min
    and max batch, with a cache of its max past plus its max new tokens."""
    prompt = [p for p in profiles if p.past is None] or profiles
    prefill = sorted({(p.batch[1], p.seq[1]) for p in prompt})
    decode = sorted({(b, p.past[2] + p.seq[2]) for p in profiles if p.past is not None
                     for b in (p.batch[0], p.batch[2])})
    return prefill, decode


def warm_up(runner: InductorRunner, prefill_shapes: list[tuple[int, int]],
            decode_shapes: list[tuple[int, int]], vocab: int) -> None:
    """Compile every graph the engine will be asked for, by running each (thrice where CUDA-graph
    trees record it: they run it once, record it on the second call, replay it from the third)."""
    for batch, seq in prefill_shapes:
        ids = torch.randint(0, vocab, (batch, seq), device=runner.device)
        for _ in range(3 if runner._prefill_replayed else 1):
            runner.prefill(ids, torch.ones_like(ids))
    if runner.has_decoder:
        for batch, max_len in decode_shapes:
            session = runner.decoder(batch, max_len)
            tokens = torch.randint(0, vocab, (batch, 1), device=runner.device)
            for pos in range(3):
                session.step(tokens, pos)
    if runner.device == "cuda":
        torch.cuda.synchronize()


def _precompile(runner: InductorRunner, prefill_shapes: list[tuple[int, int]], decode_shapes: list[tuple[int, int]],
                vocab: int) -> dict[str, Any]:
    """runner.precompile, or why it failed (the engine then loads through torch.compile, as before)."""
    try:
        return runner.precompile(prefill_shapes, decode_shapes, vocab)
    except Exception as e:  # noqa: BLE001 - a torch that cannot precompile these graphs still builds the engine
        for stale in runner.engine_dir.glob(f"*{precompiled.SUFFIX}"):
            stale.unlink()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


class InductorBackend(Backend):
    name = "inductor"
    engine_file = PREFILL

    def missing(self, target: TargetSpec) -> str | None:
        assert isinstance(target, InductorTarget)
        if target.device == "cpu":
            return None
        if not torch.cuda.is_available():
            return (f"target {target.name} needs a CUDA GPU ({target.arch}); this torch "
                    f"({torch.__version__}) sees none")
        gpu = detect_gpu()
        if gpu is None or gpu.arch != target.arch:
            found = f"{gpu.name} ({gpu.arch})" if gpu else "no GPU"
            return f"target {target.name} is for {target.arch}; this machine has {found}"
        return None

    def version(self) -> str:
        return torch.__version__

    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        """GPU facts for a cuda target (kernels are per arch), the CPU ISA for a cpu target."""
        assert isinstance(target, InductorTarget)
        if target.device == "cuda":
            gpu = detect_gpu()
            return gpu.facts() if gpu else {}
        return {"machine": platform.machine()}

    def build_from_model(self, model_dir: Path, task: str, precision: str, target: TargetSpec,
                         profiles: list[ProfileSpec], out_dir: Path,
                         calibration: Sequence[Mapping[str, np.ndarray]] | None = None) -> dict[str, Any]:
        """Export, compile and save the engine; return facts for the manifest (also written to engine.json).
        `calibration`: whole-prompt feeds (input_ids, attention_mask), for a target that calibrates."""
        assert isinstance(target, InductorTarget)
        problem = self.missing(target) or target.precision_problem(precision)
        if precision not in DTYPES:
            problem = problem or f"inductor builds {', '.join(DTYPES)} here; {precision} is not built yet"
        if problem:
            raise BackendUnavailable(problem)
        from tasks.backends.inductor.llama_support import unsupported

        dtype, device = DTYPES[precision], target.device
        causal = task in CAUSAL_TASKS
        started = time.perf_counter()
        model = _load_model(model_dir, task, dtype, device)
        prefill_shapes, decode_shapes = warm_shapes(profiles)
        batch, seq = max(prefill_shapes)
        compiled = target.format == "compiled"
        kept = _kept_products(target, model.config, causal) if precision == "fp8" else []
        decode_options = decode_products_for(precision, target, kept)
        scaling = sensitivity = None
        calibration_started = time.perf_counter()
        if target.calibrates(precision):
            _require_fp8(model, causal)
            batches = _device_batches(model, target, calibration)
            if target.fp8_scaling == "static":
                scaling = _static_fp8(model, batches, causal)
            if target.fp8_bf16_share:
                kept, sensitivity = _sensitive_kept(model, target, kept, batches, scaling and scaling["scales"],
                                                    causal)
            del batches
        calibration_seconds = time.perf_counter() - calibration_started
        prefill = export_prefill(model, causal, max(batch, 2), max(seq, 2), fp8=precision == "fp8",
                                 weights_as_input=compiled, kept=kept, input_scales=scaling and scaling["scales"])
        has_decode = causal and compiled and unsupported(model.config) is None
        decode = export_decode(model, dtype, weights_as_input=True, **decode_options) if has_decode else None
        export_seconds = time.perf_counter() - started - calibration_seconds
        gpu = detect_gpu() if device == "cuda" else None
        sidecar: dict[str, Any] = {
            "format": target.format, "precision": precision, "task": task, "causal": causal, "device": device,
            "target": target.name, "gpu": gpu.facts() if gpu else None, "versions": versions(),
            "compile_mode": target.compile_mode, "cuda_graphs": target.cuda_graphs, "fp8_kept_bf16": kept,
            "prefill_graph": prefill_graph_name(model, causal),
            "prefill_cuda_graphs": device == "cuda" and compiled and prefill_cuda_graphs(target, causal),
            "fp8_scaling": target.fp8_scaling if precision == "fp8" else None,
            "fp8_calibration": scaling and {k: v for k, v in scaling.items() if k != "scales"},
            "fp8_sensitivity": sensitivity,
            "decoder_config": _decoder_config(model.config) if has_decode else None,
            "decode_products": decode_options if has_decode else None,
            "warm_shapes": {"prefill": prefill_shapes, "decode": decode_shapes if has_decode else []}}
        compile_started = time.perf_counter()
        if not compiled:
            torch._inductor.aoti_compile_and_package(prefill.program, package_path=str(out_dir / PREFILL))
            cache_bytes = 0
        else:
            torch.export.save(prefill.program, str(out_dir / PREFILL))
            graphs = {"prefill": prefill.weights}
            if decode is not None:
                torch.export.save(decode.program, str(out_dir / DECODE))
                graphs["decode"] = decode.weights
            sidecar["weights"] = graph_weights.save(graphs, out_dir / WEIGHTS)
            del model, prefill, decode, graphs
            torch.compiler.reset()
            runner = InductorRunner(out_dir, target, sidecar)
            warm_up(runner, prefill_shapes, decode_shapes if has_decode else [], self._vocab(model_dir))
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is None:
                raise RuntimeError("torch.compiler.save_cache_artifacts() returned nothing after compiling")
            (out_dir / COMPILE_CACHE).write_bytes(artifacts[0])
            cache_bytes = len(artifacts[0])
            if PRECOMPILE:
                sidecar["precompiled"] = _precompile(runner, prefill_shapes, decode_shapes if has_decode else [],
                                                     self._vocab(model_dir))
            if device == "cuda":
                sidecar["triton_kernels"] = kernel_bundle.pack(out_dir / kernel_bundle.FILE)
        sidecar.update({"export_seconds": round(export_seconds, 3), "calibration_seconds": round(calibration_seconds, 3),
                        "compile_seconds": round(time.perf_counter() - compile_started, 3),
                        "cache_bytes": cache_bytes})
        engine_bytes = sum((out_dir / f).stat().st_size for f in (PREFILL, DECODE, WEIGHTS) if (out_dir / f).is_file())
        sidecar["engine_bytes"] = engine_bytes
        (out_dir / SIDECAR).write_text(json.dumps(sidecar, indent=2))
        return {"backend": self.name, "backend_version": self.version(), "engine_file": PREFILL,
                "engine_bytes": engine_bytes, "sidecar": SIDECAR, **{k: sidecar[k] for k in (
                    "format", "gpu", "versions", "export_seconds", "calibration_seconds", "compile_seconds",
                    "cache_bytes")}}

    @staticmethod
    def _vocab(model_dir: Path) -> int:
        return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])

    def load(self, engine_dir: Path, target: TargetSpec) -> InductorRunner:
        assert isinstance(target, InductorTarget)
        try:
            sidecar = json.loads((engine_dir / SIDECAR).read_text())
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"inductor engine {engine_dir}: cannot read {SIDECAR}: {e}") from e
        problem = load_problem(sidecar, detect_gpu() if sidecar.get("gpu") else None, versions())
        if problem:
            raise EngineMismatch(problem)
        return InductorRunner(engine_dir, target, sidecar)
