"""Ring all-reduce, one step at a time.

``dist.all_reduce(t)`` leaves the elementwise **sum** of every rank's ``t`` on every rank (DDP then
divides by the world size itself to get the average: averaging is a separate division). A
ring implementation does it without any rank ever holding everything:

* every buffer is cut into ``N`` chunks (``N`` = number of ranks; when the length does not divide,
  the first chunks are one element longer, as ``torch.tensor_split``/``numpy.array_split`` do);
* **reduce-scatter**, ``N-1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s) mod N`` to
  rank ``r+1``, which adds it to its own copy. Afterwards rank ``r`` owns the complete sum of chunk
  ``(r + 1) mod N``;
* **all-gather**, ``N-1`` steps: at step ``s`` rank ``r`` sends chunk ``(r + 1 - s) mod N`` to rank
  ``r+1``, which overwrites its copy. Afterwards every rank holds every complete chunk.

Every rank sends ``2(N-1)`` chunks, about ``2(N-1)/N`` times its buffer size, whatever ``N``:
that is why ring all-reduce scales. A naive "everyone sends everything to everyone" costs
``(N-1)`` buffer sizes per rank.

:func:`ring_allreduce_steps` is the pure simulation; :class:`AllReduceStepper` shows it with
Play/Step/Reset controls, a text summary and a matplotlib ring diagram.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traitlets import CBool, Unicode, observe, validate

from ._display import (
    SettingValueError,
    StrictInt,
    _new_figure,
    _WidgetView,
    between,
    figure_png,
)
from ._html import MONOSPACE, escape, filled, rank_row, table
from .colors import rank_color

if TYPE_CHECKING:
    from ipywidgets import VBox
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch

__all__ = ["AllReduceStepper", "RingStep", "chunk_bounds", "ring_allreduce_steps"]

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"
DIVIDE = "divide"

#: 8 elements on 4 ranks: every one of the 4 chunks holds 2 elements, none is empty.
DEFAULT_BUFFERS = [[rank + 1 + i for i in range(8)] for rank in range(4)]


@dataclass(frozen=True)
class RingStep:
    """One step of a ring all-reduce.

    Attributes:
        phase (`str`): ``"reduce-scatter"``, ``"all-gather"``, or ``"divide"`` (the final
            local division by ``N`` for ``op="avg"``; nothing is sent).
        index (`int`): 1-based position among all steps (step 0 is the initial state).
        phase_step (`int`): 1-based position within its phase.
        sends (`list[tuple[int, int, int, int]]`): ``(src, dst, chunk_idx, nbytes)`` per message.
        buffers (`list[list[float]]`): every rank's buffer *after* this step.
        contributors (`list[list[tuple[int, ...]]]`): for each rank and chunk, the ranks whose
            data that chunk now sums (complete when it holds all ``N`` ranks).
    """

    phase: str
    index: int
    phase_step: int
    sends: list[tuple[int, int, int, int]]
    buffers: list[list[float]]
    contributors: list[list[tuple[int, ...]]] = field(repr=False)

    def bytes_sent(self, rank: int) -> int:
        """Bytes ``rank`` sends in this step."""
        return sum(nbytes for src, _dst, _chunk, nbytes in self.sends if src == rank)


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``n`` chunks covering ``range(length)``.

    Like ``torch.tensor_split(t, n)``: the first ``length % n`` chunks get one extra element,
    and chunks may be empty when ``length < n``.

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _as_lists(buffers: Sequence[Any]) -> tuple[list[list[float]], int | None]:
    """Copy buffers (tensors, arrays or lists) to lists of numbers, plus the tensors' itemsize."""
    itemsize = None
    out = []
    for b in buffers:
        if hasattr(b, "element_size") and hasattr(b, "tolist"):  # torch.Tensor
            itemsize = itemsize or int(b.element_size())
            values = b.detach().cpu().reshape(-1).tolist()
        elif hasattr(b, "tolist"):  # numpy array
            itemsize = itemsize or int(getattr(b, "itemsize", 4))
            values = list(b.reshape(-1).tolist())
        else:
            values = list(b)
        out.append(values)
    return out, itemsize


def _check_buffers(buffers: list[list[float]]) -> None:
    if not 2 <= len(buffers) <= 8:
        raise ValueError(
            f"ring all-reduce needs 2 to 8 ranks' buffers, got {len(buffers)} "
            "(pass one 1-D buffer per rank, e.g. [[1, 2, 3], [2, 3, 4]])"
        )
    lengths = {len(b) for b in buffers}
    if len(lengths) != 1:
        raise ValueError(
            f"every rank's buffer must have the same length for all_reduce, got lengths "
            f"{[len(b) for b in buffers]}"
        )
    if not lengths.pop():
        raise ValueError("the buffers are empty; give every rank at least one element")


