"""One colour per rank, the same in every nb_dist view.

The palette is Okabe and Ito's eight-colour qualitative palette ("Color Universal Design",
2008), chosen so that the colours stay distinguishable with the common forms of colour-vision
deficiency. Rank ``r`` always gets ``RANK_PALETTE[r % 8]``, so rank 2 is the same green in the
shard explorer, the all-reduce stepper and any figure drawn from a real launch.
"""

from __future__ import annotations

__all__ = [
    "DROPPED_COLOR",
    "PADDING_EDGE_COLOR",
    "RANK_PALETTE",
    "rank_color",
    "rank_colors",
    "text_color_on",
]

#: Okabe-Ito palette, in its usual order: orange, sky blue, bluish green, yellow, blue,
#: vermillion, reddish purple, black.
RANK_PALETTE: tuple[str, ...] = (
    "#E69F00",
    "#56B4E9",
    "#009E73",
    "#F0E442",
    "#0072B2",
    "#D55E00",
    "#CC79A7",
    "#000000",
)

#: Fill for samples that no rank receives (dropped by ``drop_last=True``, or never consumed).
DROPPED_COLOR = "#D9D9D9"
#: Outline drawn around padding duplicates (samples repeated so that every rank gets as many).
PADDING_EDGE_COLOR = "#222222"


def rank_color(rank: int) -> str:
    """The colour of ``rank`` as a ``"#RRGGBB"`` string (the palette repeats after 8 ranks).

    >>> rank_color(0), rank_color(8)
    ('#E69F00', '#E69F00')
    """
    if rank < 0:
        raise ValueError(f"rank={rank!r} must be >= 0")
    return RANK_PALETTE[rank % len(RANK_PALETTE)]


def rank_colors(n: int) -> list[str]:
    """The colours of ranks ``0 .. n-1``, in rank order."""
    return [rank_color(r) for r in range(n)]


def text_color_on(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (a ``"#RRGGBB"`` colour)."""
    red, green, blue = (int(background[i : i + 2], 16) / 255 for i in (1, 3, 5))
    # Relative luminance, with the sRGB channel weights of WCAG.
    luminance = 0.2126 * red + 0.7152 * green + 0.0722 * blue
    return "#000000" if luminance > 0.45 else "#FFFFFF"
