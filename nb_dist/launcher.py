"""``notebook_launcher``: run a function on N processes under torch.distributed from a cell."""

from __future__ import annotations

import ipaddress
import linecache
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _openmp, _warm, ports, preflight
from .errors import LaunchInterrupted, LaunchTimeoutError, UnsafeLaunchError, WorkerFailedError
from .output import DEFAULT_PREFIX, OUTPUT_MODES, RICH_OUTPUT_MODES, OutputRouter
from .precision import normalize_mixed_precision
from .result import LaunchResult
from .supervisor import AttemptConfig, Supervisor
from .tracebacks import cell_label

# How long workers may take to reach the rendezvous store (the store's client timeout).
_STORE_TIMEOUT = 300.0
# How long the first rank to reach init_process_group waits for the others before the launch
# is stopped with a report (torch itself would wait for minutes).
RENDEZVOUS_TIMEOUT = 20.0
_MULTI_NODE_RENDEZVOUS = 300.0


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    start_method: str = "fork",
    timeout: float | None = None,
    output: str = "all",
    init_process_group: bool = False,
    device: str = "auto",
    threads_per_process: int | None = None,
    hang_notice_after: float | None = 30.0,
    monitor: bool = False,
    rendezvous_timeout: float | str | None = "auto",
    warm_imports: bool = True,
    rich_output: str | int | Sequence[int] = "rank0",
) -> LaunchResult:
    """Run ``function(*args)`` on ``num_processes`` workers and return every rank's value.

    Call it from a notebook cell (or a script). Each worker gets the standard torch.distributed
    environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...),
    so ``torch.distributed.init_process_group()`` and ``accelerate.Accelerator()`` work inside
    the function unchanged. The backend is gloo on CPU and NCCL on GPUs (one GPU per rank).

    The first parameters match ``accelerate.notebook_launcher``; swap the import and the call
    works. Differences: ``use_port=None`` picks a free port for every launch, the values
    come back (``result[rank]``), output is labelled by rank, and failures name the rank
    that failed first.

    Args:
        function: the function every worker runs; defined in a cell is fine.
        args: positional arguments for ``function`` (a tuple or list).
        num_processes: workers on this machine. ``None``: one per visible GPU.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; reaches ``Accelerator()`` and
            :func:`nb_dist.mixed_precision` in the workers.
        use_port: rendezvous port; ``None`` picks a free one. Required with ``num_nodes > 1``.
        master_addr: address of node 0 (the machine whose kernel hosts the rendezvous).
        node_rank, num_nodes: this machine's index and the number of machines; run the same
            cell on every machine at about the same time.
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id: Accelerate's rendezvous options.
            ``"static"``, or ``"c10d"`` on one machine (the same ranks); ``rdzv_endpoint=
            "host:port"`` is read as ``master_addr``/``use_port``; ``rdzv_conf``'s
            ``"timeout"``/``"join_timeout"`` set ``rendezvous_timeout``, other keys are ignored
            with a notice.
        max_restarts: restart the whole group up to this many times after a failure.
        monitor_interval: seconds between checks of the workers' state.
        log_line_prefix_template: label for each output line, e.g. ``"[${rank}]: "``
            (default ``"[rank ${rank}] "``).
        start_method: ``"fork"`` (default: cell-defined functions just work), or ``"spawn"`` /
            ``"forkserver"`` (fresh processes; works even after CUDA was touched in the kernel;
            the function and args are shipped with cloudpickle).
        timeout: stop everything after this many seconds and raise
            :class:`~nb_dist.LaunchTimeoutError` showing where each rank was blocked.
        output: ``"all"`` ranks' output in the cell as it comes, ``"rank0"`` only,
            ``"grouped"`` (every rank's lines, rank by rank, when the launch ends: the same on
            every run, as notebooks checked by nbval need), or ``"none"``. Every rank's output
            is kept in ``result.logs`` either way.
        init_process_group: create the default process group in each worker before calling
            ``function`` (off by default, so code that creates it itself runs unchanged).
        device: ``"auto"`` (GPUs if any, else CPU), ``"cpu"`` or ``"cuda"``.
        threads_per_process: intra-op threads per worker. Default: cores / workers, unless
            ``OMP_NUM_THREADS`` is set. Safe with fork after the kernel ran multi-threaded
            torch work: the kernel's OpenMP pool is released before forking (see _openmp.py).
        hang_notice_after: when some ranks finished and another still runs this many seconds
            later, print where it is (a likely deadlock) and keep waiting. ``None``: never.
        rendezvous_timeout: once one rank reaches ``init_process_group``, how many seconds the
            others have to join before the launch is stopped with a report of who is missing
            and where every rank is (:class:`~nb_dist.RendezvousTimeoutError`). ``"auto"``:
            20 s on one machine, 300 s with ``num_nodes > 1`` (the other machines' cells may
            start later). ``None``: wait as long as torch does (30 minutes).
        warm_imports: after a fork launch, import in the kernel (in the background) the
            torch modules its workers had to import, so that later launches inherit them: a
            re-run DDP cell then starts in a fraction of a second instead of re-importing
            ``torch._dynamo`` in every worker. Costs the kernel the modules' memory (about
            70 MB for DDP). ``False`` or ``NB_DIST_WARM_IMPORTS=0`` turns it off.
        rich_output: whose ``display()`` output (HTML, images, matplotlib figures, updating
            displays such as a ``Trainer``'s progress table) is shown rich in the cell:
            ``"rank0"`` (default), ``"all"`` (each labelled), a rank or a list of ranks, or
            ``"none"``. Other ranks' displays, and every display in a plain script, print
            their text form, labelled; ``result.logs`` holds the text either way.
        monitor: show a live per-rank dashboard (status, time, progress bars from
            :func:`nb_dist.progress`, last output, curves of reported scalars) in the cell.
            Only in a Jupyter kernel; the labelled text output is printed either way.

    Returns:
        A :class:`~nb_dist.LaunchResult`: a list of the ranks' return values, with their
        outcomes, logs and timings as attributes.

    Raises:
        UnsafeLaunchError: the kernel's state would break the workers (nothing was started).
        TypeError, ValueError: an argument is wrong; the message names it and the fix.
        WorkerFailedError: a rank failed; the message starts with the root cause.
        LaunchTimeoutError: ``timeout`` passed; the message shows each rank's stack.
        KeyboardInterrupt: the kernel was interrupted; all workers were stopped.
    """
    __tracebackhide__ = True
    began = time.monotonic()
    preflight.check_not_nested()
    # Every fork below (probes, workers) waits for a background import to finish first.
    _warm.wait()
    preflight.check_function(function)
    call_args = preflight.check_args(args)
    mixed = normalize_mixed_precision(mixed_precision)
    method = preflight.check_choice("start_method", start_method, preflight.START_METHODS)
    output_mode = preflight.check_choice("output", output, OUTPUT_MODES)
    rich = _rich_output(rich_output)
    device = preflight.check_choice("device", device, preflight.DEVICES)
    num_nodes = preflight.check_positive_int(
        "num_nodes", num_nodes, "Use num_nodes=1 for a launch on this machine only."
    )
    node_rank = preflight.check_node_rank(node_rank, num_nodes)
    master_addr, port = _rendezvous_address(rdzv_endpoint, master_addr, use_port)
    _check_rdzv_backend(rdzv_backend, num_nodes)
    conf_timeout, notices = _read_rdzv_conf(rdzv_conf)
    warm_notice = _warm.take_notice()
    notices += [warm_notice] if warm_notice else []
    if conf_timeout is not None and rendezvous_timeout == "auto":
        rendezvous_timeout = conf_timeout
    if num_nodes > 1 and port is None:
        raise ValueError(
            f"use_port=None with num_nodes={num_nodes}: every machine must know the port in "
            "advance, so a multi-node launch needs an explicit port. Pass the same use_port "
            "(for example use_port=29500) on every node."
        )
    restarts = _non_negative_int("max_restarts", max_restarts)
    if restarts and num_nodes > 1:
        raise ValueError(
            f"max_restarts={restarts} with num_nodes={num_nodes}: restarts are coordinated on "
            "one machine only. Use max_restarts=0, or torchrun with an elastic rendezvous "
            "(--rdzv-backend=c10d --max-restarts=N) for fault-tolerant multi-node jobs."
        )
    poll = preflight.check_seconds("monitor_interval", monitor_interval) or 0.1
    timeout = preflight.check_seconds("timeout", timeout)
    if rendezvous_timeout == "auto":
        rendezvous_timeout = RENDEZVOUS_TIMEOUT if num_nodes == 1 else _MULTI_NODE_RENDEZVOUS
    rdzv_timeout = preflight.check_seconds("rendezvous_timeout", rendezvous_timeout)
    hang_after = preflight.check_seconds("hang_notice_after", hang_notice_after)
    if threads_per_process is not None:
        preflight.check_positive_int(
            "threads_per_process", threads_per_process, "Or leave it unset for cores / workers."
        )
    if not isinstance(warm_imports, bool):
        raise TypeError(f"warm_imports={warm_imports!r} must be True or False.")
    warm = method == "fork" and _warm.enabled(warm_imports)
    if not isinstance(init_process_group, bool):
        raise TypeError(f"init_process_group={init_process_group!r} must be True or False.")

    preflight.check_process_group()
    preflight.check_accelerate_state()

    cuda = preflight.probe_cuda() if device != "cpu" else preflight.CudaState(0, False, None)
    use_gpu = device == "cuda" or (device == "auto" and cuda.gpus > 0)
    if use_gpu and cuda.gpus == 0:
        raise ValueError(
            "device='cuda' but no GPU is visible to this kernel (check CUDA_VISIBLE_DEVICES "
            "and the driver). Use device='cpu' (or the default 'auto') to run on CPU."
        )
    if num_processes is None:
        if cuda.gpus == 0 or not use_gpu:
            raise ValueError(
                "num_processes=None means one process per GPU, and no GPU is in use here. "
                "Say how many CPU processes to start, e.g. num_processes=2."
            )
        num_processes = cuda.gpus
    nprocs = preflight.check_positive_int(
        "num_processes",
        num_processes,
        "For CPU training on a laptop, 2 to 4 is a good choice.",
    )
    if use_gpu and nprocs > cuda.gpus:
        raise ValueError(
            f"num_processes={nprocs} but only {cuda.gpus} GPU(s) are visible: each process "
            f"needs its own GPU. Use num_processes={cuda.gpus} or fewer, or device='cpu'."
        )
    if use_gpu and cuda.poisoned and method == "fork":
        raise preflight.cuda_poisoned_error(cuda)
    if method == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        method = "spawn"  # e.g. Windows: no fork; spawn ships the function with cloudpickle

    payload = _pickle_for_spawn(function, call_args) if method != "fork" else None
    threads = _threads(threads_per_process, nprocs)
    if method == "fork":
        threads, notice = _fork_safe_threads(threads, explicit=threads_per_process is not None)
        notices += [notice] if notice else []
    world_size = nprocs * num_nodes
    ranks = [node_rank * nprocs + local for local in range(nprocs)]
    prefix = log_line_prefix_template or DEFAULT_PREFIX

    if not isinstance(monitor, bool):
        raise TypeError(f"monitor={monitor!r} must be True or False.")
    live_view = _open_monitor(ranks) if monitor else None

    attempt = 0
    while True:
        router = OutputRouter(ranks, output_mode, prefix, rich=rich)
        router.observer = live_view
        for text in notices:
            router.notice(text)
        notices = []
        if method == "fork" and attempt:
            _warm.wait()  # a restart forks again: no half-imported module may be copied
            _openmp.release_pool()  # and the kernel may have an OpenMP pool again
        store = None
        error_dir = tempfile.mkdtemp(prefix="nb_dist_errors_")
        if node_rank == 0:
            store = ports.open_store(master_addr, port, world_size, _STORE_TIMEOUT)
            actual_port = store.port
        else:
            actual_port = port or 0
        try:
            envs = [
                _worker_env(
                    rank=rank,
                    local_rank=local,
                    nprocs=nprocs,
                    world_size=world_size,
                    node_rank=node_rank,
                    num_nodes=num_nodes,
                    master_addr=master_addr,
                    port=actual_port,
                    attempt=attempt,
                    max_restarts=restarts,
                    run_id=rdzv_id,
                    mixed=mixed,
                    threads=threads,
                    use_gpu=use_gpu,
                    force_cpu=device == "cpu",
                    error_file=_error_file(error_dir, rank),
                )
                for local, rank in enumerate(ranks)
            ]
            config = AttemptConfig(
                function=function,
                args=call_args,
                ranks=ranks,
                worker_env=envs,
                start_method=method,
                threads=threads,
                init_process_group=init_process_group,
                backend="nccl" if use_gpu else "gloo",
                use_gpu=use_gpu,
                router=router,
                timeout=timeout,
                hang_notice_after=hang_after,
                poll_interval=poll,
                rendezvous_timeout=rdzv_timeout,
                report_imports=warm,
                payload=payload,
                linecache_entries=_cell_sources() if payload is not None else {},
                observer=live_view,
            )
            supervisor = Supervisor(config)
            try:
                outcome = supervisor.run()
            finally:
                router.finish()
                if warm:
                    _warm.schedule(supervisor.imports)
                ports.started_worker_pids.update(w.pid for w in supervisor.workers if w.pid)
        except KeyboardInterrupt:
            if live_view is not None:
                live_view.close(interrupted=True)
            # A fresh exception without the context: the cell shows the user's call, not the
            # supervisor's select loop the interrupt happened to land in.
            raise _interrupted(nprocs) from None
        except (WorkerFailedError, LaunchTimeoutError) as failure:
            if live_view is not None:
                live_view.close(failure.outcomes)
            if attempt >= restarts or isinstance(failure, LaunchTimeoutError):
                raise
            attempt += 1
            router.notice(
                f"{failure.root_cause.describe()}; restarting all ranks "
                f"(restart {attempt} of {restarts})."
            )
            continue
        finally:
            if store is not None:
                ports.forget_store(store)
                store = None  # drops the last reference: the server stops, the port is free
            shutil.rmtree(error_dir, ignore_errors=True)
        if live_view is not None:
            live_view.close(outcome.outcomes)
        return LaunchResult(
            values=outcome.values,
            reports=outcome.reports,
            ranks=ranks,
            outcomes=outcome.outcomes,
            logs=[router.log_text(i) for i in range(nprocs)],
            durations=outcome.durations,
            wall_time=time.monotonic() - began,
            port=actual_port,
            start_method=method,
            restarts=attempt,
        )


