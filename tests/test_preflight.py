"""Refusals: every launch that cannot work is refused before any worker starts.

Each refusal is checked for its exception type and for a message that names the parameter,
the value and the fix. "No worker started" is proven with a marker file that the launched
function would create, and by the autouse fixture that fails a test leaving processes behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import nb_dist
from nb_dist import UnsafeLaunchError, WorkerFailedError, notebook_launcher
from nb_dist._kernel._local import device_choice

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


# ---------------------------------------------------------------- worker functions
def _touch_marker(path):
    """Leave proof that a worker ran."""
    Path(path).write_text(str(os.getpid()))
    return os.getpid()


def _allreduce_sum():
    dist.init_process_group()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _master_port():
    return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


def _mixed_precision_seen():
    return os.environ["ACCELERATE_MIXED_PRECISION"], nb_dist.mixed_precision()


def _nested_launch(path):
    return notebook_launcher(_touch_marker, args=(path,), num_processes=1)


# ---------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(tmp_path, exc_type, **kwargs):
    """Launch ``_touch_marker`` with ``kwargs``; return the error and prove nothing ran."""
    marker = tmp_path / "ran"
    launch = {"args": (str(marker),), "num_processes": 2, **kwargs}
    with pytest.raises(exc_type) as info:
        notebook_launcher(_touch_marker, **launch)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert not marker.exists(), "a worker ran although the launch was refused"
    return str(info.value)


def _assert_mentions(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in message:\n{message}"


# ---------------------------------------------------------------- arguments
def test_a_cluster_that_is_not_one_is_refused(tmp_path):
    """cluster= takes a cluster object (its transport); an address string is the mistake a
    learner makes, and the message says what to pass instead."""
    message = _refused(tmp_path, TypeError, cluster="ray://head:10001")
    _assert_mentions(message, "cluster='ray://head:10001'", "nb_dist.RayCluster(", "cluster=None")


def test_live_ranks_refuse_a_cluster_that_is_not_one():
    from nb_dist import Ranks

    with pytest.raises(TypeError) as info:
        Ranks(2, cluster="auto")
    _assert_mentions(str(info.value), "cluster='auto'", "nb_dist.RayCluster(")


def test_function_not_callable_is_refused():
    """Passing the result of a call instead of the function names the value and the fix."""
    with pytest.raises(TypeError) as info:
        notebook_launcher(42, num_processes=2)
    _assert_mentions(
        str(info.value), "function=42", "(a int)", "not callable", "without calling it"
    )


@pytest.mark.parametrize(
    ("args", "shown", "fix"),
    [(5, "args=5 (a int)", "args=(5,)"), ("ab", "args='ab' (a str)", "args=('ab',)")],
)
def test_args_must_be_tuple_or_list(tmp_path, args, shown, fix):
    """args that is not a tuple/list is refused with the one-tuple spelling as the fix."""
    message = _refused(tmp_path, TypeError, args=args)
    _assert_mentions(message, shown, "must be a tuple or list", fix, "with the comma")


@pytest.mark.parametrize(
    ("value", "exc_type"),
    [(0, ValueError), (-1, ValueError), ("2", TypeError), (2.5, TypeError), (True, TypeError)],
)
def test_num_processes_must_be_positive_int(tmp_path, value, exc_type):
    """num_processes 0, -1, '2', 2.5 and True are refused, naming the value and a good choice."""
    message = _refused(tmp_path, exc_type, num_processes=value)
    _assert_mentions(
        message, f"num_processes={value!r}", "positive whole number", "2 to 4 is a good choice"
    )


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a GPU is visible")
def test_num_processes_none_needs_a_gpu(tmp_path):
    """num_processes=None means one per GPU; on a CPU machine it asks for a number."""
    message = _refused(tmp_path, ValueError, num_processes=None)
    _assert_mentions(message, "num_processes=None", "one process per GPU", "num_processes=2")


def test_node_rank_must_be_below_num_nodes(tmp_path):
    """node_rank >= num_nodes names both values and the valid range."""
    message = _refused(tmp_path, ValueError, node_rank=2, num_nodes=2, use_port=29500)
    _assert_mentions(message, "node_rank=2", "num_nodes=2", "0 to 1", "its own node_rank")


@pytest.mark.parametrize(("value", "exc_type"), [(-1, ValueError), ("0", TypeError)])
def test_node_rank_must_be_non_negative_int(tmp_path, value, exc_type):
    """A negative or non-integer node_rank is refused, saying 0 is the first machine."""
    message = _refused(tmp_path, exc_type, node_rank=value)
    _assert_mentions(message, f"node_rank={value!r}", "0 to num_nodes - 1", "0 on the first")


def test_unknown_mixed_precision_is_refused(tmp_path):
    """mixed_precision='fp8' lists the supported choices."""
    message = _refused(tmp_path, ValueError, mixed_precision="fp8")
    _assert_mentions(
        message, "mixed_precision='fp8'", "'no'", "'fp16'", "'bf16'", "case does not matter"
    )


def test_mixed_precision_is_case_insensitive():
    """mixed_precision='BF16' is accepted and reaches the workers as 'bf16'."""
    result = notebook_launcher(_mixed_precision_seen, num_processes=1, mixed_precision="BF16")
    assert result[0] == ("bf16", "bf16")


@pytest.mark.parametrize("value", ["abc", 70000, 0, True])
def test_invalid_use_port_is_refused(tmp_path, value):
    """use_port that is not a TCP port names the value, the range and the automatic choice."""
    message = _refused(tmp_path, ValueError, use_port=value)
    _assert_mentions(
        message, f"use_port={value!r}", "not a valid TCP port", "1024 to 65535", "leave use_port"
    )


def test_port_busy_in_this_process_is_refused(tmp_path):
    """A port this process listens on is refused as held 'by this kernel'."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        message = _refused(tmp_path, UnsafeLaunchError, use_port=port)
    _assert_mentions(
        message,
        f"Port {port} (use_port={port}) is already in use",
        "by this kernel",
        "Leave use_port unset",
    )


