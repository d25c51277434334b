"""Cold `smelter run` vs warm re-runs with nothing changed, each a whole CLI process, hash verification on.

Each cold run uses a fresh artifact store and MLflow store in a temp dir; the warm re-runs follow
it on the same stores. The figures include Prefect's temporary server start and MLflow logging,
as a user sees them. Then the verification itself is timed in this process over every output the
runs published: with the hash cache a warm run has (what it pays for trusting its cache) and with
no hash cache at all (every file re-read: what the first run after losing the cache pays).
Usage: python benchmarks/warm_rerun.py [--pipeline NAME]... [--cold N] [--warm N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.runtime import store as store_module  # noqa: E402
from tasks.runtime.store import HASH_CACHE, MANIFEST, ArtifactStore  # noqa: E402


def timed_run(args: list[str], env: dict[str, str], cwd: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", *args], cwd=cwd, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"smelter run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return seconds


def verify_all(root: Path) -> tuple[float, int, int]:
    """Seconds to verify every published output under root with a fresh store object; outputs and bytes checked."""
    store_module._known.clear()  # what this process hashed before: each figure is one run's first check
    store = ArtifactStore(root)
    entries = [m.parent for m in root.glob(f"*/*/*/{MANIFEST}") if "_corrupt" not in m.parts]
    start = time.perf_counter()
    for entry in entries:
        pipeline, stage, key = entry.relative_to(root).parts
        result, problem = store.check(pipeline, stage, key, repair=False)
        assert result is not None, problem
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for entry in entries for p in entry.rglob("*") if p.is_file())
    return seconds, len(entries), size


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:7.2f} s (one run)"
    return (f"{statistics.median(values):7.2f} s median, {min(values):.2f}-{max(values):.2f} s range, "
            f"n={len(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pipeline", action="append", default=[])
    parser.add_argument("--cold", type=int, default=2, help="cold runs, each on fresh stores")
    parser.add_argument("--warm", type=int, default=3, help="warm re-runs after each cold run")
    parser.add_argument("--verify-repeats", type=int, default=5)
    args = parser.parse_args()
    cold, warm, ratios, cached_verify, uncached_verify = [], [], [], [], []
    for _ in range(args.cold):
        with tempfile.TemporaryDirectory(prefix="smelter-bench-") as tmp:
            env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
                                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO)}
            artifacts = Path(tmp) / "artifacts"
            run_args = ["-f", str(REPO / "pipelines.yaml"), "--artifacts", str(artifacts)]
            run_args += [f"--pipeline={p}" for p in args.pipeline]
            cold.append(timed_run(run_args, env, tmp))
            these = [timed_run(run_args, env, tmp) for _ in range(args.warm)]
            warm += these
            ratios += [w / cold[-1] for w in these]
            for _ in range(args.verify_repeats):
                seconds, entries, size = verify_all(artifacts)
                cached_verify.append(seconds)
            for _ in range(args.verify_repeats):
                shutil.copy(artifacts / HASH_CACHE, Path(tmp) / "hash-cache")
                (artifacts / HASH_CACHE).unlink()
                seconds, entries, size = verify_all(artifacts)
                uncached_verify.append(seconds)
                shutil.copy(Path(tmp) / "hash-cache", artifacts / HASH_CACHE)
    print(f"cold run                   {spread(cold)}")
    print(f"warm re-run                {spread(warm)}")
    print(f"warm/cold                  {statistics.median(ratios):7.1%} median, "
          f"{min(ratios):.1%}-{max(ratios):.1%} range   (goal <= 15%)")
    print(f"verification, hash cache   {spread(cached_verify)}  ({entries} outputs, {size / 1e6:.0f} MB)")
    print(f"verification, no cache     {spread(uncached_verify)}")
    print(f"verification share of warm {statistics.median(cached_verify) / statistics.median(warm):7.1%} "
          f"(no cache: {statistics.median(uncached_verify) / statistics.median(warm):.1%})")


if __name__ == "__main__":
    main()
