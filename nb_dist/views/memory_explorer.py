"""Memory per rank, strategy by strategy: parameters, gradients, optimizer states, activations.

Notebook 13 derives what one rank of a data-, ZeRO-, tensor- or pipeline-parallel run keeps for
a stack of ``L`` transformer blocks of width ``h`` with ``a`` heads, trained with Adam on a batch
of ``b`` sequences of ``s`` tokens, on ``N`` ranks (``Ψ = L·(12h² + 13h)`` parameters):

======================= ============ ============ ================ ===========
strategy (degree N)     parameters   gradients    optimizer states activations
======================= ============ ============ ================ ===========
DP: a full copy each    wΨ           gΨ           oΨ               A
ZeRO-1                  wΨ           gΨ           oΨ/N             A
ZeRO-2                  wΨ           gΨ/N         oΨ/N             A
ZeRO-3 (FSDP)           wΨ/N         gΨ/N         oΨ/N             A
TP                      wΨ_TP        gΨ_TP        oΨ_TP            A_TP
PP                      wΨ/N         gΨ/N         oΨ/N             A
======================= ============ ============ ================ ===========

with ``w, g, o`` the bytes per parameter of weights, gradients and Adam's states (``4, 4, 8`` in
fp32, ``2, 2, 12`` in bf16 mixed precision), ``A`` = ``L`` blocks of
``16bsh + 4bs + abs²`` elements (notebook 13's count, at ``act`` bytes per element),
``Ψ_TP = L·((12h² + 7h)/N + 6h)`` and ``A_TP = L·(4bsh + 4bs + (12bsh + abs²)/N)`` elements.
:func:`memory_per_rank` is the notebook's ``per_rank``; :class:`MemoryExplorer` draws it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traitlets import Unicode, validate

from ._display import StrictInt, _WidgetView, at_least, one_of
from ._html import MONOSPACE, filled, table

if TYPE_CHECKING:
    from ipywidgets import VBox
    from traitlets.utils.bunch import Bunch

__all__ = ["MemoryExplorer", "memory_per_rank"]

STRATEGIES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP", "PP")
KINDS = ("parameters", "gradients", "optimizer", "activations")
#: Notebook 13's colours of the four kinds.
KIND_COLORS = {
    "parameters": "#0072B2",
    "gradients": "#E69F00",
    "optimizer": "#009E73",
    "activations": "#CC79A7",
}
#: Bytes per parameter (weights, gradients, Adam's states) and per activation element.
PRECISIONS = {
    "fp32": {"weights": 4, "grads": 4, "optimizer": 8, "act": 4},
    "bf16 mixed": {"weights": 2, "grads": 2, "optimizer": 12, "act": 2},
}
_SETTINGS = ("b", "s", "h", "n", "layers", "heads", "precision")
_BAR_PX = 420  # the widest bar, in pixels


def memory_per_rank(
    strategy: str,
    n: int,
    layers: int,
    h: int,
    heads: int,
    s: int,
    b: int,
    weights: int = 4,
    grads: int = 4,
    optimizer: int = 8,
    act: int = 4,
) -> dict[str, float]:
    """Bytes one rank keeps of each kind under ``strategy`` on ``n`` ranks (notebook 13's
    ``per_rank``, the same formulas: a model, not a measurement).

    >>> memory_per_rank("ZeRO-3", 2, 2, 64, 4, 32, 8)["parameters"]
    199936.0
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    psi: float = layers * (12 * h * h + 13 * h)
    # one block's activations, in elements: notebook 13's count (exercise 13-1's formula,
    # nb_dist.teach.reference.block_activations, in bytes / 4; the views import nothing of
    # nb_dist's, and the tests check the two agree)
    elements: float = 16 * b * s * h + 4 * b * s + heads * b * s * s
    shard = {"parameters": 1, "gradients": 1, "optimizer": 1}
    if strategy == "ZeRO-1":
        shard = {"parameters": 1, "gradients": 1, "optimizer": n}
    elif strategy == "ZeRO-2":
        shard = {"parameters": 1, "gradients": n, "optimizer": n}
    elif strategy in ("ZeRO-3", "PP"):
        shard = {"parameters": n, "gradients": n, "optimizer": n}
    if strategy == "TP":
        psi = layers * ((12 * h * h + 7 * h) / n + 6 * h)
        elements = 4 * b * s * h + 4 * b * s + (12 * b * s * h + heads * b * s * s) / n
    return {
        "parameters": weights * psi / shard["parameters"],
        "gradients": grads * psi / shard["gradients"],
        "optimizer": optimizer * psi / shard["optimizer"],
        "activations": float(act * layers * elements),  # PP: L/N blocks, N micro-batches
    }


def _unit(largest: float) -> tuple[str, float]:
    """A decimal unit that shows ``largest`` with a few digits: ``("MB", 1e6)``."""
    for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return name, scale
    return "B", 1.0