def test_port_busy_in_another_process_names_its_pid(tmp_path):
    """A port another process listens on is refused, naming that process' pid."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(holder.stdout.readline())
        message = _refused(tmp_path, UnsafeLaunchError, use_port=port)
        _assert_mentions(
            message,
            f"Port {port} (use_port={port}) is already in use",
            f"by process {holder.pid} (",
            "choose another port",
        )
        assert "by this kernel" not in message
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.mark.timeout(60)
def test_port_busy_in_one_of_this_kernels_ranks_names_it(tmp_path):
    """A port a live rank of this kernel listens on is named as held by that rank."""
    with nb_dist.Ranks(num_processes=1) as ranks:
        ranks.exec(
            "import socket\nheld = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()"
        )
        (port,) = ranks.exec("held.getsockname()[1]")
        message = _refused(tmp_path, UnsafeLaunchError, use_port=port)
        _assert_mentions(
            message,
            f"Port {port} (use_port={port}) is already in use",
            f"by process {ranks.pids[0]} (",
            "a rank this kernel started",
        )


def test_a_rank_record_ends_with_the_rank_and_ignores_a_reused_pid():
    """The kernel's record of its ranks holds only ranks still alive, by pid and start time."""
    from nb_dist._kernel import _ports

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _ports.remember_ranks([child.pid])
        assert _ports.is_our_rank(child.pid)
        assert not _ports.is_our_rank(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert not _ports.is_our_rank(child.pid)  # gone: a later process with its pid is not ours
    _ports.remember_ranks([])
    assert child.pid not in _ports._started_ranks


def test_multi_node_needs_explicit_port(tmp_path):
    """num_nodes=2 without use_port asks for the same explicit port on every node."""
    message = _refused(tmp_path, ValueError, num_nodes=2)
    _assert_mentions(message, "use_port=None", "num_nodes=2", "use_port=29500", "every node")


def test_max_restarts_with_multi_node_is_refused(tmp_path):
    """max_restarts with num_nodes>1 points to max_restarts=0 or torchrun."""
    message = _refused(tmp_path, ValueError, num_nodes=2, use_port=29500, max_restarts=1)
    _assert_mentions(
        message, "max_restarts=1", "num_nodes=2", "max_restarts=0", "torchrun", "--max-restarts"
    )


def test_c10d_rendezvous_across_machines_is_refused(tmp_path):
    """rdzv_backend='c10d' with several nodes: refused, naming 'static' and torchrun."""
    message = _refused(tmp_path, ValueError, rdzv_backend="c10d", num_nodes=2, use_port=29500)
    _assert_mentions(message, "rdzv_backend='c10d'", "num_nodes=2", "'static'", "torchrun")
    assert "--rdzv-backend=c10d" in message


def test_unknown_rendezvous_backend_is_refused(tmp_path):
    message = _refused(tmp_path, ValueError, rdzv_backend="etcd")
    _assert_mentions(message, "rdzv_backend='etcd'", "not supported", "'static'", "'c10d'")


@pytest.mark.timeout(60)
def test_c10d_rendezvous_on_one_machine_runs():
    """On one machine c10d gives the same ranks as static: accepted, as Accelerate accepts it."""
    assert notebook_launcher(_allreduce_sum, num_processes=2, rdzv_backend="c10d") == [3.0, 3.0]


def test_rdzv_conf_that_is_not_a_dict_is_refused(tmp_path):
    message = _refused(tmp_path, TypeError, rdzv_conf="timeout=60")
    _assert_mentions(message, "rdzv_conf='timeout=60'", "must be a dict", "{'timeout': 60}")


def test_rdzv_conf_timeout_must_be_seconds(tmp_path):
    message = _refused(tmp_path, ValueError, rdzv_conf={"timeout": -1})
    _assert_mentions(message, "rdzv_conf['timeout']=-1", "positive number of seconds")


def _only_rank0_joins():
    if int(os.environ["RANK"]) == 0:
        dist.init_process_group("gloo")
    else:
        import threading

        threading.Event().wait()


@pytest.mark.timeout(60)
def test_rdzv_conf_timeout_sets_the_rendezvous_timeout(capfd):
    """Accelerate's rdzv_conf={'timeout': N} maps onto rendezvous_timeout; other keys are
    ignored with a one-line notice."""
    with pytest.raises(nb_dist.RendezvousTimeoutError) as info:
        notebook_launcher(
            _only_rank0_joins, num_processes=2, rdzv_conf={"timeout": 1.5, "read_timeout": 5}
        )
    assert "rendezvous_timeout=1.5 s" in str(info.value)
    err = capfd.readouterr().err
    assert "[nb_dist] rdzv_conf keys read_timeout configure torchrun's elastic agent" in err


@pytest.mark.parametrize("endpoint", ["10.0.0.1", "10.0.0.1:port", "10.0.0.1:99999"])
def test_malformed_rdzv_endpoint_is_refused(tmp_path, endpoint):
    """rdzv_endpoint must be 'host:port'; the message names rdzv_endpoint, not use_port."""
    message = _refused(tmp_path, ValueError, rdzv_endpoint=endpoint)
    _assert_mentions(message, f"rdzv_endpoint={endpoint!r}", "host:port", "10.0.0.1:29500")
    assert "use_port=" not in message


def test_rdzv_endpoint_is_honoured():
    """rdzv_endpoint='127.0.0.1:P' makes the launch rendezvous on port P."""
    port = _free_port()
    result = notebook_launcher(_master_port, num_processes=2, rdzv_endpoint=f"127.0.0.1:{port}")
    assert result.port == port
    assert list(result) == [("127.0.0.1", str(port))] * 2


@pytest.mark.parametrize(
    ("name", "value", "choices"),
    [
        ("start_method", "thread", "'fork', 'spawn', 'forkserver'"),
        ("output", "rank1", "'all', 'rank0', 'grouped', 'none'"),
        ("device", "tpu", "'auto', 'cpu', 'cuda'"),
        ("device", None, "'auto', 'cpu', 'cuda'"),
    ],
)
def test_invalid_choice_is_refused(tmp_path, name, value, choices):
    """start_method/output/device outside their choices list the valid ones."""
    message = _refused(tmp_path, ValueError, **{name: value})
    _assert_mentions(message, f"{name}={value!r}", "is not supported", f"Use one of {choices}")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("timeout", 0),
        ("timeout", -1),
        ("timeout", "10"),
        ("timeout", True),
        ("hang_notice_after", -5),
        ("hang_notice_after", 0.0),
    ],
)
def test_invalid_seconds_are_refused(tmp_path, name, value):
    """timeout/hang_notice_after must be positive seconds or None."""
    message = _refused(tmp_path, ValueError, **{name: value})
    _assert_mentions(message, f"{name}={value!r}", "positive number of seconds, or None")


