"""Tensor parallelism's collectives in one sub-block: where ``f`` and ``g`` sit, what they move.

Notebook 16 splits each sub-block of a transformer block (attention, MLP) over ``t`` ranks: a
column-parallel layer first (``q``, ``k``, ``v`` or ``fc1``: output features split), then a
row-parallel one (``proj`` or ``fc2``: input features split, each rank a partial sum).

- **TP**: ``f`` at the entry (forward: nothing; backward: all-reduce of ``∂L/∂x``) and ``g`` at
  the exit (forward: all-reduce of the partial sums; backward: nothing).
- **TP + sequence parallelism**: between sub-blocks each rank keeps ``s/t`` of the tokens. The
  entry all-gathers the tokens (backward: reduce-scatter), the exit reduce-scatters the partial
  sums (backward: all-gather), and the notebook's column-parallel layer all-gathers its input
  again in backward for the weight gradient (as Megatron-LM does). After backward, the ``3h``
  gradients of the sub-block's LayerNorm and row-parallel bias, partial sums over the tokens, are
  all-reduced.

Every activation buffer is ``B = 4·b·s·h`` bytes (fp32). On a ring, a rank sends ``(t-1)/t·B``
for an all-gather or a reduce-scatter and twice that for an all-reduce: per block (two
sub-blocks), TP sends ``8·(t-1)/t·B`` and SP (the notebook's) ``10·(t-1)/t·B`` plus
``2·(t-1)/t·24h``. :func:`tp_collectives` lists them; :class:`TensorParallelView` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traitlets import Unicode, validate

from ._display import StrictInt, _g, _WidgetView, at_least, one_of
from ._html import MONOSPACE, escape, filled, table

if TYPE_CHECKING:
    from ipywidgets import VBox
    from traitlets.utils.bunch import Bunch

__all__ = ["Collective", "TensorParallelView", "tp_block_bytes", "tp_collectives"]

PARTS = ("attention", "MLP")
MODES = ("TP", "TP + SP")
#: Notebook 16's colours of the three collectives.
COLLECTIVE_COLORS = {
    "all-reduce": "#0072B2",
    "all-gather": "#009E73",
    "reduce-scatter": "#E69F00",
}
#: The backgrounds of the stages: whole on every rank, split by features, split by tokens.
SHARDING_COLORS = {"whole": "#EEEEEE", "features": "#FFF2CC", "tokens": "#D5E8F5"}
_SETTINGS = ("part", "mode", "b", "s", "h", "t", "heads")


@dataclass(frozen=True)
class Collective:
    """One collective of one rank in one sub-block.

    Attributes:
        phase (`str`): ``"forward"``, ``"backward"`` or ``"after backward"``.
        where (`str`): ``"entry"``, ``"exit"`` or ``"gradients"``.
        name (`str`): ``"all-reduce"``, ``"all-gather"`` or ``"reduce-scatter"``.
        tensor (`str`): what it moves.
        buffer (`int`): bytes of its full buffer (the all-gather's output, the reduce-scatter's
            input), as notebook 16's log counts them.
        sent (`float`): bytes one rank sends when it runs as a ring on ``t`` ranks.
    """

    phase: str
    where: str
    name: str
    tensor: str
    buffer: int
    sent: float


def _ring_sent(name: str, buffer: int, t: int) -> float:
    times = 2 * (t - 1) / t if name == "all-reduce" else (t - 1) / t
    return buffer * times


def tp_collectives(part: str, mode: str, b: int, s: int, h: int, t: int) -> list[Collective]:
    """The collectives of one sub-block (``part``: ``"attention"`` or ``"MLP"``) under ``mode``
    (``"TP"`` or ``"TP + SP"``), in the order they run, for a batch ``(b, s, h)`` on ``t`` ranks.

    >>> [c.name for c in tp_collectives("MLP", "TP", 8, 32, 64, 2)]
    ['all-reduce', 'all-reduce']
    """
    if part not in PARTS:
        raise ValueError(f"part={part!r} is not one of {PARTS}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    big = 4 * b * s * h  # an activation (b, s, h) in fp32

    def c(phase: str, where: str, name: str, tensor: str, buffer: int = big) -> Collective:
        return Collective(phase, where, name, tensor, buffer, _ring_sent(name, buffer, t))

    if mode == "TP":
        return [
            c("forward", "exit", "all-reduce", "g: the partial sums (b, s, h)"),
            c("backward", "entry", "all-reduce", "f: ∂L/∂x, one term per rank (b, s, h)"),
        ]
    return [
        c("forward", "entry", "all-gather", "the tokens: (b, s/t, h) -> (b, s, h)"),
        c("forward", "exit", "reduce-scatter", "the partial sums -> (b, s/t, h)"),
        c("backward", "exit", "all-gather", "∂L/∂y: (b, s/t, h) -> (b, s, h)"),
        c("backward", "entry", "all-gather", "the tokens again, for ∂L/∂W"),
        c("backward", "entry", "reduce-scatter", "∂L/∂x -> (b, s/t, h)"),
        c("after backward", "gradients", "all-reduce", "LayerNorm + bias gradients (3h)", 12 * h),
    ]


def tp_block_bytes(mode: str, b: int, s: int, h: int, t: int) -> float:
    """Bytes one rank sends per block and step (both sub-blocks), notebook 16's formulas:
    ``8·(t-1)/t·B`` for TP, ``10·(t-1)/t·B + 2·(t-1)/t·24h`` for SP, ``B = 4·b·s·h``."""
    big = 4 * b * s * h
    if mode == "TP":
        return 8 * (t - 1) / t * big
    return 10 * (t - 1) / t * big + 2 * (t - 1) / t * 24 * h


def _shapes(part: str, mode: str, b: int, s: int, h: int, t: int, heads: int) -> list[tuple]:
    """The sub-block's stages, left to right: (label, what each rank holds, its shape)."""
    tokens = f"(b, s/t, h) = ({b}, {_g(s / t)}, {h})" if mode == "TP + SP" else None
    whole = f"(b, s, h) = ({b}, {s}, {h})"
    split_in = "rank r's tokens only" if tokens else "whole on every rank"
    if part == "attention":
        column = ("q, k, v: column-parallel", f"W: h/t x h = {_g(h / t)} x {h} each")
        middle = (
            "attention: a/t heads",
            f"scores (b, a/t, s, s) = ({b}, {_g(heads / t)}, {s}, {s})",
        )
        row = ("proj: row-parallel", f"W: h x h/t = {h} x {_g(h / t)}")
        between = f"q, k, v (b, s, h/t) = ({b}, {s}, {_g(h / t)})"
    else:
        column = ("fc1: column-parallel", f"W: 4h/t x h = {_g(4 * h / t)} x {h}")
        middle = ("GELU", f"(b, s, 4h/t) = ({b}, {s}, {_g(4 * h / t)})")
        row = ("fc2: row-parallel", f"W: h x 4h/t = {h} x {_g(4 * h / t)}")
        between = f"(b, s, 4h/t) = ({b}, {s}, {_g(4 * h / t)})"
    return [
        ("input x", split_in, tokens or whole),
        (*column, between),
        (*middle, "split by heads / features"),
        (*row, f"partial sums {whole}"),
        ("output y", split_in, tokens or whole),
    ]


