"""A fault soak on a local 2-node Ray cluster, in one real Jupyter kernel.

The cluster is the one of ``bench/ray_cluster.py`` (``ray.cluster_utils.Cluster``: a head and
a worker node, one CPU each, in this machine). One ipykernel (jupyter_client, this
interpreter) runs ``import nb_dist`` and ``cluster = nb_dist.RayCluster(address,
placement="STRICT_SPREAD")``, then ``--rounds`` launches of 2 ranks (100; ``--quick`` 20),
each with one fault drawn by ``random.Random(--seed)``:

- ``clean``: a plain launch; its ``LaunchResult`` is the cell's value;
- ``raise``: rank 1 raises ``ValueError`` after ``init_process_group``, rank 0 waits in a
  barrier: ``WorkerFailedError`` starting ``rank 1 failed first: ValueError: ...``, its
  traceback once;
- ``sigkill``: rank 1 ``os.kill(os.getpid(), SIGKILL)`` after ``init_process_group``, rank 0
  in ``all_reduce``: rank 1 the root cause, with ``SIGKILL``;
- ``exit3``: rank 1 ``os._exit(3)``: rank 1 the root cause, ``exit code 3``;
- ``segfault``: rank 1 ``ctypes.string_at(0)``: rank 1 the root cause, ``SIGSEGV``;
- ``timeout``: ``timeout=8``, rank 0 in its second ``all_reduce``, rank 1 in
  ``time.sleep(600)``: ``LaunchTimeoutError`` naming both lines and ``all_reduce #2``;
- ``interrupt`` (■): ``km.interrupt_kernel()`` once both ranks wrote their file and rank 1 is
  inside ``all_reduce`` (its collective counter says so: a handshake, no sleep):
  ``KeyboardInterrupt: ... all 2 ranks were stopped``, the ranks gone, the 2 agents and the
  placement group kept, the kernel's SIGINT handler the one it had before;
- ``flood``: 20,000 lines from each rank: every labelled line in the cell exactly once (a
  wrong round also says how many lines each rank's ``result.logs`` holds);
- ``big``: 64 MB returned by every rank: every value whole;
- ``unpicklable``: rank 1 returns a lambda or a ``threading.Lock``: ``WorkerFailedError``,
  rank 1 the root cause, ``UnpicklableResultError``;
- ``keyboard``: rank 1 raises ``KeyboardInterrupt`` itself: ``WorkerFailedError``, rank 1 the
  root cause, ``KeyboardInterrupt`` (the kernel is not interrupted);
- ``grandchild``: each rank starts ``sleep 600`` (``subprocess.Popen``) and returns: the
  launch returns, and both ``sleep`` processes are gone within 5 s of the cell's end;
- ``badargs``: ``num_processes=0`` (``ValueError``) or ``args=5`` (``TypeError``), refused
  within 5 s, naming the argument;
- ``node_lost`` (about 1 round in 20, at least once in a run of 10 rounds or more): a third
  node is added from this process (``Cluster.add_node(num_cpus=1)``), 3 ranks are launched
  (one per node), the node is removed (``remove_node(allow_graceful=False)``) once the 3
  ranks announced themselves: ``WorkerFailedError`` starting ``rank K failed first:
  NodeLostError`` with K the rank on that node, its ranks gone, the agents and the group
  given back.

Every round must end within 60 s: from the send, or for ■ and the node loss from the press or
the removal (their handshake may wait for a cold start). A round past it is a HANG: the kernel
is interrupted (restarted if that does not end the cell within 30 s), and the soak goes on.
After every round a trivial launch must still work in the same kernel. Cells print their
values instead of ending with them, so IPython's output cache (``Out``) keeps none of them.

Leaks: the kernel's open fds, threads and RSS (psutil on its pid) are sampled after a warm-up
(3 trivial launches, one 64 MB return and one flood, so one-time growth such as allocator
pools is not read as a trend; one sample before it is kept too), then every 10 rounds, with
Ray's live NodeAgent actors and placement groups and the soak's processes (below). RSS is read
as found, then again after ``gc.collect()`` in the kernel (a value held by a reference cycle
until the next collection is not a leak); the trend is the least-squares slope per 100 rounds
and the first and last samples.

At the end the kernel runs ``cluster.close()``, then what is left is counted from this
process. Every process this soak started carries an environment marker
(``NB_DIST_SOAK``, inherited by Ray's daemons and workers, the agents, fork servers, ranks and
their children); each live one (not a zombie) other than this process and the kernel is
classified: Ray's own (``raylet``, GCS, Ray's agents, idle workers ``ray::IDLE``), a NodeAgent
(its Ray worker), a fork server (cmdline mentions ``forkserver``, parent does not), a rank (a
fork server's child, or cmdline with ``nb_dist._rank._entry``), multiprocessing's
``resource_tracker``, or other (``sleep``...); and whether it still lies below a raylet or
was orphaned (below neither a raylet nor this process). Left behind means: any NodeAgent
actor or placement group in Ray's tables, or any agent, fork server, rank, resource tracker
or other process, below the raylets or orphaned. Ray's idle workers and daemons are Ray's.

Run: ``python bench/ray_soak.py`` (``--quick``, ``--rounds N``, ``--seed S``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish, stats

NAME = "ray_soak"

KINDS = (
    "clean",
    "raise",
    "sigkill",
    "exit3",
    "segfault",
    "timeout",
    "interrupt",
    "flood",
    "big",
    "unpicklable",
    "keyboard",
    "grandchild",
    "badargs",
)
ALL_KINDS = (*KINDS, "node_lost")
BOUND = 60.0  # seconds a round's cell may take (from the send, or the press/removal)
HANDSHAKE_WITHIN = 120.0  # the ranks' files, a cold start included
FLOOD_LINES = 20_000
BIG_MB = 64
SAMPLE_EVERY = 10
MARKER = "NB_DIST_SOAK"

# The rank functions, defined in the kernel as a notebook cell defines them (in __main__,
# shipped by value with cloudpickle).
FUNCTIONS = r"""
def clean(x):
    import nb_dist
    return x * 10 + nb_dist.rank()

