"""How long `smelter validate` takes, and how much memory and output it uses, on hostile files.

Each case runs the real command line in a fresh process several times; prints the median and the
range of the process's wall time and of the check itself (`main()` once smelter's modules are
imported), the process's peak memory (VmHWM) and the bytes it printed.

    python benchmarks/hostile_inputs.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = ("import re, sys, time\n"
         "import tasks.config.spec\n"
         "from flows.cli import main\n"
         "started = time.perf_counter()\n"
         "code = main(sys.argv[1:])\n"
         "print(f'check_s={time.perf_counter() - started}', file=sys.stderr)\n"
         "peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
         "print(f'vmhwm_kb={peak}', file=sys.stderr)\n"
         "sys.exit(code)\n")


def alias_bomb(levels: int = 8, width: int = 9) -> str:
    """The classic billion-laughs document: `width`**`levels` values from about 1.4 KB of YAML."""
    lines = ["pipelines:", f"  a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def cases(workdir: Path) -> dict[str, list[str]]:
    files = {
        "alias-bomb": alias_bomb(),
        "256KiB-flat-list": "a: [" + ", ".join(["1"] * 87_000) + "]\n",
        "deep-nesting": "a: " + "[" * 100_000 + "]" * 100_000 + "\n",
    }
    found = {}
    for name, text in files.items():
        path = workdir / f"{name}.yaml"
        path.write_text(text[:256 << 10])
        found[name] = ["validate", "-f", str(path)]
    found["example-minilm"] = ["validate", "-f", str(REPO / "pipelines.yaml"), "--pipeline", "minilm"]
    return found


def measure(argv: list[str]) -> dict[str, float]:
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=600, env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                                             "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    seconds = time.perf_counter() - started
    facts = dict(re.findall(r"^(check_s|vmhwm_kb)=([0-9.]+)$", child.stderr, re.MULTILINE))
    printed = len(child.stdout) + len(re.sub(r"^(check_s|vmhwm_kb)=.*\n", "", child.stderr, flags=re.MULTILINE))
    return {"process_s": seconds, "check_s": float(facts["check_s"]), "peak_mib": int(facts["vmhwm_kb"]) / 1024,
            "printed": printed, "exit": child.returncode}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'case':<18} {'exit':>4}  {'process s, median (range)':<26} {'check s, median (range)':<24} "
              f"{'peak MiB':>8} {'printed B':>9}")
        for name, argv in cases(Path(tmp)).items():
            runs = [measure(argv) for _ in range(args.repeats)]
            print(f"{name:<18} {runs[0]['exit']:>4}  {_spread([r['process_s'] for r in runs]):<26} "
                  f"{_spread([r['check_s'] for r in runs]):<24} {max(r['peak_mib'] for r in runs):>8.0f} "
                  f"{max(r['printed'] for r in runs):>9}")

if __name__ == "__main__":
    main()
