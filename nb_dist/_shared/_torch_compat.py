"""Every private part of torch nb_dist touches, in one place, each with what is lost without it.

torch's private functions change between releases without notice. nb_dist needs a few of
them (to say which collective a blocked rank is in, who hosts the rendezvous store, where
CUDA was first touched, ...). Each one is listed in :data:`PRIVATES` with the torch release
it was checked against and what degrades when a release renames it; the modules that use
them reach them only through the functions here, which never raise when one is missing:
they return what they could do and log what they could not on the ``nb_dist`` logger.
``tests/test_torch_hooks.py`` checks every entry against the tested torch (a canary each).

Both sides use it: the kernel (CUDA first touch, the bad-fork flag, ``ChildFailedError``'s
attributes) and the ranks (c10d's rendezvous, group creation, collectives, group timeouts).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

_log = logging.getLogger(__name__)

#: The torch release every entry below was last checked against (the project's lower bound).
CHECKED_WITH = "2.13"


@dataclass(frozen=True)
class Private:
    """One private attribute of torch that nb_dist uses."""

    module: str  # where it lives, e.g. "torch.distributed.distributed_c10d"
    name: str
    used_by: str  # the nb_dist module that needs it
    without: str  # what a user loses when a torch release lacks it

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


_C10D = "torch.distributed.distributed_c10d"

#: Every torch private nb_dist touches. Public torch API is not listed.
PRIVATES: tuple[Private, ...] = (
    Private("torch.distributed.rendezvous", "_create_c10d_store", "_rank/_rendezvous.py",
            "rendezvous reports cannot tell who hosts the store"),
    Private(_C10D, "rendezvous", "_rank/_rendezvous.py",
            "no rendezvous watchdog: a missing rank is waited for as long as torch waits"),
    Private(_C10D, "_update_default_pg", "_rank/_rendezvous.py, _rank/_groups.py",
            "no rendezvous watchdog; the default group may be freed while its threads run"),
    Private(_C10D, "_new_process_group_helper", "_rank/_groups.py",
            "a group may be destroyed while its threads still run (a hang or SIGABRT at exit)"),
    Private(_C10D, "_pg_map", "_rank/_debug.py",
            "a rank paused at a breakpoint keeps torch's collective timeout"),
    Private(_C10D, "_set_pg_timeout", "_rank/_debug.py",
            "a rank paused at a breakpoint keeps torch's collective timeout"),
    Private("torch.distributed._functional_collectives", "traceable_collective_remaps",
            "_shared/_collectives.py",
            "compiled code may not see the counted collectives as collectives"),
    Private("torch._C", "_cuda_getDeviceCount", "_kernel/_preflight.py",
            "a CUDA refusal cannot name the line that first touched CUDA"),
    Private("torch._C", "_cuda_init", "_kernel/_preflight.py",
            "a CUDA refusal cannot name the line that first touched CUDA"),
    Private("torch._C", "_cuda_isInBadFork", "_kernel/_preflight.py",
            "CUDA poisoned by is_available() without NVML is not detected before forking"),
    Private("torch.cuda", "_device_count_nvml", "_kernel/_preflight.py",
            "in a poisoned kernel the refusal cannot say how many GPUs there are"),
    Private("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "failures",
            "_kernel/_errors.py",
            "code that reads err.failures (torchrun's per-rank table) finds nothing"),
)  # fmt: skip

# The CUDA builds' private entry points: on a CPU build they are absent and never needed.
_CUDA_ONLY = frozenset({"_cuda_getDeviceCount", "_cuda_init", "_cuda_isInBadFork"})
# Attributes set on instances (not looked up on a module): checked by the canary differently.
INSTANCE_ATTRIBUTES = frozenset({"failures"})


def cuda_only(private: Private) -> bool:
    return private.name in _CUDA_ONLY


def module(name: str) -> ModuleType | None:
    """The torch module ``name``, imported; ``None`` if this torch has no such module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def c10d() -> ModuleType | None:
    """``torch.distributed.distributed_c10d``, or ``None`` without distributed support."""
    return module(_C10D)


def present(where: ModuleType | Any, *names: str) -> bool:
    """Whether ``where`` has every one of ``names`` (logged when it does not)."""
    missing = [name for name in names if getattr(where, name, None) is None]
    for name in missing:
        lost = next((p.without for p in PRIVATES if p.name == name), "a feature")
        _log.info("torch lacks %s.%s: %s", getattr(where, "__name__", where), name, lost)
    return not missing


def replace(
    where: ModuleType | Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> bool:
    """Replace ``where.name`` by ``make(original)``; whether it was there to replace.

    A missing one is logged (with what is lost, when it is listed in :data:`PRIVATES`).
    """
    original = getattr(where, name, None)
    if original is None:
        owner = getattr(where, "__name__", type(where).__name__)
        lost = next((p.without for p in PRIVATES if p.name == name), "a feature")
        _log.info("torch lacks %s.%s: %s", owner, name, lost)
        return False
    setattr(where, name, make(original))
    return True


def set_group_timeouts(timeout: timedelta) -> list[str]:
    """Give every process group of this rank ``timeout`` for its collectives.

    The groups a paused rank's peers wait in must not time out while a person reads pdb.
    Returns what could not be done (logged too), empty when every group took it.
    """
    dist = sys.modules.get("torch.distributed")
    c10d_module = c10d()
    groups = getattr(c10d_module, "_pg_map", None)
    setter = getattr(c10d_module, "_set_pg_timeout", None)
    if dist is None or groups is None or setter is None:
        lacking = f"torch lacks {_C10D}._pg_map or _set_pg_timeout"
        _log.info("%s: the collective timeout stays torch's", lacking)
        return [lacking]
    problems: list[str] = []
    for group in list(groups):
        try:
            setter(timeout, group)
        except Exception as exc:  # a group of a backend that keeps its timeout fixed
            problems.append(f"{group!r}: {type(exc).__name__}: {exc}")
    for text in problems:
        _log.info("could not lengthen a process group's timeout: %s", text)
    return problems


def collective_remaps() -> dict[Any, Any]:
    """torch.compile's table of collectives it swaps for traceable ones, if it is loaded
    (``{}`` otherwise, or when this torch has no such table)."""
    loaded = sys.modules.get("torch.distributed._functional_collectives")
    remaps = getattr(loaded, "traceable_collective_remaps", None)
    return remaps if isinstance(remaps, dict) else {}


def in_bad_fork(torch: ModuleType) -> bool:
    """Whether this (forked) process inherited CUDA state it cannot use; ``False`` when this
    torch cannot say."""
    check = getattr(torch._C, "_cuda_isInBadFork", None)
    return bool(check()) if check is not None else False


def gpus_from_nvml(torch: ModuleType) -> int:
    """The GPUs NVML sees, without touching CUDA; 0 when this torch cannot ask NVML."""
    count = getattr(torch.cuda, "_device_count_nvml", None)
    return max(0, int(count())) if count is not None else 0


def wrap_cuda_entry_points(
    torch: ModuleType, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> list[str]:
    """Wrap the two functions through which anything first touches CUDA; the names wrapped."""
    return [name for name in ("_cuda_getDeviceCount", "_cuda_init")
            if replace(torch._C, name, make)]  # fmt: skip


def child_failed_attributes(error: Any, name: str, failures: dict[int, Any]) -> None:
    """Give an exception torch's ``ChildFailedError`` attributes without its ``__init__``
    (whose message is torchrun's table): what code written for torchrun reads."""
    error.name = name
    error.failures = failures