def raises(tag):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError(f"soak fault {tag}")
    dist.barrier()

def killed(tag):
    import os, signal
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} was here {tag}", flush=True)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))

def exits(tag):
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))

def crashes(tag):
    import ctypes
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        print("about to crash", flush=True)
        ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))

def stuck(tag):
    import time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)

def blocked(folder):
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(folder, f"rank{rank}.tmp"), "w") as file:
        file.write(f"{os.getpid()} {os.environ['NB_DIST_NODE_ID']} "
                   f"{os.environ['NB_DIST_COLLECTIVES']}")
    os.rename(os.path.join(folder, f"rank{rank}.tmp"), os.path.join(folder, f"rank{rank}"))
    if rank == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))

def flood(lines):
    import nb_dist
    rank = nb_dist.rank()
    for i in range(lines):
        print(f"flood {rank} {i}")
    return lines

def big(mb):
    import os, torch
    return torch.full((mb * 262144,), float(os.environ["RANK"]))

def unpicklable(what):
    import threading, nb_dist
    if nb_dist.rank() != 1:
        return 0
    return threading.Lock() if what == "lock" else (lambda: 1)

def interrupts(tag):
    import time, nb_dist
    if nb_dist.rank() == 1:
        raise KeyboardInterrupt(f"soak fault {tag}")
    time.sleep(60)

def grandchild(tag):
    import subprocess
    return subprocess.Popen(["sleep", "600"]).pid
