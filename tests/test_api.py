"""The public API is what ``nb_dist/__init__.py`` exports; everything else is private by name."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import nb_dist
import nb_dist.teach
import nb_dist.views

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

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
    "Collective",
    "ConsumedView",
    "FinfoRow",
    "GradientView",
    "LossScaleView",
    "MemoryExplorer",
    "OnlineSoftmaxView",
    "PrecisionExplorer",
    "Representation",
    "RingStep",
    "ShardExplorer",
    "SoftmaxStep",
    "TensorParallelView",
    "chunk_bounds",
    "consumed_view",
    "finfo_table",
    "memory_per_rank",
    "online_softmax_steps",
    "rank_color",
    "rank_colors",
    "represent",
    "ring_allreduce_steps",
    "sampler_assignments",
    "scaler_step",
    "tp_block_bytes",
    "tp_collectives",
    "widget_view_bundle",
]

# The names nb_dist.teach exports (the notebooks' exercise checks).
PUBLIC_TEACH = [
    "WrongAnswer",
    "all_gather_single",
    "answered",
    "check",
    "check_code",
    "ddp_buffer_sync",
    "explain",
    "reduce_scatter_single",
    "torch_name",
]


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


WITHOUT_WIDGETS = """
import sys
# As where the widget and plotting libraries are absent or cannot be imported: every import
# of them fails.
for name in ("ipywidgets", "matplotlib"):
    sys.modules[name] = None
import nb_dist
loaded = sorted(m for m in sys.modules if m.startswith("nb_dist.views."))
from nb_dist import notebook_launcher

def total(x):
    import torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(t)
    return t.item()

print(list(notebook_launcher(total, args=(1,), num_processes=2, init_process_group=True)))
try:
    nb_dist.ShardExplorer(dataset_len=10, world_size=2).widget
except ImportError as error:
    print("the widget needs:", error.name)
print(loaded)
"""


@pytest.mark.timeout(120)
def test_a_launch_needs_no_widget_or_plotting_library(tmp_path):
    """``import nb_dist`` and a launch work where ipywidgets and matplotlib cannot be imported;
    only building a view's widget needs them, and says so then."""
    import subprocess
    import sys

    script = tmp_path / "without_widgets.py"
    script.write_text(WITHOUT_WIDGETS)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[3.0, 3.0]" in lines, done.stdout
    assert "the widget needs: ipywidgets" in lines, done.stdout
    # What a launch loads of the views: the widget base its monitor builds on, and colours.
    assert set(eval(lines[-1])) <= {
        "nb_dist.views._display",
        "nb_dist.views.colors",
        "nb_dist.views.consumed_view",
    }, lines[-1]
