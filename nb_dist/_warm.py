"""Warm relaunches: later launches inherit what earlier launches' workers had to import.

A forked worker starts with every module the kernel has. ``DistributedDataParallel(...)``
imports ``torch._dynamo`` (about 800 modules, 1.5-3 s) the first time it runs, and the kernel
never does, so every launch of a DDP training cell paid it again, in every worker. Now each
forked worker tells the kernel which modules it imported that the kernel lacks; after the
launch the kernel imports the safe ones in a background thread, and the next launch's workers
inherit them: a re-run DDP cell starts as fast as a trivial launch.

What is imported: only modules under :data:`SAFE_ROOTS` (torch's pure-Python subpackages and
the libraries they pull in), never on spawn/forkserver launches (their workers do not inherit
the kernel's modules). Importing them starts no thread and does not touch CUDA; both are
checked after each import (thread count, and the CUDA first-touch recorder), and warming is
switched off for the rest of the kernel, with a notice, if either happens. Every fork the
launcher makes waits for a running import first, so no worker inherits a half-imported module.

Cost: the kernel's memory grows by what the modules take (about 70 MB for ``torch._dynamo``),
once. Opt out with ``notebook_launcher(..., warm_imports=False)`` or ``NB_DIST_WARM_IMPORTS=0``.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Iterable

ENV = "NB_DIST_WARM_IMPORTS"
# Roots whose modules a worker may ask the kernel to import. Each is pure Python at import
# time (no threads, no CUDA): torch's own subpackages and the libraries torch._dynamo uses.
SAFE_ROOTS = ("torch", "sympy", "mpmath", "accelerate")
# Never imported on purpose: inductor's compile machinery may start worker pools at import
# (torch._dynamo still imports the parts of it that it needs).
_NEVER = ("torch._inductor",)
# At most this many module names per launch (the subtree roots; their children come along).
MAX_NAMES = 64

_thread: threading.Thread | None = None
_disabled_because: str | None = None
_imported: list[str] = []
_lock = threading.Lock()


def enabled(option: bool) -> bool:
    if not option or _disabled_because is not None:
        return False
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def worth_importing(new_modules: Iterable[str]) -> list[str]:
    """From the modules a worker imported, the subtree roots the kernel may import (sorted)."""
    new = {
        name
        for name in new_modules
        if name.split(".", 1)[0] in SAFE_ROOTS and not name.startswith(_NEVER)
    }
    roots = sorted(name for name in new if name.rpartition(".")[0] not in new)
    return roots[:MAX_NAMES]


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


def wait() -> float:
    """Block until a running warm import has finished; the seconds waited."""
    thread = _thread
    if thread is None or not thread.is_alive():
        return 0.0
    began = time.monotonic()
    thread.join()
    return time.monotonic() - began


def take_notice() -> str | None:
    """A one-time notice if warming was switched off, else ``None``."""
    global _disabled_because
    reason = _disabled_because
    if reason and not reason.startswith("said:"):
        _disabled_because = "said:" + reason
        return (
            f"Warm relaunches are off for this kernel: {reason}. Later launches import what "
            "their workers need themselves, as the first did."
        )
    return None


def imported() -> list[str]:
    """The modules imported for later launches so far (for the curious, and for tests)."""
    with _lock:
        return list(_imported)


def _import_all(names: list[str]) -> None:
    global _disabled_because
    from . import _openmp, _preflight

    for name in names:
        threads_before = _openmp.thread_count()
        touched_before = _preflight.cuda_touched()
        try:
            importlib.import_module(name)
        except BaseException:
            continue
        if _preflight.cuda_touched() and not touched_before:
            _disabled_because = f"importing {name} touched CUDA"
            return
        if _openmp.thread_count() > threads_before:
            _disabled_because = f"importing {name} started a thread"
            return
        with _lock:
            _imported.append(name)
