"""``notebook_launcher``: run a function on N processes under torch.distributed from a cell.

The function is the public signature and its documentation. What it does: plan the launch
(``_transport.prepare``: every argument checked, the transport of ``cluster=`` or this
machine's says where the ranks go, the shared rules finish the plan), run the attempts
through that transport, restarts included, then the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _leftovers, _prompts, _warm
from ._arguments import LaunchOptions
from ._errors import LaunchInterrupted, LaunchTimeoutError, WorkerFailedError
from ._observer import Observer, open_live_view
from ._output import OutputRouter
from ._plan import LaunchPlan
from ._result import LaunchResult
from ._supervisor import RunResult, Supervisor
from ._tracebacks import ipython_shell
from ._transport import Transport, open_supervised, prepare


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
    hang_notice_after: float | None = 10.0,
    monitor: bool = False,
    rendezvous_timeout: float | str | None = "auto",
    warm_imports: bool = True,
    rich_output: str | int | Sequence[int] = "rank0",
    debug: str | None = None,
    cluster: Transport | None = None,
) -> LaunchResult:
    """Run ``function(*args)`` on ``num_processes`` ranks and return every rank's value.

    Call it from a notebook cell (or a script). Each rank gets the standard torch.distributed
    environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...),
    so ``torch.distributed.init_process_group()`` and ``accelerate.Accelerator()`` work inside
    the function unchanged. The backend is gloo on CPU and NCCL on GPUs (one GPU per rank).

    The first parameters match ``accelerate.notebook_launcher``; swap the import and the call
    works. Differences: ``use_port=None`` picks a free port for every launch, the values
    come back (``result[rank]``), output is labelled by rank, and failures name the rank
    that failed first.

    Args:
        function: the function every rank runs; defined in a cell is fine.
        args: positional arguments for ``function`` (a tuple or list).
        num_processes: how many ranks: on this machine, or with ``cluster=`` on all its
            nodes. ``None``: one per visible GPU (on this machine).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; reaches ``Accelerator()`` and
            :func:`nb_dist.mixed_precision` in the ranks.
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
        monitor_interval: seconds between checks of the ranks' state.
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
        init_process_group: create the default process group in each rank before calling
            ``function`` (off by default, so code that creates it itself runs unchanged).
        device: ``"auto"`` (one GPU per rank if enough are visible; else CPU, with a notice
            when there are GPUs but fewer than ranks), ``"cpu"`` or ``"cuda"``.
        threads_per_process: intra-op threads per rank. Default: cores / ranks, unless
            ``OMP_NUM_THREADS`` is set. Safe with fork after the kernel ran multi-threaded
            torch work: the kernel's OpenMP pool is released before forking (see _openmp.py).
        hang_notice_after: when some ranks finished and another still runs this many seconds
            later, print which rank, for how long and where it is (its stack, or that it is
            stuck in native code after its function returned) and keep waiting; ■ still ends
            the launch. ``None``: never.
        rendezvous_timeout: once one rank reaches ``init_process_group``, how many seconds the
            others have to join before the launch is stopped with a report of who is missing
            and where every rank is (:class:`~nb_dist.RendezvousTimeoutError`). ``"auto"``:
            20 s on one machine, 120 s on a Ray cluster (``cluster=``: its node agents start
            every rank), 300 s with ``num_nodes > 1`` (the other machines' cells may start
            later). ``None``: wait as long as torch does (30 minutes).
        warm_imports: after a fork launch, import in the kernel (in the background) the
            torch modules its ranks had to import, so that later launches inherit them: a
            re-run DDP cell then starts in a fraction of a second instead of re-importing
            ``torch._dynamo`` in every rank. Costs the kernel the modules' memory (about
            70 MB for DDP). ``False`` or ``NB_DIST_WARM_IMPORTS=0`` turns it off.
        rich_output: whose ``display()`` output (HTML, images, matplotlib figures, updating
            displays such as a ``Trainer``'s progress table) is shown rich in the cell:
            ``"rank0"`` (default), ``"all"`` (each labelled), a rank or a list of ranks, or
            ``"none"``. Other ranks' displays, and every display in a plain script, print
            their text form, labelled; ``result.logs`` holds the text either way.
        debug: ``"postmortem"`` keeps the rank that failed first at its exception (the others
            are stopped): ``%debug`` in the next cell, or ``err.debug()`` on the
            :class:`~nb_dist.WorkerFailedError`, opens pdb inside that rank, its prompts
            answered in the notebook's input box; ``q`` ends it. The next launch releases a
            rank nobody debugged. ``nb_dist.breakpoint(rank)`` works without this option.
        monitor: show a live per-rank dashboard (status, time, progress bars from
            :func:`nb_dist.progress`, last output, curves of reported scalars) in the cell.
            Only in a Jupyter kernel; the labelled text output is printed either way.
        cluster: run the ranks on a cluster's machines instead of this one, e.g.
            ``nb_dist.RayCluster(address="auto", processes_per_node=4)``: the same output,
            values, errors, timeouts and interrupts; the function and its globals are
            shipped with cloudpickle (see the README's "More than one machine").

    Returns:
        A :class:`~nb_dist.LaunchResult`: a list of the ranks' return values, with their
        outcomes, logs and timings as attributes.

    Raises:
        UnsafeLaunchError: the kernel's state would break the ranks (nothing was started).
        TypeError, ValueError: an argument is wrong; the message names it and the fix.
        WorkerFailedError: a rank failed; the message starts with the root cause.
        LaunchTimeoutError: ``timeout`` passed; the message shows each rank's stack.
        KeyboardInterrupt: the kernel was interrupted; all ranks were stopped.
    """
    __tracebackhide__ = True
    began = time.monotonic()
    # The checks read the kernel's modules, threads and CUDA state: let a running warm import
    # finish first (every fork waits for one anyway: _warm's at-fork hook).
    _warm.wait()
    _prompts.release_all()  # a rank still kept for a post-mortem is let go
    _leftovers.stop_all()  # and live ranks whose Ranks object was dropped are stopped
    options = LaunchOptions(
        num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template, start_method=start_method,
        timeout=timeout, output=output, init_process_group=init_process_group, device=device,
        threads_per_process=threads_per_process, hang_notice_after=hang_notice_after,
        monitor=monitor, rendezvous_timeout=rendezvous_timeout, warm_imports=warm_imports,
        rich_output=rich_output, debug=debug,
    )  # fmt: skip
    transport, plan = prepare(function, args, options, cluster)
    live_view = open_live_view(list(plan.ranks)) if plan.monitor else None
    try:
        outcome, logs, port, restarts = _run_attempts(transport, plan, live_view)
    except KeyboardInterrupt:
        if live_view is not None:
            live_view.close(interrupted=True)
        transport.interrupted()
        # A fresh exception without the context: the cell shows the user's call, not the
        # supervisor's select loop the interrupt happened to land in.
        raise _interrupted(plan.nprocs) from None
    if live_view is not None:
        live_view.close(outcome.outcomes)
    return LaunchResult(
        values=outcome.values,
        reports=outcome.reports,
        ranks=list(plan.ranks),
        outcomes=outcome.outcomes,
        logs=logs,
        durations=outcome.durations,
        wall_time=time.monotonic() - began,
        port=port,
        start_method=plan.start_method,
        restarts=restarts,
    )


def _run_attempts(
    transport: Transport, plan: LaunchPlan, live_view: Observer | None
) -> tuple[RunResult, list[str], int, int]:
    """Attempts until one succeeds or the restarts run out: (result, logs, port, restarts)."""
    __tracebackhide__ = True
    attempt = 0
    while True:
        router = OutputRouter(list(plan.ranks), plan.output, plan.prefix, rich=plan.rich_output)
        router.observer = live_view
        for text in plan.notices if attempt == 0 else ():
            router.notice(text)
        try:
            outcome, port = _run_attempt(transport, plan, attempt, router, live_view)
        except (WorkerFailedError, LaunchTimeoutError) as failure:
            if live_view is not None:
                live_view.close(failure.outcomes)
            if attempt >= plan.max_restarts or isinstance(failure, LaunchTimeoutError):
                raise
            attempt += 1
            _prompts.release_all()  # a post-mortem is for the failure that ends the launch
            router.notice(
                f"{failure.root_cause.describe()}; restarting all ranks "
                f"(restart {attempt} of {plan.max_restarts})."
            )
            continue
        return outcome, [router.log_text(i) for i in range(plan.nprocs)], port, attempt


def _run_attempt(
    transport: Transport,
    plan: LaunchPlan,
    attempt: int,
    router: OutputRouter,
    live_view: Observer | None,
) -> tuple[RunResult, int]:
    """One attempt, wherever its ranks run: (its result, the rendezvous port)."""
    __tracebackhide__ = True
    supervisor, port = open_supervised(
        transport, plan, attempt,
        lambda envs, places, host: Supervisor(plan, envs, places, router, live_view, host),
    )  # fmt: skip
    try:
        return supervisor.run(), port  # run() closes the host
    finally:
        router.finish()
        if plan.warm_imports:  # what the ranks imported, for the next launch (fork only)
            _warm.schedule(supervisor.imports)


def _interrupted(nprocs: int) -> KeyboardInterrupt:
    text = f"the launch was interrupted; all {nprocs} ranks were stopped"
    return LaunchInterrupted(text) if ipython_shell() is not None else KeyboardInterrupt(text)
