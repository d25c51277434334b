"""The process of smelter's temporary Prefect server: `python -m flows.temporary_server PORT`.

What Prefect's own temporary server runs (`uvicorn --factory prefect.server.api.server:create_app`, the
settings it reads from the environment flows/prefect_server.py gives it), but the app is made with the
cycle collector held off (tasks/runtime/collector.py): loading Prefect's server is most of its start.
"""

from __future__ import annotations

import sys

from tasks.runtime import collector


def serve(port: int) -> None:
    """Serve Prefect's API on loopback `port` until stopped (the parent's `_stop`, or its death)."""
    collector.hold()
    import uvicorn
    from prefect.server.api.server import create_app

    app = create_app()
    collector.loaded()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
