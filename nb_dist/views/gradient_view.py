"""Gradients before and after DDP's all-reduce, per rank, from a real launch's reports.

Each rank computes gradients on its own shard, so before synchronisation they differ. DDP's
backward all-reduces them and divides by the world size: afterwards every rank holds the same
gradient, the mean of the local ones. :class:`GradientView` shows both as heatmaps per rank,
with the largest difference across ranks written on each, and checks the mean.

It also shows *divergence over steps* for a reported tensor (for example the weights under
``no_sync()`` / gradient accumulation): ranks drift apart on non-synchronising steps and agree
again on the step that synchronises.

The rank side is two lines, e.g. in a DDP loop::

    with ddp.no_sync():                    # local gradients only
        loss.backward()
    nb_dist.report("grad/local", ddp.module.fc.weight.grad)
    ...                                    # zero the grads, backward without no_sync()
    nb_dist.report("grad/synced", ddp.module.fc.weight.grad)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from traitlets import Int, Unicode, observe, validate

from ._display import SettingValueError, _new_figure, _WidgetView, figure_png

if TYPE_CHECKING:
    from ipywidgets import VBox
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch
from .colors import rank_color

__all__ = ["GradientView"]


def _as_2d(value: Any) -> Any:
    import torch

    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.dim() == 0:
        return tensor.reshape(1, 1)
    if tensor.dim() == 1:
        return tensor.reshape(1, -1)
    return tensor.reshape(tensor.shape[0], -1)


def _at_step(series: Mapping[int, list[Any]], step: int | None) -> dict[int, Any]:
    """``{rank: value}`` at ``step`` (``None``: each rank's last reported step)."""
    chosen = {}
    for rank, entries in sorted(series.items()):
        for entry_step, value in entries:
            if step is None or entry_step == step:
                chosen[rank] = value
    return chosen


def _max_spread(values: dict[int, Any]) -> float:
    """The largest absolute difference between any two ranks' tensors, element-wise."""
    import torch

    stacked = torch.stack([_as_2d(v) for v in values.values()])
    return float((stacked.max(dim=0).values - stacked.min(dim=0).values).abs().max())


class GradientView(_WidgetView):
    """Per-rank gradients before (``local``) and after (``synced``) synchronisation.

    Args:
        reports: ``result.reports`` of a launch (``reports[name][rank]`` → ``[(step, value)]``).
        local: report name of the gradients before synchronisation.
        synced: report name of the gradients after synchronisation.
        step: which reported step to show (``None``: the last one).
    """

    _css_class = "nb-dist-gradient-view"

    local_name = Unicode("grad/local", help="report name of the gradients before the sync")
    synced_name = Unicode("grad/synced", help="report name of the gradients after the sync")
    step = Int(None, allow_none=True, help="the reported step shown (None: the last)")

    def __init__(
        self,
        reports: Mapping[str, Mapping[int, list[Any]]],
        local: str = "grad/local",
        synced: str = "grad/synced",
        step: int | None = None,
    ) -> None:
        super().__init__()
        self.reports = reports  # first: the checks look names and steps up in it
        self.local_name = local  # one by one, so that a default name is checked too
        self.synced_name = synced
        self.step = step

    @validate("local_name", "synced_name")
    def _check_name(self, proposal: Bunch) -> str:
        name: str = proposal.value
        if name not in self.reports:
            known = ", ".join(repr(n) for n in sorted(self.reports)) or "none"
            raise KeyError(
                f"GradientView: no reports named {name!r} (reported names: {known}). "
                f"Report them in the launched function with nb_dist.report({name!r}, grad)."
            )
        return name

    @validate("step")
    def _check_step(self, proposal: Bunch) -> int | None:
        step: int | None = proposal.value
        if step is not None and step not in self.steps():
            raise SettingValueError(
                f"step={step!r} is not a reported step of {self.local_name!r}; the reported "
                f"steps are {self.steps()} (step=None shows the last)"
            )
        return step

    @observe("step")
    def _refresh(self, _change: Bunch | None = None) -> None:
        if self._widget is not None:
            self._image.value = figure_png(self.figure())
            self._text.value = f"<pre>{self.summary()}</pre>"

    # ------------------------------------------------------------- model
    def steps(self) -> list[int]:
        return sorted({s for entries in self.reports[self.local_name].values() for s, _ in entries})

    def local(self) -> dict[int, Any]:
        return _at_step(self.reports[self.local_name], self.step)

    def synced(self) -> dict[int, Any]:
        return _at_step(self.reports[self.synced_name], self.step)

    def spread_before(self) -> float:
        return _max_spread(self.local())

    def spread_after(self) -> float:
        return _max_spread(self.synced())

    def mean_error(self) -> float:
        """How far the synchronised gradient is from the mean of the local ones (≈ 0)."""
        import torch

        local = torch.stack([_as_2d(v) for v in self.local().values()]).mean(dim=0)
        synced = torch.stack([_as_2d(v) for v in self.synced().values()])
        return float((synced - local).abs().max())

    def summary(self) -> str:
        shown = "last step" if self.step is None else f"step {self.step}"
        lines = [f"GradientView({self.local_name!r} -> {self.synced_name!r}, {shown})"]
        for rank, value in self.local().items():
            lines.append(f"rank {rank}: local gradient norm {float(_as_2d(value).norm()):.4g}")
        lines.append(f"max difference across ranks before sync: {self.spread_before():.3g}")
        lines.append(f"max difference across ranks after sync:  {self.spread_after():.3g}")
        lines.append(f"synced gradient vs mean of local ones:   {self.mean_error():.3g}")
        return "\n".join(lines)

    # ------------------------------------------------------------- divergence
    def divergence(self, name: str) -> list[tuple[int, float]]:
        """Per step, the largest difference of ``name`` across ranks (0 = ranks agree)."""
        if name not in self.reports:
            known = ", ".join(repr(n) for n in sorted(self.reports)) or "none"
            raise KeyError(
                f"GradientView.divergence: no reports named {name!r} (reported names: {known})."
            )
        series = self.reports[name]
        steps = sorted({s for entries in series.values() for s, _ in entries})
        return [(step, _max_spread(_at_step(series, step))) for step in steps]

    def divergence_figure(self, name: str, sync_every: int | None = None) -> Figure:
        """Line of :meth:`divergence` over steps; synchronising steps marked if known."""
        data = self.divergence(name)
        fig = _new_figure(6.0, 2.8)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([s for s, _ in data], [d for _, d in data], marker="o", color=rank_color(4))
        if sync_every:
            for step, _ in data:
                if (step + 1) % sync_every == 0:
                    ax.axvline(step, color="#999999", lw=0.8, ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel("max difference across ranks")
        ax.set_title(f"{name}: ranks drift apart, then synchronise")
        return fig

    # ------------------------------------------------------------- drawing
    def figure(self) -> Figure:
        local, synced = self.local(), self.synced()
        ranks = list(local)
        fig = _new_figure(6.5, 1.2 + 1.6 * len(ranks))
        grid = fig.add_gridspec(len(ranks), 2)
        everything = [_as_2d(v) for v in [*local.values(), *synced.values()]]
        low = min(float(t.min()) for t in everything)
        high = max(float(t.max()) for t in everything)
        image = None
        for row, rank in enumerate(ranks):
            for col, (title, values) in enumerate((("local", local), ("after all-reduce", synced))):
                ax = fig.add_subplot(grid[row, col])
                image = ax.imshow(
                    _as_2d(values[rank]).numpy(), cmap="coolwarm", vmin=low, vmax=high
                )
                ax.set_xticks([])
                ax.set_yticks([])
                if col == 0:
                    ax.set_ylabel(f"rank {rank}", color=rank_color(rank), fontweight="bold")
                if row == 0:
                    ax.set_title(title)
        if image is not None:
            fig.colorbar(image, ax=fig.axes, shrink=0.8)
        fig.suptitle(
            f"max diff across ranks: before {self.spread_before():.3g}, "
            f"after {self.spread_after():.3g}"
        )
        return fig

    def _build_widget(self) -> VBox:
        import ipywidgets as widgets

        if self.step is None:  # the slider shows a step: the last one
            self.step = self.steps()[-1]
        slider = self._link_control(
            "step", widgets.SelectionSlider(options=self.steps(), description="step")
        )
        self._image = widgets.Image(
            format="png",
            value=figure_png(self.figure()),
            # at its own size: a VBox stretches children to its width (a blurry plot)
            layout=widgets.Layout(align_self="flex-start", max_width="100%"),
        )
        self._image.add_class(f"{self._css_class}-output")
        self._text = widgets.HTML(f"<pre>{self.summary()}</pre>")
        return widgets.VBox([slider, self._image, self._text])
