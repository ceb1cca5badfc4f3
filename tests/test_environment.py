"""What the workers see (environment, threads, process group, precision) and what the caller keeps.

Every test launches real forked workers; the values they observe come back as return values.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_helpers import listeners

import nb_dist
from nb_dist import WorkerFailedError, notebook_launcher

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

_ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
)
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGHUP)
_BIG_TENSORS = 25  # x 1M float32 = 100 MB
_BIG_NUMEL = 1 << 20


# ---------------------------------------------------------------- worker functions
def _report_env():
    return {name: os.environ.get(name) for name in _ENV_NAMES}, torch.get_num_threads()


def _default_group_allreduce():
    dist.init_process_group()  # no arguments: env:// from the launcher's variables
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_backend_config(), dist.get_world_size(), dist.get_rank(), t.item()


def _group_made_by_launcher():
    initialized = dist.is_initialized()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return initialized, dist.get_backend(), dist.get_world_size(), t.item()


def _init_again():
    dist.init_process_group("gloo")


def _leave_group_initialized(marker_dir):
    original = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        Path(marker_dir, f"destroyed-{dist.get_rank()}").touch()
        return original(*args, **kwargs)

    dist.destroy_process_group = recording_destroy  # the worker's copy of torch only
    dist.init_process_group()
    dist.barrier()
    return dist.is_initialized()


def _precision_seen():
    a = torch.ones(4, 4)
    with nb_dist.autocast():
        product = a @ a
    return (
        os.environ["ACCELERATE_MIXED_PRECISION"],
        nb_dist.mixed_precision(),
        nb_dist.autocast_dtype(),
        nb_dist.needs_grad_scaler(),
        product.dtype,
    )


def _accelerator_seen():
    from accelerate import Accelerator

    accelerator = Accelerator()
    ranks = accelerator.gather(torch.tensor([accelerator.process_index]))
    return (
        accelerator.num_processes,
        accelerator.process_index,
        accelerator.mixed_precision,
        str(accelerator.state.distributed_type),
        ranks.tolist(),
    )


def _succeed():
    dist.init_process_group()
    dist.barrier()
    return os.getpid()


def _fail():
    raise ValueError("deliberate failure")


def _big_tensor(index):
    generator = torch.Generator().manual_seed(index)
    return torch.randn(_BIG_NUMEL, generator=generator)


def _return_big_state_dict():
    if int(os.environ["RANK"]) != 0:
        return None
    return {f"layer{i}.weight": _big_tensor(i).view(1024, 1024) for i in range(_BIG_TENSORS)}


def _return_unpicklable(kind):
    if int(os.environ["RANK"]) == 0:
        time.sleep(60)  # still running when rank 1 fails: stopped, on any machine
        return 0
    return threading.Lock() if kind == "lock" else (lambda: 1)


# ---------------------------------------------------------------- helpers
def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _expected_env(rank, world_size, port, threads):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(threads),
        "GLOO_SOCKET_IFNAME": "lo",
    }


@contextlib.contextmanager
def _caller_threads(n: int) -> Iterator[None]:
    """The calling process computes with ``n`` threads meanwhile (without starting its pool).

    A forked worker would keep the caller's count: with ``n`` unlike the count the launcher
    must give, a launcher that did not set the workers' threads fails the checks.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _our_temp_entries() -> set[str]:
    markers = ("nb_dist", "torchelastic", "pymp")
    return {n for n in os.listdir(tempfile.gettempdir()) if any(m in n for m in markers)}