class TensorParallelView(_WidgetView):
    """One sub-block under TP or TP + SP: each stage's sharding, and the collectives at its
    entry and exit in forward and backward, with the bytes each one moves.

    Args:
        part (`str`): ``"attention"`` or ``"MLP"``.
        mode (`str`): ``"TP"`` or ``"TP + SP"``.
        b, s, h, t (`int`): batch, sequence length, width and number of ranks (defaults:
            notebook 16's ``8``, ``32``, ``64``, ``2``).
        heads (`int`): attention heads ``a`` (default ``4``).

    Controls: buttons for ``part`` and ``mode``, sliders for ``b``, ``s``, ``h`` and ``t``.
    """

    _css_class = "nb-dist-tensor-parallel-view"
    _settings = _SETTINGS

    part = Unicode("attention", help='"attention" or "MLP"')
    mode = Unicode("TP", help='"TP" or "TP + SP"')
    b = StrictInt(8, help="batch size")
    s = StrictInt(32, help="sequence length")
    h = StrictInt(64, help="width")
    t = StrictInt(2, help="tensor-parallel ranks")
    heads = StrictInt(4, help="attention heads a")

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)

    @validate("b", "s", "h", "t", "heads")
    def _at_least_one(self, proposal: Bunch) -> int:
        return at_least(proposal, 1)

    @validate("part", "mode")
    def _check_choice(self, proposal: Bunch) -> str:
        return one_of(proposal, tuple(PARTS if proposal.trait.name == "part" else MODES))

    # ---- model ------------------------------------------------------------------------------

    def collectives(self) -> list[Collective]:
        """This sub-block's collectives (:func:`tp_collectives`)."""
        return tp_collectives(self.part, self.mode, self.b, self.s, self.h, self.t)

    def _totals(self) -> str:
        calls = self.collectives()
        lines = []
        for phase in ("forward", "backward", "after backward"):
            sent = sum(c.sent for c in calls if c.phase == phase)
            if any(c.phase == phase for c in calls):
                lines.append(f"{phase}: {_g(sent, 9)} bytes sent per rank")
        block = tp_block_bytes(self.mode, self.b, self.s, self.h, self.t)
        lines.append(
            f"this sub-block: {_g(sum(c.sent for c in calls), 9)} bytes; the whole block "
            f"(attention + MLP): {_g(block, 9)} bytes sent per rank and step"
        )
        return "\n".join(lines)

    # ---- text -------------------------------------------------------------------------------

    def summary(self) -> str:
        """The stages with their sharding, then each collective with its bytes."""
        big = 4 * self.b * self.s * self.h
        lines = [
            f"TensorParallelView({self.part}, {self.mode}, b={self.b}, s={self.s}, h={self.h}, "
            f"t={self.t}): B = 4·b·s·h = {big} bytes",
        ]
        stages = _shapes(self.part, self.mode, self.b, self.s, self.h, self.t, self.heads)
        lines.extend(f"  {label}: {held}; {shape}" for label, held, shape in stages)
        for c in self.collectives():
            lines.append(
                f"  {c.phase:14s} {c.where:9s} {c.name:14s} buffer {c.buffer:>9d}  "
                f"sent {_g(c.sent, 9):>9s}  {c.tensor}"
            )
        lines.extend("  " + line for line in self._totals().split("\n"))
        return "\n".join(lines)

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        wide = {"description_width": "initial"}
        controls = {
            "part": w.ToggleButtons(options=list(PARTS), description="part"),
            "mode": w.ToggleButtons(options=list(MODES), description="mode"),
            "b": w.IntSlider(min=1, max=64, description="b (batch)", style=wide),
            "s": w.IntSlider(min=8, max=8192, step=8, description="s (sequence)", style=wide),
            "h": w.IntSlider(min=64, max=8192, step=64, description="h (width)", style=wide),
            "t": w.IntSlider(min=1, max=8, description="t (ranks)", style=wide),
        }
        for name, control in controls.items():
            self._link_control(name, control)
        return w.VBox([*controls.values(), self._html_output()])

    def _cell(self, calls: list[Collective]) -> str:
        if not calls:
            return "<td style='color:#888'>nothing</td>"
        return f"<td>{self._boxes(calls)}</td>"

    def _boxes(self, calls: list[Collective]) -> str:
        return "<br>".join(
            f'<span class="nb-dist-collective" style="padding:0 3px;'
            f'{filled(COLLECTIVE_COLORS[c.name])}">{c.name}</span> {escape(c.tensor)}, '
            f"sends {_g(c.sent, 9)} B"
            for c in calls
        )

    def _html_view(self) -> str:
        stages = _shapes(self.part, self.mode, self.b, self.s, self.h, self.t, self.heads)
        calls = self.collectives()
        entry, exit_ = ("f", "g") if self.mode == "TP" else ("entry", "exit")

        def at(phase: str, where: str) -> list[Collective]:
            return [c for c in calls if c.phase == phase and c.where == where]

        head = [stages[0][0], entry, stages[1][0], stages[2][0], stages[3][0], exit_, "output y"]
        ends = SHARDING_COLORS["tokens" if self.mode == "TP + SP" else "whole"]

        def stage(st: tuple[str, ...], color: str) -> str:
            return f'<td style="background:{color}">{escape(st[1])}<br>{escape(st[2])}</td>'

        held = [
            stage(stages[0], ends),
            "<td></td>",
            *(stage(st, SHARDING_COLORS["features"]) for st in stages[1:4]),
            "<td></td>",
            stage(stages[4], ends),
        ]
        forward = ["<td>forward →</td>", self._cell(at("forward", "entry"))]
        forward += ["<td></td>"] * 3 + [self._cell(at("forward", "exit")), "<td></td>"]
        backward = ["<td>← backward</td>", self._cell(at("backward", "entry"))]
        backward += ["<td></td>"] * 3 + [self._cell(at("backward", "exit")), "<td></td>"]
        rows = [
            f'<tr class="nb-dist-tp-held">{"".join(held)}</tr>',
            f'<tr class="nb-dist-tp-forward">{"".join(forward)}</tr>',
            f'<tr class="nb-dist-tp-backward">{"".join(backward)}</tr>',
        ]
        after = at("after backward", "gradients")
        note = f"<br>after backward: {self._boxes(after)}" if after else ""
        totals = escape(self._totals()).replace("\n", "<br>")
        legend = " ".join(
            f'<span style="padding:0 4px;background:{color}">{name}</span>'
            for name, color in (
                ("whole on every rank", SHARDING_COLORS["whole"]),
                ("split by features (columns, rows, heads)", SHARDING_COLORS["features"]),
                ("split by tokens (sequence)", SHARDING_COLORS["tokens"]),
            )
        )
        return (
            f"<div style='{MONOSPACE}'><b>{self.part}, {self.mode}: b={self.b}, s={self.s}, "
            f"h={self.h}, t={self.t}; every buffer B = 4·b·s·h = {4 * self.b * self.s * self.h}"
            f" bytes</b><br>{legend}"
            f"{table(head, rows, ' border=1 cellpadding=3 style=border-collapse:collapse')}"
            f"{note}<br>{totals}</div>"
        )
