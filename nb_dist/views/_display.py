"""What every view and the launch monitor share: traitlets state, text first, a widget on demand.

A view is a ``traitlets.HasTraits`` object: its settings are traits (with defaults and
``@validate`` checks), its rendering follows them with ``@observe``, and its widget's controls
are linked to them (``traitlets.link``), so nothing syncs a control by hand. ``repr(view)`` is the
deterministic text summary; a Jupyter kernel also gets the widget (or a PNG of the figure).
"""

from __future__ import annotations

import io
import math
import sys
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from traitlets import HasTraits, Int, TraitError, link

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ipywidgets import HTML, DOMWidget, VBox
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch


def _kernel_is_running() -> bool:
    """True inside a Jupyter kernel (where a frontend may render widgets), else False. Never
    imports IPython: a process running a kernel has imported it already."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None:
        return False
    InteractiveShell = shell_module.InteractiveShell
    if not InteractiveShell.initialized():  # what IPython.get_ipython() checks
        return False
    return getattr(InteractiveShell.instance(), "kernel", None) is not None


# ---- settings: traits whose errors name the parameter, its value and the fix -------------------


class SettingTypeError(TraitError, TypeError):
    """A view setting of the wrong type (a ``TypeError``, and a ``TraitError`` for traitlets)."""


class SettingValueError(TraitError, ValueError):
    """A view setting out of range (a ``ValueError``, and a ``TraitError`` for traitlets)."""


# traitlets 5.9 made its traits generic (``Int[int, int]``); 5.7, which Colab and Kaggle ship,
# cannot subscript them. The type checker sees the generic, the interpreter the plain class.
if TYPE_CHECKING:
    _IntTrait = Int[int, int]
else:
    _IntTrait = Int


class StrictInt(_IntTrait):
    """An ``Int`` trait that refuses bools and floats, saying which setting and how to fix it."""

    def validate(self, obj: Any, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingTypeError(
                f"{self.name}={value!r} must be an int (for example {self.name}=2)"
            )
        return value


def at_least(proposal: Bunch, minimum: int) -> int:
    """The body of a ``@validate`` handler: ``proposal.value`` if it is ``>= minimum``."""
    value: int = proposal.value
    if value < minimum:
        raise SettingValueError(f"{proposal.trait.name}={value!r} must be >= {minimum}")
    return value


def one_of(proposal: Bunch, choices: tuple[str, ...]) -> str:
    """The body of a ``@validate`` handler: ``proposal.value`` if it is one of ``choices``."""
    value: str = proposal.value
    if value not in choices:
        names = ", ".join(repr(c) for c in choices)
        raise SettingValueError(f"{proposal.trait.name}={value!r} must be one of {names}")
    return value


def between(proposal: Bunch, low: int, high: int) -> int:
    """The body of a ``@validate`` handler: ``proposal.value`` if ``low <= value <= high``."""
    value: int = proposal.value
    if not low <= value <= high:
        raise SettingValueError(f"{proposal.trait.name}={value!r} must be between {low} and {high}")
    return value


# ---- the views -----------------------------------------------------------------------------


class _View(HasTraits):
    """Text-first display: ``repr(view)`` is the deterministic summary of what the view shows.

    Subclasses implement :meth:`summary`; ``_rich_bundle`` adds what a live frontend can show on
    top of the text (a widget or a PNG), outside a kernel only when ``_rich_outside_kernel``.
    """

    _rich_outside_kernel: ClassVar[bool] = False

    def summary(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.summary()

    def _rich_bundle(self) -> dict[str, Any]:
        return {}

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """``text/plain`` is always the summary; frontends also get the widget or figure."""
        data: dict[str, Any] = {"text/plain": self.summary()}
        if self._rich_outside_kernel or _kernel_is_running():
            data.update(self._rich_bundle())
        return data

    def _update(self, changes: Mapping[str, Any], settings: tuple[str, ...]) -> None:
        """Set several ``settings`` at once: all are checked, or none is changed."""
        unknown = sorted(set(changes) - set(settings))
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}; the settings are {list(settings)}")
        with self.hold_trait_notifications():  # a refused value rolls the others back
            for name, value in changes.items():
                setattr(self, name, value)


_V = TypeVar("_V", bound="_WidgetView")


class _WidgetView(_View):
    """A view with an ipywidgets ``widget`` (built on first use) and a ``controls`` dict."""

    _css_class: ClassVar[str] = "nb-dist-view"
    #: Classes the container gets before ``_css_class`` (the monitor is not a teaching view).
    _container_classes: ClassVar[tuple[str, ...]] = ("nb-dist-view",)
    #: The widget's HTML body, for views that have one (see :meth:`_html_output`).
    _html: HTML

    #: The traits :meth:`update` changes; a change of any redraws the HTML body (views that
    #: redraw more than that observe their own traits and leave this empty).
    _settings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **settings: Any) -> None:
        self._widget: VBox | None = None  # first: setting a trait may already refresh
        self._controls: dict[str, DOMWidget] = {}
        super().__init__(**settings)
        if self._settings:
            self.observe(self._redraw, names=list(self._settings))

    def _redraw(self, _change: Bunch | None = None) -> None:
        if self._widget is not None:
            self._html.value = self._html_view()

    def update(self: _V, **changes: Any) -> _V:
        """Change several settings at once, by name (``view.update(b=16, s=64)``); the
        controls follow.

        All the changes are checked first: a refused value leaves every setting as it was.
        """
        self._update(changes, self._settings)
        return self

    @property
    def widget(self) -> VBox:
        """The ipywidgets container (a ``VBox``); built the first time it is asked for."""
        if self._widget is None:
            widget = self._build_widget()
            for css in (*self._container_classes, self._css_class):
                widget.add_class(css)
            self._widget = widget
        return self._widget

    @property
    def controls(self) -> dict[str, DOMWidget]:
        """The widget's controls by name; setting ``controls[name].value`` updates the view."""
        _ = self.widget
        return self._controls

    def _build_widget(self) -> VBox:  # pragma: no cover - abstract
        raise NotImplementedError

    def _html_view(self) -> str:  # pragma: no cover - abstract
        """The HTML body's value (views with one build it from ``_html.py``'s pieces)."""
        raise NotImplementedError

    def _html_output(self) -> HTML:
        """The widget's HTML body, kept as ``self._html``: ``_html_view()`` with the CSS class
        ``<css class>-output``. The view sets ``self._html.value`` again when it changes."""
        import ipywidgets as w

        self._html = w.HTML(value=self._html_view())
        self._html.add_class(f"{self._css_class}-output")
        return self._html

    def _add_control(self, name: str, control: DOMWidget) -> DOMWidget:
        """Register ``control`` under ``name`` with stable CSS classes for browser tests."""
        control.add_class("nb-dist-control")
        control.add_class(f"{self._css_class}-{name.replace('_', '-')}")
        self._controls[name] = control
        return control

    def _link_control(self, name: str, control: DOMWidget) -> DOMWidget:
        """Register ``control`` and link its ``value`` both ways to the trait ``name``.

        The link is kernel-side (``traitlets.link``): the view is no widget, and its checks
        run on every value a frontend sends. A bounded control's ``max`` grows first whenever
        the trait goes past it (a slider would otherwise clamp the value it is given).
        """
        self._add_control(name, control)
        if hasattr(control, "max"):

            def grow(value: Any) -> None:
                if value > control.max:
                    control.max = value

            grow(getattr(self, name))
            self.observe(lambda change: grow(change.new), names=name)  # before the link's
        link((self, name), (control, "value"))
        return control

    def _rich_bundle(self) -> dict[str, Any]:
        return widget_view_bundle(self.widget)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_view_bundle(widget: DOMWidget) -> dict[str, Any]:
    """The MIME entry a frontend renders ``widget`` from, on ipywidgets 7 and 8.

    ipywidgets 8 builds it in ``_repr_mimebundle_``; ipywidgets 7 (Colab's and Kaggle's) has
    no such method and publishes the same entry itself from ``_ipython_display_``, so it is
    built here from the widget's model id, as ipywidgets 7 does (widget protocol 2.0).
    """
    repr_bundle = getattr(widget, "_repr_mimebundle_", None)
    if repr_bundle is not None:
        bundle = repr_bundle() or {}
        return {WIDGET_VIEW: bundle[WIDGET_VIEW]} if WIDGET_VIEW in bundle else {}
    if getattr(widget, "_view_name", None) is None or getattr(widget, "comm", None) is None:
        return {}  # no frontend view, or the widget was closed
    return {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}}


class _StaticView(_View):
    """A view without controls: text summary plus, in a kernel, the figure as a PNG."""

    def figure(self) -> Figure:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rich_bundle(self) -> dict[str, Any]:
        return {"image/png": figure_png(self.figure())}


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """Render a matplotlib ``Figure`` with Agg and return the PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def _new_figure(width: float, height: float) -> Figure:
    """A ``matplotlib.figure.Figure`` on an Agg canvas (no pyplot, so nothing pops up)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _g(x: float, digits: int = 5) -> str:
    """Stable short number formatting: ``65504``, ``3.4028e+38``, ``inf``, ``nan``."""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.{digits}g}"


def _short_list(items: list[str], limit: int = 24) -> str:
    if len(items) <= limit:
        return "[" + ", ".join(items) + "]"
    return "[" + ", ".join(items[:limit]) + f", ... (+{len(items) - limit} more)]"
