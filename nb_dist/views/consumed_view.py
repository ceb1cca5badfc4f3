"""What ranks really consumed in a launch: an epoch x sample grid of who took each sample.

:class:`ShardExplorer` (``shard_explorer.py``) shows what ``DistributedSampler`` *would* hand
out; :func:`consumed_view` takes the indices each rank actually processed in a real launch
(collected with ``nb_dist.report`` or returned by the function) and counts duplicates and
samples nobody saw, within each epoch, and whether the epochs repeat one order (a missing
``set_epoch``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from traitlets import validate

from ._display import StrictInt, _new_figure, _short_list, _StaticView, at_least
from .colors import DROPPED_COLOR, rank_color, text_color_on

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from traitlets.utils.bunch import Bunch

__all__ = ["ConsumedView", "consumed_view"]


class ConsumedView(_StaticView):
    """What every rank actually consumed in a real run, as an epoch x sample grid.

    Args:
        indices_by_rank (`dict[int, list[int] | dict[int, list[int]]]`): for each rank, the
            sample indices it processed, either as one list (one pass, or everything at once)
            or per epoch as ``{epoch: [indices]}`` (for example collected by each rank with
            ``nb_dist.report(..., step=epoch)``). Keys may be ints or strings of ints (as after
            a JSON round trip).
        dataset_len (`int`): the dataset's length, to find samples nobody saw.

    Duplicates and missed samples are counted *within* an epoch: a sample consumed once in
    every epoch is normal training, not a duplicate. With several epochs the summary also says
    whether each epoch repeated epoch 0 (same samples, same ranks, same order: what a missing
    ``set_epoch`` does) and how many samples moved to another rank.
    """

    dataset_len = StrictInt(0, read_only=True, help="the dataset's length")

    def __init__(self, indices_by_rank: Mapping[Any, Any], dataset_len: int) -> None:
        super().__init__()
        self.set_trait("dataset_len", dataset_len)
        ranks = sorted(indices_by_rank.items(), key=lambda kv: int(kv[0]))
        self.per_epoch = any(isinstance(v, Mapping) for _r, v in ranks)
        #: ``{epoch: {rank: [indices]}}``; a single list is epoch 0.
        self.by_epoch: dict[int, dict[int, list[int]]] = {}
        for rank, value in ranks:
            epochs = value if isinstance(value, Mapping) else {0: value}
            for epoch, indices in epochs.items():
                self.by_epoch.setdefault(int(epoch), {})[int(rank)] = [int(i) for i in indices]
        self.by_epoch = {e: dict(sorted(self.by_epoch[e].items())) for e in sorted(self.by_epoch)}
        #: Every rank's indices over all epochs, in epoch order.
        self.indices_by_rank: dict[int, list[int]] = {int(r): [] for r, _v in ranks}
        for by_rank in self.by_epoch.values():
            for rank, indices in by_rank.items():
                self.indices_by_rank[rank].extend(indices)
        for rank, indices in self.indices_by_rank.items():
            bad = [i for i in indices if not 0 <= i < self.dataset_len]
            if bad:
                raise ValueError(
                    f"rank {rank} consumed indices outside range(dataset_len={self.dataset_len}): "
                    f"{bad[:5]}"
                )

    @validate("dataset_len")
    def _not_negative(self, proposal: Bunch) -> int:
        return at_least(proposal, 0)

    @property
    def epochs(self) -> list[int]:
        return list(self.by_epoch)

    def counts(self) -> Counter[int]:
        """How many times each sample index was consumed, over all ranks and epochs."""
        return Counter(i for indices in self.indices_by_rank.values() for i in indices)

    def _where(self, epoch: int) -> dict[int, list[int]]:
        where: dict[int, list[int]] = {}
        for rank, indices in self.by_epoch[epoch].items():
            for i in indices:
                where.setdefault(i, []).append(rank)
        return where

    def duplicates(self) -> dict[int, list[int]]:
        """``{index: [ranks...]}`` for every sample consumed more than once *in one epoch*."""
        found: dict[int, list[int]] = {}
        for epoch in self.by_epoch:
            for i, ranks in self._where(epoch).items():
                if len(ranks) > 1:
                    found.setdefault(i, []).extend(ranks)
        return dict(sorted(found.items()))

    def never_seen(self) -> list[int]:
        """Sample indices that some epoch did not consume at all, sorted."""
        missing: set[int] = set()
        for epoch in self.by_epoch:
            where = self._where(epoch)
            missing.update(i for i in range(self.dataset_len) if i not in where)
        return sorted(missing)

    def repeats_first_epoch(self) -> list[int]:
        """The epochs after the first whose every rank consumed exactly epoch 0's list."""
        first, *rest = self.epochs or [0]
        return [e for e in rest if self.by_epoch[e] == self.by_epoch[first]]

    def moved(self, epoch: int) -> list[int]:
        """Samples that ``epoch`` gives to another rank (set) than the first epoch did."""
        first = self._where(self.epochs[0])
        now = self._where(epoch)
        return sorted(i for i in now if set(now[i]) != set(first.get(i, [])))

    def summary(self) -> str:
        total = sum(len(v) for v in self.indices_by_rank.values())
        head = f"ConsumedView(dataset={self.dataset_len}, ranks={len(self.indices_by_rank)}"
        if self.per_epoch:
            head += f", epochs={len(self.by_epoch)}"
        lines = [f"{head}, consumed={total})"]
        for epoch, by_rank in self.by_epoch.items():
            for rank, indices in by_rank.items():
                where = f"epoch {epoch}, rank {rank}" if self.per_epoch else f"rank {rank}"
                lines.append(
                    f"{where}: {len(indices)} samples {_short_list([str(i) for i in indices])}"
                )
        within = " in one epoch" if self.per_epoch else ""
        dups = self.duplicates()
        if dups:
            shown = [f"{i} (ranks {', '.join(str(r) for r in ranks)})" for i, ranks in dups.items()]
            extra = f", ... (+{len(shown) - 12} more)" if len(shown) > 12 else ""
            lines.append(f"duplicates{within}: {len(dups)}: " + "; ".join(shown[:12]) + extra)
        else:
            lines.append(f"duplicates{within}: none")
        missing = self.never_seen()
        label = "missed by an epoch" if self.per_epoch else "never seen"
        lines.append(
            f"{label}: {len(missing)}: {_short_list([str(i) for i in missing])}"
            if missing
            else f"{label}: none"
        )
        repeats = set(self.repeats_first_epoch())
        for epoch in self.epochs[1:]:
            if epoch in repeats:
                lines.append(
                    f"epoch {epoch} repeats epoch {self.epochs[0]}: same samples on the same "
                    "ranks, in the same order"
                )
            else:
                lines.append(
                    f"epoch {epoch}: a new order; {len(self.moved(epoch))} of "
                    f"{self.dataset_len} samples on another rank than in epoch {self.epochs[0]}"
                )
        return "\n".join(lines)

    def figure(self) -> Figure:
        """A grid: one row per epoch, one cell per sample, coloured by the rank that took it.

        Each cell shows the sample's position in that rank's order (1 = its first sample of
        the epoch); a sample taken by two ranks in one epoch is split into both colours with a
        red outline, a missed one is grey with an x. Datasets longer than 60 samples are drawn
        without the numbers, and as coloured pixels.
        """
        n, epochs = self.dataset_len, self.epochs or [0]
        small = n <= 60
        width = min(12.0, max(6.0, 2.5 + 0.42 * n)) if small else 12.0
        fig = _new_figure(width, 1.5 + 0.55 * len(epochs))
        ax = fig.subplots()
        if small:
            for row, epoch in enumerate(epochs):
                position: dict[int, list[tuple[int, int]]] = {}
                for rank, indices in self.by_epoch[epoch].items():
                    for k, i in enumerate(indices):
                        position.setdefault(i, []).append((rank, k + 1))
                for i in range(n):
                    _draw_consumed_cell(ax, i, row, position.get(i, []))
            ax.set_xticks([i + 0.5 for i in range(n)])
            ax.set_xticklabels([str(i) for i in range(n)], fontsize=8)
        else:
            grid: list[list[tuple[float, ...]]] = [[(0.85, 0.85, 0.85)] * n for _ in epochs]
            for row, epoch in enumerate(epochs):
                for i, ranks_of in self._where(epoch).items():
                    color = rank_color(ranks_of[0]) if len(ranks_of) == 1 else "#000000"
                    grid[row][i] = tuple(int(color[j : j + 2], 16) / 255 for j in (1, 3, 5))
            ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(0, n, len(epochs), 0))
        ax.set_xlim(0, n)
        ax.set_ylim(len(epochs), 0)
        ax.set_yticks([row + 0.5 for row in range(len(epochs))])
        ax.set_yticklabels(
            [f"epoch {e}" for e in epochs] if self.per_epoch else ["consumed"], fontsize=9
        )
        ax.set_xlabel("sample index" + (" (number: position in the rank's order)" if small else ""))
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        self._add_legend_and_title(ax)
        return fig

    def _add_legend_and_title(self, ax: Axes) -> None:
        """A legend of the ranks (and of duplicates and misses, if any) and the verdict."""
        from matplotlib.patches import Patch

        epochs = self.epochs or [0]
        handles = [Patch(facecolor=rank_color(r), label=f"rank {r}") for r in self.indices_by_rank]
        dups, missing = len(self.duplicates()), len(self.never_seen())
        if dups:
            handles.append(Patch(facecolor="#FFFFFF", edgecolor="#D55E00", label="two ranks"))
        if missing:
            handles.append(Patch(facecolor=DROPPED_COLOR, label="nobody"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        if self.per_epoch and len(epochs) > 1:
            repeats = self.repeats_first_epoch()
            verdict = (
                "every epoch repeats epoch 0"
                if len(repeats) == len(epochs) - 1
                else "the order changes between epochs"
            )
            title = f"Who consumed each sample, per epoch: {verdict}"
        else:
            title = f"Who consumed each sample: {dups} duplicated, {missing} never seen"
        ax.set_title(title, fontsize=10)


def _draw_consumed_cell(ax: Axes, i: int, row: int, takers: list[tuple[int, int]]) -> None:
    """Sample ``i`` in ``row``: a stripe per rank that took it (grey with an x: nobody).

    The label is the sample's position in each taker's order; two takers get a red outline.
    """
    from matplotlib.patches import Rectangle

    if not takers:
        ax.add_patch(Rectangle((i, row), 1, 1, facecolor=DROPPED_COLOR, edgecolor="#FFFFFF"))
        ax.text(i + 0.5, row + 0.5, "x", ha="center", va="center", color="#D55E00")
        return
    share = 1 / len(takers)
    for k, (rank, _pos) in enumerate(takers):
        ax.add_patch(
            Rectangle(
                (i + k * share, row),
                share,
                1,
                facecolor=rank_color(rank),
                edgecolor="#FFFFFF",
                linewidth=1.0,
            )
        )
    if len(takers) > 1:
        ax.add_patch(Rectangle((i, row), 1, 1, fill=False, edgecolor="#D55E00", linewidth=2.2))
    label = "/".join(str(pos) for _rank, pos in takers)
    ax.text(
        i + 0.5,
        row + 0.5,
        label,
        ha="center",
        va="center",
        fontsize=8 if len(takers) == 1 else 6.5,
        color=text_color_on(rank_color(takers[0][0])),
    )


def consumed_view(indices_by_rank: Mapping[Any, Any], dataset_len: int) -> ConsumedView:
    """Shortcut for :class:`ConsumedView` (display it, ``print`` it, or call ``.figure()``)."""
    return ConsumedView(indices_by_rank, dataset_len)
