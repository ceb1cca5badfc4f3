"""A ``Ranks`` object dropped without ``close()`` is stopped at the next launch, in the
launching cell's thread, never by the garbage collector (``nb_dist/_kernel/_leftovers.py``)."""

from __future__ import annotations

import gc

import psutil
import pytest
from process_helpers import assert_all_gone

from nb_dist import Ranks, notebook_launcher
from nb_dist._kernel import _leftovers

pytestmark = pytest.mark.timeout(120)


def _double(x):
    return 2 * x


def _running(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_a_dropped_session_is_stopped_at_the_next_launch_not_when_collected():
    ranks = Ranks(2)
    pids = ranks.pids
    assert len(pids) == 2
    del ranks
    gc.collect()  # the finalizer runs here: it may only queue the stop
    assert _running(pids) == pids, "garbage collection stopped the ranks"
    assert notebook_launcher(_double, args=(3,), num_processes=2) == [6, 6]
    assert_all_gone(pids)  # the launch stopped them first, in this thread


def test_a_closed_session_leaves_nothing_queued():
    ranks = Ranks(2)
    pids = ranks.pids
    ranks.close()
    assert_all_gone(pids)
    del ranks
    gc.collect()
    assert _leftovers.stop_all() == 0  # close() detached the finalizer


def test_a_dropped_session_is_stopped_by_the_next_ranks_too():
    first = Ranks(2)
    pids = first.pids
    del first
    gc.collect()
    with Ranks(2) as second:
        assert_all_gone(pids)
        assert second.run(_double, 5) == [10, 10]
