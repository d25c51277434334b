"""The UI screenshots in docs/images/, taken from the example pipelines' own results, not by hand.

After `make run` (which leaves the runs in `mlflow.db` and `mlruns/` beside pipelines.yaml and the Prefect
runs in Prefect's home), one command serves both stores on loopback (a real `mlflow server`, a real
`prefect server`) and photographs the pages a user opens, with headless Chromium (Debian's `chromium`):

    .venv/bin/python scripts/screenshots.py      # writes docs/images/*.png and docs/images/machine.txt

machine.txt names the machine the runs were measured on (the figures in the pictures are its own).
tests/test_ui_chromium.py reads the same pages through `page_dom` and `page_text`.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINING_VIEW = "workflowType=machine_learning"  # the UI's Model training view (tasks/registry/runs.py says why)
OUTCOME_VIEW = "smelter-outcome"  # the saved runs-table view every pipeline run writes (tasks/registry/runs.py)
PAGE_BUDGET_MS = 20000  # virtual time Chromium gives the single-page app to fetch and render


def chromium() -> str | None:
    """Chromium's executable, or None when it is not installed."""
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)


def _chromium_args(url: str, *extra: str) -> list[str]:
    browser = chromium()
    if browser is None:
        raise RuntimeError("Chromium is not installed (Debian: apt-get install chromium)")
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            f"--virtual-time-budget={PAGE_BUDGET_MS}", "--window-size=1440,1000", *extra, url]


def page_dom(url: str, showing: str | None = None, tries: int = 3) -> str:
    """The page's DOM after its scripts ran; with `showing` (a regular expression), read again in a new
    Chromium, up to `tries` times, until the DOM has it: the run page renders an artifact's preview after
    its own fetch, which a busy machine can leave unfinished when the page is dumped."""
    for _ in range(tries if showing else 1):
        dom = subprocess.run(_chromium_args(url, "--dump-dom"), capture_output=True, text=True, timeout=180,
                             check=True).stdout
        if showing is None or re.search(showing, dom):
            break
    return dom


def page_text(dom: str) -> str:
    """What a reader sees of a DOM: its text, scripts and styles left out, whitespace collapsed."""
    dom = re.sub(r"<(script|style|svg)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).strip()


def screenshot(url: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(_chromium_args(url, f"--screenshot={path}"), capture_output=True, timeout=180, check=True)
    return path


def experiment_url(server: str, experiment_id: str) -> str:
    return f"{server}/#/experiments/{experiment_id}?{TRAINING_VIEW}"


def outcome_view_url(server: str, experiment_id: str) -> str:
    """The runs table in the saved view "smelter: outcome": status, speed and reason as columns."""
    return f"{server}/#/experiments/{experiment_id}/runs?viewStateShareKey={OUTCOME_VIEW}&{TRAINING_VIEW}"


def run_url(server: str, experiment_id: str, run_id: str, tab: str = "") -> str:
    return f"{server}/#/experiments/{experiment_id}/runs/{run_id}{tab}?{TRAINING_VIEW}"


def version_url(server: str, name: str, version: str) -> str:
    return f"{server}/#/models/{name}/versions/{version}"


def flow_run_url(prefect_ui: str, flow_run_id: str) -> str:
    return f"{prefect_ui}/runs/flow-run/{flow_run_id}"


def task_run_url(prefect_ui: str, task_run_id: str) -> str:
    return f"{prefect_ui}/runs/task-run/{task_run_id}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(command: list[str], health: str, log_path: Path, env: dict[str, str], what: str) -> subprocess.Popen:
    """Start a server in its own process group and wait until `health` answers."""
    import httpx

    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(health, timeout=2).status_code == 200:
                return server
        if server.poll() is not None or time.monotonic() > deadline:
            server.terminate()
            raise RuntimeError(f"{what} did not start; see {log_path}")
        time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


@contextlib.contextmanager
def mlflow_server(store: str, artifacts: Path, log_dir: Path) -> Iterator[str]:
    """A real `mlflow server` on loopback over `store` (a SQL store URI)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = _serve([str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", store,
                     "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
                     "--workers", "1"], f"{url}/health", log_dir / "mlflow-server.log", env, "mlflow server")
    try:
        yield url
    finally:
        _stop(server)


@contextlib.contextmanager
def prefect_server(home: Path | None, log_dir: Path, database: str | None = None) -> Iterator[str]:
    """A real `prefect server` on loopback showing the runs in `home`'s database (PREFECT_HOME; None: Prefect's
    default, where a run without PREFECT_API_URL keeps its flow runs), or in `database` (a connection URL: another
    server's, which this one only reads: no services). Yields the UI's address; the API is under /api."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": f"{url}/api"}
    env.pop("PREFECT_API_URL", None)
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    if database is not None:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database
    server = _serve([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                     "--port", str(port), "--no-services"], f"{url}/api/health", log_dir / "prefect-server.log",
                    env, "prefect server")
    try:
        yield url
    finally:
        _stop(server)


def machine() -> str:
    """The machine the runs were measured on, in one line: CPU model, cores, the vector units int8 speed rests
    on (AVX2, AVX-512 VNNI), OS."""
    model, units = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.M)
        model = found.group(1).strip() if found else model
        listed = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, flags=re.M)
        flags = set(listed.group(1).split()) if listed else set()
        units = ", ".join(name for flag, name in (("avx2", "AVX2"), ("avx512_vnni", "AVX-512 VNNI")) if flag in flags)
    return (f"{model}, {os.cpu_count()} logical cores" + (f", {units}" if units else "")
            + f", {platform.system()} {platform.machine()}")


