"""Starting the ranks of one attempt: their pipes, the start gate and the lifeline.

Each rank gets five pipes (four to the kernel, ``commands`` from it; see ``_protocol.py``) and
two shared ones, the **lifeline** (the kernel keeps its only write end; when the kernel dies,
every rank reads EOF and kills itself, besides the parent-death signal) and the **start
gate** (no rank runs user code before all are started; ``_rank/_entry._wait_for_gate``),
both from ``_shared/_starting.py``, which a cluster node's agent uses too.

A forked rank closes every kernel-side end it inherited (other ranks' read ends, the
lifeline's and the gate's write ends), or EOF would never come.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._rank._spec import RankChannels, RankSpec
from .._shared._starting import gated_start
from . import _processes
from ._rank_handle import Rank

#: Builds one rank's spec from its local rank and the kernel-side fds it must close.
SpecFor = Callable[[int, list[int]], RankSpec]

#: Pipe ends the kernel holds for ranks that may outlive their start (live ranks, a rank kept
#: for a post-mortem). A rank forked later closes them too: a copy in another process would
#: keep a closed ``commands`` pipe or a lifeline from ever reaching EOF.
_kernel_ends: weakref.WeakSet[Connection] = weakref.WeakSet()


def _other_kernel_ends() -> list[int]:
    return [conn.fileno() for conn in list(_kernel_ends) if not conn.closed]


def start_all(method: str, ranks: list[Rank], spec_for: SpecFor) -> Connection:
    """Start every rank, then open the gate; the lifeline's write end, for the kernel to keep.

    If a rank cannot start (or an interrupt arrives), the ranks already started are killed
    while they still wait at the gate, so none runs the function (``_starting.gated_start``).
    """
    context = _processes.forkserver_context() if method == "forkserver" else None

    def kill_started() -> None:
        for rank in ranks:
            rank.kill()

    with gated_start(kill_started) as gate:
        kernel_ends = [*gate.starter_fds(), *_other_kernel_ends()]
        for rank in ranks:
            writers = rank.open_pipes()
            channels = RankChannels(**writers, lifeline=gate.lifeline_end, gate=gate.gate_end)
            kernel_fds = [c.fileno() for r in ranks for c in r.kernel_ends()] + kernel_ends
            try:
                process = _processes.start(
                    method, spec_for(rank.index, kernel_fds), channels, context
                )
            finally:
                for writer in writers.values():  # the rank has its own copies now
                    writer.close()
            rank.attach(process)
    _kernel_ends.update([gate.lifeline, *(c for rank in ranks for c in rank.kernel_ends())])
    return gate.lifeline