def _check_rdzv_backend(backend: object, num_nodes: int) -> None:
    """``"static"`` always; ``"c10d"`` on one machine, where it gives the same ranks."""
    name = backend.lower() if isinstance(backend, str) else None
    if name == "static" or (name == "c10d" and num_nodes == 1):
        # On one machine a c10d rendezvous assigns the same ranks a static one does (one
        # agent, local ranks in order), so the kernel-hosted static store stands in for it.
        return
    if name == "c10d":
        raise ValueError(
            f"rdzv_backend='c10d' with num_nodes={num_nodes}: an elastic rendezvous across "
            "machines (nodes joining and leaving, ranks assigned on arrival) needs torchrun's "
            "agent on every machine, which a notebook launch does not have. Use "
            "rdzv_backend='static' with the same master_addr and use_port on every machine "
            "(each with its own node_rank), or run a script with torchrun --rdzv-backend=c10d."
        )
    raise ValueError(
        f"rdzv_backend={backend!r} is not supported. Use 'static' (the default) or, on one "
        "machine, 'c10d' (the same ranks); for other elastic rendezvous backends run a script "
        "with torchrun."
    )


# rdzv_conf keys that mean "how long to wait for the ranks to join" (torchrun's names).
_RDZV_TIMEOUT_KEYS = ("join_timeout", "timeout")


