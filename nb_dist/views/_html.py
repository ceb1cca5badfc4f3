"""The HTML the views' widgets show, built from the same few pieces in every view.

A widget's body is an ``ipywidgets.HTML`` (see ``_WidgetView._html_output``) whose value a
view's ``_html_view()`` builds as a string: a monospace block, tables, one row per rank
(``class="nb-dist-rank-row" data-rank="r"``, what the browser tests find), and cells filled
with a rank's colour and readable text on it. Text from outside the view is escaped.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape

from .colors import text_color_on

__all__ = ["MONOSPACE", "escape", "filled", "rank_row", "table"]

#: The style of every view's HTML body.
MONOSPACE = "font-family:monospace;font-size:12px"


def filled(color: str) -> str:
    """CSS for a box filled with ``color``, its text black or white, whichever reads better."""
    return f"background:{color};color:{text_color_on(color)}"


def rank_row(rank: int) -> str:
    """The attributes of the element that shows one rank's row."""
    return f'class="nb-dist-rank-row" data-rank="{rank}"'


def table(head: Iterable[str], rows: Iterable[str], attributes: str = "") -> str:
    """A ``<table>``: one header row of ``<th>`` cells (``head``), then ``rows`` (``<tr>...``).

    ``attributes`` goes into the opening tag as it is (with its leading space).
    """
    cells = "".join(f"<th>{h}</th>" for h in head)
    return f"<table{attributes}><tr>{cells}</tr>{''.join(rows)}</table>"
