"""The public API is what ``nb_dist/__init__.py`` exports; everything else is private by name."""

from __future__ import annotations

import pkgutil

import nb_dist
import nb_dist.views

PUBLIC = [
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


def test_all_is_pinned():
    """Adding or removing a public name is a decision: change this list with it."""
    assert nb_dist.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(nb_dist, name) is not None, name


def test_modules_that_are_not_api_are_private_by_name():
    public = {
        module.name
        for module in pkgutil.iter_modules(nb_dist.__path__)
        if not module.name.startswith("_")
    }
    assert public == {"views"}, f"modules that should be _private: {public - {'views'}}"


def test_a_launch_error_is_what_accelerate_users_catch():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    assert issubclass(nb_dist.WorkerFailedError, ChildFailedError)
    assert issubclass(nb_dist.UnsafeLaunchError, ValueError)
    assert issubclass(nb_dist.RendezvousTimeoutError, nb_dist.LaunchTimeoutError)
