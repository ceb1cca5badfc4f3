"""nb_dist inside a real ipykernel driven by jupyter_client: what the notebook user sees.

Each test sends cells as execute_requests and reads the kernel's iopub messages: which cell the
ranks' output is attached to, when it arrives, what the error shows, and what interrupting or
killing the kernel does to the workers.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from kernel_helpers import (
    collect,
    execute,
    free_port,
    kernel_pid,
    kernel_ports,
    line_in,
    send,
    wait_for,
    wait_for_files,
)
from process_helpers import GONE_WITHIN, assert_all_gone

from nb_dist._shared._net import tcp_connections

pytestmark = pytest.mark.kernel

SETUP = """
import os, signal, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from nb_dist import notebook_launcher
"""

# A cell-defined function every test can launch; records its pid, sums ranks with all_reduce.
SUM_RANKS = """
def sum_ranks(tmp):
    rank = int(os.environ["RANK"])
    Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()
"""

PID_AND_SLEEP = """
def pid_and_sleep(tmp):
    rank = int(os.environ["RANK"])
    Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
    time.sleep(60)
    return rank
"""


#: The cells every kernel of this module runs first (conftest.py's kernel fixtures).
KERNEL_SETUP = (SETUP, SUM_RANKS, PID_AND_SLEEP)


def _pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp.glob("pid*"))]


def _rank_lines(messages) -> list[str]:
    return [
        m.content["text"]
        for m in messages
        if m.msg_type == "stream" and "[rank " in m.content["text"]
    ]


def _boot(kc) -> None:
    for cell in KERNEL_SETUP:
        execute(kc, cell, timeout=60).expect_ok()


# ----------------------------------------------------------------------------- output
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_rank_output_lands_in_the_launching_cell(module_kernel):
    """Every rank's lines are attached to the launching cell, before its idle, none after."""
    _, kc = module_kernel
    define = execute(
        kc,
        """
        def train(scale):
            rank = int(os.environ["RANK"])
            print(f"hello from {rank}")
            dist.init_process_group("gloo")
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            print(f"sum is {t.item():g}")
            return t.item() * scale + rank
        """,
    ).expect_ok()
    launch = execute(
        kc, "notebook_launcher(train, args=(10,), num_processes=2)", late_window=1.0
    ).expect_ok()
    third = execute(kc, 'print("third cell")', late_window=1.0).expect_ok()

    assert launch.result_text == "LaunchResult([30.0, 31.0])"
    lines = launch.stdout().splitlines()
    assert sorted(lines) == [
        "[rank 0] hello from 0",
        "[rank 0] sum is 3",
        "[rank 1] hello from 1",
        "[rank 1] sum is 3",
    ], lines
    # Each rank's own lines keep their order.
    assert lines.index("[rank 0] hello from 0") < lines.index("[rank 0] sum is 3")
    assert lines.index("[rank 1] hello from 1") < lines.index("[rank 1] sum is 3")
    assert launch.idle_at is not None
    assert all(m.arrived <= launch.idle_at for m in launch.streams)
    assert launch.late == []  # nothing with the launch's parent after its idle status
    for run in (define, launch, third):
        assert _rank_lines(run.foreign) == [], "rank output attached to another cell"
    assert _rank_lines(third.mine + third.late) == []
    assert third.stdout() == "third cell\n"


@pytest.mark.timeout(90)
def test_print_reaches_the_cell_while_the_function_still_runs(module_kernel, tmp_path):
    """A rank's print shows in the cell while the function still runs: each rank prints, then
    waits until the test has seen its line in the cell (how fast: bench/output_path.py)."""
    _, kc = module_kernel
    execute(
        kc,
        """
        def tick(folder):
            rank = int(os.environ["RANK"])
            print("tick")
            seen, deadline = Path(folder, f"seen{rank}"), time.monotonic() + 60
            while not seen.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return "seen" if seen.exists() else "never seen"
        """,
    ).expect_ok()
    run = send(kc, f"notebook_launcher(tick, args=({str(tmp_path)!r},), num_processes=2)")
    for rank in (0, 1):
        line = f"[rank {rank}] tick\n"
        wait_for(kc, run, lambda m, line=line: m.msg_type == "stream" and line in m.content["text"])
        (tmp_path / f"seen{rank}").touch()
    collect(kc, run).expect_ok()
    assert run.result_text == "LaunchResult(['seen', 'seen'])"


