"""Every private part of torch nb_dist touches, in one place, each with what is lost without it.

torch's private functions change between releases without notice. nb_dist needs a few of
them (to tell the kernel when a rank's rendezvous starts and ends, to keep process groups
alive until a rank exits, to name the line that first touched CUDA, ...). Each one is listed
in :data:`PRIVATES` with the oldest torch release known to have it and what degrades when a
release lacks it. The rest of the package reaches them only through the functions here, which
never raise when one is missing: they return what they could do and log what they could not
on this module's logger (under ``nb_dist``). ``tests/test_torch_hooks.py`` has a canary for
every entry (it fails on a torch that lacks one) and shows each function degrading on a torch
without its private.

Both sides use it: the kernel (CUDA first touch, the bad-fork flag, the NVML count,
``ChildFailedError``'s attributes) and the ranks (c10d's rendezvous, group creation, the
collectives' tracing table, group timeouts). It imports torch only inside its functions.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, Literal

_log = logging.getLogger(__name__)

#: The oldest torch release every entry below was checked against (the project's lower bound;
#: CI runs it in the Kaggle profile).
CHECKED_WITH = "2.10"

#: How nb_dist uses a private: replaces it by a wrapper, calls it, reads it (a table), or sets
#: it on an instance of torch's class.
Use = Literal["wrapped", "called", "read", "set on an instance", "counter reset"]


@dataclass(frozen=True)
class Private:
    """One private attribute of torch that nb_dist uses."""

    module: str  # where it lives, e.g. "torch.distributed.distributed_c10d"
    name: str
    use: Use
    used_by: str  # the nb_dist modules that need it
    since: str  # the oldest torch release known to have it ("1.x": long before 2.13)
    without: str  # what a user loses when a torch release lacks it
    public: str = ""  # a public replacement, used first where a torch has it

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


_C10D = "torch.distributed.distributed_c10d"
_FUNCTIONAL = "torch.distributed._functional_collectives"

#: Every torch private nb_dist touches. Public torch API is not listed.
PRIVATES: tuple[Private, ...] = (
    Private("torch.distributed.rendezvous", "_create_c10d_store", "wrapped",
            "_rank/_rendezvous.py", "1.x (torchelastic's agent store)",
            "code that picks its own rendezvous address (the DDP tutorial's MASTER_PORT) "
            "waits for a store nobody hosts, until the launch's timeout"),
    Private(_C10D, "rendezvous", "wrapped", "_rank/_rendezvous.py", "1.0",
            "no rendezvous watchdog: a missing rank is waited for as long as the launch's "
            "timeout allows"),
    Private(_C10D, "_update_default_pg", "wrapped", "_rank/_rendezvous.py, _rank/_groups.py",
            "1.x",
            "no rendezvous watchdog; the default group may be freed while its threads run"),
    Private(_C10D, "_new_process_group_helper", "wrapped", "_rank/_groups.py", "1.0",
            "a group may be destroyed while its threads still run (a hang or SIGABRT at exit)"),
    Private(_C10D, "_world", "counter reset", "_rank/_groups.py", "1.x (group_count)",
            "after a process group was created or failed in the kernel, forked ranks name "
            "their groups differently from ranks started fresh (another node): they wait "
            "for each other until the timeout"),
    Private(_C10D, "_pg_map", "read", "_rank/_debug.py", "1.0",
            "a rank paused at a breakpoint keeps torch's collective timeout"),
    Private(_C10D, "_set_pg_timeout", "called", "_rank/_debug.py",
            "2.3 (pytorch/pytorch#115453)",
            "a rank paused at a breakpoint keeps torch's collective timeout",
            public="set_timeout"),  # pytorch/pytorch#187387, after 2.13
    Private(_FUNCTIONAL, "traceable_collective_remaps", "read", "_shared/_collectives.py",
            "2.x (torch.compile's functional collectives)",
            "compiled code may not see the counted collectives as collectives"),
    Private("torch._C", "_cuda_getDeviceCount", "wrapped", "_kernel/_preflight.py", "1.x",
            "a CUDA refusal cannot name the line that first touched CUDA"),
    Private("torch._C", "_cuda_init", "wrapped", "_kernel/_preflight.py", "1.x",
            "a CUDA refusal cannot name the line that first touched CUDA"),
    Private("torch._C", "_cuda_isInBadFork", "called", "_kernel/_preflight.py", "1.x",
            "CUDA poisoned by is_available() without NVML is not detected before forking"),
    Private("torch.cuda", "_device_count_nvml", "called", "_kernel/_preflight.py",
            "1.13",
            "in a poisoned kernel the refusal cannot say how many GPUs there are"),
    Private("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "failures",
            "set on an instance", "_kernel/_errors.py", "1.9 (torch.distributed.elastic)",
            "code that reads err.failures (torchrun's per-rank table) finds nothing"),
)  # fmt: skip

# The CUDA builds' private entry points: on a CPU build they are absent and never needed.
_CUDA_ONLY = frozenset({"_cuda_getDeviceCount", "_cuda_init", "_cuda_isInBadFork"})
# Set on torch._C once its CUDA entry points are wrapped (a second call wraps nothing).
_RECORDER_MARK = "_nb_dist_recorder"


def cuda_only(private: Private) -> bool:
    """Whether ``private`` exists on CUDA builds of torch only."""
    return private.name in _CUDA_ONLY


def registered(name: str) -> Private | None:
    """The entry of :data:`PRIVATES` for attribute ``name``, if it is listed."""
    return next((p for p in PRIVATES if p.name == name), None)


def _torch_version() -> str:
    return str(getattr(sys.modules.get("torch"), "__version__", "?"))


def _say_missing(where: object, name: str) -> None:
    """Log that this torch lacks ``where.name``, with what that costs and since when it was
    expected."""
    owner = getattr(where, "__name__", None) or type(where).__name__
    private = registered(name)
    if private is None:
        _log.info("torch %s has no %s.%s: nb_dist goes on without it", _torch_version(), owner,
                  name)  # fmt: skip
        return
    _log.info(
        "torch %s has no %s.%s (expected since torch %s; nb_dist is checked with %s): %s",
        _torch_version(), owner, name, private.since, CHECKED_WITH, private.without,
    )  # fmt: skip


def module(name: str) -> ModuleType | None:
    """The torch module ``name``, imported; ``None`` if this torch has no such module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def c10d() -> ModuleType | None:
    """``torch.distributed.distributed_c10d``, or ``None`` without distributed support."""
    return module(_C10D)


