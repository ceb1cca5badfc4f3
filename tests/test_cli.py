"""The ``nb-dist`` command and the DDP demo behind it, run for real (subprocess and in-process)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from process_helpers import assert_all_gone

import nb_dist
from nb_dist._demo import TRAIN_POINTS, DemoSummary, run_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One row of the summary table: rank, loss, accuracy, samples.
ROW = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s*$", re.MULTILINE)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nb_dist", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(90)
def test_demo_trains_with_ddp_and_prints_a_summary_per_rank():
    """`python -m nb_dist demo` trains on 2 ranks: rank-0 progress, one line per rank, a table."""
    proc = _run("demo", "--num-processes", "2", "--epochs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Progress each epoch from rank 0 only, through the launcher's labels.
    assert "[rank 0] epoch 1/2: loss" in out and "[rank 0] epoch 2/2: loss" in out
    assert "[rank 1] epoch" not in out
    # One closing line per rank, from inside each worker.
    per_rank = TRAIN_POINTS // 2 * 2  # each rank sees half the training set, twice
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] done: {per_rank} samples seen", out, re.MULTILINE)
    # The kernel-side summary: one row per rank, identical weights, wall time.
    assert "nb_dist demo: 2 processes (fork), 2 epochs, mixed precision no" in out
    rows = ROW.findall(out)
    assert [int(r[0]) for r in rows] == [0, 1], out
    for _, loss, accuracy, samples in rows:
        assert float(accuracy) > 0.8
        assert 0 < float(loss) < 1.0
        assert int(samples) == per_rank
    assert "parameters identical on all ranks: yes" in out
    assert re.search(r"wall time: \d+\.\d\d s", out)


@pytest.mark.fast
def test_zero_processes_is_refused_with_the_launchers_message():
    """`--num-processes 0` exits non-zero with the launcher's refusal naming num_processes."""
    proc = _run("demo", "--num-processes", "0")
    assert proc.returncode == 2
    assert "num_processes=0 must be a positive whole number" in proc.stderr
    assert "[rank" not in proc.stdout  # refused before any worker started


@pytest.mark.timeout(90)
def test_a_failing_rank_exits_1_and_names_the_root_cause():
    """`--fail-rank 1`: exit code 1 and the WorkerFailedError naming rank 1 and its traceback."""
    proc = _run("demo", "--epochs", "2", "--fail-rank", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    assert (
        "the demo failed: WorkerFailedError: rank 1 failed first: RuntimeError: rank 1 failed "
        "on purpose in epoch 2" in err
    )
    assert "Traceback of rank 1:" in err and "demo.py" in err
    assert "The other ranks:\nrank 0:" in err
    assert "parameters identical" not in proc.stdout  # no summary after a failure


@pytest.mark.fast
def test_version_and_help():
    """`--version` prints nb_dist.__version__ (module and console script); help lists options."""
    expected = f"nb_dist {nb_dist.__version__}"
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == expected
    script = shutil.which("nb-dist")
    if script is not None:
        proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr
    proc = _run("demo", "--help")
    assert proc.returncode == 0
    for option in ("--num-processes", "--epochs", "--start-method", "--seed", "--mixed-precision"):
        assert option in proc.stdout
    proc = _run()
    assert proc.returncode == 2 and "required: COMMAND" in proc.stderr


@pytest.mark.timeout(60)
def test_run_demo_in_process_returns_a_summary(capsys):
    """run_demo() launches from this process and returns every rank's numbers and the check."""
    summary = run_demo(num_processes=2, epochs=1, seed=3, timeout=45)
    assert isinstance(summary, DemoSummary)
    assert (summary.num_processes, summary.epochs, summary.start_method) == (2, 1, "fork")
    assert [r["rank"] for r in summary.ranks] == [0, 1]
    assert [r["samples"] for r in summary.ranks] == [TRAIN_POINTS // 2] * 2
    assert summary.min_accuracy > 0.8
    assert summary.params_identical
    assert len({r["checksum"] for r in summary.ranks}) == 1
    assert len({r["pid"] for r in summary.ranks} | {os.getpid()}) == 3  # two real workers
    # A launch of 2 ranks takes 0.07 s and the demo's epoch about 0.3 s here (bench/
    # launch_latency.py); 10 s is a few times that with a cold import on a loaded box.
    assert 0 < summary.wall_time < 10
    as_dict = json.loads(json.dumps(summary.as_dict()))
    assert as_dict["params_identical"] is True and as_dict["ranks"][1]["rank"] == 1
    out = capsys.readouterr().out
    assert summary.table() in out
    assert "[rank 1] done:" in out
    assert_all_gone([r["pid"] for r in summary.ranks])
    # Accuracy is over the whole held-out set on every rank: identical weights, same answer.
    assert summary.ranks[0]["accuracy"] == summary.ranks[1]["accuracy"]


@pytest.mark.timeout(60)
def test_run_demo_with_spawn_and_bf16(capsys):
    """The training function ships to spawned workers, and bf16 reaches every rank's autocast."""
    summary = run_demo(
        num_processes=2, epochs=1, start_method="spawn", mixed_precision="bf16", timeout=45
    )
    assert summary.start_method == "spawn"
    assert summary.params_identical and summary.min_accuracy > 0.8
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] done: .*\(mixed precision bf16\)$", out, re.MULTILINE)


@pytest.mark.fast
def test_run_demo_refuses_zero_epochs():
    """epochs=0 is refused before anything starts, naming the argument."""
    with pytest.raises(ValueError, match=r"epochs=0 must be a positive whole number"):
        run_demo(epochs=0)
