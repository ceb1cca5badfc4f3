"""The hangs ordinary notebooks hit, in a real kernel: none of them may wait silently.

1. Fork after the kernel ran multi-threaded torch work: OpenMP's pool does not survive fork,
   and workers with more than one thread would hang in their first parallel op.
2. A function that sets MASTER_ADDR / MASTER_PORT (or a tcp:// init_method) itself.
3. A rendezvous that never completes (a rank that skips it, a wrong world_size).

The kernel starts with OMP_NUM_THREADS=1 (kernel_helpers); cells that need a multi-threaded
kernel call torch.set_num_threads(2) first, as a laptop's kernel has by default.
"""

from __future__ import annotations

import pytest
from kernel_helpers import execute, free_port

pytestmark = pytest.mark.kernel

KERNEL_SETUP = """
import os, threading, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from nb_dist import notebook_launcher, RendezvousTimeoutError, UnsafeLaunchError

def conv_work():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.Flatten(),
                        nn.Linear(16 * 24 * 24, 10))
    for _ in range(3):
        F.cross_entropy(net(torch.randn(32, 1, 28, 28)), torch.randint(0, 10, (32,))).backward()
    return torch.get_num_threads()

def sum_ranks():
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def launch_with_default_threads(function, **kwargs):
    # As on a laptop: no OMP_NUM_THREADS, so the launcher gives cores / ranks threads.
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        return notebook_launcher(function, **kwargs)
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved

def kernel_compute():
    torch.set_num_threads(2)        # what a 2+-core laptop's kernel has
    return conv_work()              # starts the kernel's OpenMP pool
"""


# ------------------------------------------------------------------ 1. OpenMP and fork
@pytest.mark.fast
@pytest.mark.timeout(120)
def test_launch_after_kernel_compute_keeps_its_threads(module_kernel):
    """Compute in the kernel, then 2 ranks x 2 threads: they finish, with 2 threads, and say so."""
    _, kc = module_kernel
    assert execute(kc, "kernel_compute()").expect_ok().result_text == "2"
    first = execute(
        kc, "notebook_launcher(conv_work, num_processes=2, threads_per_process=2, timeout=90)"
    ).expect_ok()
    assert first.result_text == "LaunchResult([2, 2])"
    assert "released the kernel's pool before forking" in first.stderr()
    assert "each rank keeps its 2 threads" in first.stderr()

    # The kernel's next parallel op starts a new pool; the notice is said once per kernel.
    assert execute(kc, "conv_work()").expect_ok().result_text == "2"
    again = execute(
        kc, "notebook_launcher(conv_work, num_processes=2, threads_per_process=2, timeout=90)"
    ).expect_ok()
    assert again.result_text == "LaunchResult([2, 2])"
    assert "released the kernel's pool" not in again.stderr()


@pytest.mark.timeout(120)
def test_one_thread_rank_that_raises_its_threads_after_kernel_compute(module_kernel):
    """The pool is released even for 1-thread ranks: one that calls set_num_threads(2) itself
    (or a library with its own thread count) must not hang in its first parallel op."""
    _, kc = module_kernel
    execute(
        kc,
        """
        def raises_threads():
            torch.set_num_threads(2)
            return conv_work()
        """,
    ).expect_ok()
    execute(kc, "kernel_compute()").expect_ok()
    run = execute(
        kc,
        "notebook_launcher(raises_threads, num_processes=2, threads_per_process=1, timeout=90)",
    ).expect_ok()
    assert run.result_text == "LaunchResult([2, 2])"


@pytest.mark.timeout(120)
def test_default_threads_after_kernel_compute(module_kernel):
    """Without OMP_NUM_THREADS, 1 rank on 2 cores gets 2 threads by default, and finishes."""
    _, kc = module_kernel
    execute(kc, "kernel_compute()").expect_ok()
    run = execute(
        kc,
        "launch_with_default_threads(conv_work, num_processes=1, timeout=90)",
    ).expect_ok()
    assert run.result_text == f"LaunchResult([{min(2, _cores())}])"


