"""The ``%%ranks`` cell magic and the ``%ranks`` line magic (``%load_ext nb_dist``).

``%%ranks`` runs the cell on every rank of the newest open :class:`~nb_dist.Ranks` session
(``--rank 0`` or ``--rank 0,1`` for some), with each rank's output labelled in the cell and
each rank's value of the last expression shown like ``Out[n]``: once, as ``[all ranks]``,
when every rank has the same, else one line per rank. ``%ranks`` shows the session;
``%ranks --export train.py`` writes it as a torchrun script, ``--restart`` and ``--close``
do what they say.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from .._kernel._result import LaunchResult
from .._kernel._scripts import torchrun_magic
from .._kernel._tracebacks import remember_cell
from ._ranks import UNSET, Ranks, SessionError, current


class RankValues:
    """What a ``%%ranks`` cell shows: each rank's value of its last expression."""

    def __init__(self, result: LaunchResult) -> None:
        self.result = result

    def __repr__(self) -> str:
        texts = [repr(value) for value in self.result]
        if len(set(texts)) == 1 and len(texts) > 1:
            return f"[all ranks] {texts[0]}"
        lines = [
            f"[rank {rank}] {text}" for rank, text in zip(self.result.ranks, texts, strict=True)
        ]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel's process
        raise ValueError(f"%ranks: {message}. {self.format_usage().strip()}")


def _cell_parser() -> _Parser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("--rank", type=str, default=None, help="e.g. 0 or 0,1")
    parser.add_argument("--timeout", type=float, default=None)
    return parser


def _line_parser() -> _Parser:
    parser = _Parser(prog="%ranks", add_help=False)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--export", metavar="PATH")
    group.add_argument("--restart", action="store_true")
    group.add_argument("--close", action="store_true")
    return parser


def _session() -> Ranks:
    session = current()
    if session is None:
        raise SessionError(
            "%%ranks needs live ranks, and none are running. Start them in a cell first: "
            "ranks = nb_dist.Ranks(num_processes=2)"
        )
    return session


def _ranks_option(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(
            f"%%ranks --rank {text}: give ranks as numbers, e.g. --rank 0,1."
        ) from None


def ranks_magic(line: str, cell: str | None = None) -> Any:
    """``%ranks`` (line) or ``%%ranks`` (cell): see the module docstring."""
    __tracebackhide__ = True
    from .._kernel._tracebacks import ipython_shell

    if cell is None:
        options = _line_parser().parse_args(shlex.split(line))
        session = _session()
        if options.export:
            path = session.export(options.export)
            nprocs = session.num_processes
            print(f"wrote {path}: run it with torchrun --nproc-per-node {nprocs} {path}")
            return None
        if options.restart:
            session.restart()
        if options.close:
            session.close()
        return session
    options = _cell_parser().parse_args(shlex.split(line))
    session = _session()
    shell = ipython_shell()
    source, filename = cell, None
    if shell is not None:
        source = shell.transform_cell(cell)
        filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
        remember_cell(filename, shell.execution_count)
    timeout = options.timeout if options.timeout is not None else UNSET
    chosen = _ranks_option(options.rank)
    result = session.exec(source, rank=chosen, timeout=timeout, filename=filename)
    if all(value is None for value in result):
        return None
    return RankValues(result)


def load_ipython_extension(shell: Any) -> None:
    """``%load_ext nb_dist``: register ``%ranks``, ``%%ranks`` and ``%torchrun``."""
    shell.register_magic_function(ranks_magic, magic_kind="line_cell", magic_name="ranks")
    shell.register_magic_function(torchrun_magic, magic_kind="line", magic_name="torchrun")
