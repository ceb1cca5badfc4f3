"""The live launch monitor: one row per rank with status, time, progress, last output and curves.

``notebook_launcher(..., monitor=True)`` shows it in the launching cell. It is fed by the
launcher's loop in the cell's own thread (no background thread touches a widget), and it only
adds to the labelled text output: where no frontend renders widgets (a script, nbconvert,
nbval) the text output is all there is, and the monitor's ``text/plain`` is a fixed line.
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any, ClassVar

from ..views._display import _kernel_is_running, _new_figure, _WidgetView, figure_png
from ..views.colors import rank_color

if TYPE_CHECKING:
    from ipywidgets import HTML, FloatProgress, VBox

    from ._errors import RankOutcome

__all__ = ["LaunchMonitor", "kernel_frontend_possible"]

#: True in a Jupyter kernel, where a frontend may render widgets (the views' own check).
kernel_frontend_possible = _kernel_is_running

_STATUS_COLORS = {
    "starting": "#888888",
    "running": "#0072B2",
    "done": "#009E73",
    "failed": "#D55E00",
    "stopped": "#CC79A7",
    "paused": "#E69F00",
}
_REFRESH_EVERY = 0.25  # seconds between widget refreshes
_PLOT_EVERY = 1.0  # seconds between redraws of the curves
_TAIL_LINES = 4


def _status_word(outcome_status: str) -> str:
    return {"ok": "done", "collateral": "failed", "running": "running"}.get(
        outcome_status, outcome_status
    )


class LaunchMonitor(_WidgetView):
    """A per-rank dashboard of a running launch (an ipywidgets ``VBox`` in ``.widget``).

    Its state is plain lists, fed by the observer hooks many times a second and drawn at most
    every ``_REFRESH_EVERY`` seconds by :meth:`refresh`: not traits, whose every change would
    notify. The launcher displays it only in a kernel, so its bundle always has the widget.
    """

    _css_class = "nb-dist-monitor"
    _container_classes = ()
    _rich_outside_kernel: ClassVar[bool] = True

    def __init__(self, ranks: list[int]) -> None:
        super().__init__()
        self.ranks = ranks
        self.status = ["starting"] * len(ranks)
        self.started_at = [time.monotonic()] * len(ranks)  # not `started`: that is a hook
        self.ended: list[float | None] = [None] * len(ranks)
        self.tails: list[list[str]] = [[] for _ in ranks]
        self.errors: list[str] = [""] * len(ranks)
        self.progress_state: list[tuple[str, int, int | None] | None] = [None] * len(ranks)
        self.scalars: dict[str, dict[int, tuple[list[int], list[float]]]] = {}
        self._dirty = True
        self._plot_dirty = False
        self._last_refresh = 0.0
        self._last_plot = 0.0

        _ = self.widget  # built now: the hooks update its rows
        self.refresh(force=True)

    def _build_widget(self) -> VBox:
        import ipywidgets as widgets

        self._rows: list[tuple[VBox, HTML, FloatProgress, HTML]] = []
        for local, rank in enumerate(self.ranks):
            label = widgets.HTML(
                f'<b style="color:{rank_color(rank)}">rank {rank}</b>',
                layout=widgets.Layout(width="70px"),
            )
            state = widgets.HTML(layout=widgets.Layout(width="260px"))
            bar = widgets.FloatProgress(
                value=0.0,
                min=0.0,
                max=1.0,
                layout=widgets.Layout(width="180px", visibility="hidden"),
            )
            tail = widgets.HTML(layout=widgets.Layout(width="100%"))
            row = widgets.VBox([widgets.HBox([label, state, bar]), tail])
            row.add_class("nb-dist-monitor-rank")
            row.add_class(f"nb-dist-monitor-rank-{rank}")
            self._rows.append((row, state, bar, tail))
            self._set_state_class(local)
        # flex-start: at its own size; a VBox stretches children to its width (blurry plot).
        self._plot = widgets.Image(
            format="png",
            layout=widgets.Layout(display="none", align_self="flex-start", max_width="100%"),
        )
        self._plot.add_class("nb-dist-monitor-plot")
        self._title = widgets.HTML(f"<b>nb_dist launch</b>: {len(self.ranks)} ranks")
        return widgets.VBox([self._title, *(r[0] for r in self._rows), self._plot])

    # ------------------------------------------------------------- observer hooks
    def started(self, index: int) -> None:
        self.status[index] = "running"
        self.started_at[index] = time.monotonic()
        self._dirty = True

    def paused(self, index: int, paused: bool) -> None:
        """A rank stopped in the debugger (``nb_dist.breakpoint``), or went on."""
        self.status[index] = "paused" if paused else "running"
        self._dirty = True
        self.refresh(force=True)  # the loop waits for the notebook now: draw it before

    def lines(self, index: int, stream: str, lines: list[str]) -> None:
        tail = self.tails[index]
        tail.extend(lines)
        del tail[:-_TAIL_LINES]
        self._dirty = True

    def reports(self, index: int, entries: list[tuple[str, Any]]) -> None:
        rank = self.ranks[index]
        for name, (step, value) in entries:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = self.scalars.setdefault(name, {}).setdefault(rank, ([], []))
                steps.append(step)
                values.append(float(value))
                self._plot_dirty = True

    def progress(self, index: int, key: str, count: int, total: int | None) -> None:
        self.progress_state[index] = (key, count, total)
        self._dirty = True

    def finished(self, index: int, outcome: RankOutcome) -> None:
        self.status[index] = _status_word(outcome.status)
        self.ended[index] = time.monotonic()
        if outcome.status in ("failed", "collateral"):
            what = f"{outcome.exc_type}: {outcome.message}" if outcome.exc_type else outcome.message
            self.errors[index] = what or "failed"
        self._dirty = True

    def tick(self) -> None:
        self.refresh()

    def close(self, outcomes: list[RankOutcome] | None = None, interrupted: bool = False) -> None:
        """Final state: every rank's outcome (collateral failures relabelled by now)."""
        for local, outcome in enumerate(outcomes or []):
            self.finished(local, outcome)
        for local, status in enumerate(self.status):
            if status in ("starting", "running"):
                self.status[local] = "stopped" if interrupted else status
        self.refresh(force=True)

    # ------------------------------------------------------------- rendering
    def summary(self) -> str:
        return f"LaunchMonitor({len(self.ranks)} ranks)"

    def _set_state_class(self, local: int) -> None:
        row = self._rows[local][0]
        for status in _STATUS_COLORS:
            row.remove_class(f"nb-dist-status-{status}")
        row.add_class(f"nb-dist-status-{self.status[local]}")

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._dirty and (force or now - self._last_refresh >= _REFRESH_EVERY):
            self._last_refresh = now
            # The clocks of live ranks tick.
            self._dirty = any(s in ("starting", "running", "paused") for s in self.status)
            for local in range(len(self.ranks)):
                self._render_rank(local, now)
        if self._plot_dirty and (force or now - self._last_plot >= _PLOT_EVERY):
            self._last_plot = now
            self._plot_dirty = False
            self._render_plot()

    def _render_rank(self, local: int, now: float) -> None:
        _, state, bar, tail = self._rows[local]
        status = self.status[local]
        end = self.ended[local] or now
        elapsed = max(0.0, end - self.started_at[local])
        color = _STATUS_COLORS.get(status, "#888888")
        text = f'<span style="color:{color}"><b>{status}</b></span> · {elapsed:.1f} s'
        progress = self.progress_state[local]
        if progress is not None:
            key, count, total = progress
            shown = f"{count}/{total}" if total else str(count)
            text += f" · {html.escape(key)} {shown}"
            if total:
                bar.value = min(1.0, count / total)
                bar.layout.visibility = "visible"
        state.value = text
        lines = list(self.tails[local])
        if self.errors[local]:
            lines.append(f"⚠ {self.errors[local]}")
        body = html.escape("\n".join(lines))
        tail.value = f'<pre style="margin:0 0 4px 70px;font-size:11px;line-height:1.3">{body}</pre>'
        self._set_state_class(local)

    def _render_plot(self) -> None:
        names = sorted(self.scalars)[:3]
        if not names:
            return
        fig = _new_figure(4.2 * len(names), 2.6)
        for index, name in enumerate(names):
            ax = fig.add_subplot(1, len(names), index + 1)
            for rank, (steps, values) in sorted(self.scalars[name].items()):
                ax.plot(steps, values, color=rank_color(rank), label=f"rank {rank}", lw=1.5)
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
        self._plot.value = figure_png(fig, dpi=80)
        self._plot.layout.display = None


def open_monitor(ranks: list[int]) -> LaunchMonitor | None:
    """Display the live monitor in the cell, where a frontend may render it; else nothing."""
    if not kernel_frontend_possible():
        return None
    import IPython.display

    view = LaunchMonitor(ranks)
    show: Any = IPython.display.display  # untyped in IPython
    show(view)
    return view
