"""The node agent: a Ray actor that starts, reads, signals and reaps one node's ranks.

The kernel (``nb_dist._cluster``) places one agent in each bundle of its placement group and
calls it for every launch: :meth:`NodeAgent.start` starts the node's ranks exactly as the
kernel starts local ones (``_starter``: forkserver or spawn, five pipes, the start gate, a
lifeline whose only write end the agent holds, so the ranks die with it), and a reader thread
moves what they write into an :class:`~_outbox.Outbox` that the kernel's long
:meth:`NodeAgent.poll` empties. The agent is a plain (non-detached) actor: it dies with the
kernel's Ray driver, and the ranks die with the agent.

The collective counters (``_shared/_collectives.py``) are files on the node; the agent reads
them and sends their raw bytes with each poll, so the kernel's mirror copies read as local.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from .._rank import _regroup
from .._rank._spec import RankSpec
from .._shared import _clock, _collectives, _cuda_touches
from .._shared._protocol import COLLECTIVES_ENV
from .._starter import _processes
from .._starter._parts import (
    DRAIN_AFTER_EXIT,
    Gate,
    host_store,
    open_rank_pipes,
    rank_files,
    scratch_folder,
)
from ._outbox import KINDS, Batch, Outbox

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Local:
    """One rank on this node: its process, the agent's ends of its pipes, its counter."""

    spec: RankSpec
    process: _processes.RankProcess
    readers: dict[str, Connection]
    commands: Connection
    counter: str
    open_kinds: set[str]
    exited_at: float | None = None
    reported: bool = False
    counts: bytes = b""
    #: multiprocessing's forkserver ``Popen`` reads its exit status from one pipe: the reader
    #: thread's polls and a kill's reap must not read it at once.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class NodeAgent:
    """One node's ranks for the kernel; every method is called through Ray."""

    def __init__(self, method: str = "forkserver") -> None:
        # ``import nb_dist`` waits for torch to record where CUDA is first touched, for a
        # launch to name; an agent never launches, and imports torch for its store only.
        _cuda_touches.stop()
        self._niceness = _node_niceness()
        self._forkserver: threading.Thread | None = None
        if method == "forkserver":  # its imports overlap the launch's other preparations
            self._forkserver = threading.Thread(
                target=_start_forkserver, args=(self._niceness,), name="nb_dist-forkserver",
                daemon=True,
            )  # fmt: skip
            self._forkserver.start()

        self._run = -1
        self._ranks: list[_Local] = []
        self._outbox = Outbox(-1)
        self._lifeline: Connection | None = None
        self._store: Any = None  # the rendezvous store of run _store_run, if hosted here
        self._store_run: int | None = None
        self._folder: str | None = None
        self._reader: threading.Thread | None = None
        self._stop_reading = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ where
    def where(self) -> tuple[str, str, str, str | None, int, str | None]:
        """(Ray node id, the node's cluster address, host name, the network interface of
        that address, cores, boot id): who this node is for ``LOCAL_RANK``/``NODE_RANK``,
        gloo, and whose clock its ranks' times are on."""
        import ray

        context = ray.get_runtime_context()
        address = ray.util.get_node_ip_address()
        return (
            context.get_node_id(),
            address,
            socket.gethostname(),
            _interface_of(address),
            len(os.sched_getaffinity(0)),
            _clock.boot_id(),
        )

    def ready(self, within: float) -> bool:
        """Whether the node's fork server is up (waiting up to ``within`` seconds), with the
        store's module imported here: a warm agent's first launch opens its store and forks
        its ranks at once instead of waiting for torch's imports (a second each)."""
        import torch.distributed  # noqa: F401 - what open_store imports, now

        if self._forkserver is not None:
            self._forkserver.join(within)
            return not self._forkserver.is_alive()
        return True

    def clock(self) -> float:
        """This node's ``time.monotonic()``, which its ranks stamp their messages with."""
        return time.monotonic()

    def open_store(self, run: int, address: str, world_size: int) -> int:
        """Host run ``run``'s rendezvous store (torch's TCPStore) here; its port (from the OS).
        It lives until that run ends here (:meth:`end_run`) or the next store replaces it."""
        store = host_store(address, None, world_size)
        with self._lock:
            self._store, self._store_run = store, run
        return int(store.port)

    # ------------------------------------------------------------------ a run
    def start(self, run: int, method: str, specs: list[RankSpec]) -> list[int]:
        """Start this node's ranks of run ``run`` (``specs`` in the kernel's order); their pids.

        As in the kernel (``_kernel/_local.py``): every rank is started before the gate
        opens, and one that cannot start takes the started ones with it."""
        with self._lock:
            _take_priority(self._niceness)  # before this thread starts a rank (or a server)
            self._end_ranks()
            self._run, self._outbox = run, Outbox(run)
            self._folder = scratch_folder("nb_dist_node_")

            def start_one(index: int, gate: Gate, context: BaseContext | None) -> None:
                self._ranks.append(self._start_one(specs[index], method, context, gate))

            self._lifeline = _processes.start_ranks(  # _end_ranks closes it
                method, len(specs), start_one, self._end_ranks, preload=True
            )
            self._stop_reading = threading.Event()
            self._reader = threading.Thread(
                target=self._read, args=(self._ranks, self._outbox, self._stop_reading),
                name="nb_dist-node-reader", daemon=True,
            )  # fmt: skip
            self._reader.start()
            return [local.process.pid for local in self._ranks]

    def _start_one(
        self,
        spec: RankSpec,
        method: str,
        context: BaseContext | None,
        gate: Gate,
    ) -> _Local:
        assert self._folder is not None
        files = rank_files(self._folder, spec.rank)  # on this node, not the kernel's
        counter = files[COLLECTIVES_ENV]
        spec = dataclasses.replace(
            spec, env={**spec.env, **files}, parent_pid=os.getpid(), close_fds=[]
        )
        pipes = open_rank_pipes()  # started as the kernel starts a local rank
        try:
            with _plain_main():
                process = _processes.start_on_pipes(method, spec, pipes.theirs, gate, context)
        except BaseException:
            for conn in (*pipes.readers.values(), pipes.commands):
                conn.close()  # no rank to read from or to write to
            raise
        return _Local(
            spec=spec,
            process=process,
            readers=pipes.readers,
            commands=pipes.commands,
            counter=counter,
            open_kinds=set(KINDS),
        )

    def poll(self, run: int, timeout: float) -> Batch:
        """What run ``run``'s ranks said since the last poll, waiting up to ``timeout`` s for
        something; ``over`` once the run ended here (a poll for another run: at once)."""
        outbox = self._outbox
        if run != outbox.run:
            return Batch(run, over=True)
        batch = outbox.take(timeout)
        for index, local in enumerate(list(self._ranks) if run == self._run else []):
            raw = _read_counter(local.counter)
            if raw and raw != local.counts:
                local.counts = batch.counters[index] = raw
        return batch

    def wake(self, run: int) -> None:
        """Let the waiting poll of run ``run`` return now."""
        if run == self._outbox.run:
            self._outbox.wake()

    def write(self, run: int, index: int, data: bytes) -> bool:
        """Kernel → rank bytes (``commands``: the debugger's answers, a live rank's tasks)."""
        local = self._rank(run, index)
        if local is None or local.commands.closed:
            return False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(local.commands.fileno(), view) :]
        except OSError:
            return False
        return True

    def close_commands(self, run: int, index: int) -> None:
        """The kernel closed its end of the rank's ``commands`` pipe: close this one."""
        local = self._rank(run, index)
        if local is not None:
            local.commands.close()

    def signal(self, run: int, index: int, sig: int, group: bool = True) -> bool:
        """Signal the rank's process group (``group``) or the rank alone; whether it was there."""
        local = self._rank(run, index)
        if local is None:
            return False
        if group:
            local.process.send_signal(sig)
            return True
        try:
            local.process.signal_leader(sig)
        except ProcessLookupError:
            return False
        return True

    def endpoints(self, run: int) -> list[tuple[str, int]]:
        """The TCP socket addresses of run ``run``'s ranks here, for idle ranks elsewhere to
        drop their connections to (freeing a rank blocked in a collective, ``_regroup.py``)."""
        ranks = list(self._ranks) if run == self._run else []
        return _regroup.endpoints(local.process.pid for local in ranks)

    def kill_and_reap(
        self, run: int, index: int, within: float = _processes.REAP_WITHIN
    ) -> tuple[int, bool]:
        """SIGKILL the rank's group and reap it (waiting ``within`` s at most): its exit
        code, and whether it had ended before any signal to stop it."""
        local = self._rank(run, index)
        if local is None:
            return -signal.SIGKILL, False
        with local.lock:
            code = local.process.kill_and_reap(within)
            return code, local.process.ended_unasked()

    def end_run(self, run: int) -> None:
        """The kernel is done with run ``run`` (started or not): kill what is left of it, and
        close its store. A late call for an earlier run leaves a later run's store alone."""
        with self._lock:
            if run == self._run:
                self._end_ranks()
            if run == self._store_run:
                self._store, self._store_run = None, None  # the server stops, the port is free

    def _rank(self, run: int, index: int) -> _Local | None:
        if run != self._run or not 0 <= index < len(self._ranks):
            return None
        return self._ranks[index]

    def _end_ranks(self) -> None:
        self._stop_reading.set()
        if self._reader is not None:
            self._reader.join(timeout=2.0)
            self._reader = None
        with contextlib.ExitStack() as held:
            for local in self._ranks:
                held.enter_context(local.lock)
            _processes.end_all([local.process for local in self._ranks])
        for local in self._ranks:
            for conn in (*local.readers.values(), local.commands):
                conn.close()
        self._ranks = []
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self._outbox.end()

    # ------------------------------------------------------------------ the reader thread
    @staticmethod
    def _read(ranks: list[_Local], outbox: Outbox, stop: threading.Event) -> None:
        """Move what the ranks write into ``outbox`` until every rank has ended and been
        reported (or the run ends)."""
        selector = selectors.DefaultSelector()
        for index, local in enumerate(ranks):
            for kind, reader in local.readers.items():
                selector.register(reader.fileno(), selectors.EVENT_READ, (index, kind))
        try:
            while not stop.is_set() and not all(local.reported for local in ranks):
                ready = {key.data for key, _ in selector.select(timeout=0.02)}
                for index, local in enumerate(ranks):
                    for kind in KINDS:  # output first, then control (see KINDS)
                        if (index, kind) in ready and not _read_once(local, index, kind, outbox):
                            selector.unregister(local.readers[kind].fileno())
                    _check_exit(local, index, outbox)
        except Exception:  # a bug here must end the ranks' run, never leave the kernel waiting
            _log.exception("nb_dist: the node agent's reader failed; its ranks are stopped")
            left = [(index, local) for index, local in enumerate(ranks) if not local.reported]
            with contextlib.ExitStack() as held:  # all killed at once, reaped by one deadline
                for _, local in left:
                    held.enter_context(local.lock)
                codes = _processes.end_all([local.process for _, local in left])
            for (index, local), code in zip(left, codes, strict=True):
                for kind in sorted(local.open_kinds):
                    outbox.add(index, kind, b"")
                local.reported = True
                at = local.exited_at or time.monotonic()
                outbox.exited(index, code, at, local.process.ended_unasked())
        finally:
            selector.close()


