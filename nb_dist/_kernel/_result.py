"""What a launch returns: every rank's value, with its outcome, output and timing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._shared._reporting import Reports
from ._errors import RankOutcome


class LaunchResult(list):  # type: ignore[type-arg]
    """The values returned by every rank, indexed by rank (a list), plus what happened.

    ``result[0]`` is rank 0's return value. On a multi-node launch the list holds this node's
    ranks in order; ``result.ranks`` gives their global ranks.

    Attributes:
        ranks: global rank of each entry.
        outcomes: each rank's :class:`~nb_dist.RankOutcome` (status, pid, exit code, duration).
        logs: each rank's full output (stdout and stderr lines, unlabelled), also of ranks
            whose output was not shown.
        durations: seconds each rank spent in the function.
        wall_time: seconds the whole launch took, start to teardown.
        port: the rendezvous port used.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        restarts: how many times the group was restarted (``max_restarts``).
        reports: everything the ranks sent with :func:`nb_dist.report`:
            ``reports[name][rank]`` → list of ``(step, value)``.
    """

    def __init__(
        self,
        values: list[Any],
        ranks: list[int],
        outcomes: list[RankOutcome],
        logs: list[str],
        durations: list[float | None],
        wall_time: float,
        port: int,
        start_method: str,
        restarts: int = 0,
        reports: Reports | None = None,
    ) -> None:
        super().__init__(values)
        self.ranks = ranks
        self.outcomes = outcomes
        self.logs = logs
        self.durations = durations
        self.wall_time = wall_time
        self.port = port
        self.start_method = start_method
        self.restarts = restarts
        self.reports = reports if reports is not None else Reports()

    @property
    def by_rank(self) -> dict[int, Any]:
        """``{global rank: value}``, handy on multi-node launches."""
        return dict(zip(self.ranks, self, strict=False))

    def __repr__(self) -> str:
        # Deterministic on purpose (no pids, ports or timings): notebooks compare it in CI.
        return f"LaunchResult({list.__repr__(self)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    @property
    def _ipython_display_(self) -> Callable[[], None] | None:
        """Show nothing for a cell that ends with a launch where every rank returned ``None``.

        Code written for ``accelerate.notebook_launcher`` (which returns ``None``) ends cells
        with the call; an ``Out[n]: LaunchResult([None, None])`` there is noise. IPython calls
        this when it is callable and formats the value as usual when it is ``None``.
        """
        if self and all(value is None for value in self):
            return _show_nothing
        return None


def _show_nothing() -> None:
    return None
