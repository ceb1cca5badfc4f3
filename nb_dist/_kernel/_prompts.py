"""The kernel side of a rank's debugger: pdb's prompts answered from the notebook.

A rank in pdb (``_debug.py``) sends what pdb printed and its prompt; here the text is
written into the cell and the line is read with ``input()``: in a Jupyter kernel that is
an ``input_request`` on the stdin channel, the box ``input()`` shows in JupyterLab; in a
terminal it is the terminal. Where nobody can answer (nbval and nbconvert run cells with
``allow_stdin=False``; a script whose stdin is not a terminal), no prompt is ever shown:
the rank is told so and goes on (a breakpoint) or ends (a post-mortem), and the cell says
how to debug interactively.

:class:`PostMortem` keeps a failed rank (``debug="postmortem"``) after its launch has ended:
the rank, its pipes and the lifeline, until ``%debug``/``err.debug()`` or :meth:`release`.
IPython's ``%debug`` opens the kernel's own frames; :func:`hook_debug_magic` makes it open
the held rank instead when the last error is a launch error holding one (and otherwise
leaves ``%debug`` as it was).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._shared import _protocol
from .._shared._reporting import Reports
from ._output import OutputRouter
from ._pump import Pump, poll_exit
from ._rank_handle import Rank
from ._tracebacks import ipython_shell, relabel_cells

_log = logging.getLogger(__name__)

#: Tells the user why no prompt appeared (printed once per debugger).
NO_FRONTEND = (
    "rank {rank} is in the debugger, but this run cannot answer its prompts: there is no "
    "input box (nbval and nbconvert run cells without one; a script's stdin is not a "
    "terminal). The rank {what}. To debug it, run the cell in JupyterLab or Jupyter Notebook "
    "(or the script in a terminal)."
)


def frontend_can_answer() -> bool:
    """Whether ``input()`` here reaches a person: a kernel request that allows stdin, or a tty."""
    shell = ipython_shell()
    if shell is not None:
        kernel = getattr(shell, "kernel", None)
        if kernel is not None:
            return bool(getattr(kernel, "_allow_stdin", False))
        return True  # a terminal IPython
    return bool(sys.stdin is not None and sys.stdin.isatty())


def read_line(prompt: str) -> str | None:
    """One line from the notebook, or ``None`` when nobody can answer."""
    if not frontend_can_answer():
        return None
    try:
        return input(prompt)
    except EOFError:
        return None
    except Exception as exc:  # ipykernel's StdinNotImplementedError
        if type(exc).__name__ == "StdinNotImplementedError":
            return None
        raise


def converse(rank: Rank, pump: Callable[[float], None]) -> None:
    """Answer ``rank``'s debugger until it finishes, the rank ends, or nobody can answer.

    ``pump`` reads the rank's pipes (its output goes to the cell as usual) and feeds its
    messages to :meth:`Rank.handle`, which keeps the newest prompt in ``rank.prompt``.
    """
    label = f"[rank {rank.outcome.rank}] "
    while _reachable(rank) and (rank.debugging or rank.prompt is not None):
        prompt = rank.take_prompt()
        if prompt is None:
            pump(0.05)
            _show(rank)
            continue
        line: str | None = None
        if frontend_can_answer():
            _show(rank, prompt.text)
            try:
                line = read_line(label + (prompt.prompt or "(Pdb) "))
            except KeyboardInterrupt:
                rank.send(_protocol.DebugInput("q"))  # ■ at the prompt quits the rank's debugger
                raise  # (still `debugging` until the rank says its debugger ended: no SIGINT)
        else:
            # Nobody will read pdb's own rendering (coloured, laid out by the installed
            # IPython): the cell keeps a plain, stable line of where the rank stopped.
            _show(rank)
            if prompt.where:
                print(f"rank {rank.outcome.rank} stopped at {relabel_cells(prompt.where)}")
        if line is None:
            print(NO_FRONTEND.format(rank=rank.outcome.rank, what=prompt.unanswered), flush=True)
        if not rank.send(_protocol.DebugInput(line)) or line is None:
            # No more prompts will be answered: let the rank finish its debugger alone.
            _wait_until_done(rank, pump)
            return
    _show(rank)


def _reachable(rank: Rank) -> bool:
    """The rank runs and its control pipe is open (a rank that died mid-command is not)."""
    return rank.alive and rank.control_closed_at is None


def _wait_until_done(rank: Rank, pump: Callable[[float], None]) -> None:
    deadline = time.monotonic() + 5.0
    while _reachable(rank) and rank.debugging and time.monotonic() < deadline:
        if rank.take_prompt() is not None:  # nobody answers: every further prompt gets "no one"
            rank.send(_protocol.DebugInput(None))
        pump(0.05)
    _show(rank, quiet=True)


def _show(rank: Rank, more: str = "", quiet: bool = False) -> None:
    text = rank.take_debug_text(more)
    if text and not quiet:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


class PostMortem:
    """A failed rank kept at its exception after its launch ended (``debug="postmortem"``).

    ``debug()`` opens pdb inside it, from the notebook; quitting pdb ends the rank.
    :meth:`release` ends it without debugging (the next launch or a kernel shutdown does
    too). It owns the rank's pipes and the launch's lifeline, so
    the rank still dies with the kernel.
    """

    def __init__(
        self,
        rank: Rank,
        lifeline: Connection | None,
        output: OutputRouter,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self._lifeline = lifeline
        self._router = output
        _held.add(self)
        # on_release: what else ends with the rank (on a cluster, its run's forwarding).
        self._finalizer = weakref.finalize(self, _release, rank, lifeline, on_release)

    @property
    def alive(self) -> bool:
        return self.rank.alive

    def debug(self) -> None:
        """Open pdb inside the failed rank, in this cell (``p``, ``l``, ``w``, ``u``, ``q``)."""
        if not self.rank.alive:
            print(f"rank {self.rank.outcome.rank} is no longer held for a post-mortem.")
            return
        if not frontend_can_answer():
            print(NO_FRONTEND.format(rank=self.rank.outcome.rank, what="was released"))
            self.release()
            return
        pump = Pump()
        pump.add(self.rank)

        def read(wait: float) -> None:
            pump(wait, self._router, self._on_message, self._router.notice)
            poll_exit(self.rank, time.monotonic())

        try:
            read(0.0)
            deadline = time.monotonic() + 5.0
            while self.rank.prompt is None and self.rank.alive and time.monotonic() < deadline:
                read(0.05)  # the rank's first prompt may still be on its way
            converse(self.rank, read)
        finally:
            pump.close()
            self.release()

    def _on_message(self, rank: Rank, message: _protocol.Message) -> None:
        """After its launch, only the held rank's debugger speaks; the rest is not for anyone."""
        if isinstance(message, _protocol.DebugPrompt):
            rank.handle(message, self._router, None, Reports(), set())

    def release(self) -> None:
        """End the held rank (if it still runs) and close its pipes."""
        self._finalizer()
        _held.discard(self)

    def __repr__(self) -> str:
        state = "held" if self.alive else "released"
        return f"PostMortem(rank {self.rank.outcome.rank}, {state})"


def _release(
    rank: Rank, lifeline: Connection | None, on_release: Callable[[], None] | None
) -> None:
    rank.kill()
    for conn in rank.kernel_ends():
        with contextlib.suppress(OSError):
            conn.close()
    if lifeline is not None:
        with contextlib.suppress(OSError):
            lifeline.close()
    if on_release is not None:
        try:
            on_release()
        except Exception:  # a release must not fail (the cluster may be gone by now)
            _log.exception("nb_dist: ending a post-mortem's run failed")


_held: set[PostMortem] = set()


def release_all() -> None:
    """Release every held rank (before a new launch: one post-mortem at a time)."""
    for held in list(_held):
        held.release()


def hook_debug_magic() -> None:
    """Make ``%debug`` open the held rank when the last error holds one (once per kernel)."""
    shell = ipython_shell()
    original = getattr(shell, "debugger", None)
    if shell is None or original is None or getattr(original, "nb_dist_hook", False):
        return

    def debugger(force: bool = False) -> None:
        held = getattr(getattr(sys, "last_value", None), "post_mortem", None)
        if isinstance(held, PostMortem) and held.alive:
            held.debug()
            return
        original(force)

    debugger.nb_dist_hook = True  # type: ignore[attr-defined]
    shell.debugger = debugger
