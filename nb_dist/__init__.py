"""nb_dist: launch distributed PyTorch from a Jupyter cell, and see every rank.

``notebook_launcher(fn, args, num_processes=2)`` runs ``fn`` on N workers under
torch.distributed (gloo on CPU, NCCL on GPUs), streams each rank's output into the cell,
returns each rank's value, and tears everything down on failure, hang or interrupt.
"""

from __future__ import annotations

import logging as _logging
import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._cluster._ray_cluster import RayCluster  # imports Ray only when a cluster is made
from ._kernel._errors import (
    LaunchError,
    LaunchTimeoutError,
    RankOutcome,
    RendezvousTimeoutError,
    UnsafeLaunchError,
    WorkerFailedError,
)
from ._kernel._launcher import notebook_launcher
from ._kernel._preflight import install_cuda_touch_recorder as _install_cuda_touch_recorder
from ._kernel._result import LaunchResult
from ._kernel._scripts import run_script
from ._kernel._tracebacks import follow_cell_names as _follow_cell_names
from ._kernel._warm import prefetch_at_import as _prefetch_at_import
from ._live._magic import load_ipython_extension
from ._live._per_rank import per_rank
from ._live._ranks import Ranks, SessionError
from ._rank._debug import breakpoint
from ._shared._precision import autocast, autocast_dtype, mixed_precision, needs_grad_scaler
from ._shared._reporting import (
    ReportEntry,
    Reports,
    is_main_process,
    local_rank,
    local_reports,
    main_process_first,
    progress,
    rank,
    report,
    world_size,
)

if _TYPE_CHECKING:
    from .views import (
        AllReduceStepper,
        GradientView,
        LossScaleView,
        PrecisionExplorer,
        ShardExplorer,
        consumed_view,
        rank_color,
    )

# The teaching views are imported when first used (PEP 562): a launch needs no widget library,
# and ``import nb_dist`` must work where a view cannot be built.
_VIEWS = (
    "AllReduceStepper",
    "GradientView",
    "LossScaleView",
    "PrecisionExplorer",
    "ShardExplorer",
    "consumed_view",
    "rank_color",
)


def __getattr__(name: str) -> object:
    if name not in _VIEWS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import views

    value = getattr(views, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_VIEWS))


__version__ = "0.1.0"

# The errors say they are nb_dist's (``nb_dist.UnsafeLaunchError`` in a rank's failure, a
# traceback, a repr), not the private module that defines them: the layout may move, the
# name a user catches and reads stays.
for _error in (
    LaunchError,
    LaunchTimeoutError,
    RendezvousTimeoutError,
    UnsafeLaunchError,
    WorkerFailedError,
):
    _error.__module__ = __name__

__all__ = [
    "AllReduceStepper",
    "GradientView",
    "LaunchError",
    "LaunchResult",
    "LaunchTimeoutError",
    "LossScaleView",
    "PrecisionExplorer",
    "RankOutcome",
    "Ranks",
    "RayCluster",
    "RendezvousTimeoutError",
    "ReportEntry",
    "Reports",
    "SessionError",
    "ShardExplorer",
    "UnsafeLaunchError",
    "WorkerFailedError",
    "autocast",
    "autocast_dtype",
    "breakpoint",
    "consumed_view",
    "is_main_process",
    "local_rank",
    "local_reports",
    "main_process_first",
    "mixed_precision",
    "needs_grad_scaler",
    "notebook_launcher",
    "per_rank",
    "progress",
    "rank",
    "rank_color",
    "report",
    "run_script",
    "world_size",
]

# What users need not see goes to the "nb_dist" logger; silent unless they configure logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# Let torch.cuda.is_available() ask NVML instead of initializing CUDA, so that checking for a
# GPU in a cell does not poison later forks (honoured only where the user has not set it).
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
_install_cuda_touch_recorder()

# On IPython 7 (Colab's, Kaggle's), note each cell's file name as IPython 8 does, so that a
# rank's traceback and a hang report say "Cell In[5]" there too.
_follow_cell_names()

# In a Jupyter kernel, import what a first DDP cell needs in the background now, so that the
# first launch or live session inherits it (_kernel/_warm.py; NB_DIST_WARM_IMPORTS=0: off).
_prefetch_at_import()

# `%load_ext nb_dist` finds this (not in __all__: it is IPython's hook, not an API).
_ = load_ipython_extension
