"""A launch's options as the caller gave them: one typed, keyword-only object.

``notebook_launcher`` and ``Ranks`` build a :class:`LaunchOptions` by keyword from their
signatures; ``_arguments.check_arguments`` checks its fields in the signature's order, the
transport's ``decide`` says where the ranks go and ``_plan.plan_on`` finishes the plan. No
option travels by position, so two options of the same type cannot be swapped by a caller.
Runs in the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The options of ``notebook_launcher`` after ``function`` and ``args``, unchecked.

    Defaults are the launcher's; ``tests/test_shared_rules.py`` keeps them equal to its
    signature. ``cluster=`` is not one of them: it says where the ranks run, the launch's
    ``_transport.Transport``, which decides the plan checked from these options (and reads
    the plan only).
    """

    num_processes: int | None = None
    mixed_precision: str = "no"
    use_port: int | str | None = None
    master_addr: str = "127.0.0.1"
    node_rank: int = 0
    num_nodes: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: dict[str, Any] | None = None
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None
    start_method: str = "fork"
    timeout: float | None = None
    output: str = "all"
    init_process_group: bool = False
    device: str = "auto"
    threads_per_process: int | None = None
    hang_notice_after: float | None = 10.0
    monitor: bool = False
    rendezvous_timeout: float | str | None = "auto"
    warm_imports: bool = True
    rich_output: str | int | Sequence[int] = "rank0"
    debug: str | None = None