# ----------------------------------------------------------------------------- failures
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_failure_shows_root_cause_with_cell_label(module_kernel, tmp_path):
    """A rank's ValueError surfaces as WorkerFailedError naming Cell In[N] and the raise line."""
    _, kc = module_kernel
    code = """
        def fails(tmp):
            rank = int(os.environ["RANK"])
            Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
            dist.init_process_group("gloo")
            if rank == 1:
                while not Path(tmp, "waiting0").exists():  # rank 0 is at its all_reduce
                    time.sleep(0.005)
                raise ValueError("boom")
            Path(tmp, "waiting0").write_text("")
            dist.all_reduce(torch.ones(1))
            return rank
        """
    define = execute(kc, code).expect_ok()
    port = free_port()
    run = execute(
        kc, f"notebook_launcher(fails, args=({str(tmp_path)!r},), num_processes=2, use_port={port})"
    )
    assert run.error is not None, run.stdout()
    assert run.error["ename"] == "WorkerFailedError"
    assert run.error["evalue"].startswith("rank 1 failed first: ValueError: boom"), run.error
    label = f"Cell In[{define.execution_count}], line {line_in(code, 'raise ValueError')}"
    assert label in run.error["evalue"], run.error["evalue"]
    assert 'raise ValueError("boom")' in run.error["evalue"]
    assert "Traceback of rank 1:" in run.error["evalue"]
    assert "The other ranks:" in run.error["evalue"]
    assert len(_pids(tmp_path)) == 2
    assert_all_gone(_pids(tmp_path), within=0)  # reaped before the cell's error

    again = execute(
        kc,
        f"""
        _r = notebook_launcher(sum_ranks, args=({str(tmp_path)!r},), num_processes=2,
                               use_port={port})
        print("port", _r.port)
        _r
        """,
    ).expect_ok()
    assert again.result_text == "LaunchResult([3.0, 3.0])"
    assert f"port {port}\n" in again.stdout()


@pytest.mark.timeout(60)
def test_a_cell_run_outside_the_history_is_named_too(module_kernel):
    """nbval runs cells without storing them in the history: a rank's traceback still names
    the cell and line (IPython 8 keeps the map in its compiler; on IPython 7, Colab's and
    Kaggle's, nb_dist notes each cell's file name as it is compiled)."""
    _, kc = module_kernel
    code = """
        def unstored():
            raise KeyError("not in the history")
        """
    execute(kc, code, store_history=False).expect_ok()
    run = execute(kc, "notebook_launcher(unstored, num_processes=2)", store_history=False)
    assert run.error is not None and run.error["ename"] == "WorkerFailedError", run.stdout()
    text = run.error["evalue"]
    line = line_in(code, "raise KeyError")
    assert re.search(rf"Cell In\[\d+\], line {line}, in unstored", text), text
    assert "ipykernel_" not in text, text


@pytest.mark.timeout(60)
def test_timeout_stacks_name_the_cell(module_kernel):
    """timeout=3 on a deadlock: LaunchTimeoutError says where each rank was blocked, by cell."""
    _, kc = module_kernel
    code = """
        def deadlock():
            dist.init_process_group("gloo")
            if dist.get_rank() == 0:
                dist.all_reduce(torch.ones(1))  # rank 1 skips this
            else:
                dist.barrier()
            return dist.get_rank()
        """
    define = execute(kc, code).expect_ok()
    run = execute(kc, "notebook_launcher(deadlock, num_processes=2, timeout=3)")
    assert run.error is not None, run.stdout()
    assert run.error["ename"] == "LaunchTimeoutError"
    took = run.idle_at - run.sent_at
    # Not before the timeout; and ended by it (the deadlock alone lasts gloo's 30 min): stacks
    # and the stop take about a second, five times that allowed on a loaded box.
    assert 3.0 <= took < 3.0 + 5.0, f"the timed-out cell took {took:.1f} s"
    text = run.error_text()
    assert text.startswith("The launch did not finish within timeout=3 s"), text
    cell = f"Cell In[{define.execution_count}]"
    assert (
        "rank 0 was blocked at `dist.all_reduce(torch.ones(1))  # rank 1 skips this` at "
        f"{cell}, line {line_in(code, '# rank 1 skips this')}, in deadlock"
    ) in text, text
    assert (
        f"rank 1 was blocked at `dist.barrier()` at {cell}, line {line_in(code, 'barrier')}"
    ) in text, text
    assert "Stack of rank 0 (most recent call last):" in text


