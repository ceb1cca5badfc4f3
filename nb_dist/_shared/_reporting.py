"""The rank → kernel reporting channel, and small helpers for code that runs in a rank.

Inside a launched function, ``report("loss", loss, step)`` sends a value to the kernel, tagged
with the rank, the step and the time. The kernel collects every report on the launch result
(``result.reports["loss"][1]`` → rank 1's ``[(step, value), ...]``) and hands them to live
views (the launch monitor) while the run goes on.

Reports are buffered in the rank and sent in batches (at least every 0.1 s, and when the
function ends), so reporting a scalar every step costs about a microsecond, not a system call.
Outside a launch, ``report`` keeps the values in this process (see :func:`local_reports`), so a
function that reports also runs single-process, unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from . import _protocol

__all__ = [
    "ReportEntry",
    "Reports",
    "is_main_process",
    "local_rank",
    "local_reports",
    "main_process_first",
    "progress",
    "rank",
    "report",
    "world_size",
]

T = TypeVar("T")

_FLUSH_EVERY = 0.1  # seconds between batches sent to the kernel
_MAX_BATCH = 512  # entries; a larger buffer is sent at once
_PROGRESS_EVERY = 0.2  # seconds between progress updates sent to the kernel


class ReportEntry(tuple):  # type: ignore[type-arg]
    """One reported value: unpacks as ``(step, value)``; ``.time`` is when it was reported."""

    time: float

    def __new__(cls, step: int, value: Any, time: float = 0.0) -> ReportEntry:
        entry = super().__new__(cls, (step, value))
        entry.time = time
        return entry

    @property
    def step(self) -> int:
        return int(self[0])

    @property
    def value(self) -> Any:
        return self[1]


class Reports(dict):  # type: ignore[type-arg]
    """Everything reported in a launch: ``reports[name][rank]`` → list of ``(step, value)``.

    Ranks are kept in rank order whichever reported first, so printing ``reports[name]`` gives
    the same text on every run.
    """

    def add(self, rank: int, name: str, step: int, when: float, value: Any) -> ReportEntry:
        entry = ReportEntry(step, value, when)
        by_rank = self.setdefault(name, {})
        entries = by_rank.get(rank)
        if entries is None:
            entries = by_rank[rank] = []
            ordered = sorted(by_rank.items())
            by_rank.clear()
            by_rank.update(ordered)
        entries.append(entry)
        return entry

    def last(self, name: str) -> dict[int, Any]:
        """The latest value of ``name`` per rank."""
        return {rank: entries[-1][1] for rank, entries in sorted(self.get(name, {}).items())}

    def series(self, name: str, rank: int) -> tuple[list[int], list[Any]]:
        """``(steps, values)`` of ``name`` on ``rank``, ready to plot."""
        entries = self.get(name, {}).get(rank, [])
        return [e[0] for e in entries], [e[1] for e in entries]

    def __repr__(self) -> str:
        parts = []
        for name in sorted(self):
            counts = ", ".join(f"rank {r}: {len(v)}" for r, v in sorted(self[name].items()))
            parts.append(f"{name!r} ({counts})")
        return f"Reports({'; '.join(parts)})"


# ----------------------------------------------------------------- rank side
class _Sink:
    """The rank's end of the channel: a buffer, a lock, and a thread that flushes it."""

    def __init__(self, control: Any, rank: int) -> None:
        self.rank = rank
        self._control = control
        self._lock = threading.Lock()
        self._buffer: list[tuple[str, int, float, Any]] = []
        self._steps: dict[str, int] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._flush_loop, name="nb_dist-reports", daemon=True
        )
        self._thread.start()

    def add(self, name: str, value: Any, step: int | None) -> None:
        if self._closed.is_set():
            return  # the function has returned: the pipe now carries its value, nothing else
        if step is None:
            step = self._steps.get(name, -1) + 1
        self._steps[name] = step
        entry = (name, step, time.monotonic(), value)
        # Under the lock: the flusher thread swaps the buffer, and an append to the list it
        # has just taken (between reading self._buffer and appending) would be lost.
        with self._lock:
            self._buffer.append(entry)
            if len(self._buffer) >= _MAX_BATCH:
                self._flush_locked()

    def send(self, message: _protocol.Message) -> None:
        """Send a control message after everything reported so far (keeps the order)."""
        if self._closed.is_set():
            return  # see add()
        with self._lock:
            self._flush_locked()
            _protocol.send(self._control, message)

    def send_result(
        self,
        result: _protocol.Result,
        data: bytes,
        buffers: Sequence[memoryview],
        then: _protocol.Message | None = None,
    ) -> None:
        """Send a :class:`~_protocol.Result` after everything reported so far, with the raw
        bytes it announces and ``then`` (``_protocol.send_result``)."""
        if self._closed.is_set():
            return  # see add()
        with self._lock:
            self._flush_locked()
            _protocol.send_result(self._control, result, data, buffers, then)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._buffer:
            return
        items, self._buffer = self._buffer, []
        values = []
        for name, step, at, value in items:
            try:  # one by one: a value that cannot be pickled costs only itself
                values.append(_protocol.report_value(name, step, at, value))
            except Exception as exc:
                print(
                    f"report({name!r}, ...) on rank {self.rank}: a {_protocol.type_name(value)} "
                    f"cannot be sent to the kernel ({type(exc).__name__}: {exc}); report "
                    "numbers, tensors, arrays or dicts/lists of those.",
                    file=sys.stderr,
                )
        if values:
            _protocol.send(self._control, _protocol.ReportBatch(tuple(values)))

    def _flush_loop(self) -> None:
        while not self._closed.wait(_FLUSH_EVERY):
            with contextlib.suppress(OSError, EOFError):
                self.flush()

    def close(self) -> None:
        """Stop the flusher and send what is left; afterwards the caller owns the pipe alone."""
        self._closed.set()
        self._thread.join()
        with contextlib.suppress(OSError, EOFError):
            self.flush()


