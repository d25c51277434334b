"""Time from `prefect deployment run` to a completed run on a two-pool fleet: cold, then with nothing changed.

On loopback, as a user's fleet on one host: a `prefect server` and an `mlflow server` (SQL store)
as processes, pools `cpu` and `gpu-test` made by `smelter deploy --pools`, one `prefect worker` on
each. The pipeline is the tiny Llama (models/tiny-llama, from `make setup`) at fp32 with two
ONNX Runtime targets, `cpu` (built by the parent run on the cpu worker) and `edge` on pool
`gpu-test` (fanned out to the other worker and joined through MLflow). The first run is cold
(fresh artifact store and servers); the next --warm runs change nothing. Every figure includes
each worker starting a flow-run process. Prints each run and the warm runs' median and range.
Usage: python benchmarks/fleet_roundtrip.py [--warm 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.fleet import Service, cli, project_env  # noqa: E402 - the tests' process helpers
from tests.fixtures.servers import free_port  # noqa: E402

SERVER_START_S = 300
PIPELINE = {
    "model": {"path": str(REPO / "models" / "tiny-llama"), "task": "text-generation"},
    "profiles": [{"batch": [1, 2, 4], "seq": [1, 16, 64]}],
    "precisions": ["fp32"],
    "targets": [{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                {"name": "edge", "backend": "onnxruntime", "threads": 1, "pool": "gpu-test"}],
    "calibration": {"data": "data/calibration.txt", "samples": 16, "seq_len": 32},
    "accuracy": {"data": "data/eval.txt", "samples": 8, "seq_len": 16, "gates": {"top1_agreement": {"min": 0.5}}},
    "benchmark": {"batch_sizes": [1, 4], "seq_lens": [16], "warmup": 1, "min_rounds": 3, "max_seconds": 2, "survey_seconds": 2,
                  "threads": 1},
    "performance": {"gates": {"p99_ms": {"max": 60000}}},
    "schedule": {"cron": "0 3 * * *", "timezone": "UTC"},
}


def wait_healthy(url: str, service: Service, what: str) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if not service.alive():
            sys.exit(f"{what} exited:\n{service.log()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{what} not healthy after {SERVER_START_S} s")


def timed_deployment_run(name: str, env: dict[str, str], cwd: Path) -> float:
    started = time.monotonic()
    done = subprocess.run([cli("prefect"), "deployment", "run", name, "--watch", "--watch-interval", "1"],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - started
    if done.returncode != 0 or "finished successfully" not in done.stdout:
        sys.exit(f"prefect deployment run {name} did not complete:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=3, help="runs with nothing changed after the cold one")
    args = parser.parse_args()
    if not (REPO / "models" / "tiny-llama").is_dir():
        sys.exit("models/tiny-llama is missing: run `make setup` (or scripts/make_tiny_llama.py) first")
    services: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="smelter-fleet-") as tmp:
        root = Path(tmp)
        project = root / "project"
        shutil.copytree(REPO / "data", project / "data")
        (project / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"fleet": PIPELINE}}, sort_keys=False))
        prefect_port, mlflow_port = free_port(), free_port()
        api, mlflow_uri = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        env = project_env(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=mlflow_uri, PREFECT_HOME=str(root / "home"),
                          PREFECT_WORKER_QUERY_SECONDS="1")
        try:
            server_env = env | {"PREFECT_UI_ENABLED": "false",
                                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}"}
            server_env.pop("PREFECT_API_URL")
            services.append(Service([cli("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                     str(prefect_port)], root / "prefect.log", server_env, root))
            services.append(Service([cli("mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                                     "--artifacts-destination", str(root / "mlartifacts"), "--host", "127.0.0.1",
                                     "--port", str(mlflow_port), "--workers", "1"], root / "mlflow.log",
                                    env | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, root))
            wait_healthy(f"{api}/health", services[0], "prefect server")
            wait_healthy(f"{mlflow_uri}/health", services[1], "mlflow server")
            subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--pools"], env=env, cwd=project,
                           check=True, capture_output=True, timeout=600)
            for pool in ("cpu", "gpu-test"):
                services.append(Service([cli("prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                         "--limit", "1"], root / f"worker-{pool}.log", env, project))
            cold = timed_deployment_run("smelter-pipeline/fleet", env, project)
            print(f"cold                 {cold:7.1f} s", flush=True)
            warm = []
            for i in range(args.warm):
                warm.append(timed_deployment_run("smelter-pipeline/fleet", env, project))
                print(f"nothing changed #{i + 1}   {warm[-1]:7.1f} s", flush=True)
        finally:
            for service in reversed(services):
                service.stop()
    if warm:
        print(f"nothing changed: median {statistics.median(warm):.1f} s, range {min(warm):.1f}-{max(warm):.1f} s "
              f"over {len(warm)} runs; cold {cold:.1f} s (one run)")


if __name__ == "__main__":
    main()
