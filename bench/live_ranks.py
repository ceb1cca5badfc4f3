"""Live ranks: session start, the cost of one cell, and a DDP walkthrough one step per cell.

``nb_dist.Ranks(num_processes=N)`` forks N ranks that keep their gloo process group (and
their namespaces) between cells; ``ranks.exec(source)`` is what a ``%%ranks`` cell runs,
``ranks.run(fn)`` ships a function. Measured, in one run, on the machine it runs on:

1. **Session start**: the wall time of ``Ranks(N)`` (until the constructor returns: every rank
   forked and ``init_process_group("gloo")`` done on each), N = 2 and 4 in interleaved rounds
   (one discarded warm-up each), then ``close()`` timed apart. In a plain Python process with
   torch imported first, and again inside a real ipykernel (``_common.run_in_kernel``: the
   cell imports this file and runs the same loop).
2. **Round trip of a cell** on 2 ranks: ``ranks.exec("")`` (the code of an empty ``%%ranks``
   cell) and ``ranks.run(noop)``, alternated call by call, after 20 discarded calls; p50 and
   p90. In the kernel also the magic itself (``get_ipython().run_cell_magic("ranks", "",
   "pass")``: IPython's cell transform and compile cache on top of ``exec``; IPython refuses a
   cell magic with an empty body, so a bare ``%%ranks`` cell is a UsageError and the body here
   is ``pass``), and what a notebook client sees: execute request to execute reply, through
   jupyter_client, of a ``%%ranks`` cell ``pass`` against a plain cell ``pass`` (the kernel's
   own floor), alternated.
3. **ipyparallel** alongside, when it is installed: ``ipp.Cluster(n=N).start_and_connect_sync()``
   (N = 2, 4, interleaved), then, to reach the state a ``Ranks`` session starts in, each
   engine's ``import torch`` and gloo ``init_process_group`` (timed apart), then
   ``stop_cluster_sync()``; round trips on 2 engines: ``view.apply_sync(noop)`` and
   ``view.execute("")`` (what an empty ``%%px`` cell sends), alternated. Its engines are fresh
   interpreters (it cannot fork the kernel); nb_dist's ranks are forks of a process that has
   torch. If it is missing or cannot start, the JSON and the report say why.
4. **A DDP walkthrough, one training step per cell**: MLP 32-64-10, gloo, 2 ranks, SGD with
   momentum, seed 0, a per-rank per-step batch. (a) a session: ``Ranks(2)``, one cell that
   builds the DDP model and optimizer, 10 cells of one step each, ``close()``; (b) the same 10
   steps as 10 ``nb_dist.notebook_launcher`` launches, each building the model, loading the
   previous model and optimizer state from a temp file (rank 0 saves it after its step), one
   step, saving. Both totals include everything from the first call to the last return; rank
   0's 10 losses are compared between (a) and (b), which must be equal. Each (a)/(b) run is in
   a fresh interpreter (so neither inherits the other's imports), in rotated rounds.

Parts 1-2 (plain), 1-2 (ipykernel), 3 and 4 each run in fresh interpreters, one after another.
Every number is a wall-clock time on a shared machine: compare rows of one run.

Run: ``python bench/live_ranks.py`` (about 3 minutes on 2 cores; ``--quick`` about 1 minute).
Writes ``bench/results/live_ranks.json`` and ``live_ranks.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCH, JSON_MARK, RESULTS, ROOT, publish, run_in_kernel, stats

NAME = "live_ranks"
SIZES = (2, 4)
TARGET_START_S = 0.15
TARGET_P50_MS = 3.0
WALK_STEPS = 10
PART_LIMIT = 420.0


# --------------------------------------------------------------------------- small helpers
def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q% at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency(samples: list[float]) -> dict[str, float | int]:
    """p50, p90, p99, min, max and n of round trips, in milliseconds."""
    if not samples:
        return {"n": 0}
    ms = [s * 1e3 for s in samples]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "min": min(ms),
        "max": max(ms),
        "n": len(ms),
    }


def noop() -> None:
    """The function a trivial round trip runs."""


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), str(BENCH), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def run_part(part: str, args: list[str]) -> Any:
    """``python live_ranks.py --part PART ...`` in a fresh interpreter; the JSON it prints."""
    cmd = [sys.executable, __file__, "--part", part, *args]
    run = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(), timeout=PART_LIMIT, cwd=ROOT
    )
    sys.stderr.write(run.stderr[-3000:] if run.returncode else "")
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(JSON_MARK):
            return json.loads(line[len(JSON_MARK) :])
    raise RuntimeError(f"part {part}: no result (exit {run.returncode}): {run.stderr[-1500:]}")


# --------------------------------------------------------------------------- 1-2: nb_dist
def measure_sessions(rounds: int, calls: int) -> dict[str, Any]:
    """Session starts (N = 2, 4, interleaved) and round trips on 2 ranks, in this process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.perf_counter()
    import torch  # noqa: F401  (a notebook that uses ranks has torch; not in the timings)

    import_torch = time.perf_counter() - began
    began = time.perf_counter()
    import nb_dist

    import_nb_dist = time.perf_counter() - began
    start: dict[str, list[float]] = {str(n): [] for n in SIZES}
    close: dict[str, list[float]] = {str(n): [] for n in SIZES}
    for n in SIZES:  # one discarded warm-up per N
        nb_dist.Ranks(num_processes=n).close()
    for round_index in range(rounds):
        order = SIZES if round_index % 2 == 0 else SIZES[::-1]
        for n in order:
            t0 = time.perf_counter()
            ranks = nb_dist.Ranks(num_processes=n)
            t1 = time.perf_counter()
            ranks.close()
            t2 = time.perf_counter()
            start[str(n)].append(t1 - t0)
            close[str(n)].append(t2 - t1)

    # Evidence that the constructor returned with the process group up on every rank.
    ranks = nb_dist.Ranks(num_processes=2)
    try:
        check = list(
            ranks.exec(
                "import torch.distributed as _d\n(_d.is_initialized(), _d.get_backend(), "
                "_d.get_world_size())"
            )
        )
        shell = None
        with contextlib.suppress(ImportError):
            from IPython import get_ipython

            shell = get_ipython()
        kinds = ["exec", "run"] + (["magic"] if shell is not None else [])
        if shell is not None:
            shell.extension_manager.load_extension("nb_dist")

        def once(kind: str) -> None:
            if kind == "exec":
                ranks.exec("")
            elif kind == "run":
                ranks.run(noop)
            else:
                shell.run_cell_magic("ranks", "", "pass")

        for _ in range(20):  # warm-up, discarded
            for kind in kinds:
                once(kind)
        trips: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(calls):
            for kind in kinds:
                t0 = time.perf_counter()
                once(kind)
                trips[kind].append(time.perf_counter() - t0)
    finally:
        ranks.close()
    return {
        "start_s": start,
        "close_s": close,
        "round_trip_s": trips,
        "process_group_check": check,
        "import_torch_s": import_torch,
        "import_nb_dist_s": import_nb_dist,
        "pid": os.getpid(),
    }


KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import live_ranks as _lr
_out = _lr.measure_sessions({rounds!r}, {calls!r})
print(JSON_MARK + json.dumps(_out))
"""


def client_cells(calls: int) -> dict[str, Any]:
    """Execute request -> execute reply of a ``%%ranks`` cell and a plain cell, each ``pass``.

    (IPython refuses a cell magic with an empty body: a bare ``%%ranks`` cell is a UsageError.)
    """
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT), env=_env())
    client = km.client()

    def cell(code: str, timeout: float = 60.0) -> float:
        t0 = time.perf_counter()
        msg_id = client.execute(code, store_history=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no reply to {code!r} within {timeout:g} s") from None
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        took = time.perf_counter() - t0
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r}: {reply['content'].get('ename')}")
        # iopub is drained between cells, outside the timing (it would only queue up).
        with contextlib.suppress(queue.Empty):
            while True:
                client.get_iopub_msg(timeout=0)
        return took

    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        cell("import torch, nb_dist\n%load_ext nb_dist\nranks = nb_dist.Ranks(num_processes=2)")
        codes = {"%%ranks cell `pass`": "%%ranks\npass", "plain cell `pass`": "pass"}
        samples: dict[str, list[float]] = {name: [] for name in codes}
        for _ in range(20):
            for code in codes.values():
                cell(code)
        for _ in range(calls):
            for name, code in codes.items():
                samples[name].append(cell(code))
        cell("ranks.close()")
        return {"round_trip_s": samples}
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


# --------------------------------------------------------------------------- 3: ipyparallel
def _engine_init_pg(rank: int, world: int, port: int) -> bool:
    """On an ipyparallel engine: import torch and join a gloo process group."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    return dist.is_initialized()


