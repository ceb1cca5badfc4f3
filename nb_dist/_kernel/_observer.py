"""What the supervisor tells a live view of a run (the launch monitor), as a typed protocol.

The supervisor, a rank's handle and the output router call these methods as things happen;
:class:`~nb_dist._kernel._monitor.LaunchMonitor` implements them. A run without a live view
passes ``None``. Runs in the kernel.
"""

from __future__ import annotations

from typing import Any, Protocol

from ._errors import RankOutcome
from ._tracebacks import kernel_is_running


class Observer(Protocol):
    """A live view of one run: every call is cheap and returns at once."""

    # ``index``: the rank's index among the kernel's ranks (``Rank.index``), not LOCAL_RANK.
    def started(self, index: int) -> None: ...
    def paused(self, index: int, paused: bool) -> None: ...
    def lines(self, index: int, stream: str, lines: list[str]) -> None: ...
    def reports(self, index: int, entries: list[tuple[str, Any]]) -> None: ...
    def progress(self, index: int, key: str, count: int, total: int | None) -> None: ...
    def finished(self, index: int, outcome: RankOutcome) -> None: ...
    def tick(self) -> None: ...
    def close(
        self, outcomes: list[RankOutcome] | None = None, interrupted: bool = False
    ) -> None: ...


def open_live_view(ranks: list[int]) -> Observer | None:
    """The live monitor of ``ranks``, shown in the cell where a frontend may render it; else
    ``None``, and the widgets it is made of are not even imported (a script, ``nb-dist run``)."""
    if not kernel_is_running():
        return None
    from ._monitor import open_monitor

    return open_monitor(ranks)
