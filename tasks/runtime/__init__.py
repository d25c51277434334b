"""What every part of smelter runs on: the content-addressed store and the one stage runner,
locks and the holders they name, this process's temp dir, whole-file writes, stop signals and kill
points, the processes paused while engines are timed, server health, the GPUs CUDA sees, and the
one-line forms of errors and URLs. It imports nothing of smelter outside this folder, so any module may
import it and it is tested on its own.
"""
