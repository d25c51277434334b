"""MLflow's registry webhooks as `smelter webhooks sync` plans them, and checking MLflow's signature."""

from __future__ import annotations

import json
import time

import yaml

from tasks.mlflow_webhooks import PREFIX, verify_signature, wanted
from tasks.notify import sign
from tasks.spec import load


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
