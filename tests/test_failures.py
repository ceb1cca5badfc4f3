"""The reliability contract: failures, crashes, timeouts, hangs and restarts with real workers.

Every worker function records its pid in the test's tmp dir first thing, so each test can prove
that no worker outlives the launch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_helpers import OnWrite, assert_all_gone, release_fifo

from nb_dist import LaunchTimeoutError, RankOutcome, WorkerFailedError, notebook_launcher
from nb_dist._kernel._diagnosis import looks_collateral

#: What README promises for "a rank raises" and ■: every other rank stopped within a second.
#: Tests allow five times that (a loaded 2-core box); bench/ measures the promise itself.
STOPPED_WITHIN = 5 * 1.0

THIS_FILE = os.path.basename(__file__)

# After a launch returns or raises, its workers have been reaped: ``assert_all_gone(...,
# within=0)`` checks that at once. How long stopping takes is not timed here.


# ----------------------------------------------------------------------------- helpers
def _start(tmp: str) -> int:
    """Record this worker's pid in ``tmp`` and return its rank."""
    rank = int(os.environ["RANK"])
    Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
    return rank


def _arrive(tmp: str, name: str) -> None:
    """One side of a handshake between ranks: say "I got here"."""
    Path(tmp, name).write_text(str(os.getpid()))


def _await(tmp: str, *names: str, within: float = 30.0) -> None:
    """The other side: wait until every named rank said so (not a guess at how long it takes)."""
    deadline = time.monotonic() + within
    while not all(Path(tmp, name).exists() for name in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no handshake {names} within {within} s")
        time.sleep(0.005)


def _assert_bystander(outcome: RankOutcome) -> None:
    """A rank that waited in a collective for the failed one: ``collateral`` exactly when it
    raised its peer's error before the launcher stopped it, else ``stopped`` with no error of
    its own. (Which of the two happens is a race between real processes; how each is told is
    the contract.)"""
    if outcome.exc_type is not None:
        assert outcome.status == "collateral" and looks_collateral(outcome), outcome
    else:
        assert outcome.status == "stopped" and outcome.message is None, outcome


def _await_exit(pid: int, within: float = 30.0) -> None:
    """Wait until process ``pid`` has exited (a zombie counts: it runs no code any more)."""
    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} still running after {within} s")


def _pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp.glob("pid*"))]


