"""Which files are nb_dist's own, so its frames stay out of the user's tracebacks and stacks.

Runs on both sides: a rank cuts the runner's frames off a failure's traceback before it
sends it (``_rank/_oneshot.py``, ``_rank/_debug.py``); the kernel leaves the package's
frames out of hang stacks and crash dumps (``_kernel/_tracebacks.py``, ``_kernel/_diagnosis.py``).
Every rule about "is this frame ours" lives here, so moving a module cannot break one.
"""

from __future__ import annotations

import os
import runpy
from types import TracebackType

#: The ``nb_dist`` folder: every file under it is the launcher's, not the user's.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A rank's entry point: the frames below it (a forked rank's copy of the kernel's) are not
#: the rank's work.
ENTRY_FILE = os.path.join(PACKAGE_DIR, "_rank", "_entry.py")
#: Where a one-shot rank calls the user's function: a blocked rank whose innermost frame is
#: this call has returned from the function (native code frees its locals).
FUNCTION_CALL = (os.path.join(PACKAGE_DIR, "_rank", "_oneshot.py"), "run")
#: The files whose frames run the user's code: left out of a failure's traceback (a script
#: run by ``run_script`` goes through ``_rank/_as_main.py`` and the standard ``runpy``).
RUNNER_FILES = frozenset(
    {
        ENTRY_FILE,
        FUNCTION_CALL[0],
        os.path.join(PACKAGE_DIR, "_rank", "_serve.py"),
        os.path.join(PACKAGE_DIR, "_rank", "_as_main.py"),
        runpy.run_path.__code__.co_filename,  # "<frozen runpy>" where it is frozen
    }
)


def is_own(filename: str) -> bool:
    """Whether ``filename`` is one of nb_dist's own modules."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep)


def from_user_code(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the runner's outermost frames: it starts at the user's code."""
    while tb is not None and tb.tb_frame.f_code.co_filename in RUNNER_FILES:
        tb = tb.tb_next
    return tb
