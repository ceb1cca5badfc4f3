"""The scripts people already run with ``torchrun``, run from a cell or a terminal instead.

``run_script("train.py", "--epochs", "2", num_processes=2)`` is a launch whose function runs
the file as ``__main__`` in every rank (``_rank/_as_main.py``): the full launch contract
(``[rank K]`` output, the root cause first, hang stacks, ■, ``max_restarts``, no orphans)
for code written for torchrun, unchanged. ``%torchrun`` (``%load_ext nb_dist``) and
``nb-dist run`` take torchrun's own options, so ``!torchrun --nproc-per-node 2 train.py``
becomes ``%torchrun --nproc-per-node 2 train.py``. Runs in the launching process.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from .._rank._as_main import run_as_main
from ._launcher import notebook_launcher
from ._result import LaunchResult


def run_script(
    path: str | os.PathLike[str],
    *script_args: str | os.PathLike[str] | int | float,
    num_processes: int | None = None,
    **options: Any,
) -> LaunchResult:
    """Run the Python file at ``path`` on ``num_processes`` ranks, as torchrun would.

    Every rank runs the file as ``__main__`` with ``sys.argv == [path, *script_args]`` and
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...);
    the script creates its process group itself, as it does under torchrun. ``options`` are
    :func:`~nb_dist.notebook_launcher`'s (``max_restarts``, ``timeout``, ``use_port``,
    ``output``, ...). Returns each rank's exit status (0); a rank that raises or calls
    ``sys.exit(1)`` fails the launch with its traceback, as any launch does.
    """
    __tracebackhide__ = True
    file = _checked_path(path)
    argv = [_checked_arg(i, value) for i, value in enumerate(script_args)]
    if "args" in options or "function" in options:
        raise TypeError(
            "run_script() takes the script's arguments after the path, e.g. "
            "run_script('train.py', '--epochs', '2', num_processes=2), not args=."
        )
    return notebook_launcher(run_as_main, (file, argv), num_processes, **options)


def _checked_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"run_script(path=...) must be the path of a Python file, got {path!r} "
            f"({type(path).__name__}). Pass it as a string, e.g. run_script('train.py')."
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"run_script(path={path!r}): give the path as text, not bytes.")
    if not os.path.exists(text):
        raise FileNotFoundError(
            f"run_script(path={text!r}): no such file (looked from {os.getcwd()}). Give the "
            "path of the script relative to the notebook's folder, or an absolute path."
        )
    if not os.path.isfile(text):
        raise IsADirectoryError(
            f"run_script(path={text!r}) is a folder, not a file. Give the script inside it, "
            f"e.g. {os.path.join(text, 'train.py')!r}."
        )
    return text


def _checked_arg(index: int, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike, int, float)):
        raise TypeError(
            f"run_script's script argument {index + 1} is {value!r} "
            f"({type(value).__name__}); a script's arguments are text, as on a command "
            "line: pass strings (numbers and paths are turned into text for you)."
        )
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if not isinstance(text, str):
        raise TypeError(f"run_script's script argument {index + 1}: give text, not bytes.")
    return text


# ----------------------------------------------------------------------------- torchrun's options
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel's process
        raise ValueError(f"{self.prog}: {message}. {self.format_usage().strip()}")


DESCRIPTION = (
    "Run a torchrun script on N local ranks with nb_dist's reports: rank-labelled output, "
    "the root cause of a failure first, stacks of a hang."
)


def parser(prog: str) -> argparse.ArgumentParser:
    """``%torchrun``'s parser: :func:`add_options` on a parser that raises, not exits."""
    return add_options(_Parser(prog=prog, description=DESCRIPTION))


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """torchrun's options that apply on one machine, then the script and its arguments.

    ``%torchrun`` and ``nb-dist run`` share them; options go before the script, as for
    torchrun (what follows the script is the script's)."""
    p.add_argument(
        "-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=None,
        metavar="N", help="ranks (default: one per GPU; required without one)",
    )  # fmt: skip
    p.add_argument(
        "--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
        metavar="N", help="restart every rank up to N times after a failure (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--master-port", "--master_port", dest="port", type=int, default=None, metavar="PORT",
        help="the rendezvous port (default: a free one)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="stop every rank, with their stacks, after this many seconds",
    )  # fmt: skip
    p.add_argument(
        "--output", choices=("all", "grouped", "none"), default="all",
        help="each line as it comes (all), rank by rank at the end (grouped), or none",
    )  # fmt: skip
    p.add_argument(
        "--start-method", choices=("fork", "spawn", "forkserver"), default="fork",
        help="how ranks start (default fork)",
    )  # fmt: skip
    p.add_argument("script", help="the Python file to run in every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def run_parsed(options: argparse.Namespace) -> LaunchResult:
    """``run_script`` with what :func:`parser` parsed."""
    __tracebackhide__ = True
    return run_script(
        options.script,
        *options.script_args,
        num_processes=options.nproc,
        max_restarts=options.max_restarts,
        use_port=options.port,
        timeout=options.timeout,
        output=options.output,
        start_method=options.start_method,
    )


def torchrun_magic(line: str) -> LaunchResult:
    """``%torchrun [--nproc-per-node N] [...] train.py ARGS``: see the module docstring."""
    __tracebackhide__ = True
    return run_parsed(parser("%torchrun").parse_args(shlex.split(line)))