@pytest.mark.parametrize("value", [0, "0.1", None])
def test_invalid_monitor_interval_is_refused(tmp_path, value):
    """monitor_interval has no "off": None is refused too, naming the default."""
    message = _refused(tmp_path, ValueError, monitor_interval=value)
    _assert_mentions(
        message, f"monitor_interval={value!r}", "positive number of seconds", "unset for 0.1"
    )


@pytest.mark.parametrize(
    ("kwargs", "exc_type", "fragments"),
    [
        ({"max_restarts": -1}, ValueError, ["max_restarts=-1", "0 or more"]),
        ({"num_nodes": 0}, ValueError, ["num_nodes=0", "num_nodes=1 for a launch"]),
        (
            {"threads_per_process": 0},
            ValueError,
            ["threads_per_process=0", "leave it unset for cores / ranks"],
        ),
        ({"init_process_group": "yes"}, TypeError, ["init_process_group='yes'", "True or False"]),
        ({"master_addr": ""}, TypeError, ["master_addr=''", "IP address string"]),
    ],
)
def test_other_invalid_arguments_are_refused(tmp_path, kwargs, exc_type, fragments):
    """max_restarts, num_nodes, threads_per_process, init_process_group, master_addr."""
    _assert_mentions(_refused(tmp_path, exc_type, **kwargs), *fragments)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a GPU is visible")
