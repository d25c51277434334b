"""Which NVIDIA GPUs a CUDA program here sees, in the order it sees them.

`nvidia-smi` lists GPUs in PCI bus order, but CUDA numbers them fastest first unless
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, and then keeps only those `CUDA_VISIBLE_DEVICES` names (indices
into that order or UUIDs, up to the first invalid entry). On a mixed machine the two numberings
disagree, and an engine would be keyed with the wrong GPU. With PyTorch's CUDA build present we ask
the CUDA runtime itself; otherwise we apply CUDA's rules to nvidia-smi's rows. No backend imports
this module's callers' runtimes: it imports torch only to ask it, and only if it is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

SMI_FIELDS = "index,uuid,pci.bus_id,name,compute_cap,driver_version,memory.total"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as a CUDA program sees it; `index` is its CUDA device number here."""

    name: str
    compute_capability: tuple[int, int]
    driver: str
    index: int = 0
    uuid: str = ""
    pci_bus_id: str = ""
    memory_bytes: int = 0

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def arch(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    def facts(self) -> dict[str, str]:
        """What an engine records about the GPU it was built on."""
        return {"compute_capability": self.cc, "arch": self.arch, "gpu_name": self.name, "driver": self.driver}


def parse_smi_rows(text: str) -> list[GpuInfo]:
    """Rows of `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`, in nvidia-smi's (PCI) order."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7:
            raise ValueError(f"unexpected nvidia-smi row {line!r}: expected {SMI_FIELDS}")
        index, uuid, bus, name, cc, driver, memory_mib = parts
        major, minor = cc.split(".")
        memory = int(float(memory_mib) * 2**20) if memory_mib.replace(".", "").isdigit() else 0
        gpus.append(GpuInfo(name, (int(major), int(minor)), driver, int(index), uuid, bus, memory))
    return gpus


def cuda_order(gpus: list[GpuInfo], device_order: str | None) -> list[GpuInfo]:
    """CUDA's enumeration: PCI order for `PCI_BUS_ID`, else fastest first.

    CUDA does not document its FASTEST_FIRST ranking; newer compute capability first, then PCI
    order, is what it does on the mixed machines we know of.
    """
    by_bus = sorted(gpus, key=lambda g: g.pci_bus_id.lower())
    if (device_order or "FASTEST_FIRST").upper() == "PCI_BUS_ID":
        return by_bus
    return sorted(by_bus, key=lambda g: g.compute_capability, reverse=True)


def apply_visible(ordered: list[GpuInfo], visible: str | None) -> list[GpuInfo]:
    """Keep what CUDA_VISIBLE_DEVICES names, in its order; CUDA stops at the first entry it cannot match."""
    if visible is None:
        chosen = list(ordered)
    else:
        chosen = []
        for entry in (e.strip() for e in visible.split(",")):
            match = None
            if entry.isdigit():
                match = ordered[int(entry)] if int(entry) < len(ordered) else None
            elif entry.startswith(("GPU-", "MIG-")):
                found = [g for g in ordered if g.uuid.startswith(entry)]
                match = found[0] if len(found) == 1 else None
            if match is None or match in chosen:
                break
            chosen.append(match)
    return [GpuInfo(g.name, g.compute_capability, g.driver, i, g.uuid, g.pci_bus_id, g.memory_bytes)
            for i, g in enumerate(chosen)]


def _smi_gpus() -> list[GpuInfo]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return parse_smi_rows(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def _torch_gpus(driver: str) -> list[GpuInfo] | None:
    """The CUDA runtime's own list through PyTorch, or None where PyTorch has no CUDA here."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", "") or "")
        gpus.append(GpuInfo(p.name, (p.major, p.minor), driver, i,
                            uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}",
                            "", int(p.total_memory)))
    return gpus


def detect_gpus() -> list[GpuInfo]:
    """The GPUs a CUDA program here would see, numbered as it numbers them (empty without any)."""
    smi = _smi_gpus()
    driver = smi[0].driver if smi else ""
    through_torch = _torch_gpus(driver)
    if through_torch is not None:
        return through_torch
    return apply_visible(cuda_order(smi, os.environ.get("CUDA_DEVICE_ORDER")),
                         os.environ.get("CUDA_VISIBLE_DEVICES"))


def detect_gpu() -> GpuInfo | None:
    """CUDA device 0 here, the one a program uses unless told otherwise, or None."""
    gpus = detect_gpus()
    return gpus[0] if gpus else None
