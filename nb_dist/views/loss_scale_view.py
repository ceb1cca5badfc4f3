"""Loss scaling: a ``torch.amp.GradScaler``'s scale over training steps, and what it skipped.

fp16's smallest numbers are far above the gradients a model often has (see
:class:`~nb_dist.views.precision_explorer.PrecisionExplorer`), so a GradScaler multiplies the
loss by a large scale before ``backward()``. When the scaled gradients overflow to inf/NaN it
skips that optimizer step and halves the scale; after enough good steps it grows the scale
again. :func:`scaler_step` records one step of a real scaler; :class:`LossScaleView` draws
the trace (and, next to it, the loss of the same model in bf16 without a scaler).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from traitlets import List, validate

from ._display import SettingValueError, _g, _new_figure, _StaticView

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch

__all__ = ["LossScaleView", "scaler_step"]


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
