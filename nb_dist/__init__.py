"""nb_dist: launch distributed PyTorch from a Jupyter cell, and see every rank.

``notebook_launcher(fn, args, num_processes=2)`` runs ``fn`` on N ranks under
torch.distributed (gloo on CPU, NCCL on GPUs), streams each rank's output into the cell,
returns each rank's value, and tears everything down on failure, hang or interrupt.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import _at_import

if _TYPE_CHECKING:
    from ._cluster._ray_cluster import RayCluster
    from ._kernel._errors import (
        LaunchError,
        LaunchTimeoutError,
        RankOutcome,
        RendezvousTimeoutError,
        UnsafeLaunchError,
        WorkerFailedError,
    )
    from ._kernel._launcher import notebook_launcher
    from ._kernel._result import LaunchResult
    from ._kernel._scripts import run_script
    from ._live._magic import load_ipython_extension as load_ipython_extension
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
    from .views import (
        AllReduceStepper,
        GradientView,
        LossScaleView,
        PrecisionExplorer,
        ShardExplorer,
        consumed_view,
        rank_color,
    )

# Each public name is imported from its module when first used (PEP 562): a rank that calls
# nb_dist.report() imports the rank's side only, a script the launcher without widgets, a Ray
# node agent nothing of the API, and ``import nb_dist`` itself takes milliseconds.
_HOMES = {
    "._cluster._ray_cluster": ("RayCluster",),
    "._kernel._errors": (
        "LaunchError", "LaunchTimeoutError", "RankOutcome", "RendezvousTimeoutError",
        "UnsafeLaunchError", "WorkerFailedError",
    ),
    "._kernel._launcher": ("notebook_launcher",),
    "._kernel._result": ("LaunchResult",),
    "._kernel._scripts": ("run_script",),
    "._live._magic": ("load_ipython_extension",),
    "._live._per_rank": ("per_rank",),
    "._live._ranks": ("Ranks", "SessionError"),
    "._rank._debug": ("breakpoint",),
    "._shared._precision": ("autocast", "autocast_dtype", "mixed_precision", "needs_grad_scaler"),
    "._shared._reporting": (
        "ReportEntry", "Reports", "is_main_process", "local_rank", "local_reports",
        "main_process_first", "progress", "rank", "report", "world_size",
    ),
    ".views": (
        "AllReduceStepper", "GradientView", "LossScaleView", "PrecisionExplorer",
        "ShardExplorer", "consumed_view", "rank_color",
    ),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME_OF))


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

# What ``import nb_dist`` does beyond names, and where (``_at_import.py``): the silent
# "nb_dist" logger; outside a rank, CUDA touches recorded once torch is imported; in IPython,
# IPython 7's cells named as IPython 8 names them, and a first DDP cell's imports warmed.
_at_import.prepare()
