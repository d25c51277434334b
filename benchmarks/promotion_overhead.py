"""What promotion's safety costs per registered engine: the pre-registration check and the promotion lock.

  bytes:        reading every byte of each engine file and hashing it (no cache: what the check and the
                upload digest cost since rot under unchanged file stamps must be caught);
  check:        that, compared with the build manifest, + load + one run at the min point
                (tasks/stages/engine_check.py), on each build of a pipeline in the artifact store;
  file lock:    acquiring and releasing the host's promotion lock alone;
  prefect lock: the same with the Prefect global concurrency limit (a temporary Prefect server that
                this script starts, as `smelter run` does).
Each is repeated (default 20 times) and printed as median [p10, p90] milliseconds.
Usage: python benchmarks/promotion_overhead.py [-f pipelines.yaml] [--pipeline tiny-llama] [--artifacts artifacts]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from tasks.config.spec import load
from tasks.runtime import locks
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages import engine_check


def spread(label: str, call: Callable[[], object], repeats: int) -> None:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    deciles = statistics.quantiles(samples, n=10)
    print(f"{label:<48} {statistics.median(samples):9.2f} ms  [p10 {deciles[0]:.2f}, p90 {deciles[-1]:.2f}]"
          f"  n={repeats}")


def builds(store: ArtifactStore, pipeline: str) -> list[StageResult]:
    found = []
    for manifest in sorted((store.root / pipeline / "build").glob("*/manifest.json")):
        data = json.loads(manifest.read_text())
        found.append(StageResult(pipeline, "build", manifest.parent.name, manifest.parent, data, cached=True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--pipeline", default="tiny-llama")
    parser.add_argument("--artifacts", default="artifacts")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    spec = load(args.file, pipelines=[args.pipeline]).pipelines[args.pipeline]
    store = ArtifactStore(args.artifacts)
    export = next(iter(sorted((store.root / args.pipeline / "export").glob("*/manifest.json"))), None)
    stages = {"export": StageResult(args.pipeline, "export", export.parent.name, export.parent,
                                    json.loads(export.read_text()), cached=True)} if export else {}
    found = builds(store, args.pipeline)
    if not found:
        print(f"no builds of {args.pipeline} under {store.root}: run `smelter run --pipeline {args.pipeline}` first")
    for build in found:
        size = sum(meta["bytes"] for meta in build.manifest["files"].values())
        name = f"{build.outputs.get('precision')}/{build.outputs.get('target')} ({size / 1e6:.1f} MB)"
        spread(f"bytes {name}", lambda: engine_check.read_digests(build), args.repeats)
        spread(f"check {name}", lambda: engine_check.check_before_registering(
            spec.targets, spec.profiles, stages | {"build": build}, None), args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[locks.LOCK_DIR_ENV] = tmp
        spread("file lock acquire+release", lambda: _hold(locks.exclusive("promote bench", "bench")), args.repeats)
        from flows.prefect_server import owned_server

        with owned_server() as server, server.serving():
            _hold(locks.exclusive("promote bench", "bench"))  # creates the limit
            spread("file lock + Prefect limit acquire+release", lambda: _hold(locks.exclusive("promote bench", "bench")),
                   args.repeats)


def _hold(lock) -> None:
    with lock:
        pass


if __name__ == "__main__":
    main()
