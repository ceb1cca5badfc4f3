"""Process kinds: how a rank is started, watched, signalled and reaped, behind one interface.

The supervisor never asks how a rank was started. Each start method is a class with the
same four operations (:class:`RankProcess`); :func:`start` picks one:

- ``fork``: ``os.fork`` of the kernel (cell-defined functions, the kernel's modules and data
  are simply there). The kernel is the parent: it reaps with ``waitpid``.
- ``spawn``: a fresh interpreter (``subprocess.Popen``) that reads its spec from stdin. Also
  the kernel's child.
- ``forkserver``: multiprocessing's fork server forks it, so the kernel is not the parent:
  the exit status comes from multiprocessing's sentinel.

Every rank leads its own process group (it calls ``setpgid(0, 0)`` first thing), so a
signal to the group reaches what it started too (DataLoader workers, subprocesses), and a
finished rank's group is killed before it is reaped: nothing outlives a launch.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from .._rank._entry import forkserver_main, run_rank
from .._rank._spec import RankChannels, RankSpec
from .._shared._frames import PACKAGE_DIR
from ._parts import Gate, gated_start

#: How long a killed rank may take to be reaped before it is reported and left behind (a
#: process in uninterruptible sleep, e.g. a wedged driver or file system, ignores SIGKILL
#: until the kernel call returns: waiting for it would wedge the cell).
REAP_WITHIN = 5.0


class RankProcess(Protocol):
    """One started rank, whatever started it."""

    pid: int

    def exit_code(self) -> int | None:
        """The exit code if it has ended (negative: the signal), reaped; else ``None``.

        Kills the rank's leftover process group (grandchildren) before reaping, while the
        zombie still reserves the group's id. Asked again, it gives the same code.
        """

    def ended_at(self) -> float | None:
        """When it ended on this process's monotonic clock, where that is known better than
        the moment its exit code was read (a rank on another machine: when its node saw it
        end); else ``None``."""

    def ended_unasked(self) -> bool:
        """Whether it had ended before it was first sent a signal to stop (``send_signal``,
        ``kill_and_reap``): its end was its own, whenever the kernel learned of it."""

    def send_signal(self, sig: int) -> None:
        """Signal its whole process group (and the rank itself, if the group is gone)."""

    def signal_leader(self, sig: int) -> None:
        """Signal the rank process alone (a stack request: SIGUSR1 would kill its children).

        ``ProcessLookupError`` if it is gone. A rank on another machine is signalled there
        (``nb_dist._cluster``), never by its pid here.
        """

    def kill_and_reap(self, within: float = REAP_WITHIN) -> int:
        """SIGKILL the group and wait up to ``within`` s for the rank; its exit code (the
        kill's, reported and left behind, if it is still not reaped then). Whoever ends
        several ranks gives each the time left of one shared deadline (``reap_by``)."""


def start(
    method: str, spec: RankSpec, channels: RankChannels, context: BaseContext | None
) -> RankProcess:
    """Start one rank with ``method`` (``"fork"``, ``"spawn"`` or ``"forkserver"``)."""
    if method == "fork":
        return _Forked(_fork(spec, channels))
    if method == "spawn":
        return spawned(_spawn(spec, channels))
    assert context is not None
    process = context.Process(  # type: ignore[attr-defined]
        target=forkserver_main, args=(spec, channels), name=f"nb_dist-rank{spec.rank}"
    )
    process.start()
    return _FromForkserver(process)


def start_on_pipes(
    method: str, spec: RankSpec, theirs: dict[str, Connection], gate: Gate,
    context: BaseContext | None,
) -> RankProcess:  # fmt: skip
    """Start one rank on its ends of its pipes (``theirs``, from ``open_rank_pipes``) and of
    the start gate, then close those ends here: the rank has its own copies, and a copy kept
    here would keep its pipes from ever reaching EOF. The kernel and a node's agent both
    start their ranks this way."""
    channels = RankChannels(**theirs, lifeline=gate.lifeline_end, gate=gate.gate_end)
    try:
        return start(method, spec, channels, context)
    finally:
        for conn in theirs.values():
            conn.close()


#: Starts the rank at ``index`` behind the start gate, with the fork server's context where
#: the method is forkserver (by :func:`start_on_pipes`), for :func:`start_ranks`.
StartOne = Callable[[int, Gate, BaseContext | None], None]


def start_ranks(
    method: str,
    count: int,
    start_one: StartOne,
    kill_started: Callable[[], None],
    preload: bool | None = None,
) -> Connection:
    """Start ``count`` ranks (``start_one(index, gate, context)``), every one before the
    start gate opens; the lifeline's write end, for the starter to keep (its only copy).

    If a rank cannot start (or an interrupt arrives), ``kill_started()`` kills the ranks
    already started while they still wait at the gate, so none runs user code
    (``_parts.gated_start``). The kernel (``_kernel/_local.start_all``) and a node's agent
    (``_node/_agent.NodeAgent.start``) both start their ranks this way; ``preload``: as for
    :func:`forkserver_context`.
    """
    context = forkserver_context(preload) if method == "forkserver" else None
    with gated_start(kill_started) as gate:
        for index in range(count):
            start_one(index, gate, context)
    return gate.lifeline


def forkserver_context(preload: bool | None = None) -> BaseContext:
    """multiprocessing's fork server, which imports torch and the rank once, when it starts.

    Without the preload every rank it forks imports torch itself (2-3 s per launch). The
    server never computes, so it has no OpenMP pool and touches no CUDA: its children keep
    their threads and can use GPUs. ``preload=None`` preloads where this process has torch
    already (a kernel without it does not pay for it); a node's agent says ``True``. A server
    already started by other code keeps its own preload list.
    """
    context = multiprocessing.get_context("forkserver")
    if preload or (preload is None and "torch" in sys.modules):
        # The first import stops the CUDA-touch recorder before torch arrives (a fork server
        # never launches); then torch and the rank's entry, once for every rank.
        context.set_forkserver_preload(
            ["nb_dist._rank._fork_server", "torch", "nb_dist._rank._entry"]
        )
    return context


# ------------------------------------------------------------------ the kernel's children
class _Forked:
    """A rank this process started itself (forked, or spawned as a ``Popen``): it reaps it
    with ``waitpid``; ``on_reaped`` hears the exit code (a ``Popen`` then keeps it)."""

    def __init__(self, pid: int, on_reaped: Callable[[int], None] | None = None) -> None:
        self.pid = pid
        self._on_reaped = on_reaped
        # Set once reaped: the pid is free for the system to give to another process, so it
        # is never signalled or waited for again, and exit_code() keeps answering (a node's
        # agent asks on every read until the rank's pipes are drained).
        self._code: int | None = None
        self._ends = _Ends()

    def exit_code(self) -> int | None:
        if self._code is not None:
            return self._code
        state = self._state()
        if state == "running":
            return None
        if state == "gone":
            return -signal.SIGKILL  # reaped elsewhere: report it as killed
        signal_group(self.pid, signal.SIGKILL, group_only=True)
        return self._reap()  # it has ended: a zombie is reaped at once

    def _has_ended(self) -> bool:
        return self._code is not None or self._state() != "running"

    def _state(self) -> str:
        """``running``, ``ended`` (a zombie, left unreaped) or ``gone`` (reaped elsewhere); an
        end is noted for :meth:`ended_unasked`."""
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            self._ends.ended()
            return "gone"
        if info is None:
            return "running"
        self._ends.ended()
        return "ended"

    def ended_at(self) -> float | None:
        return None  # a child of this process: noticed as it ends

    def ended_unasked(self) -> bool:
        return self._ends.unasked

    def send_signal(self, sig: int) -> None:
        if self._code is None:
            self._ends.stop_sent(self._has_ended())
            signal_group(self.pid, sig)

    def signal_leader(self, sig: int) -> None:
        if self._code is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def kill_and_reap(self, within: float = REAP_WITHIN) -> int:
        if self._code is not None:
            return self._code
        self._ends.stop_sent(self._has_ended())
        signal_group(self.pid, signal.SIGKILL)
        code = self._reap(within=within)
        if code is None:
            report_unreaped(self.pid, within)
            return -signal.SIGKILL
        return code

    def _reap(self, within: float | None = None) -> int | None:
        """Wait for the rank to end: its exit code, or ``None`` if ``within`` s pass first."""
        code = reap_within(self.pid, within)
        if code is None:
            return None
        self._code = -signal.SIGKILL if code == _GONE else code
        if self._on_reaped is not None:
            self._on_reaped(self._code)
        return self._code


def spawned(process: subprocess.Popen[bytes]) -> _Forked:
    """A rank started as a ``Popen``: reaped here like a forked one, and the ``Popen`` told
    its exit code, so that it never waits for the pid again (the system may reuse it)."""
    return _Forked(process.pid, on_reaped=lambda code: setattr(process, "returncode", code))


class _FromForkserver:
    def __init__(self, process: Any) -> None:
        self.pid = int(process.pid)
        self._process = process
        self._ends = _Ends()

    def exit_code(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            self._ends.ended()
            signal_group(self.pid, signal.SIGKILL, group_only=True)
        return code  # type: ignore[no-any-return]

    def ended_at(self) -> float | None:
        return None  # a child of this machine's fork server: noticed as it ends

    def ended_unasked(self) -> bool:
        return self._ends.unasked

    def send_signal(self, sig: int) -> None:
        self._ends.stop_sent(self.exit_code() is not None)
        signal_group(self.pid, sig)

    def signal_leader(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_and_reap(self, within: float = REAP_WITHIN) -> int:
        self._ends.stop_sent(self.exit_code() is not None)
        signal_group(self.pid, signal.SIGKILL)
        self._process.join(timeout=within)  # only the server reaps; multiprocessing asks
        code = self._process.exitcode
        if code is None:
            report_unreaped(self.pid, within)  # as for a rank this kernel forked
            return -signal.SIGKILL
        return int(code)


class _Ends:
    """Whether a rank ended on its own: it was seen ended before any signal to stop it was
    sent (a kernel that learns of a death late, or a node that reports it late, still knows
    that its stop did not cause it)."""

    def __init__(self) -> None:
        self._asked = False
        self.unasked = False
        self._seen = False

    def stop_sent(self, ended_already: bool) -> None:
        """A signal to stop it is being sent; ``ended_already``: it had ended before."""
        if not ended_already:
            self._asked = True

    def ended(self) -> None:
        if not self._seen:
            self._seen, self.unasked = True, not self._asked


# ------------------------------------------------------------------ reaping
_GONE = -(2**31)  # reap_within: the pid is not (or no longer) a child of this process
_log = logging.getLogger(__name__)


def reap_by(deadline: float) -> float:
    """The seconds left until ``deadline`` (``time.monotonic``), for one rank of several
    ended together: the whole teardown then waits ``REAP_WITHIN`` at most, not that for
    each rank (a rank past the deadline is still killed, and reaped if it has ended)."""
    return max(0.0, deadline - time.monotonic())


def end_all(processes: list[RankProcess]) -> list[int]:
    """Kill every rank's process group at once, then reap each by one shared deadline: their
    exit codes. Ending N ranks that will not die waits ``REAP_WITHIN`` at most, not N times
    that (the kernel's teardown, a session's close, a failed start, a node agent's end)."""
    for process in processes:
        process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + REAP_WITHIN
    return [process.kill_and_reap(reap_by(deadline)) for process in processes]


def reap_within(pid: int, within: float | None) -> int | None:
    """Reap child ``pid``: its exit code; ``None`` if it still runs after ``within`` s
    (``None``: wait as long as it takes)."""
    deadline = None if within is None else time.monotonic() + within
    delay = 0.001
    while True:
        try:
            done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        except ChildProcessError:
            return _GONE
        if done:
            return os.waitstatus_to_exitcode(status)
        assert deadline is not None
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)  # a poll with back-off: waitpid has no timeout
        delay = min(delay * 2, 0.05)


def process_state(pid: int) -> str:
    """The state Linux reports for ``pid`` (e.g. ``"D (disk sleep)"``), or ``"unknown"``."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def report_unreaped(pid: int, waited: float) -> str:
    """Say that rank ``pid`` could not be reaped and is left behind; the sentence said."""
    text = (
        f"nb_dist: rank process {pid} did not end within {waited:g} s of SIGKILL (state: "
        f"{process_state(pid)}); it is left behind so that this cell can end. A process in "
        "'D' state waits in the operating system (a driver or a file system); it ends when "
        f"that call returns. If it stays, check `ps -o pid,stat,wchan -p {pid}`."
    )
    _log.warning(text)
    print(text, file=sys.stderr, flush=True)
    return text


# ------------------------------------------------------------------ starting
def _fork(spec: RankSpec, channels: RankChannels) -> int:
    """Fork one rank. The child never returns from here."""
    # Block SIGINT across the fork: a KeyboardInterrupt raised in the child before it reaches
    # run_rank would unwind a copy of the kernel through the cell's code.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = -1
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns that fork() from a multi-threaded process (every Jupyter
            # kernel) may deadlock in the child. The rank never uses the kernel's threads or
            # their locks: it replaces stdout/stderr with its own pipes before any output, never
            # touches ZMQ/iopub, and leaves through os._exit. That makes this fork safe.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*fork\(\)")
            pid = os.fork()
            if pid == 0:
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                    run_rank(spec, channels, forked=True)
                finally:
                    os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    except BaseException:
        # An interrupt that lands between the fork and the return (another kernel thread takes
        # the signal; Python raises it here at its next check) would lose the child's pid:
        # kill and reap it now, so nothing the caller never saw keeps running.
        if pid > 0:
            signal_group(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    return pid


def _spawn(spec: RankSpec, channels: RankChannels) -> subprocess.Popen[bytes]:
    """Start a fresh interpreter for one rank (no re-import of the caller's __main__)."""
    fds = channels.named_fds()
    env = dict(os.environ)
    env.update(spec.env)
    # The rank imports nb_dist before anything else; make sure it finds this copy.
    package_root = os.path.dirname(PACKAGE_DIR)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-c", "from nb_dist._rank._entry import spawn_main; spawn_main()"],
        stdin=subprocess.PIPE,
        stdout=fds["stdout"],
        stderr=fds["stderr"],
        pass_fds=tuple(fds.values()),
        env=env,
    )
    assert process.stdin is not None
    try:
        process.stdin.write(pickle.dumps((spec, fds), protocol=pickle.HIGHEST_PROTOCOL))
        process.stdin.close()
    except BrokenPipeError:
        pass  # the rank died at start; its exit code and stderr tell why
    return process


# ------------------------------------------------------------------ signals
def signal_group(pid: int, sig: int, group_only: bool = False) -> None:
    """Send ``sig`` to the process group led by ``pid``; else (unless ``group_only``) to it."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    if not group_only:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
