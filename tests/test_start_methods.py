"""start_method='spawn' and 'forkserver': fresh processes that get the function by value.

Spawned workers import torch from scratch (seconds on a 2-core machine), so this file keeps to
three spawn launches and one forkserver launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_helpers import assert_all_gone

from nb_dist import WorkerFailedError, notebook_launcher

pytestmark = [pytest.mark.fast, pytest.mark.timeout(90)]


# ---------------------------------------------------------------- worker functions
def _whoami(scale):
    dist.init_process_group()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"sum is {t.item():g}")
    return dist.get_rank(), t.item() * scale, os.getpid(), list(sys.orig_argv)


def _rank1_raises():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom from a spawned rank")  # the line the traceback must show
    return "fine"


def _touch_marker(path, lock):
    Path(path).touch()


# ---------------------------------------------------------------- module-level functions
def test_spawn_runs_module_function_in_fresh_interpreters(capsys):
    """spawn starts fresh interpreters (not forks of the caller) that rendezvous and return."""
    result = notebook_launcher(_whoami, args=(2,), num_processes=2, start_method="spawn")
    assert result.start_method == "spawn"
    assert [(rank, value) for rank, value, _, _ in result] == [(0, 6.0), (1, 6.0)]
    for _, _, pid, argv in result:
        assert pid != os.getpid()
        entry = "from nb_dist._rank._entry import spawn_main; spawn_main()"
        assert entry in argv  # not pytest's argv
    out = capsys.readouterr().out
    assert "[rank 0] sum is 3" in out and "[rank 1] sum is 3" in out
    assert_all_gone([pid for _, _, pid, _ in result])


def test_forkserver_runs_module_function(capsys):
    """forkserver workers rendezvous, return their values and are gone afterwards."""
    result = notebook_launcher(_whoami, args=(3,), num_processes=2, start_method="forkserver")
    assert result.start_method == "forkserver"
    assert [(rank, value) for rank, value, _, _ in result] == [(0, 9.0), (1, 9.0)]
    assert all(pid != os.getpid() for _, _, pid, _ in result)
    out = capsys.readouterr().out
    assert "[rank 0] sum is 3" in out and "[rank 1] sum is 3" in out
    # forkserver children are not our children; the autouse fixture ignores them: check here.
    assert_all_gone([pid for _, _, pid, _ in result])


def test_spawned_failure_shows_traceback_with_source_line():
    """A failure in a spawned worker shows its traceback, file, line and source text."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_rank1_raises, num_processes=2, start_method="spawn")
    message = str(info.value)
    assert message.startswith("rank 1 failed first: ValueError: boom from a spawned rank")
    assert "Traceback of rank 1:" in message
    assert 'test_start_methods.py", line ' in message
    assert "in _rank1_raises" in message
    assert 'raise ValueError("boom from a spawned rank")  # the line the traceback' in message
    assert info.value.root_cause.traceback


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_args_are_refused_before_start(tmp_path, method):
    """A lock in args cannot be shipped to fresh processes: TypeError naming the fix."""
    marker = tmp_path / "ran"
    with pytest.raises(TypeError) as info:
        notebook_launcher(
            _touch_marker,
            args=(str(marker), threading.Lock()),
            num_processes=2,
            start_method=method,
        )
    message = str(info.value)
    for fragment in (
        "start_method='spawn'/'forkserver' must send the function and args",
        "_thread.lock",
        "Make the args picklable",
        "create such objects inside the function",
        "use start_method='fork'",
    ):
        assert fragment in message, fragment
    assert not marker.exists()


# ---------------------------------------------------------------- a __main__ script
_SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import torch
    import torch.distributed as dist

    from nb_dist import notebook_launcher

    print(f"MAIN BODY RAN in {os.getpid()}", flush=True)  # no __main__ guard on purpose

    OFFSET = 40

    def train(x):
        dist.init_process_group()
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"reduced {t.item():g}")
        return x + OFFSET + dist.get_rank()

    result = notebook_launcher(train, args=(2,), num_processes=2, start_method=sys.argv[1])
    print("RESULT", list(result), result.start_method, flush=True)
    """
)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_function_defined_in_unguarded_main_script(tmp_path, method):
    """A function from a __main__ script without a guard works: no re-import of __main__."""
    script = tmp_path / "train_script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=tmp_path,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert done.stdout.count("MAIN BODY RAN") == 1, output
    assert "[rank 0] reduced 3" in done.stdout and "[rank 1] reduced 3" in done.stdout, output
    assert f"RESULT [42, 43] {method}" in done.stdout, output
