"""Starting one run's ranks, wherever they start: the kernel, or a cluster node's agent.

Runs on both sides of a cluster launch (the kernel and each node agent), so it is written
once here: the rendezvous store a run hosts, its scratch folder and each rank's files in it,
the start gate and the lifeline, a large pipe for a rank's values, and how long a dead
rank's pipes are still read.

- The **store** is torch's ``TCPStore``, hosted by whoever starts rank 0 (the kernel, or
  rank 0's node agent), listening on the ranks' address only, on port 0 unless a port is
  asked for: the OS picks a free port the store already owns, so no other program can take
  it in between. A starter whose ranks other machines reach (node 0 of a launch placed by
  hand) opens the port first and starts the server after its forks (:func:`store_socket`).
- The **scratch folder** holds each rank's error file and collective counter, in memory
  (``/dev/shm``) where possible: a counter is written at every collective.
- The **start gate**: ranks wait for EOF on it before any user code runs, and the starter
  closes its write end once every rank is started, so no rank connects to the store while
  another is still being forked (a fork would copy a lock the store's server thread holds).
- The **lifeline**: the starter keeps its only write end; when the starter dies, every rank
  reads EOF and kills itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from .._shared import _collectives
from .._shared._protocol import COLLECTIVES_ENV, PIPES

#: How long ranks may take to reach the rendezvous store (the store's client timeout).
STORE_TIMEOUT = 300.0
#: How long a dead rank's pipes are still read (a grandchild may hold them open).
DRAIN_AFTER_EXIT = 1.0


def host_store(address: str, port: int | None, world_size: int, only_there: bool = True) -> Any:
    """Host a run's rendezvous store (``torch.distributed.TCPStore``) on ``address`` only;
    ``port=None``: a free one, read back from ``store.port``. :func:`store_socket`, then
    :func:`serve_store` at once; see there."""
    return serve_store(store_socket(address, port, only_there), address, world_size)


def store_socket(address: str, port: int | None, only_there: bool = True) -> socket.socket:
    """The listening socket of a run's rendezvous store, before its server starts.

    Left to itself the store listens on every interface of the machine (``::``), and it
    authenticates nobody: anyone who reaches it could join the ranks' rendezvous. So the
    socket is bound to ``address`` (``127.0.0.1`` for a launch on one machine, the node's
    cluster address on a cluster) and handed to torch's store (:func:`serve_store`). An
    ``OSError`` if the port is taken or the address is not this machine's.
    ``only_there=False`` (a launch placed by hand on several machines, whose ``master_addr``
    may be a host name this machine resolves to a loopback address, as Debian's
    ``/etc/hosts`` does): every interface, as torchrun's store.

    Clients that connect before the server starts wait in the socket's backlog: a starter
    whose ranks are forked while other machines' ranks may already connect (node 0 of a
    launch placed by hand) opens the socket, forks, and only then starts the server. A
    server thread that accepts a connection looks the peer's name up (``getnameinfo``),
    holding glibc's resolver lock; a rank forked at that moment inherits the lock held and
    hangs in its own first lookup, inside ``init_process_group``, for ever."""
    if only_there:
        family, kind, proto, _, where = socket.getaddrinfo(
            address, port or 0, type=socket.SOCK_STREAM
        )[0]
    else:
        family, kind, proto, where = socket.AF_INET6, socket.SOCK_STREAM, 0, ("::", port or 0)
    try:
        listener = socket.socket(family, kind, proto)
    except OSError:
        if only_there:
            raise
        # No IPv6 on this machine: every IPv4 interface.
        family, where = socket.AF_INET, ("0.0.0.0", port or 0)
        listener = socket.socket(family, kind, proto)
    try:
        if family == socket.AF_INET6 and not only_there:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 as well
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own does
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


def serve_store(listener: socket.socket, address: str, world_size: int) -> Any:
    """Start torch's store server on ``listener`` (from :func:`store_socket`), which it owns
    from then on (it closes the socket when it stops; so does a failure here)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(
            host_name=address,
            port=listener.getsockname()[1],
            world_size=world_size,
            is_master=True,
            timeout=timedelta(seconds=STORE_TIMEOUT),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now and closes it when it stops
    return store


def scratch_folder(prefix: str) -> str:
    """A private folder for a run's per-rank files: in memory (``/dev/shm``) where possible."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=where)


def rank_files(folder: str, rank: int) -> dict[str, str]:
    """Rank ``rank``'s files in a run's scratch folder, as the environment that names them:
    its error file (where torch's ``@record`` writes a failing rank's error, as torchrun
    sets one per rank) and its collective counter."""
    own = os.path.join(folder, str(rank))
    os.makedirs(own, exist_ok=True)
    return {
        "TORCHELASTIC_ERROR_FILE": os.path.join(own, "error.json"),
        COLLECTIVES_ENV: _collectives.create(own, rank),
    }


#: Pipe ends this process holds for ranks that may outlive their start (live ranks, a rank
#: kept for a post-mortem, a cluster's ranks whose pipes are forwarded here). A rank forked
#: later closes them: a copy in another process would keep a closed ``commands`` pipe, a
#: forwarded output pipe or a lifeline from ever reaching EOF.
_held: weakref.WeakSet[Connection] = weakref.WeakSet()


def hold_out_of_forks(conns: Iterable[Connection]) -> None:
    """Keep ``conns`` out of every rank forked from now on (see :data:`_held`)."""
    _held.update(conns)


def held_fds() -> list[int]:
    """The descriptors a rank forked now must close: the open ends kept by
    :func:`hold_out_of_forks`."""
    return [conn.fileno() for conn in list(_held) if not conn.closed]


def widen(conn: Connection, size: int = 1 << 20) -> None:
    """A ``size``-byte pipe buffer where Linux allows it (the default is 64 kB): a large
    value leaves a rank, and crosses into the kernel's pipe, in 1 MB writes."""
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)


