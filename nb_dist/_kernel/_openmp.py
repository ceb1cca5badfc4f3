"""The kernel's OpenMP thread pool, and why it must be released before a fork.

torch's Linux builds run intra-op parallel work (convolutions, matmuls, large element-wise
ops) on GNU OpenMP (libgomp). The first parallel region a thread runs starts a pool of
threads that stays. ``fork`` copies only the calling thread, but the child's libgomp still
believes the pool exists: the child's first parallel region with more than one thread waits
forever for threads that were never copied. So a cell that trains in the kernel, followed by
a launch with two or more threads per rank, hangs in the ranks' first convolution.

The fix used here: just before forking, the launcher releases the calling thread's pool with
``omp_pause_resource_all(omp_pause_hard)`` (OpenMP 5.0, in every libgomp since GCC 9). The
ranks then start pools of their own and keep all their threads; the kernel re-creates its
pool at its next parallel op, which costs about a millisecond.

Where that cannot be done (a libgomp without the call, or ``NB_DIST_RELEASE_OPENMP=0``), a
throw-away child runs one small parallel op under a deadline. If it hangs, the pool is alive
and fork is unsafe with threads: the launch then uses one thread per rank (and says so), or
refuses an explicit ``threads_per_process > 1`` with the alternatives.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time
from dataclasses import dataclass

from .._shared._env import switched_off

# Set to 0 to keep the kernel's pool (for comparison or if releasing it misbehaves).
RELEASE_ENV = "NB_DIST_RELEASE_OPENMP"

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
# How long the fallback probe's parallel op may take before the pool is judged broken. A
# healthy op of this size takes milliseconds; the deadline covers a heavily loaded machine.
PROBE_DEADLINE = 3.0

_announced = False


@dataclass(frozen=True)
class Release:
    """What :func:`release_pool` did.

    ``status``: ``"released"`` (a pool existed and was freed), ``"idle"`` (OpenMP is loaded but
    this thread had no pool, or it was freed), ``"absent"`` (no libgomp in this process),
    ``"disabled"`` (``NB_DIST_RELEASE_OPENMP=0``) or ``"unsupported"`` (a libgomp without
    ``omp_pause_resource_all``, or the call failed).
    """

    status: str
    threads_freed: int = 0


def libgomp_paths() -> list[str]:
    """Every GNU OpenMP runtime loaded in this process (torch's own, and e.g. the system's one
    that another library brought); a replaced file shows as ``... (deleted)``."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                path = fields[5] if len(fields) == 6 else ""
                name = os.path.basename(path.removesuffix(" (deleted)"))
                if "libgomp" in name and path not in found:
                    found.append(path)
    except OSError:
        return []
    return found


def libgomp_path() -> str | None:
    """The first GNU OpenMP runtime loaded in this process, if any."""
    paths = libgomp_paths()
    return paths[0] if paths else None


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def release_pool() -> Release:
    """Free the calling thread's OpenMP pool so that a fork of this thread is safe."""
    if switched_off(RELEASE_ENV):
        return Release("disabled")
    paths = libgomp_paths()
    if not paths:
        return Release("absent")
    before = thread_count()
    for path in paths:  # each runtime has a pool of its own
        if path.endswith(" (deleted)"):
            return Release("unsupported")  # the file was replaced: cannot be opened again
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            return Release("unsupported")
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return Release("unsupported")
    freed = _threads_gone(before)
    return Release("released" if freed else "idle", freed)


# Threads in this process right after the last release: a pool started since then adds some.
_after_last_release: int | None = None


def _threads_gone(before: int) -> int:
    """How many threads the release ended. libgomp's pool threads are detached and exit just
    after the pause returns, so a drop may take a moment on a busy machine: wait for it (at
    most 20 ms), but only when threads were added since the last release (else no pool can
    have started, and nothing is waited for)."""
    global _after_last_release
    now = thread_count()
    if before > now or (_after_last_release is not None and before <= _after_last_release):
        _after_last_release = now
        return max(0, before - now)
    deadline = time.monotonic() + 0.02
    while now >= before and time.monotonic() < deadline:
        time.sleep(0.0005)
        now = thread_count()
    _after_last_release = now
    return max(0, before - now)


_known_broken: set[int] = set()  # thread counts a probe found hanging (a kept pool stays)


def pool_breaks_fork(threads: int, remember: bool = True) -> bool:
    """True if a forked child hangs in a parallel op with ``threads`` threads.

    Forks a throw-away child that runs one parallel op and reports back; a child that has not
    answered within :data:`PROBE_DEADLINE` is killed, and the answer is yes. A yes is
    remembered (``remember``): a pool that cannot be released stays alive, so later launches
    do not wait for the deadline again.
    """
    torch = sys.modules.get("torch")
    if torch is None or libgomp_path() is None:
        return False
    if remember and threads in _known_broken:
        return True
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the throw-away child: one parallel op, report, leave
        try:
            os.close(read_fd)
            torch.set_num_threads(threads)
            torch.ones(1 << 20).add_(1.0).sum()
            os.write(write_fd, b"ok")
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], PROBE_DEADLINE)
        answered = bool(ready) and os.read(read_fd, 2) == b"ok"
    finally:
        os.close(read_fd)
        if not _reaped(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if not answered and remember:
        _known_broken.add(threads)
    return not answered


def _reaped(pid: int) -> bool:
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.002)
    return False


def release_notice(release: Release, threads: int) -> str | None:
    """The one-time notice after the kernel's pool was released (``None`` after the first)."""
    global _announced
    if release.status != "released" or _announced:
        return None
    _announced = True
    return (
        "The kernel had already run multi-threaded torch work, and OpenMP's thread pool does "
        "not survive fork (ranks would hang in their first parallel op). nb_dist released "
        f"the kernel's pool before forking, so each rank keeps its {threads} threads. Cost: "
        "the kernel starts a new pool at its next parallel op (about a millisecond)."
    )


def _why_kept(release: Release) -> str:
    if release.status == "disabled":
        return f"{RELEASE_ENV}=0 keeps it"
    return "this OpenMP runtime cannot release it"


def single_thread_notice(threads: int, release: Release) -> str:
    return (
        "The kernel had already run multi-threaded torch work, and OpenMP's thread pool does "
        f"not survive fork; {_why_kept(release)}. Ranks run with 1 thread "
        f"instead of {threads} so that they do not hang. For all threads, launch with "
        "start_method='forkserver' (fresh processes) or restart the kernel and launch before "
        "training in it."
    )


def fork_unsafe_message(threads: int, release: Release) -> str:
    why = _why_kept(release)
    return (
        f"threads_per_process={threads} cannot work with start_method='fork' now: the kernel "
        "already ran multi-threaded torch work, and OpenMP's thread pool does not survive fork, "
        "so every rank would hang in its first parallel op (a convolution, a matmul), and "
        f"{why}. Launch with start_method='forkserver' (fresh "
        "processes, all threads), or with threads_per_process=1, or restart the kernel and "
        "launch before running torch work in it."
    )
