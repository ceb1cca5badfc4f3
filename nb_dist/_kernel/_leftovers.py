"""Ranks nobody holds any more are stopped at the next launch, not when garbage is collected.

A ``Ranks`` object dropped without ``close()`` (``ranks = Ranks(2)`` run twice) leaves its
ranks running. Stopping them from a finalizer would run wherever garbage collection happens
to run (inside another cell's loop, a widget callback, interpreter shutdown) and wait there
for seconds. Its finalizer only hands the stop to this queue; the next launch
(``notebook_launcher``, ``Ranks(...)``) runs it in the launching cell's thread, and so does
the kernel's exit. Ranks die with the kernel in any case (their lifeline). Runs in the kernel.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

_log = logging.getLogger(__name__)
_queue: list[Callable[[], None]] = []
_lock = threading.Lock()


def leave(stop: Callable[[], None]) -> None:
    """Queue ``stop`` for the next launch (safe to call from a finalizer: it only appends)."""
    with _lock:
        _queue.append(stop)


def stop_all() -> int:
    """Run every queued stop; how many there were. A failing stop is logged, not raised."""
    with _lock:
        stops, _queue[:] = list(_queue), []
    for stop in stops:
        try:
            stop()
        except Exception:
            _log.warning("stopping ranks nobody held failed", exc_info=True)
    return len(stops)


atexit.register(stop_all)
