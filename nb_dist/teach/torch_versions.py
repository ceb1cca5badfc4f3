"""torch 2.13's names for a few distributed APIs, on the older torch Colab and Kaggle ship.

torch 2.13 renamed the single-tensor collectives (``all_gather_into_tensor`` became
``all_gather_single``, ``reduce_scatter_tensor`` became ``reduce_scatter_single``) and DDP's
``broadcast_buffers`` keyword (now ``forward_sync_buffers``). The notebooks teach the new names;
these helpers call whichever one the installed torch has, so the same cell runs on torch 2.10
and on the newest. torch is looked up at call time: importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, ReduceOp, Work

__all__ = ["all_gather_single", "ddp_buffer_sync", "reduce_scatter_single", "torch_name"]

# torch 2.13's name -> the name older releases give the same function.
_OLDER_NAMES = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


def torch_name(name: str) -> str:
    """The name the installed torch gives ``torch.distributed``'s collective ``name``.

    ``torch_name("all_gather_single")`` is ``"all_gather_single"`` on torch 2.13 and later and
    ``"all_gather_into_tensor"`` before; a name that was never renamed comes back unchanged.
    """
    import torch.distributed as dist

    if name not in _OLDER_NAMES or hasattr(dist, name):
        return name
    return _OLDER_NAMES[name]


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``dist.all_gather_single`` (torch >= 2.13), or ``all_gather_into_tensor`` before.

    Every rank's ``input_tensor``, concatenated in rank order along dimension 0, lands in
    ``output_tensor`` on every rank.
    """
    import torch.distributed as dist

    function = getattr(dist, torch_name("all_gather_single"))
    return function(output_tensor, input_tensor, group=group, async_op=async_op)  # type: ignore[no-any-return]


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,  # torch's own parameter name
    op: ReduceOp.RedOpType | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``dist.reduce_scatter_single`` (torch >= 2.13), or ``reduce_scatter_tensor`` before.

    ``input`` is reduced over the ranks (``op``, a sum by default) and cut into world-size
    chunks along dimension 0; rank ``r`` gets chunk ``r`` in ``output``.
    """
    import torch.distributed as dist

    function = getattr(dist, torch_name("reduce_scatter_single"))
    reduce_op = dist.ReduceOp.SUM if op is None else op
    return function(output, input, op=reduce_op, group=group, async_op=async_op)  # type: ignore[no-any-return]


def ddp_buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's keyword for copying rank 0's buffers at each forward, set to ``enabled``.

    ``DDP(model, **ddp_buffer_sync(False))`` passes ``forward_sync_buffers=False`` on torch
    2.13 and later and ``broadcast_buffers=False`` before (the keyword's older name).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    return {name: enabled}
