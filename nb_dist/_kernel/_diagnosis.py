"""What a stuck launch means, as pure functions of what the kernel saw (fast to unit-test).

The supervisor collects facts (each rank's stack, when it entered the rendezvous, the world
size it asked for); these functions turn them into the sentences a learner reads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .._shared._collectives import CollectiveState
from .._shared._frames import is_own
from ._errors import RankOutcome
from ._tracebacks import FAULT_FRAME, blocked_place, format_frames, relabel_cells

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


def reaching_store(frames: Sequence[Frame]) -> bool:
    """Whether a rank is still reaching the rendezvous store: its innermost torch.distributed
    frame is the store's creation (``TCPStore(...)`` in ``_create_c10d_store``). A client's
    store returns as soon as it is connected, so a rank found there has not reached the store
    (other ranks' lateness keeps a rank in ``init_process_group``, never in there)."""
    for filename, _line, name in reversed(frames):
        if _DIST_DIR in filename and name not in _WRAPPER_NAMES:
            return name == "_create_c10d_store"
    return False


def store_hint(ranks: Sequence[int]) -> str:
    """The advice for ranks that never reached the rendezvous store (:func:`reaching_store`)."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return (
        f"{who} never reached the rendezvous store: still inside torch's TCPStore, connecting "
        "to MASTER_ADDR:MASTER_PORT. On several machines, check that node 0's launch is "
        "running and that this machine reaches master_addr at that port (a firewall, or a "
        "host name it cannot resolve)."
    )


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


#: Collectives whose partner is one rank, not the group: counts may differ legitimately.
POINT_TO_POINT = frozenset({"send", "recv"})


@dataclass(frozen=True)
class SkippedCollective:
    """Live ranks in a deadlock: each running rank blocked in a collective that the ranks
    which finished the cell will never enter (they entered fewer collectives in all)."""

    blocked: tuple[tuple[int, CollectiveState], ...]  # (rank, its counts), rank order
    finished: tuple[tuple[int, int], ...]  # (rank, collectives it entered in all)


def skipped_collective(
    finished: dict[int, int | None], running: dict[int, CollectiveState | None]
) -> SkippedCollective | None:
    """A deadlock the counts prove, else ``None`` (never a guess).

    ``finished``: ranks done with the cell (or not in it) and their total collective counts;
    ``running``: the other ranks' counter files. A deadlock: every running rank is inside a
    group collective (not ``send``/``recv``, one at a time) whose number is above some
    finished rank's total, which that rank can no longer reach. Ranks computing, all inside
    the same collective, or waiting for ranks still running are never one."""
    counts = {rank: n for rank, n in finished.items() if n is not None}
    if not counts or not running:
        return None
    lowest = min(counts.values())
    for state in running.values():
        if state is None or state.current is None or state.current in POINT_TO_POINT:
            return None
        if state.completed != state.entered - 1 or state.entered <= lowest:
            return None
    return SkippedCollective(
        blocked=tuple(sorted((r, s) for r, s in running.items() if s is not None)),
        finished=tuple(sorted(counts.items())),
    )


def skipped_collective_report(
    found: SkippedCollective, frames: dict[int, list[Frame]], unit: str = "cell"
) -> str:
    """The message of a live cell ended by :func:`skipped_collective`."""
    first_rank, first = found.blocked[0]
    behind = [(rank, n) for rank, n in found.finished if n < first.entered]
    if len(behind) == 1:
        who, after = f"rank {behind[0][0]}", f"rank {behind[0][0]} finished"
        counts = f"{behind[0][1]} collectives"
    else:
        who = "ranks " + ", ".join(str(rank) for rank, _ in behind)
        after, counts = "they finished", " and ".join(str(n) for _, n in behind) + " collectives"
    lines = [
        f"rank {first_rank} is blocked in {first.current} #{first.entered}, which {who} will "
        f"never enter: {after} the {unit} after {counts}. A deadlock, so the {unit} was "
        "ended instead of waiting for ever. Make every rank call the same collectives, the "
        "same number of times (a collective under `if dist.get_rank() == 0:` is the usual "
        "cause).",
        "",
    ]
    for rank, state in found.blocked:
        stack = frames.get(rank, [])
        lines.append(
            f"rank {rank} waits in {state.current} #{state.entered} at {blocked_place(stack)}"
        )
        if stack:
            lines.append(format_frames(stack))
    for rank, n in found.finished:
        lines.append(f"rank {rank} finished the {unit} having entered {n} collectives")
    return "\n".join(lines)


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
    #: Its stack, if it was running (most recent call last).
    frames: tuple[Frame, ...] | None = None

    @property
    def place(self) -> str | None:
        return blocked_place(list(self.frames)) if self.frames is not None else None


def rendezvous_report(
    limit: float, world_size: int, ranks: Sequence[RendezvousView]
) -> tuple[str, dict[int, str]]:
    """Why the rendezvous did not complete: who waited, who never came, and the likely cause;
    and the stack of every rank that never reached it."""
    waits = [r.waited for r in ranks if r.waited is not None and not r.done]
    first = max(waits, default=limit)
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
    stacks = {
        r.rank: format_frames(list(r.frames))
        for r in ranks
        if r.frames is not None and r.waited is None
    }
    for rank, stack in stacks.items():
        lines.append(f"\nStack of rank {rank} (most recent call last):\n{stack}")
    return "\n".join(lines), stacks


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
        asked = " and ".join(str(value) for value in wrong)
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


# ------------------------------------------------------------------ a rank failed
_COLLATERAL_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COLLATERAL_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "communicator was aborted",
    "NCCL error",
)


def looks_collateral(outcome: RankOutcome) -> bool:
    """A failure that typically follows another rank's death, not a cause of its own."""
    kind = outcome.exc_type or ""
    text = outcome.message or ""
    return any(t in kind for t in _COLLATERAL_TYPES) or any(t in text for t in _COLLATERAL_TEXT)


def root_cause(outcomes: Sequence[RankOutcome]) -> tuple[RankOutcome, list[RankOutcome]]:
    """The rank that failed first for a reason of its own, and the failures caused by it.

    Collateral failures ("Connection closed by peer" from ranks waiting on a dead one) are
    the cause only when nothing else failed.
    """
    failed = [o for o in outcomes if o.status == "failed"]
    real = [o for o in failed if not looks_collateral(o)]
    candidates = real or failed or list(outcomes)
    root = min(candidates, key=lambda o: (o.failed_at is None, o.failed_at or 0.0, o.rank))
    return root, [o for o in failed if o is not root and looks_collateral(o)]


def last_output(log: str) -> list[str]:
    """The end of a dead rank's output; for a crash, faulthandler's report up to the user code.

    A forked rank's crash report continues below the user's frames with the launcher's and
    the inherited kernel's frames (dozens in Jupyter), which would push the "Fatal Python error"
    line and the user's frames out of a plain tail.
    """
    lines = log.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    if not starts:
        return lines[-15:]
    start = starts[-1]
    crash = []
    for line in lines[start:]:
        frame = FAULT_FRAME.match(line)
        if frame and is_own(frame["file"]):
            break  # the launcher's frames, then the kernel's inherited ones
        crash.append(relabel_cells(line))
    return lines[max(0, start - 5) : start] + crash[:40]


def failure_message(root: RankOutcome, outcomes: Sequence[RankOutcome], root_log: str) -> str:
    """The text of a ``WorkerFailedError``: the root cause first, then the other ranks."""
    # "returned" counts ranks whose value had not arrived yet: they were tearing down.
    finished = [o.rank for o in outcomes if o is not root and (o.status == "ok" or o.returned_at)]
    if looks_collateral(root) and finished:
        # Lead with the diagnosis; the backend's raw text (gloo's "Connection closed by peer"
        # with its source path) follows as the detail it is.
        call = distributed_call_in_traceback(root.traceback or "")
        head = skipped_collective_head(root.rank, call, finished)
        head += f"\n\nThe error rank {root.rank} got: {root.exc_type}: {root.message}"
    elif root.exc_type:
        head = f"rank {root.rank} failed first: {root.exc_type}: {root.message}"
        hint = framework_hint(root.message or "")
        if hint:
            head += f"\n{hint}"
    else:
        head = f"rank {root.rank} failed first: {root.message}"
        if root.signal_name == "SIGKILL":
            head += " (sent by the kernel's out-of-memory killer, or by kill -9)"
        elif root.signal_name == "SIGSEGV":
            head += " (a crash in native code)"
    parts = [head]
    if root.traceback:
        parts.append(f"\nTraceback of rank {root.rank}:\n{root.traceback.rstrip()}")
    elif root_log.strip():
        parts.append(f"\nLast output of rank {root.rank}:\n" + "\n".join(last_output(root_log)))
    others = [o for o in outcomes if o is not root]
    if others:
        parts.append("\nThe other ranks:\n" + "\n".join(o.describe() for o in others))
    parts.append(
        "\nEvery rank's outcome is in this exception's .outcomes and its full output in .logs."
    )
    return "\n".join(parts)


_LIGHTNING_WORLD = re.compile(
    r"`devices=(?P<devices>\d+)` and `num_nodes=(?P<nodes>\d+)` in Lightning.*"
    r"does not match the world size \((?P<world>\d+)\)",
    re.DOTALL,
)


def framework_hint(message: str) -> str | None:
    """nb_dist's one line after a training library's own error, where it knows the fix."""
    found = _LIGHTNING_WORLD.search(message)
    if found:
        world, nodes = int(found["world"]), int(found["nodes"])
        per_node = world // nodes if nodes and world % nodes == 0 else world
        return (
            f"nb_dist: the launch started {world} rank(s); Lightning's devices x num_nodes "
            f"must equal that: pass devices={per_node} (or launch with "
            f"num_processes={int(found['devices'])})."
        )
    return None


def ended_without_value(code: int | None, signal_name: str | None) -> str:
    """Why a rank that sent no value and no exception ended, from its exit status."""
    if code is not None and code < 0:
        return f"the process was killed by signal {signal_name}"
    if code == 0:
        return "the process ended without returning from the function (os._exit?)"
    return f"the process exited with code {code} before returning"


# ------------------------------------------------------------------ too slow, or stuck
TEARDOWN_NOTE = (
    "A rank that returned from the function but does not exit is stuck in native teardown: "
    "destroying the process group or freeing C++ resources (a DistributedDataParallel model "
    "still alive while its group is destroyed can hang there). Delete DDP models "
    "(del model) before returning, and pass timeout=... to the launcher to bound the wait."
)


@dataclass(frozen=True)
class StuckRank:
    """One rank at the moment a launch was stopped for running past its ``timeout``."""

    rank: int
    #: "teardown" (returned, not exited), "blocked" (a stack was taken), "starting"
    #: (no stack: not yet running the function), or "ended" (see ``outcome``).
    state: str
    frames: tuple[Frame, ...] = ()
    outcome: str = ""
    #: What its collective counter said (see _collectives.py); ``None`` if unknown.
    collectives: CollectiveState | None = None


def timeout_report(
    timeout: float, ranks: Sequence[StuckRank], what: str = "launch"
) -> tuple[str, dict[int, str]]:
    """The text of a ``LaunchTimeoutError`` and the stack of every blocked rank.

    ``what="cell"``: a live-ranks task, which is interrupted rather than stopped."""
    if what == "cell":
        first = f"The cell did not finish within timeout={timeout:g} s, so it was interrupted."
    else:
        first = (
            f"The launch did not finish within timeout={timeout:g} s, so all ranks were stopped."
        )
    lines = [first]
    stacks: dict[int, str] = {}
    calls: list[str | None] = []
    for view in ranks:
        if view.state == "teardown":
            lines.append(
                f"rank {view.rank} had returned from the function and was stuck in the native "
                "teardown after it (see the note below)"
            )
        elif view.state == "blocked":
            calls.append(distributed_call(view.frames))
            lines.append(f"rank {view.rank} was blocked at {blocked_place(list(view.frames))}")
            stacks[view.rank] = format_frames(list(view.frames))
        elif view.state == "starting":
            lines.append(f"rank {view.rank} was still starting")
        else:
            lines.append(view.outcome)
    lines.extend(collective_counts(ranks))
    for rank, text in stacks.items():
        lines.append(f"\nStack of rank {rank} (most recent call last):\n{text}")
    connecting = [v.rank for v in ranks if v.state == "blocked" and reaching_store(v.frames)]
    if connecting:
        lines.append("\n" + store_hint(connecting))
    if calls:
        lines.append(("" if connecting else "\n") + timeout_hint(calls))
    if _counts_differ(ranks):
        lines.append(COUNTS_DIFFER_NOTE)
    if any(view.state == "teardown" for view in ranks):
        lines.append(TEARDOWN_NOTE)
    return "\n".join(lines), stacks


COUNTS_HEAD = (
    "Collectives each rank called from Python (DDP's gradient all-reduces are not counted):"
)
COUNTS_DIFFER_NOTE = (
    "The ranks entered different numbers of collectives: some rank skipped a collective the "
    "others called (or called one more often), so the others wait in it forever."
)


def collective_counts(ranks: Sequence[StuckRank]) -> list[str]:
    """A line per rank with known counts: which collective it waits in, or how far behind it is.

    Nothing when no rank's counts are known. The counts are of torch.distributed calls made
    from Python (DDP's gradient all-reduces run in C++ and are not among them).
    """
    known = [view for view in ranks if view.collectives is not None]
    if not known:
        return []
    states = {view.rank: view.collectives for view in known if view.collectives is not None}
    top_rank = max(states, key=lambda rank: (states[rank].entered, -rank))
    top = states[top_rank].entered
    lines = [COUNTS_HEAD]
    if len(known) == len(ranks) and all(
        s.entered == top and s.current is None for s in states.values()
    ):
        return [*lines, f"every rank entered {top} collectives; none is inside one"]
    for view in known:
        state = states[view.rank]
        if state.current is not None and view.state == "ended":
            line = f"rank {view.rank} was in {state.current} #{state.entered} when it ended"
        elif state.current is not None:
            line = f"rank {view.rank} waits in {state.current} #{state.entered}"
            if state.entered < top:
                line += f" (rank {top_rank} entered {top})"
        elif state.entered < top:
            line = (
                f"rank {view.rank} entered only {state.entered} collectives (rank {top_rank}: "
                f"{top}) and {_whereabouts(view)}"
            )
        else:
            line = f"rank {view.rank} entered {state.entered} collectives and is inside none"
        lines.append(line)
    return lines


def _whereabouts(view: StuckRank) -> str:
    if view.state == "blocked":
        return f"is at {blocked_place(list(view.frames))}"
    if view.state == "teardown":
        return "had returned from the function"
    if view.state == "starting":
        return "was still starting"
    return "had ended"


def _counts_differ(ranks: Sequence[StuckRank]) -> bool:
    return len({view.collectives.entered for view in ranks if view.collectives is not None}) > 1


def straggler_notice(
    rank: int,
    waited: float,
    finished: Sequence[int],
    frames: Sequence[Frame],
    limit_hint: str,
) -> str:
    """The notice for a rank still running long after others finished (a likely deadlock);
    ``limit_hint`` says how to put a limit on this kind of run."""
    return (
        f"rank {rank} is still running {waited:.0f} s after rank(s) "
        f"{', '.join(map(str, finished))} finished. It is at {blocked_place(list(frames))}:\n"
        f"{format_frames(list(frames))}\n"
        "If it waits in a collective (all_reduce, barrier, ...) that the finished "
        "ranks skipped, this is a deadlock and it will never finish: interrupt the "
        f"kernel, make every rank call the same collectives, or {limit_hint}. Still "
        "waiting, since a rank may also legitimately work alone."
    )


def teardown_notice(rank: int, ago: float) -> str:
    return (
        f"rank {rank} returned from the function {ago:.0f} s ago but its process has not "
        "exited. " + TEARDOWN_NOTE
    )


def post_mortem_note(rank: int) -> str:
    """What the error says when a failed rank is kept for a post-mortem."""
    return (
        f"Rank {rank} is kept at its exception for a post-mortem: run %debug in the next cell "
        "(or call .debug() on this error) to open pdb inside it; q ends it. The other ranks "
        "were stopped."
    )
