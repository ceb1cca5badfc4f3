"""Runs in a launch's rank: a script file as ``__main__``, as ``python train.py ARGS`` would.

``run_script`` (``_kernel/_scripts.py``) launches :func:`run_as_main` as the function of
every rank, so a script written for ``torchrun`` gets everything a launch gives (labelled
output, the root cause, hang stacks, restarts) with nothing changed: ``sys.argv`` is the
script's, its folder is first on ``sys.path``, ``__name__ == "__main__"`` and
``sys.modules["__main__"]`` is the script while it runs (pickling its classes works), and
``sys.exit(0)`` is a normal end. The rank's environment is already torchrun's.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


def run_as_main(path: str, argv: Sequence[str]) -> int:
    """Run the file at ``path`` as ``__main__`` with ``sys.argv == [path, *argv]``; its exit
    status (0: it ended, or called ``sys.exit(0)``). A non-zero ``sys.exit`` is the rank's
    failure, reported like any exception."""
    folder = os.path.dirname(os.path.abspath(path))
    sys.argv = [path, *argv]
    if not sys.path or sys.path[0] != folder:
        sys.path.insert(0, folder)  # as `python path` does: the script's own modules import
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    return 0
