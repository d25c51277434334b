"""Deployments: the nightly schedules a user declares reach Prefect, and prefect.yaml points at real flows."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from flows.deploy import deployments
from tasks.spec import load

REPO = Path(__file__).resolve().parents[1]


def test_each_scheduled_pipeline_gets_a_cron_deployment(pipeline_factory, tiny_bert_dir):
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", name="enc",
                            schedule={"cron": "15 3 * * *", "timezone": "Europe/Berlin"})
    found = {d.name: d for d in deployments(load(path), str(path), "artifacts")}
    assert set(found) == {"nightly", "enc"}
    assert not found["nightly"].schedules
    schedule = found["enc"].schedules[0].schedule
    assert (schedule.cron, schedule.timezone) == ("15 3 * * *", "Europe/Berlin")
    assert found["enc"].parameters == {"file": str(path), "pipeline": "enc", "artifacts": "artifacts"}


def test_prefect_yaml_entrypoints_are_importable_flows():
    document = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for deployment in document["deployments"]:
        module_path, _, name = deployment["entrypoint"].partition(":")
        module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, name)
        assert set(deployment["parameters"]) <= set(flow.parameters.properties), deployment["name"]
        assert (REPO / deployment["parameters"]["file"]).is_file()