def _read_rdzv_conf(conf: object) -> tuple[float | None, list[str]]:
    """The rendezvous timeout an Accelerate-style ``rdzv_conf`` asks for, and notices."""
    if conf is None or conf == {}:
        return None, []
    if not isinstance(conf, dict):
        raise TypeError(
            f"rdzv_conf={conf!r} must be a dict, e.g. rdzv_conf={{'timeout': 60}}, or None."
        )
    timeout = None
    for key in _RDZV_TIMEOUT_KEYS:
        if key in conf:
            timeout = preflight.check_seconds(f"rdzv_conf[{key!r}]", conf[key])
            break
    ignored = sorted(str(k) for k in conf if k not in _RDZV_TIMEOUT_KEYS)
    notices = []
    if ignored:
        notices.append(
            f"rdzv_conf keys {', '.join(ignored)} configure torchrun's elastic agent and are "
            "ignored here; 'timeout'/'join_timeout' set rendezvous_timeout."
        )
    return timeout, notices


def _rich_output(value: object) -> str | frozenset[int]:
    if isinstance(value, str) and value.lower() in RICH_OUTPUT_MODES:
        return value.lower()
    ranks = [value] if isinstance(value, int) else value
    if (
        isinstance(ranks, (list, tuple, set, frozenset))
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        return frozenset(ranks)
    raise ValueError(
        f"rich_output={value!r} is not supported. Use 'rank0', 'all', 'none', a rank such as 1, "
        "or a list of ranks such as [0, 1]."
    )


def _interrupted(nprocs: int) -> KeyboardInterrupt:
    text = f"the launch was interrupted; all {nprocs} ranks were stopped"
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        return KeyboardInterrupt(text)
    return LaunchInterrupted(text) if get_ipython() is not None else KeyboardInterrupt(text)


def _rendezvous_address(
    endpoint: object,
    master_addr: object,
    use_port: object,
) -> tuple[str, int | None]:
    if not isinstance(master_addr, str) or not master_addr:
        raise TypeError(f"master_addr={master_addr!r} must be a host name or IP address string.")
    port = preflight.check_port(use_port)
    if endpoint:
        if not isinstance(endpoint, str) or ":" not in endpoint:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} must look like 'host:port', e.g. '10.0.0.1:29500'. "
                "Or pass master_addr and use_port instead."
            )
        host, _, endpoint_port = endpoint.rpartition(":")
        master_addr = host.strip("[]")
        try:
            port = preflight.check_port(endpoint_port)
        except ValueError:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} has no valid port after the ':'. Use 'host:port' "
                "with a port from 1024 to 65535, e.g. '10.0.0.1:29500'."
            ) from None
    return master_addr, port


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a whole number, 0 or more.")
    return value


