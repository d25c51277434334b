"""One runner for every stage: look up, verify, lock, produce in a temp dir, publish.

A stage describes one output as a `Work`: what its key covers (upstream keys, config, tool
versions, machine facts, and the stage's own code) and how it produces its files. The runner
alone decides whether to reuse or produce, as Olive's engine does for its passes, so caching,
verification, repair and locking behave the same for every stage.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager

from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, stage_key

KeyLock = Callable[[str], ContextManager[Any]]

shared_key_lock: contextvars.ContextVar[KeyLock | None] = contextvars.ContextVar("shared_key_lock", default=None)
"""A lock the orchestrator provides that also holds across hosts (Prefect's global concurrency limits)."""


class KeepPublished(Exception):
    """Raised by a producer that decides the already-published output stands (a contended re-measurement);
    its message says why, and reaches the run's terminal and record as the result's `kept`."""


@dataclass
class Work:
    """One stage output to find or make.

    Args:
        pipeline, stage: where it lives in the store.
        key_parts: everything that determines the output; hashed, with the code version, into its key.
        code: the modules whose source defines what the stage computes (see `code_version`).
        produce: writes the output's files into the writer's dir and its results into `writer.outputs`;
            gets the published output it would replace (or None).
        inputs, config, tools: recorded in the manifest.
        reusable: whether a verified published output may be returned as is (default: always).
    """

    pipeline: str
    stage: str
    key_parts: dict[str, Any]
    code: tuple[str, ...]
    produce: Callable[[StageWriter, StageResult | None], None]
    inputs: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    tools: dict[str, str] = field(default_factory=dict)
    reusable: Callable[[StageResult], bool] = lambda _published: True

    @functools.cached_property
    def key(self) -> str:
        return stage_key(self.stage, code=code_version(self.code), **self.key_parts)


@functools.cache
def code_version(modules: tuple[str, ...]) -> str:
    """A digest of the modules' code, docstrings and comments left out.

    A change to what a stage computes then changes its key without anyone remembering to bump a
    number; reformatting or rewording documentation does not.
    """
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"stage code module {name} not found")
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        digest.update(name.encode())
        digest.update(ast.dump(tree, include_attributes=False).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(store: ArtifactStore, work: Work) -> Iterator[None]:
    """The orchestrator's cross-host lock (when there is one), then this host's file lock: always in that order."""
    shared = shared_key_lock.get()
    with shared(f"{work.pipeline}-{work.stage}-{work.key}") if shared else contextlib.nullcontext(), \
            store.key_lock(work.pipeline, work.stage, work.key):
        yield


def run_stage(work: Work, store: ArtifactStore, force: bool = False) -> StageResult:
    """The verified published output for `work.key`, else a freshly produced and published one.

    A damaged output is moved aside and rebuilt; the result's `repaired` says so. Producing holds
    the key's lock, and looks up again once it has it: the run that held it may have published.
    `force` ignores an output published before it asked, not one another run published while it
    waited for the lock: rebuilding that replaced a directory the other run was reading.
    """
    asked = time.time()
    published, repaired = store.check(work.pipeline, work.stage, work.key)
    if published and not force and work.reusable(published):
        return published
    with _locked(store, work):
        published, repaired_now = store.check(work.pipeline, work.stage, work.key)
        repaired = repaired or repaired_now
        fresh = published is not None and published.manifest.get("created_unix", 0) >= round(asked, 3)
        if published and (fresh or not force) and work.reusable(published):
            return replace(published, repaired=repaired)
        try:
            with store.writing(work.pipeline, work.stage, work.key, inputs=work.inputs, config=work.config,
                               tools=work.tools) as writer:
                work.produce(writer, published)
        except KeepPublished as why:
            assert published is not None
            return replace(published, repaired=repaired, kept=str(why) or "the published output stands")
    assert writer.result is not None
    return replace(writer.result, repaired=repaired)
