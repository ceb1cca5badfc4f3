"""The parts of a Ray cluster launch that need no Ray: placement, layout, clocks, options,
and the forwarder's writes into local pipes. Run everywhere (``test_ray_cluster.py``, which
needs Ray and a local cluster, is skipped without it)."""

from __future__ import annotations

import os
import time
import typing
from multiprocessing.connection import Connection

import pytest
from process_helpers import run_python

import nb_dist
from nb_dist._cluster import _remote_attempt
from nb_dist._cluster._forward import AgentLink
from nb_dist._cluster._gang import Node, clock_offset, layout
from nb_dist._cluster._placement import bundles, infeasible
from nb_dist._kernel import _attempt_setup
from nb_dist._kernel._arguments import LaunchOptions, check_arguments
from nb_dist._kernel._attempt_setup import Place
from nb_dist._kernel._plan import LaunchPlan, Where, plan_on
from nb_dist._node._outbox import Batch
from nb_dist._shared import _protocol

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def test_layout_numbers_ranks_node_by_node_as_torchrun_does():
    # Three agents, two of them on one node (SPREAD with more bundles than nodes, or PACK):
    # a node's ranks are consecutive (device meshes and hybrid sharding group them so), and
    # its local ranks run across its agents.
    lay = layout(["node-a", "node-b", "node-a"], [2, 1, 2])
    assert lay.node_rank == (0, 0, 0, 0, 1)
    assert lay.local_rank == (0, 1, 2, 3, 0)
    assert lay.local_world_size == (4, 4, 4, 4, 1)
    assert lay.num_nodes == 2
    assert lay.agent == (0, 0, 2, 2, 1) and lay.position == (0, 1, 0, 1, 0)
    # One rank per agent, nodes interleaved: still node by node.
    assert layout(["A", "B", "A"], [1, 1, 1]).node_rank == (0, 0, 1)


class _TwoNodeGang:
    """What opening an attempt reads of a gang: three agents on two nodes (node-b's without a
    known interface), and a store on rank 0's node; the runs it ends are recorded."""

    def __init__(self) -> None:
        self.nodes = [
            Node("node-a", "10.0.0.1", "a", "eth0", 2, None),
            Node("node-b", "10.0.0.2", "b", None, 1, None),
            Node("node-a", "10.0.0.1", "a", "eth0", 2, None),
        ]
        self.layout = layout([n.node_id for n in self.nodes], [2, 1, 2])
        self.ended: list[tuple[int, object]] = []

    def new_run(self) -> int:
        return 7

    def open_store(self, run: int, world_size: int) -> tuple[str, int]:
        assert (run, world_size) == (7, 5)
        return "10.0.0.1", 4242

    def end_run(self, run: int, links: object = None) -> None:
        self.ended.append((run, links))

    def let_go(self, session: object) -> None:
        pass


def _cluster_plan() -> LaunchPlan:
    asked = check_arguments(_square, (3,), LaunchOptions(num_processes=5))
    where = Where(
        ranks=(0, 1, 2, 3, 4), world_size=5, num_nodes=2, use_gpu=False, cores_per_rank=1,
        instead_of_fork="forkserver", started_by_agents=True, payload=b"shipped",
    )  # fmt: skip
    return plan_on(asked, where)


def _square(x: int) -> int:
    return x * x


_PLACE_NAMES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NPROC", "NODE_RANK", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NB_DIST_NODE_ID",
                "GLOO_SOCKET_IFNAME")  # fmt: skip


