"""nb_dist's own environment variables: the switches (one rule for every switch) and the
mark of a rank.

``NB_DIST_WARM_IMPORTS=0`` and ``NB_DIST_RELEASE_OPENMP=0`` (and any later switch) are off
with ``0``, ``false``, ``no`` or ``off`` in any case, on with anything else or when unset.
Both sides may read a switch.
"""

from __future__ import annotations

import os

#: Set in a rank's environment (its global rank): a launch from inside a rank is refused
#: (``_kernel/_preflight.py``), and ``import nb_dist`` does nothing of the kernel's there.
RANK_ENV_FLAG = "NB_DIST_IN_RANK"

_OFF = frozenset({"0", "false", "no", "off"})


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its feature off."""
    return os.environ.get(name, "").strip().lower() in _OFF
