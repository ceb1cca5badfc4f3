"""nb_dist.teach's torch 2.13 names, on real ranks, on whichever torch is installed.

The main suite runs them on torch 2.13 and later (the new names), the Kaggle profile of
.ci/run on torch 2.10 (the older ones): the same calls give the same results on both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nb_dist import notebook_launcher
from nb_dist.teach import all_gather_single, ddp_buffer_sync, reduce_scatter_single, torch_name

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def test_torch_name_is_a_function_this_torch_has():
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        assert callable(getattr(dist, torch_name(name))), name
    assert torch_name("all_reduce") == "all_reduce"
    # The new name where torch has it, else the older one: never a name torch lacks.
    new = hasattr(dist, "all_gather_single")
    assert torch_name("all_gather_single") == (
        "all_gather_single" if new else "all_gather_into_tensor"
    )


def test_ddp_buffer_sync_names_a_keyword_this_ddp_takes():
    (keyword,) = ddp_buffer_sync(False)
    assert keyword in ("forward_sync_buffers", "broadcast_buffers")
    assert ddp_buffer_sync(True) == {keyword: True}


def _collectives():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(2 * world)
    all_gather_single(gathered, torch.tensor([rank, 10.0 * rank]))
    summed = torch.empty(2)
    reduce_scatter_single(summed, torch.arange(2.0 * world) + rank)  # rank r gets chunk r
    largest = torch.empty(2)
    reduce_scatter_single(largest, torch.arange(2.0 * world) * (rank + 1), op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return gathered.tolist(), summed.tolist(), largest.tolist()


@pytest.mark.timeout(60)
def test_the_collectives_gather_and_scatter_on_real_ranks():
    results = notebook_launcher(_collectives, num_processes=2, output="none")
    for rank, (gathered, summed, largest) in enumerate(results):
        assert gathered == [0.0, 0.0, 1.0, 10.0]
        # sum over ranks r' of (arange(4) + r'), chunk `rank`: 2 * [2 rank, 2 rank + 1] + 1
        assert summed == [4.0 * rank + 1, 4.0 * rank + 3]
        # max over r' of arange(4) * (r' + 1) is arange(4) * 2
        assert largest == [4.0 * rank, 4.0 * rank + 2]


def _buffers(sync: bool):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.BatchNorm1d(2), **ddp_buffer_sync(sync))
    model(torch.full((4, 2), float(dist.get_rank())) + torch.arange(4.0).unsqueeze(1))  # own data
    mean = model.module.running_mean.tolist()
    model.eval()
    model(torch.zeros(1, 2))  # the next forward copies rank 0's buffers when syncing
    synced = model.module.running_mean.tolist()
    dist.destroy_process_group()
    return mean, synced


@pytest.mark.timeout(60)
def test_ddp_buffer_sync_turns_the_copy_of_rank_0s_buffers_on_and_off():
    on = notebook_launcher(_buffers, args=(True,), num_processes=2, output="none")
    off = notebook_launcher(_buffers, args=(False,), num_processes=2, output="none")
    assert on[0][1] == on[1][1] == on[0][0]  # every rank ends with rank 0's statistics
    assert off[0][1] != off[1][1]  # each rank keeps its own
    assert off[1][1] == off[1][0]