@pytest.mark.parametrize("chosen", [None, "ens5"])
def test_a_cluster_attempt_gives_each_rank_its_place_on_a_two_node_layout(monkeypatch, chosen):
    """Each rank's environment on a gang of three agents on two nodes, built by the same
    ``AttemptSetup`` as a local attempt's: its place from the layout (local ranks across a
    node's agents), the store on rank 0's node, the node's id and gloo's interface (the
    caller's, else the node's; none where neither is known); the host ends the run once and
    removes the folder."""
    if chosen is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", chosen)
    gang = _TwoNodeGang()
    envs, places, host = _remote_attempt.open_ranks(gang, _cluster_plan(), 1)  # type: ignore[arg-type]
    try:
        a, b = chosen or "eth0", chosen
        assert places == [
            Place(0, 4, 0, 2, "node-a", a), Place(1, 4, 0, 2, "node-a", a),
            Place(2, 4, 0, 2, "node-a", a), Place(3, 4, 0, 2, "node-a", a),
            Place(0, 1, 1, 2, "node-b", b),
        ]  # fmt: skip
        got = [tuple(env.get(name) for name in _PLACE_NAMES) for env in envs]
        assert got == [
            ("0", "4", "4", "0", "0", "2", "10.0.0.1", "4242", "node-a", a),
            ("1", "4", "4", "0", "0", "2", "10.0.0.1", "4242", "node-a", a),
            ("2", "4", "4", "0", "0", "2", "10.0.0.1", "4242", "node-a", a),
            ("3", "4", "4", "0", "0", "2", "10.0.0.1", "4242", "node-a", a),
            ("0", "1", "1", "1", "1", "2", "10.0.0.1", "4242", "node-b", b),
        ]  # fmt: skip
        assert [env["RANK"] for env in envs] == ["0", "1", "2", "3", "4"]
        assert {env["WORLD_SIZE"] for env in envs} == {"5"}
        assert {env["TORCHELASTIC_RESTART_COUNT"] for env in envs} == {"1"}
        folder = os.path.dirname(os.path.dirname(envs[0]["TORCHELASTIC_ERROR_FILE"]))
        assert os.path.basename(folder).startswith("nb_dist_cluster_")
        assert os.path.isdir(folder) and gang.ended == []
    finally:
        host.close()
    assert gang.ended == [(7, None)] and not os.path.exists(folder)
    host.close()
    assert gang.ended == [(7, None)]  # once


def test_a_cluster_attempt_that_fails_while_its_environments_are_made_frees_all(monkeypatch):
    """As a local attempt: the error as raised, the run's store closed (the run ended on
    rank 0's agent) and the scratch folder removed."""
    made: list[str] = []
    scratch_folder = _attempt_setup.scratch_folder

    def recorded(prefix: str) -> str:
        made.append(scratch_folder(prefix))
        return made[-1]

    def no_environment(*args: object, **kwargs: object) -> dict[str, str]:
        raise RuntimeError("no environment for this rank")

    monkeypatch.setattr(_attempt_setup, "scratch_folder", recorded)
    monkeypatch.setattr(_attempt_setup, "rank_env", no_environment)
    gang = _TwoNodeGang()
    with pytest.raises(RuntimeError, match="no environment for this rank"):
        _remote_attempt.open_ranks(gang, _cluster_plan(), 0)  # type: ignore[arg-type]
    assert gang.ended == [(7, None)]
    assert len(made) == 1 and not os.path.exists(made[0])


def test_times_from_another_machine_are_put_on_the_kernels_clock():
    shift = 1000.0
    sent = [
        _protocol.Hello(7, 1, at=5.0),
        _protocol.Rendezvous("enter", at=5.0),
        _protocol.Returned(at=5.0),
        _protocol.Failed("ValueError", "bad", "", at=5.0),
    ]
    assert [m.at for m in (_protocol.on_kernel_clock(m, shift) for m in sent)] == [1005.0] * 4
    reports = _protocol.ReportBatch((_protocol.report_value("loss", 0, 5.0, 0.5),))
    moved = _protocol.on_kernel_clock(reports, shift)
    assert isinstance(moved, _protocol.ReportBatch) and moved.values[0].at == 1005.0
    assert moved.values[0].value() == 0.5
    idle = _protocol.Idle(1, 2)
    assert _protocol.on_kernel_clock(idle, shift) is idle
    # Every message stamped with the rank's clock is one of those above.
    stamped = {c for c in typing.get_args(_protocol.Message) if "at" in c.__dataclass_fields__}
    assert stamped == {type(m) for m in sent}


def test_a_nodes_clock_offset_comes_from_its_shortest_round_trip():
    calls = []

    def ask() -> float:  # a node whose clock reads 1000 s less than this process's
        theirs = time.monotonic() - 1000.0
        if not calls:  # the first answer is slow: its middle is 10 ms after the reading
            deadline = time.monotonic() + 0.02
            while time.monotonic() < deadline:
                pass
        calls.append(theirs)
        return theirs

    assert clock_offset(ask) == pytest.approx(1000.0, abs=0.002)
    assert len(calls) == 3


