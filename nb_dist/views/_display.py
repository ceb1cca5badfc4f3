"""The display protocol every view shares: text first, a widget or figure where a frontend is."""

from __future__ import annotations

import io
from typing import Any


def _kernel_is_running() -> bool:
    """True inside a Jupyter kernel (where a frontend may render widgets), else False."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with ipykernel
        return False
    shell = get_ipython()
    return getattr(shell, "kernel", None) is not None


class _View:
    """Text-first display: ``repr(view)`` is the deterministic summary of what the view shows.

    Subclasses implement :meth:`summary` and :meth:`figure`; ``_rich_bundle`` adds what a live
    frontend can show on top of the text (a widget or a PNG).
    """

    def summary(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def figure(self, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.summary()

    def _rich_bundle(self) -> dict[str, Any]:
        return {}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any):
        """``text/plain`` is always the summary; frontends also get the widget or figure."""
        data: dict[str, Any] = {"text/plain": self.summary()}
        if _kernel_is_running():
            data.update(self._rich_bundle())
        return data


class _WidgetView(_View):
    """A view with an ipywidgets ``widget`` (built on first use) and a ``controls`` dict."""

    _css_class = "nb-dist-view"

    def __init__(self) -> None:
        self._widget: Any = None
        self._controls: dict[str, Any] = {}

    @property
    def widget(self) -> Any:
        """The ipywidgets container (a ``VBox``); built the first time it is asked for."""
        if self._widget is None:
            self._widget = self._build_widget()
            self._widget.add_class("nb-dist-view")
            self._widget.add_class(self._css_class)
        return self._widget

    @property
    def controls(self) -> dict[str, Any]:
        """The widget's controls by name; setting ``controls[name].value`` updates the view."""
        _ = self.widget
        return self._controls

    def _build_widget(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _add_control(self, name: str, control: Any) -> Any:
        """Register ``control`` under ``name`` with stable CSS classes for browser tests."""
        control.add_class("nb-dist-control")
        control.add_class(f"{self._css_class}-{name.replace('_', '-')}")
        self._controls[name] = control
        return control

    def _rich_bundle(self) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_() or {}
        key = "application/vnd.jupyter.widget-view+json"
        return {key: bundle[key]} if key in bundle else {}


class _StaticView(_View):
    """A view without controls: text summary plus, in a kernel, the figure as a PNG."""

    def _rich_bundle(self) -> dict[str, Any]:
        return {"image/png": figure_png(self.figure())}


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """Render a matplotlib ``Figure`` with Agg and return the PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def _new_figure(width: float, height: float) -> Any:
    """A ``matplotlib.figure.Figure`` on an Agg canvas (no pyplot, so nothing pops up)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _short_list(items: list[str], limit: int = 24) -> str:
    if len(items) <= limit:
        return "[" + ", ".join(items) + "]"
    return "[" + ", ".join(items[:limit]) + f", ... (+{len(items) - limit} more)]"
