"""The teaching instruments: CollectiveLog on 2 real gloo ranks, GraphRecorder in one process.

The collectives are issued every way a notebook or a library issues them (the public function,
an alias imported from ``torch.distributed``, ``distributed_c10d``, the process group's own
method, an asynchronous call, DDP's C++ reducer, a functional collective); the log must see each
once, with the bytes of its full buffer, and nothing outside its ``with`` block.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nb_dist import notebook_launcher
from nb_dist.teach.instruments import CollectiveLog, GraphRecorder

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def _every_way() -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed import all_reduce as aliased_all_reduce
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nb_dist.teach import all_gather_single, reduce_scatter_single

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.all_reduce(torch.ones(3))  # outside the log: not recorded
    out: dict[str, object] = {}
    with CollectiveLog() as log:
        dist.all_reduce(torch.ones(10))  # 40 bytes
        aliased_all_reduce(torch.ones(5))  # 20
        distributed_c10d.all_reduce(torch.ones(2))  # 8
        dist.group.WORLD.allreduce([torch.ones(4)]).wait()  # 16: the process group's method
        dist.all_reduce(torch.ones(1), async_op=True).wait()  # 4
        dist.broadcast(torch.ones(6), src=0)  # 24
        all_gather_single(torch.empty(3 * world), torch.ones(3))  # 12 * world: the output
        dist.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2))  # 8 * world
        reduce_scatter_single(torch.empty(4), torch.ones(4 * world))  # 16 * world: the input
        dist.barrier()
        x = torch.ones(2, 3)  # not collectives: not recorded
        (x @ x.T).sum()
    out["plain"] = log.calls
    out["counts"] = log.counts()
    out["all-reduce bytes"] = log.bytes("all-reduce")
    out["total bytes"] = log.bytes()
    out["outside"] = len(log.calls)
    dist.all_reduce(torch.ones(3))  # after the block: not recorded
    out["after"] = len(log.calls)

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))  # 10 parameters: one bucket, one all-reduce of 40 bytes
    with CollectiveLog() as ddp_log:
        model(torch.ones(3, 4)).sum().backward()
    out["ddp"] = ddp_log.calls

    from torch.distributed import _functional_collectives as funcol

    with CollectiveLog() as functional_log:
        funcol.all_reduce(torch.ones(7), "sum", dist.group.WORLD).wait()
    out["functional"] = functional_log.calls
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_collective_log_sees_every_way_of_issuing_a_collective():
    results = list(notebook_launcher(_every_way, num_processes=2))
    assert len(results) == 2
    for out in results:
        assert out["plain"][:-1] == [
            ("all-reduce", 40),
            ("all-reduce", 20),
            ("all-reduce", 8),
            ("all-reduce", 16),
            ("all-reduce", 4),
            ("broadcast", 24),
            ("all-gather", 24),
            ("all-gather", 16),
            ("reduce-scatter", 32),
        ]
        assert out["plain"][-1][0] == "barrier"  # its bytes: whatever tensor gloo passes
        assert out["counts"] == {
            "all-reduce": 5,
            "broadcast": 1,
            "all-gather": 2,
            "reduce-scatter": 1,
            "barrier": 1,
        }
        assert out["all-reduce bytes"] == 88
        assert out["outside"] == out["after"] == 10
        assert out["ddp"] == [("all-reduce", 40)]
        assert out["functional"] == [("all-reduce", 28)]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head_out = nn.Linear(4, 1)  # an underscore in a module's name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head_out(x)


@pytest.mark.timeout(180)
def test_graph_recorder_names_the_parameters_of_each_graph():
    torch.manual_seed(0)
    model = _Net()
    recorder = GraphRecorder(model)
    x = torch.randn(3, 4)
    expected = model(x)
    torch._dynamo.reset()
    got = torch.compile(model, backend=recorder)(x)
    torch._dynamo.reset()
    assert torch.allclose(got, expected)  # the graph runs as captured
    assert recorder.graphs == [[name for name, _ in model.named_parameters()]]
    assert recorder.modules() == [["layers.0", "layers.1", "head_out"]]
