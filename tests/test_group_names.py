"""A forked rank names its process groups as a fresh process does, whatever the kernel did.

torch numbers groups with a per-process counter; a kernel that created and destroyed a group
(or whose ``init_process_group`` failed) has moved it, and forked ranks inherited it: their
default group was named "1" while ranks started fresh (another node, spawn) named theirs "0",
and the two kinds waited for each other forever. Each test runs in a fresh interpreter (the
test process plays the kernel), with a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

KERNEL = textwrap.dedent(
    """
    import datetime, os
    import torch.distributed as dist
    from torch.distributed import HashStore
    import nb_dist

    # What a learner does in the kernel before launching: {before}
    {code}
    assert not dist.is_initialized()

    def name():
        return dist.distributed_c10d._get_default_group().group_name

    names = nb_dist.notebook_launcher(
        name, num_processes=2, init_process_group=True, start_method={method!r}, timeout=60
    )
    print("NAMES", list(names))
    """
)

CREATED_AND_DESTROYED = """
dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
dist.destroy_process_group()
"""

FAILED = """
try:  # a wrong world size: torch gives up after the timeout, the counter has moved
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=1))
except Exception as exc:
    print("init failed:", type(exc).__name__)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("before", "code"),
    [("a group created and destroyed", CREATED_AND_DESTROYED), ("a failed init", FAILED)],
    ids=["created-and-destroyed", "failed-init"],
)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ranks_name_their_group_as_fresh_processes_do(before, code, method, tmp_path):
    script = KERNEL.format(before=before, code=textwrap.indent(code, ""), method=method)
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "NAMES ['0', '0']" in run.stdout, run.stdout + run.stderr[-2000:]


def test_the_counter_is_reset_only_when_it_moved_and_no_group_is_up():
    """The reset itself, on stand-ins for torch's module (the launch tests above show it)."""
    import types

    from nb_dist._rank._groups import fresh_group_names

    def c10d(count: int, up: bool) -> types.SimpleNamespace:
        world = types.SimpleNamespace(group_count=count)
        return types.SimpleNamespace(
            __name__="torch.distributed.distributed_c10d", _world=world, is_initialized=lambda: up
        )

    moved = c10d(3, up=False)
    assert fresh_group_names(moved) is True and moved._world.group_count == 0
    assert fresh_group_names(c10d(0, up=False)) is False
    running = c10d(2, up=True)  # a group is up: its name must not change under it
    assert fresh_group_names(running) is False and running._world.group_count == 2
