"""Diagnosis as pure functions: hand-built stacks and rendezvous states, no processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nb_dist import LaunchTimeoutError, notebook_launcher
from nb_dist._kernel._diagnosis import (
    COUNTS_HEAD,
    RendezvousView,
    StuckRank,
    distributed_call,
    is_rendezvous,
    reaching_store,
    rendezvous_report,
    timeout_hint,
    timeout_report,
)
from nb_dist._shared._collectives import CollectiveState

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

TORCH = "/venv/lib/python3.11/site-packages/torch"
ALL_REDUCE = [
    ("/tmp/ipykernel_1/123.py", 9, "train"),
    (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
    (f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"),
]
INIT = [
    ("/tmp/ipykernel_1/123.py", 4, "train"),
    (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
    (f"{TORCH}/distributed/c10d_logger.py", 95, "wrapper"),
    (f"{TORCH}/distributed/distributed_c10d.py", 1890, "init_process_group"),
    (f"{TORCH}/distributed/rendezvous.py", 280, "_env_rendezvous_handler"),
]
CONV = [
    ("/tmp/ipykernel_1/123.py", 12, "train"),
    (f"{TORCH}/nn/modules/module.py", 1775, "_call_impl"),
    (f"{TORCH}/nn/modules/conv.py", 548, "forward"),
]
DDP_FORWARD = [
    ("/tmp/ipykernel_1/123.py", 12, "train"),
    (f"{TORCH}/nn/parallel/distributed.py", 1650, "forward"),
]


def test_distributed_call_names_the_function_the_user_called():
    assert distributed_call(ALL_REDUCE) == "all_reduce"
    assert distributed_call(INIT) == "init_process_group"
    assert distributed_call(DDP_FORWARD) == "DistributedDataParallel.forward"
    assert distributed_call(CONV) is None
    assert distributed_call([]) is None
    assert is_rendezvous("init_process_group") and not is_rendezvous("all_reduce")


def test_timeout_hint_names_a_collective_only_when_a_rank_is_in_one():
    assert "blocked in a collective" in timeout_hint(["all_reduce", None])
    conv = timeout_hint([None, None])
    assert "No rank was in a collective" in conv and "collective (all_reduce" not in conv
    rendezvous = timeout_hint(["init_process_group"])
    assert "init_process_group" in rendezvous and "collective (all_reduce" not in rendezvous


CONNECTING = [*INIT, (f"{TORCH}/distributed/rendezvous.py", 190, "_create_c10d_store")]
MESHING = [
    *INIT[:4],
    (f"{TORCH}/distributed/distributed_c10d.py", 2169, "_new_process_group_helper"),
]


def test_a_rank_inside_the_store_creation_is_named_as_not_reaching_the_store():
    """A client's TCPStore returns once connected, so only a rank that never reached the store
    is found inside it; a rank meshing with its peers waits in init_process_group as well."""
    assert reaching_store(CONNECTING)
    assert not reaching_store(MESHING) and not reaching_store(INIT)
    assert not reaching_store(ALL_REDUCE) and not reaching_store([])
    text, stacks = timeout_report(
        45, [StuckRank(0, "blocked", tuple(CONNECTING)), StuckRank(1, "blocked", tuple(MESHING))]
    )
    hint = next(line for line in text.splitlines() if "never reached" in line)
    assert hint.startswith("rank 0 never reached the rendezvous store")
    assert "master_addr" in hint and "firewall" in hint
    assert "A rank blocked in init_process_group waits" in text  # the general advice stays
    assert list(stacks) == [0, 1]
    plain, _ = timeout_report(45, [StuckRank(1, "blocked", tuple(MESHING))])
    assert "never reached" not in plain


def _view(rank, waited=None, done=False, world=None, endpoint=None, state="running", frames=None):
    return RendezvousView(rank, waited, done, world, endpoint, state, frames)


def test_rendezvous_report_missing_rank():
    loading = (("/work/prepare.py", 3, "train"),)
    text, stacks = rendezvous_report(
        5,
        2,
        [_view(0, waited=5.2, world=2, endpoint="127.0.0.1:29500"), _view(1, frames=loading)],
    )
    assert text.startswith("The ranks did not all join the process group within ")
    assert "rank 0 waited 5.2 s in init_process_group, world_size=2 at 127.0.0.1:29500" in text
    assert (
        "rank 1 had not reached init_process_group after 5.2 s; it was at prepare.py, line 3"
        in text
    )
    assert list(stacks) == [1] and 'File "/work/prepare.py", line 3, in train' in stacks[1]
    assert text.endswith(stacks[1])
    assert "Likely cause: rank 1 had not called init_process_group" in text
    assert "larger rendezvous_timeout" in text


def test_rendezvous_report_causes():
    wrong_world, _ = rendezvous_report(3, 2, [_view(0, 3.0, world=4), _view(1, 3.0, world=4)])
    assert "asked for world_size 4, but this launch started 2 rank(s)" in wrong_world
    assert "had not called" not in wrong_world

    addresses, _ = rendezvous_report(
        3, 2, [_view(0, 3.0, world=2, endpoint="a:1"), _view(1, 3.0, world=2, endpoint="a:2")]
    )
    assert "different rendezvous addresses (a:1, a:2)" in addresses

    returned, _ = rendezvous_report(3, 2, [_view(0, 3.0, world=2), _view(1, state="returned")])
    assert "rank 1 never called init_process_group: its function returned" in returned

    joined, _ = rendezvous_report(3, 2, [_view(0, done=True), _view(1, 3.0)])
    assert "rank 0 had joined the process group" in joined


# ------------------------------------------------------------------ collective counts
SLEEP = [("/work/train.py", 14, "train")]


def _counts(entered, current=None, completed=None):
    done = completed if completed is not None else entered - (current is not None)
    return CollectiveState(entered=entered, completed=done, current=current, pid=1)


def test_timeout_report_names_the_collective_a_rank_skipped():
    text, stacks = timeout_report(
        3,
        [
            StuckRank(0, "blocked", tuple(ALL_REDUCE), collectives=_counts(57, "all_reduce")),
            StuckRank(1, "blocked", tuple(SLEEP), collectives=_counts(56)),
        ],
    )
    lines = text.splitlines()
    head = lines.index(COUNTS_HEAD)
    assert lines[head + 1] == "rank 0 waits in all_reduce #57"
    assert lines[head + 2] == (
        "rank 1 entered only 56 collectives (rank 0: 57) and is at train.py, line 14, in train"
    )
    assert head == 3 and lines[1].startswith("rank 0 was blocked at")  # after the places
    assert "A rank blocked in a collective (all_reduce, barrier, ...)" in text
    assert text.endswith("so the others wait in it forever.")
    assert list(stacks) == [0, 1]


def test_timeout_report_counts_of_a_rank_behind_inside_another_collective():
    text, _ = timeout_report(
        3,
        [
            StuckRank(0, "blocked", tuple(ALL_REDUCE), collectives=_counts(57, "all_reduce")),
            StuckRank(1, "blocked", (), collectives=_counts(56, "barrier")),
            StuckRank(2, "teardown", collectives=_counts(55)),
            StuckRank(3, "ended", outcome="rank 3 failed", collectives=_counts(57, "all_reduce")),
        ],
    )
    assert "rank 3 was in all_reduce #57 when it ended" in text
    assert "rank 1 waits in barrier #56 (rank 0 entered 57)" in text
    assert (
        "rank 2 entered only 55 collectives (rank 0: 57) and had returned from the function" in text
    )


def test_timeout_report_with_equal_counts():
    outside = [StuckRank(rank, "blocked", tuple(CONV), collectives=_counts(57)) for rank in (0, 1)]
    text, _ = timeout_report(3, outside)
    assert f"{COUNTS_HEAD}\nevery rank entered 57 collectives; none is inside one" in text
    assert "No rank was in a collective" in text and "different numbers" not in text

    inside = [
        StuckRank(rank, "blocked", tuple(ALL_REDUCE), collectives=_counts(57, "all_reduce"))
        for rank in (0, 1)
    ]
    text, _ = timeout_report(3, inside)
    assert "rank 0 waits in all_reduce #57\nrank 1 waits in all_reduce #57" in text
    assert "entered only" not in text and "different numbers" not in text


def test_timeout_report_without_counts_is_unchanged():
    views = [StuckRank(0, "blocked", tuple(ALL_REDUCE)), StuckRank(1, "starting")]
    text, _ = timeout_report(2, views)
    assert text == "\n".join(
        [
            "The launch did not finish within timeout=2 s, so all ranks were stopped.",
            "rank 0 was blocked at 123.py, line 9, in train",
            "rank 1 was still starting",
            "",
            "Stack of rank 0 (most recent call last):",
            '  File "/tmp/ipykernel_1/123.py", line 9, in train',
            f'  File "{TORCH}/distributed/c10d_logger.py", line 83, in wrapper',
            f'  File "{TORCH}/distributed/distributed_c10d.py", line 3252, in all_reduce',
            "",
            timeout_hint(["all_reduce"]),
        ]
    )
    # Counts known for some ranks only: only those get a line, and "every rank" is not said.
    partial, _ = timeout_report(
        2, [StuckRank(0, "blocked", tuple(CONV), collectives=_counts(4)), views[1]]
    )
    assert "rank 0 entered 4 collectives and is inside none" in partial
    assert "every rank" not in partial and "rank 1 entered" not in partial


# A launch in this process (fork): the timeout hint for a rank that is not in a collective.
def _blocked_outside_collectives():
    threading.Event().wait()


@pytest.mark.timeout(60)
def test_timeout_of_a_rank_outside_collectives_does_not_blame_one():
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_blocked_outside_collectives, num_processes=2, timeout=1.5)
    text = str(info.value)
    assert "was blocked at `threading.Event().wait()`" in text
    assert "No rank was in a collective" in text
    assert "blocked in a collective" not in text


def _all_reduce_then_block():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        threading.Event().wait()


@pytest.mark.timeout(60)
def test_timeout_in_a_collective_names_the_deadlock():
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_all_reduce_then_block, num_processes=2, timeout=3)
    text = str(info.value)
    assert "rank 0 was blocked at `dist.all_reduce(torch.ones(1))`" in text
    assert "A rank blocked in a collective (all_reduce, barrier, ...)" in text


def _two_process_groups(seconds, port):
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(seconds)  # work between the two groups, longer than rendezvous_timeout
    # A fresh store for the second group (the launcher's still holds the first one's keys).
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(60)
def test_a_second_process_group_is_not_timed_from_the_first():
    """The rendezvous watchdog ends with the first completed rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = notebook_launcher(
        _two_process_groups, args=(2.0, port), num_processes=2, rendezvous_timeout=1.0
    )
    assert list(result) == [2.0, 2.0]