def _line_of(text: str) -> int:
    """Line number (1-based) of the first line of this file containing ``text``."""
    with open(__file__, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if text in line:
                return number
    raise AssertionError(f"{text!r} not found in {__file__}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- worker functions
def _raise_while_other_waits(tmp):
    rank = _start(tmp)
    last = int(os.environ["WORLD_SIZE"]) - 1
    if rank == last:
        _await(tmp, *(f"waiting{r}" for r in range(last)))  # the others are at all_reduce
        Path(tmp, "raised_at").write_text(repr(time.monotonic()))
        raise ValueError("boom")
    _arrive(tmp, f"waiting{rank}")
    dist.all_reduce(torch.ones(1))
    return rank


def _crash_while_other_waits(tmp, how):
    rank = _start(tmp)
    if rank == 0:
        _arrive(tmp, "waiting0")
        dist.all_reduce(torch.ones(1))
        return rank
    _await(tmp, "waiting0")  # rank 0 is at its all_reduce
    print("about to crash", flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segfault":
        ctypes.string_at(0)
    elif how == "os_exit_3":
        os._exit(3)
    elif how == "sys_exit_2":
        sys.exit(2)
    return rank


def _sys_exit_zero(tmp):
    rank = _start(tmp)
    if rank == 1:
        sys.exit(0)
    return rank


def _skip_all_reduce(tmp):
    rank = _start(tmp)
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins this one
    else:
        dist.barrier()  # a different collective: both ranks wait forever
    return rank


def _rank1_returns_without_all_reduce(tmp):
    rank = _start(tmp)
    dist.init_process_group("gloo")
    if rank == 0:
        _await(tmp, "pid1")
        _await_exit(int(Path(tmp, "pid1").read_text()))  # rank 1 returned and tore down
        dist.all_reduce(torch.ones(1))  # the collective rank 1 skipped
    return rank


def _rank1_hangs_in_teardown(tmp):
    rank = _start(tmp)
    dist.init_process_group("gloo")
    if rank == 1:
        # Stands in for a native hang in destroy_process_group (a DDP model still alive):
        # the launcher destroys the group after the function returned, and it never ends.
        dist.destroy_process_group = lambda *args, **kwargs: time.sleep(60)
    return rank


def _sleep_long(tmp):
    rank = _start(tmp)
    if rank == 0:
        time.sleep(60)  # the line the timeout must point at
    return rank


def _rank1_lingers(tmp):
    rank = _start(tmp)
    if rank == 1:
        time.sleep(2.5)  # rank 1 runs on after rank 0
    return rank


def _rank1_lingers_until_released(tmp):
    """Rank 1 runs on until the test opens the FIFO ``release`` (once the launcher's notice
    about it is out), then one more second, so that the launcher looks at it again."""
    rank = _start(tmp)
    release = os.path.join(tmp, "release")
    if rank == 1:
        _arrive(tmp, "lingering1")
        fd = os.open(release, os.O_RDONLY)  # lingering rank 1
        os.read(fd, 2)
        os.close(fd)
        time.sleep(1.0)
    else:
        _await(tmp, "lingering1")  # rank 0 finishes only once rank 1 is at its open()
    return rank


def _fail_first_attempt(tmp):
    rank = _start(tmp)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    Path(tmp, f"attempt{attempt}-rank{rank}").touch()
    if attempt == 0 and rank == 1:
        _await(tmp, "attempt0-rank0")  # rank 0 ran too before this attempt fails
        raise RuntimeError("flaky first attempt")
    return (rank, attempt)


def _always_fail(tmp):
    rank = _start(tmp)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    Path(tmp, f"attempt{attempt}-rank{rank}").touch()
    if rank == 1:
        raise RuntimeError(f"broken on attempt {attempt}")
    return rank


def _all_reduce_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


# ----------------------------------------------------------------------------- failures
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_exception_names_root_cause_and_stops_blocked_rank_fast(tmp_path):
    """A rank that raises while another waits in all_reduce: root cause, traceback, fast stop."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(
            _raise_while_other_waits,
            args=(str(tmp_path),),
            num_processes=2,
            init_process_group=True,
        )
    returned_at = time.monotonic()
    err = info.value
    raised_at = float((tmp_path / "raised_at").read_text())
    # Rank 0 was stopped, not left to gloo's collective timeout (30 min).
    teardown = returned_at - raised_at
    assert teardown < STOPPED_WITHIN, f"teardown took {teardown:.2f} s"
    assert_all_gone(_pids(tmp_path), within=0)

    text = str(err)
    assert text.startswith("rank 1 failed first: ValueError: boom"), text
    assert "Traceback of rank 1" in text
    assert 'raise ValueError("boom")' in text
    assert f'{THIS_FILE}", line {_line_of("raise ValueError(")}' in text
    others = text.split("The other ranks:", 1)[1].splitlines()[1]
    assert others == err.outcomes[0].describe()
    assert err.root_cause.rank == 1
    assert err.root_cause.exc_type == "ValueError"
    assert [o.status for o in err.outcomes][1] == "failed"
    _assert_bystander(err.outcomes[0])
    assert len(err.logs) == 2


@pytest.mark.timeout(60)
def test_three_ranks_root_cause_is_the_raiser_not_rank_0(tmp_path):
    """With 3 ranks, rank 2's exception is the root cause; ranks 0/1 are collateral or stopped."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(
            _raise_while_other_waits,
            args=(str(tmp_path),),
            num_processes=3,
            init_process_group=True,
        )
    err = info.value
    assert str(err).startswith("rank 2 failed first: ValueError: boom"), str(err)
    assert err.root_cause.rank == 2
    assert err.outcomes[2].status == "failed"
    _assert_bystander(err.outcomes[0])
    _assert_bystander(err.outcomes[1])
    assert "rank 0 failed first" not in str(err)
    assert len(_pids(tmp_path)) == 3
    assert_all_gone(_pids(tmp_path), within=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "expected_head", "signal_name", "exit_code"),
    [
        (
            "sigkill",
            "rank 1 failed first: the process was killed by signal SIGKILL (sent by the "
            "kernel's out-of-memory killer, or by kill -9)",
            "SIGKILL",
            None,
        ),
        (
            "segfault",
            "rank 1 failed first: the process was killed by signal SIGSEGV (a crash in native "
            "code)",
            "SIGSEGV",
            None,
        ),
        (
            "os_exit_3",
            "rank 1 failed first: the process exited with code 3 before returning",
            None,
            3,
        ),
        ("sys_exit_2", "rank 1 failed first: SystemExit: 2", None, None),
    ],
)
@pytest.mark.fast
def test_process_death_is_reported_with_its_cause(
    tmp_path, how, expected_head, signal_name, exit_code
):
    """Deaths by SIGKILL, SIGSEGV, os._exit(3) and sys.exit(2) name the rank and the cause."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(
            _crash_while_other_waits,
            args=(str(tmp_path), how),
            num_processes=2,
            init_process_group=True,
        )
    err = info.value
    text = str(err)
    assert text.startswith(expected_head), text
    assert err.root_cause.rank == 1
    assert err.root_cause.status == "failed"
    if signal_name is not None:
        assert err.root_cause.signal_name == signal_name
        assert (
            err.root_cause.describe() == f"rank 1: failed: the process died (signal {signal_name})"
        )
    if exit_code is not None:
        assert err.root_cause.exit_code == exit_code
        assert err.root_cause.describe() == "rank 1: failed: the process died (exit code 3)"
    _assert_bystander(err.outcomes[0])
    assert "about to crash" in err.logs[1]
    if how == "segfault":
        # faulthandler's crash report reaches the message (last output) and the log.
        assert "Fatal Python error: Segmentation fault" in err.logs[1]
        last = text.split("Last output of rank 1:", 1)[1]
        assert "Fatal Python error: Segmentation fault" in last
        assert f'{THIS_FILE}", line {_line_of("ctypes.string_at(0)")} in ' in last
        assert "about to crash" in last  # the output just before the crash
        # The frames inherited from the launching process (here pytest's) are cut off.
        assert "_pytest" not in last and "notebook_launcher" not in last
    if how == "sys_exit_2":
        assert "Traceback of rank 1" in text and "sys.exit(2)" in text
    assert_all_gone(_pids(tmp_path), within=0)


def test_sys_exit_zero_is_success_with_value_none(tmp_path):
    """sys.exit(0) inside the function ends that rank normally, with the value None."""
    result = notebook_launcher(_sys_exit_zero, args=(str(tmp_path),), num_processes=2)
    assert list(result) == [0, None]
    assert [o.status for o in result.outcomes] == ["ok", "ok"]
    assert_all_gone(_pids(tmp_path), within=0)


# ----------------------------------------------------------------------------- timeout
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_timeout_shows_where_a_deadlocked_rank_is_blocked(tmp_path):
    """A deadlock under timeout=3 raises LaunchTimeoutError naming rank 0's all_reduce line."""
    began = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(
            _skip_all_reduce,
            args=(str(tmp_path),),
            num_processes=2,
            init_process_group=True,
            timeout=3,
        )
    elapsed = time.monotonic() - began
    # Not before the timeout; and ended by it (the deadlock alone lasts gloo's 30 min): the
    # report takes each rank's stack (0.5 s at most) and stops the ranks (under a second).
    assert 3 <= elapsed < 3 + STOPPED_WITHIN, f"the timeout took {elapsed:.1f} s"
    err = info.value
    text = str(err)
    assert text.startswith("The launch did not finish within timeout=3 s"), text
    line = _line_of("dist.all_reduce(torch.ones(1))  # rank 1 never joins")
    assert (
        f"rank 0 was blocked at `dist.all_reduce(torch.ones(1))  # rank 1 never joins this one` "
        f"at {THIS_FILE}, line {line}, in _skip_all_reduce"
    ) in text
    assert "rank 1 was blocked at `dist.barrier()" in text
    assert err.timeout == 3
    assert "all_reduce" in err.stacks[0]
    assert "barrier" in err.stacks[1]
    assert "Stack of rank 0 (most recent call last):" in text
    assert [o.status for o in err.outcomes] == ["stopped", "stopped"]
    assert_all_gone(_pids(tmp_path), within=0)


@pytest.mark.timeout(60)
def test_timeout_stack_shows_the_sleep_line(tmp_path):
    """A rank sleeping past the timeout is reported at its time.sleep line."""
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_sleep_long, args=(str(tmp_path),), num_processes=2, timeout=2)
    err = info.value
    line = _line_of("time.sleep(60)  # the line the timeout")
    assert "rank 0 was blocked at `time.sleep(60)" in str(err)
    assert f"{THIS_FILE}, line {line}, in _sleep_long" in str(err)
    assert f'{THIS_FILE}", line {line}, in _sleep_long' in err.stacks[0]
    assert "time.sleep(60)" in err.stacks[0]
    assert 1 not in err.stacks  # rank 1 had finished
    assert err.outcomes[1].status == "ok" and "rank 1: finished" in str(err)
    assert_all_gone(_pids(tmp_path), within=0)


