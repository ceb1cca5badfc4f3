"""Launch latency: how long one launch of a trivial distributed function takes, start to end.

The launched function is the smallest real distributed job: ``init_process_group("gloo")``,
one ``all_reduce`` of a one-element tensor, ``destroy_process_group()``. Each launch is timed
as the wall time of the launcher call (from the call until it returns with every worker
reaped), for N = 1, 2 and 4 workers, with these methods:

- fork family (workers are forks of the calling process, torch already imported):

  - ``nb_dist fork``: ``nb_dist.notebook_launcher(fn, num_processes=N)``;
  - ``raw fork (floor)``: ``torch.multiprocessing.start_processes(start_method="fork")`` with
    ``MASTER_ADDR``/``MASTER_PORT`` set by hand and rank 0 hosting the store: the least any
    fork-based launcher can do (no output capture, no failure handling, no cleanup guarantee);
  - ``accelerate``: ``accelerate.notebook_launcher(fn, num_processes=N, use_port=<free>)``
    (torch elastic's agent forks the workers). N=1 is n/a: accelerate then calls the function
    in the calling process, without a launch.

- spawn family (every worker is a fresh interpreter that imports torch itself):

  - ``nb_dist spawn``: the same nb_dist call with ``start_method="spawn"`` (the function is
    shipped with cloudpickle);
  - ``raw spawn (torch)``: ``torch.multiprocessing.start_processes(start_method="spawn")``
    with a module-level function: the baseline for ``nb_dist spawn``. Like every
    multiprocessing spawn it re-imports the caller's ``__main__`` in each worker (here this
    file, which imports torch and nothing heavier: nb_dist, psutil and accelerate are imported
    lazily for that reason), and each worker ends with a full interpreter shutdown, which with
    torch loaded costs about 0.5 s of CPU; nb_dist's workers leave with ``os._exit``. So this
    is not a strict floor: nb_dist spawn can come out below it.

Everything is timed from a plain Python process, and the fork family again inside a real
ipykernel (started with jupyter_client through ``_common.run_in_kernel``; the cell imports the
functions of this file and runs the same timing loop), which is what a notebook user sees: a
kernel has threads (ZMQ, heartbeat, iopub) and a larger heap to fork. The spawn family runs in
the plain process only: a spawned worker does not inherit the kernel, so the kernel would only
add noise to a measurement dominated by each worker's ``import torch``.

Within one context and one family the methods are timed in interleaved rounds (one launch of
each method per round), so a burst of background load hits them all alike. The fork family
gets one discarded warm-up launch per method and N; the spawn family, whose launches take
seconds, one discarded warm-up per method (it warms the page cache for torch's files). A
launch that takes longer than ``HANG_LIMIT`` (fork 15 s, spawn 60 s) is hung (a fork that
inherited a lock another thread held, see bench/README.md): its workers are killed, it is not
timed and it is counted under ``hung``. Each cell reports the median, min-max and p95 of its
samples; the ratios divide medians.

Run: ``python bench/launch_latency.py`` (about two minutes on 2 cores; ``--quick`` about 30 s).
Writes ``bench/results/launch_latency.json`` (every sample, the parameters, the machine) and
``launch_latency.png``, and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from _common import BENCH, RESULTS, publish, run_in_kernel, stats

NAME = "launch_latency"
SIZES = (1, 2, 4)
FORK_FAMILY = ("nb_dist fork", "raw fork (floor)", "accelerate")
SPAWN_FAMILY = ("nb_dist spawn", "raw spawn (torch)")
# A launch that takes longer than this is hung: its workers are killed and it is not timed.
# Fork: a launch takes < 1 s, or ~5 s after a stalled reverse-DNS lookup (see bench/README.md).
HANG_LIMIT = {"fork": 15.0, "spawn": 60.0}
TARGET_FLOOR_RATIO = 1.25


# --------------------------------------------------------------------------- what every rank runs
def trivial() -> None:
    """The launched function: process group, one tiny all_reduce, teardown."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