def ring_allreduce_steps(
    buffers: Sequence[Any], op: str = "sum", itemsize: int | None = None
) -> list[RingStep]:
    """Simulate ring all-reduce on ``N`` ranks' buffers and return every step.

    Args:
        buffers: one equal-length 1-D buffer per rank (lists, tensors or arrays), 2 to 8 ranks.
        op (`str`): ``"sum"`` (what ``dist.all_reduce`` does by default) or ``"avg"`` (sum, then
            a final local division by ``N`` as its own ``"divide"`` step).
        itemsize (`int`, *optional*): bytes per element; by default the tensors' element size,
            or 4 (float32) for plain lists.

    Returns:
        ``2(N-1)`` steps (``N-1`` reduce-scatter then ``N-1`` all-gather), plus one ``"divide"``
        step for ``op="avg"``. The last step's buffers are the reduced result on every rank.

    >>> ring_allreduce_steps([[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]])[-1].buffers[0]
    [10, 14, 18]
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op={op!r} is not supported; use op='sum' or op='avg'")
    state, tensor_itemsize = _as_lists(buffers)
    _check_buffers(state)
    itemsize = itemsize or tensor_itemsize or 4
    n = len(state)
    bounds = chunk_bounds(len(state[0]), n)
    contrib: list[list[frozenset[int]]] = [[frozenset([r])] * n for r in range(n)]
    steps: list[RingStep] = []

    def snapshot(phase: str, phase_step: int, sends: list[tuple[int, int, int, int]]) -> None:
        steps.append(
            RingStep(
                phase=phase,
                index=len(steps) + 1,
                phase_step=phase_step,
                sends=sends,
                buffers=[list(b) for b in state],
                contributors=[[tuple(sorted(c)) for c in row] for row in contrib],
            )
        )

    for phase in (REDUCE_SCATTER, ALL_GATHER):
        for s in range(n - 1):
            offset = -s if phase == REDUCE_SCATTER else 1 - s
            # All sends of one step happen at the same time: read every payload first.
            messages = []
            for src in range(n):
                chunk = (src + offset) % n
                start, stop = bounds[chunk]
                messages.append(
                    (src, (src + 1) % n, chunk, state[src][start:stop], contrib[src][chunk])
                )
            sends = []
            for src, dst, chunk, payload, who in messages:
                start, stop = bounds[chunk]
                if phase == REDUCE_SCATTER:
                    state[dst][start:stop] = [
                        a + b for a, b in zip(state[dst][start:stop], payload, strict=True)
                    ]
                    contrib[dst][chunk] = contrib[dst][chunk] | who
                else:
                    state[dst][start:stop] = payload
                    contrib[dst][chunk] = who
                sends.append((src, dst, chunk, (stop - start) * itemsize))
            snapshot(phase, s + 1, sends)
    if op == "avg":
        state = [[v / n for v in b] for b in state]
        snapshot(DIVIDE, 1, [])
    return steps


class AllReduceStepper(_WidgetView):
    """Step through a ring all-reduce of ``N`` ranks' buffers.

    Args:
        buffers: one equal-length 1-D buffer per rank (2 to 8 ranks). Default: 8 elements on
            4 ranks, rank ``r`` holding ``[r+1, ..., r+8]``, so every chunk has 2 elements (sum
            ``[10, 14, ..., 38]``). With fewer elements than ranks some chunks are empty.
        op (`str`): ``"sum"`` or ``"avg"`` (sum, then divide by ``N``).
        itemsize (`int`, *optional*): bytes per element (default: tensor element size, else 4).
        step (`int`): the step shown first (0 = before anything is sent).

    Controls: ``play`` (``ipywidgets.Play``), ``step`` (``IntSlider``, linked to ``play``),
    ``next`` and ``reset`` buttons, ``op`` (``ToggleButtons``) and ``ring`` (show the ring
    diagram as an image, off by default because drawing it costs a fraction of a second).
    """

    _css_class = "nb-dist-allreduce-stepper"

    op = Unicode("sum", help='"sum", or "avg" (sum, then divide by N)')
    step = StrictInt(0, help="the step shown (0 = before anything is sent)")
    ring = CBool(False, help="draw the ring diagram (a PNG) in the widget")

    def __init__(
        self,
        buffers: Sequence[Any] | None = None,
        op: str = "sum",
        itemsize: int | None = None,
        step: int = 0,
    ) -> None:
        super().__init__()
        if buffers is None:
            buffers = DEFAULT_BUFFERS
        self.initial, tensor_itemsize = _as_lists(buffers)
        _check_buffers(self.initial)
        self.itemsize = itemsize or tensor_itemsize or 4
        self.steps = ring_allreduce_steps(self.initial, op=self.op, itemsize=self.itemsize)
        self.op = op  # another op recomputes the steps (_op_changed)
        self.go_to(step)

    @validate("op")
    def _check_op(self, proposal: Bunch) -> str:
        op: str = proposal.value
        if op not in ("sum", "avg"):
            raise SettingValueError(f"op={op!r} is not supported; use op='sum' or op='avg'")
        return op

    @validate("step")
    def _check_step(self, proposal: Bunch) -> int:
        return between(proposal, 0, self.num_steps)

    @observe("op")
    def _op_changed(self, _change: Bunch) -> None:
        """New steps for the new op; the position is kept (clamped to the new last step)."""
        self.steps = ring_allreduce_steps(self.initial, op=self.op, itemsize=self.itemsize)
        self.step = min(self.step, self.num_steps)  # before the controls' max can shrink
        for name in ("play", "step"):
            if name in self._controls:
                self._controls[name].max = self.num_steps
        self._refresh()

    @observe("step", "ring")
    def _refresh(self, _change: Bunch | None = None) -> None:
        if self._widget is None:
            return
        self._html.value = self._html_view()
        if self.ring:
            self._image.value = figure_png(self.figure(), dpi=80)
            self._image.layout.display = None
        else:
            self._image.layout.display = "none"

    # ---- model ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.initial)

    @property
    def num_steps(self) -> int:
        """Number of steps after the initial state (``2(N-1)``, plus 1 for ``op="avg"``)."""
        return len(self.steps)

    def go_to(self, step: int) -> AllReduceStepper:
        """Show ``step`` (0 = initial state, ``num_steps`` = finished)."""
        self.step = step
        return self

    def next(self) -> AllReduceStepper:
        """Advance one step (stays at the end)."""
        return self.go_to(min(self.step + 1, self.num_steps))

    def reset(self) -> AllReduceStepper:
        """Back to the initial state."""
        return self.go_to(0)

    def set_op(self, op: str) -> AllReduceStepper:
        """Switch between ``"sum"`` and ``"avg"`` (recomputes the steps, keeps the position)."""
        self.op = op
        return self

    def buffers(self, step: int | None = None) -> list[list[float]]:
        """Every rank's buffer after ``step`` (default: the current step)."""
        step = self.step if step is None else step
        return [list(b) for b in (self.initial if step == 0 else self.steps[step - 1].buffers)]

    def contributors(self, step: int | None = None) -> list[list[tuple[int, ...]]]:
        """For each rank and chunk, which ranks' data the chunk sums after ``step``."""
        step = self.step if step is None else step
        if step == 0:
            return [[(r,)] * self.world_size for r in range(self.world_size)]
        return self.steps[step - 1].contributors

    def bytes_sent(self, upto: int | None = None) -> list[int]:
        """Total bytes each rank has sent after steps ``1..upto`` (default: all steps)."""
        upto = self.num_steps if upto is None else upto
        return [sum(s.bytes_sent(r) for s in self.steps[:upto]) for r in range(self.world_size)]

    @property
    def buffer_bytes(self) -> int:
        """Size of one rank's buffer in bytes."""
        return len(self.initial[0]) * self.itemsize

    def ring_bytes_formula(self) -> float:
        """The textbook per-rank traffic of ring all-reduce: ``2(N-1)/N`` x buffer size."""
        n = self.world_size
        return 2 * (n - 1) / n * self.buffer_bytes

    def naive_bytes(self) -> int:
        """Per-rank traffic if every rank sent its whole buffer to every other rank."""
        return (self.world_size - 1) * self.buffer_bytes

    # ---- text -------------------------------------------------------------------------------

    def _step_title(self, step: int) -> str:
        if step == 0:
            return f"step 0/{self.num_steps}: initial buffers"
        s = self.steps[step - 1]
        n = self.world_size
        if s.phase == DIVIDE:
            return f"step {step}/{self.num_steps}: divide by N={n} on every rank (op='avg')"
        return f"step {step}/{self.num_steps}: {s.phase} {s.phase_step}/{n - 1}"

    def summary(self) -> str:
        """The current step, what is sent, every rank's buffer, and the traffic so far."""
        n = self.world_size
        bounds = chunk_bounds(len(self.initial[0]), n)
        sizes = [b - a for a, b in bounds]
        lines = [
            f"AllReduceStepper(world_size={n}, length={len(self.initial[0])}, op={self.op!r}, "
            f"itemsize={self.itemsize}, chunks={sizes})",
            self._step_title(self.step),
        ]
        if self.step:
            for src, dst, chunk, nbytes in self.steps[self.step - 1].sends:
                lines.append(f"  rank {src} -> rank {dst}: chunk {chunk} ({nbytes} B)")
        contributors = self.contributors()
        for rank, buf in enumerate(self.buffers()):
            chunks = []
            for c, (a, b) in enumerate(bounds):
                values = ", ".join(_fmt(v) for v in buf[a:b])
                mark = "" if len(contributors[rank][c]) < n else "*"
                chunks.append(f"[{values}]{mark}")
            lines.append(f"rank {rank}: {' '.join(chunks)}")
        lines.append("* = chunk complete (sums all ranks)")
        sent = self.bytes_sent(self.step)
        lines.append(
            "bytes sent so far: " + ", ".join(f"rank {r}: {b}" for r, b in enumerate(sent))
        )
        if self.step == self.num_steps:
            totals = self.bytes_sent()
            low, high = min(totals), max(totals)
            spread = f"{low} B" if low == high else f"{low}..{high} B"
            lines.append(
                f"total per rank: {spread}, about 2(N-1)/N x {self.buffer_bytes} B = "
                f"{self.ring_bytes_formula():g} B; naive all-to-all: {self.naive_bytes()} B"
            )
        return "\n".join(lines)

    # ---- figure -----------------------------------------------------------------------------

    def figure(self, step: int | None = None) -> Figure:
        """Ranks on a ring with their chunked buffers at ``step``, and bytes sent per rank.

        Chunks are coloured by the rank whose data they started from, with as many stripes as
        ranks they already sum; arrows show this step's sends.
        """
        step = self.step if step is None else step
        if not 0 <= step <= self.num_steps:
            raise ValueError(f"step={step!r} must be between 0 and {self.num_steps}")
        fig = _new_figure(11.0, 5.2)
        ring_ax, bytes_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
        self._draw_ring(ring_ax, step)
        self._draw_bytes(bytes_ax, step)
        fig.suptitle(f"Ring all-reduce of {self.world_size} ranks (op={self.op!r})")
        return fig

    def _draw_ring(self, ax: Axes, step: int) -> None:
        """The ranks on a ring with their chunked buffers after ``step``, and its sends."""
        n = self.world_size
        bounds = chunk_bounds(len(self.initial[0]), n)
        buffers = self.buffers(step)
        contributors = self.contributors(step)
        # Chunks of a fixed size; the ring grows so that neighbouring buffers never overlap.
        # A chunk is a white box with its values on top and, below them, a band split left to
        # right into one stripe per rank whose data it sums (one stripe: the rank's own data;
        # N stripes: complete, labelled "all").
        cw, ch = (0.4 if n <= 4 else 0.3), 0.3
        radius = max(1.0, (n * cw + 0.45) / (2 * math.sin(math.pi / n)))
        centers = [
            (radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n))
            for r in range(n)
        ]
        sends = self.steps[step - 1].sends if step else []
        sent_chunks = {(src, chunk) for src, _dst, chunk, _b in sends}
        for rank, (x, y) in enumerate(centers):
            left, bottom = x - n * cw / 2, y - ch / 2
            for c, (start, stop) in enumerate(bounds):
                _draw_chunk(
                    ax,
                    _ChunkBox(left, bottom, c, cw, ch),
                    buffers[rank][start:stop],
                    contributors[rank][c],
                    complete=len(contributors[rank][c]) == n,
                    sent=(rank, c) in sent_chunks,
                )
            ax.text(
                x,
                y + ch / 2 + 0.03,
                f"rank {rank}",
                ha="center",
                va="bottom",
                fontsize=9,
                fontweight="bold",
                color=_ink(rank_color(rank)),
            )
        for send in sends:
            _draw_send(ax, send, centers)
        ax.text(
            0,
            -radius - 0.6,
            "stripes and the label below a chunk: the ranks whose data it sums ('all': "
            "complete); thick outline: chunk sent in this step",
            ha="center",
            fontsize=7.5,
            color="#444444",
        )
        ax.set_xlim(-radius - 0.7, radius + 0.7)
        ax.set_ylim(-radius - 0.65, radius + 0.55)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(self._step_title(step), fontsize=10)

    def _draw_bytes(self, ax: Axes, step: int) -> None:
        """Bars of the bytes each rank sends (all steps, and up to ``step``) with references."""
        totals = self.bytes_sent()
        so_far = self.bytes_sent(step)
        xs = range(self.world_size)
        ax.bar(xs, totals, color=[rank_color(r) for r in xs], alpha=0.3, label="ring, all steps")
        ax.bar(xs, so_far, color=[rank_color(r) for r in xs], label=f"sent by step {step}")
        for level, color, style, width, label in (
            (self.ring_bytes_formula(), "#000000", "--", 1, "2(N-1)/N x buffer"),
            (self.naive_bytes(), "#D55E00", ":", 1.5, "naive all-to-all (N-1) x buffer"),
        ):
            ax.axhline(level, color=color, linestyle=style, linewidth=width, label=label)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"rank {r}" for r in xs], fontsize=8)
        ax.set_ylabel("bytes sent")
        ax.set_ylim(0, max(self.naive_bytes(), max(totals)) * 1.3)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"bytes sent per rank (buffer = {self.buffer_bytes} B)", fontsize=10)

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        play = self._add_control(
            "play",
            w.Play(
                min=0,
                max=self.num_steps,
                step=1,
                interval=1200,
                description="play",
                show_repeat=False,
            ),
        )
        slider = self._link_control(
            "step",
            w.IntSlider(min=0, max=self.num_steps, description="step", continuous_update=True),
        )
        # While playing, jslink moves the slider in the browser, and the slider's kernel-side
        # link moves the view. Play itself only follows the view (dlink, after the slider's
        # link): linking it both ways made the browser send each value back, so that
        # go_to(3); go_to(6) in one cell ended at step 3.
        w.jslink((play, "value"), (slider, "value"))
        w.dlink((self, "step"), (play, "value"))
        nxt = self._add_control(
            "next", w.Button(description="Step", tooltip="next step", icon="step-forward")
        )
        reset = self._add_control(
            "reset", w.Button(description="Reset", tooltip="back to step 0", icon="undo")
        )
        op = self._link_control(
            "op",
            w.ToggleButtons(
                options=["sum", "avg"],
                description="op",
                tooltips=["dist.all_reduce (SUM)", "sum, then divide by N"],
            ),
        )
        ring = self._link_control("ring", w.Checkbox(description="ring diagram"))
        nxt.on_click(lambda _b: self.next())
        reset.on_click(lambda _b: self.reset())
        html_body = self._html_output()
        self._image = w.Image(  # at its own size, not stretched to the VBox's width
            format="png", layout=w.Layout(display="none", align_self="flex-start", max_width="100%")
        )
        self._image.add_class(f"{self._css_class}-figure")
        return w.VBox(
            [w.HBox([play, slider, nxt, reset]), w.HBox([op, ring]), html_body, self._image]
        )

    def _html_view(self) -> str:
        """A table: one row per rank, one cell per chunk, sends highlighted."""
        n = self.world_size
        bounds = chunk_bounds(len(self.initial[0]), n)
        buffers = self.buffers()
        contributors = self.contributors()
        sends = self.steps[self.step - 1].sends if self.step else []
        sending = {(src, chunk): dst for src, dst, chunk, _b in sends}
        rows = []
        for rank in range(n):
            cells = []
            for c, (a, b) in enumerate(bounds):
                who = contributors[rank][c]
                border = "3px solid #000" if (rank, c) in sending else "1px solid #999"
                arrow = f" &rarr; r{sending[(rank, c)]}" if (rank, c) in sending else ""
                label = escape(_chunk_label(buffers[rank][a:b], limit=6))
                if len(who) == 1:  # still only this rank's own data: its colour
                    fill = filled(rank_color(who[0]))
                else:  # a partial or complete sum: one stripe per contributing rank
                    stops = ",".join(
                        f"{rank_color(r)} {100 * k / len(who):.1f}% {100 * (k + 1) / len(who):.1f}%"
                        for k, r in enumerate(who)
                    )
                    fill = (
                        f"background:linear-gradient(to right,{stops}) bottom/100% 6px no-repeat,"
                        "#FFFFFF;color:#000000;padding-bottom:8px"
                    )
                sums = "+".join(f"r{r}" for r in who) if len(who) < n else "<b>all ranks</b>"
                complete = " nb-dist-complete" if len(who) == n else ""
                cells.append(
                    f'<td class="nb-dist-chunk{complete}" style="border:{border};'
                    f'padding:2px 6px;{fill}">[{label}]<br><small>{sums}{arrow}</small></td>'
                )
            rows.append(
                f'<tr {rank_row(rank)}><th style="color:'
                f'{_ink(rank_color(rank))}">rank {rank}</th>{"".join(cells)}</tr>'
            )
        head = ["", *(f"chunk {c}" for c in range(n))]
        spaced = " style='border-collapse:separate;border-spacing:3px'"
        sent = self.bytes_sent(self.step)
        return (
            f"<div style='{MONOSPACE}'><b>{escape(self._step_title(self.step))}</b>"
            + table(head, rows, spaced)
            + "bytes sent so far: "
            + ", ".join(f"rank {r}: {b}" for r, b in enumerate(sent))
            + f" (ring total per rank ~ {self.ring_bytes_formula():g} B, naive "
            f"{self.naive_bytes()} B)</div>"
        )


