"""Live ranks (nb_dist.Ranks) with real processes: tasks, namespaces, failures, restarts.

The ranks are forked from this test process, as they are from a kernel (their namespace is
then pytest's __main__, so each session first imports what its cells use); what only a kernel
has (the notebook's namespace, the %%ranks magic, interrupts from the frontend, kernel death)
is in test_ranks_kernel.py.
Events are ordered with handshakes (files the ranks write), never with sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from process_helpers import OnWrite, assert_all_gone, release_fifo

import nb_dist
from nb_dist import LaunchTimeoutError, Ranks, SessionError, WorkerFailedError, per_rank

pytestmark = pytest.mark.timeout(120)

IMPORTS = "import os, signal, torch, torch.distributed as dist, nb_dist"


@pytest.fixture
def ranks():
    session = Ranks(2, output="grouped")
    try:
        session.exec(IMPORTS)
        yield session
    finally:
        pids = session.pids
        session.close()
        assert_all_gone(pids)


# ----------------------------------------------------------------------------- basics
def test_each_rank_has_the_process_group_and_its_own_namespace(ranks):
    assert ranks.exec("dist.get_world_size()") == [2, 2]
    ranks.exec("x = torch.ones(2) * dist.get_rank()")
    pulled = ranks.pull("x")
    assert [t.tolist() for t in pulled] == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.fast
def test_state_survives_between_tasks_and_collectives_work(ranks):
    ranks.exec("t = torch.tensor([float(dist.get_rank() + 1)])")
    ranks.exec("dist.all_reduce(t)")
    assert ranks.pull("t")[0].item() == 3.0
    assert ranks.cells == 4  # the imports, two exec and one pull


def _times(value, k=1):
    return value * k * (dist.get_rank() + 1)


def test_run_calls_a_function_with_args_and_kwargs(ranks):
    # A notebook's functions (module __main__) are shipped by value and see the rank's
    # namespace: that is tested in a real kernel (test_ranks_kernel.py).
    assert ranks.run(_times, 21, k=2) == [42, 84]
    assert ranks.run(lambda: dist.get_rank() * 10) == [0, 10]


def test_push_same_value_and_per_rank_values(ranks):
    ranks.push(lr=0.5, seed=per_rank(7, 8))
    assert ranks.pull("lr", "seed") == [(0.5, 7), (0.5, 8)]


def test_exec_on_some_ranks_only(ranks):
    result = ranks.exec("dist.get_rank()", rank=1)
    assert list(result) == [1] and result.ranks == [1]


def test_reports_accumulate_across_tasks(ranks):
    ranks.exec("nb_dist.report('loss', 1.0 + dist.get_rank())")
    result = ranks.exec("nb_dist.report('loss', 0.5)")
    assert [value for _, value in result.reports["loss"][1]] == [2.0, 0.5]


def test_output_is_labelled_and_kept_in_logs(ranks, capsys):
    result = ranks.exec("print('hello from', dist.get_rank())")
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert result.logs == ["hello from 0\n", "hello from 1\n"]


# ----------------------------------------------------------------------------- failures
@pytest.mark.fast
def test_a_failure_on_one_rank_leaves_the_session_usable(ranks):
    with pytest.raises(WorkerFailedError) as info:
        ranks.exec("if dist.get_rank() == 1:\n    raise ValueError('bad shard')\nx = 1")
    text = str(info.value)
    assert text.startswith("rank 1 failed first: ValueError: bad shard")
    assert "The session is still usable" in text
    assert info.value.root_cause.rank == 1
    assert ranks.exec("dist.get_rank()") == [0, 1]


def test_a_rank_blocked_in_a_skipped_collective_is_freed_and_state_kept(ranks):
    ranks.exec("state = 'kept'")
    old = ranks.pids
    with pytest.raises(WorkerFailedError) as info:
        ranks.exec("if dist.get_rank() == 1:\n    raise ValueError('skips')\ndist.barrier()")
    text = str(info.value)
    assert "rank 1 failed first: ValueError: skips" in text
    assert "Rank 0 could not be interrupted" in text and "Every rank kept its variables" in text
    assert "The session is still usable" in text
    assert ranks.restarts == 0 and ranks.pids == old
    assert ranks.exec("state") == ["kept", "kept"]
    assert ranks.exec("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]


def test_a_rank_that_cannot_be_freed_is_stopped_and_the_session_restarts(ranks):
    """Blocked outside any collective, with SIGINT blocked: dropping connections frees
    nothing, so every rank is stopped and fresh ones start (the fallback)."""
    ranks.exec("state = 'kept'")
    old = ranks.pids
    cell = (
        "import time\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('fails')\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
        "time.sleep(60)  # deaf to interrupts, in no collective"
    )
    with pytest.raises(WorkerFailedError) as info:
        ranks.exec(cell)
    text = str(info.value)
    assert "the session was restarted with fresh ranks" in text and "state was lost" in text
    assert_all_gone(old)
    assert ranks.restarts == 1 and set(ranks.pids).isdisjoint(old)
    ranks.exec(IMPORTS)
    assert ranks.exec("'state' in globals()") == [False, False]


def test_timeout_shows_stacks_and_interrupts_the_cell(ranks, tmp_path):
    with pytest.raises(LaunchTimeoutError) as info:
        ranks.exec("import time\nif dist.get_rank() == 0:\n    time.sleep(60)", timeout=2)
    text = str(info.value)
    assert "rank 0 was blocked at `time.sleep(60)`" in text
    assert "The session is still usable" in text
    assert ranks.restarts == 0
    assert ranks.exec("dist.get_rank()") == [0, 1]


def test_timeout_in_a_collective_frees_the_rank_and_keeps_the_state(ranks):
    ranks.exec("state = 'kept'")
    old = ranks.pids
    with pytest.raises(LaunchTimeoutError) as info:
        # Waited on outside the counted call (async_op), so only the timeout can end it.
        ranks.exec("if dist.get_rank() == 0:\n    dist.barrier(async_op=True).wait()", timeout=2)
    text = str(info.value)
    assert "barrier" in text
    assert "Rank 0 did not stop when interrupted and was freed" in text
    assert "Every rank kept its variables" in text
    assert ranks.pids == old and ranks.restarts == 0
    assert ranks.exec("state") == ["kept", "kept"]
    assert ranks.exec("dist.barrier()\ndist.get_rank()") == [0, 1]


@pytest.mark.parametrize("how", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_rank_that_dies_is_named_and_restart_brings_fresh_ranks(ranks, how):
    old = ranks.pids
    with pytest.raises(WorkerFailedError) as info:
        ranks.exec(f"import os, signal\nif dist.get_rank() == 1:\n    {how}\ndist.barrier()")
    text = str(info.value)
    assert "rank 1 failed first" in text
    assert ("exited with code 3" in text) if "_exit" in how else ("SIGKILL" in text)
    assert "Rank 1 died" in text and "restart()" in text
    assert_all_gone(old)
    with pytest.raises(SessionError, match="restart"):
        ranks.exec("1")
    ranks.restart()
    ranks.exec(IMPORTS)
    assert ranks.exec("dist.get_rank()") == [0, 1]


def test_a_rank_killed_between_tasks_is_found_before_the_next(ranks):
    os.kill(ranks.pids[0], signal.SIGKILL)
    _await_death(ranks.pids[0])
    with pytest.raises(SessionError, match=r"rank 0 ended between cells: .*SIGKILL"):
        ranks.exec("1")
    ranks.restart()
    assert ranks.exec("1") == [1, 1]


def test_ranks_out_of_step_are_reported_before_the_next_task(ranks, capsys):
    ranks.exec("solo = dist.new_group([0])")  # a group of rank 0 alone
    ranks.exec("if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1), group=solo)")
    capsys.readouterr()
    ranks.exec("1")
    err = capsys.readouterr().err
    assert "the ranks are out of step" in err and "rank 0: 1, rank 1: 0" in err


def _await_death(pid: int) -> None:
    """Until ``pid`` (a child of this process) has ended, all its threads too; not reaped."""
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline, f"rank {pid} did not die"
        time.sleep(0.005)


# ----------------------------------------------------------------------------- bad input
def test_a_syntax_error_is_raised_once_in_the_kernel(ranks):
    with pytest.raises(SyntaxError):
        ranks.exec("for x in")
    assert ranks.cells == 1  # only the imports: nothing was sent


def test_pulling_a_missing_name_says_which_ranks(ranks):
    ranks.exec("only_on_zero = 1", rank=0)
    with pytest.raises(WorkerFailedError, match="'only_on_zero' not defined on rank 1"):
        ranks.pull("only_on_zero")
    with pytest.raises(TypeError, match="variable names as strings"):
        ranks.pull("not a name")


def test_unpicklable_values(ranks):
    with pytest.raises(TypeError, match="cannot be sent to the ranks"):
        ranks.push(lock=threading.Lock())
    with pytest.raises(TypeError, match="cannot be sent to the ranks"):
        ranks.run(len, threading.Lock())
    ranks.exec("import threading\nlock = threading.Lock()")
    with pytest.raises(WorkerFailedError, match="cannot be sent back to the kernel"):
        ranks.pull("lock")
    assert ranks.exec("1") == [1, 1]


def test_bad_arguments_name_the_parameter(ranks):
    with pytest.raises(ValueError, match=r"push\(x=per_rank\(\.\.\.\)\) got 3 values for 2 ranks"):
        ranks.push(x=per_rank(1, 2, 3))
    with pytest.raises(ValueError, match="rank=5"):
        ranks.exec("1", rank=5)
    with pytest.raises(TypeError, match="pass the code as a string"):
        ranks.exec(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_processes=0"):
        Ranks(0)


def test_a_closed_session_says_how_to_start_one():
    session = Ranks(2)
    pids = session.pids
    session.close()
    session.close()  # twice is fine
    assert_all_gone(pids)
    with pytest.raises(SessionError, match=r"closed\. Start a new one"):
        session.exec("1")


def test_context_manager_closes():
    with Ranks(2) as session:
        pids = session.pids
        assert session.exec("1") == [1, 1]
    assert session.closed
    assert_all_gone(pids)


# ----------------------------------------------------------------------------- no leaks
def _kernel_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_processes_threads_or_fds_left_after_many_cells_with_faults():
    threads_before, fds_before = threading.active_count(), _kernel_fds()
    me = psutil.Process()
    with Ranks(2) as session:
        session.exec(IMPORTS)
        for cell in range(100):
            if cell % 25 == 7:
                with pytest.raises(WorkerFailedError):
                    session.exec("if dist.get_rank() == 0:\n    raise RuntimeError('fault')")
            elif cell % 25 == 19:
                with pytest.raises(WorkerFailedError):  # blocked: freed, the group formed again
                    session.exec("if dist.get_rank() == 0:\n    raise RuntimeError('x')\n"
                                 "dist.barrier()")  # fmt: skip
            else:
                assert session.exec(f"{cell} + dist.get_rank()") == [cell, cell + 1]
        assert session.restarts == 0
        pids = session.pids
    assert_all_gone(pids)
    assert [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE] == []
    assert threading.active_count() == threads_before
    assert _kernel_fds() <= fds_before


def test_spawned_ranks_start_from_an_empty_namespace():
    with Ranks(2, start_method="spawn") as session:
        assert session.exec("'IMPORTS' in globals() or 'pytest' in globals()") == [False, False]
        session.exec("import torch.distributed as dist")
        assert session.exec("dist.get_rank()") == [0, 1]


def test_the_kernel_process_group_check_applies(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(nb_dist.UnsafeLaunchError, match="process group"):
            Ranks(2)
    finally:
        dist.destroy_process_group()


assert torch is not None  # the ranks' namespace uses `torch` from this module


def test_a_cells_unpicklable_last_value_is_shown_by_its_repr(ranks):
    result = ranks.exec("import threading\nthreading.Lock()")
    assert all(repr(value).startswith("<unlocked _thread.lock object") for value in result)


def test_the_magics_options_are_checked(ranks):
    from nb_dist._live._magic import ranks_magic

    with pytest.raises(ValueError, match=r"--rank x: give ranks as numbers, e\.g\. --rank 0,1"):
        ranks_magic("--rank x", "1")
    with pytest.raises(ValueError, match="unrecognized arguments: --bogus"):
        ranks_magic("--bogus", "1")
    with pytest.raises(ValueError, match="rank=\\[7\\]: give a rank between 0 and 1"):
        ranks_magic("--rank 7", "1")
    assert repr(ranks_magic("--rank 0,1", "dist.get_rank()")) == "[rank 0] 0\n[rank 1] 1"
    assert repr(ranks_magic("", "2 * 3")) == "[all ranks] 6"


def test_a_rank_still_busy_with_an_earlier_cell_is_interrupted_before_the_next(ranks, capsys):
    """What a second interrupt can leave behind: a rank still running a cell the kernel no
    longer waits for. The next cell first interrupts it, so no reply is misattributed."""
    from nb_dist._shared import _protocol

    busy = ranks._held.supervisor.ranks[1]
    busy.tasks_sent += 1
    busy.send(_protocol.Execute(0, "import time\ntime.sleep(60)", "<left running>"))
    assert ranks.exec("dist.get_rank()") == [0, 1]
    assert ranks.exec("41 + 1") == [42, 42]


def test_export_writes_what_the_cells_use_from_the_kernel():
    """Library names under the notebook's alias are imported (not their source pasted), and
    what an inlined notebook function uses is defined too."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    from nb_dist._live._export import History

    def make_dataset():
        return TensorDataset(torch.ones(4, 2))

    make_dataset.__module__ = "__main__"  # defined in a notebook cell
    history = History()
    history.kernel = {
        "DDP": DDP, "TensorDataset": TensorDataset, "torch": torch,
        "make_dataset": make_dataset, "lr": 0.5, "lock": threading.Lock(),
    }  # fmt: skip
    history.executed("m = DDP(torch.nn.Linear(2, 1))\nds = make_dataset()\nlen(ds) * lr", [0, 1], 2)
    history.executed("lock", [0], 2)
    plan = SimpleNamespace(nprocs=2, backend="gloo")
    script = history.script(plan, "train.py")  # type: ignore[arg-type]
    assert "from torch.nn.parallel.distributed import DistributedDataParallel as DDP" in script
    assert "class DistributedDataParallel" not in script
    assert "from torch.utils.data.dataset import TensorDataset" in script
    assert "def make_dataset():" in script and "lr = 0.5" in script
    assert "# lock (a lock) was defined in the notebook: define it here" in script
    assert "_show(len(ds) * lr)" in script
    assert "if dist.get_rank() in (0,):\n    _show(lock)" in script
    compile(script, "train.py", "exec")


