"""fp32, fp16 and bf16 side by side: what a number becomes, and why fp16 needs a GradScaler.

A floating-point number is ``(-1)^sign x 1.mantissa x 2^(exponent - bias)``. The three formats
used in training split their bits differently:

======== ==== ======== ======== =====================================================
dtype    bits exponent mantissa consequence
======== ==== ======== ======== =====================================================
float32  32   8        23       range ~1e-38 .. 3.4e38, ~7 significant digits
float16  16   5        10       range only ~6e-8 .. 65504: overflows and underflows
bfloat16 16   8        7        float32's range, but only ~2-3 significant digits
======== ==== ======== ======== =====================================================

So ``65000 * 2`` is ``inf`` in fp16 but fine in bf16, and a gradient of ``1e-8`` becomes ``0``
in fp16. Loss scaling (``torch.amp.GradScaler``) multiplies the loss so that small gradients stay
above fp16's underflow, and skips the optimizer step whenever the scaled gradients overflow
(then halves the scale). bf16 has fp32's exponent range and needs no scaler.

:class:`PrecisionExplorer` shows one value in the three dtypes (computed with real torch tensors)
with its rounding error, overflow/underflow flags and bit layout, plus the ``torch.finfo`` table.
A GradScaler's scale trace recorded in a real run is
:class:`~nb_dist.views.loss_scale_view.LossScaleView`'s to draw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from traitlets import CFloat

from ._display import _g, _new_figure, _WidgetView
from ._html import MONOSPACE, escape, table

if TYPE_CHECKING:
    from ipywidgets import VBox
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["FinfoRow", "PrecisionExplorer", "Representation", "finfo_table", "represent"]

DTYPE_NAMES = ("float32", "float16", "bfloat16")
# (total bits, exponent bits, mantissa bits) of each format.
_LAYOUT = {"float32": (32, 8, 23), "float16": (16, 5, 10), "bfloat16": (16, 8, 7)}
# Colours of the sign / exponent / mantissa fields in the bit-layout drawings.
FIELD_COLORS = {"sign": "#CC79A7", "exponent": "#56B4E9", "mantissa": "#E69F00"}


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in _LAYOUT:
        raise ValueError(f"dtype {name!r} is not one of {DTYPE_NAMES}")
    return getattr(torch, name)


def _dtype_name(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    aliases = {
        "fp32": "float32",
        "fp16": "float16",
        "bf16": "bfloat16",
        "half": "float16",
        "float": "float32",
    }
    name = aliases.get(name, name)
    _torch_dtype(name)
    return name


@dataclass(frozen=True)
class Representation:
    """How one value is stored in one dtype.

    Attributes:
        dtype (`str`): ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        value (`float`): the value asked for (a Python float, i.e. float64).
        stored (`float`): what the dtype actually holds (``torch.tensor(value, dtype).item()``).
        abs_error (`float`): ``|stored - value|`` (``inf`` on overflow).
        rel_error (`float`): ``abs_error / |value|`` (``nan`` for ``value == 0`` or non-finite).
        overflow (`bool`): a finite value became ``inf``.
        underflow (`bool`): a non-zero value became ``0``.
        subnormal (`bool`): stored below the smallest normal number (``finfo.tiny``): kept, but
            with fewer significant bits.
        sign, exponent, mantissa (`str`): the stored bits, as strings of ``0``/``1``.
    """

    dtype: str
    value: float
    stored: float
    abs_error: float
    rel_error: float
    overflow: bool
    underflow: bool
    subnormal: bool
    sign: str
    exponent: str
    mantissa: str

    @property
    def bits(self) -> str:
        """``"sign exponent mantissa"`` separated by spaces."""
        return f"{self.sign} {self.exponent} {self.mantissa}"

    @property
    def flag(self) -> str:
        """``"nan"``, ``"overflow -> inf"``, ``"underflow -> 0"``, ``"subnormal"``, or ``"ok"``.

        ``"nan"`` comes first: a NaN (``inf * 0``, ``inf - inf``) poisons every later step, and
        it is what a GradScaler looks for to skip a step.
        """
        if math.isnan(self.stored):
            return "nan"
        if self.overflow:
            return "overflow -> inf"
        if self.underflow:
            return "underflow -> 0"
        if self.subnormal:
            return "subnormal"
        return "ok"


def _bits_of(tensor: Any, name: str) -> tuple[str, str, str]:
    import torch

    total, exp_bits, _mant_bits = _LAYOUT[name]
    as_int = tensor.view(torch.int32 if total == 32 else torch.int16).item()
    pattern = format(as_int & ((1 << total) - 1), f"0{total}b")
    return pattern[0], pattern[1 : 1 + exp_bits], pattern[1 + exp_bits :]


def represent(value: float, dtype: Any) -> Representation:
    """Store ``value`` in ``dtype`` with ``torch.tensor(value, dtype=dtype)`` and describe it.

    >>> represent(65000 * 2, "float16").overflow
    True
    >>> represent(1e-8, "float16").stored
    0.0
    """
    import torch

    name = _dtype_name(dtype)
    value = float(value)
    tensor = torch.tensor(value, dtype=_torch_dtype(name))
    stored = float(tensor.item())
    tiny = torch.finfo(tensor.dtype).tiny
    if math.isfinite(value):
        abs_error = abs(stored - value) if math.isfinite(stored) else math.inf
        rel_error = abs_error / abs(value) if value != 0 else math.nan
    else:
        abs_error = 0.0 if stored == value else math.nan
        rel_error = math.nan
    sign, exponent, mantissa = _bits_of(tensor, name)
    return Representation(
        dtype=name,
        value=value,
        stored=stored,
        abs_error=abs_error,
        rel_error=rel_error,
        overflow=math.isfinite(value) and math.isinf(stored),
        underflow=value != 0 and stored == 0,
        subnormal=stored != 0 and abs(stored) < tiny,
        sign=sign,
        exponent=exponent,
        mantissa=mantissa,
    )


def multiply_in(value: float, factor: float, dtype: Any) -> float:
    """``value * factor`` computed in ``dtype`` (both operands stored in it first)."""
    import torch

    torch_dtype = _torch_dtype(_dtype_name(dtype))
    return float(
        (torch.tensor(value, dtype=torch_dtype) * torch.tensor(factor, dtype=torch_dtype)).item()
    )


@dataclass(frozen=True)
class FinfoRow:
    """One row of the dynamic-range table, read from ``torch.finfo``.

    ``smallest_subnormal`` is ``tiny * eps`` (the last mantissa bit at the smallest exponent);
    ``digits`` is the decimal precision ``-log10(finfo.resolution)``.
    """

    dtype: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    tiny: float
    smallest_subnormal: float
    eps: float
    digits: int


def finfo_table(dtypes: Iterable[Any] = DTYPE_NAMES) -> list[FinfoRow]:
    """The dynamic range of each dtype, from ``torch.finfo``.

    Note the seed tutorials' shorthand "fp16: ~1e-8 to 65504": fp16's smallest value is
    ``5.96e-08`` (a subnormal), so ``1e-8`` itself already underflows to 0.
    """
    import torch

    rows = []
    for dtype in dtypes:
        name = _dtype_name(dtype)
        info = torch.finfo(_torch_dtype(name))
        _total, exp_bits, mant_bits = _LAYOUT[name]
        rows.append(
            FinfoRow(
                dtype=name,
                bits=info.bits,
                exponent_bits=exp_bits,
                mantissa_bits=mant_bits,
                max=float(info.max),
                tiny=float(info.tiny),
                smallest_subnormal=float(info.tiny * info.eps),
                eps=float(info.eps),
                digits=round(-math.log10(info.resolution)),
            )
        )
    return rows


def format_finfo_table(rows: Sequence[FinfoRow] | None = None) -> str:
    """The finfo table as aligned text."""
    rows = finfo_table() if rows is None else rows
    header = (
        "dtype",
        "bits",
        "exp",
        "mant",
        "max",
        "tiny (min normal)",
        "min subnormal",
        "eps",
        "digits",
    )
    table = [header] + [
        (
            r.dtype,
            str(r.bits),
            str(r.exponent_bits),
            str(r.mantissa_bits),
            _g(r.max),
            _g(r.tiny),
            _g(r.smallest_subnormal),
            _g(r.eps),
            str(r.digits),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


class PrecisionExplorer(_WidgetView):
    """One value in fp32, fp16 and bf16: stored value, rounding error, flags and bits.

    Args:
        value (`float`): the value to store (default ``65000.0``).
        factor (`float`): also compute ``value * factor`` in each dtype (default ``2.0``: the
            classic ``65000 * 2`` that overflows fp16, whose max is 65504, but not bf16).

    Controls: ``value`` and ``factor`` (``FloatText``). ``representations()`` and
    ``products()`` recompute when they change.
    """

    _css_class = "nb-dist-precision-explorer"
    _settings = ("value", "factor")

    value = CFloat(65000.0, help="the value to store")
    factor = CFloat(2.0, help="also compute value * factor in each dtype")

    def __init__(self, value: float = 65000.0, factor: float = 2.0) -> None:
        super().__init__(value=value, factor=factor)

    # ---- model ------------------------------------------------------------------------------

    def representations(self) -> dict[str, Representation]:
        """``{dtype: Representation}`` of ``value`` in float32, float16 and bfloat16."""
        return {name: represent(self.value, name) for name in DTYPE_NAMES}

    def products(self) -> dict[str, Representation]:
        """``{dtype: Representation}`` of ``value * factor`` computed in each dtype.

        The product is computed in the dtype itself, so ``65000 * 2`` in fp16 is ``inf``
        even though ``130000`` is an ordinary number; the error is measured against the exact
        product of the Python floats.
        """
        exact = self.value * self.factor
        out = {}
        for name in DTYPE_NAMES:
            product = multiply_in(self.value, self.factor, name)
            base = represent(product, name)  # re-storing is exact: it only yields the bits
            if math.isfinite(exact):
                abs_error = abs(product - exact) if math.isfinite(product) else math.inf
                rel_error = abs_error / abs(exact) if exact else math.nan
            else:
                abs_error = rel_error = math.nan
            out[name] = replace(
                base,  # its bits, stored value and subnormal flag; the errors against exact
                value=exact,
                abs_error=abs_error,
                rel_error=rel_error,
                overflow=math.isfinite(exact) and math.isinf(product),
                underflow=exact != 0 and product == 0,
            )
        return out

    # ---- text -------------------------------------------------------------------------------

    def summary(self) -> str:
        """Value and product in each dtype, then the finfo table (deterministic text)."""
        lines = [f"PrecisionExplorer(value={self.value!r}, factor={self.factor!r})"]

        def block(title: str, reps: dict[str, Representation]) -> None:
            lines.append(title)
            rows = [("dtype", "stored", "abs err", "rel err", "flag", "sign exponent mantissa")]
            rows += [
                (r.dtype, _g(r.stored, 8), _g(r.abs_error, 3), _g(r.rel_error, 3), r.flag, r.bits)
                for r in reps.values()
            ]
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            lines.extend(
                "  "
                + "  ".join(c.ljust(width) for c, width in zip(row, widths, strict=True)).rstrip()
                for row in rows
            )

        block(f"value {_g(self.value, 10)} stored as:", self.representations())
        block(
            f"value * {_g(self.factor, 10)} = {_g(self.value * self.factor, 10)} computed in:",
            self.products(),
        )
        lines.append("dynamic range (torch.finfo):")
        lines.extend("  " + line for line in format_finfo_table().split("\n"))
        return "\n".join(lines)

    # ---- figure -----------------------------------------------------------------------------

    def figure(self) -> Figure:
        """Top: each dtype's range on a log scale with the value marked. Bottom: its bits."""
        fig = _new_figure(10.0, 5.6)
        range_ax, bits_ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.1, 1]})
        self._draw_ranges(range_ax, finfo_table())
        self._draw_bits(bits_ax, self.representations())
        fig.suptitle(f"{_g(self.value, 10)} in float32, float16 and bfloat16")
        return fig

    def _draw_ranges(self, ax: Axes, rows: list[FinfoRow]) -> None:
        """Each dtype's subnormal and normal range as bars, with the value and product marked."""
        for y, row in enumerate(reversed(rows)):
            lo_sub, lo, hi = (
                math.log10(row.smallest_subnormal),
                math.log10(row.tiny),
                math.log10(row.max),
            )
            ax.barh(y, lo - lo_sub, left=lo_sub, color="#BBBBBB", height=0.5)
            ax.barh(y, hi - lo, left=lo, color="#0072B2", height=0.5)
            ax.text(hi + 1, y, f"max {_g(row.max, 5)}", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r.dtype for r in reversed(rows)])
        ax.set_xlabel("log10 |x|   (grey: subnormal, blue: normal numbers)")
        for label, x, color, side in (
            ("value", self.value, "#D55E00", "right"),
            (f"value x {_g(self.factor)}", self.value * self.factor, "#009E73", "left"),
        ):
            if x != 0 and math.isfinite(x):
                where = math.log10(abs(x))
                ax.axvline(where, color=color, linestyle="--", linewidth=1.2)
                nudge = -0.6 if side == "right" else 0.6
                ax.text(
                    where + nudge,
                    len(rows) - 0.4,
                    f"{label} = {_g(x)}",
                    color=color,
                    fontsize=8,
                    ha=side,
                )
        ax.set_xlim(-50, 58)
        ax.set_ylim(-0.6, len(rows) - 0.05)
        ax.set_title("Dynamic range from torch.finfo", fontsize=10)

    def _draw_bits(self, ax: Axes, reps: dict[str, Representation]) -> None:
        """One row of coloured bits (sign, exponent, mantissa) per dtype, and what it stores."""
        from matplotlib.patches import Rectangle

        for y, rep in enumerate(reversed(list(reps.values()))):
            x = 0.0
            for field, bits in (
                ("sign", rep.sign),
                ("exponent", rep.exponent),
                ("mantissa", rep.mantissa),
            ):
                for bit in bits:
                    ax.add_patch(
                        Rectangle(
                            (x, y), 0.95, 0.8, facecolor=FIELD_COLORS[field], edgecolor="white"
                        )
                    )
                    ax.text(x + 0.47, y + 0.4, bit, ha="center", va="center", fontsize=7)
                    x += 1
            ax.text(
                33, y + 0.4, f"stores {_g(rep.stored, 8)}  ({rep.flag})", va="center", fontsize=8
            )
        ax.set_xlim(-0.5, 48)
        ax.set_ylim(-0.3, len(reps) + 0.1)
        ax.set_yticks([y + 0.4 for y in range(len(reps))])
        ax.set_yticklabels(list(reversed(list(reps))))
        ax.set_xticks([])
        ax.set_frame_on(False)
        ax.tick_params(length=0)
        for k, (field, color) in enumerate(FIELD_COLORS.items()):
            ax.add_patch(Rectangle((34 + 4.5 * k, len(reps) - 0.25), 0.9, 0.3, facecolor=color))
            ax.text(35.1 + 4.5 * k, len(reps) - 0.1, field, va="center", fontsize=7)
        ax.set_title(f"Bits of {_g(self.value, 10)} (sign | exponent | mantissa)", fontsize=10)

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        self._link_control("value", w.FloatText(description="value"))
        self._link_control("factor", w.FloatText(description="x factor"))
        return w.VBox([w.HBox(list(self._controls.values())), self._html_output()])

    def _html_view(self) -> str:
        head = ("dtype", "stored", "abs err", "rel err", "flag", "bits: sign | exponent | mantissa")

        def dtype_table(reps: dict[str, Representation]) -> str:
            body = []
            for r in reps.values():
                color = "#D55E00" if r.flag != "ok" else "inherit"
                bits = (
                    f'<span style="background:{FIELD_COLORS["sign"]}">{r.sign}</span>'
                    f'<span style="background:{FIELD_COLORS["exponent"]}">{r.exponent}</span>'
                    f'<span style="background:{FIELD_COLORS["mantissa"]}">{r.mantissa}</span>'
                )
                body.append(
                    f'<tr class="nb-dist-dtype-row" data-dtype="{r.dtype}"><td>{r.dtype}</td>'
                    f"<td>{_g(r.stored, 8)}</td><td>{_g(r.abs_error, 3)}</td>"
                    f'<td>{_g(r.rel_error, 3)}</td><td style="color:{color}">{r.flag}</td>'
                    f"<td>{bits}</td></tr>"
                )
            return table(head, body)

        return (
            f"<div style='{MONOSPACE}'>"
            f"<b>{_g(self.value, 10)} stored as</b>{dtype_table(self.representations())}"
            f"<b>{_g(self.value, 10)} x {_g(self.factor, 10)} computed in</b>"
            f"{dtype_table(self.products())}<b>torch.finfo</b><pre>"
            f"{escape(format_finfo_table())}</pre></div>"
        )
