"""MLflow's registry webhooks as `smelter webhooks sync` plans and makes them, what a user reads when the
server refuses a URL, and checking MLflow's signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import yaml
from mlflow import MlflowClient

from tasks.config.spec import load
from tasks.judge.mlflow_webhooks import PREFIX, verify_signature, wanted
from tasks.judge.notify import sign
from tests.fixtures.cli_runs import REPO
from tests.fixtures.servers import _stop, start_mlflow_server


def test_one_mlflow_webhook_per_distinct_url_and_secret(pipeline_factory, tiny_bert_dir, monkeypatch):
    monkeypatch.setenv("HOOK_SECRET", "s")
    hook = {"url": "https://deploy.example/hooks/a?token=t0k3n", "secret_env": "HOOK_SECRET"}
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", promotion={"webhooks": [hook]})
    document = yaml.safe_load(path.read_text())
    document["pipelines"]["dec"] = document["pipelines"]["enc"]
    path.write_text(yaml.safe_dump(document))
    (found,) = wanted(load(path))
    assert sorted(found.pipelines) == ["dec", "enc"] and found.name.startswith(PREFIX)
    assert "t0k3n" not in found.name + found.description


def test_mlflow_signature_checks_body_secret_and_age():
    body = json.dumps({"entity": "model_version_alias", "action": "created", "data": {"alias": "champion"}}).encode()
    now = str(int(time.time()))
    headers = {"X-MLflow-Delivery-Id": "d1", "X-MLflow-Timestamp": now, "X-MLflow-Signature": sign("k", "d1", now, body)}
    assert verify_signature("k", headers, body)
    assert verify_signature("k", {k.lower(): v for k, v in headers.items()}, body)
    assert not verify_signature("other", headers, body)
    assert not verify_signature("k", headers, body + b" ")
    old = str(int(time.time()) - 3600)
    assert not verify_signature("k", headers | {"X-MLflow-Timestamp": old,
                                                "X-MLflow-Signature": sign("k", "d1", old, body)}, body)
    assert not verify_signature("k", headers | {"X-MLflow-Timestamp": "9" * 400}, body)
    assert not verify_signature("k", {"X-MLflow-Delivery-Id": "d1"}, body)


@pytest.fixture(scope="module")
def guarded_mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` with MLflow's default webhook guard: https only, public hosts only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_WEBHOOK_")}
    server, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow-guarded"), env)
    try:
        yield uri
    finally:
        _stop(server)


def smelter(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """The real CLI in its own process, as a user's shell runs it."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=os.environ | env)


@pytest.mark.parametrize(("url", "setting"), [
    ("http://deploy.example/hooks/a?token=t0k3n", "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https"),
    ("https://127.0.0.1:9/hooks/a?token=t0k3n", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true"),
    ("https://deploy.example/hooks/a?token=t0k3n", "expected a reachable host"),
], ids=["http", "private-ip", "unresolvable"])
def test_sync_of_a_url_the_server_refuses_is_one_line_naming_the_setting(
        guarded_mlflow_server, pipeline_factory, tiny_bert_dir, url, setting):
    hook = {"url": url, "secret_env": "HOOK_SECRET"}
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", promotion={"webhooks": [hook]})

    done = smelter(["webhooks", "sync", "-f", str(path)], MLFLOW_TRACKING_URI=guarded_mlflow_server, HOOK_SECRET="s")

    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}: pipelines.enc.promotion.webhooks.0.url: the MLflow server refuses")
    assert setting in line and "Traceback" not in done.stderr and "t0k3n" not in line
    assert not [w for w in MlflowClient(guarded_mlflow_server).list_webhooks() if w.name.startswith(PREFIX)]


def test_validate_warns_where_a_server_with_the_default_guard_would_refuse(pipeline_factory, tiny_bert_dir):
    hooks = [{"url": "http://deploy.example/a?token=t0k3n", "secret_env": "HOOK_SECRET"},
             {"url": "https://10.1.2.3/a", "secret_env": "HOOK_SECRET"},
             {"url": "https://deploy.example/a", "secret_env": "HOOK_SECRET"}]
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", promotion={"webhooks": hooks})

    done = smelter(["validate", "-f", str(path)], HOOK_SECRET="s")

    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "promotion.webhooks" in line]
    assert len(warnings) == 3, done.stderr
    assert "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https" in warnings[0] and "t0k3n" not in done.stderr
    assert "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true" in warnings[1]
    assert "expected a reachable host" in warnings[2]


def test_sync_with_no_webhooks_says_so_and_sync_has_its_own_help(guarded_mlflow_server, pipeline_factory,
                                                                  tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="quiet")

    done = smelter(["webhooks", "sync", "-f", str(path)], MLFLOW_TRACKING_URI=guarded_mlflow_server)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nothing to sync")

    helped = smelter(["webhooks", "sync", "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: smelter webhooks sync")
    assert "MLFLOW_WEBHOOK_ALLOWED_SCHEMES" in helped.stdout


def test_sync_creates_refreshes_and_removes_its_own_webhooks(mlflow_server, pipeline_factory, tiny_bert_dir):
    hook = {"url": "http://127.0.0.1:9/hooks/a?token=t0k3n", "secret_env": "HOOK_SECRET"}
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc", promotion={"webhooks": [hook]})
    args = ["webhooks", "sync", "-f", str(path)]

    created, updated = (smelter(args, MLFLOW_TRACKING_URI=mlflow_server, HOOK_SECRET="s") for _ in range(2))
    assert created.stdout.startswith("created") and updated.stdout.startswith("updated"), created.stderr
    assert "t0k3n" not in created.stdout + updated.stdout, "the URL is shown redacted"
    ours = [w for w in MlflowClient().list_webhooks() if w.name.startswith(PREFIX)]
    assert [w.url for w in ours] == [hook["url"]], "MLflow holds the full URL to deliver to it"

    document = yaml.safe_load(path.read_text())
    document["pipelines"]["enc"]["promotion"] = {"webhooks": []}
    path.write_text(yaml.safe_dump(document))
    removed = smelter(args, MLFLOW_TRACKING_URI=mlflow_server)
    assert removed.returncode == 0 and removed.stdout.startswith("deleted"), removed.stderr
    assert not [w for w in MlflowClient().list_webhooks() if w.name.startswith(PREFIX)]