def measure_ipyparallel(rounds: int, calls: int) -> dict[str, Any]:
    """Cluster starts (N = 2, 4, interleaved), process-group setup, stop; round trips on 2."""
    out: dict[str, Any] = {"available": False, "error": None}
    try:
        import ipyparallel as ipp
    except ImportError as exc:
        out["error"] = f"not installed ({exc})"
        return out
    out["version"] = ipp.__version__
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    start: dict[str, list[float]] = {str(n): [] for n in SIZES}
    pg: dict[str, list[float]] = {str(n): [] for n in SIZES}
    stop: dict[str, list[float]] = {str(n): [] for n in SIZES}
    trips: dict[str, list[float]] = {"apply_sync(noop)": [], 'execute("")': []}

    def one_cluster(n: int, round_trips: bool) -> None:
        cluster = ipp.Cluster(n=n, log_level=40)
        t0 = time.perf_counter()
        try:
            client = cluster.start_and_connect_sync()
            t1 = time.perf_counter()
            port = free_port()
            pending = [
                client[i].apply_async(_engine_init_pg, rank, n, port)
                for rank, i in enumerate(client.ids)
            ]
            ok = [p.get(timeout=120) for p in pending]
            t2 = time.perf_counter()
            if not all(ok):
                raise RuntimeError("an engine has no process group")
            if round_trips:
                view = client[:]
                view.block = True
                kinds = {
                    "apply_sync(noop)": lambda: view.apply_sync(noop),
                    'execute("")': lambda: view.execute("", block=True),
                }
                for _ in range(20):
                    for run in kinds.values():
                        run()
                for _ in range(calls):
                    for name, run in kinds.items():
                        t = time.perf_counter()
                        run()
                        trips[name].append(time.perf_counter() - t)
            client.close()
        finally:
            t3 = time.perf_counter()
            cluster.stop_cluster_sync()
            t4 = time.perf_counter()
        start[str(n)].append(t1 - t0)
        pg[str(n)].append(t2 - t1)
        if not round_trips:
            stop[str(n)].append(t4 - t3)

    try:
        for n in SIZES:  # one discarded warm-up per N (page cache, ipyparallel's imports)
            one_cluster(n, False)
            start[str(n)].clear()
            pg[str(n)].clear()
            stop[str(n)].clear()
        for round_index in range(rounds):
            for n in SIZES if round_index % 2 == 0 else SIZES[::-1]:
                one_cluster(n, False)
        one_cluster(2, True)
        start["2"].pop()  # the round-trip cluster's start is not a timed round
        pg["2"].pop()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    out.update(
        available=out["error"] is None,
        start_s=start,
        process_group_s=pg,
        stop_s=stop,
        round_trip_s=trips,
    )
    return out


# --------------------------------------------------------------------------- 4: walkthrough
BUILD_CELL = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step, losses = 0, []
"""

STEP_CELL = """
x, y = batch(dist.get_rank(), step)
opt.zero_grad()
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
opt.step()
step += 1
losses.append(loss.item())
"""


def _batch(rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def launched_step(state_path: str, step: int) -> float:
    """One launch: process group, the model (and the previous state), one DDP step, save."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if step:
        state = torch.load(state_path)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    model = DistributedDataParallel(net)
    x, y = _batch(rank, step)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if rank == 0:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)
    dist.barrier()  # the next launch must find this step's state
    value = loss.item()
    del model, opt, net
    dist.destroy_process_group()
    return value


