"""Which samples does every rank get? ``DistributedSampler``, made visible.

In data-parallel training every rank runs the same loop over its own *shard* of the dataset.
``torch.utils.data.DistributedSampler`` decides the shards:

1. it orders the indices ``0 .. len-1`` (shuffled with ``seed + epoch`` when ``shuffle=True``);
2. unless ``drop_last=True``, it **pads** the list by repeating its first indices until the length
   divides by the world size (so every rank runs the same number of steps and no rank waits
   forever in an all-reduce); with ``drop_last=True`` it instead **drops** the tail;
3. rank ``r`` takes every ``world_size``-th index starting at ``r`` (``indices[r::world_size]``).

The shuffle is seeded with ``seed + epoch``, and the sampler only learns the epoch from
``sampler.set_epoch(epoch)``. Forget that call and every epoch repeats epoch 0's order.

:class:`ShardExplorer` computes all of this with the real ``DistributedSampler`` (one per rank)
and shows it as a widget, a text summary and a matplotlib figure. What ranks *actually*
consumed in a real launch is :func:`~nb_dist.views.consumed_view.consumed_view`'s to draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

from traitlets import CBool, validate

from ._display import StrictInt, _new_figure, _short_list, _WidgetView, at_least
from ._html import MONOSPACE, escape, filled, rank_row
from .colors import DROPPED_COLOR, PADDING_EDGE_COLOR, rank_color, text_color_on

if TYPE_CHECKING:
    from ipywidgets import VBox
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from torch.utils.data import Dataset
    from traitlets.utils.bunch import Bunch

__all__ = ["ShardExplorer", "sampler_assignments"]


# --------------------------------------------------------------------------------------------
# The model: pure functions over the real DistributedSampler.
# --------------------------------------------------------------------------------------------


class _IndexDataset:
    """The smallest dataset a sampler accepts: it only needs ``len()``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def sampler_assignments(
    dataset_len: int,
    world_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int | None = None,
    drop_last: bool = False,
) -> dict[int, list[int]]:
    """The indices each rank gets from ``torch.utils.data.DistributedSampler``.

    Builds one real sampler per rank (``num_replicas=world_size, rank=r``) and lists it. With
    ``epoch=None`` ``set_epoch`` is never called, exactly like a training loop that forgets it
    (the sampler then stays at epoch 0); otherwise ``sampler.set_epoch(epoch)`` is called first.
    """
    from torch.utils.data import DistributedSampler

    dataset = cast("Dataset[int]", _IndexDataset(dataset_len))  # a sampler only needs len()
    result = {}
    for rank in range(world_size):
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        if epoch is not None:
            sampler.set_epoch(epoch)
        result[rank] = [int(i) for i in sampler]
    return result


def _padding_positions(assignments: Mapping[int, list[int]]) -> dict[int, list[int]]:
    """Positions (per rank) that hold padding duplicates.

    Interleaving the ranks' lists restores the sampler's global order (position ``p`` of rank
    ``r`` is global position ``p * world_size + r``). The first occurrence of an index in that
    order is the real sample; every later occurrence is a padding duplicate.
    """
    world_size = len(assignments)
    length = max((len(v) for v in assignments.values()), default=0)
    seen: set[int] = set()
    padding: dict[int, list[int]] = {r: [] for r in assignments}
    for position in range(length):
        for rank in range(world_size):
            index = assignments[rank][position]
            if index in seen:
                padding[rank].append(position)
            seen.add(index)
    return padding


def _fmt_index(index: int, padded: bool) -> str:
    return f"{index}*" if padded else str(index)


#: The explorer's settings, in its constructor's order.
_SETTINGS = (
    "dataset_len",
    "world_size",
    "batch_size",
    "shuffle",
    "seed",
    "epoch",
    "drop_last",
    "set_epoch",
)


