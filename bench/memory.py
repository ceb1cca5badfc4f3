"""Memory: what the kernel and each worker take, fork vs spawn, nb_dist vs Accelerate.

How. Everything runs inside a real ipykernel (``_common.run_in_kernel``), as in a notebook:
the cell imports torch and nb_dist and records the kernel's memory, then launches N = 2 (and
4) workers with each method:

- ``nb_dist fork``: ``nb_dist.notebook_launcher(worker, num_processes=N)``;
- ``nb_dist spawn``: the same with ``start_method="spawn"``;
- ``accelerate fork``: ``accelerate.notebook_launcher`` (torch elastic forks the workers from
  the kernel; Accelerate has no spawn option on CPU). Imported only for these launches, after
  the nb_dist ones, so its import does not colour the nb_dist rows.

Each worker imports torch, builds a small model (a 2-layer MLP, 512-1024-512, about 4 MB of
parameters plus their gradients), does one backward pass and one ``all_reduce`` of its
gradients (gloo), then writes a "ready" file with its pid and waits until the kernel creates a
"stop" file. Meanwhile a sampler thread in the kernel reads, every ``--interval`` seconds,
``psutil.Process.memory_full_info()`` (RSS, USS, PSS) of the kernel and of all the kernel's
descendants. Once every rank is ready it takes three passes over the kernel and the workers
(the pids from the ready files; any other descendant is a helper, listed but not counted),
keeps each process's median, and creates the stop file. "kernel before" is measured just before
the launch, "during" in those passes, "after" once the launch returned (after ``gc.collect``).
One unmeasured nb_dist fork launch comes first, so the first row does not pay one-time imports.

Why USS. RSS counts every resident page a process maps, shared or not. A forked worker starts
as a copy-on-write image of the kernel: torch's libraries and heap, the kernel's objects, all
shared with the kernel until written; its RSS therefore shows hundreds of MB that cost nothing
extra, and summing RSS over the kernel and N workers counts them N+1 times. USS (unique set
size) counts only pages no other process maps: what the worker really added, what would be
freed if it exited. A spawned worker is a fresh interpreter that imports torch itself: its
Python heap (modules, torch's operator registrations) is its own, so its USS is hundreds of MB
per worker; only the read-only pages of the shared libraries are shared (page cache). The
"added by the launch" column is the sum of PSS (proportional set size: shared pages split
among the processes that map them) over the kernel and the workers during the launch, minus
the kernel's PSS before: the machine's real cost of the launch. The kernel's own USS drops
during a fork launch, because its pages are then shared with the workers.

Run: ``python bench/memory.py`` (about 40 s on 2 cores; ``--quick``: N=2 only). Writes
``bench/results/memory.json`` (every sample, the parameters, the machine) and ``memory.png``,
and prints the markdown tables. No target: the numbers are there to choose a start method.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import BENCH, RESULTS, publish, run_in_kernel

NAME = "memory"
MB = 2**20
WIDTH, HIDDEN = 512, 1024
# A worker waits this long at most for the stop file (if the sampler died), then returns.
WORKER_WAIT = 60.0
METHODS = ("nb_dist fork", "nb_dist spawn", "accelerate fork")


# --------------------------------------------------------------------------- what every rank runs
def worker(ready_dir: str) -> int:
    """Import torch, build a small MLP, one backward and all_reduce, then wait to be measured."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH)
    )
    loss = model(torch.randn(32, WIDTH)).square().mean()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    Path(ready_dir, f"ready.{rank}").write_text(str(os.getpid()))
    stop = Path(ready_dir, "stop")
    deadline = time.monotonic() + WORKER_WAIT
    while not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()
    return os.getpid()


# --------------------------------------------------------------------------- the kernel side
def _mem(proc: Any) -> dict[str, float]:
    info = proc.memory_full_info()
    return {key: round(getattr(info, key) / MB, 1) for key in ("rss", "uss", "pss")}


