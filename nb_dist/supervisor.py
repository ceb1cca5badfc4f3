"""The kernel side of one launch attempt: start the workers, watch them, stop them.

Everything here runs in the thread that called the launcher (the cell's thread), in one
``select`` loop: worker output is written by that thread, so it lands in the launching cell;
an interrupt arrives there as ``KeyboardInterrupt`` and tears the workers down; and every
worker is reaped and every pipe drained before control returns to the cell.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import re
import selectors
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from . import _diagnosis
from .errors import LaunchTimeoutError, RankOutcome, RendezvousTimeoutError, WorkerFailedError
from .output import LineSplitter, OutputRouter
from .reporting import Reports
from .tracebacks import blocked_place, format_frames, parse_fault_dump, relabel_cells
from .worker import WorkerChannels, WorkerSpec, forkserver_main, run_worker

# How long a stopped worker gets between SIGTERM and SIGKILL; keeps "stopped within 1 s".
STOP_GRACE = 0.4
# How long to keep reading a dead worker's pipes (a grandchild may hold them open).
DRAIN_AFTER_EXIT = 1.0
# A partial line (no newline yet) is shown after this long anyway.
PARTIAL_LINE_AFTER = 1.0

_CRASH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line \d+ in ')
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_COLLATERAL_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COLLATERAL_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "communicator was aborted",
    "NCCL error",
)


@dataclass
class AttemptConfig:
    """One attempt of a launch, fully resolved by the launcher."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    ranks: list[int]  # global rank of each local worker
    worker_env: list[dict[str, str]]
    start_method: str
    threads: int | None
    init_process_group: bool
    backend: str
    use_gpu: bool
    router: OutputRouter
    timeout: float | None
    hang_notice_after: float | None
    poll_interval: float
    rendezvous_timeout: float | None = None
    report_imports: bool = False
    payload: bytes | None = None
    linecache_entries: dict[str, Any] = field(default_factory=dict)
    observer: Any = None  # a live view (the launch monitor), see nb_dist/views/monitor.py


@dataclass
class AttemptResult:
    values: list[Any]
    reports: Reports
    outcomes: list[RankOutcome]
    durations: list[float | None]


class _Worker:
    """One running worker as the kernel sees it."""

    def __init__(self, local_rank: int, rank: int) -> None:
        self.local_rank = local_rank
        self.outcome = RankOutcome(rank=rank, local_rank=local_rank)
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.stack = bytearray()
        self.main_ident: int | None = None
        self.started_at = time.monotonic()
        self.value: Any = None
        self.has_value = False
        self.duration: float | None = None
        self.error: dict[str, Any] | None = None
        self.pid: int | None = None
        self.process: Any = None  # multiprocessing.Process for spawn/forkserver
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.control_closed_at: float | None = None
        self.stop_requested = False
        self.readers: list[Connection] = []
        self.finalized = False
        # The rendezvous as this rank reported it (see nb_dist/_rendezvous.py).
        self.rdzv_entered_at: float | None = None
        self.rdzv_done = False
        self.rdzv_world_size: int | None = None
        self.rdzv_endpoint: str | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None


