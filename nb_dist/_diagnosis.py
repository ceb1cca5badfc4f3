"""What a stuck launch means, as pure functions of what the kernel saw (fast to unit-test).

The supervisor collects facts (each rank's stack, when it entered the rendezvous, the world
size it asked for); these functions turn them into the sentences a learner reads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

Frame = tuple[str, int, str]  # (file, line, function), as parsed from a faulthandler dump

_DIST_DIR = os.sep + os.path.join("torch", "distributed") + os.sep
_DDP_FILE = os.sep + os.path.join("torch", "nn", "parallel", "distributed.py")
# Decorators torch wraps its collectives in: their frames say nothing about the call.
_WRAPPER_NAMES = ("wrapper", "_exception_logger", "_time_logger", "inner")


def distributed_call(frames: Sequence[Frame]) -> str | None:
    """The torch.distributed function a rank is blocked in (``"all_reduce"``, ...), or ``None``.

    Frames are most recent last. The answer is the outermost torch.distributed frame, which is
    the function the user's code called (the frames inside it are torch's own helpers); a DDP
    model's forward counts as ``"DistributedDataParallel.forward"``.
    """
    for filename, _line, name in frames:
        if _DIST_DIR in filename and name not in _WRAPPER_NAMES:
            return name
        if filename.endswith(_DDP_FILE):
            return f"DistributedDataParallel.{name}"
    return None


_TRACEBACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def distributed_call_in_traceback(text: str) -> str | None:
    """:func:`distributed_call` for a formatted traceback (most recent call last)."""
    frames = [(m["file"], int(m["line"]), m["name"]) for m in _TRACEBACK_FRAME.finditer(text)]
    return distributed_call(frames)


def skipped_collective_head(rank: int, call: str | None, finished: Sequence[int]) -> str:
    """The first sentence of a failure caused by a collective that other ranks skipped."""
    who = f"rank {finished[0]} had" if len(finished) == 1 else f"ranks {list(finished)} had"
    what = f"a collective ({call})" if call else "a collective"
    return (
        f"rank {rank} failed first: it was waiting in {what} while {who} already returned "
        "from the function, so the connection closed under it. This is how a collective that "
        "some ranks skip (or call fewer times) ends. Make every rank call the same "
        "collectives, the same number of times."
    )


def is_rendezvous(call: str | None) -> bool:
    return call in ("init_process_group", "rendezvous", "_create_c10d_store")


def timeout_hint(calls: Sequence[str | None]) -> str:
    """The closing advice of a timeout report, from what each blocked rank was calling."""
    if any(c and not is_rendezvous(c) for c in calls):
        return (
            "A rank blocked in a collective (all_reduce, barrier, ...) that other ranks skipped "
            "or already left is a deadlock: make every rank call the same collectives in the same "
            "order. If the work is only slow, pass a larger timeout."
        )
    if any(is_rendezvous(c) for c in calls):
        return (
            "A rank blocked in init_process_group waits for every rank of the world to join: "
            "check that every rank calls it, with the same address and world size. If the work "
            "is only slow, pass a larger timeout."
        )
    return (
        "No rank was in a collective: the work itself was slow or stuck (a long computation, "
        "a lock, I/O). If it is only slow, pass a larger timeout."
    )


@dataclass(frozen=True)
class RendezvousView:
    """One rank at the moment the rendezvous was given up."""

    rank: int
    #: Seconds it had been waiting in the rendezvous; ``None`` if it never entered.
    waited: float | None
    done: bool
    #: The world size it asked for (argument or ``WORLD_SIZE``), and the address it used.
    asked_world_size: int | None
    endpoint: str | None
    #: ``"running"``, ``"returned"`` (the function returned), or an outcome sentence.
    state: str
    #: Where it was (its own line of code), if it was running.
    place: str | None


def rendezvous_report(limit: float, world_size: int, ranks: Sequence[RendezvousView]) -> str:
    """Why the rendezvous did not complete: who waited, who never came, and the likely cause."""
    waiting = [r for r in ranks if r.waited is not None and not r.done]
    first = max((r.waited for r in waiting), default=limit)
    lines = [
        f"The ranks did not all join the process group within rendezvous_timeout={limit:g} s "
        "of the first one reaching init_process_group, so all ranks were stopped."
    ]
    for view in ranks:
        lines.append(_describe(view, first))
    lines.extend(_causes(world_size, ranks))
    lines.append(
        "If a rank is only slow to get there (it prepares data before init_process_group), "
        "pass a larger rendezvous_timeout=... to the launcher."
    )
    return "\n".join(lines)


def _describe(view: RendezvousView, longest: float) -> str:
    if view.done:
        return f"rank {view.rank} had joined the process group"
    if view.waited is not None:
        asked = "" if view.asked_world_size is None else f", world_size={view.asked_world_size}"
        where = f" at {view.endpoint}" if view.endpoint else ""
        return f"rank {view.rank} waited {view.waited:.1f} s in init_process_group{asked}{where}"
    if view.state == "returned":
        return (
            f"rank {view.rank} never called init_process_group: its function returned without "
            "joining"
        )
    if view.state != "running":
        return f"rank {view.rank} never reached init_process_group: {view.state}"
    place = view.place or "an unknown place"
    return (
        f"rank {view.rank} had not reached init_process_group after {longest:.1f} s; it was at "
        f"{place}"
    )


def _causes(world_size: int, ranks: Sequence[RendezvousView]) -> list[str]:
    causes = []
    wrong = sorted(
        {r.asked_world_size for r in ranks if r.asked_world_size not in (None, world_size)}
    )
    if wrong:
        asked = " and ".join(str(w) for w in wrong)
        causes.append(
            f"Likely cause: the rendezvous asked for world_size {asked}, but this launch started "
            f"{world_size} rank(s). Call init_process_group() without world_size (it reads "
            "WORLD_SIZE from the environment), or launch that many processes."
        )
    endpoints = sorted({r.endpoint for r in ranks if r.endpoint})
    if len(endpoints) > 1:
        causes.append(
            "Likely cause: the ranks used different rendezvous addresses "
            f"({', '.join(endpoints)}). Every rank must use the same MASTER_ADDR and "
            "MASTER_PORT (or leave them to the launcher)."
        )
    missing = [r.rank for r in ranks if r.waited is None and not r.done]
    if missing and not causes:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        causes.append(
            f"Likely cause: {who} had not called init_process_group. Every rank must call it, "
            "the same number of times."
        )
    return causes