def test_closing_one_session_reaches_its_ranks_while_another_is_open():
    """Ranks forked later (another session) close the first session's pipe ends, so closing
    the first reaches its ranks at once: they destroy their group and exit 0, not killed."""
    first = Ranks(2)
    second = Ranks(2)
    try:
        ranks_of_first = first._held.supervisor.ranks
        first.close()
        assert [w.returncode for w in ranks_of_first] == [0, 0]
        assert second.exec("1") == [1, 1]
    finally:
        first.close()
        second.close()


def test_export_comments_what_cannot_be_written_as_source():
    from types import SimpleNamespace

    from nb_dist._live._export import History

    history = History()
    history.called(lambda: 1, (), {})

    def step(k, scale=1):
        return k * scale

    step.__module__ = "__main__"
    history.called(step, (threading.Lock(),), {})
    history.called(step, (2,), {"scale": 3})
    history.pushed({"lock": threading.Lock(), "seeds": per_rank(1, 2)})
    script = history.script(SimpleNamespace(nprocs=2, backend="gloo"), "x.py")  # type: ignore[arg-type]
    assert "run(a lambda, ...): it has no source under a name to call" in script
    assert "# step(...) was called with values that cannot be written as source" in script
    assert "_show(step(2, scale=3))" in script
    assert "# lock was pushed as a value that cannot be written as source" in script
    assert "seeds = [1, 2][dist.get_rank()]" in script
    compile(script, "x.py", "exec")