# ----------------------------------------------------------------------------- interrupt
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_interrupt_stops_the_ranks_and_leaves_the_kernel_clean(module_kernel, tmp_path):
    """Interrupting the kernel ends the cell with KeyboardInterrupt, the workers stopped and
    reaped by then, leaves env and signal handlers as they were, and the next launch works."""
    km, kc = module_kernel
    execute(
        kc,
        """
        _sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1)
        _env0 = dict(os.environ)
        _sig0 = {s: signal.getsignal(s) for s in _sigs}
        """,
    ).expect_ok()
    run = send(kc, f"notebook_launcher(pid_and_sleep, args=({str(tmp_path)!r},), num_processes=2)")
    wait_for_files(tmp_path, "pid*", 2, within=30)
    pids = _pids(tmp_path)
    assert all(psutil.pid_exists(p) for p in pids)
    interrupted_wall = time.time()
    km.interrupt_kernel()
    collect(kc, run, timeout=45, late_window=1.0)
    assert_all_gone(pids, within=0)  # reaped before the cell's error
    assert run.error is not None, run.stdout()
    assert run.error["ename"] == "KeyboardInterrupt", run.error_text()
    assert run.error["evalue"] == "the launch was interrupted; all 2 ranks were stopped"
    # The traceback ends at the launcher's call, not inside its select loop.
    assert "supervisor.py" not in run.error_text() and "selectors" not in run.error_text()
    error_msg = next(m for m in run.mine if m.msg_type == "error")
    ended_after = error_msg.sent_date - interrupted_wall
    # Ended by the interrupt (README: every worker stopped within a second; five times that
    # allowed on a loaded box), long before the workers' 60 s sleep would have.
    assert ended_after < 5.0, f"the cell ended {ended_after:.2f} s after the interrupt"
    assert run.late == []

    after = execute(
        kc, f"notebook_launcher(sum_ranks, args=({str(tmp_path)!r},), num_processes=2)"
    ).expect_ok()
    assert after.result_text == "LaunchResult([3.0, 3.0])"

    check = execute(
        kc,
        """
        _env1 = dict(os.environ)
        (sorted(k for k in set(_env0) | set(_env1) if _env0.get(k) != _env1.get(k)),
         [s.name for s in _sigs if signal.getsignal(s) != _sig0[s]])
        """,
    ).expect_ok()
    changed_env, changed_signals = ast.literal_eval(check.result_text)
    assert changed_env == [], f"the launches changed the kernel's env: {changed_env}"
    assert changed_signals == [], f"the launches changed signal handlers: {changed_signals}"


