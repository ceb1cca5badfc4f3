"""Which monotonic clock a time is on: both sides (a node's agent says, the kernel compares).

``time.monotonic()`` counts from a moment fixed at boot, the same for every process of one
running system and different on every other machine (or after a reboot). Two processes
stamp comparable times exactly when their systems' boot ids are equal; otherwise the kernel
measures the offset (``_cluster/_gang.clock_offset``).
"""

from __future__ import annotations

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This running system's boot id (Linux), ``None`` where there is none to read."""
    try:
        with open(_BOOT_ID) as file:
            return file.read().strip() or None
    except OSError:
        return None