def test_an_empty_rank_list_is_refused(ranks):
    with pytest.raises(ValueError, match=r"rank=\[\]: give a rank between 0 and 1"):
        ranks.exec("1", rank=[])
    with pytest.raises(ValueError, match=r"push\(__name__=\.\.\.\): __name__ belongs to"):
        ranks.push(__name__="x")


# ----------------------------------------------------------------------------- straggler notice
def test_a_rank_still_running_after_the_others_finished_gets_a_notice(tmp_path, monkeypatch):
    """hang_notice_after=0.5: where a rank still runs after the others finished the cell is
    printed while the cell goes on. A handshake: rank 1 waits on a FIFO that writing the
    notice opens."""
    release = tmp_path / "release"
    os.mkfifo(release)
    notices = OnWrite(sys.stderr, "is still running", lambda: release_fifo(release))
    monkeypatch.setattr(sys, "stderr", notices)
    with Ranks(2, output="grouped", hang_notice_after=0.5) as session:
        session.exec(IMPORTS)
        cell = (
            "if dist.get_rank() == 1:\n"
            f"    fd = os.open({str(release)!r}, os.O_RDONLY)  # lingering rank 1\n"
            "    os.read(fd, 2)\n"
            "    os.close(fd)\n"
            "dist.get_rank()"
        )
        assert session.exec(cell) == [0, 1]
        assert notices.fired
    err = "".join(notices.seen)
    assert "rank 1 is still running" in err and "after rank(s) 0 finished" in err, err
    assert "`fd = os.open(" in err and "# lingering rank 1`" in err, err
    assert "%%ranks --timeout" in err  # how to limit a cell, not a launch
    assert err.count("is still running") == 1


