"""``per_rank(v0, v1, ...)``: values for ``Ranks.push`` that differ by rank. Runs in the kernel.

Its own module so that both the session (``_ranks.py``) and the export (``_export.py``)
recognise it by type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PerRank:
    """Values for :meth:`Ranks.push` that differ by rank: ``per_rank(v0, v1, ...)``."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = list(values)

    def __repr__(self) -> str:
        return f"per_rank({', '.join(repr(v) for v in self.values)})"


def per_rank(*values: Any) -> PerRank:
    """One value per rank for :meth:`Ranks.push`: ``ranks.push(seed=per_rank(0, 1))``."""
    return PerRank(values)
