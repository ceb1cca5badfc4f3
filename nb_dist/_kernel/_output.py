"""Rank-labelled output: turning each rank's byte stream into labelled lines in the cell.

Ranks write to pipes; the launching cell's thread reads them and writes every complete line
with its rank's prefix to the kernel's own ``sys.stdout``/``sys.stderr``. Because the launching
thread writes, the lines land in the launching cell and are all sent before the cell returns.
"""

from __future__ import annotations

import codecs
import re
import string
import sys
import time
import uuid
from typing import Any, NamedTuple, TextIO

from ._tracebacks import ipython_shell


class _Shown(NamedTuple):
    """One ``display()`` of a rank, as it is published (or held for grouped output)."""

    rank_index: int  # the rank's index among the kernel's ranks
    data: dict[str, Any]
    metadata: dict[str, Any]
    display_id: str | None
    update: bool


OUTPUT_MODES = ("all", "rank0", "grouped", "none")
RICH_OUTPUT_MODES = ("rank0", "all", "none")
DEFAULT_PREFIX = "[rank ${rank}] "


class LineSplitter:
    """Split a byte stream into complete text lines; keep what a terminal would show of ``\\r``.

    A progress bar that redraws itself with ``\\r`` becomes one line (its last state) instead
    of hundreds, and a partial line is held back until it is complete (or flushed).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.pending_since: float | None = None

    def feed(self, data: bytes) -> list[str]:
        text = self._pending + self._decoder.decode(data)
        *complete, self._pending = text.split("\n")
        if self._pending and self.pending_since is None:
            self.pending_since = time.monotonic()
        elif not self._pending:
            self.pending_since = None
        return [_visible(line) for line in complete]

    def flush(self) -> list[str]:
        """Return the held-back partial line, if any, as a line of its own."""
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        self.pending_since = None
        return [_visible(text)] if text else []


def _frontend() -> Any:
    """The IPython shell that can show rich output, or ``None`` (a plain script)."""
    return ipython_shell()


# torch's informational lines that every rank prints on every launch (gloo's connection
# report, on stdout from torch 2.10 to 2.12): kept in the rank's log (``result.logs``), never
# shown in the cell or the monitor, where they would bury the function's own output. Warnings
# and errors never match.
QUIET_LINES = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)


def is_quiet(line: str) -> bool:
    """Whether ``line`` is torch's chatter that stays in the log only (see ``QUIET_LINES``)."""
    return QUIET_LINES.fullmatch(line.strip()) is not None


def _visible(line: str) -> str:
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1]