"""


# ----------------------------------------------------------------------------- the kernel
@dataclass
class Cell:
    code: str
    msg_id: str
    sent: float
    stdout: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    result: str | None = None
    idle_at: float | None = None

    def record(self, msg: dict[str, Any]) -> None:
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            return
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content.get("name") == "stdout":
            self.stdout.append(content["text"])
        elif kind == "error":
            self.error = content
        elif kind == "execute_result":
            self.result = content["data"].get("text/plain")
        elif kind == "status" and content["execution_state"] == "idle":
            self.idle_at = time.monotonic()

    @property
    def out(self) -> str:
        return "".join(self.stdout)

    @property
    def printed(self) -> str:
        """The last line the cell printed (values are printed, never kept in ``Out``)."""
        lines = [line for line in self.out.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    @property
    def ename(self) -> str | None:
        return self.error["ename"] if self.error else None

    @property
    def evalue(self) -> str:
        return self.error["evalue"] if self.error else ""


class Kernel:
    """One ipykernel running this interpreter (the ``python3`` spec of its environment)."""

    def __init__(self, env: dict[str, str], setup: str) -> None:
        self.env, self.setup, self.restarts = env, setup, 0
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._set_up()

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def _set_up(self) -> None:
        cell = self.run(self.setup, 180)
        if cell.idle_at is None or cell.error is not None:
            raise RuntimeError(f"the kernel's setup failed: {cell.evalue or 'no idle'}")

    def send(self, code: str) -> Cell:
        msg_id = self.kc.execute(code, stop_on_error=False)
        return Cell(code=code, msg_id=msg_id, sent=time.monotonic())

    def pump(self, cell: Cell, until: float) -> bool:
        """Read iopub into ``cell`` until it is idle (True) or ``until`` passes (False)."""
        while cell.idle_at is None:
            left = until - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(queue.Empty):
                cell.record(self.kc.get_iopub_msg(timeout=min(left, 0.05)))
        with contextlib.suppress(queue.Empty):  # its reply (kept out of the shell queue)
            while True:
                reply = self.kc.get_shell_msg(timeout=0.5)
                if reply["parent_header"].get("msg_id") == cell.msg_id:
                    break
        return True

    def run(self, code: str, bound: float = BOUND) -> Cell:
        cell = self.send(code)
        self.pump(cell, cell.sent + bound)
        return cell

    def rescue(self, cell: Cell) -> str:
        """A cell past its bound: interrupt; restart the kernel when that does not end it."""
        self.km.interrupt_kernel()
        if self.pump(cell, time.monotonic() + 30):
            return "interrupted"
        self.restarts += 1
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._set_up()
        return "kernel restarted"

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


# ----------------------------------------------------------------------------- processes
def _marked(token: str) -> dict[int, Any]:
    """Every live process (not a zombie) started by this soak: {pid: psutil.Process}."""
    import psutil

    found = {}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER) == token:
                found[proc.pid] = proc
    return found


def _cmd(proc: Any) -> str:
    import psutil

    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return ""


def soak_processes(token: str, kernel_pid: int | None) -> dict[str, Any]:
    """This soak's processes by kind, below the raylets and orphaned (see the docstring)."""
    import psutil

    marked = _marked(token)
    me = os.getpid()
    raylets = set()
    for pid, proc in marked.items():
        with contextlib.suppress(psutil.Error):
            if proc.name() == "raylet":
                raylets.add(pid)
    kinds: dict[str, list[str]] = {}
    where = {"below_raylets": 0, "orphaned": 0, "kernel_children": 0}
    for pid, proc in marked.items():
        if pid in (me, kernel_pid):
            continue
        cmd = _cmd(proc)
        try:
            parent = proc.parent()
            ancestors = {a.pid for a in proc.parents()}
        except psutil.Error:
            continue
        parent_cmd = _cmd(parent) if parent is not None else ""
        if proc.name() in ("raylet", "gcs_server"):  # a raylet's cmdline names default_worker
            kind = "ray_daemon"
        elif "forkserver" in cmd:
            kind = "rank" if "forkserver" in parent_cmd else "fork_server"
        elif "nb_dist._rank._entry" in cmd:
            kind = "rank"
        elif "NodeAgent" in cmd:
            kind = "agent"
        elif "resource_tracker" in cmd:
            kind = "resource_tracker"
        elif cmd.startswith("ray::IDLE"):
            kind = "ray_idle_worker"
        elif cmd.startswith("ray::") or "default_worker.py" in cmd:
            kind = "ray_worker"
        elif "ray" in cmd or proc.name() in ("raylet", "gcs_server"):
            kind = "ray_daemon"
        else:
            kind = "other"
        kinds.setdefault(kind, []).append(f"{pid} {cmd[:80]}")
        if kernel_pid in ancestors:
            where["kernel_children"] += 1
        elif ancestors & raylets:
            where["below_raylets"] += 1
        elif me not in ancestors:
            where["orphaned"] += 1
    counts = {k: len(v) for k, v in sorted(kinds.items())}
    ours = ("agent", "fork_server", "rank", "resource_tracker", "other")
    return {
        "counts": counts,
        **where,
        "nb_dist_left": {k: kinds[k] for k in ours if k in kinds},
    }


