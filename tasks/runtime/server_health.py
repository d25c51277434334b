"""Whether a server answers its `/health`: asked of the MLflow server and the Prefect API before a run
(a dead one is one line at once, not minutes of client retries) and after a failure mid-run (a gone one
ends the run with one line)."""

from __future__ import annotations

HEALTH_TIMEOUT_S = 5.0


def unanswered(base_url: str) -> str | None:
    """Why the server at `base_url` does not answer its health check (the error's name), or None."""
    import httpx

    try:
        httpx.get(f"{base_url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        return type(e).__name__
    return None
