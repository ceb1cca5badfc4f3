"""Free live ranks blocked in a collective, then form the default group again.

A rank blocked inside a gloo collective runs no Python and ignores interrupts, and torch's
``ProcessGroup.abort()`` does not wake a pending gloo collective (torch 2.13). What does is the
other side of its connections going away: a collective whose peer closed fails at once with
"Connection closed by peer", as in a launch when a rank exits. So a rank that is idle (it
finished the cell) shuts down its own TCP connections to the other ranks' sockets
(:func:`drop_connections`; their addresses read where the ranks run, :func:`endpoints`: by
the kernel on one machine, by each node's agent on a cluster): the blocked ranks'
collectives raise, their cells end, and every rank keeps its Python state. Then every rank
forms the default process group again on a fresh key prefix of the launch's store
(:func:`regroup`); the old group objects stay referenced (``_groups.py``) and are never used
again. Objects bound to the old group (a ``DistributedDataParallel`` model, subgroups from
``new_group``) must be built again; plain tensors, models, optimizers and samplers are
untouched.

:func:`endpoints` runs where the ranks run (the kernel, or a node's agent);
:func:`drop_connections` and :func:`regroup` run in the ranks, as ordinary live-rank calls
sent by ``_live/_session.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from datetime import timedelta

from .._shared import _collectives
from .._shared._net import tcp_connections


def endpoints(pids: Iterable[int]) -> list[tuple[str, int]]:
    """The local addresses of every TCP socket of the processes ``pids`` (ranks on this
    machine: their process groups' connections and listening sockets). Run where those
    processes are: the kernel for its own ranks, a node's agent for the ranks on its node."""
    import psutil

    found: set[tuple[str, int]] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.update(
                (c.laddr.ip, c.laddr.port) for c in tcp_connections(psutil.Process(pid))
                if c.laddr
            )  # fmt: skip
    return sorted(found)


def drop_connections(peers: Iterable[tuple[str, int]]) -> int:
    """Shut down this process's TCP connections to ``peers`` (the session's ranks' socket
    addresses, :func:`endpoints`: their process groups' sockets, never the kernel's store);
    how many."""
    import psutil

    connections = tcp_connections(psutil.Process())
    own = {(c.laddr.ip, c.laddr.port) for c in connections if c.laddr}
    wanted = {(ip, port) for ip, port in peers} - own
    dropped = 0
    for conn in connections:
        if conn.fd < 0 or not conn.raddr or (conn.raddr.ip, conn.raddr.port) not in wanted:
            continue
        with contextlib.suppress(OSError):
            # A duplicate of the descriptor: shutdown() acts on the connection itself, which
            # gloo's own descriptor shares; closing the duplicate leaves gloo's open.
            sock = socket.socket(fileno=os.dup(conn.fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
                dropped += 1
            finally:
                sock.close()
    return dropped


def regroup(generation: int, timeout: float) -> int:
    """Form the default process group again (same backend, rank and size) on the kernel's
    store under a fresh prefix; the collective counts start again from zero. The world size."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if dist.is_initialized():
        dist.destroy_process_group()  # its object stays referenced until os._exit
    limit = timedelta(seconds=timeout)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=False, timeout=limit,
    )  # fmt: skip
    prefixed = dist.PrefixStore(f"nb_dist/regroup/{generation}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=limit)
    _collectives.restart_count()
    return dist.get_world_size()
