"""Prefect deployment steps that let a worker find the project without hidden settings.

`prefect deploy` (build step) and `smelter deploy --pools` record the directory they ran in; on
the worker the pull step enters it, so `pipelines.yaml`, `data/` and `artifacts/` resolve as they
do for `smelter run`. Flow code itself comes from the installed package (module entrypoints).
A worker whose host keeps the checkout elsewhere sets SMELTER_HOME; a worker that has none fails
before any work with a message saying so.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOME_ENV = "SMELTER_HOME"


class ProjectNotFound(RuntimeError):
    """The worker's host has no smelter checkout where the deployment says to run."""


def project_directory() -> dict[str, str]:
    """Build step: the directory the deployment is registered from (the checkout workers run in)."""
    return {"directory": str(Path.cwd())}


def enter_project(directory: str) -> dict[str, str]:
    """Pull step: change into the checkout (SMELTER_HOME on this worker, else the recorded directory)."""
    home = os.environ.get(HOME_ENV) or directory
    where = Path(home)
    if not where.is_dir():
        source = f"{HOME_ENV}={home!r}" if os.environ.get(HOME_ENV) else (
            f"{home!r}, the directory the deployment was registered from,")
        raise ProjectNotFound(
            f"smelter: {source} does not exist on worker host {socket.gethostname()}. Set {HOME_ENV} in the "
            f"worker's environment to the smelter checkout on this host (the docker image keeps it at "
            f"/opt/smelter), or register the deployments from the path the workers use.")
    os.chdir(where)
    return {"directory": str(where)}
