"""Helpers for tests that run Python processes of their own and check processes are gone.

(Not in conftest.py: the notebooks folder has a conftest.py of its own, and two modules named
``conftest`` cannot both be imported by name.)
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

#: How long a process someone else stopped may take to be gone: 5x the README's promises
#: (ranks stopped within a second of a failure, ■ or close; ranks die with the kernel or the
#: launching process, by the lifeline and the parent-death signal; a rank's leftover
#: subprocesses go with its process group), which still tolerates a loaded machine. How fast
#: it really is, is measured in bench/ (launch_latency.py, relaunch.py).
GONE_WITHIN = 5.0


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) run by a Python of its own with ``args`` as its argv and ``env``
    over this process's environment; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_all_gone(pids, within: float = GONE_WITHIN) -> None:
    """Assert that every pid has exited (or is a zombie) within ``within`` seconds.

    ``within=0`` checks once, now: for workers that a launcher which has returned must already
    have reaped.
    """
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    raise AssertionError(f"worker processes still alive after {within} s: {alive}")


def alive_descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (empty if ``pid`` itself is gone)."""
    try:
        process = psutil.Process(pid)
        found = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [p.pid for p in found if _alive(p.pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def release_fifo(fifo: Path, within: float = 30.0) -> None:
    """Write to ``fifo`` once its reader has it open (the reader's read() then returns)."""
    deadline = time.monotonic() + within
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    try:
        os.write(fd, b"go")
    finally:
        os.close(fd)


class OnWrite:
    """A stream that writes through to ``stream`` and calls ``then()`` the first time a write
    contains ``marker``. As sys.stderr it sees the launcher's notices as they are written."""

    def __init__(self, stream, marker: str, then) -> None:
        self._stream, self._marker, self._then = stream, marker, then
        self.fired = False
        self.seen: list[str] = []  # every write, in order

    def write(self, text: str) -> int:
        self.seen.append(text)
        written = self._stream.write(text)
        if not self.fired and self._marker in text:
            self.fired = True
            self._then()
        return written

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def listeners() -> tuple[str, list[str], list[str]]:
    """Run in a rank: (``MASTER_ADDR``, the addresses the rendezvous store listens on, this
    rank's own listening sockets'), read while every rank is in the process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    port = int(os.environ["MASTER_PORT"])
    store = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    mine = [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    dist.barrier()  # every rank has read its sockets before any leaves
    return os.environ["MASTER_ADDR"], store, mine