def _fmt(value: float) -> str:
    """Numbers as short, stable text: ``10``, ``2.5``, ``0.3333``."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def _chunk_label(values: list[float], sep: str = ", ", limit: int = 3) -> str:
    """A chunk's values as text, at most ``limit`` of them (then an ellipsis)."""
    if not values:
        return "-"
    shown = [_fmt(v) for v in values[:limit]]
    return sep.join(shown + (["..."] if len(values) > limit else []))


@dataclass(frozen=True)
class _ChunkBox:
    """Where chunk ``index`` of a rank's buffer is drawn: the buffer's corner and chunk size."""

    left: float
    bottom: float
    index: int
    width: float
    height: float

    @property
    def center_x(self) -> float:
        return self.left + (self.index + 0.5) * self.width


def _draw_chunk(
    ax: Axes, box: _ChunkBox, values: list[float], who: tuple[int, ...], complete: bool, sent: bool
) -> None:
    """One chunk: a stripe per rank it sums, its outline (thick if sent), values and ranks."""
    from matplotlib.patches import Rectangle

    cw, ch = box.width, box.height
    band = 0.45 * ch
    for k, contributor in enumerate(who):  # one stripe per summed rank
        ax.add_patch(
            Rectangle(
                (box.left + box.index * cw + k * cw / len(who), box.bottom),
                cw / len(who),
                band,
                facecolor=rank_color(contributor),
                edgecolor="#FFFFFF",
                linewidth=0.8,
            )
        )
    ax.add_patch(
        Rectangle(
            (box.left + box.index * cw, box.bottom),
            cw,
            ch,
            fill=False,
            edgecolor="#000000" if sent else "#888888",
            linewidth=2.4 if sent else 0.6,
        )
    )
    ax.text(
        box.center_x,
        box.bottom + band + (ch - band) / 2,
        _chunk_label(values, limit=2),
        ha="center",
        va="center",
        fontsize=8,
        fontweight="bold" if complete else "normal",
    )
    ax.text(
        box.center_x,
        box.bottom - 0.03,
        "all" if complete else "+".join(str(r) for r in who),
        ha="center",
        va="top",
        fontsize=6.5,
        color="#444444",
    )


def _draw_send(
    ax: Axes, send: tuple[int, int, int, int], centers: list[tuple[float, float]]
) -> None:
    """An arrow from the sending rank to the receiving one, labelled with chunk and bytes."""
    from matplotlib.patches import FancyArrowPatch

    src, dst, chunk, nbytes = send
    (x0, y0), (x1, y1) = centers[src], centers[dst]
    ax.add_patch(
        FancyArrowPatch(
            (x0, y0),
            (x1, y1),
            connectionstyle="arc3,rad=-0.25",
            arrowstyle="-|>",
            mutation_scale=14,
            shrinkA=42,
            shrinkB=42,
            color=rank_color(src),
            linewidth=1.8,
        )
    )
    mx, my = (x0 + x1) / 2 * 1.25, (y0 + y1) / 2 * 1.25
    ax.text(
        mx,
        my,
        f"chunk {chunk}\n{nbytes} B",
        ha="center",
        va="center",
        fontsize=7,
        color=_ink(rank_color(src)),
    )


def _ink(color: str) -> str:
    """A readable text colour for labels drawn in a rank's colour on white (yellow is too pale)."""
    return "#8C7D00" if color.upper() == "#F0E442" else color
