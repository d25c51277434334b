"""Optimization profiles: the [min, opt, max] shapes an engine is built for and checked at.

A backend receives them in `build` (tasks/backends/base.py), so they live apart from the schema: a
backend imports this module and the settings bounds, never the schema, whose target union is built
from the backends.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from tasks.config.bounds import MAX_BATCH, MAX_SEQ, Strict

BatchDim = Annotated[list[Annotated[int, Field(ge=1, le=MAX_BATCH)]], Field(min_length=3, max_length=3)]
SeqDim = Annotated[list[Annotated[int, Field(ge=1, le=MAX_SEQ)]], Field(min_length=3, max_length=3)]
PastDim = Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEQ)]], Field(min_length=3, max_length=3)]


class ProfileSpec(Strict):
    """One optimization profile: [min, opt, max] for each dynamic dimension."""

    batch: BatchDim = Field(description="[min, opt, max] batch size")
    seq: SeqDim = Field(description="[min, opt, max] sequence length (new tokens)")
    past: PastDim | None = Field(None, description="[min, opt, max] past length (0 = prefill), decoders with KV cache")

    @model_validator(mode="after")
    def _ordered(self) -> ProfileSpec:
        for name in ("batch", "seq", "past"):
            lo_opt_hi = getattr(self, name)
            if lo_opt_hi is not None and not lo_opt_hi[0] <= lo_opt_hi[1] <= lo_opt_hi[2]:
                raise ValueError(f"{name} must satisfy min <= opt <= max, got {lo_opt_hi}")
        return self

    def shapes(self) -> dict[str, dict[str, int]]:
        """The three shape points validation and engines must agree on."""
        points = {}
        for i, point in enumerate(("min", "opt", "max")):
            shape = {"batch": self.batch[i], "seq": self.seq[i]}
            if self.past is not None:
                shape["past"] = self.past[i]
            points[point] = shape
        return points
