"""The collective counter with real processes and real gloo groups (no launcher involved).

A process group in this process would make the launcher refuse every later launch of the
test session, so the ranks are subprocesses; this process plays the kernel and reads their
files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nb_dist._shared import _collectives

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent

# Rank 0 of a world of 1: every counted kind of call, then what it saw, as JSON on stdout.
WORLD_OF_ONE = """
import json, os, sys
import torch
import torch.distributed as dist
from nb_dist._shared import _collectives as c

path, store_file = sys.argv[1], sys.argv[2]
c.install(path)
c.install(path)  # idempotent: still one wrapper, counts kept
seen = {"same_wrapper": dist.all_reduce is dist.distributed_c10d.all_reduce,
        "wraps": dist.all_reduce.__name__, "start": c.count()}
store = dist.FileStore(store_file, 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
seen["after_init"] = c.count()
t = torch.ones(2)
dist.all_reduce(t)
seen["after_all_reduce"] = c.count()
dist.barrier()
objects = [None]
dist.all_gather_object(objects, {"x": 1})  # calls all_gather inside: counted once
seen["after_all_gather_object"] = c.count()
out = [torch.zeros(2)]
dist.all_gather(out, t)
dist.broadcast(t, src=0)
seen["after_broadcast"] = c.count()
try:
    dist.all_reduce("not a tensor")
except Exception as exc:
    seen["raised"] = type(exc).__name__
seen["after_raise"] = c.count()
dist.destroy_process_group()
original = c._originals[(dist, "all_reduce")]
c.uninstall()
seen["restored"] = dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
print(json.dumps(seen))
"""

# One of two ranks. Rank 0: all_reduce, then barrier. Rank 1: all_reduce, then waits until
# rank 0's file says it is inside the barrier, then for a line on stdin from the test (which
# reads rank 0's file meanwhile), then joins the barrier. No sleep decides anything.
TWO_RANKS = """
import json, sys, time
import torch
import torch.distributed as dist
from nb_dist._shared import _collectives as c

rank, mine, other = int(sys.argv[1]), sys.argv[2], sys.argv[3]
c.install(mine)
dist.init_process_group("gloo", rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 1:
    while True:
        state = c.read(other)
        if state is not None and state.current == "barrier":
            break
        time.sleep(0.001)
    print(json.dumps({"rank 0 seen by rank 1": [state.entered, state.completed]}), flush=True)
    sys.stdin.readline()
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"count": c.count()}), flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_new_file_reads_as_unknown_and_a_missing_one_as_none(tmp_path):
    path = _collectives.create(str(tmp_path), 3)
    assert os.path.getsize(path) == _collectives.SIZE
    assert "rank3" in os.path.basename(path)
    assert _collectives.create(str(tmp_path), 3) != path  # unique per call
    assert _collectives.read(path) is None  # zero-filled: no worker installed the counter
    assert _collectives.read(str(tmp_path / "missing")) is None
    (tmp_path / "short").write_bytes(b"\x01" * 8)
    assert _collectives.read(str(tmp_path / "short")) is None


@pytest.mark.timeout(60)
def test_counts_in_a_world_of_one(tmp_path):
    path = _collectives.create(str(tmp_path), 0)
    proc = subprocess.run(
        [sys.executable, "-c", WORLD_OF_ONE, path, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["same_wrapper"] and seen["wraps"] == "all_reduce"
    assert seen["start"] == 0
    assert seen["after_init"] == 0  # init_process_group is not a collective
    assert seen["after_all_reduce"] == 1
    assert seen["after_all_gather_object"] == 3  # barrier 2, all_gather_object (nested) 3
    assert seen["after_broadcast"] == 5
    assert seen["after_raise"] == 6  # a call that raised was entered, and left
    assert seen["restored"]
    # The file outlives the process: what the kernel reads after a rank died.
    state = _collectives.read(path)
    assert state == _collectives.CollectiveState(6, 6, None, state.pid if state else 0)
    assert state is not None and state.pid != os.getpid()


@pytest.mark.timeout(60)
def test_the_kernel_sees_which_collective_a_blocked_rank_is_in(tmp_path):
    paths = [_collectives.create(str(tmp_path), rank) for rank in (0, 1)]
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), paths[rank], paths[1 - rank]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        rank1 = procs[1]
        assert rank1.stdout is not None and rank1.stdin is not None
        line = rank1.stdout.readline()  # rank 1 saw rank 0 inside the barrier
        assert json.loads(line) == {"rank 0 seen by rank 1": [2, 1]}, procs[1].stderr
        # Rank 0 is blocked in the barrier until rank 1 joins: its main thread runs no Python,
        # and this process still reads where it is.
        assert _collectives.read(paths[0]) == _collectives.CollectiveState(
            entered=2, completed=1, current="barrier", pid=procs[0].pid
        )
        state1 = _collectives.read(paths[1])
        assert state1 is not None and (state1.entered, state1.current) == (1, None)
        rank1.stdin.write("go\n")
        rank1.stdin.flush()
        outputs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"count": 2}
    for rank, path in enumerate(paths):
        assert _collectives.read(path) == _collectives.CollectiveState(2, 2, None, procs[rank].pid)


@pytest.mark.timeout(30)
def test_install_in_this_process_counts_and_uninstall_restores(tmp_path):
    import torch.distributed as dist

    original = dist.barrier
    path = _collectives.create(str(tmp_path), 0)
    _collectives.install(path)
    try:
        assert dist.barrier is not original and dist.barrier.__wrapped__ is original
        assert dist.distributed_c10d.barrier is dist.barrier
        with pytest.raises(ValueError):  # no process group here: torch refuses, after entering
            dist.barrier()
        state = _collectives.read(path)
        assert state == _collectives.CollectiveState(1, 1, None, os.getpid())
        assert _collectives.count() == 1
        # Another file: the counter moves there and starts again.
        other = _collectives.create(str(tmp_path), 0)
        _collectives.install(other)
        assert _collectives.count() == 0 and _collectives.read(other) is not None
    finally:
        _collectives.uninstall()
    assert dist.barrier is original and dist.distributed_c10d.barrier is original


@pytest.mark.timeout(30)
def test_a_forked_child_does_not_write_into_the_file(tmp_path):
    import torch.distributed as dist

    path = _collectives.create(str(tmp_path), 0)
    _collectives.install(path)
    try:
        pid = os.fork()
        if pid == 0:  # the child: a collective that fails at once, counted privately
            code = 0
            try:
                dist.barrier()
            except ValueError:
                code = 0 if _collectives.count() == 1 else 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _collectives.read(path) == _collectives.CollectiveState(0, 0, None, os.getpid())
    finally:
        _collectives.uninstall()