_sink: _Sink | None = None
_local = Reports()


def install_sink(control: Any, rank: int) -> _Sink:
    """Called by the rank before the user's function runs."""
    global _sink
    _sink = _Sink(control, rank)
    return _sink


def _detached(value: Any) -> Any:
    """A copy of ``value`` safe to send: tensors detached and on CPU, 0-d tensors as numbers."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.item()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.copy()
    return value


def report(name: str, value: Any, step: int | None = None) -> None:
    """Send ``value`` from this rank to the kernel under ``name`` (for plots and views).

    ``value`` may be a number, a tensor (detached and copied to CPU here; a 0-d tensor becomes
    a Python number), a small array, or a dict/list of those. ``step`` defaults to one more
    than the last step reported under ``name`` on this rank.
    Outside a launch the value is kept in this process: see :func:`local_reports`.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"report(name={name!r}, ...): name must be a non-empty string.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"report({name!r}, ..., step={step!r}): step must be an int or None.")
    value = _detached(value)
    if _sink is not None:
        _sink.add(name, value, step)
        return
    entries = _local.get(name, {}).get(rank(), [])
    if step is None:
        step = entries[-1][0] + 1 if entries else 0
    _local.add(rank(), name, step, time.time(), value)


def local_reports() -> Reports:
    """Values reported outside a launch (a function run single-process in the kernel)."""
    return _local


# ----------------------------------------------------------------- rank helpers
def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def rank() -> int:
    """This process's global rank (0 outside a launch)."""
    return _env_int("RANK", 0)


def local_rank() -> int:
    """This process's rank on its machine (0 outside a launch)."""
    return _env_int("LOCAL_RANK", 0)


def world_size() -> int:
    """How many processes take part (1 outside a launch)."""
    return _env_int("WORLD_SIZE", 1)


def is_main_process() -> bool:
    """True on rank 0 (and outside a launch): the rank that prints, saves and evaluates."""
    return rank() == 0


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Let rank 0 run the block first (e.g. download or preprocess), then the other ranks.

    Other ranks wait at a barrier until rank 0 has finished the block, so they find its
    results (files, caches) in place. Needs the default process group in a launch.
    """
    size = world_size()
    dist = sys.modules.get("torch.distributed")
    if size > 1 and (dist is None or not dist.is_initialized()):
        raise RuntimeError(
            "main_process_first() makes ranks wait for each other, which needs the default "
            "process group. Call torch.distributed.init_process_group() before it, or launch "
            "with init_process_group=True."
        )
    if size > 1 and not is_main_process():
        dist.barrier()  # type: ignore[union-attr]
    try:
        yield
    finally:
        if size > 1 and is_main_process():
            dist.barrier()  # type: ignore[union-attr]


# ----------------------------------------------------------------- progress
def progress(iterable: Iterable[T], desc: str = "", total: int | None = None) -> Iterator[T]:
    """Iterate like ``tqdm``: a per-rank progress bar in the launch monitor.

    In a launch, the kernel's monitor shows a bar per rank (updated a few times a second); the
    text output gets a single line per rank when the loop ends, not a flood of ``\\r`` updates.
    Outside a launch it is a plain loop.
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    sink = _sink
    if sink is None:
        yield from iterable
        return
    key = desc or "progress"
    started = last = time.monotonic()
    count = 0
    sink.send(_protocol.Progress(key, 0, total))
    for item in iterable:
        yield item
        count += 1
        now = time.monotonic()
        if now - last >= _PROGRESS_EVERY:
            last = now
            sink.send(_protocol.Progress(key, count, total))
    sink.send(_protocol.Progress(key, count, total))
    shown = f"{count}/{total}" if total is not None else f"{count}"
    print(f"{key}: {shown} done in {time.monotonic() - started:.1f} s")
