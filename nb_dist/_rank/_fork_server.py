"""Imported first by multiprocessing's fork server, the process forkserver ranks are forked
from (its preload list: ``_starter/_processes.forkserver_context``).

The fork server only forks ranks and never launches, so the CUDA-touch recorder that
``import nb_dist`` starts outside a rank is stopped here, before the preload imports torch:
torch's import in the server is not hooked, and the ranks it forks inherit no recorder.
"""

from __future__ import annotations

from .._shared import _cuda_touches

_cuda_touches.stop()
