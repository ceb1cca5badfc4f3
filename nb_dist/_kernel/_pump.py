"""The one loop that reads ranks' pipes, and the state one run collects while it reads.

A launch attempt, a live-ranks task and a post-mortem all read their ranks the same way: a
``select`` over each rank's ``stdout``/``stderr``/``stack``/``control`` pipes; output lines go
to the cell (:class:`~_output.OutputRouter`), control messages to :meth:`Rank.handle`. That is
:class:`Pump`. What a run collects and decides while it reads (its ranks, its output, its
reports, its watchdogs' marks) is a fresh :class:`Run` each time: nothing carries over from
one task to the next by accident. How a run treats a failure is its :class:`Policy`: one
loop, two policies (a launch's, a live task's). Runs in the kernel, in the cell's thread.
"""

from __future__ import annotations

import contextlib
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from .._shared import _protocol
from .._shared._reporting import Reports
from ._observer import Observer
from ._output import OutputRouter
from ._rank_handle import Rank


@dataclass(frozen=True)
class Policy:
    """How a run treats a failure; a launch's is :data:`LAUNCH`, a live task builds its own.

    ``answers_post_mortems``: a failed rank's debugger is answered in the cell (live ranks),
    not kept for ``%debug`` after the run. ``on_failure``: the run's own reaction to a
    failed or dead rank (``None``: the launch's, stop every rank). ``closing_note``: a last
    paragraph for a failure's message (live ranks: whether the session's state survived).
    """

    answers_post_mortems: bool = False
    #: How the straggler notice tells the user to put a limit on a run.
    limit_hint: str = "pass timeout=... to the launcher"
    on_failure: Callable[[], None] | None = None
    closing_note: Callable[[], str] | None = None
    #: A check the loop makes on every turn, after its own watchdogs (live ranks: a skipped
    #: collective); it may raise the run's error.
    watch: Callable[[], None] | None = None


#: A launch attempt: the first failure stops every rank; a failed rank's debugger waits for
#: ``%debug`` (``debug="postmortem"``).
LAUNCH = Policy()


@dataclass
class Run:
    """One run's ranks, where their output goes, and what it has collected and noticed."""

    ranks: list[Rank]
    router: OutputRouter
    observer: Observer | None
    reports: Reports = field(default_factory=Reports)
    policy: Policy = LAUNCH
    #: Modules the ranks imported that the kernel lacks (see ``_warm.py``).
    imports: set[str] = field(default_factory=set)
    #: When the first rank finished well (the straggler notice counts from there).
    first_finish: float | None = None
    #: Ranks a straggler or teardown notice was already shown for.
    hang_noticed: set[int] = field(default_factory=set)
    #: A failure was acted on (the others are being stopped or interrupted).
    failure_seen: bool = False
    #: Every rank finished its rendezvous: the rendezvous watchdog is done.
    rdzv_complete: bool = False
    #: Seconds spent waiting for the notebook to answer a debugger (not counted as work).
    paused_for: float = 0.0


OnMessage = Callable[[Rank, _protocol.Message], None]
Notice = Callable[[str], None]


class Pump:
    """Reads the pipes of the ranks added to it; one ``select`` for all of them."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()

    def add(self, rank: Rank, kinds: tuple[str, ...] | None = None) -> None:
        """Watch ``rank``'s open pipes (all of them, or the ``kinds`` named)."""
        for kind, reader in rank.pipes.items():
            if (kinds is None or kind in kinds) and not reader.closed:
                self._selector.register(reader.fileno(), selectors.EVENT_READ, (rank, kind))

    def remove(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.fileno())

    def __call__(
        self, wait: float, router: OutputRouter, on_message: OnMessage, notice: Notice
    ) -> None:
        """Wait up to ``wait`` s for data; route what arrived. A pipe that closed is dropped."""
        for key, _ in self._selector.select(timeout=wait):
            rank, kind = key.data
            if kind != "control":
                if not rank.read_stream(kind, router):
                    self.remove(rank.pipes[kind])
                continue
            for item in rank.read_control():
                if isinstance(item, Exception):
                    notice(
                        f"could not read a message from rank {rank.outcome.rank} "
                        f"({type(item).__name__}: {item})."
                    )
                else:
                    on_message(rank, item)
            if rank.control_closed:
                self.remove(rank.pipes["control"])

    def close(self) -> None:
        self._selector.close()


def poll_exit(rank: Rank, now: float) -> None:
    """Note ``rank``'s exit code (and when: ``now``, or when its node saw it end) if its
    process has ended."""
    if rank.alive and rank.process is not None:
        code = rank.process.exit_code()
        if code is not None:
            rank.note_exit(code, now)