# ------------------------------------------------------------------ the OpenMP pool
@pytest.mark.timeout(60)
def test_release_pool_frees_this_threads_pool():
    from nb_dist._kernel import _openmp

    assert _openmp.libgomp_path() is not None  # torch's Linux wheels use GNU OpenMP
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).add_(1.0).sum()  # starts this thread's pool (2 threads)
        # The probe sees the real hang: its child's parallel op never ends.
        assert _openmp.pool_breaks_fork(2, remember=False)
        release = _openmp.release_pool()
        assert release.status == "released" and release.threads_freed >= 1
        assert _openmp.release_pool().status == "idle"  # nothing left to free
        assert not _openmp.pool_breaks_fork(2, remember=False)  # a fork is safe now
        # The pool comes back at the next parallel op, and the result is right.
        assert torch.ones(1 << 20).add_(1.0).sum().item() == 2 * (1 << 20)
    finally:
        torch.set_num_threads(before)


def test_release_can_be_turned_off(monkeypatch):
    from nb_dist._kernel import _openmp

    monkeypatch.setenv(_openmp.RELEASE_ENV, "0")
    assert _openmp.release_pool().status == "disabled"


# ----------------------------------------------------------------------------- skipped collective
def _state(entered: int, current: str | None = "all_reduce", completed: int | None = None):
    from nb_dist._shared._collectives import CollectiveState

    done = entered - 1 if completed is None else completed
    return CollectiveState(entered=entered, completed=done, current=current, pid=1)