class Supervisor:
    """Runs one attempt: ``run()`` returns per-rank values or raises a launch error."""

    def __init__(self, config: AttemptConfig) -> None:
        self.config = config
        self.router = config.router
        self.workers = [_Worker(i, r) for i, r in enumerate(config.ranks)]
        self._selector = selectors.DefaultSelector()
        self._lifeline_reader: Connection | None = None
        self._lifeline_writer: Connection | None = None
        self._gate_reader: Connection | None = None
        self._gate_writer: Connection | None = None
        self._first_finish: float | None = None
        self._hang_noticed: set[int] = set()
        self._failure_seen = False
        self._rdzv_first: float | None = None
        self._rdzv_complete = False
        self.reports = Reports()
        #: Modules the workers imported that the kernel lacks (see nb_dist/_warm.py).
        self.imports: set[str] = set()
        self.observer = config.observer

    # ----------------------------------------------------------------- public
    def run(self) -> AttemptResult:
        __tracebackhide__ = True
        try:
            self._start_all()
            timeout = self.config.timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._watch(deadline):
                raise self._timeout_error()
            self._drain_and_reap()
            return self._result()
        except BaseException:
            # Failure, timeout or interrupt: stop everything before the exception reaches the
            # cell, so the next launch starts from a clean kernel.
            self._stop_all()
            self._drain_and_reap()
            raise
        finally:
            self._kill_remaining()
            self._close()

    # ----------------------------------------------------------------- start
    def _start_all(self) -> None:
        self._lifeline_reader, self._lifeline_writer = multiprocessing.Pipe(duplex=False)
        self._gate_reader, self._gate_writer = multiprocessing.Pipe(duplex=False)
        context = None
        if self.config.start_method == "forkserver":
            context = multiprocessing.get_context("forkserver")
        for worker in self.workers:
            self._start(worker, context)
        # The kernel keeps only the lifeline's write end: its EOF tells workers the kernel died.
        self._lifeline_reader.close()
        # Open the start gate (EOF): ranks connect to the store only once all are forked, so
        # no fork copies a lock that the store's server thread holds (see worker._wait_for_gate).
        self._gate_writer.close()
        self._gate_reader.close()

    def _start(self, worker: _Worker, context: Any) -> None:
        cfg = self.config
        out_r, out_w = multiprocessing.Pipe(duplex=False)
        err_r, err_w = multiprocessing.Pipe(duplex=False)
        ctl_r, ctl_w = multiprocessing.Pipe(duplex=False)
        stk_r, stk_w = multiprocessing.Pipe(duplex=False)
        assert self._lifeline_reader is not None and self._lifeline_writer is not None
        assert self._gate_reader is not None and self._gate_writer is not None
        channels = WorkerChannels(
            stdout=out_w,
            stderr=err_w,
            control=ctl_w,
            stack=stk_w,
            lifeline=self._lifeline_reader,
            gate=self._gate_reader,
        )
        worker.readers = [out_r, err_r, ctl_r, stk_r]
        kernel_fds = [c.fileno() for w in self.workers for c in w.readers]
        kernel_fds += [self._lifeline_writer.fileno(), self._gate_writer.fileno()]
        spec = WorkerSpec(
            rank=worker.outcome.rank,
            local_rank=worker.local_rank,
            env=cfg.worker_env[worker.local_rank],
            threads=cfg.threads,
            init_process_group=cfg.init_process_group,
            backend=cfg.backend,
            use_gpu=cfg.use_gpu,
            parent_pid=os.getpid(),
            check_parent=cfg.start_method != "forkserver",
            function=cfg.function if cfg.payload is None else None,
            args=cfg.args if cfg.payload is None else (),
            payload=cfg.payload,
            linecache_entries=cfg.linecache_entries,
            sys_path=list(sys.path) if cfg.payload is not None else [],
            close_fds=kernel_fds,
            report_imports=cfg.report_imports,
        )
        if cfg.start_method == "fork":
            worker.pid = _fork(spec, channels)
        elif cfg.start_method == "spawn":
            worker.process = _spawn(spec, channels)
            worker.pid = worker.process.pid
        else:
            process = context.Process(
                target=forkserver_main,
                args=(spec, channels),
                name=f"nb_dist-rank{worker.outcome.rank}",
            )
            process.start()
            worker.process = process
            worker.pid = process.pid
        worker.outcome.pid = worker.pid
        worker.started_at = time.monotonic()
        for conn in (out_w, err_w, ctl_w, stk_w):
            conn.close()
        for kind, conn in zip(
            ("stdout", "stderr", "control", "stack"), worker.readers, strict=False
        ):
            self._selector.register(conn.fileno(), selectors.EVENT_READ, (worker, kind, conn))

    # ----------------------------------------------------------------- watch
    def _watch(self, deadline: float | None) -> bool:
        """Pump events until every worker has ended. Returns True if the deadline passed."""
        while not all(w.finalized for w in self.workers):
            now = time.monotonic()
            if deadline is not None and now >= deadline and any(w.alive for w in self.workers):
                return True
            wait = self.config.poll_interval
            if any(w.alive and w.control_closed_at is not None for w in self.workers):
                # Its pipes are closed, so it is exiting, and no event will wake the select:
                # reap it within milliseconds, not a whole poll interval (~0.1 s per launch).
                wait = min(wait, 0.002)
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - now))
            self._pump(wait)
            self._poll_processes()
            self._flush_stale_partials()
            self._check_failures()
            self._check_rendezvous()
            self._check_stragglers()
            if self.observer is not None:
                self.observer.tick()
        return False

    def _pump(self, wait: float) -> None:
        for key, _ in self._selector.select(timeout=wait):
            worker, kind, conn = key.data
            if kind == "control":
                self._read_control(worker, conn)
            else:
                self._read_stream(worker, kind, conn)

    def _read_stream(self, worker: _Worker, kind: str, conn: Connection) -> None:
        try:
            data = os.read(conn.fileno(), 65536)
        except OSError:
            data = b""
        if not data:
            self._unregister(conn)
            if kind in worker.splitters:
                self.router.lines(worker.local_rank, kind, worker.splitters[kind].flush())
            return
        if kind == "stack":
            worker.stack.extend(data)
        else:
            self.router.lines(worker.local_rank, kind, worker.splitters[kind].feed(data))

    def _read_control(self, worker: _Worker, conn: Connection) -> None:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self._unregister(conn)
            worker.control_closed_at = time.monotonic()
            return
        try:
            message = pickle.loads(data)
        except Exception as exc:
            self.router.notice(
                f"could not read a message from rank {worker.outcome.rank} "
                f"({type(exc).__name__}: {exc}); report plain data (numbers, tensors, lists, "
                "dicts) or objects of classes the kernel can import."
            )
            return
        tag = message[0]
        if tag == "reports":
            rank = worker.outcome.rank
            entries = [
                (name, self.reports.add(rank, name, step, when, value))
                for name, step, when, value in message[1]
            ]
            if self.observer is not None:
                self.observer.reports(worker.local_rank, entries)
        elif tag == "progress":
            if self.observer is not None:
                self.observer.progress(worker.local_rank, *message[1:])
        elif tag == "hello":
            worker.main_ident = message[2]
            worker.outcome.status = "running"
            if self.observer is not None:
                self.observer.started(worker.local_rank)
        elif tag == "returned":
            worker.outcome.returned_at = message[1]
        elif tag == "imports":
            self.imports.update(message[1])
        elif tag == "display":
            _, data, metadata, display_id, update = message
            self.router.display(worker.local_rank, data, metadata, display_id, update)
        elif tag == "clear_output":
            self.router.clear_output(worker.local_rank, message[1])
        elif tag == "rendezvous":
            _, stage, when, world_size, endpoint = message
            if stage == "enter":
                worker.rdzv_entered_at = when
                worker.rdzv_world_size = world_size
                worker.rdzv_endpoint = endpoint
                if self._rdzv_first is None:
                    self._rdzv_first = when
            else:
                worker.rdzv_done = True
        elif tag == "error":
            worker.error = message[1]
        elif tag == "result":
            worker.duration = message[1]
            try:
                data = _read_exactly(conn, message[2])
            except (EOFError, OSError):
                # The worker died while sending its value (e.g. the OOM killer): its exit
                # status tells the user what happened, not a bare EOFError from this loop.
                self._unregister(conn)
                worker.control_closed_at = time.monotonic()
                return
            try:
                worker.value = pickle.loads(data)
                worker.has_value = True
            except Exception as exc:
                worker.error = {
                    "exc_type": "UnpicklableResultError",
                    "message": (
                        f"the kernel could not unpickle the value returned by rank "
                        f"{worker.outcome.rank} ({type(exc).__name__}: {exc}). Return plain "
                        "data (numbers, lists, dicts, tensors) or objects of classes the kernel "
                        "can import."
                    ),
                    "traceback": "",
                    "failed_at": time.monotonic(),
                }

    def _unregister(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.fileno())

    def _poll_processes(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.pid is None:  # never started (the start of an earlier rank failed)
                worker.finalized = True
                worker.outcome.status = "stopped"
                continue
            if worker.alive:
                code = _poll_exit(worker)
                if code is not None:
                    worker.returncode = code
                    worker.exited_at = now
            if not worker.finalized and not worker.alive:
                control_done = worker.control_closed_at is not None
                if control_done or now - (worker.exited_at or now) > DRAIN_AFTER_EXIT:
                    self._finalize(worker)

    def _finalize(self, worker: _Worker) -> None:
        """Decide a finished worker's outcome (its control pipe is drained by now)."""
        worker.finalized = True
        out = worker.outcome
        out.duration = worker.duration
        code = worker.returncode
        if code is not None and code < 0:
            out.signal_name = _signal_name(-code)
        elif code is not None:
            out.exit_code = code
        if worker.error is not None:
            out.status = "failed"
            out.exc_type = worker.error["exc_type"]
            out.message = worker.error["message"]
            out.traceback = relabel_cells(worker.error["traceback"])
            out.failed_at = worker.error["failed_at"]
        elif worker.has_value and code == 0:
            out.status = "ok"
            if self._first_finish is None:
                self._first_finish = time.monotonic()
        elif worker.stop_requested:
            out.status = "stopped"
        else:
            out.status = "failed"
            out.failed_at = worker.control_closed_at or worker.exited_at
            if code is not None and code < 0:
                out.message = f"the process was killed by signal {out.signal_name}"
            elif code == 0:
                out.message = "the process ended without returning from the function (os._exit?)"
            else:
                out.message = f"the process exited with code {code} before returning"
        if self.observer is not None:
            self.observer.finished(worker.local_rank, out)

    def _flush_stale_partials(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            for kind, splitter in worker.splitters.items():
                since = splitter.pending_since
                if since is not None and now - since > PARTIAL_LINE_AFTER:
                    self.router.lines(worker.local_rank, kind, splitter.flush())

    def _check_failures(self) -> None:
        if self._failure_seen:
            return
        for worker in self.workers:
            failed_exit = not worker.alive and worker.returncode != 0 and not worker.stop_requested
            ended_badly = worker.finalized and worker.outcome.status == "failed"
            if worker.error is not None or failed_exit or ended_badly:
                self._failure_seen = True
                self._stop_all()
                return

    def _check_stragglers(self) -> None:
        limit = self.config.hang_notice_after
        if limit is None or self._first_finish is None:
            return
        waited = time.monotonic() - self._first_finish
        if waited < limit:
            return
        finished = [w.outcome.rank for w in self.workers if w.outcome.status == "ok"]
        for worker in self.workers:
            if worker.alive and worker.local_rank not in self._hang_noticed:
                self._hang_noticed.add(worker.local_rank)
                returned = worker.outcome.returned_at
                if returned is not None:
                    self.router.notice(
                        _TEARDOWN_HANG.format(
                            rank=worker.outcome.rank, ago=time.monotonic() - returned
                        )
                    )
                    continue
                frames = self._stacks([worker]).get(worker.local_rank, [])
                where = blocked_place(frames)
                self.router.notice(
                    f"rank {worker.outcome.rank} is still running {waited:.0f} s after rank(s) "
                    f"{', '.join(map(str, finished))} finished. It is at {where}:\n"
                    f"{format_frames(frames)}\n"
                    "If it waits in a collective (all_reduce, barrier, ...) that the finished "
                    "ranks skipped, this is a deadlock and it will never finish: interrupt the "
                    "kernel, make every rank call the same collectives, or pass timeout=... to "
                    "the launcher. Still waiting, since a rank may also legitimately work alone."
                )

    def _check_rendezvous(self) -> None:
        """Stop a rendezvous that has not completed ``rendezvous_timeout`` s after it began."""
        limit = self.config.rendezvous_timeout
        if limit is None or self._rdzv_first is None or self._rdzv_complete:
            return
        if self._failure_seen:
            return  # a rank failed: the failure report explains, not the rendezvous
        if all(w.rdzv_done for w in self.workers):
            self._rdzv_complete = True
            return
        if time.monotonic() - self._rdzv_first >= limit:
            raise self._rendezvous_error(limit)

    def _rendezvous_error(self, limit: float) -> RendezvousTimeoutError:
        live = [w for w in self.workers if w.alive]
        frames = self._stacks(live)
        self._stop_all()
        self._drain_and_reap()
        now = time.monotonic()
        views = []
        stacks: dict[int, str] = {}
        for worker in self.workers:
            out = worker.outcome
            if worker.local_rank in frames and worker.rdzv_entered_at is None:
                stacks[out.rank] = format_frames(frames[worker.local_rank])
            if worker in live and out.returned_at is None:
                state = "running"
            elif out.returned_at is not None or out.status == "ok":
                state = "returned"
            else:
                state = out.describe()
            views.append(
                _diagnosis.RendezvousView(
                    rank=out.rank,
                    waited=None if worker.rdzv_entered_at is None else now - worker.rdzv_entered_at,
                    done=worker.rdzv_done,
                    asked_world_size=worker.rdzv_world_size,
                    endpoint=worker.rdzv_endpoint,
                    state=state,
                    place=blocked_place(frames[worker.local_rank])
                    if worker.local_rank in frames
                    else None,
                )
            )
        text = _diagnosis.rendezvous_report(limit, len(self.workers), views)
        for rank, stack in stacks.items():
            text += f"\n\nStack of rank {rank} (most recent call last):\n{stack}"
        logs = [self.router.log_text(w.local_rank) for w in self.workers]
        outcomes = [w.outcome for w in self.workers]
        error = RendezvousTimeoutError(text, limit, stacks, outcomes, logs)
        error.reports = self.reports
        return error

    # ----------------------------------------------------------------- stacks
    def _stacks(self, workers: list[_Worker]) -> dict[int, list[tuple[str, int, str]]]:
        """Ask live workers for their Python stacks (SIGUSR1 → faulthandler) and parse them."""
        asked = []
        for worker in workers:
            # Only workers that said hello have faulthandler installed; SIGUSR1 would kill others.
            if worker.alive and worker.main_ident is not None and worker.pid is not None:
                worker.stack.clear()
                try:
                    os.kill(worker.pid, signal.SIGUSR1)
                    asked.append(worker)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 0.5
        quiet_since: float | None = None
        while asked and time.monotonic() < deadline:
            before = sum(len(w.stack) for w in asked)
            self._pump(0.02)
            after = sum(len(w.stack) for w in asked)
            if all(w.stack for w in asked):
                if after == before:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 0.05:
                        break
                else:
                    quiet_since = None
        stacks = {}
        for worker in asked:
            dump = worker.stack.decode("utf-8", "replace")
            stacks[worker.local_rank] = parse_fault_dump(dump, worker.main_ident)
            worker.outcome.stack = format_frames(stacks[worker.local_rank])
        return stacks

    # ----------------------------------------------------------------- stop
    def _stop_all(self) -> None:
        """SIGTERM every live worker's process group, then SIGKILL what is left after a grace."""
        live = [w for w in self.workers if w.alive and w.pid is not None]
        for worker in live:
            worker.stop_requested = True
            _signal_group(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and any(w.alive for w in live):
            self._pump(0.02)
            self._poll_processes()
        for worker in live:
            if worker.alive:
                _signal_group(worker.pid, signal.SIGKILL)

    def _drain_and_reap(self) -> None:
        deadline = time.monotonic() + DRAIN_AFTER_EXIT + STOP_GRACE
        while not all(w.finalized for w in self.workers):
            if time.monotonic() > deadline:
                for worker in self.workers:
                    if worker.alive and worker.pid is not None:
                        worker.stop_requested = True
                        _signal_group(worker.pid, signal.SIGKILL)
                        worker.returncode = _wait_exit(worker)
                        worker.exited_at = time.monotonic()
                    if not worker.finalized:
                        self._finalize(worker)
                break
            self._pump(0.02)
            self._poll_processes()
        for worker in self.workers:
            for kind, splitter in worker.splitters.items():
                self.router.lines(worker.local_rank, kind, splitter.flush())

    def _kill_remaining(self) -> None:
        """Last line of defence (e.g. a second interrupt during teardown): kill and reap."""
        for worker in self.workers:
            if worker.alive and worker.pid is not None:
                _signal_group(worker.pid, signal.SIGKILL)
                worker.returncode = _wait_exit(worker)

    def _close(self) -> None:
        for worker in self.workers:
            for conn in worker.readers:
                self._unregister(conn)
                conn.close()
        self._selector.close()
        if self._lifeline_writer is not None:
            self._lifeline_writer.close()
        if self._lifeline_reader is not None and not self._lifeline_reader.closed:
            self._lifeline_reader.close()
        for gate in (self._gate_writer, self._gate_reader):
            if gate is not None and not gate.closed:
                gate.close()

    # ----------------------------------------------------------------- results
    def _result(self) -> AttemptResult:
        outcomes = [w.outcome for w in self.workers]
        if all(o.status == "ok" for o in outcomes):
            return AttemptResult(
                values=[w.value for w in self.workers],
                reports=self.reports,
                outcomes=outcomes,
                durations=[w.duration for w in self.workers],
            )
        raise self._failure_error(outcomes)

    def _failure_error(self, outcomes: list[RankOutcome]) -> WorkerFailedError:
        failed = [o for o in outcomes if o.status == "failed"]
        real = [o for o in failed if not _looks_collateral(o)]
        candidates = real or failed or outcomes
        root = min(candidates, key=lambda o: (o.failed_at is None, o.failed_at or 0.0, o.rank))
        for outcome in failed:
            if outcome is not root and _looks_collateral(outcome):
                outcome.status = "collateral"
        logs = [self.router.log_text(w.local_rank) for w in self.workers]
        error = WorkerFailedError(
            _failure_message(root, outcomes, logs[root.local_rank]), root, outcomes, logs
        )
        error.reports = self.reports
        return error

    def _timeout_error(self) -> LaunchTimeoutError:
        live = [w for w in self.workers if w.alive]
        frames = self._stacks(live)
        self._stop_all()
        self._drain_and_reap()
        timeout = self.config.timeout or 0.0
        lines = [
            f"The launch did not finish within timeout={timeout:g} s, so all ranks were stopped."
        ]
        stacks: dict[int, str] = {}
        calls: list[str | None] = []
        teardown = False
        for worker in self.workers:
            rank = worker.outcome.rank
            if worker.outcome.returned_at is not None and worker in live:
                lines.append(
                    f"rank {rank} had returned from the function and was stuck in the native "
                    "teardown after it (see the note below)"
                )
                teardown = True
            elif worker.local_rank in frames:
                where = blocked_place(frames[worker.local_rank])
                calls.append(_diagnosis.distributed_call(frames[worker.local_rank]))
                lines.append(f"rank {rank} was blocked at {where}")
                stacks[rank] = format_frames(frames[worker.local_rank])
            elif worker in live:
                lines.append(f"rank {rank} was still starting")
            else:
                lines.append(worker.outcome.describe())
        for rank, text in stacks.items():
            lines.append(f"\nStack of rank {rank} (most recent call last):\n{text}")
        if calls:
            lines.append("\n" + _diagnosis.timeout_hint(calls))
        if teardown:
            lines.append(_TEARDOWN_NOTE)
        logs = [self.router.log_text(w.local_rank) for w in self.workers]
        outcomes = [w.outcome for w in self.workers]
        error = LaunchTimeoutError("\n".join(lines), timeout, stacks, outcomes, logs)
        error.reports = self.reports
        return error


_TEARDOWN_NOTE = (
    "A rank that returned from the function but does not exit is stuck in native teardown: "
    "destroying the process group or freeing C++ resources (a DistributedDataParallel model "
    "still alive while its group is destroyed can hang there). Delete DDP models "
    "(del model) before returning, and pass timeout=... to the launcher to bound the wait."
)
_TEARDOWN_HANG = (
    "rank {rank} returned from the function {ago:.0f} s ago but its process has not exited. "
    + _TEARDOWN_NOTE
)


# --------------------------------------------------------------------- helpers
def _fork(spec: WorkerSpec, channels: WorkerChannels) -> int:
    """Fork one worker. The child never returns from here."""
    # Block SIGINT across the fork: a KeyboardInterrupt raised in the child before it reaches
    # run_worker would unwind a copy of the kernel through the cell's code.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns that fork() from a multi-threaded process (every Jupyter
            # kernel) may deadlock in the child. The worker never uses the kernel's threads or
            # their locks: it replaces stdout/stderr with its own pipes before any output, never
            # touches ZMQ/iopub, and leaves through os._exit. That makes this fork safe.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*fork\(\)")
            pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if pid == 0:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            run_worker(spec, channels, forked=True)
        finally:
            os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    return pid


def _read_exactly(conn: Connection, size: int) -> bytearray:
    """Read ``size`` raw bytes from ``conn``'s pipe into one preallocated buffer.

    ``Connection.recv_bytes`` reads a large message in pipe-sized chunks, each allocated for
    the whole remaining size and copied into a growing buffer; this reads straight into place.
    """
    buffer = bytearray(size)
    with memoryview(buffer) as view:
        got = 0
        while got < size:
            count = os.readv(conn.fileno(), [view[got:]])
            if count == 0:
                raise EOFError(f"the pipe closed after {got} of {size} bytes")
            got += count
    return buffer


def _poll_exit(worker: _Worker) -> int | None:
    """Return the worker's exit code (negative: signal) if it ended; clean its process group."""
    try:
        info = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = None
        if worker.process is not None:  # forkserver: the server is the parent, ask it
            code = worker.process.exitcode
            if code is not None:
                _signal_group(worker.pid, signal.SIGKILL)
            return code
        return -signal.SIGKILL
    if info is None:
        return None
    # The zombie still reserves its pid and process group: kill leftover grandchildren
    # (DataLoader workers, subprocesses) before reaping, so nothing outlives the launch.
    _signal_group(worker.pid, signal.SIGKILL, group_only=True)
    return _wait_exit(worker)


def _wait_exit(worker: _Worker) -> int:
    process = worker.process
    if process is not None and not isinstance(process, subprocess.Popen):
        process.join(timeout=5)  # forkserver: only the server can reap; ask multiprocessing
        code = process.exitcode
        return code if code is not None else -signal.SIGKILL
    assert worker.pid is not None
    try:
        _, status = os.waitpid(worker.pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        code = -signal.SIGKILL
    if isinstance(process, subprocess.Popen):
        process.returncode = code  # reaped here; keep Popen from waiting on it again
    return code


def _spawn(spec: WorkerSpec, channels: WorkerChannels) -> subprocess.Popen[bytes]:
    """Start a fresh interpreter for one worker (no re-import of the caller's __main__)."""
    fds = {
        "stdout": channels.stdout.fileno(),
        "stderr": channels.stderr.fileno(),
        "control": channels.control.fileno(),
        "stack": channels.stack.fileno(),
        "lifeline": channels.lifeline.fileno(),
        "gate": channels.gate.fileno(),
    }
    env = dict(os.environ)
    env.update(spec.env)
    # The worker imports nb_dist before anything else; make sure it finds this copy.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-c", "from nb_dist.worker import spawn_main; spawn_main()"],
        stdin=subprocess.PIPE,
        stdout=fds["stdout"],
        stderr=fds["stderr"],
        pass_fds=tuple(fds.values()),
        env=env,
    )
    assert process.stdin is not None
    try:
        process.stdin.write(pickle.dumps((spec, fds), protocol=pickle.HIGHEST_PROTOCOL))
        process.stdin.close()
    except BrokenPipeError:
        pass  # the worker died at start; its exit code and stderr tell why
    return process


def _signal_group(pid: int | None, sig: int, group_only: bool = False) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    if not group_only:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _looks_collateral(outcome: RankOutcome) -> bool:
    """A failure that typically follows another rank's death, not a cause of its own."""
    kind = outcome.exc_type or ""
    text = outcome.message or ""
    return any(t in kind for t in _COLLATERAL_TYPES) or any(t in text for t in _COLLATERAL_TEXT)


def _last_output(log: str) -> list[str]:
    """The end of a dead rank's output; for a crash, faulthandler's report up to the user code.

    A forked worker's crash report continues below the user's frames with the launcher's and
    the inherited kernel's frames (dozens in Jupyter), which would push the "Fatal Python error"
    line and the user's frames out of a plain tail.
    """
    lines = log.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    if not starts:
        return lines[-15:]
    start = starts[-1]
    crash = []
    for line in lines[start:]:
        frame = _CRASH_FRAME.match(line)
        if frame and os.path.dirname(os.path.abspath(frame["file"])) == _PACKAGE_DIR:
            break  # the launcher's frames, then the kernel's inherited ones
        crash.append(relabel_cells(line))
    return lines[max(0, start - 5) : start] + crash[:40]


def _failure_message(root: RankOutcome, outcomes: list[RankOutcome], root_log: str) -> str:
    # "returned" counts ranks whose value had not arrived yet: they were tearing down.
    finished = [o.rank for o in outcomes if o is not root and (o.status == "ok" or o.returned_at)]
    skipped = _looks_collateral(root) and bool(finished)
    if skipped:
        # Lead with the diagnosis; the backend's raw text (gloo's "Connection closed by peer"
        # with its source path) follows as the detail it is.
        call = _diagnosis.distributed_call_in_traceback(root.traceback or "")
        head = _diagnosis.skipped_collective_head(root.rank, call, finished)
        head += f"\n\nThe error rank {root.rank} got: {root.exc_type}: {root.message}"
    elif root.exc_type:
        head = f"rank {root.rank} failed first: {root.exc_type}: {root.message}"
    else:
        head = f"rank {root.rank} failed first: {root.message}"
        if root.signal_name == "SIGKILL":
            head += " (sent by the kernel's out-of-memory killer, or by kill -9)"
        elif root.signal_name == "SIGSEGV":
            head += " (a crash in native code)"
    parts = [head]
    if root.traceback:
        parts.append(f"\nTraceback of rank {root.rank}:\n{root.traceback.rstrip()}")
    elif root_log.strip():
        tail = _last_output(root_log)
        parts.append(f"\nLast output of rank {root.rank}:\n" + "\n".join(tail))
    others = [o for o in outcomes if o is not root]
    if others:
        parts.append("\nThe other ranks:\n" + "\n".join(o.describe() for o in others))
    parts.append(
        "\nEvery rank's outcome is in this exception's .outcomes and its full output in .logs."
    )
    return "\n".join(parts)
