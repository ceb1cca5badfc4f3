"""The public API is what ``nb_dist/__init__.py`` exports; everything else is private by name."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import nb_dist
import nb_dist.teach
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


# The names nb_dist.views exports (the teaching widgets, their models and helpers).
PUBLIC_VIEWS = [
    "AllReduceStepper",
    "ConsumedView",
    "FinfoRow",
    "GradientView",
    "LossScaleView",
    "PrecisionExplorer",
    "Representation",
    "RingStep",
    "ShardExplorer",
    "chunk_bounds",
    "consumed_view",
    "finfo_table",
    "rank_color",
    "rank_colors",
    "represent",
    "ring_allreduce_steps",
    "sampler_assignments",
    "scaler_step",
]

# The names nb_dist.teach exports (the notebooks' exercise checks).
PUBLIC_TEACH = ["WrongAnswer", "answered", "check", "check_code"]


def _defined_where_it_says(obj) -> bool:
    """``obj.__module__`` and ``obj.__qualname__`` lead back to ``obj``: what help(), pydoc,
    pickle and a traceback name it by is a real, importable path to this very object."""
    module = importlib.import_module(obj.__module__)
    found = module
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is obj


def test_all_is_pinned():
    """Adding or removing a public name is a decision: change this list with it."""
    assert nb_dist.__all__ == PUBLIC
    assert nb_dist.views.__all__ == PUBLIC_VIEWS
    assert nb_dist.teach.__all__ == PUBLIC_TEACH


@pytest.mark.parametrize(
    ("package", "names"),
    [(nb_dist, PUBLIC), (nb_dist.views, PUBLIC_VIEWS), (nb_dist.teach, PUBLIC_TEACH)],
    ids=["nb_dist", "views", "teach"],
)
def test_every_public_name_is_nb_dists_own_documented_object(package, names):
    """Each exported name is bound, is an object nb_dist defines (not a re-export of torch's or
    a stray module), under its own name, found again at the path it names, and documented."""
    for name in names:
        assert hasattr(package, name), f"{package.__name__}.{name} is exported but not defined"
        obj = getattr(package, name)
        assert obj.__module__.split(".")[0] == "nb_dist", (name, obj.__module__)
        assert obj.__name__ == name, f"{name} is exported under another name: {obj.__name__}"
        assert _defined_where_it_says(obj), f"{obj.__module__}.{obj.__qualname__} is not {name}"
        assert (obj.__doc__ or "").strip(), f"{package.__name__}.{name} has no docstring"


def test_the_views_the_package_exports_are_the_views_module_objects():
    shared = set(PUBLIC) & set(PUBLIC_VIEWS)
    assert shared == {
        "AllReduceStepper",
        "GradientView",
        "LossScaleView",
        "PrecisionExplorer",
        "ShardExplorer",
        "consumed_view",
        "rank_color",
    }
    for name in shared:
        assert getattr(nb_dist, name) is getattr(nb_dist.views, name), name


def test_modules_that_are_not_api_are_private_by_name():
    public = {
        module.name
        for module in pkgutil.iter_modules(nb_dist.__path__)
        if not module.name.startswith("_")
    }
    # The teaching widgets and the notebooks' exercise checks are public subpackages.
    expected = {"views", "teach"}
    assert public == expected, f"modules that should be _private: {public - expected}"


def test_a_launch_error_is_what_accelerate_users_catch():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    assert issubclass(nb_dist.WorkerFailedError, ChildFailedError)
    assert issubclass(nb_dist.UnsafeLaunchError, ValueError)
    assert issubclass(nb_dist.RendezvousTimeoutError, nb_dist.LaunchTimeoutError)
