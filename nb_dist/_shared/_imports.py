"""Which modules a forked rank names to the kernel for warm relaunches (``_kernel/_warm.py``).

Runs in the rank (it filters what it imported before sending :class:`~_protocol.Imports`);
the kernel imports what arrives, in the background, for the next launch's forks.
"""

from __future__ import annotations

from collections.abc import Iterable

# Roots whose modules a rank may ask the kernel to import. Each is pure Python at import
# time (no threads, no CUDA): torch's own subpackages and the libraries torch._dynamo uses.
SAFE_ROOTS = ("torch", "sympy", "mpmath", "accelerate")
# Never imported on purpose: inductor's compile machinery may start worker pools at import
# (torch._dynamo still imports the parts of it that it needs).
_NEVER = ("torch._inductor",)
# At most this many module names per launch (the subtree roots; their children come along).
MAX_NAMES = 64


def worth_importing(new_modules: Iterable[str]) -> list[str]:
    """From the modules a rank imported, the subtree roots the kernel may import (sorted)."""
    new = {
        name
        for name in new_modules
        if name.split(".", 1)[0] in SAFE_ROOTS and not name.startswith(_NEVER)
    }
    roots = sorted(name for name in new if name.rpartition(".")[0] not in new)
    return roots[:MAX_NAMES]