class Sampler(threading.Thread):
    """Samples the kernel and its descendants; measures the workers once all are ready."""

    def __init__(self, ready_dir: str, n: int, interval: float) -> None:
        super().__init__(daemon=True)
        import psutil

        self.psutil = psutil
        self.ready_dir, self.n, self.interval = Path(ready_dir), n, interval
        self.done = threading.Event()
        self.timeline: list[dict[str, Any]] = []
        self.steady: dict[str, Any] | None = None
        self.error: str | None = None
        self.t0 = time.monotonic()

    def run(self) -> None:
        try:
            me = self.psutil.Process()
            while not self.done.is_set():
                sample: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 3)}
                sample["kernel"] = _mem(me)
                sample["children"] = {}
                for child in me.children(recursive=True):
                    with contextlib.suppress(self.psutil.Error):
                        sample["children"][str(child.pid)] = _mem(child)
                self.timeline.append(sample)
                if self.steady is None:
                    pids = self._ready_pids()
                    if len(pids) == self.n:
                        self.steady = self._measure(me, pids)
                        (self.ready_dir / "stop").touch()
                self.done.wait(self.interval)
        except Exception as exc:  # reported in the result; the workers stop on their own
            self.error = f"{type(exc).__name__}: {exc}"
            (self.ready_dir / "stop").touch()

    def _ready_pids(self) -> list[int]:
        pids = []
        for path in self.ready_dir.glob("ready.*"):
            with contextlib.suppress(ValueError, OSError):
                pids.append(int(path.read_text()))
        return pids

    def _measure(self, me: Any, pids: list[int]) -> dict[str, Any]:
        passes = []
        for _ in range(3):
            passes.append(
                {"kernel": _mem(me), **{str(pid): _mem(self.psutil.Process(pid)) for pid in pids}}
            )
            time.sleep(0.1)
        median = {
            key: {m: statistics.median(p[key][m] for p in passes) for m in ("rss", "uss", "pss")}
            for key in passes[0]
        }
        helpers = {}
        for child in me.children(recursive=True):
            if child.pid not in pids:
                with contextlib.suppress(self.psutil.Error):
                    helpers[str(child.pid)] = " ".join(child.cmdline()[:3])
        return {
            "kernel": median.pop("kernel"),
            "workers": median,
            "passes": passes,
            "helpers": helpers,
        }


def _launch(method: str, n: int, ready_dir: str) -> None:
    if method.startswith("nb_dist"):
        import nb_dist

        start = method.split()[-1]
        nb_dist.notebook_launcher(
            worker, (ready_dir,), num_processes=n, device="cpu", start_method=start, timeout=120
        )
    else:
        import io
        import socket

        from accelerate import notebook_launcher

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with contextlib.redirect_stdout(io.StringIO()):  # "Launching training on N CPUs."
            notebook_launcher(worker, (ready_dir,), num_processes=n, use_port=str(port))


def in_kernel(configs: list[tuple[str, int]], interval: float) -> dict[str, Any]:
    """Run in the kernel: measure the kernel, then every (method, N) launch."""
    import psutil

    me = psutil.Process()
    gc.collect()
    bare = _mem(me)
    import torch  # noqa: F401  (what a notebook has imported before launching)

    import nb_dist  # noqa: F401

    gc.collect()
    imported = _mem(me)
    with tempfile.TemporaryDirectory() as warm:  # first launch's one-time costs, not measured
        Path(warm, "stop").touch()
        _launch("nb_dist fork", 2, warm)
    runs = []
    for method, n in configs:
        with tempfile.TemporaryDirectory() as ready_dir:
            if method.startswith("accelerate"):
                import accelerate  # noqa: F401  (part of "before": a user imports it too)
            gc.collect()
            before = _mem(me)
            sampler = Sampler(ready_dir, n, interval)
            began = time.perf_counter()
            sampler.start()
            try:
                _launch(method, n, ready_dir)
            finally:
                sampler.done.set()
                sampler.join(timeout=10)
            took = time.perf_counter() - began
            gc.collect()
            after = _mem(me)
        print(f"{method} N={n}: {took:.1f} s", file=sys.stderr, flush=True)
        runs.append(
            {
                "method": method,
                "n": n,
                "seconds": round(took, 2),
                "kernel_before": before,
                "kernel_after": after,
                "steady": sampler.steady,
                "sampler_error": sampler.error,
                "timeline": sampler.timeline,
            }
        )
    return {"kernel_bare": bare, "kernel_imported": imported, "runs": runs}


KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import memory as _memory
print(JSON_MARK + json.dumps(_memory.in_kernel({configs!r}, {interval!r})))
"""


# --------------------------------------------------------------------------- summaries
def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers for one launch (MB)."""
    steady = run.get("steady")
    if not steady:
        return {}
    workers = list(steady["workers"].values())
    kernel_peak = max((s["kernel"]["rss"] for s in run["timeline"]), default=None)
    return {
        "worker_rss": statistics.median(w["rss"] for w in workers),
        "worker_uss": statistics.median(w["uss"] for w in workers),
        "worker_pss": statistics.median(w["pss"] for w in workers),
        "workers_rss_total": round(sum(w["rss"] for w in workers), 1),
        "workers_uss_total": round(sum(w["uss"] for w in workers), 1),
        "kernel_during": steady["kernel"],
        "kernel_peak_rss": kernel_peak,
        "added_pss": round(
            steady["kernel"]["pss"] + sum(w["pss"] for w in workers) - run["kernel_before"]["pss"],
            1,
        ),
        "helpers": len(steady["helpers"]),
    }


def _label(run: dict[str, Any]) -> str:
    return f"{run['method']}, N={run['n']}"


def markdown(data: dict) -> str:
    runs = data["kernel"]["runs"]
    lines = [
        "| launch | per worker RSS | per worker USS | per worker PSS | workers' RSS sum "
        "| workers' USS sum | added by the launch (ΣPSS) | s (launch + measuring) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        s = run["summary"]
        if not s:
            lines.append(f"| {_label(run)} | failed: {run.get('sampler_error')} |||||||")
            continue
        lines.append(
            f"| {_label(run)} | {s['worker_rss']:.0f} | {s['worker_uss']:.0f} | "
            f"{s['worker_pss']:.0f} | {s['workers_rss_total']:.0f} | "
            f"{s['workers_uss_total']:.0f} | {s['added_pss']:.0f} | {run['seconds']:.1f} |"
        )
    k = data["kernel"]
    lines += [
        "",
        "| kernel RSS / USS during a launch | before | during | after |",
        "| --- | --- | --- | --- |",
    ]
    for run in runs:
        during = run["summary"].get("kernel_during")
        lines.append(
            f"| {_label(run)} | {_pair(run['kernel_before'])} | "
            f"{_pair(during) if during else 'n/a'} | {_pair(run['kernel_after'])} |"
        )
    lines += [
        "",
        f"The kernel takes {_pair(k['kernel_bare'])} MB (RSS / USS) bare and "
        f"{_pair(k['kernel_imported'])} MB after `import torch, nb_dist`. Values in MB "
        "(2^20 bytes); per-worker values are medians over the workers. " + finding(data),
    ]
    machine = data.get("machine", {})
    lines.append(
        f"{machine.get('cpu_count')} CPUs, {machine.get('memory_gib')} GiB, torch "
        f"{machine.get('torch')}, accelerate {machine.get('accelerate')}; run took "
        f"{data.get('seconds', 0):.0f} s."
    )
    return "\n".join(lines) + "\n"


def _pair(m: dict[str, float]) -> str:
    return f"{m['rss']:.0f} / {m['uss']:.0f}"


def finding(data: dict) -> str:
    """One or two sentences from the numbers: what fork saves over spawn."""
    by = {(r["method"], r["n"]): r["summary"] for r in data["kernel"]["runs"] if r["summary"]}
    n = max((key[1] for key in by), default=None)
    fork, spawn = by.get(("nb_dist fork", n)), by.get(("nb_dist spawn", n))
    acc = by.get(("accelerate fork", n))
    if not fork or not spawn:
        return ""
    text = (
        f"At N={n}, a forked nb_dist worker shows {fork['worker_rss']:.0f} MB RSS but only "
        f"{fork['worker_uss']:.0f} MB USS: the rest is the kernel's torch, shared copy-on-write. "
        f"A spawned worker has {spawn['worker_uss']:.0f} MB of its own (its own torch import), "
        f"so the launch adds {spawn['added_pss']:.0f} MB with spawn against "
        f"{fork['added_pss']:.0f} MB with fork"
    )
    if acc:
        text += (
            f"; Accelerate's forked workers are alike ({acc['worker_uss']:.0f} MB USS each, "
            f"{acc['added_pss']:.0f} MB added)"
        )
    return text + "."


def targets(data: dict) -> list[dict]:
    return []


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["kernel"]["runs"] if r["summary"]]
    labels = ["kernel\n(torch, nb_dist\nimported)"] + [
        f"{r['method'].replace(' ', chr(10), 1)}\nN={r['n']}" for r in runs
    ]
    k = data["kernel"]["kernel_imported"]
    rss = [k["rss"]] + [r["summary"]["worker_rss"] for r in runs]
    uss = [k["uss"]] + [r["summary"]["worker_uss"] for r in runs]
    colors = {"nb_dist fork": "#1f77b4", "nb_dist spawn": "#d62728", "accelerate fork": "#2ca02c"}
    shade = ["#7f7f7f"] + [colors.get(r["method"], "#9467bd") for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], rss, 0.4, color=shade, alpha=0.35, edgecolor="black", lw=0.4)
    ax.bar([x + 0.2 for x in xs], uss, 0.4, color=shade, edgecolor="black", lw=0.4)
    for x, value in zip(xs, uss, strict=True):
        ax.text(x + 0.2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=6.5)
    for x, value in zip(xs, rss, strict=True):
        ax.text(x - 0.2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=6.5)
    ax.set_ylim(0, max(rss + uss) * 1.3)  # room for the legend
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("MB per process (median over workers)")
    ax.set_title("Memory per worker: RSS (light) vs USS (solid), in a Jupyter kernel")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(facecolor="#bbbbbb", edgecolor="black", label="RSS (counts shared pages)"),
            Patch(facecolor="#555555", edgecolor="black", label="USS (unique to the process)"),
        ],
        fontsize=7,
        loc="upper right",
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=2 only (~20 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--interval", type=float, default=0.1, help="sampling period, s")
    args = parser.parse_args(argv)
    sizes = (2,) if args.quick else (2, 4)
    try:
        import accelerate  # noqa: F401

        methods = METHODS
    except ImportError:
        methods = METHODS[:2]
    configs = [(m, n) for m in methods for n in sizes]
    began = time.perf_counter()
    code = KERNEL_CELL.format(bench=str(BENCH), configs=configs, interval=args.interval)
    measured = run_in_kernel(code, timeout=240.0)
    for run in measured["runs"]:
        run["summary"] = summarize(run)
    data = {
        "what": "RSS/USS/PSS of the kernel and of each worker, fork vs spawn, in an ipykernel",
        "unit": "MB (2^20 bytes)",
        "params": {
            "quick": args.quick,
            "configs": configs,
            "model": f"Linear({WIDTH}, {HIDDEN}) + ReLU + Linear({HIDDEN}, {WIDTH})",
            "interval_s": args.interval,
            "steady_passes": 3,
        },
        "kernel": measured,
        "seconds": round(time.perf_counter() - began, 1),
    }
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
