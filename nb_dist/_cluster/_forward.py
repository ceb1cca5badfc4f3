"""Remote ranks as local ones: their pipe bytes forwarded into local pipes, their process
behind the kernel's ``WorkerProcess`` interface.

Runs in the kernel. For each rank the kernel makes its usual pipes (``Rank.open_pipes``); the
ends a local worker would hold stay here. :class:`Forwarder` long-polls every node agent
(``_node/_agent.py``) in one thread and writes the raw bytes it gets into those write ends
(raw bytes keep the control pipe's framing, so the kernel's parsing is unchanged), copies
each rank's collective counter into the kernel's mirror file, and records exit codes; a
second thread reads the ``commands`` pipes (kernel → rank) and sends what it reads to the
agents: to each agent in order, to different agents at once (a live cell's command reaches
every node in one round trip, not one per node). :class:`RemoteProcess` is a rank's process
for the supervisor: its exit code as the agent reported it, signals and kills through the
agent. An agent that dies (its node was lost) ends its ranks here, each with the reason as
its failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._node._outbox import Batch

#: How long one long poll waits on the node when nothing happens (also how stale the
#: kernel's copy of a silent rank's collective counts can be).
POLL_WAIT = 0.25
#: Seconds an agent call may take before the agent counts as gone.
CALL_LIMIT = 30.0

OnLost = Callable[[str, float], None]
_log = logging.getLogger(__name__)


class AgentLink:
    """The kernel's side of one agent in one run: the local pipe ends of its ranks, their
    exit codes, and whether the agent was lost (and why)."""

    def __init__(self, ray: Any, actor: Any, run: int, where: str) -> None:
        self.ray, self.actor, self.run, self.where = ray, actor, run, where
        self.writers: dict[tuple[int, str], Connection] = {}
        self.commands: dict[int, Connection] = {}
        self.mirrors: dict[int, str] = {}
        self.positions: list[int] = []
        #: Ranks still running when the agent was lost (their end is the loss).
        self.ended_by_loss: set[int] = set()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self.lost: str | None = None
        self.lost_at: float | None = None
        self._sent: Any = None  # the last send_in_order call's reference

    def add_rank(self, position: int, theirs: dict[str, Connection], mirror: str | None) -> None:
        """Rank ``position`` of this agent: the worker's ends of its local pipes."""
        self.positions.append(position)
        for kind, conn in theirs.items():
            if kind == "commands":
                self.commands[position] = conn
            else:
                self.writers[(position, kind)] = conn
        if mirror:
            self.mirrors[position] = mirror

    def call(self, method: str, *args: Any) -> Any:
        """Call the agent and wait (``None`` if it is gone)."""
        if self.lost is not None:
            return None
        try:
            return self.ray.get(getattr(self.actor, method).remote(self.run, *args),
                                timeout=CALL_LIMIT)  # fmt: skip
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
        with self._lock:
            return self._exits.get(position)

    def set_exit(self, position: int, code: int) -> None:
        with self._lock:
            self._exits.setdefault(position, code)

    def deliver(self, batch: Batch) -> None:
        """Write a poll's bytes into the local pipes, then note counters and exits."""
        for position, kind, data in batch.chunks:
            writer = self.writers.get((position, kind))
            if writer is None:
                continue
            if len(data) and _write_all(writer, data):
                continue
            writer.close()  # the pipe closed on the node (or nobody reads here any more)
            del self.writers[(position, kind)]
        for position, raw in batch.counters.items():
            mirror = self.mirrors.get(position)
            if mirror is not None:
                with contextlib.suppress(OSError):
                    fd = os.open(mirror, os.O_WRONLY)
                    try:
                        os.pwrite(fd, raw, 0)
                    finally:
                        os.close(fd)
        for position, code in batch.exits.items():
            self.set_exit(position, code)

    def lose(self, reason: str, close_pipes: bool = False) -> None:
        """The agent is gone: every rank of it has ended, with ``reason``. Only the poll
        thread (``close_pipes``) closes the write ends it writes to."""
        with self._lock:
            if self.lost is None:
                self.lost, self.lost_at = reason, time.monotonic()
        with self._lock:
            for position in self.positions:
                if position not in self._exits:
                    self._exits[position] = -signal.SIGKILL
                    self.ended_by_loss.add(position)
        if close_pipes:
            for key in list(self.writers):
                self.writers.pop(key).close()

    def close(self) -> None:
        """Close every local end still open (after the run)."""
        for conn in [*self.writers.values(), *self.commands.values()]:
            conn.close()
        self.writers.clear()
        self.commands.clear()