@pytest.mark.timeout(120)
def test_without_release_the_launch_drops_to_one_thread_or_refuses(module_kernel):
    """NB_DIST_RELEASE_OPENMP=0: the probe finds the hang; default threads fall back to 1 with
    a notice, and an explicit threads_per_process=2 is refused before anything starts."""
    _, kc = module_kernel
    execute(kc, "kernel_compute(); os.environ['NB_DIST_RELEASE_OPENMP'] = '0'").expect_ok()
    try:
        run = execute(
            kc,
            "launch_with_default_threads(conv_work, num_processes=1, timeout=90)",
        ).expect_ok()
        if _cores() >= 2:
            assert run.result_text == "LaunchResult([1])"
            assert "Ranks run with 1 thread instead of 2" in run.stderr()

        refused = execute(
            kc, "notebook_launcher(conv_work, num_processes=2, threads_per_process=2, timeout=90)"
        )
        assert refused.error is not None and refused.error["ename"] == "UnsafeLaunchError"
        message = refused.error["evalue"]
        assert "threads_per_process=2 cannot work with start_method='fork'" in message
        assert "start_method='forkserver'" in message and "threads_per_process=1" in message
    finally:
        execute(kc, "os.environ.pop('NB_DIST_RELEASE_OPENMP', None)").expect_ok()

    # The explicit alternative the message offers works, with its threads.
    alternative = execute(
        kc,
        "notebook_launcher(conv_work, num_processes=2, threads_per_process=2, "
        "start_method='forkserver', timeout=120)",
        timeout=150,
    ).expect_ok()
    assert alternative.result_text == "LaunchResult([2, 2])"
    # And with the release back on, fork is fine again in the same kernel.
    execute(kc, "kernel_compute()").expect_ok()
    fork_again = execute(
        kc, "notebook_launcher(conv_work, num_processes=2, threads_per_process=2, timeout=90)"
    ).expect_ok()
    assert fork_again.result_text == "LaunchResult([2, 2])"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


# ------------------------------------------------------------------ 2. the function's own address
@pytest.mark.timeout(90)
def test_function_that_sets_master_port_itself(module_kernel):
    """The PyTorch DDP tutorial's pattern: MASTER_ADDR/MASTER_PORT set inside the function."""
    _, kc = module_kernel
    port = free_port()
    execute(
        kc,
        f"""
        def train_ddp():
            os.environ["MASTER_ADDR"] = "localhost"
            os.environ["MASTER_PORT"] = "{port}"
            dist.init_process_group(
                "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
            )
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)
            return t.item()
        """,
    ).expect_ok()
    run = execute(kc, "notebook_launcher(train_ddp, num_processes=2, timeout=60)").expect_ok()
    assert run.result_text == "LaunchResult([3.0, 3.0])"
    # Twice in a row on the same port: rank 0's store is gone with the launch.
    again = execute(kc, "notebook_launcher(train_ddp, num_processes=2, timeout=60)").expect_ok()
    assert again.result_text == "LaunchResult([3.0, 3.0])"


@pytest.mark.timeout(90)
def test_explicit_tcp_init_method(module_kernel):
    _, kc = module_kernel
    port = free_port()
    execute(
        kc,
        f"""
        def train_tcp(world):
            dist.init_process_group(
                "gloo", init_method="tcp://127.0.0.1:{port}",
                rank=int(os.environ["RANK"]), world_size=world,
            )
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        """,
    ).expect_ok()
    run = execute(
        kc, "notebook_launcher(train_tcp, args=(3,), num_processes=3, timeout=60)"
    ).expect_ok()
    assert run.result_text == "LaunchResult([3.0, 3.0, 3.0])"


# ------------------------------------------------------------------ 3. rendezvous that never ends
@pytest.mark.timeout(60)
def test_rank_that_never_joins_is_reported_without_timeout(module_kernel):
    """No timeout= given: the rendezvous watchdog stops it, naming the missing rank's line."""
    _, kc = module_kernel
    execute(
        kc,
        """
        def only_rank0_joins():
            if int(os.environ["RANK"]) == 0:
                dist.init_process_group("gloo")
            else:  # never calls init_process_group
                threading.Event().wait()
        """,
    ).expect_ok()
    run = execute(kc, "notebook_launcher(only_rank0_joins, num_processes=2, rendezvous_timeout=2)")
    assert run.error is not None and run.error["ename"] == "RendezvousTimeoutError"
    text = run.error["evalue"]
    assert "rendezvous_timeout=2 s" in text
    assert "rank 0 waited" in text and "in init_process_group, world_size=2" in text
    assert "rank 1 had not reached init_process_group" in text
    assert "`threading.Event().wait()` at Cell In[" in text
    assert "Likely cause: rank 1 had not called init_process_group" in text
    # The kernel stays usable: the next launch works.
    after = execute(kc, "notebook_launcher(sum_ranks, num_processes=2, timeout=60)").expect_ok()
    assert after.result_text == "LaunchResult([2.0, 2.0])"


@pytest.mark.timeout(60)
def test_wrong_world_size_is_named(module_kernel):
    _, kc = module_kernel
    execute(
        kc,
        """
        def world_of_four():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=4)
        """,
    ).expect_ok()
    run = execute(
        kc, "notebook_launcher(world_of_four, num_processes=2, rendezvous_timeout=2, timeout=30)"
    )
    assert run.error is not None and run.error["ename"] == "RendezvousTimeoutError"
    text = run.error["evalue"]
    assert "rank 0 waited" in text and "rank 1 waited" in text
    assert "asked for world_size 4, but this launch started 2 rank(s)" in text