def test_a_collective_the_finished_ranks_never_reach_is_a_deadlock():
    from nb_dist._kernel._diagnosis import skipped_collective, skipped_collective_report

    found = skipped_collective({1: 2}, {0: _state(3)})
    assert found is not None
    text = skipped_collective_report(found, {0: [("<ranks cell 4>", 2, "<module>")]})
    assert text.startswith(
        "rank 0 is blocked in all_reduce #3, which rank 1 will never enter: rank 1 finished "
        "the cell after 2 collectives. A deadlock"
    ), text
    assert "rank 0 waits in all_reduce #3" in text
    assert "rank 1 finished the cell having entered 2 collectives" in text
    several = skipped_collective({1: 0, 2: 0}, {0: _state(1), 3: _state(1, "barrier")})
    assert several is not None and [r for r, _ in several.blocked] == [0, 3]
    assert "which ranks 1, 2 will never enter: they finished" in skipped_collective_report(
        several, {}
    )


def test_no_deadlock_without_proof():
    from nb_dist._kernel._diagnosis import skipped_collective

    assert skipped_collective({1: 3}, {0: _state(3)}) is None  # rank 1 took part in #3
    assert skipped_collective({1: 2}, {0: _state(3, current=None, completed=3)}) is None
    assert skipped_collective({1: 2}, {0: None}) is None  # counts unknown
    assert skipped_collective({1: None}, {0: _state(3)}) is None
    assert skipped_collective({}, {0: _state(3), 1: _state(3)}) is None  # all in one collective
    assert skipped_collective({1: 2}, {0: _state(3, "recv")}) is None  # point to point
    assert skipped_collective({1: 2}, {0: _state(3, completed=1)}) is None  # several threads
    assert skipped_collective({2: 2}, {0: _state(3), 1: _state(3, None, 3)}) is None  # computing
