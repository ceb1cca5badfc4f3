"""One rank as the kernel sees it: its process, its pipes, and what it has reported.

The supervisor owns the loop; a :class:`Rank` turns the bytes that arrive on its pipes into
lines for the cell, stack dumps, protocol messages, and its returned value.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from . import _protocol
from ._diagnosis import Frame, RendezvousView, StuckRank
from ._errors import RankOutcome, RankStatus
from ._output import LineSplitter, OutputRouter
from ._processes import WorkerProcess
from ._reporting import ReportEntry, Reports

FINAL: tuple[RankStatus, ...] = ("ok", "failed", "collateral", "stopped")
PIPES = ("stdout", "stderr", "control", "stack")


@dataclass
class Rendezvous:
    """A rank's rendezvous as it reported it (see _rendezvous.py)."""

    entered_at: float | None = None
    done: bool = False
    world_size: int | None = None
    endpoint: str | None = None


class Rank:
    """One worker: started by the supervisor, fed by its pipes, finalized once it ended."""

    def __init__(self, local_rank: int, rank: int) -> None:
        self.local_rank = local_rank
        self.outcome = RankOutcome(rank=rank, local_rank=local_rank, status="starting")
        self.process: WorkerProcess | None = None
        self.pipes: dict[str, Connection] = {}
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.stack = bytearray()
        self.thread_ident: int | None = None  # from Hello: whose stack to read
        self.value: Any = None
        self.result: _protocol.Result | None = None  # set once the value has arrived
        self.failure: _protocol.Failed | None = None
        self.rendezvous = Rendezvous()
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.control_closed_at: float | None = None
        self.stop_requested = False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.returncode is None

    @property
    def finished(self) -> bool:
        return self.outcome.status in FINAL

    def read_stream(self, kind: str, router: OutputRouter) -> bool:
        """Read what is waiting on ``stdout``/``stderr``/``stack``; False once it closed."""
        try:
            data = os.read(self.pipes[kind].fileno(), 65536)
        except OSError:
            data = b""
        if not data:
            if kind in self.splitters:
                router.lines(self.local_rank, kind, self.splitters[kind].flush())
            return False
        if kind == "stack":
            self.stack.extend(data)
        else:
            router.lines(self.local_rank, kind, self.splitters[kind].feed(data))
        return True

    def read_message(self) -> _protocol.Message | None:
        """The next control message (a :class:`~_protocol.Result` with its value read);
        ``None`` once the pipe closed. ``TypeError``/pickle errors for a bad frame."""
        try:
            message = _protocol.decode(self.pipes["control"].recv_bytes())
        except (EOFError, OSError):
            self.control_closed_at = time.monotonic()
            return None
        if isinstance(message, _protocol.Result) and not self._read_value(message):
            return None
        return message

    def _read_value(self, result: _protocol.Result) -> bool:
        try:
            data = _protocol.read_raw(self.pipes["control"], result.size)
        except (EOFError, OSError):
            # The worker died while sending its value (e.g. the OOM killer): its exit status
            # tells the user what happened, not a bare EOFError from the loop.
            self.control_closed_at = time.monotonic()
            return False
        try:
            self.value = pickle.loads(data)
            self.result = result
        except Exception as exc:
            self.failure = _protocol.Failed(
                "UnpicklableResultError",
                f"the kernel could not unpickle the value returned by rank "
                f"{self.outcome.rank} ({type(exc).__name__}: {exc}). Return plain data "
                "(numbers, lists, dicts, tensors) or objects of classes the kernel can import.",
                "",
                time.monotonic(),
            )
        return True

    def add_reports(
        self, values: tuple[_protocol.ReportValue, ...], reports: Reports, router: OutputRouter
    ) -> list[tuple[str, ReportEntry]]:
        """Add a batch to ``reports``, value by value; the entries that arrived."""
        rank, offset = self.outcome.rank, time.time() - time.monotonic()
        entries = []
        for item in values:
            try:
                value = item.value()
            except Exception as exc:  # one value the kernel cannot read costs only itself
                router.notice(
                    f"report({item.name!r}, ...) from rank {rank}: the kernel cannot read a "
                    f"{item.type_name} ({type(exc).__name__}: {exc}). Report numbers, tensors, "
                    "arrays or dicts/lists of those, or objects of classes the kernel imports."
                )
                continue
            entry = reports.add(rank, item.name, item.step, item.at + offset, value)
            entries.append((item.name, entry))
        return entries

    def stuck_view(self, was_live: bool, frames: list[Frame] | None) -> StuckRank:
        """This rank for a timeout report (``frames``: its stack, if one was taken)."""
        out = self.outcome
        if out.returned_at is not None and was_live:
            return StuckRank(out.rank, "teardown")
        if frames is not None:
            return StuckRank(out.rank, "blocked", frames=tuple(frames))
        if was_live:
            return StuckRank(out.rank, "starting")
        return StuckRank(out.rank, "ended", outcome=out.describe())

    def rendezvous_view(
        self, now: float, was_live: bool, frames: list[Frame] | None
    ) -> RendezvousView:
        """This rank for a rendezvous report."""
        out, rdzv = self.outcome, self.rendezvous
        if was_live and out.returned_at is None:
            state = "running"
        elif out.returned_at is not None or out.status == "ok":
            state = "returned"
        else:
            state = out.describe()
        return RendezvousView(
            rank=out.rank,
            waited=None if rdzv.entered_at is None else now - rdzv.entered_at,
            done=rdzv.done,
            asked_world_size=rdzv.world_size,
            endpoint=rdzv.endpoint,
            state=state,
            frames=tuple(frames) if frames is not None else None,
        )
