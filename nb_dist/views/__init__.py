"""Teaching views: widgets and figures that show what distributed training does.

Every view is a small class holding plain Python state (computed by pure, testable functions)
and, on demand, an ipywidgets ``widget``. Displaying a view in Jupyter shows the live widget;
everywhere else (``print``, scripts, nbconvert, nbval) it shows a deterministic text summary.
``view.figure()`` returns a static matplotlib ``Figure`` (Agg, no pyplot).

- :class:`ShardExplorer`: which samples each rank gets from ``DistributedSampler``
  (padding, ``drop_last``, ``set_epoch``); :func:`consumed_view` (``consumed_view.py``): what
  the ranks of a real run consumed.
- :class:`AllReduceStepper`: ring all-reduce step by step (reduce-scatter, all-gather, bytes).
- :class:`GradientView`: per-rank gradients before and after DDP's all-reduce, and drift
  across ranks under ``no_sync()``.
- :class:`PrecisionExplorer`: a value in fp32/fp16/bf16; :class:`LossScaleView`
  (``loss_scale_view.py``): a GradScaler trace.
- :class:`MemoryExplorer`: bytes per rank of parameters, gradients, optimizer states and
  activations under DP, ZeRO-1/2/3, TP and PP (notebook 13's formulas, :func:`memory_per_rank`).
- :class:`TensorParallelView`: where TP's ``f`` and ``g`` (and sequence parallelism's
  all-gathers and reduce-scatters) sit in a sub-block, and the bytes each moves.
- :class:`OnlineSoftmaxView`: one query's softmax built block by block of keys (running ``m``,
  ``den``, ``acc``), as ring attention does.

Each rank has one colour in every view: :func:`rank_color`. The widgets' HTML is built from
the pieces in ``_html.py``. :func:`widget_view_bundle` gives a widget's display entry on
ipywidgets 7 and 8, for a notebook's own view class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._display import widget_view_bundle
    from .allreduce_stepper import (
        AllReduceStepper,
        RingStep,
        chunk_bounds,
        ring_allreduce_steps,
    )
    from .colors import rank_color, rank_colors
    from .gradient_view import GradientView
    from .loss_scale_view import LossScaleView, scaler_step
    from .memory_explorer import MemoryExplorer, memory_per_rank
    from .online_softmax_view import OnlineSoftmaxView, SoftmaxStep, online_softmax_steps
    from .precision_explorer import (
        FinfoRow,
        PrecisionExplorer,
        Representation,
        finfo_table,
        represent,
    )
    from .shard_explorer import ShardExplorer, sampler_assignments
    from .tensor_parallel_view import (
        Collective,
        TensorParallelView,
        tp_block_bytes,
        tp_collectives,
    )

# The function ``consumed_view`` shares its module's name: imported at once, so that an import
# of the module ``nb_dist.views.consumed_view`` cannot leave the package attribute pointing at
# the module instead of the function. It needs no widget library (a figure on demand).
from .consumed_view import ConsumedView, consumed_view

# Each other name is imported from its module when first used (PEP 562), so that a launch, which
# needs none of the views, never imports them, and a view that cannot be built where it runs
# (an older widget library) fails only when it is used.
_WHERE = {
    "AllReduceStepper": "allreduce_stepper",
    "RingStep": "allreduce_stepper",
    "chunk_bounds": "allreduce_stepper",
    "ring_allreduce_steps": "allreduce_stepper",
    "rank_color": "colors",
    "rank_colors": "colors",
    "GradientView": "gradient_view",
    "LossScaleView": "loss_scale_view",
    "scaler_step": "loss_scale_view",
    "MemoryExplorer": "memory_explorer",
    "memory_per_rank": "memory_explorer",
    "OnlineSoftmaxView": "online_softmax_view",
    "SoftmaxStep": "online_softmax_view",
    "online_softmax_steps": "online_softmax_view",
    "FinfoRow": "precision_explorer",
    "PrecisionExplorer": "precision_explorer",
    "Representation": "precision_explorer",
    "finfo_table": "precision_explorer",
    "represent": "precision_explorer",
    "ShardExplorer": "shard_explorer",
    "sampler_assignments": "shard_explorer",
    "Collective": "tensor_parallel_view",
    "TensorParallelView": "tensor_parallel_view",
    "tp_block_bytes": "tensor_parallel_view",
    "tp_collectives": "tensor_parallel_view",
    "widget_view_bundle": "_display",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    imported = importlib.import_module(f"{__name__}.{module}")
    for other, where in _WHERE.items():  # the next lookups are plain attributes
        if where == module:
            globals()[other] = getattr(imported, other)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
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
