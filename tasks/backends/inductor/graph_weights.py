"""One copy of the weights for all of an engine's exported graphs.

A decoder engine holds two graphs over the same weights (prefill and decode step). Exported with
their weights inside, each `.pt2` carried all of them, and loading an engine read and deserialized
them twice (on the H200, loading a Llama-3.2-1B engine took 22 s; 11.5 s with one copy). Here the
graphs are exported with their
weights as their first input, and the weights are stored once, in one safetensors file:
- a tensor two graphs hold with equal values (or one graph under two names, as tied embeddings)
  is stored once;
- a graph's tensor that differs from the one stored under its name (fp8 prefill weights beside
  the decode step's bf16 ones) is stored under `<graph>/<name>`;
- the file's metadata maps each graph's names to the stored tensors.

At load, `Bound` gives each graph its weights as buffers at fixed addresses, which CUDA-graph
replay needs and which the graphs share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

INDEX_KEY = "smelter.graph_weights"


def weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by name, each once (tied ones under their first name):
    what `functional_call` needs to run the module on other values."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class WeightsAsInput(nn.Module):
    """`graph` run on weights given as its first input, so an export of this holds no weights."""

    def __init__(self, graph: nn.Module):
        super().__init__()
        self.__dict__["graph"] = graph  # not a submodule: its tensors are inputs, not this module's own

    def forward(self, weights: dict[str, torch.Tensor], *inputs: Any) -> Any:
        return torch.func.functional_call(self.graph, weights, inputs)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def save(graphs: dict[str, dict[str, torch.Tensor]], path: Path) -> dict[str, int]:
    """Write the weights of every graph to `path`, each distinct tensor once; return the counts."""
    from safetensors.torch import save_file

    stored: dict[str, torch.Tensor] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    by_name: dict[str, str] = {}  # the key a name was first stored under, by any graph
    storages: set[int] = set()
    index: dict[str, dict[str, str]] = {}
    for graph, weights in graphs.items():
        index[graph] = {}
        for name, tensor in weights.items():
            tensor = tensor.detach()
            view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tensor.stride(), tensor.dtype)
            key = by_view.get(view)
            if key is None and name in by_name and _same(stored[by_name[name]], tensor):
                key = by_name[name]
            if key is None:
                key = name if name not in stored else f"{graph}/{name}"
                # safetensors refuses tensors that share memory: a view of stored memory gets its own copy
                storage = tensor.untyped_storage().data_ptr()
                stored[key] = tensor.contiguous().clone() if storage in storages else tensor.contiguous()
                storages.add(storage)
            by_view[view] = key
            by_name.setdefault(name, key)
            index[graph][name] = key
    save_file(stored, str(path), metadata={INDEX_KEY: json.dumps(index)})
    os.chmod(path, 0o666 & ~_umask())  # safetensors creates it 0600; the engine's other files follow the umask
    return {"tensors_stored": len(stored), "names": sum(len(names) for names in index.values()),
            "bytes": sum(t.numel() * t.element_size() for t in stored.values())}


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


class WeightsFile:
    """An engine's weights file, read one graph at a time (a runner that only prefills never reads
    the decode step's weights); a tensor graphs share is read once and is one tensor."""

    def __init__(self, path: Path, device: str):
        from safetensors import safe_open

        self.path, self.device = path, device
        with safe_open(str(path), framework="pt", device=device) as f:
            raw = (f.metadata() or {}).get(INDEX_KEY)
        if raw is None:
            raise ValueError(f"{path}: no {INDEX_KEY} in its metadata: not an engine's graph weights")
        self.index: dict[str, dict[str, str]] = json.loads(raw)
        self._read: dict[str, torch.Tensor] = {}

    def graph(self, name: str) -> dict[str, torch.Tensor]:
        """Graph `name`'s weights by name."""
        from safetensors import safe_open

        names = self.index[name]
        missing = sorted({key for key in names.values() if key not in self._read})
        if missing:
            with safe_open(str(self.path), framework="pt", device=self.device) as f:
                self._read.update({key: f.get_tensor(key) for key in missing})
        return {weight: self._read[key] for weight, key in names.items()}


class Bound(nn.Module):
    """An exported graph whose weights are its first input, bound to weights held here as buffers.

    The buffers are marked static: torch.compile then reads them in place, and CUDA-graph replay
    needs no copy of them."""

    def __init__(self, graph: nn.Module, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.graph = graph
        self.names = list(weights)
        for i, tensor in enumerate(weights.values()):
            self.register_buffer(f"w{i}", tensor, persistent=False)
            torch._dynamo.mark_static_address(tensor)

    def forward(self, *inputs: Any) -> Any:
        return self.graph({name: getattr(self, f"w{i}") for i, name in enumerate(self.names)}, *inputs)