def test_a_wait_the_counts_cannot_prove_is_noticed_and_interrupt_ends_the_cell(monkeypatch):
    """A collective only one rank calls, waited on outside the counted call (async_op, as
    DDP's C++ all-reduces are): no proof of a deadlock, so the notice after
    hang_notice_after names where rank 0 is, and ■ ends the cell."""

    def interrupt() -> None:
        raise KeyboardInterrupt  # ■ pressed as the notice appears

    notices = OnWrite(sys.stderr, "is still running", interrupt)
    monkeypatch.setattr(sys, "stderr", notices)
    with Ranks(2, output="grouped", hang_notice_after=0.5) as session:
        session.exec(IMPORTS)
        old = session.pids
        with pytest.raises(KeyboardInterrupt) as info:
            session.exec(
                "if dist.get_rank() == 0:\n"
                "    dist.all_reduce(torch.ones(1), async_op=True).wait()  # rank 0 alone"
            )
        assert notices.fired
        assert "was freed" in str(info.value) and "kept its variables" in str(info.value)
        assert session.pids == old
        assert session.exec("dist.barrier()\ndist.get_rank()") == [0, 1]
    err = "".join(notices.seen)
    assert "rank 0 is still running" in err and "# rank 0 alone`" in err, err


def test_hang_notice_none_keeps_a_cell_quiet(tmp_path, monkeypatch):
    notices = OnWrite(sys.stderr, "is still running", lambda: None)
    monkeypatch.setattr(sys, "stderr", notices)
    with Ranks(2, output="grouped", hang_notice_after=None) as session:
        session.exec(IMPORTS)
        session.exec("import time\nif dist.get_rank() == 1:\n    time.sleep(1.5)")
    assert not notices.fired


