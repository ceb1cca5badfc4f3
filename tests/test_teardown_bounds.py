"""Every wait in a teardown has a deadline: a rank that cannot be reaped is reported
(its pid and state) and left behind, never waited for for ever (``_starter/_processes.py``).

A process in uninterruptible sleep (a wedged driver or file system) ignores SIGKILL until its
kernel call returns; a test cannot make one, so the bounded wait is tested on a real child
that is simply not killed yet, and the report on a real process's state.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from nb_dist._starter import _processes
from nb_dist._starter._processes import process_state, reap_within, report_unreaped

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


@pytest.fixture
def sleeper():
    """A child in ``sleep 60``, once it sleeps (right after exec it may still be running)."""
    child = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 30
    while not process_state(child.pid).startswith("S"):  # sleeping, as /proc says
        assert time.monotonic() < deadline, f"sleep 60 never slept: {process_state(child.pid)}"
        time.sleep(0.005)
    yield child
    if child.returncode is None:
        child.kill()
        child.wait()


def test_the_wait_for_a_running_child_ends_at_its_deadline(sleeper):
    assert reap_within(sleeper.pid, 0.2) is None  # still running: not waited for further
    assert process_state(sleeper.pid).startswith("S")  # still sleeping, as /proc says
    sleeper.kill()
    code = reap_within(sleeper.pid, None)
    sleeper.returncode = code  # reaped here
    assert code == -signal.SIGKILL


def test_a_pid_that_is_not_a_child_is_not_waited_for():
    assert reap_within(1, None) == _processes._GONE  # init is nobody's child


def test_an_unreaped_rank_is_reported_with_its_pid_and_state(sleeper, capsys, caplog):
    text = report_unreaped(sleeper.pid, 5.0)
    err = capsys.readouterr().err
    assert text in err  # in the cell (stderr), not only in a log
    assert f"rank process {sleeper.pid} did not end within 5 s" in text
    assert f"state: {process_state(sleeper.pid)}" in text and "left behind" in text
    assert any(r.name == "nb_dist._starter._processes" and r.levelname == "WARNING"
               for r in caplog.records)  # fmt: skip


def test_kill_and_reap_of_a_forked_rank_returns_its_signal(sleeper):
    rank = _processes.spawned(sleeper)
    assert rank.kill_and_reap() == -signal.SIGKILL
    assert sleeper.returncode == -signal.SIGKILL  # Popen knows: it will not wait again


def test_an_ended_rank_keeps_its_exit_code_and_is_never_signalled_again():
    # A node's agent asks for the exit code on every read until the rank's pipes are drained:
    # once reaped, the answer must stay the rank's own code (it read as SIGKILL before), and
    # the pid, free for the system to reuse, must never be signalled or waited for again.
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    rank = _processes.spawned(child)
    deadline = time.monotonic() + 30
    while (code := rank.exit_code()) is None:
        assert time.monotonic() < deadline, "sh -c 'exit 3' never ended"
        time.sleep(0.005)
    assert code == 3
    assert [rank.exit_code(), rank.exit_code()] == [3, 3]
    assert rank.kill_and_reap() == 3  # not SIGKILL: it had ended on its own
    rank.send_signal(signal.SIGTERM)  # a no-op now, not a signal to a reused pid
    with pytest.raises(ProcessLookupError):
        rank.signal_leader(signal.SIGUSR1)


class _UnreportedServerChild:
    """A fork server's child as multiprocessing shows it, whose exit the server never
    reports (a server stuck, or the child in uninterruptible sleep): ``join`` times out."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode = pid, None

    def join(self, timeout: float | None = None) -> None:
        pass  # the deadline passed with no exit status


def test_a_forkserver_rank_that_cannot_be_reaped_is_reported_like_a_forked_one(sleeper, capsys):
    rank = _processes._FromForkserver(_UnreportedServerChild(sleeper.pid))
    assert rank.kill_and_reap() == -signal.SIGKILL
    assert f"rank process {sleeper.pid} did not end within 5 s" in capsys.readouterr().err


class _SlowServerChild(_UnreportedServerChild):
    """As above, and its ``join`` takes all the time it is given (a server that never says)."""

    def join(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0.0)


def test_ending_several_ranks_that_cannot_be_reaped_waits_one_deadline(monkeypatch, capsys):
    """``end_all`` kills every group first, then gives each rank what is left of one shared
    deadline: three ranks that never report cost REAP_WITHIN once, not three times."""
    monkeypatch.setattr(_processes, "REAP_WITHIN", 0.5)
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        ranks = [_processes._FromForkserver(_SlowServerChild(c.pid)) for c in children]
        began = time.monotonic()
        codes = _processes.end_all(ranks)
        took = time.monotonic() - began
        assert codes == [-signal.SIGKILL] * 3
        assert took < 2 * 0.5, took  # per rank in turn it would take 1.5 s
        # Every group was killed before the first wait: all three are gone now.
        assert [c.wait(timeout=5) for c in children] == [-signal.SIGKILL] * 3
        assert capsys.readouterr().err.count("did not end within") == 3
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                child.wait()
