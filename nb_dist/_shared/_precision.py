"""Mixed precision as handed from ``notebook_launcher(mixed_precision=...)`` to the ranks.

The launcher exports the choice as ``ACCELERATE_MIXED_PRECISION`` (what ``accelerate.Accelerator()``
reads) and ``NB_DIST_MIXED_PRECISION``. Plain-torch code reads it back with these helpers.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")
_ENV = "NB_DIST_MIXED_PRECISION"

__all__ = ["autocast", "autocast_dtype", "mixed_precision", "needs_grad_scaler"]


def normalize_mixed_precision(value: object) -> str:
    """Validate a ``mixed_precision`` argument and return it lower-cased."""
    if isinstance(value, str) and value.strip().lower() in MIXED_PRECISION_CHOICES:
        return value.strip().lower()
    raise ValueError(
        f"mixed_precision={value!r} is not a precision the launcher knows. "
        f"Use one of {', '.join(repr(c) for c in MIXED_PRECISION_CHOICES)} "
        "(case does not matter), for example mixed_precision='bf16'."
    )


def mixed_precision() -> str:
    """The mixed precision this rank was launched with: ``"no"``, ``"fp16"`` or ``"bf16"``.

    Outside a launch it reads the same environment variables, so a function also runs
    single-process (``"no"`` unless you set ``ACCELERATE_MIXED_PRECISION`` yourself).
    """
    value = os.environ.get(_ENV) or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no"
    return normalize_mixed_precision(value)


def autocast_dtype() -> Any:
    """``torch.float16`` / ``torch.bfloat16`` for the launched precision, ``None`` for ``"no"``."""
    import torch

    return {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision()]


def needs_grad_scaler() -> bool:
    """Whether the launched precision needs loss scaling (``GradScaler``): true only for fp16.

    fp16 has a narrow range, so small gradients underflow to zero unless the loss is scaled up;
    bf16 keeps fp32's range and needs no scaler.
    """
    return mixed_precision() == "fp16"


def autocast(device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for the launched precision, or a no-op context for ``"no"``."""
    import torch

    dtype = autocast_dtype()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
