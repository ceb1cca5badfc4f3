"""Whether a host name is this machine's loopback: one rule for both sides.

The kernel asks it to pin gloo to the loopback interface (``_kernel/_plan.py``); a rank asks
it to tell whether the store it is told to join is the one the kernel hosts
(``_rank/_rendezvous.py``).
"""

from __future__ import annotations

import ipaddress

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