def test_placement_says_what_can_never_fit():
    nodes = [{"CPU": 1.0}, {"CPU": 1.0}]
    assert bundles(5, 2, {"CPU": 1}) == [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}]
    assert infeasible(bundles(2, 1, {"CPU": 1}), "STRICT_SPREAD", nodes) is None

    def why(nprocs: int, per_node: int, per_rank: dict[str, float], strategy: str) -> str:
        return infeasible(bundles(nprocs, per_node, per_rank), strategy, nodes) or ""

    assert "3 different nodes" in why(3, 1, {"CPU": 1}, "STRICT_SPREAD")
    assert "no node has 2 CPU" in why(2, 2, {"CPU": 1}, "PACK")
    assert "one node with 2 CPU" in why(2, 1, {"CPU": 1}, "STRICT_PACK")
    assert "1 GPU" in why(1, 1, {"GPU": 1}, "PACK")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"processes_per_node": 0}, "processes_per_node=0 must be a positive whole number"),
        ({"placement": "SPREAD_THIN"}, "placement='SPREAD_THIN' is not one of Ray's strategies"),
        ({"resources_per_rank": {"GPU": -1}}, "each entry must be a resource name and a number"),
        ({"placement_timeout": 0}, "placement_timeout=0 must be a number of seconds above 0"),
        ({"num_processes": 0}, "num_processes=0 must be a positive whole number"),
        ({"num_processes": True}, "num_processes=True must be a positive whole number"),
        ({"num_processes": "2"}, "num_processes='2' must be a positive whole number"),
    ],
)
def test_bad_options_are_refused_before_connecting(options, says):
    # The launcher's own check and words for the same options (TypeError for a non-number).
    with pytest.raises((ValueError, TypeError)) as caught:
        nb_dist.RayCluster("127.0.0.1:9", **options)  # nothing there: never reached
    assert says in str(caught.value)


