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

Each rank has one colour in every view: :func:`rank_color`. The widgets' HTML is built from
the pieces in ``_html.py``.
"""

from __future__ import annotations

from .allreduce_stepper import AllReduceStepper, RingStep, chunk_bounds, ring_allreduce_steps
from .colors import rank_color, rank_colors
from .consumed_view import ConsumedView, consumed_view
from .gradient_view import GradientView
from .loss_scale_view import LossScaleView, scaler_step
from .precision_explorer import FinfoRow, PrecisionExplorer, Representation, finfo_table, represent
from .shard_explorer import ShardExplorer, sampler_assignments

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
