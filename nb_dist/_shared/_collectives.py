"""How many collectives each rank has entered, and which one it is in: a shared-memory counter.

When a launch hangs, the useful sentence is "rank 0 waits in all_reduce #57; rank 1 entered
only 56 collectives". The kernel cannot ask a blocked rank for this: its main thread is stuck
in C++ inside the collective and runs no Python. So each rank keeps its counts in a tiny file
that the kernel can read at any moment without the rank's help.

Kernel side: :func:`create` makes one zero-filled file per rank (the caller picks the folder:
``/dev/shm`` where it exists, so the file is memory and reading it costs no disk), and
:func:`read` turns it into a :class:`CollectiveState`, or ``None`` when the file is missing or
the rank never installed the counter (so "unknown" is never shown as "0 collectives").

Rank side: :func:`install` maps the file (``mmap``, shared) and replaces each
torch.distributed collective, in both ``torch.distributed`` and
``torch.distributed.distributed_c10d``, with one wrapper that, on entering, bumps ``entered``
and records which collective it is (an index into :data:`NAMES`), and on leaving (returned or
raised) bumps ``completed`` and clears it. Each of those is one ``struct.pack_into`` into the
mapped page: no lock, no system call. A per-thread guard makes a collective built from another
one count once, under the name the user called (``all_gather_object`` calls ``all_gather``).
:func:`count` is this process's ``entered``; :func:`uninstall` puts the originals back.

File layout (little-endian, :data:`SIZE` bytes, the rest zero): ``entered`` (u64),
``completed`` (u64), the current collective (u32: index in :data:`NAMES` + 1, 0 for none), the
writer's pid (u32, written by :func:`install`; 0 means "never installed"). A reader may see a
running rank's fields one call apart (they are written together but not atomically); it reads
until two reads agree, and a blocked rank's fields do not change at all.

What is counted, honestly:

- Only the Python-level torch.distributed calls in :data:`NAMES`. ``DistributedDataParallel``'s
  gradient all-reduces are issued in C++ (its Reducer calls the process group directly), and so
  are its parameter broadcast at construction and the collectives of FSDP2 and of
  ``torch.distributed._functional_collectives``: none of them is counted. (DDP's rarer Python
  calls, such as those under its ``join()`` context manager, are.)
- With ``async_op=True`` the call returns at once: it counts as entered and left, and the wait
  happens later in ``work.wait()``, outside any counted call.
- Collectives called from several threads of one rank at once share the counts; ``current``
  is then the last one entered (or ``None`` once any of them left).
- ``send``/``recv`` are counted like the others, so with point-to-point traffic ranks'
  counts can legitimately differ.
- Under ``torch.compile``, dynamo replaces the original collectives with traceable ones by
  function identity; the wrappers are registered for the same replacement, so compiled code
  keeps its graphs (and its traced collectives are not counted).

A process that forks after :func:`install` gives its child a private counter (see
``os.register_at_fork``), so a DataLoader worker cannot write into its rank's file.

This module imports torch only inside :func:`install`: the kernel reads the files, and
``_diagnosis`` uses :class:`CollectiveState`, without importing torch.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import _torch_compat

#: The collectives counted, in a fixed order: the file stores an index into this tuple, so
#: a name is only ever appended. Names the installed torch lacks are skipped by install().
NAMES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
)

SIZE = 64
_COUNTS = struct.Struct("<QQI")  # entered, completed, current (index + 1, 0: none)
_PID = struct.Struct("<I")
_PID_OFFSET = _COUNTS.size
_FILE = struct.Struct("<QQII")  # the whole used part: the counts, then the pid


@dataclass(frozen=True)
class CollectiveState:
    """One rank's counts, as read from its file."""

    #: Collectives this rank has entered, in total (the current one included).
    entered: int
    #: Collectives it has left, returned or raised.
    completed: int
    #: The collective it is inside right now (a name from :data:`NAMES`), or ``None``.
    current: str | None
    #: The process that installed the counter.
    pid: int


# ------------------------------------------------------------------ kernel side
def create(folder: str, rank: int) -> str:
    """A new zero-filled counter file for ``rank`` in ``folder``; returns its path.

    The name is unique, so kernels and attempts never share a file; the caller removes it.
    """
    fd, path = tempfile.mkstemp(prefix=f"nb_dist-rank{rank}-", suffix=".collectives", dir=folder)
    try:
        os.write(fd, bytes(SIZE))
    finally:
        os.close(fd)
    return path