# ----------------------------------------------------------------------------- kernel death
@pytest.mark.timeout(120)
def test_killed_kernel_takes_its_ranks_along(kernels, tmp_path):
    """SIGKILL of the kernel kills its workers (long before their 60 s sleep ends); they never
    hold the kernel's ports, so a restarted kernel binds the same ports and launches again."""
    kernel = kernels(tmp_path / "kernel")
    km, kc = kernel
    _boot(kc)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    send(kc, f"notebook_launcher(pid_and_sleep, args=({str(run_dir)!r},), num_processes=2)")
    wait_for_files(run_dir, "pid*", 2, within=30)
    pids = _pids(run_dir)
    kpid = kernel_pid(km)
    ports = kernel_ports(km)

    def listening(pid: int) -> set[int]:
        return {
            c.laddr.port
            for c in tcp_connections(psutil.Process(pid))
            if c.status == psutil.CONN_LISTEN
        }

    # The kernel listens on its ports (the workers were forked with those sockets) ...
    assert set(ports.values()) <= listening(kpid), (ports, listening(kpid))
    # ... and the workers closed their inherited copies.
    for pid in pids:
        assert listening(pid) == set(), f"worker {pid} listens on {listening(pid)}"

    os.kill(kpid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert_all_gone(pids)

    # Then nothing listens on the dead kernel's ports any more (TIME_WAIT leftovers of its
    # connections are normal TCP and do not stop a new kernel from binding them).
    deadline = killed_at + GONE_WITHIN
    while True:
        held = {
            (c.laddr.port, c.pid)
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in set(ports.values())
        }
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert held == set(), f"the dead kernel's ports are still held: {held} of {ports}"

    kc = kernel.restart()
    assert kernel_ports(km) == ports  # the restarted kernel reuses the very same ports
    _boot(kc)
    again = execute(
        kc, f"notebook_launcher(sum_ranks, args=({str(run_dir)!r},), num_processes=2)"
    ).expect_ok()
    assert again.result_text == "LaunchResult([3.0, 3.0])"


# ----------------------------------------------------------------------------- refusals
@pytest.mark.timeout(60)
def test_process_group_in_the_kernel_is_refused_until_destroyed(module_kernel, tmp_path):
    """A process group initialized in a cell makes the launch refuse (nothing starts), with the
    fix; after destroy_process_group() the same launch works."""
    _, kc = module_kernel
    execute(
        kc,
        f"""
        dist.init_process_group(
            "gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        """,
    ).expect_ok()
    launch = f"notebook_launcher(sum_ranks, args=({str(tmp_path)!r},), num_processes=2)"
    refused = execute(kc, launch)
    assert refused.error is not None, refused.stdout()
    assert refused.error["ename"] == "UnsafeLaunchError"
    evalue = refused.error["evalue"]
    assert "process group is already initialized in this kernel" in evalue, evalue
    assert "(backend 'gloo', world size 1)" in evalue
    assert "torch.distributed.destroy_process_group()" in evalue
    assert list(tmp_path.glob("pid*")) == []  # no worker was started

    execute(kc, "dist.destroy_process_group()").expect_ok()
    ok = execute(kc, launch).expect_ok()
    assert ok.result_text == "LaunchResult([3.0, 3.0])"


# ----------------------------------------------------------------------------- spawn
@pytest.mark.timeout(90)
def test_spawn_runs_a_cell_defined_function(module_kernel):
    """start_method='spawn' ships a function defined in a cell (in __main__) to fresh
    interpreters, and a spawned rank's traceback names the cell and shows its source line."""
    _, kc = module_kernel
    code = """
        def spawned(scale):
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(f"spawned rank {dist.get_rank()}")
            return t.item() * scale, "ipykernel" in sys.modules

        def spawned_fails():
            if int(os.environ["RANK"]) == 1:
                raise RuntimeError("spawned boom")
            return 0

        spawned.__module__
        """
    define = execute(kc, code).expect_ok()
    assert define.result_text == "'__main__'"
    run = execute(
        kc,
        """
        _r = notebook_launcher(spawned, args=(10,), num_processes=2, start_method="spawn")
        print("method", _r.start_method)
        _r
        """,
        timeout=60,
    ).expect_ok()
    # Fresh interpreters: the workers never imported the kernel's ipykernel.
    assert run.result_text == "LaunchResult([(30.0, False), (30.0, False)])"
    assert "method spawn\n" in run.stdout()
    assert "[rank 0] spawned rank 0\n" in run.stdout()
    assert "[rank 1] spawned rank 1\n" in run.stdout()

    failed = execute(
        kc, 'notebook_launcher(spawned_fails, num_processes=2, start_method="spawn")', timeout=60
    )
    assert failed.error is not None, failed.stdout()
    assert failed.error["ename"] == "WorkerFailedError"
    evalue = failed.error["evalue"]
    assert evalue.startswith("rank 1 failed first: RuntimeError: spawned boom"), evalue
    label = f"Cell In[{define.execution_count}], line {line_in(code, 'raise RuntimeError')}"
    assert f"{label}, in spawned_fails" in evalue, evalue
    assert 'raise RuntimeError("spawned boom")' in evalue


# ----------------------------------------------------------------------------- accelerate
@pytest.mark.timeout(90)
def test_accelerator_in_the_kernel_is_refused_until_reset(module_kernel, tmp_path):
    """An Accelerator() created in a cell makes the launch refuse with the reset recipe; after
    running that recipe the launch works."""
    pytest.importorskip("accelerate")
    _, kc = module_kernel
    execute(
        kc, "from accelerate import Accelerator\n_acc = Accelerator(cpu=True)", timeout=60
    ).expect_ok()
    launch = f"notebook_launcher(sum_ranks, args=({str(tmp_path)!r},), num_processes=2)"
    refused = execute(kc, launch)
    assert refused.error is not None, refused.stdout()
    assert refused.error["ename"] == "UnsafeLaunchError"
    evalue = refused.error["evalue"]
    assert "An Accelerate AcceleratorState and PartialState already exist in" in evalue, evalue
    assert "Create the Accelerator inside the launched function" in evalue
    recipe = "from accelerate.state import AcceleratorState; "
    recipe += "AcceleratorState._reset_state(reset_partial_state=True)"
    assert recipe in evalue
    assert list(tmp_path.glob("pid*")) == []

    execute(kc, f"del _acc\n{recipe}").expect_ok()
    ok = execute(kc, launch).expect_ok()
    assert ok.result_text == "LaunchResult([3.0, 3.0])"
