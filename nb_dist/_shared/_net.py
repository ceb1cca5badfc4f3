"""Network facts both sides ask: whether a host is this machine's loopback, a process's sockets.

The kernel asks :func:`is_loopback` to pin gloo to the loopback interface
(``_kernel/_attempt_setup.py``); a rank asks it to tell whether the store it is told to join
is the one the kernel hosts (``_rank/_rendezvous.py``). :func:`tcp_connections` lists a
process's TCP sockets on every psutil the project supports (``_rank/_regroup.py``).
"""

from __future__ import annotations

import ipaddress
from typing import Any

#: Names that mean this machine's loopback on common systems (``/etc/hosts``).
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """``localhost`` and its aliases, ``127.x.y.z``, ``::1`` (bracketed or not)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tcp_connections(process: Any) -> list[Any]:
    """The TCP sockets of ``process`` (a ``psutil.Process``).

    psutil 6 calls the method ``net_connections``; 5.9, which Colab and Kaggle ship, has it
    only under its old name ``connections``.
    """
    method = getattr(process, "net_connections", None) or process.connections
    return list(method("tcp"))
