"""What the kernel hands each rank at its start: its spec and its pipes.

Built in the kernel (``_kernel/_attempt_setup.rank_spec``, for every transport), read in the rank
(``_entry.py``); both are picklable, so a spawned or forkserver rank receives them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from typing import Any


@dataclass
class RankSpec:
    """Everything one rank needs, picklable so spawn/forkserver ranks can receive it."""

    rank: int
    local_rank: int
    env: dict[str, str]
    threads: int | None
    init_process_group: bool
    backend: str
    use_gpu: bool
    parent_pid: int
    check_parent: bool
    # fork: the function and args themselves; spawn/forkserver: cloudpickle bytes of both.
    function: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    payload: bytes | None = None
    # Cell sources for tracebacks in spawned ranks (they do not inherit linecache).
    linecache_entries: dict[str, Any] = field(default_factory=dict)
    # The kernel's sys.path, so classes the function refers to by module can be imported.
    sys_path: list[str] = field(default_factory=list)
    # Kernel-side file descriptors a forked rank must close (other ranks' pipes, lifelines).
    close_fds: list[int] = field(default_factory=list)
    # Tell the kernel which modules this rank imported that it lacks (see _kernel/_warm.py).
    report_imports: bool = False
    # A live rank (nb_dist.Ranks): serve tasks from the commands pipe instead of one function.
    session: bool = False
    # "postmortem": a failed rank waits at its exception for the notebook's debugger.
    debug: str | None = None


@dataclass
class RankChannels:
    """Pipes between one rank and the kernel. Each end is a ``Connection`` so it pickles."""

    stdout: Connection
    stderr: Connection
    control: Connection
    stack: Connection
    lifeline: Connection
    # Read end of the start gate: EOF once the kernel has started every rank.
    gate: Connection
    # Kernel → rank: the debugger's answers (_debug.py) and a live rank's tasks (_serve.py).
    commands: Connection | None = None

    def named_fds(self) -> dict[str, int]:
        """Each pipe's file descriptor by name (how a spawned rank is told its pipes)."""
        ends = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: conn.fileno() for name, conn in ends.items() if conn is not None}