def _raw_worker(local_rank: int, world_size: int, port: int) -> None:
    """What a hand-written launcher's worker does: set the env:// variables, run the function."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    trivial()


# --------------------------------------------------------------------------- the launchers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nb_dist_fork(n: int) -> None:
    import nb_dist

    nb_dist.notebook_launcher(trivial, num_processes=n, device="cpu")


def launch_nb_dist_spawn(n: int) -> None:
    import nb_dist

    nb_dist.notebook_launcher(trivial, num_processes=n, device="cpu", start_method="spawn")


def launch_raw_fork(n: int) -> None:
    torch_mp.start_processes(
        _raw_worker, args=(n, free_port()), nprocs=n, join=True, start_method="fork"
    )


def launch_raw_spawn(n: int) -> None:
    torch_mp.start_processes(
        _raw_worker, args=(n, free_port()), nprocs=n, join=True, start_method="spawn"
    )


def launch_accelerate(n: int) -> None:
    from accelerate import notebook_launcher

    # It prints "Launching training on N CPUs."; its port is fixed unless use_port is given.
    with contextlib.redirect_stdout(io.StringIO()):
        notebook_launcher(trivial, num_processes=n, use_port=str(free_port()))


def accelerate_version() -> str | None:
    try:
        import accelerate
    except ImportError:
        return None
    return accelerate.__version__


# name -> (launch function, the N it applies to)
LAUNCHERS: dict[str, tuple[Callable[[int], None], tuple[int, ...]]] = {
    "nb_dist fork": (launch_nb_dist_fork, SIZES),
    "raw fork (floor)": (launch_raw_fork, SIZES),
    # With num_processes=1 accelerate runs the function in the calling process: no launch.
    "accelerate": (launch_accelerate, tuple(n for n in SIZES if n > 1)),
    "nb_dist spawn": (launch_nb_dist_spawn, SIZES),
    "raw spawn (torch)": (launch_raw_spawn, SIZES),
}


# --------------------------------------------------------------------------- timing
def _kill_children(fired: threading.Event) -> None:
    import psutil

    fired.set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def time_once(name: str, n: int, hung: dict[str, dict[str, int]]) -> float | None:
    """Seconds one launch took, or None if it hung (then counted in ``hung``)."""
    launch = LAUNCHERS[name][0]
    fired = threading.Event()
    limit = HANG_LIMIT["spawn" if name in SPAWN_FAMILY else "fork"]
    watchdog = threading.Timer(limit, _kill_children, args=(fired,))
    watchdog.daemon = True
    began = time.perf_counter()
    watchdog.start()
    try:
        launch(n)
    except Exception:
        if not fired.is_set():
            raise  # a real failure, not the watchdog's doing
    finally:
        watchdog.cancel()
    elapsed = time.perf_counter() - began
    if fired.is_set():
        print(f"{name} N={n}: hung, workers killed", file=sys.stderr, flush=True)
        per_n = hung.setdefault(name, {})
        per_n[str(n)] = per_n.get(str(n), 0) + 1
        return None
    return elapsed


def measure(
    names: list[str],
    sizes: tuple[int, ...],
    repeats: int,
    warmup: str,
    label: str = "",
) -> dict[str, Any]:
    """Time ``names`` (one family) for every N in interleaved rounds.

    ``warmup``: ``"per_n"`` (one discarded launch per method and N) or ``"once"`` (one
    discarded launch per method, at the first N it applies to). Returns
    ``{"samples": {name: {N: [seconds]}}, "hung": {name: {N: count}}}``.
    """
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    hung: dict[str, dict[str, int]] = {}
    warmed: set[str] = set()
    for n in sizes:
        active = [name for name in names if n in LAUNCHERS[name][1]]
        for name in active:
            if warmup == "per_n" or name not in warmed:
                time_once(name, n, hung)
                warmed.add(name)
        for _ in range(repeats):
            for name in active:
                took = time_once(name, n, hung)
                if took is not None:
                    samples[name].setdefault(str(n), []).append(took)
        done = ", ".join(
            f"{name} {stats(samples[name][str(n)])['median']:.3f}"
            for name in active
            if samples[name].get(str(n))
        )
        print(f"{label}N={n}: {done} (median s)", file=sys.stderr, flush=True)
    return {"samples": samples, "hung": hung}


KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import launch_latency as _ll
_out = _ll.measure({names!r}, {sizes!r}, {repeats!r}, "per_n", label="ipykernel ")
print(JSON_MARK + json.dumps(_out))
"""


