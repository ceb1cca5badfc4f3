"""Instruments for the teaching notebooks: what a rank communicates, what a compiler captured.

:class:`CollectiveLog` records every collective a rank runs while it is active, whoever issues
it: the notebook's own code, DDP's C++ reducer, FSDP, DTensor or a compiled graph. It is a
``TorchDispatchMode``: every operation passes through it, and the collectives are the
operations of the ``c10d`` namespace (``torch.ops.c10d.allreduce_`` and friends, which every
``torch.distributed`` function and every ``ProcessGroup`` method ends in) and of
``_c10d_functional`` (the functional collectives of DTensor and ``torch.compile``). Patching
the ``torch.distributed`` functions instead misses aliases (``from torch.distributed import
all_reduce``), calls into ``distributed_c10d`` and C++, and so counts differently on different
torch versions; the operations seen here are the same on torch 2.10 to 2.13.

:class:`GraphRecorder` is a ``torch.compile`` backend that records, for each graph it is given,
which of a model's parameters the graph takes, and runs the graph unchanged.

Usage in a rank::

    with CollectiveLog() as log:
        loss = model(x).sum()
        loss.backward()
    log.counts()  # {"all-gather": 16, "reduce-scatter": 8}
    log.calls  # [("all-gather", 16384), ...]: (name, bytes of the full buffer)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVES", "CollectiveLog", "GraphRecorder"]


def _nbytes_all(value: Any) -> int:
    """Bytes of a tensor, or of all the tensors in a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, list | tuple):
        return sum(_nbytes_all(v) for v in value)
    return 0


def _argument(index: int) -> Callable[[tuple[Any, ...]], int]:
    return lambda args: _nbytes_all(args[index])


def _gathered(args: tuple[Any, ...]) -> int:  # _c10d_functional.all_gather_into_tensor
    return _nbytes_all(args[0]) * int(args[1])


#: ``(namespace, operation)``: (the name recorded, the bytes of its full buffer from its
#: arguments). The full buffer is the tensor all-reduced or broadcast, the *output* of an
#: all-gather and the *input* of a reduce-scatter: the unit in which ZeRO's paper counts Ψ.
COLLECTIVES: dict[tuple[str, str], tuple[str, Callable[[tuple[Any, ...]], int]]] = {
    ("c10d", "allreduce_"): ("all-reduce", _argument(0)),
    ("c10d", "allreduce_coalesced_"): ("all-reduce", _argument(0)),
    ("c10d", "broadcast_"): ("broadcast", _argument(0)),
    ("c10d", "reduce_"): ("reduce", _argument(0)),
    ("c10d", "allgather_"): ("all-gather", _argument(0)),
    ("c10d", "_allgather_base_"): ("all-gather", _argument(0)),
    ("c10d", "allgather_coalesced_"): ("all-gather", _argument(0)),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all-gather", _argument(0)),
    ("c10d", "reduce_scatter_"): ("reduce-scatter", _argument(1)),
    ("c10d", "_reduce_scatter_base_"): ("reduce-scatter", _argument(1)),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce-scatter", _argument(1)),
    ("c10d", "alltoall_"): ("all-to-all", _argument(1)),
    ("c10d", "alltoall_base_"): ("all-to-all", _argument(1)),
    ("c10d", "gather_"): ("gather", _argument(1)),
    ("c10d", "scatter_"): ("scatter", _argument(0)),
    ("c10d", "send"): ("send", _argument(0)),
    ("c10d", "recv_"): ("recv", _argument(0)),
    ("c10d", "barrier"): ("barrier", _argument(0)),
    ("_c10d_functional", "all_reduce"): ("all-reduce", _argument(0)),
    ("_c10d_functional", "all_reduce_"): ("all-reduce", _argument(0)),
    ("_c10d_functional", "all_reduce_coalesced"): ("all-reduce", _argument(0)),
    ("_c10d_functional", "broadcast"): ("broadcast", _argument(0)),
    ("_c10d_functional", "all_gather_into_tensor"): ("all-gather", _gathered),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce-scatter", _argument(0)),
    ("_c10d_functional", "all_to_all_single"): ("all-to-all", _argument(0)),
}


class CollectiveLog(TorchDispatchMode):
    """Record the collectives this process runs while the ``with`` block is active.

    ``calls`` is a list of ``(name, bytes)`` in the order they were issued: ``name`` is one
    of ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"broadcast"``,
    ``"all-to-all"``, ``"reduce"``, ``"gather"``, ``"scatter"``, ``"send"``, ``"recv"`` or
    ``"barrier"`` (the values of :data:`COLLECTIVES`); ``bytes`` is the size of the
    collective's full buffer on this rank. An asynchronous collective is recorded when it is
    issued. Everything else runs untouched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        known = COLLECTIVES.get((func.namespace, func.overloadpacket.__name__))
        if known is not None:
            name, size = known
            self.calls.append((name, size(args)))
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        """How many collectives of each name, in the order each name first appeared."""
        return dict(Counter(name for name, _ in self.calls))

    def count(self, name: str) -> int:
        """How many collectives called ``name`` (0 when none)."""
        return sum(1 for recorded, _ in self.calls if recorded == name)

    def bytes(self, name: str | None = None) -> int:
        """Total bytes of the collectives called ``name`` (of all of them when ``None``)."""
        return sum(size for recorded, size in self.calls if name in (None, recorded))


def _dynamo_name(parameter: str) -> str:
    """The placeholder name dynamo gives parameter ``layers.0.weight`` of the compiled module."""
    *modules, last = parameter.split(".")
    path = "".join(f"modules_{m}_" for m in modules)
    return f"l_self_{path}parameters_{last}_".lower()


class GraphRecorder:
    """A ``torch.compile`` backend that records which parameters each captured graph takes.

    ``GraphRecorder(model)``: ``model`` is the module whose ``forward`` dynamo traces (for
    ``torch.compile(DDP(model))`` and ``DDP(torch.compile(model))`` alike, the module inside
    DDP). ``graphs`` gets one list per graph the backend is called with: the names of
    ``model``'s parameters the graph takes as inputs (as ``model.named_parameters()`` spells
    them), in the graph's order. :meth:`modules` gives the same per module. Each graph then
    runs as captured (``gm.forward``), like ``backend="eager"``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.graphs: list[list[str]] = []
        names = [name for name, _ in model.named_parameters()]
        self._by_placeholder = {_dynamo_name(name): name for name in names}
        self._names = set(names)

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Iterable[Any]
    ) -> Callable[..., Any]:
        taken = []
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name.lower() in self._by_placeholder:
                taken.append(self._by_placeholder[node.name.lower()])
            elif node.op == "get_attr" and str(node.target) in self._names:
                taken.append(str(node.target))  # torch versions that do not lift parameters
        self.graphs.append(taken)
        return gm.forward

    def modules(self) -> list[list[str]]:
        """For each graph, the modules whose parameters it takes (``"layers.0"``, ``"head"``)."""
        out = []
        for graph in self.graphs:
            modules: list[str] = []
            for name in graph:
                module = re.sub(r"\.?[^.]+$", "", name)
                if module not in modules:
                    modules.append(module)
            out.append(modules)
        return out
