"""Helpers for tests that check worker processes are gone.

(Not in conftest.py: the notebooks folder has a conftest.py of its own, and two modules named
``conftest`` cannot both be imported by name.)
"""

from __future__ import annotations

import time

import psutil

#: How long a process someone else signalled may take to die. Generous on purpose: it tells
#: "was stopped" from "was never stopped" (every process these tests start would otherwise run
#: for a minute or forever), not how fast; how fast is measured in bench/.
GONE_WITHIN = 30.0


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
