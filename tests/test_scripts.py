"""torchrun scripts from a cell and a terminal: ``run_script``, ``%torchrun``, ``nb-dist run``.

The script is ``tests/scripts/ddp_series.py``, the shape of the PyTorch DDP tutorial series'
``multigpu_torchrun.py`` on CPU ranks: train, snapshot, resume; a crash on one rank with a
restart. Every test runs real ranks (and, for the magic, a real kernel; for the command, a
real process that is interrupted).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kernel_helpers import execute, wait_for_files
from process_helpers import assert_all_gone

import nb_dist
from nb_dist import WorkerFailedError, run_script

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "ddp_series.py")
CHECKSUM = re.compile(r"rank (\d) checksum (-?\d+\.\d+)")


def _checksums(text: str) -> dict[int, str]:
    return {int(rank): value for rank, value in CHECKSUM.findall(text)}


def test_the_ddp_series_script_trains_then_resumes_from_its_snapshot(tmp_path, capsys):
    snapshot = str(tmp_path / "snapshot.pt")
    result = run_script(SCRIPT, 2, 1, "--snapshot_path", snapshot, num_processes=2)
    assert list(result) == [0, 0]  # each rank's exit status
    out = capsys.readouterr().out
    assert "[rank 0] Epoch 1 | Training snapshot saved at" in out, out
    assert "[rank 1] [GPU1] Epoch 1 | Batchsize: 32 | Steps: 4" in out
    first = _checksums(out)
    assert set(first) == {0, 1} and first[0] == first[1]  # DDP kept the replicas equal

    result = run_script(SCRIPT, "4", "1", "--snapshot_path", snapshot, num_processes=2)
    assert list(result) == [0, 0]
    out = capsys.readouterr().out
    assert "[rank 1] Resuming training from snapshot at Epoch 2" in out, out
    assert "Epoch 0 |" not in out and "[rank 0] [GPU0] Epoch 3" in out
    resumed = _checksums(out)
    assert resumed[0] == resumed[1] != first[0]


def test_a_crash_on_one_rank_is_restarted_from_the_snapshot(tmp_path, capsys):
    """rank 1 crashes once in epoch 1; max_restarts=1 starts every rank again, and the
    script resumes from the epoch-0 snapshot, as under torchrun."""
    marker = tmp_path / "crashed"
    result = run_script(
        SCRIPT, 3, 1, "--snapshot_path", tmp_path / "snapshot.pt",
        "--crash-rank", 1, "--crash-marker", marker, num_processes=2, max_restarts=1,
    )  # fmt: skip
    assert list(result) == [0, 0]
    assert marker.exists()
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "RuntimeError: rank 1 crashed in epoch 1" in text, text
    assert "Resuming training from snapshot at Epoch" in captured.out
    sums = _checksums(captured.out)
    assert sums[0] == sums[1]


@pytest.mark.fast
def test_a_failing_script_names_its_own_line_and_exit_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import sys

            if __name__ == "__main__":
                print("argv", sys.argv[1:])
                if os.environ["RANK"] == "1":
                    sys.exit(3)  # rank 1 gives up
            """
        )
    )
    with pytest.raises(WorkerFailedError) as info:
        run_script(script, "--flag", num_processes=2, output="grouped")
    text = str(info.value)
    assert text.startswith("rank 1 failed first"), text
    assert "SystemExit: 3" in text
    assert "sys.exit(3)  # rank 1 gives up" in text  # the script's own line
    assert "runpy" not in text and "_script.py" not in text  # nb_dist's runner left out
    assert info.value.logs[1].strip().endswith("argv ['--flag']")  # printed before it exited
    assert_all_gone([o.pid for o in info.value.outcomes if o.pid], within=0)