@pytest.mark.timeout(60)
def test_skipped_collective_names_the_rank_that_returned(tmp_path):
    """A rank that returned without a collective breaks its peer's: the message says so."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_rank1_returns_without_all_reduce, args=(str(tmp_path),), num_processes=2)
    message = str(info.value)
    # The diagnosis leads; the backend's raw text follows.
    head = message.split("\n")[0]
    assert head.startswith("rank 0 failed first: it was waiting in a collective (all_reduce)")
    assert "while rank 1 had already returned from the function" in head, message
    assert "Make every rank call the same collectives" in head
    assert "The error rank 0 got: " in message
    assert message.index("Make every rank") < message.index("The error rank 0 got: ")
    assert info.value.outcomes[1].returned_at is not None
    assert info.value.outcomes[0].returned_at is None
    assert_all_gone(_pids(tmp_path), within=0)


@pytest.mark.timeout(60)
def test_teardown_hang_is_told_apart_from_a_hang_in_the_function(tmp_path, capsys):
    """A rank stuck after returning gets a teardown notice and timeout text, not a stack.

    The notice comes 0.5 s after rank 0 finished; timeout=10 leaves the ranks' start and
    rendezvous on a busy machine ample time before it."""
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(
            _rank1_hangs_in_teardown,
            args=(str(tmp_path),),
            num_processes=2,
            hang_notice_after=0.5,
            timeout=10,
        )
    err = capsys.readouterr().err
    assert "[nb_dist] rank 1 returned from the function" in err, err
    assert "but its process has not exited" in err
    assert "stuck in native teardown" in err and "del model" in err
    message = str(info.value)
    assert "rank 1 had returned from the function and was stuck in the native teardown" in (
        message
    ), message
    assert "rank 0: finished" in message
    assert 1 not in info.value.stacks
    assert_all_gone(_pids(tmp_path), within=0)


# ----------------------------------------------------------------------------- hang notice
@pytest.mark.timeout(60)
def test_hang_notice_names_the_lingering_rank(tmp_path, capsys, monkeypatch):
    """hang_notice_after=0.5 prints where a still-running rank is, and the launch still ends.

    A handshake, not a race: rank 1 runs on until the notice about it is written (writing it
    releases rank 1), then a second more."""
    release = tmp_path / "release"
    os.mkfifo(release)
    notices = OnWrite(sys.stderr, "is still running", lambda: release_fifo(release))
    monkeypatch.setattr(sys, "stderr", notices)
    result = notebook_launcher(
        _rank1_lingers_until_released,
        args=(str(tmp_path),),
        num_processes=2,
        hang_notice_after=0.5,
    )
    assert list(result) == [0, 1]
    assert notices.fired
    err = capsys.readouterr().err
    assert "[nb_dist] rank 1 is still running" in err, err
    assert "after rank(s) 0 finished" in err
    line = _line_of("# lingering rank 1")
    where = f"`fd = os.open(release, os.O_RDONLY)  # lingering rank 1` at {THIS_FILE}, line {line}"
    assert where in err, err
    assert err.count("is still running") == 1  # one notice per rank, not one per poll
    assert_all_gone(_pids(tmp_path), within=0)


@pytest.mark.timeout(60)
def test_hang_notice_none_disables_it(tmp_path, capsys):
    """hang_notice_after=None never prints a notice, however long a rank lingers."""
    result = notebook_launcher(
        _rank1_lingers, args=(str(tmp_path),), num_processes=2, hang_notice_after=None
    )
    assert list(result) == [0, 1]
    assert "[nb_dist]" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- restarts
@pytest.mark.timeout(60)
def test_max_restarts_recovers_from_a_failed_attempt(tmp_path, capsys):
    """max_restarts=2: a failure on attempt 0 restarts all ranks; attempt 1 succeeds."""
    result = notebook_launcher(
        _fail_first_attempt, args=(str(tmp_path),), num_processes=2, max_restarts=2
    )
    assert list(result) == [(0, 1), (1, 1)]
    assert result.restarts == 1
    err = capsys.readouterr().err
    assert (
        "[nb_dist] rank 1: failed: RuntimeError: flaky first attempt; restarting all ranks "
        "(restart 1 of 2)." in err
    ), err
    assert "restart 2 of 2" not in err
    assert sorted(p.name for p in tmp_path.glob("attempt*")) == [
        "attempt0-rank0",
        "attempt0-rank1",
        "attempt1-rank0",
        "attempt1-rank1",
    ]


@pytest.mark.timeout(60)
def test_no_restart_by_default(tmp_path, capsys):
    """max_restarts=0: the same flaky function fails at once, with no restart notice."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(
            _fail_first_attempt, args=(str(tmp_path),), num_processes=2, max_restarts=0
        )
    assert str(info.value).startswith("rank 1 failed first: RuntimeError: flaky first attempt")
    assert "restarting" not in capsys.readouterr().err
    assert not list(tmp_path.glob("attempt1-*"))