def test_device_cuda_without_gpu_is_refused(tmp_path):
    """device='cuda' on a machine without GPU suggests device='cpu'."""
    message = _refused(tmp_path, ValueError, device="cuda")
    _assert_mentions(message, "device='cuda'", "no GPU is visible", "device='cpu'")


# ---------------------------------------------------------------- kernel state
def test_initialized_process_group_is_refused(tmp_path, monkeypatch):
    """A process group in the caller is refused with the destroy_process_group way out."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(tmp_path / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        message = _refused(tmp_path, UnsafeLaunchError)
        _assert_mentions(
            message,
            "process group is already initialized",
            "backend 'gloo', world size 1",
            "torch.distributed.destroy_process_group()",
            "keep init_process_group inside the launched function",
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Following the advice is enough: the workers can create their own group.
    assert list(notebook_launcher(_allreduce_sum, num_processes=2)) == [3.0, 3.0]


@pytest.mark.parametrize("kind", ["PartialState", "Accelerator"])
def test_accelerate_state_is_refused(tmp_path, kind):
    """An Accelerate state in the caller is refused; the _reset_state advice makes it work."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    saved_env = dict(os.environ)
    try:
        if kind == "PartialState":
            accelerate.PartialState(cpu=True)
            names = "PartialState already exists"
        else:
            accelerate.Accelerator(cpu=True)
            names = "AcceleratorState and PartialState already exist in"
        message = _refused(tmp_path, UnsafeLaunchError)
        _assert_mentions(
            message,
            f"An Accelerate {names}",
            "Create the Accelerator inside the launched function",
            "from accelerate.state import AcceleratorState",
            "AcceleratorState._reset_state(reset_partial_state=True)",
        )
        # Do exactly what the message says, then launch again.
        AcceleratorState._reset_state(reset_partial_state=True)
        marker = tmp_path / "after_reset"
        result = notebook_launcher(_touch_marker, args=(str(marker),), num_processes=1)
        assert marker.read_text() == str(result[0])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)


def test_nested_launch_is_refused(tmp_path):
    """A worker that calls notebook_launcher fails with UnsafeLaunchError as the root cause."""
    marker = tmp_path / "inner_ran"
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_nested_launch, args=(str(marker),), num_processes=1)
    root = info.value.root_cause
    assert root.rank == 0
    assert root.exc_type == "nb_dist.UnsafeLaunchError"
    _assert_mentions(
        root.message, "inside rank 0 of a launch", "from the notebook (the kernel) only"
    )
    assert str(info.value).startswith("rank 0 failed first: nb_dist.UnsafeLaunchError: ")
    assert not marker.exists()


# ---------------------------------------------------------------- CUDA
def test_probe_cuda_on_cpu_build_is_quick_and_clean():
    """On a CPU build of torch, probe_cuda reports no GPU and no poisoning, without forking."""
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("torch is built with CUDA/ROCm")
    forks_before = _FORKS[0]
    state = nb_dist._kernel._preflight.probe_cuda()
    assert (state.gpus, state.poisoned, state.where) == (0, False, None)
    assert _FORKS[0] == forks_before  # nothing forked: no throw-away child on a CPU build


def _wedged_driver(torch_module, in_bad_fork):
    """Stands in for the GPU count in the probe's child: a driver call that never returns."""
    time.sleep(600)
    return {}


def _zombies_and_children() -> set[int]:
    """This process's children, zombies (ended, not reaped) included."""
    return {child.pid for child in psutil.Process().children()}