# ----------------------------------------------------------------------------- deadlocks
@pytest.mark.fast
def test_a_collective_only_some_ranks_call_ends_the_cell_without_a_timeout(ranks):
    """The classroom mistake: no --timeout, yet the cell ends (within about half a second of
    rank 1 finishing) with which collective, who finished after how many, rank 0's line."""
    ranks.exec("t = torch.ones(1)\ndist.all_reduce(t)")  # one collective each, in step
    ranks.exec("model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))")
    old = ranks.pids
    with pytest.raises(WorkerFailedError) as info:
        ranks.exec("if dist.get_rank() == 0:\n    dist.all_reduce(t)  # rank 0 only")
    text = str(info.value)
    assert text.startswith(
        "rank 0 is blocked in all_reduce #2, which rank 1 will never enter: rank 1 finished "
        "the cell after 1 collectives."
    ), text
    assert "`dist.all_reduce(t)  # rank 0 only`" in text
    assert "Every rank kept its variables" in text and "model = DDP(model.module)" in text
    assert info.value.root_cause.rank == 0
    # The same processes, their variables kept, a working default group, counts in step.
    assert ranks.pids == old and ranks.restarts == 0
    assert ranks.exec("t.item()") == [2.0, 2.0]
    ranks.exec("model = torch.nn.parallel.DistributedDataParallel(model.module)")
    ranks.exec("model(torch.ones(3, 2)).sum().backward()")
    grads = ranks.exec("[p.grad.sum().item() for p in model.parameters()]")
    assert grads[0] == grads[1]


@pytest.mark.parametrize("monitor", [False, True])
def test_a_collective_on_a_subset_of_the_ranks_is_a_deadlock_too(monitor):
    """`%%ranks --rank 0` with a collective: rank 1 is idle, outside the cell (with the live
    monitor too, which knows only the cell's ranks)."""
    with Ranks(2, output="grouped", monitor=monitor) as ranks:
        ranks.exec(IMPORTS)
        _subset_deadlock(ranks)


def _subset_deadlock(ranks):
    with pytest.raises(WorkerFailedError, match="rank 1 finished the cell after 0 collectives"):
        ranks.exec("dist.barrier()", rank=[0])
    assert ranks.restarts == 0
    assert ranks.exec("dist.barrier()\ndist.get_rank()") == [0, 1]


@pytest.mark.parametrize(
    "cell",
    [
        # A rank still computing, with the other one done (no collective at all).
        "import time\nif dist.get_rank() == 0:\n    time.sleep(1.5)",
        # Every rank inside the same collective, one of them late: a barrier reached later.
        "import time\nif dist.get_rank() == 0:\n    time.sleep(1.5)\ndist.barrier()",
        # Long collectives on a big tensor: every rank in them, one returning before another.
        "big = torch.ones(8_000_000)\nfor _ in range(6):\n    dist.all_reduce(big)",
    ],
    ids=["computing", "late-barrier", "big-tensor"],
)
def test_no_deadlock_is_reported_where_there_is_none(ranks, cell):
    before = ranks.pids
    assert ranks.exec(cell + "\ndist.get_rank()") == [0, 1]
    assert ranks.pids == before and ranks.restarts == 0
