"""Exceptions raised by the launcher, and the per-rank outcome records they carry."""

from __future__ import annotations

import os
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Literal

from .._shared import _torch_compat
from .._shared._frames import PACKAGE_DIR

try:  # what torchrun and accelerate.notebook_launcher raise when a rank fails
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError as _ChildFailedError,
    )
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as _ProcessFailure
except ImportError:  # pragma: no cover - a torch without torch.distributed

    class _ChildFailedError(Exception):  # type: ignore[no-redef]
        """Stand-in where torch.distributed.elastic is missing."""

    _ProcessFailure = None  # type: ignore[assignment,misc]

__all__ = [
    "LaunchError",
    "LaunchTimeoutError",
    "RankOutcome",
    "RendezvousTimeoutError",
    "UnsafeLaunchError",
    "WorkerFailedError",
]


#: Where a rank is: ``starting`` → ``running`` → ``ok`` / ``failed`` / ``stopped``, and a
#: failure caused by another rank's is re-labelled ``collateral``. The live monitor reads it.
RankStatus = Literal["starting", "running", "ok", "failed", "collateral", "stopped"]


@dataclass
class RankOutcome:
    """What happened to one rank of a launch.

    ``status`` is one of:

    - ``"ok"``: the function returned and its value came back;
    - ``"failed"``: the function raised, or the process died on its own (signal, ``os._exit``);
    - ``"collateral"``: it failed, but only because another rank failed first
      (for example "Connection closed by peer" while waiting in a collective);
    - ``"stopped"``: the launcher stopped it (after another rank failed, a timeout or an interrupt);
    - ``"running"``: still running when the outcome was recorded (only seen in live views).
    """

    rank: int
    local_rank: int
    pid: int | None = None
    status: RankStatus = "running"
    exit_code: int | None = None
    signal_name: str | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    failed_at: float | None = None
    duration: float | None = None
    stack: str | None = field(default=None, repr=False)
    #: When the function returned (``time.monotonic()``), before the rank's teardown.
    returned_at: float | None = field(default=None, repr=False)

    def describe(self) -> str:
        """One human sentence about this rank's outcome."""
        how = ""
        if self.signal_name:
            how = f" (signal {self.signal_name})"
        elif self.exit_code not in (None, 0):
            how = f" (exit code {self.exit_code})"
        if self.status == "ok":
            return f"rank {self.rank}: finished"
        if self.status == "stopped":
            return f"rank {self.rank}: stopped by the launcher{how}"
        if self.status == "running":
            return f"rank {self.rank}: still running"
        if self.status == "starting":
            return f"rank {self.rank}: still starting"
        what = f"{self.exc_type}: {self.message}" if self.exc_type else "the process died"
        if self.exc_type:
            # The exception is the cause; the exit that followed it (code 1, or the launcher's
            # SIGTERM while the rank was exiting) would only mislead.
            how = ""
        if self.status == "collateral":
            return f"rank {self.rank}: failed as a consequence: {what}{how}"
        return f"rank {self.rank}: failed: {what}{how}"


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of nb_dist itself (nor IPython's, which runs a ``%%ranks``
    cell): it ends at the user's call."""
    kept = []
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not filename.startswith(_NOT_THE_USERS):
            kept.append(tb)
        tb = tb.tb_next
    chain = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def _ipython_dir() -> str:
    """IPython's ``core`` folder, found without importing IPython (0.07 s, and a rank or a
    plain script never needs it)."""
    import importlib.util

    spec = importlib.util.find_spec("IPython")
    if spec is None or spec.origin is None:  # pragma: no cover - IPython is a dependency
        return PACKAGE_DIR
    return os.path.join(os.path.dirname(os.path.abspath(spec.origin)), "core") + os.sep


_NOT_THE_USERS = (PACKAGE_DIR + os.sep, _ipython_dir())


class _EndsAtTheCall(BaseException):
    """IPython renders these exceptions' tracebacks without nb_dist's own frames.

    IPython always shows the frame an exception was raised in, even one marked
    ``__tracebackhide__``, so a launch error would end inside the package. Exceptions may
    render their own traceback (``_render_traceback_``, as ipyparallel's remote errors do):
    these render IPython's usual one, ending at the user's ``notebook_launcher(...)`` line.
    ``__traceback__`` itself is untouched.
    """

    def _render_traceback_(self) -> list[str]:
        from ._tracebacks import ipython_shell

        shell = ipython_shell()
        if shell is None:  # only IPython asks; anyone else gets Python's usual traceback
            return traceback.format_exception(type(self), self, self.__traceback__)
        frames = _user_frames(self.__traceback__)
        return list(shell.InteractiveTB.structured_traceback(type(self), self, frames))


class LaunchInterrupted(_EndsAtTheCall, KeyboardInterrupt):
    """The kernel was interrupted during a launch, and every rank was stopped.

    A ``KeyboardInterrupt``, named so in the cell (IPython shows the class name), whose
    traceback ends at the user's call. Raised only in IPython; elsewhere a plain
    ``KeyboardInterrupt`` is raised.
    """


LaunchInterrupted.__name__ = LaunchInterrupted.__qualname__ = "KeyboardInterrupt"