# ---------------------------------------------------------------- environment
def test_worker_environment_and_default_threads(monkeypatch):
    """Each rank gets torchrun's variables; OMP threads default to cores // workers."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    threads = max(1, _cores() // 2)
    with _caller_threads(threads + 2):
        result = notebook_launcher(_report_env, num_processes=2)
    for rank, (env, torch_threads) in enumerate(result):
        assert env == _expected_env(rank, 2, result.port, threads)
        assert torch_threads == threads
    assert "OMP_NUM_THREADS" not in os.environ


def test_single_worker_gets_all_cores(monkeypatch):
    """With OMP_NUM_THREADS unset, one worker gets every core (the computed default)."""
    if _cores() < 2:
        pytest.skip("needs 2 cores to tell the computed default from 1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    (env, torch_threads) = notebook_launcher(_report_env, num_processes=1)[0]
    assert env["OMP_NUM_THREADS"] == str(_cores())
    assert torch_threads == _cores()


def test_threads_per_process_overrides(monkeypatch):
    """threads_per_process=1 wins over both the computed default and OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    with _caller_threads(3):
        launch = notebook_launcher(_report_env, num_processes=1, threads_per_process=1)
    (env, torch_threads) = launch[0]
    assert (env["OMP_NUM_THREADS"], torch_threads) == ("1", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with _caller_threads(3):
        launch = notebook_launcher(_report_env, num_processes=1, threads_per_process=1)
    (env, torch_threads) = launch[0]
    assert (env["OMP_NUM_THREADS"], torch_threads) == ("1", 1)


def test_omp_num_threads_of_caller_is_inherited(monkeypatch):
    """An OMP_NUM_THREADS set by the user reaches the workers unchanged, and is their thread
    count. The value is none the launcher would pick itself (more than the cores; not the 1
    this suite's conftest sets), so only carrying the user's value over passes."""
    mine = _cores() + 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(mine))
    (env, torch_threads) = notebook_launcher(_report_env, num_processes=1)[0]
    assert env["OMP_NUM_THREADS"] == str(mine)
    assert torch_threads == mine


# ---------------------------------------------------------------- process group
def test_init_process_group_without_arguments():
    """dist.init_process_group() with no arguments works in the function; all_reduce sums."""
    result = notebook_launcher(_default_group_allreduce, num_processes=2)
    assert list(result) == [("cpu:gloo", 2, 0, 3.0), ("cpu:gloo", 2, 1, 3.0)]


def test_launcher_creates_group_when_asked():
    """init_process_group=True: the group (gloo) exists before the function runs."""
    result = notebook_launcher(_group_made_by_launcher, num_processes=2, init_process_group=True)
    assert list(result) == [(True, "gloo", 2, 3.0)] * 2


