"""Starting the ranks of one attempt: their pipes, the start gate and the lifeline.

Each rank gets five pipes (four to the kernel, ``commands`` from it; see ``_protocol.py``) and
two shared ones:

- the **lifeline**: the kernel keeps the only write end; when the kernel dies, every worker
  reads EOF and kills itself (besides the parent-death signal);
- the **start gate**: workers wait for EOF on it before any user code runs. The kernel
  closes its write end once every rank is started, so no rank connects to the rendezvous
  store while another is still being forked (a fork would copy a lock the store's server
  thread holds, see ``_rank/_entry._wait_for_gate``).

A forked worker closes every kernel-side end it inherited (other ranks' read ends, the
lifeline's and the gate's write ends), or EOF would never come.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._rank._spec import WorkerChannels, WorkerSpec
from . import _processes
from ._rank_handle import Rank

#: Builds one rank's spec from its local rank and the kernel-side fds it must close.
SpecFor = Callable[[int, list[int]], WorkerSpec]

#: Pipe ends the kernel holds for ranks that may outlive their start (live ranks, a rank kept
#: for a post-mortem). A rank forked later closes them too: a copy in another process would
#: keep a closed ``commands`` pipe or a lifeline from ever reaching EOF.
_kernel_ends: weakref.WeakSet[Connection] = weakref.WeakSet()


def _other_kernel_ends() -> list[int]:
    return [conn.fileno() for conn in list(_kernel_ends) if not conn.closed]


def start_all(method: str, ranks: list[Rank], spec_for: SpecFor) -> Connection:
    """Start every rank, then open the gate; the lifeline's write end, for the kernel to keep.

    If a rank cannot start (or an interrupt arrives), the ranks already started are killed
    while they still wait at the gate, so none runs the function.
    """
    lifeline_reader, lifeline_writer = multiprocessing.Pipe(duplex=False)
    gate_reader, gate_writer = multiprocessing.Pipe(duplex=False)
    context = _processes.forkserver_context() if method == "forkserver" else None
    kernel_ends = [lifeline_writer.fileno(), gate_writer.fileno(), *_other_kernel_ends()]
    try:
        for rank in ranks:
            writers = rank.open_pipes()
            channels = WorkerChannels(**writers, lifeline=lifeline_reader, gate=gate_reader)
            kernel_fds = [c.fileno() for r in ranks for c in r.kernel_ends()] + kernel_ends
            try:
                process = _processes.start(
                    method, spec_for(rank.index, kernel_fds), channels, context
                )
            finally:
                for writer in writers.values():  # the worker has its own copies now
                    writer.close()
            rank.process = process
            rank.outcome.pid = process.pid
    except BaseException:
        for rank in ranks:
            if rank.alive and rank.process is not None:
                rank.request_stop()
                rank.returncode = rank.process.kill_and_reap()
                rank.exited_at = time.monotonic()
        lifeline_writer.close()
        raise
    finally:
        for conn in (lifeline_reader, gate_writer, gate_reader):
            conn.close()  # the gate opens: EOF for every worker
    _kernel_ends.update([lifeline_writer, *(c for rank in ranks for c in rank.kernel_ends())])
    return lifeline_writer
