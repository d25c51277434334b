"""tiny-llama's int8 on a CPU without VNNI, tried on any x86 machine: its int8 stages run under qemu-user's emulated
Haswell (AVX2 and FMA; no AVX-512, no VNNI), whose CPUID ONNX Runtime's kernels dispatch on. There its u8s8
products are VPMADDUBSW, which adds each pair of 8-bit products in 16 bits, saturating, as a real AVX2 CPU does.

smelter reads the CPU's flags from /proc/cpuinfo, which qemu-user passes through from the host, so each run is
given the flags of the CPU it emulates: `haswell` (what smelter sees on such a CPU: it chooses 7-bit weights) or
`claims-vnni` (the same CPU said to have VNNI: 8-bit weights, the format smelter used on every CPU before it chose
by ISA). Each run: `smelter run --pipeline tiny-llama --precision int8` on new stores with the export copied from
`--artifacts`; prints the int8 format the precision stage wrote and the accuracy stage's top-1 agreement.

Needs qemu-user (Debian: apt-get install qemu-user) and a store where tiny-llama was exported (`make run`).
Slow: 10-15 minutes a run on 2 cores; the runs go in parallel. Its benchmark figures are the emulator's: ignore them.
Usage: python benchmarks/emulated_cpu.py [--as haswell --as claims-vnni] [--artifacts artifacts] [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QEMU_CPU = "Haswell-noTSX"
HASWELL_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
                 "syscall nx lm pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
                 "lahf_lm abm bmi1 avx2 bmi2 erms")
FLAGS = {"haswell": HASWELL_FLAGS, "claims-vnni": HASWELL_FLAGS + " avx512_vnni"}
PIPELINE = "tiny-llama"


def inside(cpuinfo: str, argv: list[str]) -> int:
    """In the emulated process: smelter reads `cpuinfo` for the CPU's flags, then runs the command."""
    from tasks.backends.onnxruntime import backend

    backend.cpu_isa.__defaults__ = (Path(cpuinfo),)
    from flows.cli import main

    return main(argv)


def start(variant: str, artifacts: Path) -> tuple[subprocess.Popen, Path]:
    root = Path(tempfile.mkdtemp(prefix=f"emulated-{variant}-"))
    for stage in ("export", "validate"):
        shutil.copytree(artifacts / PIPELINE / stage, root / "artifacts" / PIPELINE / stage)
    cpuinfo = root / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: qemu {QEMU_CPU}\nflags\t\t: {FLAGS[variant]}\n\n")
    (root / "tmp").mkdir()
    # A TMPDIR of its own: qemu-user's emulated /proc/self/stat gives a start time a tick off the kernel's, so
    # another smelter process would take this one's scratch dir for a dead run's and remove it
    env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "TMPDIR": str(root / "tmp"),
                        "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(["qemu-x86_64", "-cpu", QEMU_CPU, sys.executable, __file__, "--inside", str(cpuinfo),
                            "run", "-q", "--pipeline", PIPELINE, "--precision", "int8", "--artifacts",
                            str(root / "artifacts")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    return run, root


def outputs(root: Path, stage: str) -> dict:
    (manifest,) = glob.glob(str(root / "artifacts" / PIPELINE / stage / "*" / "manifest.json"))
    return json.loads(Path(manifest).read_text())["outputs"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--as", dest="variants", action="append", choices=sorted(FLAGS), default=[])
    parser.add_argument("--artifacts", default=str(REPO / "artifacts"), help="a store where tiny-llama was exported")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if shutil.which("qemu-x86_64") is None:
        print("qemu-x86_64 not found: install qemu-user", file=sys.stderr)
        return 2
    runs = {variant: start(variant, Path(args.artifacts)) for variant in args.variants or ["haswell", "claims-vnni"]}
    results = {}
    for variant, (run, root) in runs.items():
        run.wait()
        precision, accuracy = outputs(root, "precision"), outputs(root, "accuracy")
        results[variant] = {"exit": run.returncode, "cpu_int8_products": precision["cpu_int8_products"],
                            "cpu_weight_bits": precision["cpu_weight_bits"],
                            "top1_agreement": accuracy["metrics"]["top1_agreement"],
                            "samples": accuracy["samples"]}
        print(f"{variant:<12} products {precision['cpu_int8_products']:<10} weights {precision['cpu_weight_bits']} bits"
              f"  top-1 agreement {accuracy['metrics']['top1_agreement']:.4f}  (exit {run.returncode}; {root})")
    if args.json:
        Path(args.json).write_text(json.dumps({"qemu_cpu": QEMU_CPU, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(inside(sys.argv[2], sys.argv[3:]) if sys.argv[1:2] == ["--inside"] else main())