def measure_in_kernel(names: list[str], sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """The fork family's timing loop, run as one cell of a fresh ipykernel."""
    code = KERNEL_CELL.format(bench=str(BENCH), names=names, sizes=sizes, repeats=repeats)
    return run_in_kernel(code, timeout=240.0)


# --------------------------------------------------------------------------- summaries
def _ratio(data: dict, context: str, num: str, den: str) -> dict[str, float]:
    summary = data["summary"].get(context, {})
    a, b = summary.get(num, {}), summary.get(den, {})
    return {
        n: a[n]["median"] / b[n]["median"] for n in a if n in b and a[n].get("n") and b[n].get("n")
    }


def ratios(data: dict) -> dict[str, dict[str, dict[str, float]]]:
    """``{ratio name: {context: {N: value}}}`` from the medians."""
    pairs = {
        "nb_dist fork / raw fork": ("nb_dist fork", "raw fork (floor)", ("plain", "ipykernel")),
        "nb_dist fork / accelerate": ("nb_dist fork", "accelerate", ("plain", "ipykernel")),
        "accelerate / raw fork": ("accelerate", "raw fork (floor)", ("plain", "ipykernel")),
        "nb_dist spawn / raw spawn": ("nb_dist spawn", "raw spawn (torch)", ("plain",)),
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for label, (num, den, contexts) in pairs.items():
        out[label] = {c: _ratio(data, c, num, den) for c in contexts if c in data["summary"]}
    return out


# --------------------------------------------------------------------------- report
def _cell(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "n/a"
    return f"{entry['median']:.3f} ({entry['min']:.3f}-{entry['max']:.3f}, p95 {entry['p95']:.3f})"


def markdown(data: dict) -> str:
    sizes = data["params"]["sizes"]
    head = " | ".join(f"N={n}: median s (min-max, p95)" for n in sizes)
    lines = [
        f"| where | method | {head} |",
        "| --- | --- | " + " | ".join("---" for _ in sizes) + " |",
    ]
    for context in ("plain", "ipykernel"):
        for name, per_n in data["summary"].get(context, {}).items():
            cells = " | ".join(_cell(per_n.get(str(n))) for n in sizes)
            lines.append(f"| {context} | {name} | {cells} |")
    lines += [
        "",
        "| ratio of medians | where | " + " | ".join(f"N={n}" for n in sizes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in sizes) + " |",
    ]
    for label, per_context in data["ratios"].items():
        for context, per_n in per_context.items():
            values = [per_n.get(str(n)) for n in sizes]
            shown = " | ".join("n/a" if v is None else f"{v:.2f}x" for v in values)
            lines.append(f"| {label} | {context} | {shown} |")
    p = data["params"]
    notes = [
        "",
        f"Fork family: {p['repeats']} timed launches per cell after one discarded warm-up per "
        f"method and N; spawn family (plain process only: spawned workers do not inherit the "
        f"kernel): {p['spawn_repeats']} per cell after one warm-up per method. Accelerate at "
        "N=1 runs the function in the calling process (no launch): n/a.",
    ]
    plain = data["ratios"].get("nb_dist fork / raw fork", {}).get("plain", {})
    versus = data["ratios"].get("nb_dist fork / accelerate", {}).get("plain", {})
    spawn = data["ratios"].get("nb_dist spawn / raw spawn", {}).get("plain", {})
    if plain:
        text = (
            "nb_dist fork launches in "
            + ", ".join(f"{plain[n]:.2f}x" for n in sorted(plain, key=int))
            + " the raw-fork floor (N="
            + ", ".join(sorted(plain, key=int))
            + ")"
        )
        if versus:
            text += ", " + ", ".join(f"{versus[n]:.2f}x" for n in sorted(versus, key=int))
            text += " Accelerate's (N=" + ", ".join(sorted(versus, key=int)) + ")"
        if spawn:
            text += "; nb_dist spawn costs " + ", ".join(
                f"{spawn[n]:.2f}x" for n in sorted(spawn, key=int)
            )
            text += (
                " torch's own spawn: both pay one `import torch` per worker, and torch's workers"
                " also re-import the caller's `__main__` and end with a full interpreter"
                " shutdown (nb_dist's leave with `os._exit`)"
            )
        notes.append(text + ".")
    machine = data.get("machine", {})
    load = f"load average {data.get('loadavg_before')} before, {data.get('loadavg_after')} after"
    notes.append(
        f"{machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, accelerate "
        f"{machine.get('accelerate') or 'not installed'}; {load}; run took "
        f"{data.get('seconds', 0):.0f} s."
    )
    hung = [
        f"{context} {name} N={n}: {count}"
        for context, per_name in data.get("hung", {}).items()
        for name, per_n in per_name.items()
        for n, count in per_n.items()
    ]
    if hung:
        notes.append(
            f"Hung launches (workers killed after {p['hang_limit']} s, not timed): "
            + "; ".join(hung)
            + "."
        )
    if data.get("kernel_error"):
        notes.append(f"The ipykernel part failed: {data['kernel_error']}")
    return "\n".join(lines + notes) + "\n"


def targets(data: dict) -> list[dict]:
    """Per N: nb_dist fork <= 1.25x the raw-fork floor and below Accelerate (plain, kernel)."""
    out = []
    summary = data["summary"]
    for context in ("plain", "ipykernel"):
        where = "" if context == "plain" else ", in ipykernel"
        rows = summary.get(context, {})
        ours = rows.get("nb_dist fork", {})
        floor = rows.get("raw fork (floor)", {})
        acc = rows.get("accelerate", {})
        for n in data["params"]["sizes"]:
            key = str(n)
            mine, base = ours.get(key, {}), floor.get(key, {})
            if mine.get("n") and base.get("n"):
                r = mine["median"] / base["median"]
                measured = f"{r:.2f}x ({mine['median']:.3f} s vs {base['median']:.3f} s)"
                met: bool | None = r <= TARGET_FLOOR_RATIO
            else:
                measured, met = "not measured", None
            out.append(
                {
                    "name": f"launch, nb_dist fork vs raw fork, N={n}{where}",
                    "target": f"<= {TARGET_FLOOR_RATIO}x the raw-fork floor",
                    "measured": measured,
                    "met": met,
                }
            )
        for n in data["params"]["sizes"]:
            if n not in data["params"]["accelerate_sizes"]:
                continue  # accelerate does not launch at N=1
            key = str(n)
            mine, theirs = ours.get(key, {}), acc.get(key, {})
            if mine.get("n") and theirs.get("n"):
                measured = f"{mine['median']:.3f} s vs {theirs['median']:.3f} s"
                met = mine["median"] < theirs["median"]
            else:
                measured, met = "not measured (accelerate missing or failed)", None
            out.append(
                {
                    "name": f"launch, nb_dist fork vs Accelerate, N={n}{where}",
                    "target": "below Accelerate's",
                    "measured": measured,
                    "met": met,
                }
            )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [str(n) for n in data["params"]["sizes"]]
    series = [
        ("plain", "nb_dist fork", "#1f77b4", ""),
        ("plain", "raw fork (floor)", "#7fb8e0", ""),
        ("plain", "accelerate", "#2ca02c", ""),
        ("ipykernel", "nb_dist fork", "#1f77b4", "//"),
        ("ipykernel", "raw fork (floor)", "#7fb8e0", "//"),
        ("ipykernel", "accelerate", "#2ca02c", "//"),
        ("plain", "nb_dist spawn", "#d62728", ""),
        ("plain", "raw spawn (torch)", "#ff9896", ""),
    ]
    series = [s for s in series if data["summary"].get(s[0], {}).get(s[1])]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    width = 0.8 / max(1, len(series))
    for i, (context, name, color, hatch) in enumerate(series):
        per_n = data["summary"][context][name]
        xs, ys, lo, hi = [], [], [], []
        for j, n in enumerate(sizes):
            entry = per_n.get(n)
            if not entry or not entry.get("n"):
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(entry["median"])
            lo.append(entry["median"] - entry["min"])
            hi.append(entry["max"] - entry["median"])
        label = name if context == "plain" else f"{name}, in ipykernel"
        ax.bar(
            xs,
            ys,
            width,
            yerr=[lo, hi],
            capsize=2,
            color=color,
            hatch=hatch,
            edgecolor="black",
            linewidth=0.4,
            label=label,
            error_kw={"elinewidth": 0.8},
        )
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 12)  # room for the legend above the bars
    ax.set_xticks(range(len(sizes)), [f"N={n}" for n in sizes])
    ax.set_xlabel("workers (N)")
    ax.set_ylabel("launch wall time, s (log scale)")
    ax.set_title("Launch latency, trivial gloo job: median, whiskers min-max")
    ax.legend(fontsize=6.5, ncol=3, loc="upper left")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~30 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--repeats", type=int, help="timed fork-family launches per cell")
    parser.add_argument("--spawn-repeats", type=int, help="timed spawn launches per cell")
    parser.add_argument(
        "--kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the fork family inside a real ipykernel (default on)",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    spawn_repeats = args.spawn_repeats or (1 if args.quick else 2)
    spawn_sizes = (1, 2) if args.quick else SIZES
    # One thread per process everywhere, as in a notebook launch on a small machine.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

    began = time.perf_counter()
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    fork = [name for name in FORK_FAMILY if name != "accelerate" or accelerate_version()]
    plain_fork = measure(fork, SIZES, repeats, "per_n", label="plain fork ")
    plain_spawn = measure(list(SPAWN_FAMILY), spawn_sizes, spawn_repeats, "once", "plain spawn ")
    samples: dict[str, dict] = {"plain": {**plain_fork["samples"], **plain_spawn["samples"]}}
    hung: dict[str, dict] = {"plain": {**plain_fork["hung"], **plain_spawn["hung"]}}
    kernel_error = None
    if args.kernel:
        try:
            in_kernel = measure_in_kernel(fork, SIZES, repeats)
            samples["ipykernel"] = in_kernel["samples"]
            hung["ipykernel"] = in_kernel["hung"]
        except (TimeoutError, RuntimeError) as exc:
            kernel_error = f"{type(exc).__name__}: {exc}"
            print(f"ipykernel: skipped, {kernel_error}", file=sys.stderr, flush=True)

    data: dict[str, Any] = {
        "what": "launch latency of a trivial gloo function (init, all_reduce, destroy)",
        "unit": "seconds",
        "params": {
            "quick": args.quick,
            "sizes": list(SIZES),
            "spawn_sizes": list(spawn_sizes),
            "accelerate_sizes": list(LAUNCHERS["accelerate"][1]) if "accelerate" in fork else [],
            "repeats": repeats,
            "spawn_repeats": spawn_repeats,
            "warmup": "fork family: 1 per method and N; spawn family: 1 per method",
            "hang_limit": HANG_LIMIT,
            "omp_num_threads": 1,
        },
        "samples": samples,
        "summary": {
            context: {
                name: {n: stats(values) for n, values in per_n.items()}
                for name, per_n in per_name.items()
            }
            for context, per_name in samples.items()
        },
        "hung": hung,
        "kernel_error": kernel_error,
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - began, 1),
    }
    data["ratios"] = ratios(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
