"""The inductor backend's declaration and target settings (no torch import: see table.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.backends.base import TargetSpec
from tasks.backends.inductor import encoder_support, llama_support
from tasks.backends.inductor.llama_support import fp8_kept
from tasks.config.bounds import MAX_PATTERNS, MAX_THREADS, Arch, Pattern, arch_number
from tasks.config.yaml_source import clip

FP8_SETTINGS = ("fp8_exclude", "fp8_scaling", "fp8_bf16_share")  # read by fp8 builds only


def fp8_rules(decoder: bool) -> tuple[Callable[[Any], str | None], tuple[str, ...]]:
    """Why a model's config cannot be built in fp8 (or None), and each layer's product names, for the graph
    family that builds it: Llama-family graphs for decoders, the encoder graph for encoders."""
    if decoder:
        return llama_support.fp8_unsupported, llama_support.PRODUCTS
    return encoder_support.fp8_unsupported, encoder_support.PRODUCTS


class InductorTarget(TargetSpec):
    """PyTorch's compiler, built from the model itself (torch.export), on a CUDA GPU or the CPU."""

    devices: ClassVar = ("gpu", "cpu")
    source: ClassVar = "torch"
    precisions: ClassVar = ("fp32", "fp16", "bf16", "fp8")
    implementation: ClassVar = "tasks.backends.inductor.backend:InductorBackend"
    precision_settings: ClassVar = {"fp8": FP8_SETTINGS}

    backend: Literal["inductor"]
    device: Literal["cuda", "cpu"] = "cuda"
    arch: Arch | None = Field(None, description="GPU arch, required with device: cuda")
    format: Literal["compiled", "aoti"] = Field(
        "compiled", description="compiled: exported program + compile cache; aoti: an AOTInductor .pt2 package")
    compile_mode: Literal["max-autotune-no-cudagraphs", "default", "reduce-overhead", "max-autotune"] = Field(
        "max-autotune-no-cudagraphs", description="the prefill's, as torch.compile reads it: max-autotune* autotune, "
        "reduce-overhead and max-autotune replay CUDA graphs (device: cuda)")
    cuda_graphs: bool = Field(True, description="replay the decode step, and an encoder's forward, with CUDA graphs "
                                                      "(device: cuda)")
    fp8_exclude: list[Pattern] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                       description="an fp8 build's products kept in bf16: globs over "
                                                   "layers.<i>.qkv|o|gate_up|down (decoders) or "
                                                   "layers.<i>.qkv|o|up|down (encoders)")
    fp8_scaling: Literal["per-token", "static"] = Field(
        "per-token", description="an fp8 build's activation scales: per-token (computed as each input arrives) "
        "or static (one per product input, calibrated on calibration.data at build: faster; values past the "
        "calibrated range are clipped)")
    fp8_bf16_share: float = Field(
        0.0, ge=0.0, le=0.5, description="an fp8 build keeps in bf16 up to this share of its products' arithmetic: "
        "fp8_exclude's products first, then those whose e4m3 rounding disturbs the output (a decoder's logits, an "
        "encoder's last hidden state) most per unit of "
        "arithmetic, measured at build on calibration.data")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads (device: cpu)")

    @model_validator(mode="before")
    @classmethod
    def _cpu_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("device") == "cpu" and "cuda_graphs" not in data:
            return {**data, "cuda_graphs": False}
        return data

    @model_validator(mode="after")
    def _device_settings(self) -> InductorTarget:
        if self.device == "cuda":
            if self.arch is None:
                raise ValueError("an inductor target on device cuda needs 'arch' (e.g. sm90)")
            if self.threads is not None:
                raise ValueError("'threads' is a setting of device cpu; this target is on cuda")
        else:
            if self.arch is not None:
                raise ValueError("'arch' is a setting of device cuda; this target is on cpu")
            if self.cuda_graphs:
                raise ValueError("'cuda_graphs' needs device cuda; this target is on cpu")
        return self

    @property
    def device_kind(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    @property
    def gpu_arch(self) -> str | None:
        return self.arch

    @property
    def intra_op_threads(self) -> int | None:
        return self.threads

    def with_threads(self, threads: int) -> InductorTarget:
        return self.model_copy(update={"threads": threads})

    def calibrates(self, precision: str) -> bool:
        return precision == "fp8" and (self.fp8_scaling == "static" or self.fp8_bf16_share > 0)

    def precision_problem(self, precision: str) -> str | None:
        if precision == "fp8" and (self.device != "cuda" or arch_number(self.arch or "sm0") < 89):
            return "fp8 needs device cuda with arch sm89 or newer"
        return super().precision_problem(precision)

    def model_problems(self, precision: str, config: Mapping[str, Any],
                       decoder: bool) -> list[tuple[tuple[Any, ...], str]]:
        """fp8 engines come from the Llama-family graphs (decoders) and the encoder graph (BERT-family encoders)
        only, and fp8_exclude names their products: said by `smelter validate`, not after the export."""
        if precision != "fp8":
            return []
        unsupported, products = fp8_rules(decoder)
        try:
            problem = unsupported(SimpleNamespace(**{"num_key_value_heads": None, **config}))
        except (AttributeError, TypeError, ZeroDivisionError) as e:
            family = "a Llama-family" if decoder else "a BERT-family"
            problem = f"fp8 needs {family} config with its sizes; this one lacks them ({clip(str(e))})"
        if problem:
            return [((), problem)]
        if not self.fp8_exclude:
            return []
        layers = config.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            return [(("fp8_exclude",), f"naming layers needs the model's num_hidden_layers; this config has "
                                       f"{clip(repr(layers))}")]
        return [(("fp8_exclude", j), why) for j, why in fp8_kept(self.fp8_exclude, layers, products)[1]]
