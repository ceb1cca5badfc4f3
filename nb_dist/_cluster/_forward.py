"""Remote ranks as local ones: their pipe bytes forwarded into local pipes, their process
behind the kernel's ``RankProcess`` interface.

Runs in the kernel. For each rank the kernel makes its usual pipes (``Rank.open_pipes``); the
ends a local rank would hold stay here. :class:`Forwarder` long-polls every node agent
(``_node/_agent.py``), one thread per agent, and writes the raw bytes it gets into those
write ends (raw bytes keep the control pipe's framing, so the kernel's parsing is unchanged), copies
each rank's collective counter into the kernel's mirror file, and records exit codes and
when each rank ended on its node's clock. The writes never block: what a full pipe cannot
take waits in the link's backlog, written as the kernel reads, while every other rank's
bytes go on flowing (two ranks returning 64 MB each cannot wait on each other); an agent
with a large backlog is polled again once it has shrunk, so memory stays bounded. A
second thread reads the ``commands`` pipes (kernel → rank) and sends what it reads to the
agents: to each agent in order, to different agents at once (a live cell's command reaches
every node in one round trip, not one per node). :class:`RemoteProcess` is a rank's process
for the supervisor: its exit code as the agent reported it, signals and kills through the
agent. An agent that dies (its node was lost) ends its ranks here, each with the reason as
its failure.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import select
import selectors
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from .._node._outbox import Batch
from .._starter._parts import hold_out_of_forks
from .._starter._processes import REAP_WITHIN

#: How long one long poll waits on the node when nothing happens (also how stale the
#: kernel's copy of a silent rank's collective counts can be).
POLL_WAIT = 0.25
#: Seconds an agent call may take before the agent counts as gone.
CALL_LIMIT = 30.0
#: A rank's kill and reap on its node waits what is left of the teardown's deadline; its
#: answer may take this much longer to arrive (a round trip on a loaded cluster).
ANSWER_MARGIN = 2.0
#: An agent is not polled again while this many of its bytes wait for the kernel to read.
BACKLOG_LIMIT = 16 << 20
#: How long the poll thread waits for a full pipe to take more before it looks at the
#: agents' answers again.
BACKLOG_WAIT = 0.01

OnLost = Callable[[str, float], None]
_log = logging.getLogger(__name__)


class _Exit(NamedTuple):
    """A rank's end as its node reported it: its exit code, when it ended (on the kernel's
    clock, if known) and whether it had ended before any signal to stop it."""

    code: int
    at: float | None = None
    unasked: bool = False


class AgentLink:
    """The kernel's side of one agent in one run: the local pipe ends of its ranks, the bytes
    still to write into them, their exit codes, and whether the agent was lost (and why)."""

    def __init__(self, ray: Any, actor: Any, run: int, where: str, offset: float = 0.0) -> None:
        self.ray, self.actor, self.run, self.where = ray, actor, run, where
        #: Added to a time on the node's monotonic clock to put it on the kernel's.
        self.offset = offset
        self.writers: dict[tuple[int, str], Connection] = {}
        self.commands: dict[int, Connection] = {}
        self.mirrors: dict[int, str] = {}
        self.positions: list[int] = []
        #: Ranks still running when the agent was lost (their end is the loss).
        self.ended_by_loss: set[int] = set()
        #: Each ended rank's exit: its code, when it ended on the kernel's clock (if its node
        #: said), and whether it had ended before any signal to stop it.
        self._exits: dict[int, _Exit] = {}
        self._lock = threading.Lock()
        self.lost: str | None = None
        self.lost_at: float | None = None
        self._sent: Any = None  # the last send_in_order call's reference
        # Bytes a full pipe could not take yet, by pipe; pipes to close once written; exits
        # noted once their rank's bytes are all written (only the poll thread uses these).
        self._backlog: dict[tuple[int, str], collections.deque[memoryview]] = {}
        self._closing: set[tuple[int, str]] = set()
        self._held_exits: dict[int, _Exit] = {}
        self.backlog_bytes = 0

    def add_rank(self, position: int, theirs: dict[str, Connection], mirror: str | None) -> None:
        """Rank ``position`` of this agent: the rank's ends of its local pipes."""
        self.positions.append(position)
        for kind, conn in theirs.items():
            if kind == "commands":
                self.commands[position] = conn
            else:
                os.set_blocking(conn.fileno(), False)  # see deliver()
                self.writers[(position, kind)] = conn
        if mirror:
            self.mirrors[position] = mirror

    def call(self, method: str, *args: Any, limit: float = CALL_LIMIT) -> Any:
        """Call the agent and wait, ``limit`` s at most (``None`` if it is gone; an agent
        that does not answer within ``limit`` is taken for gone)."""
        if self.lost is not None:
            return None
        try:
            return self.ray.get(getattr(self.actor, method).remote(self.run, *args),
                                timeout=limit)  # fmt: skip
        except Exception as exc:
            if _is_gone(self.ray, exc):
                self.lose(_reason(exc))
                return None
            raise

    def send_in_order(self, method: str, *args: Any) -> None:
        """Call the agent without waiting for its answer, once its previous such call has
        ended (a threaded actor may run two calls at once, in either order): commands to
        different agents travel at once, those to one agent in the order they were sent."""
        self.settle()
        if self.lost is None:
            self._sent = getattr(self.actor, method).remote(self.run, *args)

    def settle(self) -> None:
        """Wait for the last :meth:`send_in_order` call to end (a gone agent is lost)."""
        sent, self._sent = self._sent, None
        if sent is None or self.lost is not None:
            return
        try:
            self.ray.get(sent, timeout=CALL_LIMIT)
        except Exception as exc:
            if not _is_gone(self.ray, exc):
                raise
            self.lose(_reason(exc))

    def exit_code(self, position: int) -> int | None:
        exit = self._exit_of(position)
        return exit.code if exit is not None else None

    def ended_at(self, position: int) -> float | None:
        """When the rank ended as its node saw it, on the kernel's clock (if it has)."""
        exit = self._exit_of(position)
        return exit.at if exit is not None else None

    def ended_unasked(self, position: int) -> bool:
        """Whether the rank had ended before any signal to stop it (its node says)."""
        exit = self._exit_of(position)
        return exit is not None and exit.unasked

    def _exit_of(self, position: int) -> _Exit | None:
        with self._lock:
            return self._exits.get(position)

    def set_exit(self, position: int, exit: _Exit) -> None:
        with self._lock:
            self._exits.setdefault(position, exit)

    def deliver(self, batch: Batch) -> None:
        """Queue a poll's bytes for the local pipes and write what they take now; note the
        counters; note each exit once its rank's bytes are all written (the kernel reads a
        rank's last output and its value before it learns that the rank ended)."""
        for position, kind, data in batch.chunks:
            key = (position, kind)
            if key not in self.writers:
                continue
            if len(data):
                view = memoryview(data).cast("B")
                self._backlog.setdefault(key, collections.deque()).append(view)
                self.backlog_bytes += view.nbytes
            else:
                self._closing.add(key)  # the pipe closed on the node
        for position, raw in batch.counters.items():
            mirror = self.mirrors.get(position)
            if mirror is not None:
                with contextlib.suppress(OSError):
                    fd = os.open(mirror, os.O_WRONLY)
                    try:
                        os.pwrite(fd, raw, 0)
                    finally:
                        os.close(fd)
        for position, (code, at, unasked) in batch.exits.items():
            self._held_exits[position] = _Exit(code, at + self.offset, unasked)
        self.flush()

    def flush(self) -> None:
        """Write what each pipe takes now, never waiting for one: a full pipe keeps its
        bytes for a later turn, and every other pipe is written meanwhile."""
        for key in list(self._backlog):
            queue, writer = self._backlog[key], self.writers.get(key)
            try:
                while queue and writer is not None:  # None: closed since (the run ended)
                    written = os.write(writer.fileno(), queue[0])
                    self.backlog_bytes -= written
                    queue[0] = queue[0][written:]
                    if not queue[0].nbytes:
                        queue.popleft()
            except BlockingIOError:
                continue
            except OSError:  # nobody reads here any more: drop the bytes, close the pipe
                self._closing.add(key)
            self.backlog_bytes -= sum(view.nbytes for view in queue)
            del self._backlog[key]
        for key in [k for k in self._closing if k not in self._backlog]:
            self._closing.discard(key)
            closing = self.writers.pop(key, None)
            if closing is not None:
                closing.close()
        for position in [p for p in self._held_exits if not self._waiting(p)]:
            self.set_exit(position, self._held_exits.pop(position))

    def _waiting(self, position: int) -> bool:
        return any(key[0] == position for key in self._backlog)

    def blocked(self) -> list[int]:
        """The file descriptors of pipes whose bytes wait for room."""
        return [self.writers[key].fileno() for key in self._backlog if key in self.writers]

    def lose(self, reason: str, close_pipes: bool = False) -> None:
        """The agent is gone: every rank of it has ended, with ``reason``. Only the poll
        thread (``close_pipes``) closes the write ends it writes to."""
        with self._lock:
            if self.lost is None:
                self.lost, self.lost_at = reason, time.monotonic()
        with self._lock:
            for position in self.positions:
                if position not in self._exits:
                    self._exits[position] = _Exit(-signal.SIGKILL)
                    self.ended_by_loss.add(position)
        if close_pipes:
            for key in list(self.writers):
                self.writers.pop(key).close()
            self._backlog.clear()
            self.backlog_bytes = 0

    def close(self) -> None:
        """Close every local end still open (after the run)."""
        for conn in [*self.writers.values(), *self.commands.values()]:
            conn.close()
        self.writers.clear()
        self.commands.clear()