class MemoryExplorer(_WidgetView):
    """Bytes per rank of each kind, for every strategy, as stacked bars and as numbers.

    Args:
        b, s, h (`int`): batch size, sequence length and width (defaults: notebook 13's small
            case, ``8``, ``32``, ``64``).
        n (`int`): number of ranks (the degree of every strategy; default ``2``).
        layers, heads (`int`): ``L`` blocks and ``a`` attention heads (defaults ``2``, ``4``).
        precision (`str`): ``"fp32"`` (4 + 4 + 8 bytes per parameter, activations at 4) or
            ``"bf16 mixed"`` (2 + 2 + 12, activations at 2).

    Controls: sliders for ``b``, ``s``, ``h`` and ``n``, buttons for ``precision``.
    ``table()`` recomputes when any setting changes.
    """

    _css_class = "nb-dist-memory-explorer"
    _settings = _SETTINGS

    b = StrictInt(8, help="batch size (sequences per rank; a TP group shares one batch)")
    s = StrictInt(32, help="sequence length")
    h = StrictInt(64, help="width of the model")
    n = StrictInt(2, help="number of ranks")
    layers = StrictInt(2, help="number of transformer blocks L")
    heads = StrictInt(4, help="attention heads a")
    precision = Unicode("fp32", help='"fp32" or "bf16 mixed"')

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)

    @validate("b", "s", "h", "n", "layers", "heads")
    def _at_least_one(self, proposal: Bunch) -> int:
        return at_least(proposal, 1)

    @validate("precision")
    def _check_precision(self, proposal: Bunch) -> str:
        return one_of(proposal, tuple(PRECISIONS))

    # ---- model ------------------------------------------------------------------------------

    @property
    def psi(self) -> int:
        """``Ψ = L·(12h² + 13h)``, the parameters of the ``L`` blocks."""
        return self.layers * (12 * self.h * self.h + 13 * self.h)

    def table(self) -> dict[str, dict[str, float]]:
        """``{strategy: {kind: bytes per rank}}`` from :func:`memory_per_rank`."""
        sizes = PRECISIONS[self.precision]
        return {
            strategy: memory_per_rank(
                strategy, self.n, self.layers, self.h, self.heads, self.s, self.b, **sizes
            )
            for strategy in STRATEGIES
        }

    def _title(self) -> str:
        return (
            f"L={self.layers}, h={self.h}, a={self.heads}, b={self.b}, s={self.s}, "
            f"N={self.n}, {self.precision}: Ψ = {self.psi:,} parameters"
        )

    # ---- text -------------------------------------------------------------------------------

    def summary(self) -> str:
        """The settings, then one line per strategy: each kind and the total per rank."""
        bars = self.table()
        unit, scale = _unit(max(sum(parts.values()) for parts in bars.values()))
        lines = [f"MemoryExplorer({self._title()})", f"  {unit} per rank (a model):"]
        for strategy, parts in bars.items():
            kinds = "  ".join(f"{kind} {parts[kind] / scale:9.3f}" for kind in KINDS)
            lines.append(f"  {strategy:7s} {kinds}  total {sum(parts.values()) / scale:9.3f}")
        return "\n".join(lines)

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        wide = {"description_width": "initial"}
        controls = {
            "b": w.IntSlider(min=1, max=64, description="b (batch)", style=wide),
            "s": w.IntSlider(min=16, max=8192, step=16, description="s (sequence)", style=wide),
            "h": w.IntSlider(min=64, max=8192, step=64, description="h (width)", style=wide),
            "n": w.IntSlider(min=1, max=64, description="N (ranks)", style=wide),
            "precision": w.ToggleButtons(options=list(PRECISIONS), description="precision"),
        }
        for name, control in controls.items():
            self._link_control(name, control)
        return w.VBox([*controls.values(), self._html_output()])

    def _html_view(self) -> str:
        bars = self.table()
        largest = max(sum(parts.values()) for parts in bars.values())
        unit, scale = _unit(largest)
        rows = []
        for strategy, parts in bars.items():
            total = sum(parts.values())
            segments = "".join(
                f'<span title="{kind}" style="display:inline-block;height:14px;'
                f'width:{_BAR_PX * parts[kind] / largest:.1f}px;{filled(KIND_COLORS[kind])}">'
                "</span>"
                for kind in KINDS
            )
            numbers = "".join(f"<td>{parts[kind] / scale:,.3f}</td>" for kind in KINDS)
            rows.append(
                f'<tr class="nb-dist-strategy-row" data-strategy="{strategy}">'
                f"<td>{strategy}</td><td style='white-space:nowrap'>{segments}</td>{numbers}"
                f"<td><b>{total / scale:,.3f}</b></td></tr>"
            )
        legend = " ".join(
            f'<span style="padding:0 4px;{filled(color)}">{kind}</span>'
            for kind, color in KIND_COLORS.items()
        )
        head = ("strategy", "per rank", *KINDS, f"total ({unit})")
        return (
            f"<div style='{MONOSPACE}'><b>{self._title()}</b><br>{legend}"
            f"{table(head, rows, ' cellpadding=3')}<span>{unit} per rank; a model, not a "
            "measurement. TP: the N ranks share one batch; the others: one batch per rank."
            "</span></div>"
        )
