"""Scaling: time per training step for 1 to 4 ranks at a fixed global batch, against simple models.

A compute-bound DDP training loop (bench/_ddp_loop.py: an MLP 256->1024->1024->10, 1.3 M
parameters, SGD, cross-entropy; the GLOBAL batch of 768 split evenly over the ranks, so the total
work per step is the same at every N) runs under ``nb_dist.notebook_launcher`` (fork, gloo, one
intra-op thread per rank) with N = 1, 2, 3 and 4 ranks. Each rank times every step with
``time.perf_counter``; T_N is the slowest rank's median step. In the same launch, after
training, every rank times bare ``all_reduce`` calls of a flat tensor as large as the model's
gradients (each after a barrier): T_comm(N), the slowest rank's median.

The table and plot put T_N next to:

- the ideal T_1 / N (perfect division of the work);
- the simple model T_1 / N + T_comm(N) (the work divided, plus one gradient all_reduce, no
  overlap);
- the core-limited model T_1 / min(N, cores) + T_comm(N): ranks beyond the number of cores
  time-share them, so the work cannot be done faster than by ``cores`` ranks.

The Ns run in ``--rounds`` interleaved rounds (the order rotated every round); values are medians
over rounds. Machine facts recorded: ``os.cpu_count()`` and ``len(os.sched_getaffinity(0))``.
CUDA is never touched in this process: a throw-away child counts GPUs (nb_dist's probe); with
none, the NCCL run is reported as not done.

Run: ``python bench/scaling.py`` (about 45 s on 2 cores; ``--quick`` about 20 s). Writes
``bench/results/scaling.json`` and prints a markdown table. No target: it shows what N ranks buy
on this machine, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _common import RESULTS, publish, stats
from _ddp_loop import train

import nb_dist
from nb_dist._kernel._preflight import probe_cuda

NAME = "scaling"
SIZES = (256, 1024, 1024, 10)
GLOBAL_BATCH = 768  # divisible by 1, 2, 3 and 4
NS = (1, 2, 3, 4)
HANG_LIMIT = 120.0  # a launch taking longer is hung: its workers are killed, it is not timed
NO_GPU = "no GPU on this machine: NCCL run not done"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --------------------------------------------------------------------------- running
def kill_children() -> list[int]:
    """Kill every descendant of this process (a hung launch's workers); their pids."""
    victims = psutil.Process().children(recursive=True)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(victims, timeout=5)
    return [proc.pid for proc in victims]


def launch(n: int, p: dict[str, Any]) -> dict[str, Any] | None:
    """One launch with n ranks: T_N, T_comm and every rank's record; None if it hung."""
    fired = threading.Event()

    def watchdog() -> None:
        fired.set()
        kill_children()

    timer = threading.Timer(HANG_LIMIT, watchdog)
    timer.daemon = True
    args = (
        p["steps"],
        p["warmup"],
        SIZES,
        GLOBAL_BATCH // n,
        "plain",
        None,
        p["comm_rounds"],
        True,
    )
    began = time.perf_counter()
    timer.start()
    try:
        result = nb_dist.notebook_launcher(
            train, args, num_processes=n, device="cpu", threads_per_process=1
        )
    except Exception:
        if not fired.is_set():
            raise
        print(f"N={n}: hung, killed after {HANG_LIMIT:g} s", file=sys.stderr, flush=True)
        return None
    finally:
        timer.cancel()
    ranks = sorted(result[0], key=lambda r: r["rank"])
    return {
        "wall_s": time.perf_counter() - began,
        "step_s": max(r["median_s"] for r in ranks),
        "loop_mean_s": max(r["loop_mean_s"] for r in ranks),
        "comm_s": max(r["comm"]["median_s"] for r in ranks),
        "grad_numel": ranks[0]["grad_numel"],
        "final_loss": [r["final_loss"] for r in ranks],
        "ranks": ranks,
    }


def measure(p: dict[str, Any]) -> dict[str, Any]:
    launches: dict[str, list[dict]] = {str(n): [] for n in NS}
    order, hung = [], {}
    for round_index in range(p["rounds"]):
        shift = round_index % len(NS)
        this_round = list(NS[shift:] + NS[:shift])
        order.append(this_round)
        for n in this_round:
            sample = launch(n, p)
            if sample is None:
                hung[str(n)] = hung.get(str(n), 0) + 1
                continue
            sample["round"] = round_index
            launches[str(n)].append(sample)
        done = ", ".join(
            f"N={n} {launches[str(n)][-1]['step_s'] * 1e3:.1f}" for n in NS if launches[str(n)]
        )
        print(f"round {round_index + 1}/{p['rounds']}: {done} (ms/step)", file=sys.stderr)
    return {"launches": launches, "order": order, "hung": hung}


def summarize(launches: dict[str, list[dict]], cores: int) -> dict[str, Any]:
    """Per N: T_N, T_comm (stats over rounds) and the three models built from T_1."""
    per_n: dict[str, Any] = {}
    for n, samples in launches.items():
        if samples:
            per_n[n] = {
                "T_N_s": stats([s["step_s"] for s in samples]),
                "loop_mean_s": stats([s["loop_mean_s"] for s in samples]),
                "T_comm_s": stats([s["comm_s"] for s in samples]),
            }
    if "1" not in per_n:
        return per_n
    t1 = per_n["1"]["T_N_s"]["median"]
    for n, entry in per_n.items():
        count, t_n = int(n), entry["T_N_s"]["median"]
        comm = entry["T_comm_s"]["median"]
        entry["ideal_s"] = t1 / count
        entry["model_s"] = t1 / count + comm
        entry["core_limited_s"] = t1 / min(count, cores) + comm
        entry["speedup"] = t1 / t_n
        entry["efficiency"] = t1 / t_n / count
    return per_n


# --------------------------------------------------------------------------- report
def markdown(data: dict) -> str:
    per = data["per_n"]
    cores = data["cores"]
    lines = [
        "| N | T_N ms, median (min-max) | ideal T_1/N | model T_1/N + T_comm | core-limited "
        "T_1/min(N,cores) + T_comm | T_comm ms | speedup | efficiency |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in map(str, NS):
        e = per.get(n)
        if e is None or "ideal_s" not in e:
            lines.append(f"| {n} | n/a | | | | | | |")
            continue
        t = e["T_N_s"]
        lines.append(
            f"| {n} | {t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}) | "
            f"{e['ideal_s'] * 1e3:.1f} | {e['model_s'] * 1e3:.1f} | "
            f"{e['core_limited_s'] * 1e3:.1f} | {e['T_comm_s']['median'] * 1e3:.2f} | "
            f"{e['speedup']:.2f}x | {100 * e['efficiency']:.0f} % |"
        )
    p, m = data["params"], data["machine"]
    lines += [
        "",
        f"MLP {'->'.join(map(str, SIZES))} ({data['grad_numel']:,} parameters, so T_comm is an "
        f"all_reduce of {data['grad_numel'] * 4 / 2**20:.1f} MiB), global batch {GLOBAL_BATCH} "
        f"split over N ranks, nb_dist fork, DDP over gloo, one thread per rank; {p['steps']} "
        f"timed steps after {p['warmup']} warm-up steps, {p['comm_rounds']} timed all_reduces, "
        f"{p['rounds']} interleaved rounds. T_N: the slowest rank's median step. "
        f"os.cpu_count() = {cores['cpu_count']}, usable cores (sched_getaffinity) = "
        f"{cores['usable']}; load average before/after {data['loadavg_before']} / "
        f"{m['loadavg']}.",
        "",
        f"Why {cores['usable']} cores limit scaling: each rank is one single-threaded process, so "
        f"at most {cores['usable']} ranks compute at once; ranks beyond that time-share the "
        "cores, and T_N cannot drop below about T_1 / cores however many ranks run. "
        "The all_reduce, gloo's threads, the launching process (the kernel, in a notebook) and "
        "other programs compete for the same cores, and a rank "
        "that is descheduled holds up every other rank at the next all_reduce.",
        "",
        f"GPU: {data['gpu_note']}.",
    ]
    if data["hung"]:
        hung = ", ".join(f"N={n}: {count}" for n, count in data["hung"].items())
        lines.append(f"Hung launches (killed after {HANG_LIMIT:g} s, not timed): {hung}.")
    return "\n".join(lines) + "\n"


def targets(data: dict) -> list[dict]:
    """No target: informative entries (met=None) for the speedups and the GPU run."""
    out = []
    for n in map(str, NS[1:]):
        e = data["per_n"].get(n)
        out.append(
            {
                "name": f"scaling: speedup T_1/T_N at N={n} (informative)",
                "target": f"none (ideal {n}x; this machine has {data['cores']['usable']} cores)",
                "measured": "n/a" if e is None or "speedup" not in e else f"{e['speedup']:.2f}x",
                "met": None,
            }
        )
    out.append(
        {
            "name": "scaling: NCCL run on GPUs (informative)",
            "target": "none",
            "measured": data["gpu_note"],
            "met": None,
        }
    )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = data["per_n"]
    ns = [int(n) for n in map(str, NS) if n in per and "ideal_s" in per[n]]
    entries = [per[str(n)] for n in ns]

    def ms(key: str) -> list[float]:
        return [e[key] * 1e3 for e in entries]

    measured = [e["T_N_s"]["median"] * 1e3 for e in entries]
    spread = [
        [(e["T_N_s"]["median"] - e["T_N_s"]["min"]) * 1e3 for e in entries],
        [(e["T_N_s"]["max"] - e["T_N_s"]["median"]) * 1e3 for e in entries],
    ]
    cores = data["cores"]["usable"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4), dpi=120)
    left.errorbar(ns, measured, yerr=spread, fmt="o-", capsize=4, label="measured T_N (min-max)")
    left.plot(ns, ms("ideal_s"), "--", label="ideal T_1/N")
    left.plot(ns, ms("model_s"), ":", marker="s", label="model T_1/N + T_comm")
    left.plot(ns, ms("core_limited_s"), "-.", label="T_1/min(N, cores) + T_comm")
    left.set_xlabel("ranks N")
    left.set_ylabel("time per step (ms)")
    left.set_xticks(ns)
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    left.set_title("Time per step, fixed global batch")

    right.plot(ns, [e["speedup"] for e in entries], "o-", label="measured T_1/T_N")
    right.plot(ns, ns, "--", label="ideal N")
    right.plot(ns, [min(n, cores) for n in ns], "-.", label=f"core limit ({cores} cores)")
    right.set_xlabel("ranks N")
    right.set_ylabel("speedup (x)")
    right.set_xticks(ns)
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    right.set_title("Speedup over 1 rank")
    fig.suptitle(f"DDP scaling on {cores} cores (gloo, nb_dist fork)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (~20 s)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per launch (30, quick 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (3, quick 2)")
    parser.add_argument("--comm-rounds", type=int, help="timed all_reduces (20, quick 5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    p = {
        "rounds": args.rounds or (2 if args.quick else 3),
        "steps": args.steps or (10 if args.quick else 30),
        "warmup": args.warmup or (2 if args.quick else 3),
        "comm_rounds": args.comm_rounds or (5 if args.quick else 20),
        "quick": args.quick,
        "mlp": list(SIZES),
        "global_batch": GLOBAL_BATCH,
        "ns": list(NS),
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = {"cpu_count": os.cpu_count(), "usable": usable_cores()}
    gpus = probe_cuda().gpus  # counted in a throw-away child: CUDA stays untouched here
    gpu_note = NO_GPU if gpus == 0 else f"{gpus} GPU(s) visible; this run is CPU/gloo only"
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    try:
        measured = measure(p)
    finally:
        leftover = kill_children()
    if leftover:
        print(f"killed leftover processes {leftover}", file=sys.stderr)
    launches = measured["launches"]
    losses = {tuple(round(x, 6) for x in s["final_loss"]) for v in launches.values() for s in v}
    data = {
        "params": p,
        "cores": cores,
        "gpus": gpus,
        "gpu_note": gpu_note,
        "loadavg_before": loadavg_before,
        "grad_numel": next(s["grad_numel"] for v in launches.values() for s in v),
        "per_n": summarize(launches, cores["usable"]),
        "distinct_final_losses": len(losses),
        "order": measured["order"],
        "hung": measured["hung"],
        "leftover_processes_killed": leftover,
        "launches": launches,
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