class ShardExplorer(_WidgetView):
    """Explore how ``DistributedSampler`` splits a dataset over ranks, epoch by epoch.

    Args:
        dataset_len (`int`): number of samples in the dataset (``len(dataset)``).
        world_size (`int`): number of ranks (``num_replicas``).
        batch_size (`int`): per-rank batch size, used to group each rank's indices into batches
            (``BatchSampler(sampler, batch_size, drop_last=False)``, as a ``DataLoader`` does).
        shuffle (`bool`): the sampler's ``shuffle``.
        seed (`int`): the sampler's ``seed`` (the shuffle uses ``seed + epoch``).
        epoch (`int`): the training loop's current epoch.
        drop_last (`bool`): the sampler's ``drop_last``: drop the tail instead of padding.
        set_epoch (`bool`): whether the loop calls ``sampler.set_epoch(epoch)``. When False the
            sampler stays at epoch 0, so every epoch repeats epoch 0's order.

    Every setting above is a trait: change it by assignment, with :meth:`update` or through
    the widget's ``controls`` (linked to the traits); ``assignments()``, ``padding()``,
    ``dropped()`` and ``batches()`` recompute.

    >>> ShardExplorer(dataset_len=10, world_size=3).assignments()
    {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}
    """

    _css_class = "nb-dist-shard-explorer"
    _settings = _SETTINGS

    dataset_len = StrictInt(10, help="number of samples in the dataset")
    world_size = StrictInt(3, help="number of ranks (num_replicas)")
    batch_size = StrictInt(2, help="per-rank batch size")
    shuffle = CBool(False, help="the sampler's shuffle")
    seed = StrictInt(0, help="the sampler's seed (the shuffle uses seed + epoch)")
    epoch = StrictInt(0, help="the training loop's current epoch")
    drop_last = CBool(False, help="the sampler's drop_last: drop the tail instead of padding")
    set_epoch = CBool(True, help="whether the loop calls sampler.set_epoch(epoch)")

    def __init__(
        self,
        dataset_len: int = 10,
        world_size: int = 3,
        batch_size: int = 2,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        set_epoch: bool = True,
    ) -> None:
        super().__init__(
            dataset_len=dataset_len,
            world_size=world_size,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            drop_last=drop_last,
            set_epoch=set_epoch,
        )

    @validate("dataset_len", "world_size", "batch_size")
    def _at_least_one(self, proposal: Bunch) -> int:
        return at_least(proposal, 1)

    @validate("seed", "epoch")
    def _not_negative(self, proposal: Bunch) -> int:
        return at_least(proposal, 0)

    # ---- model ------------------------------------------------------------------------------

    @property
    def sampler_epoch(self) -> int:
        """The epoch the sampler actually uses: ``epoch`` if ``set_epoch`` is called, else 0."""
        return self.epoch if self.set_epoch else 0

    def assignments(self, epoch: int | None = None) -> dict[int, list[int]]:
        """``{rank: indices}`` from ``DistributedSampler`` for ``epoch`` (default: current).

        Without ``set_epoch`` the sampler never hears about the epoch, whatever it is.
        """
        epoch = self.epoch if epoch is None else epoch
        return sampler_assignments(
            self.dataset_len,
            self.world_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch if self.set_epoch else None,
            drop_last=self.drop_last,
        )

    def padding(self, epoch: int | None = None) -> dict[int, list[int]]:
        """``{rank: positions}``: where in each rank's list the padding duplicates sit."""
        return _padding_positions(self.assignments(epoch))

    def dropped(self, epoch: int | None = None) -> list[int]:
        """Sample indices no rank gets this epoch (only with ``drop_last=True``), sorted."""
        assigned = {i for indices in self.assignments(epoch).values() for i in indices}
        return sorted(set(range(self.dataset_len)) - assigned)

    def batches(self, epoch: int | None = None) -> dict[int, list[list[int]]]:
        """``{rank: [batch, ...]}``: each rank's indices as its ``DataLoader`` would batch them.

        Uses ``torch.utils.data.BatchSampler(indices, batch_size, drop_last=False)``; the last
        batch of a rank may be smaller.
        """
        from torch.utils.data import BatchSampler

        return {
            rank: [list(b) for b in BatchSampler(indices, self.batch_size, drop_last=False)]
            for rank, indices in self.assignments(epoch).items()
        }

    def epoch_orders(self, epochs: Iterable[int]) -> dict[int, dict[int, list[int]]]:
        """``{epoch: assignments}`` for several epochs, honouring the ``set_epoch`` switch."""
        return {e: self.assignments(e) for e in epochs}

    def samples_per_rank(self) -> int:
        """How many indices every rank gets (``len(sampler)``; the same on every rank)."""
        return len(self.assignments()[0])

    # ---- text -------------------------------------------------------------------------------

    def _header(self) -> str:
        return (
            f"ShardExplorer(dataset={self.dataset_len}, world_size={self.world_size}, "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"epoch={self.epoch}, drop_last={self.drop_last}, set_epoch={self.set_epoch})"
        )

    def _next_epoch_line(self, current: dict[int, list[int]]) -> str:
        nxt = self.epoch + 1
        if not self.shuffle:
            return f"epoch {nxt}: same order (shuffle=False never reorders)"
        if not self.set_epoch:
            return (
                f"epoch {nxt}: same order as epoch 0 (set_epoch is not called, so the "
                f"sampler shuffles with seed {self.seed} + 0 every epoch)"
            )
        changed = self.assignments(nxt) != current
        what = "new order" if changed else "same order (by chance)"
        return f"epoch {nxt}: {what} (set_epoch({nxt}) reshuffles with seed {self.seed} + {nxt})"

    def summary(self) -> str:
        """What the view shows, as deterministic text (this is the notebook's text/plain)."""
        assignments = self.assignments()
        padding = self.padding()
        dropped = self.dropped()
        lines = [self._header()]
        if self.set_epoch:
            lines.append(f"sampler.set_epoch({self.epoch}) called: shuffle seed = seed + epoch")
        elif self.epoch:
            lines.append(f"set_epoch not called: the sampler still uses epoch 0 (now {self.epoch})")
        for rank, indices in assignments.items():
            pad = set(padding[rank])
            shown = [_fmt_index(i, p in pad) for p, i in enumerate(indices)]
            lines.append(f"rank {rank}: {_short_list(shown)}")
        n_pad = sum(len(p) for p in padding.values())
        per_rank = len(assignments[0])
        if n_pad:
            lines.append(
                f"* = padding duplicate: {n_pad} sample(s) repeated so every rank gets {per_rank}"
            )
        if dropped:
            lines.append(
                f"dropped (drop_last=True): {_short_list([str(i) for i in dropped])}, "
                f"so every rank gets {per_rank}"
            )
        else:
            lines.append("dropped: none")
        lines.append(f"batches (batch_size={self.batch_size}):")
        for rank, batches in self.batches().items():
            pad = set(padding[rank])
            shown = []
            for b, batch in enumerate(batches):
                items = [_fmt_index(i, b * self.batch_size + j in pad) for j, i in enumerate(batch)]
                shown.append("[" + ", ".join(items) + "]")
            text = " ".join(shown[:12]) + (
                f" ... (+{len(shown) - 12} more)" if len(shown) > 12 else ""
            )
            lines.append(f"rank {rank}: {len(batches)} batch(es) {text}")
        lines.append(self._next_epoch_line(assignments))
        return "\n".join(lines)

    # ---- figure -----------------------------------------------------------------------------

    def figure(self, epochs: int = 2) -> Figure:
        """A matplotlib ``Figure``: dataset coverage, then each rank's strip for ``epochs`` epochs.

        The top row colours every sample by the rank that receives it (grey: dropped). Below, for
        the current epoch and the following ones, each rank's indices in order, batch by batch;
        padding duplicates are hatched and starred.
        """
        epoch_list = list(range(self.epoch, self.epoch + max(1, epochs)))
        orders = self.epoch_orders(epoch_list)
        per_rank = max(1, len(orders[self.epoch][0]))
        width = max(self.dataset_len, per_rank + (per_rank - 1) // self.batch_size * 0.4)
        fig = _new_figure(
            min(16.0, max(7.0, 2.5 + 0.38 * width)),
            1.8 + 0.45 * self.world_size * len(epoch_list),
        )
        axes = fig.subplots(
            1 + len(epoch_list),
            1,
            gridspec_kw={"height_ratios": [1.4] + [self.world_size + 0.6] * len(epoch_list)},
        )
        show_labels = width <= 80  # beyond that the numbers would not fit in the cells
        self._draw_coverage(axes[0], orders[self.epoch], width, show_labels)
        for ax, epoch in zip(axes[1:], epoch_list, strict=True):
            self._draw_strips(ax, epoch, orders[epoch], width, show_labels)
        fig.suptitle(
            f"DistributedSampler: {self.dataset_len} samples over {self.world_size} ranks\n"
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last} "
            "(dashed, faded, * = padding duplicate)",
            fontsize=10,
        )
        return fig

    def _draw_coverage(
        self, ax: Axes, assignments: dict[int, list[int]], width: float, show_labels: bool
    ) -> None:
        """The dataset's row: every sample split between the ranks that get it (grey: none)."""
        from matplotlib.patches import Rectangle

        owners: dict[int, list[int]] = {}
        for rank, indices in assignments.items():
            for i in indices:
                owners.setdefault(i, []).append(rank)
        for i in range(self.dataset_len):
            ranks = owners.get(i, [])
            if not ranks:
                _draw_cell(ax, i, 0, str(i), DROPPED_COLOR, show_labels, dropped=True)
                continue
            share = 0.8 / len(ranks)
            for k, rank in enumerate(ranks):
                ax.add_patch(Rectangle((i, k * share), 0.92, share, facecolor=rank_color(rank)))
            ax.text(
                i + 0.46,
                0.4,
                str(i),
                ha="center",
                va="center",
                fontsize=7,
                color=text_color_on(rank_color(ranks[0])),
            )
        ax.set_xlim(-0.2, width + 0.2)
        ax.set_ylim(-0.1, 0.9)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_ylabel("dataset", rotation=0, ha="right", va="center")
        ax.set_frame_on(False)
        ax.set_title(
            f"epoch {self.epoch}: the rank(s) that get each sample (grey = dropped)",
            fontsize=9,
            loc="left",
        )

    def _draw_strips(
        self,
        ax: Axes,
        epoch: int,
        assignments: dict[int, list[int]],
        width: float,
        show_labels: bool,
    ) -> None:
        """One row per rank: its indices for ``epoch`` in order, batch by batch."""
        padding = _padding_positions(assignments)
        for rank, indices in assignments.items():
            y = self.world_size - 1 - rank
            pad = set(padding[rank])
            for p, index in enumerate(indices):
                x = p + (p // self.batch_size) * 0.4
                label = _fmt_index(index, p in pad)
                _draw_cell(ax, x, y, label, rank_color(rank), show_labels, padded=p in pad)
        ax.set_xlim(-0.2, width + 0.2)
        ax.set_ylim(-0.2, self.world_size)
        ax.set_yticks([self.world_size - 1 - r + 0.4 for r in range(self.world_size)])
        ax.set_yticklabels([f"rank {r}" for r in range(self.world_size)])
        ax.set_xticks([])
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        note = (
            f"sampler.set_epoch({epoch})"
            if self.set_epoch
            else "set_epoch not called: sampler epoch 0"
        )
        ax.set_title(
            f"epoch {epoch} ({note}), batches of {self.batch_size}", fontsize=9, loc="left"
        )

    # ---- widget -----------------------------------------------------------------------------

    def _build_widget(self) -> VBox:
        import ipywidgets as w

        wide = {"description_width": "initial"}
        controls = {
            "dataset_len": w.IntSlider(min=1, max=64, description="dataset length", style=wide),
            "world_size": w.IntSlider(min=1, max=8, description="world size", style=wide),
            "batch_size": w.IntSlider(min=1, max=16, description="batch size", style=wide),
            "epoch": w.IntSlider(min=0, max=9, description="epoch", style=wide),
            "seed": w.BoundedIntText(
                min=0, max=2**31 - 1, description="seed", style=wide, layout=w.Layout(width="160px")
            ),
            "shuffle": w.Checkbox(description="shuffle"),
            "drop_last": w.Checkbox(description="drop_last"),
            "set_epoch": w.Checkbox(description="call set_epoch(epoch)"),
        }
        for name, control in controls.items():
            self._link_control(name, control)
            control.tooltip = name
        c = self._controls
        return w.VBox(
            [
                w.HBox([c["dataset_len"], c["world_size"], c["batch_size"]]),
                w.HBox([c["epoch"], c["seed"], c["shuffle"], c["drop_last"], c["set_epoch"]]),
                self._html_output(),
            ]
        )

    def _html_view(self) -> str:
        """The widget's body: coloured strips per rank for this epoch and the next."""
        assignments = self.assignments()
        padding = self.padding()
        nxt = self.epoch + 1
        nxt_orders = self.assignments(nxt)
        parts = [
            f'<div style="{MONOSPACE}">',
            "<div><b>dataset</b> (colour = rank that gets the sample first)"
            f"{''.join(self._html_coverage(assignments))}</div>",
            f"<div style='margin-top:6px'><b>epoch {self.epoch}</b>, batches of "
            f"{self.batch_size} ({len(assignments[0])} samples per rank)</div>",
            *self._html_strips(assignments, padding),
            f"<div style='margin-top:6px'><b>epoch {nxt}</b></div>",
            *self._html_strips(nxt_orders, _padding_positions(nxt_orders)),
            "<pre style='margin-top:6px'>" + escape(self.summary().split("\n")[-1]) + "</pre>",
            "<div>* = padding duplicate; struck-through grey = dropped</div>",
            "</div>",
        ]
        return "\n".join(parts)

    def _html_coverage(self, assignments: dict[int, list[int]]) -> list[str]:
        """One cell per sample, in the colour of the first rank that gets it (grey: dropped)."""
        dropped = set(self.dropped())
        coverage = []
        owner: dict[int, int] = {}
        for rank, indices in assignments.items():
            for i in indices:
                owner.setdefault(i, rank)
        for i in range(self.dataset_len):
            if i in dropped:
                coverage.append(
                    _html_cell(
                        str(i), DROPPED_COLOR, "text-decoration:line-through;", "nb-dist-dropped"
                    )
                )
            else:
                coverage.append(_html_cell(str(i), rank_color(owner[i])))
        return coverage

    def _html_strips(self, orders: dict[int, list[int]], pads: dict[int, list[int]]) -> list[str]:
        """One row per rank: its indices as cells, a gap between batches, padding outlined."""
        rows = []
        for rank, indices in orders.items():
            pad = set(pads[rank])
            cells = []
            for p, index in enumerate(indices):
                if p and p % self.batch_size == 0:
                    cells.append('<span style="display:inline-block;width:0.8em"></span>')
                if p in pad:
                    cells.append(
                        _html_cell(
                            f"{index}*",
                            rank_color(rank),
                            "outline:2px dashed #222;",
                            "nb-dist-padding",
                        )
                    )
                else:
                    cells.append(_html_cell(str(index), rank_color(rank)))
            rows.append(
                f"<div {rank_row(rank)}>"
                f'<b style="display:inline-block;width:4em">rank {rank}</b>'
                f"{''.join(cells)}</div>"
            )
        return rows


def _draw_cell(
    ax: Axes,
    x: float,
    y: float,
    label: str,
    color: str,
    show_label: bool,
    padded: bool = False,
    dropped: bool = False,
) -> None:
    """One sample's cell in a strip: faded with a dashed outline when it is padding."""
    from matplotlib.patches import Rectangle

    ax.add_patch(
        Rectangle(
            (x, y),
            0.92,
            0.8,
            facecolor=DROPPED_COLOR if dropped else color,
            alpha=0.45 if padded else 1.0,
            edgecolor="none",
        )
    )
    if padded:  # a dashed outline on top of the faded fill marks a padding duplicate
        ax.add_patch(
            Rectangle(
                (x, y),
                0.92,
                0.8,
                fill=False,
                edgecolor=PADDING_EDGE_COLOR,
                linestyle="--",
                linewidth=1.4,
            )
        )
    ink = "#555555" if dropped else "#000000" if padded else text_color_on(color)
    if show_label:
        ax.text(x + 0.46, y + 0.4, label, ha="center", va="center", fontsize=7, color=ink)


def _html_cell(label: str, color: str, extra: str = "", cls: str = "") -> str:
    """One sample as an inline coloured box (``extra``: more CSS, ``cls``: a CSS class)."""
    return (
        f'<span class="nb-dist-cell {cls}" style="display:inline-block;min-width:2.2em;'
        f"text-align:center;margin:1px;padding:1px 2px;border-radius:3px;"
        f'{filled(color)};{extra}">{label}</span>'
    )