class LaunchError(_EndsAtTheCall, RuntimeError):
    """Base class of every error the launcher raises about a launch."""

    #: Values reported with ``nb_dist.report`` before the failure (a ``Reports``), if any.
    reports: Any = None


class UnsafeLaunchError(LaunchError, ValueError):
    """The kernel is in a state where starting ranks would fail or misbehave.

    Raised before any rank starts; the message says what was found and what to do. Also a
    ``ValueError``, which is what ``accelerate.notebook_launcher`` raises for the same states,
    so code written for it catches this too.
    """


class WorkerFailedError(LaunchError, _ChildFailedError):
    """One or more ranks failed. The message starts with the root cause.

    Also torch's ``ChildFailedError`` (what ``torchrun`` and ``accelerate.notebook_launcher``
    raise), so ``except ChildFailedError`` in code written for them catches it, with that
    class's data filled in: ``name`` and ``failures`` (global rank → ``ProcessFailure`` with
    pid, exit code and the rank's error message; the root cause first), and
    ``get_first_failure()``.

    Attributes:
        root_cause: the outcome of the rank that failed first (not a collateral failure).
        outcomes: every rank's :class:`RankOutcome`, indexed by local rank.
        logs: every rank's captured output, indexed by local rank.
    """

    def __init__(
        self, message: str, root_cause: RankOutcome, outcomes: list[RankOutcome], logs: list[str]
    ) -> None:
        # Not ChildFailedError.__init__: its message is torchrun's table; ours leads with the
        # root cause. Its attributes are set here instead.
        RuntimeError.__init__(self, message)
        self.root_cause = root_cause
        self.outcomes = outcomes
        self.logs = logs
        _torch_compat.child_failed_attributes(
            self, "notebook_launcher", _process_failures(root_cause, outcomes)
        )
        #: The failed rank kept at its exception (``debug="postmortem"``), else ``None``.
        self.post_mortem: Any = None

    def debug(self) -> None:
        """Open pdb inside the failed rank (``debug="postmortem"``), as ``%debug`` does."""
        if self.post_mortem is None:
            print(
                "No rank was kept for a post-mortem. Launch with debug='postmortem' to keep "
                "the failing rank at its exception, then run %debug (or err.debug())."
            )
            return
        self.post_mortem.debug()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.root_cause, self.outcomes, self.logs))


def _process_failures(root: RankOutcome, outcomes: list[RankOutcome]) -> dict[int, Any]:
    """torch's ``{global rank: ProcessFailure}`` for the failed ranks, root cause first."""
    if _ProcessFailure is None:  # pragma: no cover
        return {}
    failed = [root] + [
        o for o in outcomes if o is not root and o.status in ("failed", "collateral")
    ]
    now_wall, now_mono = time.time(), time.monotonic()
    failures = {}
    for outcome in failed:
        if outcome.exc_type:
            code = 1  # it raised; a SIGTERM from the launcher while it exited is not the cause
        elif outcome.signal_name is not None:
            code = -_signal_number(outcome.signal_name)
        else:
            code = outcome.exit_code if outcome.exit_code not in (None, 0) else 1
        failure = _ProcessFailure(outcome.local_rank, outcome.pid or -1, code, "<N/A>")
        if outcome.exc_type:
            failure.message = f"{outcome.exc_type}: {outcome.message}"
        elif outcome.message:
            failure.message = outcome.message
        if outcome.failed_at is not None:
            failure.timestamp = int(now_wall - (now_mono - outcome.failed_at))
        failures[outcome.rank] = failure
    first = min(f.timestamp for f in failures.values())
    failures[root.rank].timestamp = first  # get_first_failure() names the root cause
    return failures


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(signal.Signals[name])
    except KeyError:
        return 9


class LaunchTimeoutError(LaunchError):
    """The launch ran longer than its ``timeout``. Carries where every live rank was blocked.

    Attributes:
        timeout: the limit in seconds.
        stacks: ``{rank: stack text}`` for the ranks that were still running.
        outcomes: every rank's :class:`RankOutcome`, indexed by local rank.
        logs: every rank's captured output, indexed by local rank.
    """

    def __init__(
        self,
        message: str,
        timeout: float,
        stacks: dict[int, str],
        outcomes: list[RankOutcome],
        logs: list[str],
    ) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.stacks = stacks
        self.outcomes = outcomes
        self.logs = logs


class RendezvousTimeoutError(LaunchTimeoutError):
    """The ranks did not all join the process group within ``rendezvous_timeout`` seconds.

    Raised instead of waiting for torch's own rendezvous timeout (minutes): the message says
    which ranks waited in ``init_process_group``, which never got there and where they were,
    and the likely cause (a wrong ``world_size``, different addresses, a rank that skips it).
    ``timeout`` holds the ``rendezvous_timeout`` that passed.
    """


# The errors say they are nb_dist's (``nb_dist.UnsafeLaunchError`` in a rank's failure, a
# traceback, a repr, a pickle), not this private module's: the layout may move, the name a
# user catches and reads stays (``nb_dist.__getattr__`` finds them there).
for _error in (
    LaunchError,
    LaunchTimeoutError,
    RendezvousTimeoutError,
    UnsafeLaunchError,
    WorkerFailedError,
):
    _error.__module__ = "nb_dist"