def test_a_wedged_driver_is_refused_at_the_probes_deadline_and_its_child_is_gone(monkeypatch):
    """A real throw-away child that never answers (it sleeps where it would ask the driver):
    probe_cuda returns at its deadline with a refusal that says what to do, and the child is
    killed and reaped (not even a zombie is left)."""
    probe = nb_dist._kernel._preflight
    monkeypatch.setattr(probe, "_cuda_built", lambda: True)  # probe on a CPU build as on CUDA
    monkeypatch.setattr(probe, "_count_gpus", _wedged_driver)
    monkeypatch.setattr(probe, "PROBE_WITHIN", 0.5)  # the deadline _plan's call gets
    before = _zombies_and_children()
    began = time.monotonic()
    with pytest.raises(UnsafeLaunchError) as info:
        probe.probe_cuda()
    took = time.monotonic() - began
    assert took < 0.5 + probe.REAP_WITHIN, f"returned after {took:.1f} s, not at its deadline"
    _assert_mentions(
        str(info.value), "took more than 0.5 s", "did not answer", "nvidia-smi", "device='cpu'"
    )
    assert _zombies_and_children() == before


def test_the_probe_deadline_can_be_given_per_call_and_an_answer_within_it_is_used(monkeypatch):
    """A child that answers in time is read and reaped; ``within`` overrides the constant."""
    probe = nb_dist._kernel._preflight
    monkeypatch.setattr(probe, "_cuda_built", lambda: True)
    monkeypatch.setattr(probe, "_count_gpus", lambda torch_module, bad: {"bad": False, "count": 3})
    before = _zombies_and_children()
    state = probe.probe_cuda(within=20.0)
    assert (state.gpus, state.poisoned) == (3, False)
    assert _zombies_and_children() == before  # a child that answered is reaped too
    monkeypatch.setattr(probe, "_count_gpus", _wedged_driver)
    with pytest.raises(UnsafeLaunchError, match=r"took more than 0\.25 s"):
        probe.probe_cuda(within=0.25)
    assert _zombies_and_children() == before


# Every os.fork of this test process, counted (the probe above must not fork on a CPU build).
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


os.register_at_fork(before=_count_fork)


_POISONED_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"
    import nb_dist
    import torch

    def count():
        return torch.cuda.device_count()

    torch.cuda.is_available()  # poisons fork: cudaGetDeviceCount in the parent
    try:
        nb_dist.notebook_launcher(count, num_processes=1)
    except nb_dist.UnsafeLaunchError as exc:
        print("REFUSED:", exc, flush=True)
    result = nb_dist.notebook_launcher(count, num_processes=1, start_method="spawn")
    print("SPAWNED:", list(result), flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_touched_in_caller_refuses_fork_and_allows_spawn(tmp_path):
    """torch.cuda.is_available() in the caller: fork is refused naming the line; spawn works."""
    if not torch.version.cuda:
        pytest.skip("torch is not built with CUDA")
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    if nvml is None or nvml() < 1:
        pytest.skip("NVML sees no GPU")
    script = tmp_path / "poisoned.py"
    script.write_text(_POISONED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_mentions(
        done.stdout,
        "REFUSED: CUDA was already initialized in this kernel",
        "torch.cuda.is_available()",
        "poisoned.py, line 10",
        "start_method='spawn'",
        "SPAWNED: [",
    )


# ------------------------------------------------------------ devices, given the visible GPUs
@pytest.mark.parametrize(
    ("device", "num_processes", "gpus", "expected"),
    [
        ("auto", 2, 0, (False, 2)),
        ("cpu", 4, 8, (False, 4)),
        ("auto", 2, 2, (True, 2)),
        ("auto", None, 4, (True, 4)),
        ("cuda", 1, 1, (True, 1)),
    ],
)
def test_device_choice_without_a_notice(device, num_processes, gpus, expected):
    assert device_choice(device, num_processes, gpus) == (*expected, None)


def test_more_ranks_than_gpus_run_on_the_cpu_by_default_with_a_notice():
    """A notebook written for a laptop (2 ranks) on a one-GPU machine: gloo on the CPU, and
    the cell says why and how to use the GPU."""
    use_gpu, n, notice = device_choice("auto", 2, 1)
    assert (use_gpu, n) == (False, 2)
    assert notice is not None
    _assert_mentions(notice, "num_processes=2", "1 GPU(s)", "CPU with gloo", "device='cuda'")


@pytest.mark.parametrize(
    ("device", "num_processes", "gpus", "words"),
    [
        ("cuda", 2, 1, ("num_processes=2", "device='cuda'", "only 1 GPU(s)", "'auto'")),
        ("cuda", 1, 0, ("device='cuda'", "no GPU is visible", "device='cpu'")),
        ("auto", None, 0, ("num_processes=None", "num_processes=2")),
        ("cpu", None, 4, ("num_processes=None", "num_processes=2")),
    ],
)
def test_device_choices_that_are_refused(device, num_processes, gpus, words):
    with pytest.raises(ValueError) as caught:
        device_choice(device, num_processes, gpus)
    _assert_mentions(str(caught.value), *words)