def _gone(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still alive (not zombies) after up to ``within`` seconds."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _announced(folder: Path, count: int) -> dict[int, tuple[int, str, str]] | None:
    files = sorted(folder.glob("rank[0-9]*"))
    if len([f for f in files if not f.name.endswith(".tmp")]) < count:
        return None
    found = {}
    for f in files:
        if f.name.endswith(".tmp"):
            continue
        pid, node, counter = f.read_text().split()
        found[int(f.name[4:])] = (int(pid), node, counter)
    return found


# ----------------------------------------------------------------------------- the rounds
def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _failed_first(cell: Cell, rank: int, what: str) -> str | None:
    if cell.ename != "WorkerFailedError":
        return f"{cell.ename}: {_first_line(cell.evalue)}"
    line = _first_line(cell.evalue)
    if not line.startswith(f"rank {rank} failed first") or what not in line:
        return f"first line: {line}"
    return None


def launch(fn: str, args: str, extra: str = "", nprocs: int = 2) -> str:
    return (
        f"nb_dist.notebook_launcher({fn}, {args}, num_processes={nprocs}, cluster=cluster{extra})"
    )


class Soak:
    def __init__(self, ray: Any, cluster: Any, root: str, token: str, kernel: Kernel) -> None:
        self.ray, self.cluster, self.root, self.token = ray, cluster, root, token
        self.kernel = kernel
        self.failures: list[dict[str, Any]] = []  # trivial launches that failed, in full

    def tables(self) -> tuple[int, int]:
        from ray_cluster import ray_tables

        return ray_tables(self.ray)

    def folder(self, n: int) -> Path:
        path = Path(self.root) / "soak" / f"round{n}"
        path.mkdir(parents=True)
        return path

    # Each returns (cell, reason or None, the time the bound counts from).
    def round(self, n: int, kind: str, rng: random.Random) -> tuple[Cell, str | None, float]:
        k = self.kernel
        if kind == "clean":
            cell = k.run(f"print(repr({launch('clean', f'({n},)')}))")
            want = f"LaunchResult([{n * 10}, {n * 10 + 1}])"
            return cell, None if cell.printed == want else self._got(cell, want), cell.sent
        if kind == "raise":
            cell = k.run(launch("raises", f"({n},)"))
            bad = _failed_first(cell, 1, f"ValueError: soak fault {n}")
            if bad is None and cell.evalue.count("Traceback (most recent call last)") != 1:
                bad = f"traceback {cell.evalue.count('Traceback (most recent')} times"
            return cell, bad, cell.sent
        if kind in ("sigkill", "exit3", "segfault"):
            fn, what = {"sigkill": ("killed", "SIGKILL"), "exit3": ("exits", "code 3 "),
                        "segfault": ("crashes", "SIGSEGV")}[kind]  # fmt: skip
            cell = k.run(launch(fn, f"({n},)"))
            return cell, _failed_first(cell, 1, what), cell.sent
        if kind == "timeout":
            cell = k.run(launch("stuck", f"({n},)", ", timeout=8"))
            bad = None
            if cell.ename != "LaunchTimeoutError":
                bad = f"{cell.ename}: {_first_line(cell.evalue)}"
            else:
                needles = (
                    "rank 0 was blocked at `dist.all_reduce(torch.ones(1))`",
                    "rank 1 was blocked at `time.sleep(600)`",
                    "all_reduce #2",
                )
                for needle in needles:
                    if needle not in cell.evalue:
                        bad = f"missing {needle!r}: {cell.evalue[:300]}"
                        break
            return cell, bad, cell.sent
        if kind == "interrupt":
            return self._interrupt(n)
        if kind == "flood":
            code = (
                f"_r = {launch('flood', f'({FLOOD_LINES},)')}\n"
                "print('FLOODED', list(_r), [log.count('flood ') for log in _r.logs])\ndel _r"
            )
            cell = k.run(code)
            return cell, self._flood_check(cell), cell.sent
        if kind == "big":
            code = (
                f"_r = {launch('big', f'({BIG_MB},)', ', timeout=150')}\n"
                "print('BIG', [(v.numel(), bool((v == i).all())) for i, v in enumerate(_r)])\n"
                "del _r"
            )
            cell = k.run(code)
            numel = BIG_MB * 262144
            want = f"BIG [({numel}, True), ({numel}, True)]"
            bad = None if want in cell.out and cell.error is None else self._got(cell, want)
            return cell, bad, cell.sent
        if kind == "unpicklable":
            what = rng.choice(["lock", "lambda"])
            cell = k.run(launch("unpicklable", f"({what!r},)"))
            return cell, _failed_first(cell, 1, "UnpicklableResultError"), cell.sent
        if kind == "keyboard":
            cell = k.run(launch("interrupts", f"({n},)"))
            return cell, _failed_first(cell, 1, f"KeyboardInterrupt: soak fault {n}"), cell.sent
        if kind == "grandchild":
            cell = k.run(f"print(list({launch('grandchild', f'({n},)')}))")
            try:
                pids = [int(x) for x in cell.printed.strip("[]").split(",")]
            except (IndexError, ValueError):
                return cell, self._got(cell, "LaunchResult([pid, pid])"), cell.sent
            alive = _gone(pids, 5.0)
            return cell, f"grandchildren alive 5 s after: {alive}" if alive else None, cell.sent
        if kind == "badargs":
            arg, ename = rng.choice([("num_processes=0", "ValueError"), ("args=5", "TypeError")])
            if arg == "args=5":
                code = "nb_dist.notebook_launcher(clean, args=5, num_processes=2, cluster=cluster)"
            else:
                code = "nb_dist.notebook_launcher(clean, (1,), num_processes=0, cluster=cluster)"
            cell = k.run(code)
            bad = None
            if cell.ename != ename or arg not in cell.evalue:
                bad = f"{arg}: {cell.ename}: {_first_line(cell.evalue)}"
            elif cell.idle_at is not None and cell.idle_at - cell.sent > 5:
                bad = f"{arg}: refused after {cell.idle_at - cell.sent:.1f} s"
            return cell, bad, cell.sent
        if kind == "node_lost":
            return self._node_lost(n)
        raise AssertionError(kind)

    @staticmethod
    def _got(cell: Cell, want: str) -> str:
        if cell.error is not None:
            return f"{cell.ename}: {_first_line(cell.evalue)}"
        return f"want {want}, got {cell.out[-200:]!r}"

    @staticmethod
    def _flood_check(cell: Cell) -> str | None:
        if cell.error is not None:
            return f"{cell.ename}: {_first_line(cell.evalue)}"
        seen: dict[str, int] = {}
        for line in cell.out.splitlines():
            if line.startswith("[rank ") and " flood " in line:
                seen[line] = seen.get(line, 0) + 1
        want = {f"[rank {r}] flood {r} {i}" for r in (0, 1) for i in range(FLOOD_LINES)}
        lost, doubled = len(want - set(seen)), sum(c > 1 for c in seen.values())
        strange = len(set(seen) - want)
        end = f"FLOODED [{FLOOD_LINES}, {FLOOD_LINES}]" in cell.out
        if not (lost or doubled or strange or not end):
            return None
        where = []
        for r in (0, 1):
            gone = [i for i in range(FLOOD_LINES) if f"[rank {r}] flood {r} {i}" not in seen]
            if gone:
                tail = gone == list(range(gone[0], FLOOD_LINES))
                where.append(f"rank {r}: {len(gone)} from line {gone[0]}{' (its tail)' * tail}")
        logs = cell.printed.rpartition("] ")[2]  # the lines each rank's result.logs holds
        return (
            f"lines lost {lost} ({'; '.join(where)}), doubled {doubled}, unexpected {strange}, "
            f"value {end}, lines in result.logs {logs}"
        )

    def _handshake(self, cell: Cell, folder: Path, count: int) -> dict | None:
        """Read the cell's output until ``count`` ranks announced themselves (or it ended)."""
        until = time.monotonic() + HANDSHAKE_WITHIN
        while time.monotonic() < until:
            found = _announced(folder, count)
            if found is not None:
                return found
            if self.kernel.pump(cell, time.monotonic() + 0.05):
                return None  # it ended first
        return None

    def _interrupt(self, n: int) -> tuple[Cell, str | None, float]:
        from nb_dist._shared import _collectives

        folder = self.folder(n)
        cell = self.kernel.send(launch("blocked", f"({str(folder)!r},)"))
        found = self._handshake(cell, folder, 2)
        if found is None:
            return cell, f"no handshake: {self._got(cell, 'two files')}", cell.sent
        until = time.monotonic() + 10  # rank 1 waits in its all_reduce for rank 0
        while time.monotonic() < until:
            state = _collectives.read(found[1][2])
            if state is not None and state.current == "all_reduce":
                break
            self.kernel.pump(cell, time.monotonic() + 0.02)
        pressed = time.monotonic()
        self.kernel.km.interrupt_kernel()
        self.kernel.pump(cell, pressed + BOUND)
        if cell.idle_at is None:
            return cell, None, pressed
        bad = None
        if cell.ename != "KeyboardInterrupt" or "all 2 ranks were stopped" not in cell.evalue:
            bad = f"{cell.ename}: {_first_line(cell.evalue)}"
        elif alive := _gone([pid for pid, _, _ in found.values()], 20.0):
            bad = f"ranks alive 20 s after ■: {alive}"
        elif (kept := self.tables()) != (2, 1):
            bad = f"(agents, groups) after ■: {kept}, not (2, 1)"
        elif (
            same := self.kernel.run("print(signal.getsignal(signal.SIGINT) is _sigint)")
        ).printed != "True":
            bad = f"SIGINT's handler after ■ is not the one before: {same.printed or same.evalue}"
        return cell, bad, pressed

    def _node_lost(self, n: int) -> tuple[Cell, str | None, float]:
        doomed = self.cluster.add_node(num_cpus=1, object_store_memory=600 * 2**20)
        self.cluster.wait_for_nodes()
        folder = self.folder(n)
        cell = self.kernel.send(launch("blocked", f"({str(folder)!r},)", ", timeout=300", 3))
        found = self._handshake(cell, folder, 3)
        if found is None:
            with contextlib.suppress(Exception):
                self.cluster.remove_node(doomed, allow_graceful=False)
            return cell, f"no handshake: {self._got(cell, 'three files')}", cell.sent
        removed = time.monotonic()
        self.cluster.remove_node(doomed, allow_graceful=False)
        self.kernel.pump(cell, removed + BOUND)
        if cell.idle_at is None:
            return cell, None, removed
        lost = [rank for rank, (_, node, _) in found.items() if node == doomed.node_id]
        bad = None
        if len(lost) != 1:
            bad = f"ranks on the removed node: {lost}"
        else:
            bad = _failed_first(cell, lost[0], "NodeLostError")
            if bad is None and f"Ray node {doomed.node_id[:8]}" not in cell.evalue:
                bad = f"the node is not named: {_first_line(cell.evalue)}"
        if bad is None and (alive := _gone([pid for pid, _, _ in found.values()], 30.0)):
            bad = f"ranks alive 30 s after the loss: {alive}"
        if bad is None:
            until = time.monotonic() + 30
            while (left := self.tables()) != (0, 0) and time.monotonic() < until:
                time.sleep(0.2)
            if left != (0, 0):
                bad = f"(agents, groups) 30 s after the loss: {left}, not given back"
        return cell, bad, removed

    def trivial(self, n: int) -> str | None:
        """A trivial launch in the same kernel; a failure's whole text is kept (``failures``)."""
        code = launch("clean", "(7,)", ', output="none"')
        cell = self.kernel.run(f"print(repr({code}))")
        if cell.idle_at is None:
            self.kernel.rescue(cell)
            bad = "the trivial launch hung"
        elif cell.printed != "LaunchResult([70, 71])":
            bad = self._got(cell, "LaunchResult([70, 71])")
        else:
            return None
        text = f"{cell.ename}: {cell.evalue}\n--- stdout ---\n{cell.out[-2000:]}"
        self.failures.append({"after_round": n, "text": text[:6000]})
        return bad

    def sample(self, n: int) -> dict[str, Any]:
        import psutil

        proc = psutil.Process(self.kernel.pid)
        agents, groups = self.tables()
        left = soak_processes(self.token, self.kernel.pid)
        fds, threads, rss = proc.num_fds(), proc.num_threads(), proc.memory_info().rss
        self.kernel.run("import gc\n_n = gc.collect()")
        return {
            "round": n,
            "fds": fds,
            "threads": threads,
            "rss_mb": round(rss / 2**20, 1),
            "rss_gc_mb": round(proc.memory_info().rss / 2**20, 1),
            "agents": agents,
            "groups": groups,
            "processes": left["counts"],
            "orphaned": left["orphaned"],
            "kernel_pid": self.kernel.pid,
        }


def schedule(rounds: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    kinds = ["node_lost" if rng.random() < 0.05 else rng.choice(KINDS) for _ in range(rounds)]
    if rounds >= 10 and "node_lost" not in kinds:
        kinds[rng.randrange(rounds // 2, rounds)] = "node_lost"
    return kinds


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return None if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def trend(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in ("fds", "threads", "rss_mb", "rss_gc_mb"):
        xs = [float(s["round"]) for s in samples]
        ys = [float(s[key]) for s in samples]
        slope = _slope(xs, ys)
        half = [(x, y) for x, y in zip(xs, ys, strict=True) if x >= xs[-1] / 2]
        later = _slope([x for x, _ in half], [y for _, y in half])
        out[key] = {
            "first": ys[0] if ys else None,
            "last": ys[-1] if ys else None,
            "max_deviation": max((abs(y - ys[0]) for y in ys), default=None),
            "slope_per_100_rounds": None if slope is None else round(slope * 100, 2),
            # the second half alone: a step early on (allocator pools) against steady growth
            "slope_second_half_per_100_rounds": None if later is None else round(later * 100, 2),
        }
    return out


def measure(rounds: int, seed: int, every: int = SAMPLE_EVERY) -> dict[str, Any]:
    from ray_cluster import start_cluster

    began, began_wall = time.monotonic(), time.time()
    token = f"{os.getpid()}-{time.time_ns()}"
    os.environ[MARKER] = token  # inherited by every process the soak starts
    ray, cluster, root = start_cluster()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    setup = (
        "import signal\n_sigint = signal.getsignal(signal.SIGINT)\n"
        f"import nb_dist\ncluster = nb_dist.RayCluster({cluster.address!r}, "
        f'placement="STRICT_SPREAD")\n' + FUNCTIONS
    )
    kernel = None
    per_kind: dict[str, dict[str, Any]] = {
        k: {"n": 0, "ok": 0, "hang": 0, "wrong": 0, "after_failed": 0, "first_wrong": None,
            "seconds": []}
        for k in ALL_KINDS
    }  # fmt: skip
    log: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    kinds = schedule(rounds, seed)
    rng = random.Random(seed + 1)
    try:
        kernel = Kernel(env, setup)
        soak = Soak(ray, cluster, root, token, kernel)
        soak.trivial(0)
        before_warmup = soak.sample(0)
        for _ in range(2):  # the agents up and warm before the first sample
            soak.trivial(0)
        if len(soak.failures) == 3:
            raise RuntimeError(f"every warm-up launch failed: {soak.failures}")
        warmup = {}
        for kind in ("big", "flood"):  # one-time growth (pools, buffers) before the start
            cell, bad, _ = soak.round(0, kind, rng)
            if cell.idle_at is None:
                bad = f"no end within {BOUND:g} s ({kernel.rescue(cell)})"
            warmup[kind] = bad or "ok"
        samples.append(soak.sample(0))
        for n, kind in enumerate(kinds, start=1):
            cell, bad, since = soak.round(n, kind, rng)
            row = per_kind[kind]
            row["n"] += 1
            status = "ok"
            if cell.idle_at is None:
                how = kernel.rescue(cell)
                status, bad = "hang", f"no end within {BOUND:g} s ({how})"
                row["hang"] += 1
            elif bad is not None:
                status = "wrong"
                row["wrong"] += 1
            else:
                row["ok"] += 1
            took = (cell.idle_at or time.monotonic()) - since
            row["seconds"].append(round(took, 3))
            if bad is not None and row["first_wrong"] is None:
                row["first_wrong"] = f"round {n}: {bad}"[:400]
            after = soak.trivial(n)
            if after is not None:
                row["after_failed"] += 1
                row["first_wrong"] = row["first_wrong"] or f"round {n}, after: {after}"[:400]
            log.append({"round": n, "kind": kind, "status": status, "seconds": round(took, 3),
                        "after_ok": after is None, "why": bad and bad[:200]})  # fmt: skip
            note = ("" if after is None else f" AFTER: {after[:100]}") + (
                "" if bad is None else f" {bad[:160]}"
            )
            print(f"round {n:3d} {kind:11s} {status:5s} {took:6.2f} s{note}", file=sys.stderr,
                  flush=True)  # fmt: skip
            if n % every == 0 or n == len(kinds):
                samples.append(soak.sample(n))
        closed = kernel.run("cluster.close()")
        close_error = closed.evalue if closed.error or closed.idle_at is None else None
        until = time.monotonic() + 30  # Ray takes a moment to mark actors dead
        while soak.tables() != (0, 0) and time.monotonic() < until:
            time.sleep(0.2)
        time.sleep(3.0)  # the agents' workers and their fork servers exit
        agents, groups = soak.tables()
        procs = soak_processes(token, kernel.pid)
        leftovers = {"agents": agents, "groups": groups, "close_error": close_error, **procs}
        restarts = kernel.restarts
        failures = soak.failures
    finally:
        if kernel is not None:
            kernel.shutdown()
        ray.shutdown()
        cluster.shutdown()
    time.sleep(5.0)
    after_shutdown = soak_processes(token, None)
    for row in per_kind.values():
        row["stats"] = stats(row.pop("seconds"))
    return {
        "rounds": rounds,
        "seed": seed,
        "bound_s": BOUND,
        "per_kind": per_kind,
        "log": log,
        "samples": samples,
        "before_warmup": before_warmup,
        "warmup_rounds": warmup,
        "trend": trend(samples),
        "leftovers": leftovers,
        "after_cluster_shutdown": after_shutdown["counts"],
        "kernel_restarts": restarts,
        "trivial_failures": failures,
        "total_s": round(time.monotonic() - began, 1),
        # The tree is shared: nb_dist's files edited while the soak ran (then it measured a mix).
        "nb_dist_changed_during_run": sorted(
            str(path.relative_to(ROOT))
            for path in (ROOT / "nb_dist").rglob("*.py")
            if path.stat().st_mtime > began_wall
        ),
    }


# ----------------------------------------------------------------------------- the report
def _left_count(left: dict[str, Any]) -> int:
    nb = sum(len(v) for v in left.get("nb_dist_left", {}).values())
    return left["agents"] + left["groups"] + nb


def _num(value: float | None, spec: str = "g") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(data: dict) -> str:
    lines = [
        f"| fault ({data['rounds']} rounds, seed {data['seed']}) | n | as documented | hangs "
        "| wrong | trivial launch after failed | p95 s | max s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, row in data["per_kind"].items():
        if not row["n"]:
            continue
        st = row["stats"]
        lines.append(
            f"| {kind} | {row['n']} | {row['ok']} | {row['hang']} | {row['wrong']} "
            f"| {row['after_failed']} | {st['p95']:.2f} | {st['max']:.2f} |"
        )
    wrongs = [f"{k}: {r['first_wrong']}" for k, r in data["per_kind"].items() if r["first_wrong"]]
    t, left = data["trend"], data["leftovers"]
    lines += [
        "",
        "Kernel over the soak (first -> last sample; slope per 100 rounds): "
        + "; ".join(
            f"{k} {_num(t[k]['first'])} -> {_num(t[k]['last'])} "
            f"({_num(t[k]['slope_per_100_rounds'], '+g')}; second half "
            f"{_num(t[k]['slope_second_half_per_100_rounds'], '+g')}; max deviation "
            f"{_num(t[k]['max_deviation'])})"
            for k in ("fds", "threads", "rss_mb", "rss_gc_mb")
        )
        + f". Kernel restarts: {data['kernel_restarts']}. Warm-up rounds (not counted "
        f"above): {data['warmup_rounds']}.",
        f"Left after cluster.close(): {left['agents']} NodeAgent actors, {left['groups']} "
        f"placement groups; processes {left['counts']} ({left['below_raylets']} below the "
        f"raylets, {left['orphaned']} orphaned); nb_dist's: {left['nb_dist_left'] or 'none'}. "
        f"Total {data['total_s']:.0f} s. nb_dist files edited during the run: "
        f"{data['nb_dist_changed_during_run'] or 'none'}.",
    ]
    if wrongs:
        lines += ["", "First wrong ending per fault:", *(f"- {w}" for w in wrongs)]
    return "\n".join(lines)


def targets(data: dict) -> list[dict]:
    rows = data["per_kind"].values()
    n = sum(r["n"] for r in rows)
    ok = sum(r["ok"] for r in rows)
    hangs = sum(r["hang"] for r in rows)
    after = sum(r["after_failed"] for r in rows)
    warmup = sum(f["after_round"] == 0 for f in data.get("trivial_failures", []))
    bad_kinds = sorted(k for k, r in data["per_kind"].items() if r["ok"] < r["n"])
    t, left = data["trend"], data["leftovers"]
    fds, threads = (
        t["fds"]["last"] - t["fds"]["first"],
        t["threads"]["last"] - t["threads"]["first"],
    )
    rss = t["rss_gc_mb"]["slope_per_100_rounds"] or 0.0
    return [
        {"name": "Ray soak: every round ends as documented", "target": f"{n}/{n}",
         "measured": f"{ok}/{n}" + (f" (not: {', '.join(bad_kinds)})" if bad_kinds else ""),
         "met": ok == n},
        {"name": "Ray soak: no round hangs", "target": f"0 past {data['bound_s']:g} s",
         "measured": f"{hangs}", "met": hangs == 0},
        {"name": "Ray soak: a trivial launch works after every round (and the 3 warm-ups)",
         "target": "0 failed", "measured": f"{after} failed (+{warmup} of the warm-ups)",
         "met": after + warmup == 0},
        {"name": "Ray soak: nothing left after cluster.close()",
         "target": "0 agents, groups, fork servers, ranks, others (below raylets or orphaned)",
         "measured": f"{_left_count(left)} ({left['nb_dist_left'] or 'none'}; agents "
                     f"{left['agents']}, groups {left['groups']})",
         "met": _left_count(left) == 0},
        {"name": "Ray soak: no leak in the kernel",
         "target": "fds and threads: last sample within +-5 of the first; RSS (after "
                   "gc.collect()) slope < 50 MB per 100 rounds",
         "measured": f"fds {fds:+g}, threads {threads:+g}, RSS {rss:+.1f} MB/100 rounds "
                     f"(second half {_num(t['rss_gc_mb']['slope_second_half_per_100_rounds'])})",
         "met": abs(fds) <= 5 and abs(threads) <= 5 and rss < 50},
    ]  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    kinds = list(ALL_KINDS)
    colors = {"ok": "tab:green", "wrong": "tab:orange", "hang": "tab:red"}
    for status, color in colors.items():
        rows = [r for r in data["log"] if r["status"] == status]
        top.scatter([r["round"] for r in rows], [kinds.index(r["kind"]) for r in rows],
                    c=color, s=14, label=status)  # fmt: skip
    top.set_yticks(range(len(kinds)), kinds, fontsize=6)
    top.legend(fontsize=7, loc="upper right")
    top.set_title("nb_dist fault soak, local 2-node Ray cluster, one kernel")
    xs = [s["round"] for s in data["samples"]]
    mid.plot(xs, [s["fds"] for s in data["samples"]], marker="o", label="open fds")
    mid.plot(xs, [s["threads"] for s in data["samples"]], marker="o", label="threads")
    mid.legend(fontsize=7)
    mid.set_ylabel("kernel")
    low.plot(xs, [s["rss_mb"] for s in data["samples"]], marker="o", label="as found")
    low.plot(xs, [s["rss_gc_mb"] for s in data["samples"]], marker="o", label="after gc.collect()")
    low.legend(fontsize=7)
    low.set_ylabel("kernel RSS (MB)")
    low.set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, default=SAMPLE_EVERY, help="rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (20 if args.quick else 100)
    data = measure(rounds, args.seed, args.sample_every)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