def test_second_init_with_init_process_group_true_explains():
    """A user init after init_process_group=True fails with a message saying what to change."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_init_again, num_processes=2, init_process_group=True)
    message = str(info.value)
    assert message.startswith("rank ")
    assert "failed first: ValueError:" in message
    for fragment in (
        "twice",
        "init_process_group=True",
        "Remove your own torch.distributed.init_process_group(...) call",
        "init_process_group=False",
    ):
        assert fragment in message, fragment


def test_group_left_initialized_is_destroyed(tmp_path):
    """A group the function leaves behind is destroyed by the worker, with no warning."""
    result = notebook_launcher(_leave_group_initialized, args=(str(tmp_path),), num_processes=2)
    assert list(result) == [True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["destroyed-0", "destroyed-1"]
    for log in result.logs:
        assert "destroy_process_group" not in log
        assert "Warning" not in log and "WARNING" not in log


# ---------------------------------------------------------------- mixed precision
@pytest.mark.parametrize(
    ("precision", "dtype", "scaler"),
    [("bf16", torch.bfloat16, False), ("fp16", torch.float16, True), ("no", None, False)],
)
def test_mixed_precision_reaches_the_ranks(precision, dtype, scaler):
    """mixed_precision arrives as the env var, the nb_dist helpers and a real CPU autocast."""
    result = notebook_launcher(_precision_seen, num_processes=1, mixed_precision=precision)
    env, seen, autocast_dtype, needs_scaler, product_dtype = result[0]
    assert (env, seen) == (precision, precision)
    assert autocast_dtype == dtype
    assert needs_scaler is scaler
    assert product_dtype == (dtype or torch.float32)


@pytest.mark.timeout(90)
def test_accelerator_runs_multi_cpu():
    """Accelerator() inside the function sees 2 CPU ranks, their indices and bf16."""
    pytest.importorskip("accelerate")
    result = notebook_launcher(_accelerator_seen, num_processes=2, mixed_precision="bf16")
    assert list(result) == [
        (2, 0, "bf16", "DistributedType.MULTI_CPU", [0, 1]),
        (2, 1, "bf16", "DistributedType.MULTI_CPU", [0, 1]),
    ]


# ---------------------------------------------------------------- the caller keeps its state
def _custom_handler(signum, frame):  # pragma: no cover - never called
    pass


def test_caller_environment_and_signals_are_unchanged():
    """os.environ, signal handlers and the temp dir are the same after a good and a bad launch."""
    previous = signal.signal(signal.SIGUSR1, _custom_handler)  # a handler a user might install
    try:
        env_before = dict(os.environ)
        handlers_before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        temp_before = _our_temp_entries()

        pids = notebook_launcher(_succeed, num_processes=2)
        assert len(set(pids)) == 2
        assert dict(os.environ) == env_before
        assert {sig: signal.getsignal(sig) for sig in _SIGNALS} == handlers_before

        with pytest.raises(WorkerFailedError, match="deliberate failure"):
            notebook_launcher(_fail, num_processes=2)
        assert dict(os.environ) == env_before
        assert {sig: signal.getsignal(sig) for sig in _SIGNALS} == handlers_before
        assert _our_temp_entries() - temp_before == set()
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------- return values
@pytest.mark.timeout(60)
def test_large_state_dict_comes_back_intact():
    """A 100 MB dict of tensors returned by rank 0 arrives with every value intact."""
    result = notebook_launcher(_return_big_state_dict, num_processes=2)
    state, other = result
    assert other is None
    assert sorted(state) == sorted(f"layer{i}.weight" for i in range(_BIG_TENSORS))
    assert sum(t.numel() * t.element_size() for t in state.values()) == 100 * 2**20
    for i in range(_BIG_TENSORS):
        tensor = state[f"layer{i}.weight"]
        assert tensor.shape == (1024, 1024) and tensor.dtype == torch.float32
        assert torch.equal(tensor.view(-1), _big_tensor(i))


@pytest.mark.parametrize(("kind", "type_name"), [("lock", "_thread.lock"), ("lambda", "function")])
def test_unpicklable_return_value_names_rank_and_type(kind, type_name):
    """An unpicklable return value fails that rank, naming the rank, the type and the fix."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_return_unpicklable, args=(kind,), num_processes=2)
    error = info.value
    assert str(error).startswith(
        f"rank 1 failed first: UnpicklableResultError: rank 1 returned a value of type "
        f"{type_name} that cannot be sent back to the kernel"
    )
    assert "Return something picklable" in str(error)
    assert error.root_cause.rank == 1
    assert error.outcomes[0].status == "stopped"


# ------------------------------------------- init_process_group completes on every rank first
def _init_barrier_setting() -> str | None:
    return os.environ.get("TORCH_DIST_INIT_BARRIER")


def test_ranks_use_torchs_init_barrier_unless_the_user_says_otherwise(monkeypatch):
    """Without it, a rank whose function returns right after init_process_group can exit
    while a slower peer still connects to it, which then fails ("Connection closed by peer"):
    measured in bench/init_race.py (a race: too rare on an idle machine for a test)."""
    monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)
    assert list(notebook_launcher(_init_barrier_setting, num_processes=2)) == ["1", "1"]
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "0")
    assert list(notebook_launcher(_init_barrier_setting, num_processes=2)) == ["0", "0"]


def _visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_cpu_ranks_see_no_gpu(monkeypatch):
    """Ranks on the CPU (device='cpu', or the default with fewer GPUs than ranks) see no GPU,
    so init_process_group() without a backend picks gloo (with a GPU in view torch picks
    NCCL, which fails on CPU tensors: found on a one-GPU machine)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if nb_dist._kernel._preflight.probe_cuda().gpus >= 3:  # the default would use GPUs
        pytest.skip("3 or more GPUs are visible: the default runs these ranks on GPUs")
    assert list(notebook_launcher(_visible_devices, num_processes=3)) == ["", "", ""]
    assert list(notebook_launcher(_visible_devices, num_processes=2, device="cpu")) == ["", ""]


def test_the_store_and_gloo_listen_on_loopback_only():
    """Neither authenticates its peers: on one machine nothing of a launch is reachable from
    the network (torch's store alone would listen on every interface, '::')."""
    for _, store, mine in notebook_launcher(listeners, num_processes=2):
        assert store == ["127.0.0.1"], store
        assert mine and set(mine) == {"127.0.0.1"}, mine  # gloo's pairs, on loopback
