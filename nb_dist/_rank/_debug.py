"""The rank side of debugging a rank: pdb driven from the notebook over the rank's pipes.

A rank's stdin is ``/dev/null`` (nobody could type into it), so a plain ``pdb`` would read
EOF and go on. Here pdb reads and writes through :class:`_PromptIO`: each time it wants a
command, what it printed so far and its prompt go to the kernel as one
:class:`~_protocol.DebugPrompt`, and the rank waits for the kernel's
:class:`~_protocol.DebugInput` on its ``commands`` pipe. The kernel asks the notebook for
the line (``input()``, which is ipykernel's ``input_request``: the box ``input()`` shows in
JupyterLab), see ``_prompts.py``. When the debugger ends, a ``DebugPrompt`` with no prompt
says so.

Three ways in: :func:`breakpoint` (``nb_dist.breakpoint``, also Python's ``breakpoint()``
in a rank, through ``sys.breakpointhook``), and :func:`after_failure` for
``debug="postmortem"``, which keeps a failed rank at its exception until the notebook
debugs it or lets it go.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import pdb
import sys
import types
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from .._shared import _protocol, _torch_compat
from .._shared._frames import from_user_code

#: How long other ranks may wait in a collective for a rank paused in the debugger.
PAUSE_TIMEOUT = timedelta(hours=1)

Send = Callable[[_protocol.Message], None]


class _State:
    """Where this rank's debugger talks: set by :func:`install` in every rank."""

    send: Send | None = None
    commands: Connection | None = None
    rank: int = 0
    mode: str | None = None  # "postmortem" keeps a failed rank for the notebook


_state = _State()


class _PromptIO:
    """pdb's stdin and stdout: output is collected, and a read asks the kernel for a line."""

    def __init__(self, on_eof: str, where: Callable[[], str]) -> None:
        self._text: list[str] = []
        self._on_eof = on_eof  # what to do when no frontend can answer
        self._where = where

    def write(self, text: str) -> int:
        self._text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self._text = "".join(self._text), []
        return text

    def readline(self) -> str:
        text = self.take()
        prompt = ""
        # pdb writes its prompt just before reading: show it as the input box's prompt.
        for candidate in ("(Pdb) ", "(Pdb) \n"):
            if text.endswith(candidate):
                text, prompt = text[: -len(candidate)], candidate.strip() + " "
        unanswered = "goes on" if self._on_eof == "continue" else "was released"
        line = ask(text, prompt or "(Pdb) ", unanswered, self._where())
        if line is None:
            return self._on_eof + "\n"
        return line + "\n"


def ask(text: str, prompt: str | None, unanswered: str = "goes on", where: str = "") -> str | None:
    """Send ``text`` and ``prompt`` to the kernel; its answer (``None``: nobody can answer).

    ``prompt=None`` only tells the kernel that the debugger has finished."""
    send, commands = _state.send, _state.commands
    if send is None or commands is None:
        return None
    try:
        send(_protocol.DebugPrompt(text, prompt, unanswered, where))
        if prompt is None:
            return None
        while True:
            command = _protocol.receive_command(commands)
            if isinstance(command, _protocol.DebugInput):
                return command.line
    except (EOFError, OSError):
        return None


class _NotebookPdb(pdb.Pdb):
    """pdb whose commands come from the notebook (see the module docstring)."""

    def __init__(self, on_eof: str, at_next_line: bool = False) -> None:
        self.io = _PromptIO(on_eof, self._where)
        super().__init__(stdin=self.io, stdout=self.io, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = "(Pdb) "
        self._at_next_line = at_next_line

    def set_stepinstr(self) -> None:
        # Python 3.13's set_trace steps by instruction, so pdb stops at the caller's own line
        # (the breakpoint call); nb_dist.breakpoint() stops at the next line on every Python,
        # as on 3.12 and before (its docs, notebooks and the rank's "stopped at" say so).
        if self._at_next_line:
            self._at_next_line = False
            self.set_step()
        else:
            super().set_stepinstr()  # type: ignore[misc]

    def _where(self) -> str:
        """The current frame as a traceback line, plain (pdb's own rendering has IPython's
        colours in a kernel, which change from release to release)."""
        frame = getattr(self, "curframe", None)
        if frame is None:
            return ""
        code, line = frame.f_code, frame.f_lineno
        where = f'File "{code.co_filename}", line {line}, in {code.co_name}'
        source = linecache.getline(code.co_filename, line, frame.f_globals).strip()
        return f"{where}\n    {source}" if source else where

    def interaction(self, frame: Any, tb_or_exc: Any) -> None:
        try:
            super().interaction(frame, tb_or_exc)
        finally:
            ask(self.io.take(), None)  # the debugger is done (for now): the kernel goes on


def install(send: Send, commands: Connection | None, rank: int, mode: str | None) -> None:
    """Route this rank's debugger to the kernel; make ``breakpoint()`` and ``pdb.set_trace()``
    use it (with stdin at /dev/null they would read EOF and quit)."""
    _state.send, _state.commands, _state.rank, _state.mode = send, commands, rank, mode
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = _set_trace


def _breakpointhook(*args: Any, **kwargs: Any) -> None:
    """Python's ``breakpoint()`` in a rank: this rank stops, the others do not wait."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    frame = sys._getframe(1)
    _stop_here(frame)


def _set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` in a rank: this rank stops, its prompt in the notebook."""
    _stop_here(sys._getframe(1), header)


def breakpoint(rank: int = 0) -> None:
    """Stop rank ``rank`` in pdb, driven from the launching cell; the other ranks wait.

    Call it in a launched function or a live-ranks task, on every rank (like a collective).
    Every rank's process-group timeout is raised to an hour (as
    ``torch.distributed.breakpoint`` does), so ranks that wait for the paused one in a
    collective do not time out while you look around (a group whose timeout torch does not
    let change keeps its own; that is logged on ``nb_dist._shared._torch_compat``). Type
    ``c`` to go on, ``q`` to stop the function with ``BdbQuit``. Outside a launch it is
    Python's ``breakpoint()``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"breakpoint(rank={rank!r}): rank must be an int, e.g. rank=0.")
    frame = sys._getframe(1)
    if _state.send is None:  # not in a rank: the ordinary debugger
        pdb.Pdb().set_trace(frame)
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        _torch_compat.set_group_timeouts(PAUSE_TIMEOUT)  # what it cannot do, it logs
        # Every rank meets here; the others then wait for the paused one in its next collective.
        dist.barrier()
    if _state.rank == rank:
        _stop_here(frame, at_next_line=True)


def _stop_here(
    frame: types.FrameType, header: str | None = None, at_next_line: bool = False
) -> None:
    debugger = _NotebookPdb(on_eof="continue", at_next_line=at_next_line)
    if header is not None:
        debugger.message(header)
    debugger.message(f"rank {_state.rank} paused; c goes on, q stops the function")
    debugger.set_trace(frame)


def after_failure(exc: BaseException, send: Send) -> None:
    """With ``debug="postmortem"``: keep this rank at its exception for the notebook.

    Called after the failure was reported. pdb's first prompt goes to the kernel, which keeps
    it until ``%debug`` (or ``err.debug()``) answers, or stops the rank.
    """
    if _state.mode != "postmortem" or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    tb = from_user_code(exc.__traceback__)  # the runner's frames are not the user's
    if tb is None:
        return
    _state.send = send
    debugger = _NotebookPdb(on_eof="quit")
    debugger.reset()
    debugger.botframe = tb.tb_frame  # `u` stops at the user's outermost frame
    with contextlib.suppress(Exception):
        debugger.interaction(None, tb)
