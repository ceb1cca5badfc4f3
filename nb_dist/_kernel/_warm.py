"""Warm relaunches: later launches inherit what earlier launches' ranks had to import.

A forked rank starts with every module the kernel has. ``DistributedDataParallel(...)``
imports ``torch._dynamo`` (about 800 modules, 1.5-3 s) the first time it runs, and the kernel
never does, so every launch of a DDP training cell paid it again, in every rank. Now each
forked rank tells the kernel which modules it imported that the kernel lacks; after the
launch the kernel imports the safe ones in a background thread, and the next launch's ranks
inherit them: a re-run DDP cell starts as fast as a trivial launch.

What is imported: only modules under ``SAFE_ROOTS`` (``_shared/_imports.py``: torch's
pure-Python subpackages and the libraries they pull in), never on spawn/forkserver launches
(their ranks do not inherit the kernel's modules). Importing them starts no thread and does
not touch CUDA; both are checked after each import (thread count, and the CUDA first-touch
recorder), and warming is switched off for the rest of the kernel, with a notice, if either
happens. Every fork in the kernel (a launch's ranks, its probes, a restart, live ranks
renewed) waits for a running import first (an ``os.register_at_fork`` hook), so no child
inherits a half-imported module.

In a Jupyter kernel, :func:`prefetch_at_import` starts the same import when ``nb_dist`` is
imported, for :data:`PREFETCH` (what a first DDP cell needs): a launch or a live session a few
seconds later, the very first one included, inherits it instead of paying it in every rank.
Scripts and the command line are left alone (they launch at once, and would only wait).

Cost: the kernel's memory grows by what the modules take (about 70 MB for ``torch._dynamo``),
once. Opt out with ``notebook_launcher(..., warm_imports=False)`` or ``NB_DIST_WARM_IMPORTS=0``
(which also stops the import at ``import nb_dist``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable

from .._shared._env import switched_off
from . import _openmp, _preflight
from ._tracebacks import kernel_is_running

ENV = "NB_DIST_WARM_IMPORTS"
#: Imported at ``import nb_dist`` in a kernel: what ``DistributedDataParallel(...)`` pulls in
#: the first time (``torch._dynamo`` and what it imports: 1.5-3 s per rank otherwise).
PREFETCH = ("torch._dynamo",)
#: The longest a fork or a launch waits for a warm import (a few seconds is usual).
WAIT_LIMIT = 60.0
_log = logging.getLogger(__name__)
_thread: threading.Thread | None = None
_importing: str | None = None  # the module the background thread is importing now
_disabled_because: str | None = None
_imported: list[str] = []
_lock = threading.Lock()


def enabled(option: bool) -> bool:
    if not option or _disabled_because is not None:
        return False
    return not switched_off(ENV)


def schedule(names: Iterable[str]) -> None:
    """Import ``names`` the kernel lacks, in a background thread (one at a time)."""
    global _thread
    missing = sorted({n for n in names if n not in sys.modules})
    if not missing or _disabled_because is not None:
        return
    wait()
    _thread = threading.Thread(
        target=_import_all, args=(missing,), name="nb_dist-warm", daemon=True
    )
    _thread.start()


def prefetch_at_import() -> bool:
    """In a Jupyter kernel, start importing :data:`PREFETCH` in the background; whether it
    started (not in scripts, not with ``NB_DIST_WARM_IMPORTS=0``)."""
    if not enabled(True) or not kernel_is_running():
        return False
    schedule(PREFETCH)
    return _thread is not None


def wait(limit: float | None = None) -> float:
    """Block until a running warm import has finished, at most ``limit`` s (default
    :data:`WAIT_LIMIT`); the seconds waited. An import still running then is given up on:
    warming is switched off (with a notice at the next launch) instead of waiting for ever."""
    global _disabled_because
    thread = _thread
    if thread is None or not thread.is_alive() or thread is threading.current_thread():
        return 0.0
    began = time.monotonic()
    thread.join(WAIT_LIMIT if limit is None else limit)
    if thread.is_alive():
        name = _importing or "a module"
        _disabled_because = (
            f"importing {name} did not finish within {time.monotonic() - began:.0f} s"
        )
        _log.warning("warm import of %s is still running; not waiting for it", name)
    return time.monotonic() - began


def take_notice() -> str | None:
    """A one-time notice if warming was switched off, else ``None``."""
    global _disabled_because
    reason = _disabled_because
    if reason and not reason.startswith("said:"):
        _disabled_because = "said:" + reason
        return (
            f"Warm relaunches are off for this kernel: {reason}. Later launches import what "
            "their ranks need themselves, as the first did."
        )
    return None


def imported() -> list[str]:
    """The modules imported for later launches so far (for the curious, and for tests)."""
    with _lock:
        return list(_imported)


def _import_all(names: list[str]) -> None:
    global _disabled_because, _importing
    for name in names:
        threads_before = _openmp.thread_count()
        touched_before = _preflight.cuda_touched()
        _importing = name
        environ = {key: os.environ.get(key) for key in SET_BY_IMPORTS}
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # the next launch's ranks import it themselves
            _log.info("warm import of %s failed: %s: %s", name, type(exc).__name__, exc)
            continue
        finally:
            _restore_environ(environ)
        if _preflight.cuda_touched() and not touched_before:
            _disabled_because = f"importing {name} touched CUDA"
            return
        if _openmp.thread_count() > threads_before:
            _disabled_because = f"importing {name} started a thread"
            return
        with _lock:
            _imported.append(name)


#: What importing torch's modules sets in ``os.environ`` (``torch._inductor``: its cache
#: folder), undone after each warm import: the launcher changes no environment variable of the
#: kernel, and one the user's own import would set is set then, by that import. Only these:
#: a cell may change the environment while a warm import runs in the background, and what it
#: changes is the user's (``tests/test_warm.py`` holds this list complete for a DDP launch).
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)


def _restore_environ(before: dict[str, str | None]) -> None:
    """Put the variables of :data:`SET_BY_IMPORTS` back as they were before an import."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        elif os.environ.get(key) != value:
            os.environ[key] = value


def _before_fork() -> None:
    """Every ``os.fork`` in the kernel waits for a running warm import (not the import's own
    thread: a module that forks while it is imported must not wait for itself)."""
    wait()


os.register_at_fork(before=_before_fork)
