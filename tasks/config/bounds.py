"""The building blocks of every settings model: strict parsing and the bounds a value may take.

A backend's target settings (tasks.backends.base.TargetSpec and its subclasses) are built from
these too, so a plugin's settings are checked like the built-in ones. Nothing here imports the
schema or the backend registry: both import this.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from tasks.config.yaml_source import shown
from tasks.measure.rounds import MAX_ROUNDS  # the rounds' own limit, which min_rounds may not pass

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")

# Upper bounds: far above any real use, low enough that a typo (1e12, an extra digit) is caught here
# instead of as an out-of-memory kill an hour into a nightly run.
MAX_BATCH = 4096
MAX_SEQ = 262_144
MAX_SAMPLES = 100_000
MAX_WARMUP = 10_000
MAX_BENCHMARK_SECONDS = 3600.0
MAX_THREADS = 1024
MAX_THRESHOLD = 1e12
MAX_TOLERANCE = 1e3
MAX_WORKSPACE_BYTES = 1 << 40
MAX_TIMEOUT_S = 300.0
MAX_WORKER_TIMEOUT_S = 7 * 24 * 3600.0
MAX_RETRIES = 10
MAX_TARGETS = 64
MAX_PROFILES = 16
MAX_PATTERNS = 10_000
MAX_TOKENS_PER_DAY = 1e15
MAX_SLO_MS = 3_600_000.0
MAX_GPUS_PER_HOST = 1024
NAME = r"^[a-z0-9][a-z0-9_-]*$"


class Strict(BaseModel):
    """No unknown keys, no coercion (`true` is not 1), finite numbers, frozen once checked."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


Pattern = Annotated[str, Field(min_length=1, max_length=1000)]
Arch = Annotated[str, Field(pattern=r"^sm\d{2,3}$", description="GPU arch, e.g. sm90")]


def arch_number(arch: str) -> int:
    """sm89 -> 89: compute capability as one comparable number."""
    return int(arch[2:])


def parse_bytes(text: str | int) -> int:
    match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*", str(text))
    if not match or isinstance(text, bool):
        raise ValueError(f"expected a size like '4GiB' or '512MiB', got {shown(text)}")
    units = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    return int(float(match.group(1)) * units[match.group(2)])
