"""An exception as the one line a run shows for it (the stage lines, the summary table, MLflow).

Libraries raise bare asserts (ONNX Runtime's shape inference: `AssertionError: ` and nothing else) and
multi-line messages (ONNX Runtime's own errors); the first says nothing, the second breaks the table's
columns. So an empty message names where it was raised, and every message is one line.
"""

from __future__ import annotations

import traceback
from pathlib import Path


def described(error: BaseException) -> str:
    """`Type: message` on one line; for an empty message, the file and line that raised it."""
    message = " ".join(str(error).split())
    if not message:
        frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
        message = f"(no message; raised at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