def _read_once(local: _Local, index: int, kind: str, outbox: Outbox) -> bool:
    """One ``os.read`` of a pipe into the outbox; False once it closed."""
    try:
        data = os.read(local.readers[kind].fileno(), 1 << 20)
    except OSError:
        data = b""
    outbox.add(index, kind, data)
    if not data:
        local.open_kinds.discard(kind)
    return bool(data)


def _check_exit(local: _Local, index: int, outbox: Outbox) -> None:
    """Report the rank's exit code once its pipes are drained (or after a grace)."""
    if local.reported:
        return
    with local.lock:
        code = local.process.exit_code()
    if code is None:
        return
    now = time.monotonic()
    local.exited_at = local.exited_at or now
    if not local.open_kinds or now - local.exited_at > DRAIN_AFTER_EXIT:
        local.reported = True
        outbox.exited(index, code, local.exited_at, local.process.ended_unasked())


def _node_niceness() -> int | None:
    """The raylet's niceness (this agent's parent), which the ranks take back.

    Ray starts its workers, this agent among them, at niceness 15 so that the raylet stays
    responsive; ranks that inherited it would get a sliver of a busy node's CPUs (a spawned
    rank took 50 s to import torch beside two busy processes, instead of 3 s)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, os.getppid())
    except OSError:
        return None


def _take_priority(niceness: int | None) -> None:
    """Run the calling thread at ``niceness`` where that is lower than its own and the system
    allows it (root, CAP_SYS_NICE or RLIMIT_NICE); otherwise leave it.

    Linux keeps a niceness per thread, and a process inherits the one of the thread that
    started it: the threads that start ranks and the fork server take it, the agent's Ray
    threads keep Ray's."""
    if niceness is None:
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, thread) > niceness:
            os.setpriority(os.PRIO_PROCESS, thread, niceness)


