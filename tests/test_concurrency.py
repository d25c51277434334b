"""Two `smelter run` processes at once on a fresh MLflow store, several times over: both finish, the
registry holds one version per build key, and the promotion is announced once.

Each pair samples the race once; SMELTER_CONCURRENCY_PAIRS sets how many (4 in the suite, where every run of
CI samples them again; more to hunt a rare interleaving)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.fixtures.cli_runs import (MODEL, CliSetup, assert_artifacts_intact, assert_registry_sound, cli_setup,
                                     copy_artifacts, deliveries, fresh_store, start_run)

pytestmark = pytest.mark.slow
__all__ = ["cli_setup"]

PAIRS = int(os.environ.get("SMELTER_CONCURRENCY_PAIRS", "4"))


@pytest.mark.parametrize("pair", range(PAIRS))
def test_two_concurrent_runs_on_a_fresh_store_register_once_and_announce_once(
        pair: int, cli_setup: CliSetup, tmp_path: Path) -> None:
    receiver = cli_setup.receiver
    receiver.events.clear()
    store = fresh_store(tmp_path / "store")  # both runs open it first: MLflow's schema migration must run once
    artifacts = copy_artifacts(cli_setup, tmp_path / "artifacts")
    runs = [start_run(cli_setup, store, artifacts) for _ in range(2)]
    results = [(*run.communicate(timeout=600), run.returncode) for run in runs]
    for out, err, code in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"
    candidates = [json.loads(out)["candidates"][0] for out, _, _ in results]
    assert sorted(c["status"] for c in candidates) == ["passed", "promoted"], candidates
    assert len({c["model_version"] for c in candidates}) == 1

    champion = assert_registry_sound(store, tmp_path)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    assert [str(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")] == [champion]
    sent = deliveries(receiver)
    assert len(sent) == 1 and [e["version"] for e in receiver.events] == [champion], receiver.events
    assert_artifacts_intact(artifacts)