class RemoteProcess:
    """A rank on another node, behind the kernel's ``WorkerProcess`` interface."""

    def __init__(self, link: AgentLink, position: int, pid: int, on_lost: OnLost) -> None:
        self.pid = pid
        self._link, self._position, self._on_lost = link, position, on_lost
        self._told = False

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

    def kill_and_reap(self) -> int:
        code = self._link.exit_code(self._position)
        if code is None:
            reaped = self._link.call("kill_and_reap", self._position)
            code = int(reaped) if reaped is not None else -signal.SIGKILL
            self._link.set_exit(self._position, code)
        self.exit_code()  # a lost node is still the rank's failure
        return code


class Forwarder:
    """The two threads of one run: polls from the agents, commands to them."""

    def __init__(self, ray: Any, links: list[AgentLink]) -> None:
        self.ray, self.links = ray, links
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._threads = [
            threading.Thread(target=self._poll, name="nb_dist-cluster-poll", daemon=True),
            threading.Thread(target=self._commands, name="nb_dist-cluster-commands", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both threads and close every local end (the run is over)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        for link in self.links:
            with contextlib.suppress(Exception):
                link.actor.wake.remote(link.run)
        for thread in self._threads:
            thread.join(timeout=2 * POLL_WAIT + 1.0)
        for link in self.links:
            link.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _poll(self) -> None:
        try:
            self._poll_agents()
        except Exception as exc:  # a bug here must end the launch, never hang it
            _log.exception("nb_dist: the cluster forwarder failed")
            for link in self.links:
                link.lose(f"nb_dist's forwarder failed: {type(exc).__name__}", close_pipes=True)

    def _poll_agents(self) -> None:
        ray = self.ray
        pending = {link.actor.poll.remote(link.run, POLL_WAIT): link for link in self.links}
        while pending and not self._stop.is_set():
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_WAIT)
            if ready and len(pending) > 1:  # the other agents that answered meanwhile too
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            again = []
            for ref in ready:
                link = pending.pop(ref)
                try:
                    batch = ray.get(ref)
                except Exception as exc:
                    link.lose(_reason(exc), close_pipes=True)
                    continue
                if self._stop.is_set():
                    return
                link.deliver(batch)
                if not batch.over:
                    again.append(link)
            # Polled again only once every answer is delivered: each call costs a little,
            # and a rank's output or value waits for none of them.
            for link in again:
                pending[link.actor.poll.remote(link.run, POLL_WAIT)] = link

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


def _write_all(writer: Connection, data: Any) -> bool:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(writer.fileno(), view) :]
    except OSError:
        return False
    return True


def _is_gone(ray: Any, exc: BaseException) -> bool:
    errors = ray.exceptions
    return isinstance(exc, (errors.RayActorError, errors.GetTimeoutError))


def _reason(exc: BaseException) -> str:
    """What Ray said, by its exception's name only: its text (an RPC's "Connection reset by
    peer") would read as a failure caused by another rank's (``_diagnosis.looks_collateral``),
    and a lost node is a cause of its own. The whole text goes to the ``nb_dist`` log."""
    _log.info("nb_dist: a node agent is gone: %s", exc)
    return f"its agent stopped answering: {type(exc).__name__}"
