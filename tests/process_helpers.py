"""Helpers for tests that check worker processes are gone.

(Not in conftest.py: the notebooks folder has a conftest.py of its own, and two modules named
``conftest`` cannot both be imported by name.)
"""

from __future__ import annotations

import time

import psutil


def assert_all_gone(pids, within: float = 2.0) -> None:
    """Assert that every pid has exited (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker processes still alive after {within} s: {alive}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
