"""What a node's ranks said that the kernel has not fetched yet: raw bytes by rank and pipe.

The agent's reader thread appends each read (``os.read`` of a rank's pipe, or ``b""`` when
the pipe closed) and each exit code; the kernel's long poll (:meth:`Outbox.take`) waits for
something to arrive and takes everything at once. Consecutive reads of one pipe are joined,
so a burst of output or a large result crosses to the kernel in few messages. The bytes are
never parsed here: the control pipe's framing reaches the kernel exactly as it was written.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .._shared._protocol import PIPES

#: The pipes a rank writes to, in the order one read turn drains them: output before the
#: control pipe, so a rank's last lines arrive before the end of its control stream.
KINDS = PIPES


@dataclass
class Batch:
    """One poll's worth: ``(rank index, pipe kind, bytes)`` in arrival order (empty: the
    pipe closed), ``(exit code, when it ended on the node's monotonic clock, whether it ended
    before any signal to stop it)`` by rank index, and changed collective counters (raw
    bytes).
    A large chunk is a numpy ``uint8`` array instead of ``bytes`` (:func:`_wire`)."""

    run: int
    chunks: list[tuple[int, str, Any]] = field(default_factory=list)
    exits: dict[int, tuple[int, float, bool]] = field(default_factory=dict)
    counters: dict[int, bytes] = field(default_factory=dict)
    #: The run ended on the node (or another began): the kernel stops polling.
    over: bool = False


class Outbox:
    """Thread-safe: the reader thread adds, one long poll at a time takes."""

    def __init__(self, run: int) -> None:
        self.run = run
        self._cond = threading.Condition()
        self._chunks: list[tuple[int, str, bytearray]] = []
        self._exits: dict[int, tuple[int, float, bool]] = {}
        self._over = False
        self._woken = False

    def add(self, index: int, kind: str, data: bytes) -> None:
        with self._cond:
            last = self._chunks[-1] if self._chunks else None
            if data and last is not None and last[:2] == (index, kind) and last[2]:
                last[2].extend(data)
            else:
                self._chunks.append((index, kind, bytearray(data)))
            self._cond.notify_all()

    def exited(self, index: int, code: int, at: float, unasked: bool) -> None:
        """Rank ``index`` ended with ``code`` at ``at`` (``time.monotonic()`` here); ``unasked``:
        before any signal to stop it."""
        with self._cond:
            self._exits[index] = (code, at, unasked)
            self._cond.notify_all()

    def end(self) -> None:
        """The run is over: a waiting poll returns now, and every later one at once."""
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Let a waiting poll return now, with what there is (possibly nothing)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def take(self, timeout: float) -> Batch:
        """Wait up to ``timeout`` s for something, then take all of it."""
        with self._cond:
            self._cond.wait_for(
                lambda: bool(self._chunks or self._exits or self._over or self._woken), timeout
            )
            chunks = [(i, k, _wire(d)) for i, k, d in self._chunks]
            batch = Batch(self.run, chunks, self._exits, over=self._over)
            self._chunks, self._exits, self._woken = [], {}, False
            return batch


#: Chunks from this size on cross as numpy arrays: Ray moves those out of band (one copy into
#: the object store, read in place on the other side), where ``bytes`` are pickled inline.
LARGE = 1 << 16


def _wire(data: bytearray) -> Any:
    """``data`` as it crosses to the kernel: ``bytes``, or for a large chunk (a result's
    bytes) a numpy array over it (both support ``len`` and the buffer protocol)."""
    if len(data) >= LARGE:
        try:
            import numpy
        except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
            return bytes(data)
        return numpy.frombuffer(data, dtype=numpy.uint8)
    return bytes(data)
