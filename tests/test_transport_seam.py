"""The transport seam (``_kernel/_transport.py``) holds for a transport that is neither of ours.

``cluster=`` takes any object with the ``Transport`` methods. The one here is built by
composition from the local transport (real forked ranks), and adds what a third transport
would: its own variable in every rank's environment, and a journal of the calls the launcher
and ``nb_dist.Ranks`` make on it. The tests assert the contract the two built-in transports
rely on: ``decide`` once per launch, ``open`` once per attempt with its number, the host
started once and closed once per attempt (also when the attempt failed or the host refused
to start), the transport's environment reaching every rank, each rank's place (what ``open``
decided) in its environment and its outcome, and a failure of ``open`` ending the launch
with nothing left running.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from process_helpers import assert_all_gone

import nb_dist
from nb_dist._kernel._arguments import Asked
from nb_dist._kernel._attempt_setup import Place
from nb_dist._kernel._local import LocalTransport
from nb_dist._kernel._plan import LaunchPlan, Where
from nb_dist._kernel._rank_handle import Rank
from nb_dist._kernel._supervisor import RankHost
from nb_dist._kernel._transport import Transport, transport_for

#: Quick launches through a journalled transport: all in the fast lane.
pytestmark = [pytest.mark.timeout(120), pytest.mark.fast]

SEAM_ENV = "NB_DIST_TEST_TRANSPORT_ATTEMPT"


class _JournalledHost:
    """The local host, with every call written to the transport's journal."""

    def __init__(self, inner: RankHost, journal: list[tuple], number: int, fail: bool) -> None:
        self._inner, self._journal, self._number, self._fail = inner, journal, number, fail

    def start(
        self, plan: LaunchPlan, envs: list[dict[str, str]], ranks: list[Rank]
    ) -> Connection | None:
        self._journal.append(("start", self._number, len(ranks)))
        if self._fail:
            raise RuntimeError("this transport has no room for the ranks")
        return self._inner.start(plan, envs, ranks)

    def close(self) -> None:
        self._journal.append(("close", self._number))
        self._inner.close()

    def endpoints(self) -> list[tuple[str, int]] | None:
        return self._inner.endpoints()


class JournalledTransport:
    """A third transport: the ranks run here, the calls are journalled, the environment is
    its own. ``fail_open`` / ``fail_start``: the attempt numbers whose open (or whose host's
    start) raises, as a transport without capacity would."""

    def __init__(self, fail_open: tuple[int, ...] = (), fail_start: tuple[int, ...] = ()):
        self.journal: list[tuple] = []
        #: The places each attempt's open decided, in order.
        self.places: list[list[Place]] = []
        self._local = LocalTransport()
        self._fail_open, self._fail_start = fail_open, fail_start

    def decide(self, asked: Asked) -> Where:
        where = self._local.decide(asked)
        self.journal.append(("decide", len(where.ranks)))
        return where

    def open(
        self, plan: LaunchPlan, attempt: int
    ) -> tuple[list[dict[str, str]], list[Place], RankHost]:
        self.journal.append(("open", attempt, plan.session))
        if attempt in self._fail_open:
            raise ConnectionError("the transport could not reach its machines")
        envs, places, host = self._local.open(plan, attempt)
        self.places.append(places)
        envs = [{**env, SEAM_ENV: str(attempt)} for env in envs]
        journalled = _JournalledHost(host, self.journal, attempt, attempt in self._fail_start)
        return envs, places, journalled

    def interrupted(self) -> None:
        self.journal.append(("interrupted",))


def _attempt_seen(folder: str) -> tuple[int, str]:
    """Each rank: its rank and the attempt its transport said; rank 1 fails attempt 0."""
    attempt = os.environ[SEAM_ENV]
    Path(folder, f"pid-{os.getpid()}").touch()
    if attempt == "0" and nb_dist.rank() == 1:
        raise ValueError("attempt 0 fails on rank 1")
    return nb_dist.rank(), attempt


def _seam_attempt() -> str | None:
    return os.environ.get(SEAM_ENV)  # the rank's environment (os.environ.get would ship ours)


def _pids(folder: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in folder.glob("pid-*")]


def test_the_journalled_transport_is_a_transport():
    transport = JournalledTransport()
    assert isinstance(transport, Transport)
    assert transport_for(transport) is transport


def test_a_third_transport_runs_every_attempt_through_open_start_and_close(tmp_path):
    transport = JournalledTransport()
    result = nb_dist.notebook_launcher(
        _attempt_seen, args=(str(tmp_path),), num_processes=2, max_restarts=1,
        cluster=transport, output="none",
    )  # fmt: skip
    assert list(result) == [(0, "1"), (1, "1")]  # the transport's variable, attempt 1's
    assert result.restarts == 1
    assert transport.journal == [
        ("decide", 2),
        ("open", 0, False), ("start", 0, 2), ("close", 0),
        ("open", 1, False), ("start", 1, 2), ("close", 1),
    ]  # fmt: skip
    assert_all_gone(_pids(tmp_path), within=0)


_PLACE_NAMES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NPROC", "NODE_RANK", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME",
                "NB_DIST_NODE_ID")  # fmt: skip


def _place_seen() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in _PLACE_NAMES}


def test_each_ranks_place_reaches_its_environment_and_the_supervisor(monkeypatch):
    """The places ``open`` decided (on this machine: from the plan) are what each rank's
    environment says and what the launch's outcomes report, read from a real launch."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    transport = JournalledTransport()
    result = nb_dist.notebook_launcher(_place_seen, num_processes=3, cluster=transport,
                                       output="none")  # fmt: skip
    assert transport.places == [[Place(i, 3, 0, 1, None, "lo") for i in range(3)]]
    assert list(result) == [
        {"LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": "3", "NPROC": "3", "NODE_RANK": "0",
         "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
         "GLOO_SOCKET_IFNAME": "lo", "NB_DIST_NODE_ID": None}
        for i in range(3)
    ]  # fmt: skip
    assert [o.local_rank for o in result.outcomes] == [0, 1, 2]


def test_live_ranks_open_one_session_through_a_third_transport(tmp_path):
    transport = JournalledTransport()
    ranks = nb_dist.Ranks(num_processes=2, cluster=transport)
    try:
        assert list(ranks.run(_seam_attempt)) == ["0", "0"]
        assert transport.journal == [("decide", 2), ("open", 0, True), ("start", 0, 2)]
        pids = ranks.pids
    finally:
        ranks.close()
    assert transport.journal[-1] == ("close", 0)
    assert_all_gone(pids, within=0)


@pytest.mark.parametrize("where", ["open", "start"])
def test_a_transport_that_cannot_start_ends_the_launch_and_the_next_one_works(tmp_path, where):
    failing = (
        JournalledTransport(fail_open=(0,))
        if where == "open"
        else JournalledTransport(fail_start=(0,))
    )
    expected = ConnectionError if where == "open" else RuntimeError
    with pytest.raises(expected):
        nb_dist.notebook_launcher(
            _attempt_seen, args=(str(tmp_path),), num_processes=2, cluster=failing,
            output="none",
        )  # fmt: skip
    assert _pids(tmp_path) == []  # no rank ran
    if where == "start":
        assert failing.journal[-1] == ("close", 0)  # what open made is freed
    working = JournalledTransport()
    result = nb_dist.notebook_launcher(
        _attempt_seen, args=(str(tmp_path),), num_processes=2, max_restarts=1,
        cluster=working, output="none",
    )  # fmt: skip
    assert [value for _, value in result] == ["1", "1"]
    assert_all_gone(_pids(tmp_path), within=0)
