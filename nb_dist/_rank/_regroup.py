"""Runs in a live rank: free ranks blocked in a collective, then form the default group again.

A rank blocked inside a gloo collective runs no Python and ignores interrupts, and torch's
``ProcessGroup.abort()`` does not wake a pending gloo collective (torch 2.13). What does is the
other side of its connections going away: a collective whose peer closed fails at once with
"Connection closed by peer", as in a launch when a rank exits. So a rank that is idle (it
finished the cell) shuts down its own TCP connections to the other ranks' processes
(:func:`drop_connections`): the blocked ranks' collectives raise, their cells end, and every
rank keeps its Python state. Then every rank forms the default process group again on a fresh
key prefix of the kernel's store (:func:`regroup`); the old group objects stay referenced
(``_groups.py``) and are never used again. Objects bound to the old group (a
``DistributedDataParallel`` model, subgroups from ``new_group``) must be built again; plain
tensors, models, optimizers and samplers are untouched.

Both run as the functions of ordinary live-rank calls, sent by ``_live/_session.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

from .._shared import _collectives


def drop_connections(rank_pids: list[int]) -> int:
    """Shut down this process's TCP connections to the other processes of ``rank_pids`` (the
    session's ranks: their process groups' sockets, never the kernel's store); how many."""
    import psutil

    peers: set[tuple[str, int]] = set()
    for pid in rank_pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            peers.update(
                (c.laddr.ip, c.laddr.port)
                for c in psutil.Process(pid).net_connections("tcp")
                if c.laddr
            )
    dropped = 0
    for conn in psutil.Process().net_connections("tcp"):
        if conn.fd < 0 or not conn.raddr or (conn.raddr.ip, conn.raddr.port) not in peers:
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