def _threads(threads_per_process: int | None, nprocs: int) -> int | None:
    """Intra-op threads per worker so that N workers do not oversubscribe the cores."""
    if threads_per_process is not None:
        return threads_per_process
    user_value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user_value:
        # The user decided. Apply it in the worker too: a forked worker keeps the kernel's
        # torch thread pool, which ignores a variable set after torch was imported.
        return int(user_value) if user_value.isdigit() and int(user_value) > 0 else None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nprocs)


def _fork_safe_threads(threads: int | None, explicit: bool) -> tuple[int | None, str | None]:
    """Threads per forked worker that cannot hang on the kernel's OpenMP pool, and a notice.

    See nb_dist/_openmp.py: the pool is released before forking; where it cannot be, a
    throw-away child tells whether fork with threads would hang, and then the launch uses one
    thread (or refuses an explicit ``threads_per_process > 1``).
    """
    wanted = threads if threads is not None else _kernel_threads()
    if wanted <= 1:
        return threads, None
    release = _openmp.release_pool()
    if release.status in ("released", "idle", "absent"):
        return threads, _openmp.release_notice(release, wanted)
    if not _openmp.pool_breaks_fork(wanted):
        return threads, None
    if explicit:
        raise UnsafeLaunchError(_openmp.fork_unsafe_message(wanted, release))
    return 1, _openmp.single_thread_notice(wanted, release)


