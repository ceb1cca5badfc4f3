"""Runs in a rank: what training libraries froze about the kernel at import, made true again.

A rank is a torchrun rank: not an interactive console. A forked rank inherits the kernel's
``sys.ps1`` (IPython sets it) and every module the kernel imported, including flags a library
computed from it once, at import. Lightning is the one that matters: its
``_IS_INTERACTIVE = hasattr(sys, "ps1") or bool(sys.flags.interactive)`` is copied into
several of its modules by ``from ... import``, and Fabric and Trainer refuse
``strategy="ddp"`` while it is true ("not compatible with an interactive environment"),
although nb_dist's ranks are the processes Lightning asks for (it detects them as torchrun's,
by ``TORCHELASTIC_RUN_ID``).

:func:`become_a_script` removes ``sys.ps1``/``sys.ps2`` (modules imported later in the rank see
a script) and clears each frozen flag listed in :data:`FROZEN` in the modules already
imported. Every entry names the oldest release known to have it; ``tests/test_frameworks.py``
has a canary for each against the real package. A release without the flag is left alone
(nothing is set that was not there).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Frozen:
    """A module-level flag a library computed from the kernel's state at import."""

    packages: tuple[str, ...]  # the packages whose modules may hold it (``from ... import``)
    defined_in: str  # the module that computes it (the canary's)
    name: str
    value_in_a_rank: bool
    since: str  # the oldest release known to have it
    without: str  # what goes wrong in a rank while it keeps the kernel's value


#: Every frozen flag nb_dist clears in a rank. Lightning ships under two names
#: (``lightning.fabric``/``lightning.pytorch`` and ``lightning_fabric``/``pytorch_lightning``)
#: and copies the flag into several modules: each copy is cleared.
FROZEN: tuple[Frozen, ...] = (
    Frozen(
        packages=("lightning", "lightning_fabric", "pytorch_lightning"),
        defined_in="lightning.fabric.utilities.imports",
        name="_IS_INTERACTIVE",
        value_in_a_rank=False,
        since="lightning 2.6.6 (the release checked)",
        without="Fabric/Trainer(strategy='ddp') refuse to run: 'not compatible with an "
        "interactive environment'",
    ),
)


def become_a_script() -> list[str]:
    """Make this rank look like a script's process to libraries; the flags it set (names)."""
    for prompt in ("ps1", "ps2"):
        if hasattr(sys, prompt):
            delattr(sys, prompt)
    changed = []
    for flag in FROZEN:
        for module_name, module in list(sys.modules.items()):
            if module_name.partition(".")[0] not in flag.packages:
                continue  # not imported in the kernel: it computes the flag in the rank
            current = getattr(module, flag.name, None)
            if isinstance(current, bool) and current != flag.value_in_a_rank:
                setattr(module, flag.name, flag.value_in_a_rank)
                changed.append(f"{module_name}.{flag.name}")
    if changed:
        _log.info("a rank is not interactive: set %s", ", ".join(changed))
    return changed
