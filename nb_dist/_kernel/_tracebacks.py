"""Tracebacks and live stacks from ranks, written the way IPython writes them.

Ranks report file names such as ``/tmp/ipykernel_123/2803.py``; the kernel knows that this
file is ``Cell In[5]``. These helpers relabel such names in the kernel, and turn a raw
``faulthandler`` dump of a blocked rank into a readable "most recent call last" stack.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
from typing import Any

from .._shared._frames import ENTRY_FILE, FUNCTION_CALL, is_own

_FILE_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_FAULT_HEADER = re.compile(r"^(Current thread|Thread|Stack) ?(?P<ident>0x[0-9a-f]+)?.*:$")
FAULT_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>.+)$')


def ipython_shell() -> Any:
    """The running IPython shell (a kernel's, or a terminal's), or ``None`` in a script.

    Looked up without importing IPython: where it is not imported, no shell is running.
    """
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def kernel_is_running() -> bool:
    """Whether this process runs a Jupyter kernel (where a frontend may render widgets)."""
    return getattr(ipython_shell(), "kernel", None) is not None


def cell_label(filename: str) -> str | None:
    """Return ``"Cell In[5]"`` for a file name IPython made for a cell, else ``None``."""
    shell = ipython_shell()
    compiler = getattr(shell, "compile", None)
    formatter = getattr(compiler, "format_code_name", None)
    if formatter is None:
        return _label_from_history(shell, compiler, filename)
    label = formatter(filename)
    return f"{label[0]} {label[1]}" if label else None


def _label_from_history(shell: Any, compiler: Any, filename: str) -> str | None:
    """``cell_label`` on IPython 7 (Colab's and Kaggle's), which keeps no map from a cell's
    file name to its number: the newest cell of the history whose code the kernel's compiler
    names ``filename``. ipykernel names a cell's file after a hash of its code, and the history
    keeps the code without its trailing newlines, so a few endings are tried."""
    if filename in _cell_numbers:
        return f"Cell In[{_cell_numbers[filename]}]"
    namer = getattr(compiler, "get_code_name", None)
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if namer is None or not history or not os.path.isabs(filename):
        return None
    number = _history_names(namer, history).get(filename)
    return f"Cell In[{number}]" if number is not None else None


# On IPython 7: the file name of each cell compiled since nb_dist was imported, and of each
# %%ranks cell's body (run on the ranks under a name made from the body): file name -> number.
_cell_numbers: dict[str, int] = {}


def remember_cell(filename: str, number: int) -> None:
    """Note that ``filename`` is cell ``number``'s code, for :func:`cell_label` on IPython 7
    (IPython 8 and later keep this map in the kernel's compiler themselves)."""
    _cell_numbers[filename] = number


def follow_cell_names() -> None:
    """On IPython 7, note each cell's file name and number as the kernel compiles it, as
    IPython 8 and later do in their compiler. The history finds only cells stored in it; a
    cell run without history (nbval, a frontend's silent run) is found this way."""
    compiler = getattr(ipython_shell(), "compile", None)
    if compiler is None or hasattr(compiler, "format_code_name"):
        return
    cache = getattr(compiler, "cache", None)
    if cache is None or getattr(cache, "_nb_dist_follows", False):
        return

    def following(transformed_code: str, number: int = 0, *args: Any, **kwargs: Any) -> str:
        name: str = cache(transformed_code, number, *args, **kwargs)
        remember_cell(name, number)
        return name

    following._nb_dist_follows = True  # type: ignore[attr-defined]
    compiler.cache = following


# The names of the history's cells, kept until the history grows: a spawn launch asks for
# every linecache entry, and each name is a hash of a whole cell.
_named: tuple[int, int, dict[str, int]] = (0, 0, {})


def _history_names(namer: Any, history: list[str]) -> dict[str, int]:
    global _named
    if _named[:2] != (id(history), len(history)):
        names: dict[str, int] = {}
        for number in range(1, len(history)):  # later cells overwrite: the newest wins
            for ending in ("", "\n", "\n\n"):
                code = history[number] + ending
                names[namer(code, code, number)] = number
        _named = (id(history), len(history), names)
    return _named[2]


def relabel_cells(text: str) -> str:
    """Replace ``File "/tmp/ipykernel_…/N.py", line L`` by ``Cell In[K], line L`` in ``text``."""

    def repl(match: re.Match[str]) -> str:
        label = cell_label(match.group("file"))
        if label is None:
            return match.group(0)
        return f"{label}, line {match.group('line')}"

    return _FILE_LINE.sub(repl, text)


def parse_fault_dump(dump: str, thread_ident: int | None) -> list[tuple[str, int, str]]:
    """Frames (file, line, function), most recent last, of one thread in a faulthandler dump.

    ``thread_ident`` picks the thread (the rank's main thread); with ``None`` the first
    block is used.
    """
    blocks: list[tuple[int | None, list[tuple[str, int, str]]]] = []
    for raw in dump.splitlines():
        header = _FAULT_HEADER.match(raw)
        if header:
            ident = header.group("ident")
            blocks.append((int(ident, 16) if ident else None, []))
            continue
        frame = FAULT_FRAME.match(raw)
        if frame and blocks:
            blocks[-1][1].append((frame["file"], int(frame["line"]), frame["name"].strip()))
    if not blocks:
        return []
    chosen = blocks[0][1]
    for ident, frames in blocks:
        if thread_ident is not None and ident == thread_ident:
            chosen = frames
            break
    return list(reversed(chosen))


def rank_frames(frames: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """Drop the frames below the rank's entry point (most recent last).

    A forked rank's stack still holds the frames of whatever called the launcher in the
    kernel (IPython, pytest, ...) below nb_dist's rank entry: they are not the rank's work.
    """
    entry = [i for i, f in enumerate(frames) if os.path.abspath(f[0]) == ENTRY_FILE]
    return frames[entry[-1] + 1 :] if entry else frames


def format_frames(frames: list[tuple[str, int, str]]) -> str:
    """Format frames like a Python traceback body, with cell labels and source lines."""
    lines = []
    for filename, lineno, name in rank_frames(frames):
        if is_own(filename):
            continue
        label = cell_label(filename)
        where = f"{label}, line {lineno}" if label else f'File "{filename}", line {lineno}'
        lines.append(f"  {where}, in {name}")
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines)


def innermost_user_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """Short "``dist.all_reduce(t)`` at Cell In[5], line 9, in train" for a blocked rank.

    The deepest frame is usually inside torch; what a learner needs is the line of their own
    code that led there, so report the innermost frame whose file is not in a library.
    """
    library_markers = (os.sep + "site-packages" + os.sep, os.sep + "lib" + os.sep + "python")
    for filename, lineno, name in reversed(rank_frames(frames)):
        if any(m in filename for m in library_markers) or filename.startswith("<frozen"):
            continue
        if is_own(filename):
            continue
        where = cell_label(filename) or os.path.basename(filename)
        source = linecache.getline(filename, lineno).strip()
        code = f"`{source}` at " if source else ""
        return f"{code}{where}, line {lineno}, in {name}"
    return None


def blocked_place(frames: list[tuple[str, int, str]]) -> str:
    """Where a blocked rank is, for a learner: their own line, or what the native code is.

    With no frame of the user's code, a stack whose innermost frame is the rank's own call
    of the function means the function has returned and native code is freeing its local
    variables (a DDP model whose process group was destroyed first can hang there).
    """
    user = innermost_user_frame(frames)
    if user:
        return user
    if frames and (os.path.abspath(frames[-1][0]), frames[-1][2]) == FUNCTION_CALL:
        return (
            "the return from the function, in native code freeing its local variables (a "
            "DistributedDataParallel model whose process group was already destroyed can hang "
            "there: del the model before destroy_process_group(), or leave the destroy to the "
            "launcher)"
        )
    return "an unknown place (native code, no Python frame of yours)"
