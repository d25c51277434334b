"""Cold `smelter run` vs a warm re-run with nothing changed, each a whole CLI process.

Both runs use a fresh artifact store and MLflow store in a temp dir (the first run is cold), so
the figures include Prefect's temporary server start and MLflow logging, as a user sees them.
Usage: python benchmarks/warm_rerun.py [--pipeline NAME]... (default: every pipeline)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_run(args: list[str], env: dict[str, str], cwd: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", *args], cwd=cwd, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"smelter run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pipeline", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smelter-bench-") as tmp:
        env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
                            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        run_args = ["-f", str(REPO / "pipelines.yaml"), "--artifacts", f"{tmp}/artifacts"]
        run_args += [f"--pipeline={p}" for p in args.pipeline]
        cold = timed_run(run_args, env, tmp)
        warm = timed_run(run_args, env, tmp)
    print(f"cold run   {cold:8.1f} s")
    print(f"warm rerun {warm:8.1f} s")
    print(f"warm/cold  {warm / cold:8.1%}   (goal <= 15%)")


if __name__ == "__main__":
    main()
