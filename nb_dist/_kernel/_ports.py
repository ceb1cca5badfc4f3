"""The rendezvous store the kernel owns, and what to say when its port is taken.

The kernel hosts torch's ``TCPStore`` for the launch (as torchrun's agent does) and the ranks
connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so ``init_process_group()``
and ``Accelerator()`` work unchanged inside the function. With no ``use_port`` the store binds
port 0 and the OS picks a free port that the store already owns: there is no window in which
another program could take it, unlike "find a free port, close it, hope".
"""

from __future__ import annotations

import os
import socket

from .._starter import _parts
from ._errors import UnsafeLaunchError

# Ports of launches from this kernel that are running now (a second launch from a thread).
_ports_in_use_here: set[int] = set()
# The ranks this kernel started that may still run, by pid, with their start times: a pid
# the OS reused for another program is not taken for a leftover rank.
_started_ranks: dict[int, float] = {}


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def remember_ranks(pids: list[int]) -> None:
    """Record ranks just started, so a port one of them holds later is named as theirs;
    ranks gone since the last launch are forgotten (the record never grows past the ranks
    alive)."""
    for pid in list(_started_ranks):
        if _start_time(pid) != _started_ranks[pid]:
            del _started_ranks[pid]
    for pid in pids:
        started = _start_time(pid)
        if started is not None:
            _started_ranks[pid] = started


def is_our_rank(pid: int) -> bool:
    """Whether ``pid`` is a rank this kernel started (the same process, not a reused pid)."""
    return pid in _started_ranks and _start_time(pid) == _started_ranks[pid]


def open_store(master_addr: str, port: int | None, only_there: bool) -> socket.socket:
    """Open the launch's rendezvous port in the kernel (``None``: a free port): the listening
    socket its store will serve (``_parts.store_socket``), on ``master_addr`` only unless
    ``only_there`` is false; a taken port or an address not of this machine refused in words."""
    try:
        listener = _parts.store_socket(master_addr, port, only_there)
    except (RuntimeError, OSError) as exc:
        if port is not None and _is_address_in_use(exc):
            raise port_in_use_error(port) from None
        raise UnsafeLaunchError(
            f"The launcher could not open its rendezvous port on {master_addr}:{port or 'auto'} "
            f"({type(exc).__name__}: {exc}). Check that master_addr={master_addr!r} is an "
            "address of this machine (127.0.0.1 for a single machine)."
        ) from exc
    _ports_in_use_here.add(listener.getsockname()[1])
    return listener


def forget_store(port: int) -> None:
    """Mark the store's port free; the caller closes the store (or its socket)."""
    _ports_in_use_here.discard(port)


def _is_address_in_use(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text or "errno: 98" in text


def port_in_use_error(port: int) -> UnsafeLaunchError:
    owner = _describe_owner(port)
    return UnsafeLaunchError(
        f"Port {port} (use_port={port}) is already in use{owner}, so the launch cannot "
        "rendezvous there. Leave use_port unset and the launcher picks a free port for every "
        "launch, or choose another port (for example use_port=29600)."
    )


def _describe_owner(port: int) -> str:
    """``" by process 123 (python)"`` and whether that is a launch from this kernel, if known."""
    if port in _ports_in_use_here:
        return " by another launch from this kernel that is still running"
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return ""
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return ""
    for conn in connections:
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            if conn.pid is None:
                return " by another program"
            if conn.pid == os.getpid():
                return " by this kernel (an earlier store or server you started in a cell)"
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.Error:
                name = "unknown"
            if is_our_rank(conn.pid):
                return (
                    f" by process {conn.pid} ({name}), a rank this kernel started (of live "
                    "nb_dist.Ranks, or left over from an earlier launch)"
                )
            return f" by process {conn.pid} ({name})"
    return ""
