"""nb_dist: launch distributed PyTorch from a Jupyter cell, and see every rank.

``notebook_launcher(fn, args, num_processes=2)`` runs ``fn`` on N workers under
torch.distributed (gloo on CPU, NCCL on GPUs), streams each rank's output into the cell,
returns each rank's value, and tears everything down on failure, hang or interrupt.
"""

from __future__ import annotations

import os as _os

from ._debug import breakpoint
from ._errors import (
    LaunchError,
    LaunchTimeoutError,
    RankOutcome,
    RendezvousTimeoutError,
    UnsafeLaunchError,
    WorkerFailedError,
)
from ._launcher import notebook_launcher
from ._magic import load_ipython_extension
from ._precision import autocast, autocast_dtype, mixed_precision, needs_grad_scaler
from ._preflight import install_cuda_touch_recorder as _install_cuda_touch_recorder
from ._ranks import Ranks, SessionError, per_rank
from ._reporting import (
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
from ._result import LaunchResult
from .views import (
    AllReduceStepper,
    GradientView,
    LossScaleView,
    PrecisionExplorer,
    ShardExplorer,
    consumed_view,
    rank_color,
)

__version__ = "0.1.0"

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
    "world_size",
]

# Let torch.cuda.is_available() ask NVML instead of initializing CUDA, so that checking for a
# GPU in a cell does not poison later forks (honoured only where the user has not set it).
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
_install_cuda_touch_recorder()

# `%load_ext nb_dist` finds this (not in __all__: it is IPython's hook, not an API).
_ = load_ipython_extension