def read(path: str) -> CollectiveState | None:
    """The counts in ``path``; ``None`` if it is missing, short, or was never installed."""
    try:
        with open(path, "rb", buffering=0) as file:
            raw = os.pread(file.fileno(), _FILE.size, 0)
            for _ in range(3):  # a running rank may be writing: until two reads agree
                again = os.pread(file.fileno(), _FILE.size, 0)
                if again == raw:
                    break
                raw = again
    except OSError:
        return None
    if len(raw) < _FILE.size:
        return None
    entered, completed, current, pid = _FILE.unpack(raw)
    if pid == 0:
        return None
    name = NAMES[current - 1] if 0 < current <= len(NAMES) else None
    return CollectiveState(entered=entered, completed=completed, current=name, pid=pid)


# ------------------------------------------------------------------ rank side
class _Guard(threading.local):
    inside = False


_guard = _Guard()
_pack = _COUNTS.pack_into
# Where the wrappers write: the mapped file once installed; a private buffer otherwise (after
# uninstall() or in a forked child), so a wrapper someone kept a reference to never fails.
_buffer: mmap.mmap | bytearray = bytearray(SIZE)
_mapped: mmap.mmap | None = None
_path: str | None = None
_entered = 0
_completed = 0
# (module, name) -> the original function, for uninstall().
_originals: dict[tuple[ModuleType, str], Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}
_fork_hook = False


def _wrap(index: int, original: Callable[..., Any]) -> Callable[..., Any]:
    code = index + 1

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        global _entered, _completed
        if _guard.inside:  # a collective built from another one: counted once, as the outer
            return original(*args, **kwargs)
        _guard.inside = True
        _entered += 1
        _pack(_buffer, 0, _entered, _completed, code)
        try:
            return original(*args, **kwargs)
        finally:
            _completed += 1
            _pack(_buffer, 0, _entered, _completed, 0)
            _guard.inside = False

    return counted


def install(path: str) -> None:
    """Count this process's collectives into ``path`` (made by :func:`create`).

    Idempotent for the same path; a different path moves the counter there and starts again
    from zero.
    """
    global _buffer, _mapped, _path, _entered, _completed, _fork_hook
    if _path == path:
        return
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), SIZE)
    _entered = _completed = 0
    _pack(mapped, 0, 0, 0, 0)
    _PID.pack_into(mapped, _PID_OFFSET, os.getpid())
    old, _buffer, _mapped, _path = _mapped, mapped, mapped, path
    if old is not None:
        old.close()
    if not _fork_hook:
        os.register_at_fork(after_in_child=_detach)
        _fork_hook = True
    if not _originals:
        _patch()


def _patch() -> None:
    import torch.distributed as dist

    c10d = _torch_compat.c10d() if dist.is_available() else None
    if c10d is None:
        return
    for index, name in enumerate(NAMES):
        original = getattr(c10d, name, None) or getattr(dist, name, None)
        if original is None:
            continue
        wrapper = _wrap(index, original)
        _wrappers[name] = wrapper
        for module in (dist, c10d):
            if hasattr(module, name):
                _originals[(module, name)] = getattr(module, name)
                setattr(module, name, wrapper)
    remaps = _dynamo_remaps()
    for (_module, name), original in _originals.items():
        if original in remaps:
            remaps[_wrappers[name]] = remaps[original]


def _dynamo_remaps() -> dict[Any, Any]:
    """Dynamo's table of collectives it replaces when tracing, if it is loaded already.

    Loaded later, it is built from the names as they are then: the wrappers.
    """
    return _torch_compat.collective_remaps()


def _detach() -> None:
    """In a forked child: keep counting, but privately."""
    global _buffer, _mapped, _path
    if _mapped is not None:
        _buffer = bytearray(_mapped[:SIZE])
        _mapped.close()  # the child's mapping only; the parent's stays
        _mapped = _path = None


def count() -> int:
    """How many collectives this process has entered since :func:`install`."""
    return _entered


def restart_count() -> None:
    """Count from zero again (a live rank whose default group was formed again: the counts
    of the old group say nothing about the new one)."""
    global _entered, _completed
    _entered = _completed = 0
    _pack(_buffer, 0, 0, 0, 0)


def uninstall() -> None:
    """Put the original functions back and unmap the file (for tests)."""
    global _buffer, _mapped, _path
    remaps = _dynamo_remaps()
    for (module, name), original in _originals.items():
        setattr(module, name, original)
        wrapper = _wrappers.get(name)
        if wrapper in remaps:
            remaps.setdefault(original, remaps[wrapper])
    _originals.clear()
    _wrappers.clear()
    _buffer = bytearray(SIZE)
    if _mapped is not None:
        _mapped.close()
    _mapped = _path = None