def _latest_flow_run(api: str, pipeline: str) -> tuple[str, str]:
    """(id, name) of the newest `smelter-pipeline` flow run of `pipeline` (named `<pipeline>: <counts>`)."""
    import httpx

    body = {"sort": "EXPECTED_START_TIME_DESC", "limit": 50,
            "flow_runs": {"name": {"like_": pipeline}}}
    runs = httpx.post(f"{api}/flow_runs/filter", json=body, timeout=30).json()
    found = [r for r in runs if r["name"].split(": ")[0] == pipeline]
    if not found:
        raise RuntimeError(f"no Prefect flow run of pipeline {pipeline}: run `make run` first")
    return found[0]["id"], found[0]["name"]


def take(pipelines: Path, out: Path, prefect_home: Path | None) -> list[Path]:
    """Photograph the example pipelines' last run: for each pipeline its runs in the outcome view, its parent run
    (the decision table) and summary figure; a rejected candidate's run (else the champion's), the champion's
    registry version; the Prefect flow run of the pipeline with the most rejections."""
    from mlflow import MlflowClient

    store = pipelines.parent / "mlflow.db"
    if not store.is_file():
        raise RuntimeError(f"{store} does not exist: run `make run` first")
    shots: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="smelter-screenshots-") as tmp, \
            mlflow_server(f"sqlite:///{store}", pipelines.parent / "mlruns", Path(tmp)) as server, \
            prefect_server(prefect_home, Path(tmp)) as prefect_ui:
        client = MlflowClient(server)
        most_rejected, worst = None, -1
        for experiment in client.search_experiments(filter_string="name LIKE 'smelter/%'"):
            pipeline = experiment.name.removeprefix("smelter/")
            runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
            parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
            if not parents:
                continue
            parent = parents[0]
            children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
            rejected = [r for r in children if r.data.tags.get("status") == "rejected"]
            if len(rejected) > worst:
                most_rejected, worst = pipeline, len(rejected)
            eid = experiment.experiment_id
            shots.append(screenshot(outcome_view_url(server, eid), out / f"mlflow-runs-{pipeline}.png"))
            parent_url = run_url(server, eid, parent.info.run_id)
            shots.append(screenshot(parent_url, out / f"mlflow-parent-run-{pipeline}.png"))
            shots.append(screenshot(run_url(server, eid, parent.info.run_id, "/artifacts/summary.png"),
                                    out / f"mlflow-summary-figure-{pipeline}.png"))
            shown = (rejected or [r for r in children if r.data.tags.get("status") == "promoted"] or children)[:1]
            for child in shown:
                shots.append(screenshot(run_url(server, eid, child.info.run_id),
                                        out / f"mlflow-child-run-{pipeline}.png"))
            for model in client.search_registered_models(filter_string=f"name LIKE '{pipeline}-%'"):
                champion = next(iter(model.aliases.values()), None) if model.aliases else None
                if champion:
                    shots.append(screenshot(version_url(server, model.name, str(champion)),
                                            out / f"mlflow-model-version-{model.name}.png"))
        if most_rejected is not None:
            flow_run_id, _ = _latest_flow_run(f"{prefect_ui}/api", most_rejected)
            shots.append(screenshot(flow_run_url(prefect_ui, flow_run_id), out / "prefect-flow-run.png"))
    taken = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    (out / "machine.txt").write_text(f"Runs measured on: {machine()}\nScreenshots taken: {taken}\n")
    return shots


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--file", type=Path, default=REPO / "pipelines.yaml",
                        help="the pipelines file `make run` ran; its stores lie beside it (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="where the PNGs go")
    parser.add_argument("--prefect-home", type=Path,
                        help="PREFECT_HOME of the runs (default: $PREFECT_HOME, else Prefect's own default)")
    args = parser.parse_args()
    home = args.prefect_home or (Path(os.environ["PREFECT_HOME"]) if os.environ.get("PREFECT_HOME") else None)
    for path in take(args.file.resolve(), args.out, home):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    print(f"{args.out / 'machine.txt'}: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