class RemoteProcess:
    """A rank on another node, behind the kernel's ``RankProcess`` interface."""

    def __init__(self, link: AgentLink, position: int, pid: int, on_lost: OnLost) -> None:
        self.pid = pid
        self._link, self._position, self._on_lost = link, position, on_lost
        self._told = False

    def ended_at(self) -> float | None:
        return self._link.ended_at(self._position)

    def ended_unasked(self) -> bool:
        return self._link.ended_unasked(self._position)

    def exit_code(self) -> int | None:
        code = self._link.exit_code(self._position)
        if self._position in self._link.ended_by_loss and not self._told:
            self._told = True
            reason = self._link.lost or "its agent is gone"
            self._on_lost(reason, self._link.lost_at or time.monotonic())
        return code

    def send_signal(self, sig: int) -> None:
        self._link.call("signal", self._position, sig, True)

    def signal_leader(self, sig: int) -> None:
        if not self._link.call("signal", self._position, sig, False):
            raise ProcessLookupError(self.pid)

    def kill_and_reap(self, within: float = REAP_WITHIN) -> int:
        code = self._link.exit_code(self._position)
        if code is None:
            # The agent waits ``within`` (what is left of the teardown's one deadline); its
            # answer is awaited that long and a round trip more, not CALL_LIMIT: an agent
            # that hangs costs the teardown little more than its deadline.
            reaped = self._link.call(
                "kill_and_reap", self._position, within, limit=within + ANSWER_MARGIN
            )
            code, unasked = -signal.SIGKILL, False
            if reaped is not None:
                code, unasked = int(reaped[0]), bool(reaped[1])
            self._link.set_exit(self._position, _Exit(code, unasked=unasked))
        self.exit_code()  # a lost node is still the rank's failure
        return code


