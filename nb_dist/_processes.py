"""Process kinds: how a worker is started, watched, signalled and reaped, behind one interface.

The supervisor never asks how a worker was started. Each start method is a class with the
same four operations (:class:`WorkerProcess`); :func:`start` picks one:

- ``fork``: ``os.fork`` of the kernel (cell-defined functions, the kernel's modules and data
  are simply there). The kernel is the parent: it reaps with ``waitpid``.
- ``spawn``: a fresh interpreter (``subprocess.Popen``) that reads its spec from stdin. Also
  the kernel's child.
- ``forkserver``: multiprocessing's fork server forks it, so the kernel is not the parent:
  the exit status comes from multiprocessing's sentinel.

Every worker leads its own process group (it calls ``setpgid(0, 0)`` first thing), so a
signal to the group reaches what it started too (DataLoader workers, subprocesses), and a
finished worker's group is killed before it is reaped: nothing outlives a launch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import warnings
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from ._worker import WorkerChannels, WorkerSpec, forkserver_main, run_worker


class WorkerProcess(Protocol):
    """One started worker, whatever started it."""

    pid: int

    def exit_code(self) -> int | None:
        """The exit code if it has ended (negative: the signal), reaped; else ``None``.

        Kills the worker's leftover process group (grandchildren) before reaping, while the
        zombie still reserves the group's id.
        """

    def send_signal(self, sig: int) -> None:
        """Signal its whole process group (and the worker itself, if the group is gone)."""

    def kill_and_reap(self) -> int:
        """SIGKILL the group and wait for the worker; its exit code."""


def start(
    method: str, spec: WorkerSpec, channels: WorkerChannels, context: BaseContext | None
) -> WorkerProcess:
    """Start one worker with ``method`` (``"fork"``, ``"spawn"`` or ``"forkserver"``)."""
    if method == "fork":
        return _Forked(_fork(spec, channels))
    if method == "spawn":
        return _Spawned(_spawn(spec, channels))
    assert context is not None
    process = context.Process(  # type: ignore[attr-defined]
        target=forkserver_main, args=(spec, channels), name=f"nb_dist-rank{spec.rank}"
    )
    process.start()
    return _FromForkserver(process)


def forkserver_context() -> BaseContext:
    """multiprocessing's fork server, which imports torch and the worker once, when it starts.

    Without the preload every worker it forks imports torch itself (2-3 s per launch). The
    server never computes, so it has no OpenMP pool and touches no CUDA: its children keep
    their threads and can use GPUs. A server already started by other code keeps its own
    preload list.
    """
    context = multiprocessing.get_context("forkserver")
    preload = ["torch", "nb_dist._worker"]
    if "torch" in sys.modules:
        context.set_forkserver_preload(preload)
    return context


# ------------------------------------------------------------------ the kernel's children
class _Forked:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def exit_code(self) -> int | None:
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return -signal.SIGKILL  # reaped elsewhere: report it as killed
        if info is None:
            return None
        signal_group(self.pid, signal.SIGKILL, group_only=True)
        return self._reap()

    def send_signal(self, sig: int) -> None:
        signal_group(self.pid, sig)

    def kill_and_reap(self) -> int:
        signal_group(self.pid, signal.SIGKILL)
        return self._reap()

    def _reap(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            return -signal.SIGKILL
        return os.waitstatus_to_exitcode(status)


class _Spawned(_Forked):
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        super().__init__(process.pid)
        self._process = process

    def _reap(self) -> int:
        code = super()._reap()
        self._process.returncode = code  # reaped here; keep Popen from waiting on it again
        return code


class _FromForkserver:
    def __init__(self, process: Any) -> None:
        self.pid = int(process.pid)
        self._process = process

    def exit_code(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            signal_group(self.pid, signal.SIGKILL, group_only=True)
        return code  # type: ignore[no-any-return]

    def send_signal(self, sig: int) -> None:
        signal_group(self.pid, sig)

    def kill_and_reap(self) -> int:
        signal_group(self.pid, signal.SIGKILL)
        self._process.join(timeout=5)  # only the server can reap; multiprocessing asks it
        code = self._process.exitcode
        return int(code) if code is not None else -signal.SIGKILL


# ------------------------------------------------------------------ starting
def _fork(spec: WorkerSpec, channels: WorkerChannels) -> int:
    """Fork one worker. The child never returns from here."""
    # Block SIGINT across the fork: a KeyboardInterrupt raised in the child before it reaches
    # run_worker would unwind a copy of the kernel through the cell's code.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = -1
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns that fork() from a multi-threaded process (every Jupyter
            # kernel) may deadlock in the child. The worker never uses the kernel's threads or
            # their locks: it replaces stdout/stderr with its own pipes before any output, never
            # touches ZMQ/iopub, and leaves through os._exit. That makes this fork safe.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*fork\(\)")
            pid = os.fork()
            if pid == 0:
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                    run_worker(spec, channels, forked=True)
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


def _spawn(spec: WorkerSpec, channels: WorkerChannels) -> subprocess.Popen[bytes]:
    """Start a fresh interpreter for one worker (no re-import of the caller's __main__)."""
    fds = channels.named_fds()
    env = dict(os.environ)
    env.update(spec.env)
    # The worker imports nb_dist before anything else; make sure it finds this copy.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-c", "from nb_dist._worker import spawn_main; spawn_main()"],
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
        pass  # the worker died at start; its exit code and stderr tell why
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
