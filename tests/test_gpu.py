"""GPU detection numbers GPUs as CUDA does, not as nvidia-smi lists them (no GPU needed)."""

from __future__ import annotations

from tasks.runtime.gpu import GpuInfo, apply_visible, cuda_order, parse_smi_rows

# nvidia-smi lists in PCI bus order: an A100 first, an H200 second.
SMI = ("0, GPU-aaaa1111, 00000000:17:00.0, NVIDIA A100-SXM4-80GB, 8.0, 580.159.04, 81920\n"
       "1, GPU-bbbb2222, 00000000:65:00.0, NVIDIA H200, 9.0, 580.159.04, 143771\n")


def test_smi_rows_are_parsed_with_uuid_bus_and_memory() -> None:
    a100, h200 = parse_smi_rows(SMI)
    assert (a100.name, a100.cc, a100.arch, a100.uuid) == ("NVIDIA A100-SXM4-80GB", "8.0", "sm80", "GPU-aaaa1111")
    assert h200.memory_bytes == 143771 * 2**20 and h200.pci_bus_id == "00000000:65:00.0"
    assert h200.facts() == {"compute_capability": "9.0", "arch": "sm90", "gpu_name": "NVIDIA H200",
                            "driver": "580.159.04"}


def test_cuda_numbers_fastest_first_unless_told_pci_order() -> None:
    gpus = parse_smi_rows(SMI)
    assert [g.arch for g in apply_visible(cuda_order(gpus, None), None)] == ["sm90", "sm80"]
    assert [g.arch for g in apply_visible(cuda_order(gpus, "PCI_BUS_ID"), None)] == ["sm80", "sm90"]


def test_visible_devices_index_cuda_order_and_renumber_from_zero() -> None:
    ordered = cuda_order(parse_smi_rows(SMI), None)
    only = apply_visible(ordered, "1")
    assert [(g.index, g.arch) for g in only] == [(0, "sm80")]
    swapped = apply_visible(ordered, "1,0")
    assert [(g.index, g.arch) for g in swapped] == [(0, "sm80"), (1, "sm90")]


def test_visible_devices_by_uuid_prefix_and_stop_at_the_first_invalid_entry() -> None:
    ordered = cuda_order(parse_smi_rows(SMI), "PCI_BUS_ID")
    assert [g.arch for g in apply_visible(ordered, "GPU-bbbb")] == ["sm90"]
    assert [g.arch for g in apply_visible(ordered, "0,7,1")] == ["sm80"]
    assert apply_visible(ordered, "-1") == [] and apply_visible(ordered, "") == []


def test_gpu_info_keeps_its_old_three_field_form() -> None:
    assert GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), "580.1").arch == "sm90"