def walkthrough(mode: str) -> dict[str, Any]:
    """In this (fresh) process: the 10-step walkthrough as a session or as 10 launches."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401

    import nb_dist

    out: dict[str, Any] = {"mode": mode}
    if mode == "session":
        t0 = time.perf_counter()
        ranks = nb_dist.Ranks(num_processes=2)
        t1 = time.perf_counter()
        ranks.exec(BUILD_CELL)
        t2 = time.perf_counter()
        steps = []
        for _ in range(WALK_STEPS):
            s = time.perf_counter()
            ranks.exec(STEP_CELL)
            steps.append(time.perf_counter() - s)
        t3 = time.perf_counter()
        losses = ranks.pull("losses")[0]  # outside the timing
        t4 = time.perf_counter()
        ranks.close()
        t5 = time.perf_counter()
        out.update(
            total_s=(t3 - t0) + (t5 - t4),
            start_s=t1 - t0,
            build_s=t2 - t1,
            step_s=steps,
            close_s=t5 - t4,
            losses=losses,
        )
    else:
        folder = tempfile.mkdtemp(prefix="nb_dist_walk_")
        state = os.path.join(folder, "state.pt")
        launches, losses = [], []
        t0 = time.perf_counter()
        for step in range(WALK_STEPS):
            s = time.perf_counter()
            result = nb_dist.notebook_launcher(launched_step, args=(state, step), num_processes=2)
            launches.append(time.perf_counter() - s)
            losses.append(result[0])
        total = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            os.unlink(state)
            os.rmdir(folder)
        out.update(total_s=total, launch_s=launches, losses=losses)
    return out


# --------------------------------------------------------------------------- orchestration
def measure(p: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {"errors": []}
    rounds, calls = p["rounds"], p["calls"]

    def attempt(label: str, fn: Any) -> Any:
        print(f"{label} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            data["errors"].append(f"{label}: {type(exc).__name__}: {str(exc)[-400:]}")
            print(data["errors"][-1], file=sys.stderr, flush=True)
            return None
        print(f"{label}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        return value

    sessions = {}
    sessions["plain"] = attempt(
        "sessions, plain",
        lambda: run_part("sessions", ["--rounds", str(rounds), "--calls", str(calls)]),
    )
    if p["kernel"]:
        code = KERNEL_CELL.format(bench=str(BENCH), rounds=rounds, calls=calls)
        sessions["ipykernel"] = attempt(
            "sessions, ipykernel", lambda: run_in_kernel(code, timeout=PART_LIMIT)
        )
        data["client"] = attempt("client round trips", lambda: client_cells(calls))
    data["sessions"] = {k: v for k, v in sessions.items() if v is not None}
    if p["ipyparallel"]:
        data["ipyparallel"] = attempt(
            "ipyparallel",
            lambda: run_part(
                "ipyparallel", ["--ipp-rounds", str(p["ipp_rounds"]), "--calls", str(calls)]
            ),
        )
    else:
        data["ipyparallel"] = {"available": False, "error": "skipped (--no-ipyparallel)"}
    walks: dict[str, list[dict]] = {"session": [], "launches": []}
    modes = ["session", "launches"]
    for round_index in range(p["walk_rounds"]):
        for mode in modes[round_index % 2 :] + modes[: round_index % 2]:
            result = attempt(
                f"walkthrough {mode}, round {round_index + 1}",
                lambda mode=mode: run_part("walk", ["--mode", mode]),
            )
            if result is not None:
                walks[mode].append(result)
    data["walkthrough"] = walks
    return data


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"start": {}, "close": {}, "round_trip_ms": {}}
    for context, m in data.get("sessions", {}).items():
        s["start"][f"nb_dist, {context}"] = {n: stats(v) for n, v in m["start_s"].items()}
        s["close"][f"nb_dist, {context}"] = {n: stats(v) for n, v in m["close_s"].items()}
        labels = {
            "exec": 'exec("")',
            "run": "run(noop)",
            "magic": 'run_cell_magic("ranks", "", "pass")',
        }
        for kind, samples in m["round_trip_s"].items():
            s["round_trip_ms"][f"nb_dist {labels[kind]}, {context}"] = latency(samples)
    client = data.get("client") or {}
    for name, samples in client.get("round_trip_s", {}).items():
        s["round_trip_ms"][f"client: {name}, ipykernel"] = latency(samples)
    ipp = data.get("ipyparallel") or {}
    if ipp.get("start_s"):
        s["start"]["ipyparallel, plain"] = {n: stats(v) for n, v in ipp["start_s"].items()}
        s["start"]["ipyparallel + torch + gloo group, plain"] = {
            n: stats(
                [a + b for a, b in zip(ipp["start_s"][n], ipp["process_group_s"][n], strict=True)]
            )
            for n in ipp["start_s"]
        }
        s["close"]["ipyparallel, plain"] = {n: stats(v) for n, v in ipp["stop_s"].items()}
        for kind, samples in ipp.get("round_trip_s", {}).items():
            if samples:
                s["round_trip_ms"][f"ipyparallel {kind}, plain"] = latency(samples)
    walk = data.get("walkthrough", {})
    s["walkthrough"] = {}
    for mode, runs in walk.items():
        if runs:
            s["walkthrough"][mode] = stats([r["total_s"] for r in runs])
    if walk.get("session"):
        ses = walk["session"]
        s["walkthrough_parts"] = {
            "start": stats([r["start_s"] for r in ses]),
            "build cell": stats([r["build_s"] for r in ses]),
            "1st step cell": stats([r["step_s"][0] for r in ses]),
            f"2nd-{WALK_STEPS}th step cells": stats([x for r in ses for x in r["step_s"][1:]]),
            "close": stats([r["close_s"] for r in ses]),
        }
    if walk.get("launches"):
        runs = walk["launches"]
        s["walkthrough_parts"] = {
            **s.get("walkthrough_parts", {}),
            "1st launch": stats([r["launch_s"][0] for r in runs]),
            "2nd launch": stats([r["launch_s"][1] for r in runs]),
            f"3rd-{WALK_STEPS}th launches": stats([x for r in runs for x in r["launch_s"][2:]]),
        }
    if walk.get("session") and walk.get("launches"):
        a = s["walkthrough"]["session"]["median"]
        b = s["walkthrough"]["launches"]["median"]
        s["walkthrough_ratio"] = b / a
        diffs = [
            abs(x - y)
            for r1 in walk["session"]
            for r2 in walk["launches"]
            for x, y in zip(r1["losses"], r2["losses"], strict=True)
        ]
        s["losses_max_abs_diff"] = max(diffs)
    return s


# --------------------------------------------------------------------------- report
def _s(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "n/a"
    return f"{entry['median']:.3f} ({entry['min']:.3f}-{entry['max']:.3f}, n={entry['n']})"


def _ms(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "n/a"
    return f"{entry['p50']:.2f} | {entry['p90']:.2f} | {entry['max']:.1f} | {entry['n']}"


def markdown(data: dict) -> str:
    s = data["summary"]
    p = data["params"]
    lines = [
        "| session start (until every rank has its gloo group) | N=2: s, median (min-max, n) | "
        "N=4 | close, N=2 | close, N=4 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, per_n in s["start"].items():
        closing = s["close"].get(name, {})
        lines.append(
            f"| {name} | {_s(per_n.get('2'))} | {_s(per_n.get('4'))} | "
            f"{_s(closing.get('2'))} | {_s(closing.get('4'))} |"
        )
    lines += [
        "",
        "| round trip on 2 ranks | p50 ms | p90 ms | max ms | calls |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, entry in s["round_trip_ms"].items():
        lines.append(f"| {name} | {_ms(entry)} |")
    walk = s.get("walkthrough", {})
    if walk:
        lines += [
            "",
            f"| DDP walkthrough, {WALK_STEPS} steps, 2 ranks | total s, median (min-max, n) |",
            "| --- | ---: |",
        ]
        labels = {
            "session": f"a session: Ranks(2), a build cell, {WALK_STEPS} step cells, close()",
            "launches": f"{WALK_STEPS} notebook_launcher launches (state through a file)",
        }
        for mode, entry in walk.items():
            lines.append(f"| {labels[mode]} | {_s(entry)} |")
        parts = s.get("walkthrough_parts", {})
        if parts:
            lines += ["", "| where the walkthrough's time goes | s, median (min-max, n) |"]
            lines += ["| --- | ---: |"]
            for name, entry in parts.items():
                lines.append(f"| {name} | {_s(entry)} |")
    notes = [""]
    if "walkthrough_ratio" in s:
        notes.append(
            f"The {WALK_STEPS} launches take {s['walkthrough_ratio']:.1f}x the session's time; "
            f"rank 0's losses agree between the two to {s['losses_max_abs_diff']:.1e} (max "
            "absolute difference)."
        )
    parts = s.get("walkthrough_parts", {})
    later_cell = parts.get(f"2nd-{WALK_STEPS}th step cells", {})
    later_launch = parts.get(f"3rd-{WALK_STEPS}th launches", {})
    if later_cell.get("n") and later_launch.get("n"):
        notes.append(
            "Both totals are dominated by a one-time cost: `DistributedDataParallel` imports "
            "`torch._dynamo` in each rank (the session's build cell; the 1st launch, and the 2nd, "
            "which waits for the launcher's background import of it, as cells run back to back). "
            f"Past it, a step cell takes {later_cell['median'] * 1e3:.1f} ms and a step as a "
            f"launch {later_launch['median'] * 1e3:.0f} ms (medians), "
            f"{later_launch['median'] / later_cell['median']:.0f}x."
        )
    for context, m in data.get("sessions", {}).items():
        check = m.get("process_group_check")
        if check:
            notes.append(
                f"{context}: after `Ranks(2)` returned, every rank reported "
                f"(is_initialized, backend, world_size) = {tuple(check[0])}."
            )
    ipp = data.get("ipyparallel") or {}
    if ipp.get("error") or not ipp.get("available"):
        notes.append(f"ipyparallel: not measured: {ipp.get('error') or 'no result'}.")
    else:
        notes.append(
            f"ipyparallel {ipp.get('version')}: engines are fresh interpreters started by its "
            "launcher (no torch); the '+ torch + gloo group' row adds each engine's `import "
            "torch` and `init_process_group` (the state a `Ranks` session starts in). Its "
            f"round trips ran on a separate 2-engine cluster. {p['ipp_rounds']} timed starts "
            "per N after one warm-up each."
        )
    m = data["machine"]
    notes.append(
        f"nb_dist starts: {p['rounds']} interleaved rounds of N=2 and N=4 after one warm-up "
        f"each; round trips: {p['calls']} calls per kind after 20 warm-up calls, kinds "
        f"alternated call by call. Walkthrough: {p['walk_rounds']} rounds, each run in a fresh "
        f"interpreter, order rotated. {m['cpu_count']} CPUs shared with other work (load average "
        f"{data['loadavg_before']} before, {m['loadavg']} after); run took "
        f"{data['total_seconds']:.0f} s."
    )
    if data.get("errors"):
        notes.append("Errors: " + "; ".join(data["errors"]))
    return "\n".join(lines + notes) + "\n"


def targets(data: dict) -> list[dict]:
    s = data["summary"]
    out = []
    for context in ("plain", "ipykernel"):
        where = "" if context == "plain" else " (ipykernel)"
        entry = s["start"].get(f"nb_dist, {context}", {}).get("2", {})
        value = entry.get("median") if entry.get("n") else None
        out.append(
            {
                "name": f"live ranks: session start, Ranks(2){where}",
                "target": f"<= {TARGET_START_S:g} s",
                "measured": "n/a" if value is None else f"{value:.3f} s",
                "met": None if value is None else value <= TARGET_START_S,
            }
        )
        for kind, label in (('exec("")', 'empty cell, exec("")'), ("run(noop)", "run(noop)")):
            entry = s["round_trip_ms"].get(f"nb_dist {kind}, {context}", {})
            value = entry.get("p50") if entry.get("n") else None
            out.append(
                {
                    "name": f"live ranks: round trip of {label}, 2 ranks, p50{where}",
                    "target": f"<= {TARGET_P50_MS:g} ms",
                    "measured": "n/a" if value is None else f"{value:.2f} ms",
                    "met": None if value is None else value <= TARGET_P50_MS,
                }
            )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    s = data["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8), dpi=120)
    colors = {"nb_dist": "tab:blue", "ipyparallel": "tab:orange", "client": "tab:purple"}

    def color(name: str) -> str:
        return next((c for k, c in colors.items() if name.startswith(k)), "tab:gray")

    ax = axes[0]
    names = list(s["start"])
    for j, n in enumerate(("2", "4")):
        xs, meds, lo, hi, cs = [], [], [], [], []
        for i, name in enumerate(names):
            e = s["start"][name].get(n, {})
            if not e.get("n"):
                continue
            xs.append(i + (j - 0.5) * 0.4)
            meds.append(e["median"])
            lo.append(e["median"] - e["min"])
            hi.append(e["max"] - e["median"])
            cs.append(color(name))
        ax.bar(xs, meds, width=0.38, yerr=[lo, hi], capsize=3, color=cs,
               alpha=1.0 if n == "2" else 0.55, label=f"N={n}")  # fmt: skip
        for x, v in zip(xs, meds, strict=True):
            ax.annotate(f"{v:.2f}", (x, v), textcoords="offset points", xytext=(0, 2),
                        ha="center", fontsize=7)  # fmt: skip
    ax.axhline(TARGET_START_S, color="k", ls="--", lw=0.8, label=f"target {TARGET_START_S} s (N=2)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n").replace(" + ", "\n+ ") for n in names],
                  fontsize=7)  # fmt: skip
    ax.set_ylabel("seconds (log; median, whiskers min-max)")
    ax.set_title("session start, process group up", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1]
    names = list(s["round_trip_ms"])
    entries = [s["round_trip_ms"][n] for n in names]
    p50 = [e.get("p50", 0) for e in entries]
    p90 = [e.get("p90", 0) for e in entries]
    ys = range(len(names))
    ax.barh(ys, p50, color=[color(n) for n in names], label="p50")
    ax.scatter(p90, ys, marker="|", s=120, color="k", label="p90", zorder=3)
    ax.axvline(TARGET_P50_MS, color="k", ls="--", lw=0.8, label=f"target p50 {TARGET_P50_MS} ms")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_yticks(list(ys), ["\n".join(n.rsplit(", ", 1)) for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (log)")
    ax.set_title("round trip of a trivial cell, 2 ranks", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")

    ax = axes[2]
    walk = s.get("walkthrough", {})
    modes = [m for m in ("session", "launches") if m in walk]
    meds = [walk[m]["median"] for m in modes]
    ax.bar(range(len(modes)), meds, color=["tab:blue", "tab:gray"][: len(modes)],
           yerr=[[walk[m]["median"] - walk[m]["min"] for m in modes],
                 [walk[m]["max"] - walk[m]["median"] for m in modes]], capsize=3)  # fmt: skip
    for x, v in enumerate(meds):
        ax.annotate(f"{v:.2f} s", (x, v), textcoords="offset points", xytext=(0, 2),
                    ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(modes)), [
        {"session": "Ranks session\n(1 build + 10 step cells)",
         "launches": "10 launches\n(state via a file)"}[m] for m in modes], fontsize=8)  # fmt: skip
    ax.set_ylabel("total wall time, s")
    ax.set_title(f"DDP walkthrough, {WALK_STEPS} steps, 2 ranks", fontsize=10)
    fig.suptitle("Live ranks (nb_dist.Ranks) vs ipyparallel and vs one launch per step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument("--rounds", type=int, help="session-start rounds (default 10, quick 3)")
    parser.add_argument("--calls", type=int, help="round trips per kind (default 300, quick 200)")
    parser.add_argument("--ipp-rounds", type=int, help="ipyparallel starts per N (3, quick 1)")
    parser.add_argument("--walk-rounds", type=int, help="walkthrough rounds (default 3, quick 1)")
    parser.add_argument("--no-kernel", action="store_true", help="skip the ipykernel part")
    parser.add_argument("--no-ipyparallel", action="store_true", help="skip ipyparallel")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--part", choices=["sessions", "ipyparallel", "walk"], help="(internal)")
    parser.add_argument("--mode", choices=["session", "launches"], help="(internal)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    calls = args.calls or (200 if args.quick else 300)
    if args.part == "sessions":
        print(JSON_MARK + json.dumps(measure_sessions(rounds, calls)))
        return 0
    if args.part == "ipyparallel":
        with contextlib.redirect_stdout(io.StringIO()):
            result = measure_ipyparallel(args.ipp_rounds or 3, calls)
        print(JSON_MARK + json.dumps(result))
        return 0
    if args.part == "walk":
        print(JSON_MARK + json.dumps(walkthrough(args.mode)))
        return 0
    p = {
        "rounds": rounds,
        "calls": calls,
        "ipp_rounds": args.ipp_rounds or (1 if args.quick else 3),
        "walk_rounds": args.walk_rounds or (1 if args.quick else 3),
        "kernel": not args.no_kernel,
        "ipyparallel": not args.no_ipyparallel,
        "sizes": list(SIZES),
        "walk_steps": WALK_STEPS,
        "quick": args.quick,
    }
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    measured = measure(p)
    data: dict[str, Any] = {
        "params": p,
        "loadavg_before": loadavg_before,
        **measured,
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["summary"] = summarize(data)
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