class OutputRouter:
    """Where each rank's lines go: the cell (labelled, filtered by ``mode``) and the rank's log."""

    def __init__(
        self,
        ranks: list[int],
        mode: str = "all",
        prefix_template: str = DEFAULT_PREFIX,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        rich: str | frozenset[int] = "rank0",
    ) -> None:
        self.mode = mode
        # Which ranks' display() output is shown rich (HTML, images) in the cell.
        self._rich = rich
        self._display_ids: dict[tuple[int, str], str] = {}
        self._prefixes = [
            string.Template(prefix_template).safe_substitute(
                rank=rank, local_rank=local, role_name="default", role="default"
            )
            for local, rank in enumerate(ranks)
        ]
        self._ranks = ranks
        self._stdout = stdout
        self._stderr = stderr
        self.logs: list[list[str]] = [[] for _ in ranks]
        # "grouped": (stream, line) per rank, written rank by rank when the launch ends; a
        # display is held as ("display", its publish arguments).
        self._held: list[list[tuple[str, Any]]] = [[] for _ in ranks]
        self.observer: Any = None  # a live view that also wants every line (the monitor)

    def _stream(self, name: str) -> TextIO:
        # Looked up at write time: IPython swaps sys.stdout per cell.
        if name == "stderr":
            return self._stderr or sys.stderr
        return self._stdout or sys.stdout

    def shows(self, index: int) -> bool:
        if self.mode == "none":
            return False
        return self.mode == "all" or self._ranks[index] == 0

    def lines(self, index: int, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        self.logs[index].extend(lines)
        lines = [line for line in lines if not is_quiet(line)]
        if not lines:
            return
        if self.observer is not None:
            self.observer.lines(index, stream, lines)
        if self.mode == "grouped":
            self._held[index].extend((stream, line) for line in lines)
        elif self.shows(index):
            prefix = self._prefixes[index]
            out = self._stream(stream)
            out.write("".join(f"{prefix}{line}\n" for line in lines))
            out.flush()

    def shows_rich(self, index: int) -> bool:
        """Whether this rank's ``display()`` output is published rich in the cell."""
        if self._rich == "none" or self.mode == "none" or _frontend() is None:
            return False
        if self._rich == "all":
            return True
        ranks = frozenset({0}) if self._rich == "rank0" else self._rich
        return self._ranks[index] in ranks

    def display(
        self,
        index: int,
        data: dict[str, Any],
        metadata: dict[str, Any],
        display_id: str | None,
        update: bool,
    ) -> None:
        """A rank's ``display()``: published in the cell, or printed as text where it cannot be.

        The text form always goes to the rank's log, so ``result.logs`` reads the same either
        way, and scripts, ``nbconvert`` and ranks not shown rich get the text in the cell.
        """
        text = str(data.get("text/plain", "")).splitlines()
        if not self.shows_rich(index):
            if update:  # a redraw (a progress table) would repeat the same text lines
                self.logs[index].extend(text)
            else:
                self.lines(index, "stdout", text)
            return
        self.logs[index].extend(text)
        if display_id is not None:
            key = (index, str(display_id))
            display_id = self._display_ids.setdefault(key, f"nb_dist-{uuid.uuid4().hex}")
        shown = _Shown(index, data, metadata, display_id, update)
        if self.mode == "grouped":
            self._held[index].append(("display", shown))
        else:
            self._publish(shown)

    def clear_output(self, index: int, wait: bool) -> None:
        """A rank's ``clear_output()`` (progress displays redraw with it): only rank 0's, live."""
        if self.shows_rich(index) and self._ranks[index] == 0 and self.mode != "grouped":
            import IPython.display

            for name in ("stdout", "stderr"):
                self._stream(name).flush()
            clear: Any = IPython.display.clear_output  # untyped in IPython
            clear(wait=wait)

    def _publish(self, shown: _Shown) -> None:
        index, data, metadata, display_id, update = shown
        import IPython.display

        publish: Any = IPython.display.publish_display_data  # untyped in IPython
        for name in ("stdout", "stderr"):
            self._stream(name).flush()  # the rank's earlier prints stay above its display
        if self._rich != "rank0" and not update:
            self._stream("stdout").write(f"{self._prefixes[index]}(display)\n")
            self._stream("stdout").flush()
        transient = {"display_id": display_id} if display_id is not None else None
        publish(data, metadata, transient=transient, update=update)

    def finish(self) -> None:
        """End of a launch: in ``"grouped"`` mode, write every rank's lines, rank by rank.

        Live lines of different ranks interleave in whatever order the OS schedules them;
        grouped output is the same on every run, which is what notebooks checked by nbval need.
        """
        for local, held in enumerate(self._held):
            prefix = self._prefixes[local]
            for stream, item in held:
                if stream == "display":
                    self._publish(item)
                else:
                    self._stream(stream).write(f"{prefix}{item}\n")
            held.clear()
        for name in ("stdout", "stderr"):
            self._stream(name).flush()

    def notice(self, text: str) -> None:
        """A message from the launcher itself (not from a rank), on stderr."""
        self._stream("stdout").flush()  # what the cell printed before stays above it
        out = self._stream("stderr")
        out.write("".join(f"[nb_dist] {line}\n" for line in text.splitlines()))
        out.flush()

    def log_text(self, index: int) -> str:
        lines = self.logs[index]
        return "\n".join(lines) + ("\n" if lines else "")