def lookup(where: ModuleType | Any, *names: str) -> tuple[Any, ...] | None:
    """``where``'s attributes ``names``, all of them or ``None`` (each missing one logged).

    For hooks that only work together: a torch with half of them gets neither.
    """
    found = tuple(getattr(where, name, None) for name in names)
    missing = [name for name, value in zip(names, found, strict=True) if value is None]
    for name in missing:
        _say_missing(where, name)
    return None if missing else found


def replace(
    where: ModuleType | Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> bool:
    """Replace ``where.name`` by ``make(original)``; whether it was there to replace.

    A missing one is logged (with what is lost, when it is listed in :data:`PRIVATES`).
    ``make`` returns ``original`` itself when it is its own wrapper already (a second install).
    """
    original = getattr(where, name, None)
    if original is None:
        _say_missing(where, name)
        return False
    setattr(where, name, make(original))
    return True


def set_group_timeouts(timeout: timedelta, torch_c10d: Any = None) -> list[str]:
    """Give every process group of this rank ``timeout`` for its collectives.

    The groups a paused rank's peers wait in must not time out while a person reads pdb.
    Uses torch's public ``torch.distributed.set_timeout`` where a release has it (it replaces
    ``_set_pg_timeout`` after 2.13), else ``_set_pg_timeout``. Returns what could not be done
    (also logged), empty when every group took it. ``torch_c10d`` is
    ``torch.distributed.distributed_c10d`` unless given (tests give a stand-in).
    """
    where = torch_c10d if torch_c10d is not None else c10d()
    if where is None:  # pragma: no cover - torch without distributed support
        return ["this torch has no torch.distributed"]
    groups = getattr(where, "_pg_map", None)
    setter = getattr(where, "set_timeout", None) or getattr(where, "_set_pg_timeout", None)
    if groups is None or setter is None:
        missing = "_pg_map" if groups is None else "_set_pg_timeout"
        _say_missing(where, missing)
        return [f"torch {_torch_version()} has no {_C10D}.{missing}"]
    problems: list[str] = []
    for group in list(groups):
        try:
            setter(timeout, group)
        except Exception as exc:  # a backend that keeps its timeout fixed, or a bad value
            problems.append(f"{group!r}: {type(exc).__name__}: {exc}")
    for text in problems:
        _log.info(
            "could not lengthen a process group's timeout, so ranks waiting for a paused one "
            "may time out: %s",
            text,
        )
    return problems


def collective_remaps(functional: Any = None) -> dict[Any, Any]:
    """torch.compile's table of collectives it swaps for traceable ones, if it is loaded
    (``{}`` otherwise, or when this torch has no such table: then logged).

    ``functional`` is ``torch.distributed._functional_collectives`` if already imported,
    unless given (tests give a stand-in); it is never imported here (it is heavy, and once
    loaded later it builds its table from the wrapped names anyway).
    """
    loaded = functional if functional is not None else sys.modules.get(_FUNCTIONAL)
    if loaded is None:
        return {}
    remaps = getattr(loaded, "traceable_collective_remaps", None)
    if not isinstance(remaps, dict):
        _say_missing(loaded, "traceable_collective_remaps")
        return {}
    return remaps


def bad_fork_check(torch: ModuleType | Any) -> Callable[[], bool]:
    """A function that says whether this (forked) process inherited CUDA state it cannot use.

    Looked up in the kernel, before forking, so that a missing one is logged there (a forked
    child must not log into the kernel's streams); called in the child. Without it the answer
    is always ``False``.
    """
    check = getattr(torch._C, "_cuda_isInBadFork", None)
    if check is None:
        _say_missing(torch._C, "_cuda_isInBadFork")
        return lambda: False
    return lambda: bool(check())


def gpus_from_nvml(torch: ModuleType | Any) -> int:
    """The GPUs NVML sees, without touching CUDA; 0 when this torch cannot ask NVML (logged)."""
    count = getattr(torch.cuda, "_device_count_nvml", None)
    if count is None:
        _say_missing(torch.cuda, "_device_count_nvml")
        return 0
    return max(0, int(count()))


def wrap_cuda_entry_points(
    torch: ModuleType | Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> list[str]:
    """Wrap the two functions through which anything first touches CUDA (once per process:
    ``torch._C`` is marked); the names wrapped by this call."""
    if getattr(torch._C, _RECORDER_MARK, False):
        return []
    wrapped = [name for name in ("_cuda_getDeviceCount", "_cuda_init")
               if replace(torch._C, name, make)]  # fmt: skip
    setattr(torch._C, _RECORDER_MARK, True)
    return wrapped


def child_failed_attributes(error: Any, name: str, failures: dict[int, Any]) -> None:
    """Give an exception torch's ``ChildFailedError`` attributes without its ``__init__``
    (whose message is torchrun's table): what code written for torchrun reads
    (``err.failures``, and ``get_first_failure()``, which reads it)."""
    error.name = name
    error.failures = failures