class Forwarder:
    """The threads of one run: one poll thread per agent, one for commands to all of them.

    A thread per agent: one agent's answer is delivered while another's next poll is still
    being sent, so a live cell on N nodes waits for the slowest node, not for every node's
    poll in turn."""

    def __init__(self, ray: Any, links: list[AgentLink]) -> None:
        self.ray, self.links = ray, links
        self._stop = threading.Event()
        # Wakes the commands thread at stop; kept out of ranks forked here later, as every
        # pipe end of the run is.
        self._wake = multiprocessing.Pipe(duplex=False)
        hold_out_of_forks(self._wake)
        self._wake_r, self._wake_w = (end.fileno() for end in self._wake)
        self._threads = [
            threading.Thread(
                target=self._poll, args=(link,), name=f"nb_dist-cluster-poll-{number}",
                daemon=True,
            )
            for number, link in enumerate(links)
        ]  # fmt: skip
        self._threads.append(
            threading.Thread(target=self._commands, name="nb_dist-cluster-commands", daemon=True)
        )

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop every thread and close every local end (the run is over)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        for link in self.links:
            with contextlib.suppress(Exception):
                link.actor.wake.remote(link.run)
        for thread in self._threads:
            thread.join(timeout=2 * POLL_WAIT + 1.0)
            if thread.is_alive():  # a daemon thread: it ends when its call returns
                _log.warning("%s still waits on its agent after the run ended", thread.name)
        for link in self.links:
            link.close()
        for end in self._wake:
            end.close()

    def _poll(self, link: AgentLink) -> None:
        try:
            self._poll_agent(link)
        except Exception as exc:  # a bug here must end the launch, never hang it
            _log.exception("nb_dist: the cluster forwarder failed")
            link.lose(f"nb_dist's forwarder failed: {type(exc).__name__}", close_pipes=True)

    def _poll_agent(self, link: AgentLink) -> None:
        """Long-poll one agent until its run is over (or it is lost), writing what it sends
        into the local pipes. While its bytes wait for the kernel to read more than
        ``BACKLOG_LIMIT``, it is not polled again (its ranks' pipes on the node fill, and they
        wait); a full pipe is waited on a little at a time, the poll's answer looked at
        between."""
        ray = self.ray
        pending: Any = None
        over = False
        while not self._stop.is_set():
            idle = pending is None and not over and link.lost is None
            if idle and link.backlog_bytes <= BACKLOG_LIMIT:
                pending = link.actor.poll.remote(link.run, POLL_WAIT)
            blocked = link.blocked()
            if pending is None and not blocked:
                return
            wait = POLL_WAIT
            if blocked:
                _wait_for_room(blocked, BACKLOG_WAIT)
                link.flush()
                wait = 0.0
            if pending is None:
                continue
            ready, _ = ray.wait([pending], num_returns=1, timeout=wait)
            if not ready:
                continue
            try:
                batch = ray.get(pending)
            except Exception as exc:
                link.lose(_reason(exc), close_pipes=True)
                return
            pending = None
            if self._stop.is_set():
                return
            link.deliver(batch)
            over = batch.over

    def _commands(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        for link in self.links:
            for position, conn in link.commands.items():
                selector.register(conn.fileno(), selectors.EVENT_READ, (link, position, conn))
        try:
            while not self._stop.is_set():
                for key, _ in selector.select():
                    if key.data is None:
                        return
                    link, position, conn = key.data
                    try:
                        data = os.read(conn.fileno(), 1 << 20)
                    except OSError:
                        data = b""
                    if data:
                        link.send_in_order("write", position, data)
                    else:
                        selector.unregister(conn.fileno())
                        link.send_in_order("close_commands", position)
        finally:
            selector.close()
            for link in self.links:
                link.settle()


def _wait_for_room(fds: list[int], timeout: float) -> None:
    """Wait up to ``timeout`` s until one of the pipes ``fds`` can take bytes."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLOUT)
    with contextlib.suppress(OSError):
        poller.poll(timeout * 1000)


def _is_gone(ray: Any, exc: BaseException) -> bool:
    errors = ray.exceptions
    return isinstance(exc, (errors.RayActorError, errors.GetTimeoutError))


def _reason(exc: BaseException) -> str:
    """What Ray said, by its exception's name only: its text (an RPC's "Connection reset by
    peer") would read as a failure caused by another rank's (``_diagnosis.looks_collateral``),
    and a lost node is a cause of its own. The whole text goes to the ``nb_dist`` log."""
    _log.info("nb_dist: a node agent is gone: %s", exc)
    return f"its agent stopped answering: {type(exc).__name__}"
