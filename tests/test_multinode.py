"""Two launches on loopback acting as node 0 (this process) and node 1 (a subprocess)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from process_helpers import assert_all_gone

from nb_dist import notebook_launcher


def _allreduce_rank_plus_one():
    dist.init_process_group()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"world {dist.get_world_size()} sum {t.item():g}")
    return {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world_size": dist.get_world_size(),
        "node_rank": int(os.environ["NODE_RANK"]),
        "sum": t.item(),
        "pid": os.getpid(),
    }


_NODE1 = textwrap.dedent(
    """
    import json
    import sys

    sys.path.insert(0, {tests_dir!r})
    from test_multinode import _allreduce_rank_plus_one

    from nb_dist import notebook_launcher

    result = notebook_launcher(
        _allreduce_rank_plus_one,
        num_processes=2,
        num_nodes=2,
        node_rank=1,
        use_port={port},
        master_addr="127.0.0.1",
        timeout=45,
    )
    print("NODE1 " + json.dumps(
        {{"ranks": result.ranks, "by_rank": result.by_rank, "port": result.port}}
    ), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_workers(process: subprocess.Popen, count: int, within: float) -> None:
    """Wait until ``process`` has started ``count`` children (its launch's workers)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if len(psutil.Process(process.pid).children()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"node 1 did not start {count} workers within {within} s")


def _node0_beside_node1(node1_first: bool, before_launch=lambda: None):
    """Start node 1 (2 ranks) in a subprocess, launch node 0 (2 ranks) here on one port; node
    0's result and node 1's ``(returncode, stdout, stderr)``. ``node1_first``: node 0 starts
    once node 1's ranks are up and connecting. ``before_launch`` runs just before node 0's."""
    port = _free_port()
    script = _NODE1.format(tests_dir=os.path.dirname(os.path.abspath(__file__)), port=port)
    node1 = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        if node1_first:
            _wait_for_workers(node1, 2, within=30)  # node 1's ranks are up and connecting
        before_launch()
        result = notebook_launcher(
            _allreduce_rank_plus_one,
            num_processes=2,
            num_nodes=2,
            node_rank=0,
            use_port=port,
            master_addr="127.0.0.1",
            timeout=45,
        )
        out1, err1 = node1.communicate(timeout=50)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    return result, port, (node1.returncode, out1, err1)


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["node0_first", "node1_first"])
def test_two_nodes_on_loopback_form_one_world(capsys, order):
    """Node 0 and node 1 (2 ranks each) rendezvous on one port: world 4, all_reduce sums to 10.

    With node1_first, node 1's workers are already waiting when node 0 opens the store.
    """
    result, port, (code1, out1, err1) = _node0_beside_node1(order == "node1_first")
    assert code1 == 0, out1 + err1

    # Node 0: global ranks 0 and 1, hosting the store on the agreed port.
    assert result.ranks == [0, 1]
    assert result.port == port
    assert [v["rank"] for v in result] == [0, 1]
    for local, value in enumerate(result):
        assert value["local_rank"] == local
        assert (value["world_size"], value["node_rank"], value["sum"]) == (4, 0, 10.0)
    out0 = capsys.readouterr().out
    assert "[rank 0] world 4 sum 10" in out0 and "[rank 1] world 4 sum 10" in out0

    # Node 1: global ranks 2 and 3, local ranks 0 and 1, labelled with their global rank.
    line = next(x for x in out1.splitlines() if x.startswith("NODE1 "))
    node1_result = json.loads(line[len("NODE1 ") :])
    assert node1_result["ranks"] == [2, 3]
    assert node1_result["port"] == port
    by_rank = {int(k): v for k, v in node1_result["by_rank"].items()}
    assert sorted(by_rank) == [2, 3]
    for rank, value in by_rank.items():
        assert value["rank"] == rank
        assert value["local_rank"] == rank - 2
        assert (value["world_size"], value["node_rank"], value["sum"]) == (4, 1, 10.0)
    assert "[rank 2] world 4 sum 10" in out1 and "[rank 3] world 4 sum 10" in out1

    assert_all_gone([v["pid"] for v in result] + [v["pid"] for v in by_rank.values()])


def _threads_here() -> int:
    return len(os.listdir("/proc/self/task"))


_forking: list[int] | None = None  # while armed: this process's thread count at each fork
_threads_before = 0  # and just before it was armed


def _arm_fork_count() -> None:
    global _forking, _threads_before
    _threads_before, _forking = _threads_here(), []


def _count_threads_at_fork() -> None:
    if _forking is not None:
        _forking.append(_threads_here())


os.register_at_fork(before=_count_threads_at_fork)  # does nothing until a test arms it


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_node0_forks_every_rank_before_its_store_serves():
    """Other machines' ranks connect to node 0's store whenever they start. The store's server
    thread looks each new peer's name up (``getnameinfo``) under glibc's resolver lock, and a
    rank forked at that moment inherits the lock held: it hangs in ``init_process_group`` for
    ever (1 rank in 7 here, with node 1's ranks connecting during node 0's forks). So node 0
    opens the port, forks every rank, and only then starts the server: no thread beside the
    kernel's own runs while it forks, and node 1's early ranks still join.
    """
    global _forking
    try:
        result, _, (code1, out1, err1) = _node0_beside_node1(True, before_launch=_arm_fork_count)
    finally:
        forks, _forking = _forking, None
    assert code1 == 0, out1 + err1
    assert [v["sum"] for v in result] == [10.0, 10.0]
    assert forks is not None and len(forks) == 2, forks  # one fork per rank of node 0
    assert max(forks) <= _threads_before, (_threads_before, forks)


def _return_rank() -> int:
    dist.init_process_group()
    return dist.get_rank()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_store_that_cannot_serve_after_the_forks_takes_the_ranks_with_it(monkeypatch):
    """The store's server starts after the forks; if it cannot, the forked ranks (which would
    wait for it) are stopped, the error reaches the caller, and the next launch works."""
    from nb_dist._starter import _parts

    forked: list[int] = []
    serve = _parts.serve_store

    def refuse(listener, address, world_size):
        forked.extend(child.pid for child in psutil.Process().children())
        listener.close()
        raise RuntimeError("the store refused to start")

    monkeypatch.setattr(_parts, "serve_store", refuse)
    with pytest.raises(RuntimeError, match="the store refused to start"):
        notebook_launcher(_return_rank, num_processes=2, timeout=30)
    assert len(forked) >= 2, forked
    assert_all_gone(forked)
    monkeypatch.setattr(_parts, "serve_store", serve)
    assert list(notebook_launcher(_return_rank, num_processes=2, timeout=30)) == [0, 1]