def _kernel_threads() -> int:
    """Threads a forked worker inherits when the launcher does not set them."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_interface() -> str | None:
    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _error_file(folder: str, rank: int) -> str:
    os.makedirs(os.path.join(folder, str(rank)), exist_ok=True)
    return os.path.join(folder, str(rank), "error.json")


def _worker_env(
    *,
    rank: int,
    local_rank: int,
    nprocs: int,
    world_size: int,
    node_rank: int,
    num_nodes: int,
    master_addr: str,
    port: int,
    attempt: int,
    max_restarts: int,
    run_id: str,
    mixed: str,
    threads: int | None,
    use_gpu: bool,
    force_cpu: bool,
    error_file: str | None = None,
) -> dict[str, str]:
    """The environment torchrun would give this rank, plus nb_dist's own hand-offs."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "ROLE_RANK": str(rank),
        # What torch's elastic_launch (and so accelerate.notebook_launcher) gives.
        "ROLE_NAME": "default_role",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        # The kernel hosts the store (see ports.py): every rank connects as a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": str(run_id),
        "ACCELERATE_MIXED_PRECISION": mixed,
        "NB_DIST_MIXED_PRECISION": mixed,
        # accelerate.notebook_launcher's own hand-offs, for code that reads them.
        "MIXED_PRECISION": mixed,
        "NPROC": str(nprocs),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    if error_file is not None:
        # Where torch's @record writes a failing rank's error (torchrun sets one per rank).
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if _is_loopback(master_addr) and not os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo otherwise resolves the host name to pick an interface, which fails on machines
        # without network or with an unresolvable host name.
        interface = _loopback_interface()
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    if not use_gpu:
        # Accelerate only picks MULTI_CPU (gloo, one process per rank) when told to use the
        # CPU; without it, Accelerator() in each worker would see a single-process run.
        env["ACCELERATE_USE_CPU"] = "true"
    if force_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _pickle_for_spawn(function: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Ship the function and args by value, so functions defined in a cell work with spawn."""
    import cloudpickle

    try:
        return cloudpickle.dumps((function, args))
    except Exception as exc:
        raise TypeError(
            f"start_method='spawn'/'forkserver' must send the function and args to fresh "
            f"processes, and this failed: {type(exc).__name__}: {exc}. Make the args picklable "
            "(no open files, locks or generators), create such objects inside the function, or "
            "use start_method='fork'."
        ) from exc


def _cell_sources() -> dict[str, Any]:
    """linecache entries of notebook cells, so spawned workers' tracebacks show the code."""
    return {name: entry for name, entry in linecache.cache.items() if cell_label(name)}


def _open_monitor(ranks: list[int]) -> Any:
    """Display the live monitor in the cell, where a frontend may render it; else nothing."""
    from .monitor import LaunchMonitor, kernel_frontend_possible

    if not kernel_frontend_possible():
        return None
    from IPython.display import display

    view = LaunchMonitor(ranks)
    display(view)
    return view
