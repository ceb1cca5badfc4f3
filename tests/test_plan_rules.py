"""The rules every transport's plan is finished by (``_plan.plan_on``), and the cluster's own
decision of where the ranks go (``RayCluster.decide``, ``_cluster/_ray_cluster.py``), read
from the plans they make: nothing launches, and no Ray is needed (Ray's module and the
cluster's gang are stand-ins with what the decision reads of them)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from nb_dist._cluster import _connect, _gang, _ray_cluster
from nb_dist._kernel._arguments import Asked, LaunchOptions, check_arguments
from nb_dist._kernel._plan import (
    RENDEZVOUS_BY_HAND,
    RENDEZVOUS_HERE,
    RENDEZVOUS_ON_AGENTS,
    Where,
    auto_rendezvous,
    plan_on,
    start_method_on,
)
from nb_dist._shared import _shipping

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def _square(x: int) -> int:
    return x * x


def _checked(**options: object) -> Asked:
    return check_arguments(_square, (3,), LaunchOptions(**options))  # type: ignore[arg-type]


def _where(**changes: object) -> Where:
    here = Where(
        ranks=(0, 1), world_size=2, num_nodes=1, use_gpu=False, cores_per_rank=3,
        instead_of_fork=None,
    )  # fmt: skip
    return dataclasses.replace(here, **changes)  # type: ignore[arg-type]


def test_fork_stays_fork_where_the_starter_can_fork_and_nothing_is_shipped():
    plan = plan_on(_checked(num_processes=2, threads_per_process=1), _where())
    assert (plan.start_method, plan.payload, plan.threads) == ("fork", None, 1)
    assert (plan.ranks, plan.world_size, plan.num_nodes) == ((0, 1), 2, 1)


def test_fork_becomes_what_the_transport_says_and_the_function_goes_by_value():
    plan = plan_on(_checked(num_processes=2), _where(instead_of_fork="forkserver"))
    assert plan.start_method == "forkserver" and not plan.warm_imports
    function, args = _shipping.loads(plan.payload or b"")
    assert function(*args) == 9


def test_threads_are_the_callers_then_omp_num_threads_then_the_cores_each_rank_has(
    monkeypatch: pytest.MonkeyPatch,
):
    where = _where(instead_of_fork="spawn", cores_per_rank=3)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan_on(_checked(num_processes=2, threads_per_process=2), where).threads == 2
    assert plan_on(_checked(num_processes=2), where).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert plan_on(_checked(num_processes=2), where).threads == 5
    no_cores = dataclasses.replace(where, cores_per_rank=0)
    assert plan_on(_checked(num_processes=2), no_cores).threads == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert plan_on(_checked(num_processes=2), no_cores).threads == 1  # at least one


@pytest.mark.parametrize(
    ("options", "limit"),
    [
        ({}, RENDEZVOUS_HERE),  # "auto": the plan's rule, on what the transport says
        ({"rendezvous_timeout": 5}, 5.0),
        ({"rendezvous_timeout": None}, None),  # no limit, as asked
        ({"rdzv_conf": {"timeout": 9}}, 9.0),  # Accelerate's way of saying it
    ],
)
def test_the_rendezvous_timeout_is_the_rules_only_where_auto_was_left(options, limit):
    assert plan_on(_checked(num_processes=2, **options), _where()).rendezvous_timeout == limit


def test_auto_rendezvous_is_one_rule_on_who_starts_the_ranks():
    """Every rank started here; some started by hand on other machines (this launch starts
    two of four); all started by the nodes' agents."""
    assert auto_rendezvous(_where()) == RENDEZVOUS_HERE == 20.0
    assert auto_rendezvous(_where(ranks=(2, 3), world_size=4)) == RENDEZVOUS_BY_HAND == 300.0
    on_agents = _where(started_by_agents=True, ranks=(0, 1, 2, 3), world_size=4)
    assert auto_rendezvous(on_agents) == RENDEZVOUS_ON_AGENTS == 120.0


