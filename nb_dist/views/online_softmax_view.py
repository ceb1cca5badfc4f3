"""The online softmax, one block of keys at a time: the running ``m``, ``den`` and ``acc``.

For one query with scores ``x_j`` against keys ``j`` and values ``v_j``, attention is
``Σ_j e^{x_j} v_j / Σ_j e^{x_j}``. Notebook 18 builds it block by block: each block of keys gives
its own maximum ``m``, ``den = Σ e^{x_j - m}`` and ``acc = Σ e^{x_j - m} v_j``, and a merge
(notebook 18's exercise; ``nb_dist.teach.reference.merge_blocks``, which the notebook passes in)
folds the blocks together, bringing both to the larger maximum first. After the last block,
``acc / den`` is the softmax over all the keys times the values. :func:`online_softmax_steps`
records the state after each block; :class:`OnlineSoftmaxView` steps through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traitlets import observe, validate

from ._display import StrictInt, _WidgetView, at_least, between
from ._html import MONOSPACE, table
from .colors import rank_color

if TYPE_CHECKING:
    from ipywidgets import VBox
    from traitlets.utils.bunch import Bunch

__all__ = ["OnlineSoftmaxView", "SoftmaxStep", "online_softmax_steps"]

_BAR_PX = 60  # the height of a weight of 1


@dataclass(frozen=True)
class SoftmaxStep:
    """The state after one more block of keys.

    Attributes:
        block (`int`): the block just folded in (0, 1, ...).
        keys (`tuple[int, int]`): its keys, ``start`` to ``stop`` (``stop`` excluded).
        block_max (`float`): the block's own maximum score.
        m (`float`): the running maximum, over every key seen so far.
        den (`float`): ``Σ e^{x_j - m}`` over the keys seen so far.
        acc (`tuple[float, ...]`): ``Σ e^{x_j - m} v_j`` over the keys seen so far.
    """

    block: int
    keys: tuple[int, int]
    block_max: float
    m: float
    den: float
    acc: tuple[float, ...]

    @property
    def output(self) -> tuple[float, ...]:
        """``acc / den``: attention over the keys seen so far."""
        return tuple(a / self.den for a in self.acc)


def _as_tensors(scores: Any, values: Any) -> tuple[Any, Any]:
    import torch

    x = torch.as_tensor(scores, dtype=torch.float32).detach().reshape(-1)
    v = torch.as_tensor(values, dtype=torch.float32).detach()
    if v.dim() == 1:
        v = v[:, None]
    if v.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape[0]} scores but {v.shape[0]} values: one value per key")
    return x, v


#: ``merge(a, b)``: the ``(m, den, acc)`` of two blocks of keys together (tensors).
Merge = Callable[[tuple[Any, Any, Any], tuple[Any, Any, Any]], tuple[Any, Any, Any]]


def online_softmax_steps(scores: Any, values: Any, block: int, merge: Merge) -> list[SoftmaxStep]:
    """Fold the keys in, ``block`` at a time, with ``merge``: the state after each block.

    ``scores``: one query's ``s`` scores (``q kᵀ/√d``); ``values``: ``(s, d)``, one row per key;
    ``merge``: notebook 18's online-softmax merge (``nb_dist.teach.reference.merge_blocks``).
    """
    import torch

    if block < 1:
        raise ValueError(f"block={block!r} must be >= 1")
    x, v = _as_tensors(scores, values)
    steps, state = [], None
    for index, start in enumerate(range(0, x.shape[0], block)):
        stop = min(start + block, x.shape[0])
        part = x[start:stop]
        m = part.max().reshape(1)
        weights = torch.exp(part - m)
        mine = (m, weights.sum().reshape(1), weights @ v[start:stop])
        state = mine if state is None else merge(state, mine)
        steps.append(
            SoftmaxStep(
                block=index,
                keys=(start, stop),
                block_max=float(m),
                m=float(state[0]),
                den=float(state[1]),
                acc=tuple(float(a) for a in state[2]),
            )
        )
    return steps


def full_attention(scores: Any, values: Any) -> tuple[float, ...]:
    """``softmax(scores) · values`` over all the keys at once (the reference)."""
    import torch

    x, v = _as_tensors(scores, values)
    return tuple(float(a) for a in torch.softmax(x, dim=0) @ v)


class OnlineSoftmaxView(_WidgetView):
    """One query's scores folded in block by block: weights, running ``m``, ``den``, ``acc``.

    Args:
        scores: one query's scores, one per key (a tensor or a list).
        values: the keys' values, ``(s, d)``.
        merge: the merge of two blocks' ``(m, den, acc)`` (notebook 18: ``merge_blocks``).
        block (`int`): keys per block (default ``16``).
        step (`int`): blocks folded in so far (``0``: none; default ``1``).

    Controls: ``step`` (``IntSlider``) and ``block`` (``IntSlider``).
    """

    _css_class = "nb-dist-online-softmax-view"

    block = StrictInt(16, help="keys per block")
    step = StrictInt(1, help="blocks folded in so far (0: none)")

    def __init__(
        self, scores: Any, values: Any, merge: Merge, block: int = 16, step: int = 1
    ) -> None:
        x, v = _as_tensors(scores, values)
        self.merge = merge
        self.scores = [float(s) for s in x]
        self.values = v
        self.reference = full_attention(x, v)
        super().__init__(block=block)
        self.step = step

    @property
    def steps(self) -> list[SoftmaxStep]:
        """The state after each block (:func:`online_softmax_steps`)."""
        return online_softmax_steps(self.scores, self.values, self.block, self.merge)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.scores) // self.block)

    @validate("block")
    def _check_block(self, proposal: Bunch) -> int:
        return at_least(proposal, 1)

    @validate("step")
    def _check_step(self, proposal: Bunch) -> int:
        return between(proposal, 0, self.num_blocks)

    @observe("block")
    def _block_changed(self, _change: Bunch) -> None:
        if self.step > self.num_blocks:
            self.step = self.num_blocks
        if "step" in self._controls:
            self._controls["step"].max = self.num_blocks  # type: ignore[attr-defined]
        self._refresh()

    @observe("step")
    def _refresh(self, _change: Bunch | None = None) -> None:
        if self._widget is not None:
            self._html.value = self._html_view()

    def go_to(self, step: int) -> OnlineSoftmaxView:
        """Show the state after ``step`` blocks."""
        self.step = step
        return self

    def matches(self, atol: float = 1e-6) -> bool:
        """After the last block: ``acc / den`` equals the full softmax times the values."""
        last = self.steps[-1].output
        return all(abs(a - r) <= atol for a, r in zip(last, self.reference, strict=True))

    # ---- text -------------------------------------------------------------------------------

    def _lines(self) -> list[str]:
        shown = self.steps[: self.step]
        lines = [f"{len(self.scores)} keys in {self.num_blocks} blocks of {self.block}"]
        if not shown:
            lines.append("no block yet: m = -inf, den = 0, acc = 0")
        for st in shown:
            lines.append(
                f"block {st.block} (keys {st.keys[0]}-{st.keys[1] - 1}): its max "
                f"{st.block_max:.4f}; running m = {st.m:.4f}, den = {st.den:.4f}, "
                f"acc[:3] = [{', '.join(f'{a:.3f}' for a in st.acc[:3])}]"
            )
        if self.step == self.num_blocks:
            lines.append(
                f"all blocks: m = max of all scores = {max(self.scores):.4f}; acc / den equals "
                f"softmax(x) · v over all keys (atol=1e-6): {self.matches()}"
            )
        else:
            lines.append(f"{self.num_blocks - self.step} block(s) to go")
        return lines

    def summary(self) -> str:
        """The state after each block shown so far, and, at the end, the check."""
        head = f"OnlineSoftmaxView(block={self.block}, step={self.step}/{self.num_blocks})"
        return "\n".join([head, *("  " + line for line in self._lines())])

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        wide = {"description_width": "initial"}
        self._link_control(
            "step", w.IntSlider(min=0, max=self.num_blocks, description="blocks seen", style=wide)
        )
        self._link_control(
            "block", w.IntSlider(min=4, max=len(self.scores), description="block size", style=wide)
        )
        return w.VBox([*self._controls.values(), self._html_output()])

    def _html_view(self) -> str:
        import math

        shown = self.steps[: self.step]
        m = shown[-1].m if shown else 0.0
        seen = shown[-1].keys[1] if shown else 0
        bars = []
        for j, x in enumerate(self.scores):
            block = j // self.block
            if j < seen:
                height, color = _BAR_PX * math.exp(x - m), rank_color(block)
            else:
                height, color = 2.0, "#DDDDDD"
            bars.append(
                f'<span title="key {j}" style="display:inline-block;width:5px;'
                f"margin-right:1px;height:{height:.1f}px;background:{color};"
                f'vertical-align:bottom"></span>'
            )
        rows = [
            f'<tr class="nb-dist-softmax-step" data-block="{st.block}"><td>{st.block}</td>'
            f"<td>{st.keys[0]}-{st.keys[1] - 1}</td><td>{st.block_max:.4f}</td>"
            f"<td>{st.m:.4f}</td><td>{st.den:.4f}</td>"
            f"<td>[{', '.join(f'{a:.3f}' for a in st.acc[:3])}, ...]</td></tr>"
            for st in shown
        ]
        head = ("block", "keys", "its max", "running m", "den", "acc")
        text = "<br>".join(self._lines())
        return (
            f"<div style='{MONOSPACE}'><b>e^(x_j - m) of each key seen so far (one colour per "
            f"block; grey: not yet seen)</b><div style='height:{_BAR_PX + 4}px;"
            f"display:flex;align-items:flex-end'>{''.join(bars)}</div>"
            f"{table(head, rows, ' cellpadding=4')}{text}</div>"
        )
