"""CPU a process of smelter spends loading its libraries, with the cycle collector held off while they
load (tasks/runtime/collector.py) and with Python's default, alternated in one run.

1. A warm `smelter run` of one candidate (every stage cached: the gates, decide, promote and MLflow logging still run), a
   whole CLI process on a lasting Prefect server, so its CPU is the command's own: the command as shipped
   against the same command with `collector.hold` made a no-op.
2. The temporary Prefect server a run without PREFECT_API_URL starts: Prefect's own command (`uvicorn
   --factory prefect.server.api.server:create_app`, what Prefect runs for itself) against smelter's
   `python -m flows.temporary_server`; CPU until /health answers, then after a fixed load of API calls (a
   flow, 20 flow runs, 3 state changes each).

Usage: python benchmarks/process_start.py [--pipeline minilm] [--runs 6] [--servers 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.servers import free_port  # noqa: E402 - the tests' helper, as benchmarks/fleet_roundtrip.py
NOT_HELD = ("import sys; from tasks.runtime import collector; collector.hold = lambda: None; "
            "from flows.cli import entry; entry()")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):5.2f} CPU-s median, {min(values):.2f}-{max(values):.2f} range, "
            f"n={len(values)}")


def _server(command: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    import httpx

    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with httpx.Client(timeout=5) as client:
        while True:
            if process.poll() is not None:
                sys.exit(f"the server exited with {process.returncode}: {command}")
            try:
                if client.get(f"http://127.0.0.1:{port}/api/health").status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            time.sleep(0.05)


def _server_commands(port: int) -> dict[str, list[str]]:
    import prefect

    return {"Prefect's command": [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                                  "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                                  "--port", str(port), "--log-level", "error", "--lifespan", "on"],
            "flows.temporary_server": [sys.executable, "-m", "flows.temporary_server", str(port)]}


def _api_load(port: int) -> None:
    """A flow, 20 flow runs, 3 state changes each; a 503 (SQLite busy) is asked again, as Prefect's client does."""
    import httpx

    url = f"http://127.0.0.1:{port}/api"
    with httpx.Client(timeout=30) as client:
        def post(path: str, body: dict) -> dict:
            for _ in range(100):
                answer = client.post(url + path, json=body)
                if answer.status_code != 503:
                    answer.raise_for_status()
                    return answer.json()
                time.sleep(0.1)
            sys.exit(f"{path}: the server stayed busy")

        flow = post("/flows/", {"name": "process-start"})["id"]
        for i in range(20):
            run = post("/flow_runs/", {"flow_id": flow, "name": f"run-{i}"})["id"]
            for state in ("PENDING", "RUNNING", "COMPLETED"):
                post(f"/flow_runs/{run}/set_state", {"state": {"type": state}, "force": True})


def servers(rounds: int, env: dict[str, str]) -> None:
    env = env | {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    port = free_port()
    migrated = _server(_server_commands(port)["flows.temporary_server"], port, env)  # the database's first start
    migrated.terminate()
    migrated.wait()
    to_health: dict[str, list[float]] = {}
    with_load: dict[str, list[float]] = {}
    for index in range(rounds):
        names = list(_server_commands(0))
        for name in names if index % 2 == 0 else names[::-1]:
            port = free_port()
            process = _server(_server_commands(port)[name], port, env)
            to_health.setdefault(name, []).append(_process_cpu(process.pid))
            _api_load(port)
            time.sleep(1)
            with_load.setdefault(name, []).append(_process_cpu(process.pid))
            process.terminate()
            process.wait()
    for name in to_health:
        print(f"temporary server, {name:<24} to /health {_spread(to_health[name])}")
        print(f"{'':<42} with the load {_spread(with_load[name])}")
    base, held = (statistics.median(to_health[n]) for n in to_health)
    print(f"{'':<42} to /health: {held / base:.0%} of Prefect's command")


def warm_runs(pipeline: str, rounds: int, env: dict[str, str], tmp: Path) -> None:
    port = free_port()
    server = _server([sys.executable, "-m", "flows.temporary_server", str(port)], port,
                     env | {"PREFECT_UI_ENABLED": "0"})
    env = env | {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
    args = ["run", "-q", "-f", str(REPO / "pipelines.yaml"), "--artifacts", str(tmp / "artifacts"),
            "--pipeline", pipeline, "--precision", "fp32"]
    commands = {"collector held (shipped)": [sys.executable, "-m", "flows.cli", *args],
                "Python's default": [sys.executable, "-c", NOT_HELD, *args]}
    try:
        first = subprocess.run(commands["collector held (shipped)"], env=env, cwd=tmp, capture_output=True, text=True)
        if first.returncode not in (0, 1):
            sys.exit(f"the cold run failed ({first.returncode}):\n{first.stderr[-4000:]}")
        cpu: dict[str, list[float]] = {}
        for index in range(rounds):
            names = list(commands)
            for name in names if index % 2 == 0 else names[::-1]:
                before = _children_cpu()
                done = subprocess.run(commands[name], env=env, cwd=tmp, capture_output=True, text=True)
                if done.returncode not in (0, 1):
                    sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
                cpu.setdefault(name, []).append(_children_cpu() - before)
    finally:
        server.terminate()
        server.wait()
    for name, values in cpu.items():
        print(f"warm `smelter run --pipeline {pipeline} --precision fp32`, {name:<26} {_spread(values)}")
    held, default = (statistics.median(v) for v in cpu.values())
    print(f"{'':<42} held: {held / default:.0%} of the default's CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="minilm")
    parser.add_argument("--runs", type=int, default=6, help="warm runs of each kind, alternated")
    parser.add_argument("--servers", type=int, default=8, help="server starts of each kind, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smelter-process-start-") as tmp:
        env = os.environ | {"PREFECT_HOME": str(Path(tmp) / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                            "PYTHONPATH": str(REPO)}
        env.pop("PREFECT_API_URL", None)
        servers(args.servers, env)
        warm_runs(args.pipeline, args.runs, env, Path(tmp))


if __name__ == "__main__":
    main()