def test_without_ray_one_line_says_how_to_get_it():
    done = run_python(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import nb_dist
        try:
            nb_dist.RayCluster()
        except Exception as exc:
            print(type(exc).__name__, exc, sep="|")
        """
    )
    name, text = done.stdout.strip().split("|")
    assert name == "ClusterError" and "\n" not in text
    assert 'pip install "nb-dist[ray]"' in text, text


def test_import_nb_dist_does_not_import_ray():
    done = run_python("import sys, nb_dist; print('ray' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr


# ----------------------------------------------------------------------------- forwarding
class _Pipes:
    """A rank's local pipes as the kernel makes them: the forwarder writes the ``theirs``
    ends, the test reads ``ours`` (what the kernel's loop would)."""

    def __init__(self) -> None:
        self.ours: dict[str, Connection] = {}
        self.theirs: dict[str, Connection] = {}
        for kind in ("stdout", "control"):
            read, write = os.pipe()
            self.ours[kind] = Connection(read, writable=False)
            self.theirs[kind] = Connection(write, readable=False)

    def read_all(self, kind: str) -> bytes:
        os.set_blocking(self.ours[kind].fileno(), False)
        got = b""
        while True:
            try:
                chunk = os.read(self.ours[kind].fileno(), 1 << 20)
            except BlockingIOError:
                return got
            if not chunk:
                return got
            got += chunk

    def close(self) -> None:
        for conn in [*self.ours.values(), *self.theirs.values()]:
            conn.close()


def test_a_full_pipe_never_holds_another_ranks_bytes_and_an_exit_waits_for_its_bytes():
    """Rank 0's 3 MB value fills its pipe (nobody reads it yet): rank 1's bytes and exit
    arrive at once; rank 0's exit is noted only once all of its bytes are written, with the
    time its node saw it end, put on this clock, and whether it ended before any stop."""
    link = AgentLink(ray=None, actor=None, run=1, where="here", offset=100.0)
    pipes = [_Pipes(), _Pipes()]
    try:
        for position, rank in enumerate(pipes):
            link.add_rank(position, rank.theirs, None)
        big = os.urandom(3 << 20)
        batch = Batch(1, chunks=[(0, "control", big), (1, "stdout", b"hello\n"),
                                 (1, "control", b"")],
                      exits={0: (0, 5.0, True), 1: (1, 6.0, False)})  # fmt: skip
        began = time.monotonic()
        link.deliver(batch)  # returns at once: nothing waits for a reader
        assert time.monotonic() - began < 1.0
        assert pipes[1].read_all("stdout") == b"hello\n"
        assert link.exit_code(1) == 1 and link.ended_at(1) == 106.0
        assert not link.ended_unasked(1)
        assert link.exit_code(0) is None and link.backlog_bytes > 0 and link.blocked()
        got = b""
        while link.backlog_bytes:  # the kernel reads; the forwarder writes what fits
            got += pipes[0].read_all("control")
            link.flush()
        got += pipes[0].read_all("control")
        assert got == big and not link.blocked()
        assert link.exit_code(0) == 0 and link.ended_at(0) == 105.0 and link.ended_unasked(0)
    finally:
        link.close()
        for rank in pipes:
            rank.close()


def test_a_pipe_nobody_reads_any_more_drops_its_bytes_and_the_rest_go_on():
    link = AgentLink(ray=None, actor=None, run=1, where="here")
    pipes = [_Pipes(), _Pipes()]
    try:
        for position, rank in enumerate(pipes):
            link.add_rank(position, rank.theirs, None)
        pipes[0].ours["control"].close()  # the kernel closed its end (the run ended there)
        link.deliver(Batch(1, chunks=[(0, "control", b"x" * 100), (1, "stdout", b"ok\n")],
                           exits={0: (-9, 1.0, True)}))  # fmt: skip
        assert pipes[1].read_all("stdout") == b"ok\n"
        assert link.backlog_bytes == 0 and link.exit_code(0) == -9
    finally:
        link.close()
        for rank in pipes:
            rank.close()


def test_the_stand_in_main_of_overlapping_starts_gives_back_the_real_one():
    """Two overlapping starts in an agent (the forkserver's warm-up and a rank) each see the
    stand-in ``__main__``; the real module is back once both ended, in either order."""
    import sys
    import threading

    from nb_dist._node._agent import _plain_main

    real = sys.modules["__main__"]
    entered, leave_first = threading.Event(), threading.Event()
    seen: list[object] = []

    def first() -> None:
        with _plain_main():
            seen.append(sys.modules["__main__"])
            entered.set()
            leave_first.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(10)
    with _plain_main():
        assert sys.modules["__main__"] is seen[0] is not real
        leave_first.set()
        thread.join(10)
        assert sys.modules["__main__"] is not real  # the other start is still inside
    assert sys.modules["__main__"] is real


class _HungAgentRay:
    """What a link asks of Ray, for an agent that answers signals at once and never answers
    a kill-and-reap: ``get`` then waits out its timeout, as Ray's does."""

    class exceptions:
        class RayActorError(Exception):
            pass

        class GetTimeoutError(Exception):
            pass

    class _Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: object) -> str:
            return self.name

    class actor:
        def __getattr__(self, name: str) -> object:
            return _HungAgentRay._Method(name)

    def get(self, ref: str, timeout: float) -> object:
        if ref == "signal":
            return True
        time.sleep(timeout)
        raise self.exceptions.GetTimeoutError(f"{ref}: no answer within {timeout} s")


def test_a_hung_agent_costs_a_teardown_its_deadline_not_the_call_limit(monkeypatch):
    """Ending the ranks of an agent that never answers waits what is left of the teardown's
    deadline and a round trip, not ``CALL_LIMIT`` (30 s); the agent is then taken for lost,
    so its other ranks end at once."""
    from nb_dist._cluster import _forward
    from nb_dist._cluster._forward import RemoteProcess
    from nb_dist._starter import _processes

    monkeypatch.setattr(_processes, "REAP_WITHIN", 0.3)
    monkeypatch.setattr(_forward, "ANSWER_MARGIN", 0.2)
    ray = _HungAgentRay()
    link = AgentLink(ray=ray, actor=ray.actor(), run=1, where="node-b")
    ranks = [RemoteProcess(link, i, 100 + i, lambda reason, at: None) for i in range(2)]
    began = time.monotonic()
    codes = _processes.end_all(ranks)  # type: ignore[arg-type]
    took = time.monotonic() - began
    assert took < 2.0, took  # CALL_LIMIT would be 30 s
    assert codes == [-9, -9]
    assert link.lost is not None  # the agent counts as gone: its node is lost
