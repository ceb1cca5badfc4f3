"""One rank as the kernel sees it: its process, its pipes, and what it has reported.

The supervisor owns the loop; a :class:`Rank` turns the bytes that arrive on its pipes into
lines for the cell, stack dumps, protocol messages, and its returned value.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .._shared import _collectives, _protocol, _values
from .._shared._reporting import ReportEntry, Reports
from .._starter._parts import open_rank_pipes
from .._starter._processes import RankProcess, end_all, signal_name
from ._diagnosis import Frame, RendezvousView, StuckRank, ended_without_value
from ._errors import RankOutcome, RankStatus
from ._output import LineSplitter, OutputRouter
from ._tracebacks import format_frames, parse_fault_dump, relabel_cells

FINAL: tuple[RankStatus, ...] = ("ok", "failed", "collateral", "stopped")


@dataclass
class RendezvousState:
    """A rank's rendezvous as it reported it (see _rendezvous.py)."""

    entered_at: float | None = None
    done: bool = False
    world_size: int | None = None
    endpoint: str | None = None


class Rank:
    """One rank: started by the supervisor, fed by its pipes, finalized once it ended."""

    def __init__(self, index: int, rank: int, local_rank: int) -> None:
        #: This rank's index among the kernel's ranks (its pipes, its output's place, its log).
        self.index = index
        #: Its ``LOCAL_RANK`` (on a cluster: on its node), as its outcome reports it.
        self.local_rank = local_rank
        self.outcome = RankOutcome(rank=rank, local_rank=self.local_rank, status="starting")
        self.process: RankProcess | None = None
        self.pipes: dict[str, Connection] = {}
        self.commands: Connection | None = None  # kernel → rank
        self.control: _protocol.ControlReader | None = None  # reads pipes["control"]
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.stack = bytearray()
        self.thread_ident: int | None = None  # from Hello: whose stack to read
        self.value: Any = None
        self.result: _protocol.Result | None = None  # set once the value has arrived
        self.failure: _protocol.Failed | None = None
        self.rendezvous = RendezvousState()
        #: Added to the times the rank stamps (its machine's monotonic clock): 0 on this
        #: machine, the node's measured offset for a rank on a cluster node.
        self.clock_offset = 0.0
        self.returncode: int | None = None
        #: When the kernel learned that the rank ended (its pipes are drained from then on),
        #: and when it ended (earlier for a rank on another node: its node's report).
        self.exited_at: float | None = None
        self.ended_at: float | None = None
        self.control_closed_at: float | None = None
        self.stop_requested = False
        # The rank's debugger (_debug.py): its prompt waiting for a line, what it printed.
        self.prompt: _protocol.DebugPrompt | None = None
        self.debugging = False
        self.debug_text = ""
        # A live rank: the last task it finished and how many collectives it had entered.
        self.idle_task: int | None = None
        self.tasks_sent = 0  # the rank is idle when idle_task == tasks_sent
        self.collectives = 0

    def begin_task(self) -> None:
        """Forget the last task (a live rank): a fresh outcome, no value, no failure. Its
        status is kept: only the supervisor's ``set_status`` changes a status."""
        self.outcome = RankOutcome(
            rank=self.outcome.rank, local_rank=self.local_rank, status=self.outcome.status,
            pid=self.outcome.pid,
        )  # fmt: skip
        self.value, self.result, self.failure = None, None, None
        self.stack.clear()
        self.stop_requested = False

    def blame(self, exc_type: str, message: str) -> None:
        """Name what ended this rank's task, as the kernel found it (a skipped collective),
        not an exception of its own."""
        self.outcome.exc_type, self.outcome.message = exc_type, message

    def request_stop(self) -> None:
        """The kernel is stopping this rank: its end is not a failure of its own, unless its
        process had ended before the stop reached it (``RankProcess.ended_unasked``)."""
        self.stop_requested = True

    def task_sent(self, command: _protocol.Command) -> bool:
        """Send a live rank its next task (counted: the counts must match its ``Idle``)."""
        self.tasks_sent += 1
        return self.send(command)

    def take_prompt(self) -> _protocol.DebugPrompt | None:
        """The debugger prompt waiting for an answer, if any (it is answered once)."""
        prompt, self.prompt = self.prompt, None
        return prompt

    def quit_debugger(self) -> None:
        """Answer a waiting prompt with ``q``: the rank's debugger ends (no SIGINT there)."""
        self.prompt, self.debugging = None, False
        self.send(_protocol.DebugInput("q"))

    def take_debug_text(self, more: str = "") -> str:
        """What the rank's debugger printed and the cell has not shown yet (and ``more``)."""
        text, self.debug_text = self.debug_text + more, ""
        return text

    def attach(self, process: RankProcess, clock_offset: float = 0.0) -> None:
        """The rank's process has started (on a cluster node: ``clock_offset`` puts the
        node's times on the kernel's clock)."""
        self.process = process
        self.outcome.pid = process.pid
        self.clock_offset = clock_offset

    def kill(self, stop: bool = True) -> None:
        """Kill and reap the rank's process if it still runs (``stop``: as the kernel's own
        stop, not a failure of the rank), noting its exit code and when it ended."""
        kill_all([self], stop)

    def note_exit(self, code: int, now: float) -> None:
        """The process ended by itself with ``code``; ``now`` when the kernel saw it, its
        end on the process's own clock where that is known (a cluster node's)."""
        assert self.process is not None
        self.returncode, self.exited_at = code, now
        self.ended_at = self.process.ended_at() or now

    def lose(self, failure: _protocol.Failed) -> None:
        """The rank's node was lost: that is its failure, unless it had one already."""
        if self.failure is None:
            self.failure = failure

    @property
    def alive(self) -> bool:
        return self.process is not None and self.returncode is None

    @property
    def finished(self) -> bool:
        return self.outcome.status in FINAL

    def open_pipes(self) -> dict[str, Connection]:
        """Create this rank's pipes; keep the kernel's ends, return the rank's.

        Four carry what the rank says (the kernel reads them); ``commands`` goes the other
        way (the debugger's answers, a live rank's tasks)."""
        pipes = open_rank_pipes()
        self.pipes, self.commands = pipes.readers, pipes.commands
        self.control = _protocol.ControlReader(self.pipes["control"])
        return pipes.theirs

    def kernel_ends(self) -> list[Connection]:
        """Every pipe end the kernel holds for this rank (a forked rank closes them all)."""
        return [*self.pipes.values(), *([self.commands] if self.commands is not None else [])]

    def send(self, command: _protocol.Command) -> bool:
        """Send a command to the rank; False if it can no longer receive one."""
        if self.commands is None or self.commands.closed:
            return False
        try:
            _protocol.send(self.commands, command)
        except (OSError, EOFError):
            return False
        return True

    def settle(self) -> RankStatus:
        """Record how the finished rank ended (exit status, exception, duration); the
        status that follows from it."""
        out, code, failure = self.outcome, self.returncode, self.failure
        out.duration = self.result.duration if self.result is not None else None
        if code is not None and code < 0:
            out.signal_name = signal_name(-code)
        elif code is not None:
            out.exit_code = code
        if failure is not None:
            self._record_failure(failure)
            return "failed"
        if self.result is not None and code == 0:
            return "ok"
        ended_on_its_own = self.process is not None and self.process.ended_unasked()
        if self.stop_requested and not ended_on_its_own:
            return "stopped"
        ends = [t for t in (self.control_closed_at, self._ended()) if t is not None]
        out.failed_at = min(ends) if ends else None
        out.message = ended_without_value(code, out.signal_name)
        return "failed"

    def _ended(self) -> float | None:
        return self.ended_at if self.ended_at is not None else self.exited_at

    def _record_failure(self, failure: _protocol.Failed) -> None:
        out = self.outcome
        out.exc_type, out.message, out.failed_at = failure.exc_type, failure.message, failure.at
        out.traceback = relabel_cells(failure.traceback)

    def ask_for_stack(self) -> bool:
        """Ask the rank for its Python stack (SIGUSR1 → faulthandler); False if it cannot
        answer (only ranks that said hello have faulthandler, SIGUSR1 would kill others)."""
        if not (self.alive and self.thread_ident is not None and self.process is not None):
            return False
        self.stack.clear()
        try:
            self.process.signal_leader(signal.SIGUSR1)
        except ProcessLookupError:
            return False
        return True

    def read_stack(self) -> list[Frame]:
        """The stack the rank dumped (its function's thread), also kept on the outcome."""
        dump = self.stack.decode("utf-8", "replace")
        frames = parse_fault_dump(dump, self.thread_ident)
        self.outcome.stack = format_frames(frames)
        return frames

    def read_stream(self, kind: str, router: OutputRouter) -> bool:
        """Read what is waiting on ``stdout``/``stderr``/``stack``; False once it closed."""
        try:
            data = os.read(self.pipes[kind].fileno(), 65536)
        except OSError:
            data = b""
        if not data:
            if kind in self.splitters:
                router.lines(self.index, kind, self.splitters[kind].flush())
            return False
        if kind == "stack":
            self.stack.extend(data)
        else:
            router.lines(self.index, kind, self.splitters[kind].feed(data))
        return True

    def drain_streams(self, router: OutputRouter, by: float) -> None:
        """Read what already waits in the output pipes, without waiting for more (until the
        deadline ``by``, ``time.monotonic``, shared by every rank of a teardown: a grandchild
        may keep writing). A rank whose control pipe closed is finished while up to a pipe's
        worth of its last output may still be unread (on a cluster, the forwarder writes a
        rank's last bytes just before its exit is noted)."""
        deadline = by
        for kind in ("stdout", "stderr", "stack"):
            reader = self.pipes.get(kind)
            while (
                reader is not None
                and not reader.closed
                and time.monotonic() < deadline
                and select.select([reader.fileno()], [], [], 0)[0]
                and self.read_stream(kind, router)
            ):
                pass

    def read_control(self) -> list[_protocol.Message | Exception]:
        """The control messages that have arrived whole (a :class:`~_protocol.Result` once
        its value has, the value then in :attr:`value`) and the errors of frames that did not
        decode; never waits for more. :attr:`control_closed` once the pipe has closed."""
        assert self.control is not None
        arrived: list[_protocol.Message | Exception] = []
        for item in self.control.read():
            if isinstance(item, _protocol.Value):
                self._take_value(item)
                item = item.result
            if not isinstance(item, Exception):
                item = _protocol.on_kernel_clock(item, self.clock_offset)
            arrived.append(item)
        if self.control.closed and self.control_closed_at is None:
            # A value cut off here means the rank died while sending it (e.g. the OOM
            # killer): its exit status tells the user what happened.
            self.control_closed_at = time.monotonic()
        return arrived

    @property
    def control_closed(self) -> bool:
        return self.control is None or self.control.closed

    def _take_value(self, value: _protocol.Value) -> None:
        try:
            self.value = _values.loads(value.data, value.buffers)
            self.result = value.result
        except Exception as exc:
            self.failure = _protocol.Failed(
                "UnpicklableResultError",
                f"the kernel could not unpickle the value returned by rank "
                f"{self.outcome.rank} ({type(exc).__name__}: {exc}). Return plain data "
                "(numbers, lists, dicts, tensors) or objects of classes the kernel can import.",
                "",
                time.monotonic(),
            )

    def handle(
        self,
        message: _protocol.Message,
        router: OutputRouter,
        observer: Any,
        reports: Reports,
        imports: set[str],
    ) -> RankStatus | None:
        """Act on one control message; the status it moves this rank to, if any."""
        local = self.index
        match message:
            case _protocol.Hello(thread_ident=ident):
                self.thread_ident = ident
                return "running"
            case _protocol.ReportBatch(values=values):
                entries = self.add_reports(values, reports, router)
                if observer is not None and entries:
                    observer.reports(local, entries)
            case _protocol.Progress(key=key, count=count, total=total):
                if observer is not None:
                    observer.progress(local, key, count, total)
            case _protocol.Rendezvous(stage="enter", at=at, world_size=size, endpoint=where):
                self.rendezvous = RendezvousState(at, False, size, where)
            case _protocol.Rendezvous():
                self.rendezvous.done = True
            case _protocol.Display(data=data, metadata=meta, display_id=ident, update=update):
                router.display(local, data, meta, ident, update)
            case _protocol.ClearOutput(wait=wait):
                router.clear_output(local, wait)
            case _protocol.Returned(at=at):
                self.outcome.returned_at = at
            case _protocol.Imports(names=names):
                imports.update(names)
            case _protocol.Failed():
                self.failure = message
            case _protocol.Result():
                pass  # the value arrived with it (read_control)
            case _protocol.DebugPrompt(text=text, prompt=None):
                self.debugging, self.prompt = False, None
                self.debug_text += text
            case _protocol.DebugPrompt():
                self.debugging, self.prompt = True, message
            case _protocol.Idle(task=task, collectives=count):
                self.idle_task, self.collectives = task, count
                self.outcome.duration = self.result.duration if self.result else None
                if self.failure is not None:
                    self._record_failure(self.failure)
                    return "failed"
                return "ok"
            case _:  # pragma: no cover - decode() admits only the classes above
                raise AssertionError(f"rank {self.outcome.rank}: unexpected {message!r}")
        return None

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

    def stuck_view(
        self, was_live: bool, frames: list[Frame] | None, counter: str | None = None
    ) -> StuckRank:
        """This rank for a timeout report (``frames``: its stack, if one was taken;
        ``counter``: its collective counter file)."""
        out = self.outcome
        counts = _collectives.read(counter) if counter else None
        if out.returned_at is not None and was_live:
            return StuckRank(out.rank, "teardown", collectives=counts)
        if frames is not None:
            return StuckRank(out.rank, "blocked", frames=tuple(frames), collectives=counts)
        if was_live:
            return StuckRank(out.rank, "starting", collectives=counts)
        return StuckRank(out.rank, "ended", outcome=out.describe(), collectives=counts)

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


def kill_all(ranks: list[Rank], stop: bool = True) -> None:
    """Kill and reap every rank in ``ranks`` that still runs, all groups at once and reaped by
    one deadline (``_processes.end_all``), noting each exit code and when it ended; ``stop``:
    the kernel's own stop, not a failure of the ranks."""
    live = [rank for rank in ranks if rank.alive and rank.process is not None]
    if stop:
        for rank in live:
            rank.request_stop()
    codes = end_all([rank.process for rank in live if rank.process is not None])
    now = time.monotonic()
    for rank, code in zip(live, codes, strict=True):
        rank.returncode, rank.exited_at = code, now
