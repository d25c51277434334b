"""A stop while the `smelter` command loads its modules: imported first by flows/cli.py, before anything else.

Until main() takes SIGINT and SIGTERM over, Python's own handlers would end a Ctrl-C pressed right after Enter
with a KeyboardInterrupt traceback from whichever import it landed in (on a slow CPU these imports take a
second). Nothing has started then, so the handler here says the stop's line and exits with its code at once.
Only for the command (`smelter`, `python -m flows.cli`); a program that imports flows.cli keeps its handlers.
"""

from __future__ import annotations

import os
import signal
import sys


# How a stop is said, by its signal: here and, once main() has taken the signals over, by flows/cli.py
STOPPED = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}


def _stopped_while_loading(signum: int, frame: object) -> None:
    os.write(2, f"smelter: {STOPPED[signum]}\n".encode())
    os._exit(128 + signum)


def _is_the_command() -> bool:
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main_spec, "name", None) == "flows.cli" or os.path.basename(sys.argv[0]) == "smelter"


if _is_the_command():
    for signum in STOPPED:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # a background job's ignored SIGINT stays ignored
            signal.signal(signum, _stopped_while_loading)
