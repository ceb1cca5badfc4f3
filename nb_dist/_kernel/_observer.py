"""What the supervisor tells a live view of a run (the launch monitor), as a typed protocol.

The supervisor, a rank's handle and the output router call these methods as things happen;
:class:`~nb_dist._kernel._monitor.LaunchMonitor` implements them. A run without a live view
passes ``None``. Runs in the kernel.
"""

from __future__ import annotations

from typing import Any, Protocol

from ._errors import RankOutcome


class Observer(Protocol):
    """A live view of one run: every call is cheap and returns at once."""

    def started(self, local_rank: int) -> None: ...
    def paused(self, local_rank: int, paused: bool) -> None: ...
    def lines(self, local_rank: int, stream: str, lines: list[str]) -> None: ...
    def reports(self, local_rank: int, entries: list[tuple[str, Any]]) -> None: ...
    def progress(self, local_rank: int, key: str, count: int, total: int | None) -> None: ...
    def finished(self, local_rank: int, outcome: RankOutcome) -> None: ...
    def tick(self) -> None: ...
    def close(
        self, outcomes: list[RankOutcome] | None = None, interrupted: bool = False
    ) -> None: ...
