"""What ``import nb_dist`` does beyond defining names: little, and only where it is needed.

Runs wherever nb_dist is imported (a kernel, a script, a rank, a Ray node agent), so it
imports nothing heavy itself (no torch, no IPython, no widgets) and does nothing of the
kernel's in a rank:

- the silent ``nb_dist`` logger (a ``NullHandler``: what users need not see goes there);
- ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set): ``torch.cuda.is_available()`` in a cell
  asks NVML instead of initializing CUDA, so it does not poison later forks;
- the CUDA-touch recorder (``_shared/_cuda_touches.py``), when torch is imported (on CUDA
  builds only; ``NB_DIST_CUDA_RECORDER=0``: off, and a refusal cannot name the line);
- in an IPython shell only: cells named as IPython 8 names them on IPython 7 (``Cell In[5]``
  in tracebacks and hang reports), and in a Jupyter kernel the warm imports of a first DDP
  cell in the background (``_kernel/_warm.py``; ``NB_DIST_WARM_IMPORTS=0``: off).
"""

from __future__ import annotations

import logging
import os
import sys

from ._shared._env import RANK_ENV_FLAG


def prepare() -> None:
    # What users need not see goes to the "nb_dist" logger: silent unless they configure it.
    logging.getLogger("nb_dist").addHandler(logging.NullHandler())
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if RANK_ENV_FLAG in os.environ:
        return  # a rank: nothing of the kernel's
    if os.environ.get("NB_DIST_CUDA_RECORDER") != "0":
        from ._shared import _cuda_touches

        _cuda_touches.record()
    if sys.modules.get("IPython") is None:
        return  # no shell here (a script, a node agent)
    # The kernel's side, imported only in a shell: a rank or a node agent never loads it.
    from ._kernel._tracebacks import follow_cell_names
    from ._kernel._warm import prefetch_at_import

    follow_cell_names()
    prefetch_at_import()