@pytest.mark.timeout(60)
def test_restarts_exhausted_raises_after_all_attempts(tmp_path, capsys):
    """max_restarts=1 with a function that always fails: two attempts, then WorkerFailedError."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_always_fail, args=(str(tmp_path),), num_processes=2, max_restarts=1)
    assert str(info.value).startswith("rank 1 failed first: RuntimeError: broken on attempt 1")
    err = capsys.readouterr().err
    assert "restarting all ranks (restart 1 of 1)." in err
    assert err.count("restarting all ranks") == 1
    assert sorted(p.name for p in tmp_path.glob("attempt*-rank1")) == [
        "attempt0-rank1",
        "attempt1-rank1",
    ]


# ----------------------------------------------------------------------------- relaunch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["exception", "timeout", "sigkill"])
def test_same_port_works_again_after_a_failed_launch(tmp_path, failure):
    """After a failure, a timeout or a SIGKILLed rank, a new launch on the same port works."""
    port = _free_port()
    if failure == "exception":
        with pytest.raises(WorkerFailedError):
            notebook_launcher(
                _raise_while_other_waits,
                args=(str(tmp_path),),
                num_processes=2,
                init_process_group=True,
                use_port=port,
            )
    elif failure == "timeout":
        with pytest.raises(LaunchTimeoutError):
            notebook_launcher(
                _skip_all_reduce,
                args=(str(tmp_path),),
                num_processes=2,
                init_process_group=True,
                use_port=port,
                timeout=2,
            )
    else:
        with pytest.raises(WorkerFailedError) as info:
            notebook_launcher(
                _crash_while_other_waits,
                args=(str(tmp_path), "sigkill"),
                num_processes=2,
                init_process_group=True,
                use_port=port,
            )
        assert info.value.root_cause.signal_name == "SIGKILL"
    assert_all_gone(_pids(tmp_path), within=0)

    result = notebook_launcher(
        _all_reduce_sum, num_processes=2, init_process_group=True, use_port=port
    )
    assert list(result) == [3.0, 3.0]
    assert result.port == port


def _marks_that_it_ran(tmp):
    Path(tmp, f"ran{os.environ['RANK']}").write_text("")
    return int(os.environ["RANK"])


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_start_stops_the_ones_started_before_it(tmp_path, monkeypatch):
    """Rank 1's start fails (as fork can, with EAGAIN): rank 0, already started and waiting at
    the start gate, is stopped there and never runs the function; nothing is left behind."""
    from nb_dist._starter import _processes

    real_start = _processes.start

    def start_rank0_only(method, spec, channels, context):
        if spec.rank == 1:
            raise OSError(11, "Resource temporarily unavailable (fork)")
        return real_start(method, spec, channels, context)

    monkeypatch.setattr(_processes, "start", start_rank0_only)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        notebook_launcher(_marks_that_it_ran, args=(str(tmp_path),), num_processes=2)
    assert list(tmp_path.glob("ran*")) == []
    monkeypatch.undo()
    assert notebook_launcher(_marks_that_it_ran, args=(str(tmp_path),), num_processes=2) == [0, 1]
