"""Do decisions hold when nothing changed and the machine is busy? Three `smelter run`, whole CLI processes.

Runs every pipeline of pipelines.yaml three times on a fresh artifact store and MLflow store, with a
signed webhook to a receiver on loopback; the 2nd and 3rd runs compete with busy processes (one per
core, spinning). Prints, per run, each candidate's status and version and the reason, then the
changes of status or version, the alias moves and the events received after the first run (all
expected 0). With --force the 2nd and 3rd runs also rebuild and re-measure everything under load.
Usage: python benchmarks/decision_stability.py [--pipeline NAME]... [--force]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SECRET_ENV = "SMELTER_BENCH_WEBHOOK_SECRET"


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


class Receiver:
    """Counts the signed events it is sent, on a free loopback port."""

    def __init__(self) -> None:
        events = self.events = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                events.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0")))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/engines"


def _aliases(tracking_uri: str, names: list[str]) -> dict[str, str | None]:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client, found = MlflowClient(tracking_uri), {}
    for name in names:
        try:
            found[name] = client.get_model_version_by_alias(name, "champion").version
        except MlflowException:
            found[name] = None
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", action="append", default=[])
    parser.add_argument("--force", action="store_true", help="rebuild and re-measure in the 2nd and 3rd runs")
    args = parser.parse_args()
    receiver = Receiver()
    document = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    document.setdefault("defaults", {}).setdefault("promotion", {})["webhooks"] = [
        {"url": receiver.url, "secret_env": SECRET_ENV, "retries": 1, "timeout_s": 5}]
    pipelines_file = REPO / f".stability-{os.getpid()}.yaml"  # beside the original: its relative paths still resolve
    pipelines_file.write_text(yaml.safe_dump(document, sort_keys=False))
    names = [f"{p}-{t['name']}" for p, body in document["pipelines"].items() if not args.pipeline or p in args.pipeline
             for t in body["targets"]]
    try:
        with tempfile.TemporaryDirectory(prefix="smelter-stability-") as tmp:
            uri = f"sqlite:///{tmp}/mlflow.db"
            env = os.environ | {"MLFLOW_TRACKING_URI": uri, SECRET_ENV: secrets.token_hex(16),
                                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            command = [sys.executable, "-m", "flows.cli", "run", "--json", "-f", str(pipelines_file),
                       "--artifacts", f"{tmp}/artifacts", *[f"--pipeline={p}" for p in args.pipeline]]
            runs = []
            for index in range(3):
                busy = index > 0
                stop = multiprocessing.Event()
                spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                            for _ in range(os.cpu_count() or 1)] if busy else []
                for process in spinners:
                    process.start()
                started = time.perf_counter()
                done = subprocess.run(command + (["--force"] if busy and args.force else []), cwd=REPO, env=env,
                                      capture_output=True, text=True)
                seconds = time.perf_counter() - started
                stop.set()
                for process in spinners:
                    process.join()
                if done.returncode not in (0, 1):
                    sys.exit(f"run {index + 1} failed ({done.returncode}):\n{done.stderr[-4000:]}")
                summary = {c["candidate"]: c for c in json.loads(done.stdout)["candidates"]}
                runs.append({"summary": summary, "aliases": _aliases(uri, names), "events": len(receiver.events)})
                print(f"run {index + 1} ({'busy' if busy else 'quiet'}{', forced' if busy and args.force else ''}, "
                      f"{seconds:.0f} s):")
                for name, c in summary.items():
                    contended = c["stages"].get("benchmark", {}).get("contended")
                    print(f"  {name:<28} {c['status']:<9} v{c['model_version'] or '-':<3} "
                          f"{'(benchmark contended) ' if contended else ''}{(c['decision'] or {}).get('reason', '')}")
    finally:
        pipelines_file.unlink(missing_ok=True)
        receiver.server.shutdown()
    first = runs[0]
    changes = sum((later["summary"][n]["status"], later["summary"][n]["model_version"]) !=
                  (runs[i]["summary"][n]["status"], runs[i]["summary"][n]["model_version"])
                  for i, later in enumerate(runs[1:], start=1) for n in later["summary"] if i > 1)
    moves = sum(later["aliases"] != runs[i - 1]["aliases"] for i, later in enumerate(runs) if i)
    print(f"\nchanges of status or version between runs 2 and 3: {changes}")
    print(f"versions changed after run 1: "
          f"{sum(r['summary'][n]['model_version'] != first['summary'][n]['model_version'] for r in runs[1:] for n in first['summary'])}")
    print(f"alias moves after run 1: {moves}   (aliases {first['aliases']})")
    print(f"events after run 1: {runs[-1]['events'] - first['events']}   (run 1 sent {first['events']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