def _start_forkserver(niceness: int | None) -> None:
    """Start the node's fork server now (it imports torch and nb_dist once), not at the first
    rank's start; a failure here shows at that start instead."""
    from multiprocessing import forkserver

    _take_priority(niceness)
    with contextlib.suppress(Exception), _plain_main():
        _processes.forkserver_context(True)
        forkserver.ensure_running()


# Who holds the stand-in ``__main__`` (the forkserver's warm-up thread and a start may
# overlap): the real module is put back when the last one leaves, never a stand-in.
_main_lock = threading.Lock()
_main_holders = 0
_real_main: types.ModuleType | None = None


@contextlib.contextmanager
def _plain_main() -> Iterator[None]:
    """While a rank starts, ``__main__`` is an empty module, not Ray's worker script.

    multiprocessing tells a forkserver (or spawn) child to import the parent's ``__main__``
    as ``__mp_main__``; in an agent that is ``ray/_private/workers/default_worker.py``, whose
    import costs each rank seconds and whose code has no business in a rank.

    The swap is process-wide, and safe: Ray ran that script once, at the worker's start, and
    nothing in an agent reads ``__main__`` afterwards but multiprocessing's start (what Ray
    sends an agent's methods is nb_dist's own types and bytes, never pickled by reference to
    ``__main__``)."""
    global _main_holders, _real_main
    with _main_lock:
        if _main_holders == 0:
            _real_main = sys.modules["__main__"]
            sys.modules["__main__"] = types.ModuleType("__main__")
        _main_holders += 1
    try:
        yield
    finally:
        with _main_lock:
            _main_holders -= 1
            if _main_holders == 0 and _real_main is not None:
                sys.modules["__main__"], _real_main = _real_main, None


def _read_counter(path: str) -> bytes:
    with contextlib.suppress(OSError), open(path, "rb", buffering=0) as file:
        return os.pread(file.fileno(), _collectives.SIZE, 0)
    return b""


def _interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (for gloo), if it can be told."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None
