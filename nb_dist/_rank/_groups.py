"""Rank side: every process group a rank creates lives until the rank leaves with ``os._exit``.

Destroying a gloo process group while other threads still finish its work can kill or hang a
rank after the user's function has returned: the group's destructor joins its worker threads
holding the GIL while one of them waits for the GIL to free a Python object (a hang), or the
last reference is dropped on one of those threads, which then joins itself (``std::terminate``,
"Resource deadlock avoided", SIGABRT). It happens when a DDP model outlives
``destroy_process_group()`` (the PyTorch DDP tutorial series' ``main``), or when a comm hook's
futures drop the last reference (PowerSGD), and far more often in a process forked from a
parent that imported ``torch._dynamo`` (pytorch/pytorch#56297 is the upstream issue).

Every rank of nb_dist leaves through ``os._exit``, which runs no destructor, so the groups
need never be destroyed at all: a reference to each one is kept here from its creation on.
``destroy_process_group()`` still does everything else it does (the group is gone from
``torch.distributed``'s tables and a new ``init_process_group`` works).
"""

from __future__ import annotations

import functools
from typing import Any

from .._shared import _torch_compat

#: The functions wrapped, in ``torch.distributed.distributed_c10d``: every group is made by the
#: first (the default one and ``new_group``'s), and the default one is also passed to the
#: second; either is enough for the default group. Both are torch privates, listed (with what
#: is lost without them) in ``_torch_compat.PRIVATES``.
HOOKED = ("_new_process_group_helper", "_update_default_pg")

_kept: list[Any] = []


def kept() -> int:
    """How many objects holding process groups this rank keeps (for tests)."""
    return len(_kept)


def install(c10d: Any = None) -> list[str]:
    """Keep every process group this rank creates; the hooks this torch lacks (names, each
    also logged by ``_torch_compat``).

    ``c10d`` is ``torch.distributed.distributed_c10d`` unless given (tests give a stand-in)."""
    if c10d is None:
        c10d = _torch_compat.c10d()
        if c10d is None:  # pragma: no cover - torch without distributed support
            return []
    return [
        f"torch.distributed.distributed_c10d.{name}"
        for name in HOOKED
        if not _torch_compat.replace(c10d, name, _keeping)
    ]


def fresh_group_names(c10d: Any = None) -> bool:
    """Number this rank's process groups from 0, as in a fresh process; whether it had to.

    torch names a group by a counter that lives in the process (``"0"`` for the first
    default group). A forked rank inherits the kernel's: after a process group was created
    and destroyed in the kernel, or an ``init_process_group`` there failed, the counter is
    no longer 0, the forked ranks' group is named ``"1"``, and ranks started fresh (a second
    node, a spawned rank) that name theirs ``"0"`` wait for each other forever."""
    if c10d is None:
        c10d = _torch_compat.c10d()
    world = _torch_compat.lookup(c10d, "_world") if c10d is not None else None
    if world is None or c10d.is_initialized():
        return False
    if getattr(world[0], "group_count", 0) == 0:
        return False
    world[0].group_count = 0
    return True


def _keeping(original: Any) -> Any:
    if getattr(original, "_nb_dist_keeps", False):
        return original  # installed already

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if result is not None:
            _kept.append(result)  # a group, or a tuple holding one: never freed before _exit
        elif args and args[0] is not None:
            _kept.append(args[0])  # _update_default_pg(pg) returns nothing
        return result

    wrapper._nb_dist_keeps = True  # type: ignore[attr-defined]
    return wrapper