@dataclass
class RankPipes:
    """One rank's pipes, both ends: what it says (``_protocol.PIPES``) and what it is told
    (``commands``: the debugger's answers, a live rank's tasks)."""

    #: The reading ends of what the rank says, by kind: the starter's.
    readers: dict[str, Connection]
    #: The writing end of what the rank is told: the starter's.
    commands: Connection
    #: The rank's ends: each kind's writing end, and ``"commands"``'s reading end.
    theirs: dict[str, Connection]


def open_rank_pipes() -> RankPipes:
    """The pipes of a rank about to start (the kernel's or a node agent's): the same five
    on both sides of a cluster, the control pipe widened for large values."""
    ends = {kind: multiprocessing.Pipe(duplex=False) for kind in PIPES}
    widen(ends["control"][0])  # a large value leaves the rank in 1 MB writes
    commands_reader, commands = multiprocessing.Pipe(duplex=False)
    theirs = {kind: writer for kind, (_, writer) in ends.items()}
    theirs["commands"] = commands_reader
    return RankPipes({kind: reader for kind, (reader, _) in ends.items()}, commands, theirs)


class Gate:
    """The start gate and the lifeline of one start: the ends a rank is given
    (:attr:`lifeline_end`, :attr:`gate_end`) and the ones only the starter may hold."""

    def __init__(self) -> None:
        self.lifeline_end, self.lifeline = multiprocessing.Pipe(duplex=False)
        self.gate_end, self._opener = multiprocessing.Pipe(duplex=False)

    def starter_fds(self) -> list[int]:
        """The starter's ends, which a forked rank must close (or EOF would never come)."""
        return [self.lifeline.fileno(), self._opener.fileno()]

    def _open(self) -> None:
        for conn in (self.lifeline_end, self._opener, self.gate_end):
            conn.close()  # EOF on the gate for every rank; the ranks hold their own ends


@contextmanager
def gated_start(on_failure: Callable[[], None]) -> Iterator[Gate]:
    """Start ranks inside the block, then open the gate. If the block raises (a rank could
    not start, an interrupt), ``on_failure()`` kills the ranks already started while they
    still wait at the gate, so none runs user code, and the lifeline is closed."""
    gate = Gate()
    try:
        yield gate
    except BaseException:
        try:
            on_failure()
        finally:
            gate.lifeline.close()
        raise
    finally:
        gate._open()
