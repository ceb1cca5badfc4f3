"""Ray, imported only when a cluster is asked for, and a connection to the cluster.

Runs in the kernel. ``import nb_dist`` never imports Ray; :func:`ray_module` does, the first
time a :class:`~nb_dist.RayCluster` is made, and says in one line how to get Ray when it is
missing. :func:`connect` joins the cluster at an address (or keeps the connection this
kernel already has) with Ray's own log forwarding off: the ranks' output comes through
nb_dist's pipes, labelled and in the launching cell, never through Ray's log path (which
prints late, deduplicates and lands in later cells).
"""

from __future__ import annotations

import logging
import socket
from typing import Any


class ClusterError(RuntimeError):
    """The cluster cannot run the launch: no Ray, no cluster, not enough resources, a lost
    node. The message says what was asked, what the cluster has, and what to do."""


def ray_module() -> Any:
    """``import ray``, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ClusterError(
            "nb_dist.RayCluster needs Ray, which is not installed in this kernel's "
            'environment. Install it with: pip install "nb-dist[ray]" (and the same Ray '
            "version on every node of the cluster)."
        ) from None
    return ray


#: How many times a connection is tried when the cluster answers but its Ray Client server
#: does not start a session for this kernel in time (Ray gives that session 30 s; a busy head
#: takes longer, and a second try, on a head that has just started one, usually does not).
CLIENT_SESSION_TRIES = 2


def connect(ray: Any, address: str) -> None:
    """Join the Ray cluster at ``address`` unless this process is connected to one already."""
    if ray.is_initialized():
        return
    unreachable = _unreachable(address)
    if unreachable is not None:
        raise _no_cluster(address, unreachable)
    for tries_left in reversed(range(CLIENT_SESSION_TRIES)):
        try:
            ray.init(
                address=address,
                log_to_driver=False,  # the ranks' output comes through nb_dist, labelled
                logging_level=logging.WARNING,
                configure_logging=False,
            )
            return
        # Before ConnectionError, of which it is a kind: the server refused this client's session.
        except ConnectionAbortedError as exc:
            if not tries_left:
                raise _no_session(address, _why(exc)) from None
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise _no_cluster(address, _why(exc)) from None


def _why(exc: BaseException) -> str:
    """The line of ``exc``'s message that says what went wrong. A Ray Client server's refusal
    is a heading ("Initialization failure from server:") above the server's traceback, whose
    last line names the error; other messages say it in their first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1] if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _no_cluster(address: str, why: str) -> ClusterError:
    return ClusterError(
        f"No Ray cluster at address={address!r} ({why}). Start one with `ray start --head` "
        "on a machine (then address='auto' on it, or 'ray://HOST:10001' from elsewhere), or "
        "pass the address of yours."
    )


def _no_session(address: str, why: str) -> ClusterError:
    return ClusterError(
        f"The Ray cluster at address={address!r} answered, but its Ray Client server did not "
        f"start a session for this kernel, in {CLIENT_SESSION_TRIES} tries ({why}). A busy "
        "head node starts one slower than Ray waits for it (30 s, set by "
        "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S on the head): run the cell again, or "
        "start the head with a longer wait; ray_client_server*.err in the head's Ray logs "
        "says more."
    )


def _unreachable(address: str, within: float = 3.0) -> str | None:
    """Why nothing answers at ``HOST:PORT`` (or ``ray://HOST:PORT``); ``None`` if something
    does, or the address is ``"auto"`` (Ray finds the cluster, or says it found none, at
    once). Ray itself would wait minutes for a server at an address where none runs."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=within).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port}: {exc.strerror or exc}"
    return None
