"""Teaching views: models against the real torch objects, controls, text summaries, figures.

No browser and no workers: the widgets are built headless (ipywidgets without a kernel) and
their controls are driven programmatically, as a frontend would.
"""

from __future__ import annotations

import io
import math
import random
import re
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler

from nb_dist.views import (
    AllReduceStepper,
    ConsumedView,
    LossScaleView,
    PrecisionExplorer,
    ShardExplorer,
    chunk_bounds,
    consumed_view,
    finfo_table,
    rank_color,
    rank_colors,
    represent,
    ring_allreduce_steps,
    scaler_step,
)

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

WIDGET_KEY = "application/vnd.jupyter.widget-view+json"


def direct_sampler(n, world_size, rank, *, shuffle, seed=0, drop_last=False, epoch=None):
    """What a training script gets from DistributedSampler on ``rank``."""
    sampler = DistributedSampler(
        list(range(n)),
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    if epoch is not None:
        sampler.set_epoch(epoch)
    return list(sampler)


# ---------------------------------------------------------------- colours


def test_rank_colors_are_stable_distinct_and_wrap():
    """Each rank keeps one colour everywhere; 8 distinct colours, then the palette repeats."""
    colors = rank_colors(8)
    assert len(set(colors)) == 8
    assert all(re.fullmatch(r"#[0-9A-F]{6}", c) for c in colors)
    assert rank_color(0) == "#E69F00" and rank_color(8) == rank_color(0)
    assert rank_colors(3) == [rank_color(0), rank_color(1), rank_color(2)]
    with pytest.raises(ValueError, match="rank=-1"):
        rank_color(-1)


# ---------------------------------------------------------------- ShardExplorer


@pytest.mark.parametrize(
    ("n", "world_size", "shuffle", "drop_last", "seed", "epoch"),
    [
        (10, 3, False, False, 0, 0),  # padding: 2 duplicates
        (12, 4, False, False, 0, 0),  # divisible: no padding
        (11, 4, True, False, 7, 3),  # shuffled, padded, epoch 3
        (11, 4, True, True, 0, 1),  # drop_last drops the tail
        (3, 5, False, False, 0, 0),  # fewer samples than ranks: repeats
        (13, 2, True, False, 42, 0),
    ],
)
def test_shard_assignments_equal_distributed_sampler(
    n, world_size, shuffle, drop_last, seed, epoch
):
    """assignments() is exactly what DistributedSampler yields on every rank after set_epoch."""
    view = ShardExplorer(
        dataset_len=n,
        world_size=world_size,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
        epoch=epoch,
    )
    expected = {
        r: direct_sampler(
            n, world_size, r, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch
        )
        for r in range(world_size)
    }
    assert view.assignments() == expected
    assert view.samples_per_rank() == len(expected[0])


def test_shard_padding_marks_duplicates_and_summary_stars_them():
    """10 samples on 3 ranks: ranks 1 and 2 get samples 0 and 1 again, marked with '*'."""
    view = ShardExplorer(dataset_len=10, world_size=3, batch_size=2)
    assert view.assignments() == {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}
    assert view.padding() == {0: [], 1: [3], 2: [3]}
    assert view.dropped() == []
    text = repr(view)
    assert text.splitlines()[0] == (
        "ShardExplorer(dataset=10, world_size=3, batch_size=2, shuffle=False, seed=0, "
        "epoch=0, drop_last=False, set_epoch=True)"
    )
    assert "rank 1: [1, 4, 7, 0*]" in text
    assert "rank 2: [2, 5, 8, 1*]" in text
    assert "rank 0: [0, 3, 6, 9]" in text
    assert "2 sample(s) repeated so every rank gets 4" in text
    assert "rank 1: 2 batch(es) [1, 4] [7, 0*]" in text


def test_shard_padding_with_more_ranks_than_samples():
    """3 samples on 5 ranks: the two extra slots are duplicates, found by position."""
    view = ShardExplorer(dataset_len=3, world_size=5)
    assert view.assignments() == {0: [0], 1: [1], 2: [2], 3: [0], 4: [1]}
    assert view.padding() == {0: [], 1: [], 2: [], 3: [0], 4: [0]}


def test_shard_drop_last_drops_tail_without_padding():
    """drop_last=True: no duplicates, the dropped samples are exactly the unassigned ones."""
    view = ShardExplorer(dataset_len=11, world_size=4, shuffle=True, drop_last=True, seed=3)
    assigned = [i for v in view.assignments().values() for i in v]
    assert len(assigned) == len(set(assigned)) == 8
    assert view.padding() == {r: [] for r in range(4)}
    assert view.dropped() == sorted(set(range(11)) - set(assigned))
    assert len(view.dropped()) == 3
    assert "dropped (drop_last=True): [" in repr(view)


def test_shard_batches_group_each_rank_like_batchsampler():
    """batches() groups each rank's indices by batch_size; the last batch may be short."""
    view = ShardExplorer(dataset_len=10, world_size=3, batch_size=3)
    assert view.batches() == {0: [[0, 3, 6], [9]], 1: [[1, 4, 7], [0]], 2: [[2, 5, 8], [1]]}


def test_shard_set_epoch_switch_reshuffles_or_repeats_epoch_zero():
    """With set_epoch every epoch is reshuffled; without it every epoch repeats epoch 0."""
    view = ShardExplorer(dataset_len=20, world_size=2, shuffle=True, seed=5, epoch=0)
    orders = view.epoch_orders(range(3))
    assert orders[0] != orders[1] != orders[2]
    assert orders[1] == {
        r: direct_sampler(20, 2, r, shuffle=True, seed=5, epoch=1) for r in range(2)
    }
    assert "epoch 1: new order (set_epoch(1) reshuffles with seed 5 + 1)" in repr(view)

    view.controls["set_epoch"].value = False
    assert view.set_epoch is False
    orders = view.epoch_orders(range(3))
    never_told = {r: direct_sampler(20, 2, r, shuffle=True, seed=5) for r in range(2)}
    assert orders[0] == orders[1] == orders[2] == never_told
    view.controls["epoch"].value = 4
    assert view.sampler_epoch == 0
    assert view.assignments() == never_told
    text = repr(view)
    assert "set_epoch not called: the sampler still uses epoch 0 (now 4)" in text
    assert "epoch 5: same order as epoch 0" in text


def test_shard_controls_update_model_and_summary():
    """Changing a control (or calling update) changes the model, the summary and the HTML."""
    view = ShardExplorer(dataset_len=10, world_size=3)
    widget = view.widget
    before_text, before_html = repr(view), view._html.value
    view.controls["world_size"].value = 4
    assert view.world_size == 4
    assert list(view.assignments()) == [0, 1, 2, 3]
    assert "world_size=4" in repr(view) and repr(view) != before_text
    assert "rank 3: [3, 7, 1*]" in repr(view)
    assert view._html.value != before_html and 'data-rank="3"' in view._html.value

    view.controls["drop_last"].value = True
    assert view.dropped() == [8, 9]
    view.update(dataset_len=80, batch_size=5)  # past the slider's max: the slider grows
    assert view.controls["dataset_len"].value == 80 and view.controls["dataset_len"].max == 80
    assert view.controls["batch_size"].value == 5
    assert view.widget is widget


def test_shard_rejects_bad_settings_with_the_parameter_name():
    """Invalid sizes are refused with the parameter's name and value."""
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        ShardExplorer(world_size=0)
    with pytest.raises(TypeError, match=r"dataset_len=2\.5 must be an int"):
        ShardExplorer(dataset_len=2.5)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['worldsize'\]"):
        ShardExplorer().update(worldsize=2)


def test_consumed_view_reports_duplicates_and_never_seen():
    """What ranks really consumed: duplicates name their ranks, missing samples are listed."""
    view = consumed_view({"1": [1, 4, 7, 0], 0: [0, 3, 6, 9], 2: [2, 5, 8]}, dataset_len=11)
    assert isinstance(view, ConsumedView)
    assert list(view.indices_by_rank) == [0, 1, 2]
    assert view.duplicates() == {0: [0, 1]}
    assert view.never_seen() == [10]
    assert repr(view) == (
        "ConsumedView(dataset=11, ranks=3, consumed=11)\n"
        "rank 0: 4 samples [0, 3, 6, 9]\n"
        "rank 1: 4 samples [1, 4, 7, 0]\n"
        "rank 2: 3 samples [2, 5, 8]\n"
        "duplicates: 1: 0 (ranks 0, 1)\n"
        "never seen: 1: [10]"
    )
    with pytest.raises(ValueError, match=r"rank 0 consumed indices outside range\(dataset_len=3\)"):
        ConsumedView({0: [0, 5]}, 3)


def test_consumed_view_of_sampler_output_finds_exactly_the_padding():
    """Feeding the sampler's shards to consumed_view: the duplicates are the padded samples."""
    shards = ShardExplorer(dataset_len=10, world_size=4, shuffle=True, seed=1)
    padded = {
        shards.assignments()[r][p] for r, positions in shards.padding().items() for p in positions
    }
    view = consumed_view(shards.assignments(), 10)
    assert set(view.duplicates()) == padded and len(padded) == 2
    assert view.never_seen() == []


def test_consumed_view_long_datasets_are_drawn_as_pixels():
    """Long datasets become one pixel per sample (no numbers), and every sample is counted."""
    view = ConsumedView({0: list(range(0, 900, 2)), 1: [*range(1, 900, 2), 0]}, 901)
    assert view.never_seen() == [900] and view.duplicates() == {0: [0, 1]}
    fig = view.figure()
    assert fig.axes[0].images[0].get_array().shape[:2] == (1, 901)
    assert not fig.axes[0].texts
    fig.savefig(io.BytesIO(), format="png", dpi=30)


def _two_epochs(set_epoch):
    """{rank: {epoch: indices}} from the real sampler, 12 samples on 2 ranks."""
    return {
        rank: {
            epoch: direct_sampler(12, 2, rank, shuffle=True, epoch=epoch if set_epoch else None)
            for epoch in (0, 1)
        }
        for rank in (0, 1)
    }


def test_consumed_view_per_epoch_counts_duplicates_within_an_epoch_only():
    """Two normal epochs consume every sample twice: that is not a duplicate."""
    for set_epoch in (False, True):
        view = consumed_view(_two_epochs(set_epoch), 12)
        assert view.per_epoch and view.epochs == [0, 1]
        assert view.counts() == {i: 2 for i in range(12)}
        assert view.duplicates() == {} and view.never_seen() == []
        assert "duplicates in one epoch: none" in repr(view)
    broken = consumed_view({0: {0: [0, 1], 1: [0, 2]}, 1: {0: [2, 3], 1: [0, 3]}}, 4)
    assert broken.duplicates() == {0: [0, 1]} and broken.never_seen() == [1]


def test_consumed_view_contrasts_set_epoch_with_repeating_epoch_zero():
    """Without set_epoch epoch 1 repeats epoch 0; with it the order changes and samples move."""
    without, with_ = consumed_view(_two_epochs(False), 12), consumed_view(_two_epochs(True), 12)
    assert without.repeats_first_epoch() == [1] and without.moved(1) == []
    assert "epoch 1 repeats epoch 0: same samples on the same ranks, in the same order" in (
        repr(without)
    )
    assert with_.repeats_first_epoch() == [] and with_.moved(1)
    assert f"epoch 1: a new order; {len(with_.moved(1))} of 12 samples on another rank" in (
        repr(with_)
    )
    # The grid: one row per epoch, one cell per sample; each cell's number is its position
    # in the rank's order, so identical rows mean an identical epoch.
    for view, same_rows in ((without, True), (with_, False)):
        ax = view.figure().axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["epoch 0", "epoch 1"]
        numbers = [t.get_text() for t in ax.texts]
        assert len(numbers) == 24
        assert (numbers[:12] == numbers[12:]) is same_rows
        assert "repeats epoch 0" in ax.get_title() if same_rows else "changes" in ax.get_title()


# ---------------------------------------------------------------- ring all-reduce


def test_ring_allreduce_seed_example_sum_and_avg():
    """The 4-rank example: all_reduce sums to [10, 14, 18]; averaging divides by 4 afterwards."""
    buffers = [[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]
    steps = ring_allreduce_steps(buffers)
    assert [s.phase for s in steps] == ["reduce-scatter"] * 3 + ["all-gather"] * 3
    assert steps[-1].buffers == [[10, 14, 18]] * 4
    avg = ring_allreduce_steps(buffers, op="avg")
    assert avg[-1].phase == "divide" and avg[-1].sends == []
    assert avg[-1].buffers == [[2.5, 3.5, 4.5]] * 4
    assert avg[-2].buffers == [[10, 14, 18]] * 4
    assert buffers == [[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]  # inputs untouched


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("length", [1, 7, 11])
def test_ring_allreduce_equals_sum_and_avg_for_random_inputs(n, length):
    """Every rank ends with the elementwise sum (or average) of all ranks' tensors."""
    gen = torch.Generator().manual_seed(n * 100 + length)
    tensors = [torch.randn(length, generator=gen) for _ in range(n)]
    expected = torch.stack(tensors).sum(0)
    for op, target in (("sum", expected), ("avg", expected / n)):
        steps = ring_allreduce_steps(tensors, op=op)
        assert len(steps) == 2 * (n - 1) + (op == "avg")
        for buf in steps[-1].buffers:
            assert len(buf) == length
            assert (torch.tensor(buf) - target).abs().max().item() < 1e-5


@pytest.mark.parametrize(("n", "length"), [(2, 5), (3, 7), (4, 10), (5, 11), (4, 12), (5, 3)])
def test_ring_allreduce_traffic_is_two_n_minus_one_over_n(n, length):
    """Each rank sends ~2(N-1)/N x buffer bytes (exact when N divides the length)."""
    tensors = [torch.ones(length, dtype=torch.float32) * r for r in range(n)]
    steps = ring_allreduce_steps(tensors)
    size = length * 4
    for step in steps:  # one message per rank to its right neighbour, every step
        assert sorted((src, dst) for src, dst, _c, _b in step.sends) == [
            (r, (r + 1) % n) for r in range(n)
        ]
    bounds = chunk_bounds(length, n)
    for step in steps:
        for _src, _dst, chunk, nbytes in step.sends:
            assert nbytes == (bounds[chunk][1] - bounds[chunk][0]) * 4
    per_rank = [sum(s.bytes_sent(r) for s in steps) for r in range(n)]
    for total in per_rank:
        assert abs(total - 2 * (n - 1) / n * size) < 2 * 4  # less than 2 elements of rounding
        if length % n == 0:
            assert total == 2 * (n - 1) * size // n
    assert sum(per_rank) == 2 * (n - 1) * size
    view = AllReduceStepper(tensors)
    assert view.bytes_sent() == per_rank
    assert view.naive_bytes() == (n - 1) * size


def test_ring_reduce_scatter_leaves_rank_r_owning_chunk_r_plus_one():
    """After N-1 reduce-scatter steps rank r holds the complete sum of chunk (r+1) mod N."""
    n, length = 4, 9
    rng = random.Random(1)
    buffers = [[rng.randint(-9, 9) for _ in range(length)] for _ in range(n)]
    steps = ring_allreduce_steps(buffers)
    after_rs = steps[n - 2]
    assert after_rs.phase == "reduce-scatter" and after_rs.phase_step == n - 1
    total = [sum(col) for col in zip(*buffers, strict=True)]
    for rank in range(n):
        chunk = (rank + 1) % n
        start, stop = chunk_bounds(length, n)[chunk]
        assert after_rs.buffers[rank][start:stop] == total[start:stop]
        assert after_rs.contributors[rank][chunk] == tuple(range(n))


def test_chunk_bounds_match_torch_tensor_split():
    """Chunks follow torch.tensor_split: the first length % N chunks are one longer."""
    for length in range(0, 12):
        for n in range(2, 6):
            sizes = [b - a for a, b in chunk_bounds(length, n)]
            assert sizes == [len(c) for c in torch.tensor_split(torch.arange(length), n)]


def test_stepper_default_has_no_empty_chunk():
    """The default buffers (8 elements on 4 ranks) give every chunk 2 elements, none empty."""
    view = AllReduceStepper()
    assert view.world_size == 4 and len(view.initial[0]) == 8
    assert [b - a for a, b in chunk_bounds(8, 4)] == [2, 2, 2, 2]
    for step in view.steps:  # every message carries data
        assert all(nbytes == 8 for _src, _dst, _chunk, nbytes in step.sends)
    assert view.go_to(view.num_steps).buffers() == [list(range(10, 39, 4))] * 4
    assert "chunks=[2, 2, 2, 2]" in repr(view)


def test_stepper_controls_step_next_reset_and_op():
    """The step slider, Step and Reset buttons and the op toggle drive the model and summary."""
    view = AllReduceStepper()
    assert view.num_steps == 6 and view.step == 0
    assert "step 0/6: initial buffers" in repr(view)
    view.controls["step"].value = 3
    assert view.step == 3
    text = repr(view)
    assert "step 3/6: reduce-scatter 3/3" in text
    assert "rank 3 -> rank 0: chunk 1 (8 B)" in text
    assert "rank 0: [1, 2] [18, 22]* [20, 23] [17, 19]" in text
    view.controls["next"].click()
    assert view.step == 4 and view.controls["step"].value == 4
    assert view.controls["play"].value == 4
    view.controls["reset"].click()
    assert view.step == 0 and view.controls["step"].value == 0
    view.controls["op"].value = "avg"
    assert view.num_steps == 7 and view.controls["step"].max == 7
    view.controls["step"].value = 7
    assert view.buffers() == [[2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5]] * 4
    assert "step 7/7: divide by N=4 on every rank (op='avg')" in repr(view)
    assert "total per rank: 48 B, about 2(N-1)/N x 32 B = 48 B; naive all-to-all: 96 B" in (
        repr(view)
    )


def test_stepper_figure_stripes_one_rectangle_per_contributor():
    """Each chunk's band has one stripe per rank it sums: N stripes once complete."""
    from matplotlib.patches import Rectangle

    view = AllReduceStepper()

    def stripes(step):
        ring_ax = view.figure(step=step).axes[0]
        return [p for p in ring_ax.patches if isinstance(p, Rectangle) and p.get_fill()]

    # 4 ranks x 4 chunks: one stripe each at step 0; after reduce-scatter 3 chunks of each
    # rank sum 1..3 ranks and one sums all 4 (1+2+3+4 = 10 stripes per rank).
    assert len(stripes(0)) == 16
    assert len(stripes(3)) == 4 * (1 + 2 + 3 + 4)
    assert len(stripes(view.num_steps)) == 4 * 4 * 4


def test_stepper_uses_tensor_itemsize_and_validates_input():
    """float64 tensors send 8 bytes per element; bad inputs are refused with the reason."""
    view = AllReduceStepper(
        [torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    )
    assert view.itemsize == 8 and view.buffer_bytes == 32
    assert view.bytes_sent() == [32, 32]
    with pytest.raises(ValueError, match=r"same length.*\[3, 2\]"):
        ring_allreduce_steps([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="2 to 8 ranks' buffers, got 1"):
        AllReduceStepper([[1, 2]])
    with pytest.raises(ValueError, match=r"op='max' is not supported"):
        ring_allreduce_steps([[1], [2]], op="max")
    with pytest.raises(ValueError, match=r"step=9 must be between 0 and 6"):
        AllReduceStepper().go_to(9)


# ---------------------------------------------------------------- precision


def test_precision_65000_times_2_overflows_fp16_not_bf16():
    """The seed's example: 65000 * 2 is inf in fp16 (max 65504) and finite in bf16."""
    view = PrecisionExplorer(value=65000.0, factor=2.0)
    products = view.products()
    assert math.isinf(products["float16"].stored) and products["float16"].overflow
    assert products["bfloat16"].stored == 130048.0 and not products["bfloat16"].overflow
    assert products["float32"].stored == 130000.0
    assert (torch.tensor(65000.0, dtype=torch.float16) * 2).isinf()
    reps = view.representations()
    assert reps["float16"].stored == 64992.0 and reps["float16"].abs_error == 8.0
    assert reps["bfloat16"].stored == 65024.0
    assert represent(130000.0, "fp16").overflow
    assert represent(65504.0, torch.float16).flag == "ok"
    text = repr(view)
    assert "float16   inf     inf      inf       overflow -> inf" in text


def test_precision_nan_product_is_flagged():
    """1e6 is inf in fp16, and inf * 0 is NaN there: flagged "nan", not "ok"; fp32 gives 0."""
    products = PrecisionExplorer(value=1e6, factor=0.0).products()
    assert math.isnan(products["float16"].stored) and products["float16"].flag == "nan"
    assert products["float32"].stored == 0.0 and products["float32"].flag == "ok"
    assert represent(float("nan"), "bfloat16").flag == "nan"


def test_precision_underflow_and_subnormals():
    """1e-8 underflows to 0 in fp16 but not in bf16/fp32; 1e-7 survives as an fp16 subnormal."""
    tiny = represent(1e-8, "float16")
    assert tiny.stored == 0.0 and tiny.underflow and tiny.flag == "underflow -> 0"
    assert tiny.rel_error == 1.0
    assert not represent(1e-8, "bfloat16").underflow
    assert not represent(1e-8, "float32").underflow
    sub = represent(1e-7, "float16")
    assert sub.subnormal and sub.stored != 0 and sub.exponent == "00000"
    assert not represent(1e-3, "float16").subnormal


@pytest.mark.parametrize("value", [1.0, -2.0, 0.1, 3.0e-5, 1234.5678, -7.25e30])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_precision_bits_decode_back_to_the_stored_value(value, dtype):
    """sign/exponent/mantissa strings are the real bits: decoding them gives the stored value."""
    rep = represent(value, dtype)
    if math.isinf(rep.stored):
        assert set(rep.exponent) == {"1"} and set(rep.mantissa) == {"0"}
        return
    bias = 2 ** (len(rep.exponent) - 1) - 1
    exponent = int(rep.exponent, 2)
    fraction = int(rep.mantissa, 2) / 2 ** len(rep.mantissa)
    if exponent == 0:
        magnitude = fraction * 2.0 ** (1 - bias)
    else:
        magnitude = (1 + fraction) * 2.0 ** (exponent - bias)
    assert (-magnitude if rep.sign == "1" else magnitude) == rep.stored
    assert len(rep.sign + rep.exponent + rep.mantissa) == (32 if dtype == "float32" else 16)


def test_precision_finfo_table_values():
    """The dynamic-range table: max, smallest normal, smallest subnormal, eps, digits."""
    rows = {r.dtype: r for r in finfo_table()}
    fp32, fp16, bf16 = rows["float32"], rows["float16"], rows["bfloat16"]
    assert (fp16.max, fp16.tiny, fp16.smallest_subnormal, fp16.eps) == (
        65504.0,
        2.0**-14,
        2.0**-24,
        2.0**-10,
    )
    assert (bf16.tiny, bf16.smallest_subnormal, bf16.eps) == (2.0**-126, 2.0**-133, 2.0**-7)
    assert bf16.max == pytest.approx(3.3895e38, rel=1e-4)
    assert (fp32.max, fp32.smallest_subnormal, fp32.eps) == (
        torch.finfo(torch.float32).max,
        2.0**-149,
        2.0**-23,
    )
    assert [r.digits for r in (fp32, fp16, bf16)] == [6, 3, 2]
    assert [(r.exponent_bits, r.mantissa_bits) for r in (fp32, fp16, bf16)] == [
        (8, 23),
        (5, 10),
        (8, 7),
    ]
    # the smallest subnormal really is the smallest positive number: half of it rounds to 0
    for name, row in rows.items():
        dtype = getattr(torch, name)
        assert torch.tensor(row.smallest_subnormal, dtype=dtype).item() == row.smallest_subnormal
        assert torch.tensor(row.smallest_subnormal / 2, dtype=dtype).item() == 0.0
    text = repr(PrecisionExplorer())
    assert "float16   16    5    10    65504       6.1035e-05         5.9605e-08" in text


def test_precision_controls_update_model_and_summary():
    """Typing a new value or factor recomputes every representation and the summary."""
    view = PrecisionExplorer()
    view.controls["value"].value = 1e-8
    assert view.value == 1e-8
    assert view.representations()["float16"].underflow
    assert "value 1e-08 stored as:" in repr(view)
    assert "underflow -> 0" in repr(view)
    view.controls["factor"].value = 1.0
    assert not view.products()["float16"].overflow
    assert "PrecisionExplorer(value=1e-08, factor=1.0)" in repr(view)
    view.update(value=65000.0, factor=2.0)
    assert view.controls["value"].value == 65000.0
    assert "overflow -> inf" in view._html.value


def test_loss_scale_view_from_a_real_grad_scaler():
    """scaler_step records a real GradScaler: an inf gradient skips the step, halves the scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    trace = []
    for step in range(5):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")  # what an fp16 overflow looks like
        before = model.weight.detach().clone()
        scale, skipped = scaler_step(scaler, opt)
        trace.append((step, scale, skipped))
        assert torch.equal(model.weight, before) == skipped
    assert [s for s, _, k in trace if k] == [2]
    assert [c for _, c, _ in trace] == [2.0**16, 2.0**16, 2.0**17, 2.0**16, 2.0**16]
    view = LossScaleView(trace, bf16_loss=[1.0, 0.8, 0.7, 0.6, 0.5])
    assert view.skipped_steps() == [2]
    assert view.final_scale == 2.0**16
    assert repr(view) == (
        "LossScaleView(steps=5, skipped=1, initial_scale=65536, final_scale=65536)\n"
        "skipped steps (inf/NaN gradients, scale backed off): 2\n"
        "bf16, no scaler loss: 1 -> 0.5 over 5 steps"
    )
    with pytest.raises(ValueError, match="trace is empty"):
        LossScaleView([])


def test_loss_panel_uses_log_scale_marks_skips_and_explains_an_early_rise():
    """A loss falling 100x gets a log axis; skipped steps and an early rise are marked."""
    trace = [(s, 65536.0 / (2 if s >= 2 else 1), s in (0, 2)) for s in range(12)]
    rising = [10.0, 14.0, 17.0, 8.0, 5.0, 2.0, 1.0, 0.5, 0.3, 0.2, 0.15, 0.1]
    view = LossScaleView(trace, fp16_loss=rising, bf16_loss=[1.0] * 12)
    assert view.early_rise() == (2, 17.0)
    assert repr(view).endswith("early rise: the loss goes up to 17 at step 2, then falls")
    loss_ax = view.figure().axes[1]
    assert loss_ax.get_yscale() == "log" and "log" in loss_ax.get_ylabel()
    assert [t.get_text() for t in loss_ax.texts] == ["early rise (step 2)"]
    skipped_lines = [line for line in loss_ax.lines if line.get_linestyle() == ":"]
    assert [line.get_xdata()[0] for line in skipped_lines] == [0, 2]
    # A flat loss: linear axis, no rise, nothing added to the summary.
    flat = LossScaleView(trace, bf16_loss=[1.0, 0.9, 0.8, 0.7])
    assert flat.early_rise("bf16") is None and "early rise" not in repr(flat)
    assert flat.figure().axes[1].get_yscale() == "linear"


# ---------------------------------------------------------------- shared view behaviour

SCALE_TRACE = [(0, 65536.0, False), (1, 131072.0, True), (2, 65536.0, False)]

FACTORIES = {
    "shard": lambda: ShardExplorer(dataset_len=11, world_size=3, shuffle=True, epoch=1),
    "shard_no_set_epoch": lambda: ShardExplorer(shuffle=True, set_epoch=False, drop_last=True),
    "consumed": lambda: ConsumedView({0: [0, 2, 4], 1: [1, 3, 0]}, 6),
    "allreduce": lambda: AllReduceStepper(step=2),
    "allreduce_avg": lambda: AllReduceStepper([[1.0] * 5, [2.0] * 5, [3.0] * 5], op="avg", step=5),
    "precision": lambda: PrecisionExplorer(value=1e-7),
    "loss_scale": lambda: LossScaleView(SCALE_TRACE, bf16_loss=[1.0, 0.9, 0.8]),
    "loss_scale_only": lambda: LossScaleView(SCALE_TRACE),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_figure_renders_with_agg_and_has_a_title(name):
    """figure() returns a matplotlib Figure (no pyplot) that renders to PNG and has a title."""
    from matplotlib.figure import Figure

    fig = FACTORIES[name]().figure()
    assert isinstance(fig, Figure)
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)  # draws every artist with Agg
    assert buf.getvalue().startswith(b"\x89PNG")
    titles = [
        " ".join(ax.get_title(loc=loc) for loc in ("left", "center", "right")).strip()
        for ax in fig.axes
    ]
    assert fig.get_suptitle() or titles[0]
    assert all(titles), titles  # every panel says what it shows
    if "matplotlib.pyplot" in sys.modules:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []


def test_allreduce_figure_draws_any_step():
    """figure(step=k) works for every step, and refuses a step out of range."""
    view = AllReduceStepper([[1, 2, 3, 4, 5]] * 3)
    for k in (0, view.num_steps):
        assert view.figure(step=k).get_suptitle()
    with pytest.raises(ValueError, match="step=5 must be between 0 and 4"):
        view.figure(step=5)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_repr_is_deterministic_and_is_the_plain_text_bundle(name):
    """Two fresh views print the same text, without ids or addresses; it is the text/plain."""
    first, second = FACTORIES[name](), FACTORIES[name]()
    assert repr(first) == repr(second) == str(first)
    assert not re.search(r"0x[0-9a-fA-F]{4,}|object at|model_id", repr(first))
    bundle = first._repr_mimebundle_()
    assert bundle == {"text/plain": repr(first)}  # no kernel here: text only


@pytest.mark.parametrize(
    ("name", "css", "controls"),
    [
        (
            "shard",
            "nb-dist-shard-explorer",
            {
                "dataset_len",
                "world_size",
                "batch_size",
                "shuffle",
                "seed",
                "epoch",
                "drop_last",
                "set_epoch",
            },
        ),
        ("allreduce", "nb-dist-allreduce-stepper", {"play", "step", "next", "reset", "op", "ring"}),
        ("precision", "nb-dist-precision-explorer", {"value", "factor"}),
    ],
)
def test_widgets_have_stable_css_classes_labels_and_a_widget_view(name, css, controls):
    """Container and controls carry stable CSS classes and labels; frontends get a widget view."""
    import ipywidgets

    view = FACTORIES[name]()
    assert isinstance(view.widget, ipywidgets.VBox)
    assert css in view.widget._dom_classes and "nb-dist-view" in view.widget._dom_classes
    assert set(view.controls) == controls
    for key, control in view.controls.items():
        assert f"{css}-{key.replace('_', '-')}" in control._dom_classes
        assert control.description
    rich = view._rich_bundle()
    assert rich[WIDGET_KEY]["model_id"] == view.widget.model_id


def test_ring_diagram_checkbox_renders_the_figure_into_the_widget():
    """Ticking 'ring diagram' puts a PNG of the current step into the widget's Image."""
    view = AllReduceStepper()
    view.controls["ring"].value = True
    assert bytes(view._image.value).startswith(b"\x89PNG")
    first = bytes(view._image.value)
    view.controls["step"].value = 1
    assert bytes(view._image.value) != first


def test_static_views_offer_a_png_to_frontends():
    """ConsumedView and LossScaleView give frontends their figure as image/png."""
    for view in (FACTORIES["consumed"](), FACTORIES["loss_scale"]()):
        assert view._rich_bundle()["image/png"].startswith(b"\x89PNG")
