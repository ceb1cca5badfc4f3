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
:class:`LossScaleView` draws a GradScaler's scale trace recorded in a real run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traitlets import CFloat, List, observe, validate

from ._display import SettingValueError, _new_figure, _StaticView, _WidgetView

if TYPE_CHECKING:
    from ipywidgets import VBox
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch

__all__ = [
    "FinfoRow",
    "LossScaleView",
    "PrecisionExplorer",
    "Representation",
    "finfo_table",
    "represent",
    "scaler_step",
]

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


def _g(x: float, digits: int = 5) -> str:
    """Stable short number formatting: ``65504``, ``3.4028e+38``, ``inf``, ``nan``."""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.{digits}g}"


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
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
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

    value = CFloat(65000.0, help="the value to store")
    factor = CFloat(2.0, help="also compute value * factor in each dtype")

    def __init__(self, value: float = 65000.0, factor: float = 2.0) -> None:
        super().__init__(value=value, factor=factor)

    @observe("value", "factor")
    def _refresh(self, _change: Bunch | None = None) -> None:
        if self._widget is not None:
            self._html.value = self._html_view()

    # ---- model ------------------------------------------------------------------------------

    def update(self, **changes: float) -> PrecisionExplorer:
        """Change ``value`` and/or ``factor``; the controls follow."""
        self._update(changes, ("value", "factor"))
        return self

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
            out[name] = Representation(
                dtype=name,
                value=exact,
                stored=product,
                abs_error=abs_error,
                rel_error=rel_error,
                overflow=math.isfinite(exact) and math.isinf(product),
                underflow=exact != 0 and product == 0,
                subnormal=base.subnormal,
                sign=base.sign,
                exponent=base.exponent,
                mantissa=base.mantissa,
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
                "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
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
        self._html = w.HTML(value=self._html_view())
        self._html.add_class(f"{self._css_class}-output")
        return w.VBox([w.HBox(list(self._controls.values())), self._html])

    def _html_view(self) -> str:
        import html

        def table(reps: dict[str, Representation]) -> str:
            head = "".join(
                f"<th>{h}</th>"
                for h in (
                    "dtype",
                    "stored",
                    "abs err",
                    "rel err",
                    "flag",
                    "bits: sign | exponent | mantissa",
                )
            )
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
            return f"<table><tr>{head}</tr>{''.join(body)}</table>"

        return (
            "<div style='font-family:monospace;font-size:12px'>"
            f"<b>{_g(self.value, 10)} stored as</b>{table(self.representations())}"
            f"<b>{_g(self.value, 10)} x {_g(self.factor, 10)} computed in</b>"
            f"{table(self.products())}<b>torch.finfo</b><pre>"
            f"{html.escape(format_finfo_table())}</pre></div>"
        )


# --------------------------------------------------------------------------------------------
# Loss scaling: a GradScaler's scale over training steps.
# --------------------------------------------------------------------------------------------


def scaler_step(scaler: Any, optimizer: Any) -> tuple[float, bool]:
    """``scaler.step(optimizer)`` then ``scaler.update()``; return ``(scale used, skipped)``.

    GradScaler skips the optimizer step when the scaled gradients contain inf/NaN and then
    multiplies the scale by ``backoff_factor`` (< 1), so a step was skipped exactly when the
    scale went down. Append ``(step, *scaler_step(scaler, opt))`` to a list to build the trace
    :class:`LossScaleView` draws.
    """
    scale = float(scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()
    return scale, float(scaler.get_scale()) < scale


def _as_trace(trace: Iterable[Sequence[Any]]) -> list[tuple[int, float, bool]]:
    return [(int(s), float(scale), bool(skipped)) for s, scale, skipped in trace]


def _as_loss_points(trace: Iterable[Any] | None) -> list[tuple[int, float]]:
    if trace is None:
        return []
    points = []
    for k, item in enumerate(trace):
        if isinstance(item, (tuple, list)):
            points.append((int(item[0]), float(item[1])))
        else:
            points.append((k, float(item)))
    return points


class LossScaleView(_StaticView):
    """A GradScaler's scale over steps, with the skipped (overflow) steps marked.

    Args:
        trace: ``[(step, scale, skipped), ...]`` recorded from a real ``torch.amp.GradScaler``
            run (see :func:`scaler_step`); ``scale`` is the scale used in that step.
        bf16_loss: optional bf16 loss trace of the same model *without* a scaler, either
            ``[loss, ...]`` or ``[(step, loss), ...]``, drawn next to it.
        fp16_loss: optional loss trace of the fp16 + GradScaler run, same formats.
    """

    trace: List[tuple[int, float, bool]] = List(help="[(step, scale, skipped), ...]")
    bf16_loss: List[tuple[int, float]] = List(help="[(step, loss), ...], bf16 without scaler")
    fp16_loss: List[tuple[int, float]] = List(help="[(step, loss), ...], fp16 + GradScaler")

    def __init__(
        self,
        trace: Iterable[Sequence[Any]],
        bf16_loss: Iterable[Any] | None = None,
        fp16_loss: Iterable[Any] | None = None,
    ) -> None:
        super().__init__()
        self.trace = _as_trace(trace)
        self.bf16_loss = _as_loss_points(bf16_loss)
        self.fp16_loss = _as_loss_points(fp16_loss)

    @validate("trace")
    def _check_trace(self, proposal: Bunch) -> list[tuple[int, float, bool]]:
        trace = _as_trace(proposal.value)
        if not trace:
            raise SettingValueError(
                "trace is empty: record at least one (step, scale, skipped) tuple"
            )
        return trace

    @validate("bf16_loss", "fp16_loss")
    def _loss_points(self, proposal: Bunch) -> list[tuple[int, float]]:
        return _as_loss_points(proposal.value)

    def skipped_steps(self) -> list[int]:
        """Steps whose optimizer update GradScaler skipped because gradients overflowed."""
        return [s for s, _scale, skipped in self.trace if skipped]

    @property
    def final_scale(self) -> float:
        return self.trace[-1][1]

    def early_rise(self, name: str = "fp16") -> tuple[int, float] | None:
        """``(step, loss)`` of the peak if the loss first *rises* above its first value.

        Only the first quarter of the steps is searched, and only a peak 10% above the first
        loss counts. A per-batch loss often does this when the first steps meet harder batches
        than the first one; the figure marks it so that it is explained, not overlooked.
        """
        points = self.fp16_loss if name == "fp16" else self.bf16_loss
        if len(points) < 4:
            return None
        head = points[: max(2, len(points) // 4)]
        step, peak = max(head, key=lambda point: point[1])
        return (step, peak) if peak > 1.1 * points[0][1] and step > points[0][0] else None

    def summary(self) -> str:
        skipped = self.skipped_steps()
        first, last = self.trace[0][1], self.trace[-1][1]
        lines = [
            f"LossScaleView(steps={len(self.trace)}, skipped={len(skipped)}, "
            f"initial_scale={_g(first, 8)}, final_scale={_g(last, 8)})",
            "skipped steps (inf/NaN gradients, scale backed off): "
            + (
                ", ".join(str(s) for s in skipped[:20]) + (" ..." if len(skipped) > 20 else "")
                if skipped
                else "none"
            ),
        ]
        for name, points in (
            ("fp16 + GradScaler", self.fp16_loss),
            ("bf16, no scaler", self.bf16_loss),
        ):
            if points:
                lines.append(
                    f"{name} loss: {_g(points[0][1], 4)} -> {_g(points[-1][1], 4)} "
                    f"over {len(points)} steps"
                )
        rise = self.early_rise("fp16" if self.fp16_loss else "bf16")
        if rise:
            lines.append(
                f"early rise: the loss goes up to {_g(rise[1], 4)} at step {rise[0]}, then falls"
            )
        return "\n".join(lines)

    def figure(self) -> Figure:
        """Left: scale per step on a log axis, skipped steps as red crosses. Right: the losses."""
        has_loss = bool(self.bf16_loss or self.fp16_loss)
        fig = _new_figure(11.0 if has_loss else 6.5, 3.8)
        axes = fig.subplots(1, 2 if has_loss else 1, squeeze=False)[0]
        skipped = [(s, c) for s, c, k in self.trace if k]
        self._draw_scale(axes[0], skipped)
        if has_loss:
            self._draw_losses(axes[1], [s for s, _c in skipped])
        fig.suptitle("Loss scaling with torch.amp.GradScaler")
        return fig

    def _draw_scale(self, ax: Axes, skipped: list[tuple[int, float]]) -> None:
        """The scale per step (log2 axis), the ``skipped`` ``(step, scale)`` as red crosses."""
        from matplotlib.ticker import MaxNLocator

        steps = [s for s, _c, _k in self.trace]
        scales = [c for _s, c, _k in self.trace]
        ax.step(steps, scales, where="post", color="#0072B2", label="scale")
        if skipped:
            ax.scatter(
                [s for s, _ in skipped],
                [c for _, c in skipped],
                marker="x",
                s=50,
                color="#D55E00",
                zorder=3,
                label="skipped step (overflow)",
            )
        ax.set_yscale("log", base=2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale")
        ax.legend(fontsize=8)
        ax.set_title(
            f"GradScaler scale: {len(skipped)} skipped, final {_g(self.final_scale)}", fontsize=10
        )

    def _draw_losses(self, ax: Axes, skipped_steps: list[int]) -> None:
        """The fp16 and bf16 loss curves, the skipped steps and an early rise, if any."""
        from matplotlib.ticker import MaxNLocator

        for name, points, color in (
            ("fp16 + GradScaler", self.fp16_loss, "#0072B2"),
            ("bf16, no scaler", self.bf16_loss, "#009E73"),
        ):
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], color=color, label=name)
        for k, s in enumerate(skipped_steps):
            ax.axvline(
                s,
                color="#D55E00",
                linestyle=":",
                linewidth=1,
                label="skipped step" if k == 0 else None,
            )
        values = [v for points in (self.fp16_loss, self.bf16_loss) for _s, v in points]
        # A loss that falls by orders of magnitude reads better on a log axis.
        log = min(values) > 0 and max(values) / min(values) > 20
        if log:
            ax.set_yscale("log")
        rise = self.early_rise("fp16" if self.fp16_loss else "bf16")
        if rise:
            ax.annotate(
                f"early rise (step {rise[0]})",
                xy=rise,
                xytext=(0.35, 0.85),
                textcoords="axes fraction",
                fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "#444444"},
            )
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("loss (log scale)" if log else "loss")
        ax.legend(fontsize=8)
        ax.set_title("Loss per step (each step's own batch)", fontsize=10)