def test_what_no_transport_changes_reaches_the_plan_as_asked():
    asked = _checked(num_processes=2, output="grouped", timeout=30, max_restarts=1)
    plan = plan_on(asked, _where(instead_of_fork="spawn"))
    assert (plan.output, plan.timeout, plan.max_restarts) == ("grouped", 30.0, 1)
    assert (plan.function, plan.args, plan.prefix) == (_square, (3,), asked.prefix)


@pytest.mark.parametrize(
    ("asked", "instead", "method"),
    [
        ("fork", None, "fork"),
        ("fork", "forkserver", "forkserver"),
        ("spawn", "forkserver", "spawn"),
    ],
)
def test_only_fork_becomes_what_the_transport_starts_instead(asked, instead, method):
    assert start_method_on(asked, instead) == method


class _Gang:
    """What the cluster's decision reads of the nodes it reserves (and what closing reads)."""

    layout = types.SimpleNamespace(num_nodes=2)
    threads_per_rank = 4
    closed = False
    made: list[tuple[int, str]] = []

    def __init__(self, ray, nprocs, per_node, per_rank, strategy, timeout, method) -> None:
        self.key = _gang.gang_key(nprocs, per_node, per_rank, strategy)
        self.session = None
        self.made.append((nprocs, method))

    def describe(self) -> str:
        return "2 node(s) (10.0.0.1, 10.0.0.2)"

    def healthy(self, fresh_for: float = 0.0) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch):
    """A ``RayCluster`` whose Ray and gang are stand-ins: its real ``decide``, no cluster."""
    monkeypatch.setattr(_connect, "ray_module", lambda: None)
    monkeypatch.setattr(_connect, "connect", lambda ray, address: None)
    monkeypatch.setattr(_ray_cluster, "Gang", _Gang)
    monkeypatch.setattr(_Gang, "made", [])
    made = _ray_cluster.RayCluster()
    yield made
    made.close()


def test_a_cluster_plan_spans_its_nodes_with_forkserver_and_its_own_rendezvous_timeout(
    monkeypatch: pytest.MonkeyPatch, cluster: _ray_cluster.RayCluster
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    asked = _checked(num_processes=4)
    plan = plan_on(asked, cluster.decide(asked))
    assert _Gang.made == [(4, "forkserver")]
    assert (plan.ranks, plan.world_size, plan.num_nodes) == ((0, 1, 2, 3), 4, 2)
    assert (plan.start_method, plan.threads) == ("forkserver", 4)
    assert plan.rendezvous_timeout == RENDEZVOUS_ON_AGENTS
    assert plan.payload is not None and not plan.warm_imports
    assert any(n.startswith("shipped _square() with") for n in plan.notices), plan.notices
    cluster.decide(asked)
    assert len(_Gang.made) == 1  # the next launch reuses the gang


def test_where_on_a_gang_is_read_from_the_gang():
    where = _ray_cluster.where_on(_Gang.__new__(_Gang), 3, True, b"fn", "f() with no globals")
    assert (where.ranks, where.world_size, where.num_nodes) == ((0, 1, 2), 3, 2)
    assert (where.use_gpu, where.cores_per_rank, where.instead_of_fork) == (True, 4, "forkserver")
    assert where.started_by_agents and where.payload == b"fn"
    assert where.notices == ("shipped f() with no globals to 3 ranks on 2 node(s) "
                             "(10.0.0.1, 10.0.0.2).",)  # fmt: skip


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"num_processes": None}, "on a cluster say how many ranks to start"),
        ({"num_processes": 2, "use_port": "29600"}, "use_port place a launch by hand"),
        ({"num_processes": 2, "device": "cuda"}, "needs a GPU per rank"),
    ],
)
def test_what_a_cluster_cannot_do_is_refused_before_nodes_are_reserved(
    options, says, cluster: _ray_cluster.RayCluster
):
    with pytest.raises(ValueError, match=says):
        cluster.decide(_checked(**options))
    assert _Gang.made == [] and cluster._gang is None