def test_a_script_runs_as_main_with_its_folder_on_the_path(tmp_path):
    """`if __name__ == "__main__"`, sys.argv, a module beside the script, pickling a class the
    script defines (sys.modules["__main__"] is the script while it runs)."""
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import pickle
            import sys

            import helper

            class Point:
                def __init__(self, x):
                    self.x = x

            if __name__ == "__main__":
                assert sys.argv[1:] == ["a b", "3"], sys.argv
                assert pickle.loads(pickle.dumps(Point(helper.VALUE))).x == 7
                sys.exit(0)
            """
        )
    )
    assert list(run_script(str(script), "a b", 3, num_processes=2)) == [0, 0]


@pytest.mark.fast
def test_a_path_that_is_not_a_file_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run_script\(path='nope\.py'\): no such file"):
        run_script("nope.py", num_processes=2)
    with pytest.raises(IsADirectoryError, match="is a folder, not a file"):
        run_script(tmp_path, num_processes=2)
    with pytest.raises(TypeError, match=r"run_script\(path=\.\.\.\) must be the path"):
        run_script(3, num_processes=2)  # type: ignore[arg-type]


@pytest.mark.fast
def test_script_arguments_must_be_text_and_args_is_refused():
    with pytest.raises(TypeError, match=r"script argument 2 is \[1\] \(list\)"):
        run_script(SCRIPT, "1", [1], num_processes=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="script argument 1 is True"):
        run_script(SCRIPT, True, num_processes=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not args="):
        run_script(SCRIPT, num_processes=2, args=("1",))
    with pytest.raises(ValueError, match="num_processes"):
        run_script(SCRIPT, "1", "1", num_processes=0)


def test_the_torchrun_magic_takes_torchruns_options(kernels, tmp_path):
    _, kc = kernels()
    execute(kc, "%load_ext nb_dist").expect_ok()
    snapshot = tmp_path / "s.pt"
    line = f"%torchrun --nproc-per-node 2 --output grouped {SCRIPT} 1 1 --snapshot_path {snapshot}"
    run = execute(kc, line).expect_ok()
    assert run.result_text == "LaunchResult([0, 0])"
    assert "[rank 1] [GPU1] Epoch 0 | Batchsize: 32" in run.stdout()
    # torchrun's underscore spelling, and a bad option that names the magic.
    run = execute(kc, f"%torchrun --nproc_per_node=2 --output none {SCRIPT} 1 1 "
                  f"--snapshot_path {snapshot}").expect_ok()  # fmt: skip
    assert run.result_text == "LaunchResult([0, 0])"
    bad = execute(kc, f"%torchrun --nproc-per-node two {SCRIPT}")
    assert bad.error is not None and bad.error["ename"] == "ValueError"
    assert "%torchrun: argument -n/--nproc-per-node/--nproc_per_node" in bad.error_text()
    # The kernel is usable after a failed script.
    failing = execute(kc, f"%torchrun -n 2 {SCRIPT} 1 1 --batch_size nope")
    assert failing.error is not None and failing.error["ename"] == "WorkerFailedError"
    assert "SystemExit: 2" in failing.error_text() and "invalid int value" in failing.error_text()
    again = f"%torchrun -n 2 --output none {SCRIPT} 1 1 --snapshot_path {tmp_path / 't.pt'}"
    assert execute(kc, again).expect_ok().result_text == "LaunchResult([0, 0])"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nb_dist", "run", *args],
        cwd=cwd, capture_output=True, text=True, timeout=100,
    )  # fmt: skip


def test_the_command_runs_a_script_and_its_exit_status_says_how_it_went(tmp_path):
    ok = _cli("-n", "2", SCRIPT, "1", "1", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "[rank 0] Epoch 0 | Training snapshot saved at snapshot.pt" in ok.stdout
    assert (tmp_path / "snapshot.pt").exists()  # the script's relative paths: the cwd's

    failed = _cli("-n", "2", SCRIPT, "2", "1", "--crash-rank", "0", "--crash-marker",
                  str(tmp_path / "m"), "--snapshot_path", "x.pt", cwd=tmp_path)  # fmt: skip
    assert failed.returncode == 1
    assert "nb-dist run: WorkerFailedError: rank 0 failed first" in failed.stderr.replace(
        "python -m nb_dist run", "nb-dist run"
    ), failed.stderr
    assert "RuntimeError: rank 0 crashed in epoch 1" in failed.stderr

    missing = _cli("-n", "2", "missing.py", cwd=tmp_path)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_ctrl_c_stops_every_rank_of_the_command(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import time
            from pathlib import Path

            Path({str(tmp_path)!r}, f"pid{{os.environ['RANK']}}").write_text(str(os.getpid()))
            while True:
                time.sleep(0.1)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "nb_dist", "run", "-n", "2", str(script)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = [int(p.read_text()) for p in wait_for_files(tmp_path, "pid*", 2, within=60)]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_all_gone(pids)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_ctrl_c_in_code_run_from_a_string_still_exits_130(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves code run from a string (``dataclasses``
    defines methods so, during a lazy import) as unhandled even once caught, and under
    ``python -m`` ends the process by SIGINT (-2). The Ctrl-C here lands in such code, in
    place of the launch (which the test above interrupts for real, at a moment it cannot
    choose): the command still says it was interrupted and exits 130."""
    (tmp_path / "interrupted_cli.py").write_text(
        textwrap.dedent(
            """
            from nb_dist import _cli
            from nb_dist._kernel import _scripts

            def run_parsed(options):
                exec("raise KeyboardInterrupt('the launch was interrupted')", {})

            _scripts.run_parsed = run_parsed
            raise SystemExit(_cli.main(["run", "train.py"], prog="python -m nb_dist"))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_cli"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr == "python -m nb_dist run: interrupted: the launch was interrupted\n"


@pytest.mark.fast
def test_run_script_is_public():
    assert "run_script" in nb_dist.__all__ and nb_dist.run_script is run_script
    assert os.path.exists(SCRIPT)
