"""How long `smelter validate` takes, and how much memory and output it uses, on hostile files.

Each case runs the real command line in a fresh process several times; prints the median and the
range of wall time, the process's peak memory (VmHWM) and the bytes it printed.

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
CHILD = ("import re, sys\n"
         "from flows.cli import main\n"
         "code = main(sys.argv[1:])\n"
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


def measure(argv: list[str]) -> tuple[float, int, int, int]:
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=600, env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                                             "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    seconds = time.perf_counter() - started
    peak = re.search(r"vmhwm_kb=(\d+)", child.stderr)
    printed = len(child.stdout) + len(child.stderr) - (len(peak.group(0)) + 1 if peak else 0)
    return seconds, int(peak.group(1)) if peak else -1, printed, child.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'case':<20} {'exit':>4} {'median s':>9} {'min-max s':>13} {'peak MiB':>9} {'printed B':>10}")
        for name, argv in cases(Path(tmp)).items():
            runs = [measure(argv) for _ in range(args.repeats)]
            seconds = [r[0] for r in runs]
            print(f"{name:<20} {runs[0][3]:>4} {statistics.median(seconds):>9.2f} "
                  f"{min(seconds):>6.2f}-{max(seconds):<6.2f} {max(r[1] for r in runs) / 1024:>9.0f} "
                  f"{max(r[2] for r in runs):>10}")


if __name__ == "__main__":
    main()
