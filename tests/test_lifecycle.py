"""Interrupts and the death of the launching process, with plain Python processes as the caller.

A small script plays the kernel: it launches workers that record their pids and sleep, and the
test interrupts or kills it. (Tests through a real Jupyter kernel live elsewhere.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import assert_all_gone

from nb_dist import notebook_launcher

SCRIPT = """\
import os
import sys
import time
from pathlib import Path

from nb_dist import notebook_launcher


def sleeper(directory):
    Path(directory, "pid" + os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(60)


def quick():
    return int(os.environ["RANK"]) * 10


if __name__ == "__main__":
    directory, start_method = sys.argv[1], sys.argv[2]
    try:
        notebook_launcher(sleeper, args=(directory,), num_processes=2, start_method=start_method)
        print("NOT INTERRUPTED", flush=True)
    except BaseException as exc:
        print("caught", type(exc).__name__, type(exc) is KeyboardInterrupt, flush=True)
        print("stopped_at", repr(time.monotonic()), flush=True)
    result = notebook_launcher(quick, num_processes=2)
    print("relaunch", list(result), flush=True)
"""


def _run_script(tmp_path: Path, start_method: str) -> tuple[subprocess.Popen[str], list[int]]:
    """Start the script and wait until both of its workers run the function; return their pids."""
    script = tmp_path / "launch_and_sleep.py"
    script.write_text(SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pid_dir), start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        files = [pid_dir / "pid0", pid_dir / "pid1"]
        if all(f.exists() and f.read_text() for f in files):
            return proc, [int(f.read_text()) for f in files]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"the workers never started.\nstdout:\n{out}\nstderr:\n{err}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------------------- interrupt
@pytest.mark.fast
@pytest.mark.timeout(90)
def test_keyboard_interrupt_stops_the_ranks_and_next_launch_works(tmp_path):
    """SIGINT to the launching process: plain KeyboardInterrupt, the workers stopped and reaped
    before it reaches the caller (how fast is not timed here)."""
    proc, pids = _run_script(tmp_path, "fork")
    try:
        # Every worker wrote its pid after the start gate opened: the launcher has started
        # them all and is in its watch loop, where an interrupt must stop everything.
        assert all(_alive(pid) for pid in pids)
        interrupted_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # Handshake: the script prints "stopped_at" once the launcher has raised.
        assert proc.stdout is not None
        seen = []
        while not (seen and seen[-1].startswith("stopped_at ")):
            line = proc.stdout.readline()
            assert line, f"the script ended before it was stopped: {seen}"
            seen.append(line)
        assert_all_gone(pids, within=0)  # the launcher reaped them before it raised
        out, err = proc.communicate(timeout=60)
        out = "".join(seen) + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "caught KeyboardInterrupt True" in out, out + err
    stopped_at = float(out.split("stopped_at ", 1)[1].split()[0])
    # Stopped by the interrupt (README: within a second; five times that on a loaded box), long
    # before the workers' 60 s sleep would have ended.
    assert stopped_at - interrupted_at < 5.0, f"stopping took {stopped_at - interrupted_at:.2f} s"
    assert "relaunch [0, 10]" in out
    assert "NOT INTERRUPTED" not in out
    assert "Traceback" not in err, err


# ----------------------------------------------------------------------------- parent death
@pytest.mark.fast
@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ranks_die_with_the_launching_process(tmp_path, start_method):
    """SIGKILL of the launching process takes its workers down (no orphans): they are gone
    long before their 60 s sleep would end."""
    proc, pids = _run_script(tmp_path, start_method)
    try:
        assert all(_alive(pid) for pid in pids)
        proc.kill()
        proc.wait(timeout=10)
        assert_all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        for pid in pids:  # never leave a sleeping worker behind, even when the test fails
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- grandchildren
def _start_grandchild():
    sleeper = subprocess.Popen(["sleep", "60"])
    return sleeper.pid, os.getpid()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_processes_started_by_ranks_are_cleaned_up(start_method):
    """A subprocess a worker leaves running (sleep 60) is killed with the worker's group."""
    result = notebook_launcher(_start_grandchild, num_processes=2, start_method=start_method)
    sleep_pids = [sleep_pid for sleep_pid, _ in result]
    worker_pids = [worker_pid for _, worker_pid in result]
    assert len(set(sleep_pids)) == 2
    assert_all_gone(worker_pids, within=0)  # reaped before the launcher returned
    # Killed with the worker's group (SIGKILL lands when the OS schedules it): long before
    # `sleep 60` would end.
    assert_all_gone(sleep_pids)
