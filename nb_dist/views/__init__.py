"""Teaching views: widgets and figures that show what distributed training does.

Every view is a small class holding plain Python state (computed by pure, testable functions)
and, on demand, an ipywidgets ``widget``. Displaying a view in Jupyter shows the live widget;
everywhere else (``print``, scripts, nbconvert, nbval) it shows a deterministic text summary.
``view.figure()`` returns a static matplotlib ``Figure`` (Agg, no pyplot).

- :class:`ShardExplorer`: which samples each rank gets from ``DistributedSampler``
  (padding, ``drop_last``, ``set_epoch``), and :func:`consumed_view` for a real run.
- :class:`AllReduceStepper`: ring all-reduce step by step (reduce-scatter, all-gather, bytes).
- :class:`GradientView`: per-rank gradients before and after DDP's all-reduce, and drift
  across ranks under ``no_sync()``.
- :class:`PrecisionExplorer`: a value in fp32/fp16/bf16, and :class:`LossScaleView` for a
  GradScaler trace.

Each rank has one colour in every view: :func:`rank_color`.
"""

from __future__ import annotations

from .allreduce_stepper import AllReduceStepper, RingStep, chunk_bounds, ring_allreduce_steps
from .colors import rank_color, rank_colors
from .gradient_view import GradientView
from .precision_explorer import (
    FinfoRow,
    LossScaleView,
    PrecisionExplorer,
    Representation,
    finfo_table,
    represent,
    scaler_step,
)
from .shard_explorer import ConsumedView, ShardExplorer, consumed_view, sampler_assignments

__all__ = [
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
