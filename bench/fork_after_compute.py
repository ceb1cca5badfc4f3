"""Fork after the kernel computed: what each safe way of starting threaded workers costs.

Once the kernel has run a multi-threaded torch op, its OpenMP pool makes a forked worker with
more than one thread hang in its first parallel op (the default before nb_dist released the
pool: it never finishes, so it has no time to report). This compares, in one run and on the
same machine, the ways that do finish:

- ``fork, no kernel compute``: the floor; the kernel never ran a parallel op;
- ``fork, pool released`` (nb_dist's default): the kernel computed, the launcher releases its
  OpenMP pool before forking, and the worker keeps its threads;
- ``fork, 1 thread`` (the fallback where a runtime cannot release its pool,
  ``NB_DIST_RELEASE_OPENMP=0``): the probe finds the hang, the worker gets one thread;
- ``forkserver``: fresh processes with all their threads, the function shipped by value.

Each mode runs in a fresh interpreter (``--mode``): the "kernel" sets 2 intra-op threads and,
except for the floor, trains a small conv net for a few steps first. Then it times ``--launches``
launches of a no-op function (launch latency; the first, which starts the forkserver or runs
the probe, separately) and one launch of a conv training loop on 1 rank with 2 threads, timed
per step inside the worker: the median step's wall time, and the worker's CPU time per step
(all its threads: ``time.process_time``). The worker also reports its torch thread setting and
how many OS threads it had at the end (main thread + OpenMP pool: the pool was really used).

The modes run in ``--rounds`` interleaved rounds (every mode once per round, a fresh interpreter
each time, the order rotated), so a burst of other work on the machine hits them all alike;
each cell is the median over rounds with the min-max range. Why rounds matter: 2 OpenMP threads
per worker on a 2-core machine that also runs other work are at the mercy of the scheduler
(a parallel region waits for its slowest thread), and the same step measured 20 ms and 200 ms
minutes apart on the machine this was written on, in every mode alike.

Run: ``python bench/fork_after_compute.py`` (about 5 minutes on 2 cores; ``--quick``: 1 round).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish, stats

NAME = "fork_after_compute"
THREADS = 2
MODES = {
    "floor": ("fork, no kernel compute", {}, "fork", False),
    "released": ("fork, pool released (default)", {}, "fork", True),
    "one_thread": ("fork, 1 thread (fallback)", {"NB_DIST_RELEASE_OPENMP": "0"}, "fork", True),
    "forkserver": ("forkserver", {}, "forkserver", True),
}


def _net() -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.Flatten(),
        nn.Linear(32 * 24 * 24, 10),
    )  # fmt: skip


def conv_steps(steps: int) -> dict[str, Any]:
    """Train the conv net for ``steps`` steps; per-step seconds and the threads used."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    times = []
    cpu_began = 0.0
    for index in range(steps):
        if index == 1:  # the first step (oneDNN set-up, pool start) is left out
            cpu_began = time.process_time()
        began = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - began)
    cpu = (time.process_time() - cpu_began) / max(1, steps - 1)
    try:
        os_threads = len(os.listdir("/proc/self/task"))
    except OSError:
        os_threads = None
    return {
        "step_s": times[1:],
        "cpu_per_step_s": cpu,
        "threads": torch.get_num_threads(),
        "os_threads": os_threads,
    }


def noop() -> int:
    return 0


def run_mode(mode: str, launches: int, steps: int) -> dict[str, Any]:
    """In this (fresh) process: prepare the 'kernel', then time launches and steps."""
    import torch

    from nb_dist import notebook_launcher

    _, env, method, compute = MODES[mode]
    os.environ.update(env)
    os.environ.pop("OMP_NUM_THREADS", None)
    torch.set_num_threads(THREADS)
    kernel_step = conv_steps(4)["step_s"] if compute else []
    launch_s = []
    for _ in range(launches):
        began = time.perf_counter()
        notebook_launcher(
            noop, num_processes=1, threads_per_process=None if mode == "one_thread" else THREADS,
            start_method=method, output="none", timeout=120,
        )  # fmt: skip
        launch_s.append(time.perf_counter() - began)
    result = notebook_launcher(
        conv_steps, args=(steps,), num_processes=1,
        threads_per_process=None if mode == "one_thread" else THREADS,
        start_method=method, output="none", timeout=300,
    )  # fmt: skip
    return {
        "first_launch_s": launch_s[0],
        "later_launch_s": launch_s[1:],
        "worker_threads": result[0]["threads"],
        "worker_os_threads": result[0]["os_threads"],
        "step_median_s": stats(result[0]["step_s"])["median"],
        "cpu_per_step_s": result[0]["cpu_per_step_s"],
        "kernel_step_s": stats(kernel_step),
    }


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode, over the rounds: medians and ranges of every measured quantity."""
    out: dict[str, Any] = {}
    for mode, results in rounds.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            out[mode] = {"error": "; ".join(str(r["error"]) for r in results)}
            continue
        out[mode] = {
            "rounds": len(ok),
            "failed_rounds": len(results) - len(ok),
            "first_launch_s": stats([r["first_launch_s"] for r in ok]),
            "launch_s": stats([x for r in ok for x in r["later_launch_s"]]),
            "step_s": stats([r["step_median_s"] for r in ok]),
            "cpu_per_step_s": stats([r["cpu_per_step_s"] for r in ok]),
            "worker_threads": sorted({r["worker_threads"] for r in ok}),
            "worker_os_threads": sorted({r["worker_os_threads"] for r in ok}),
        }
    return out


def _range(entry: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    if not entry or not entry.get("n"):
        return "n/a"
    med, lo, hi = (entry[k] * scale for k in ("median", "min", "max"))
    return f"{fmt.format(med)} ({fmt.format(lo)}-{fmt.format(hi)})"


def markdown(data: dict[str, Any]) -> str:
    p, summary = data["params"], data["summary"]
    lines = [
        "| mode | torch threads (OS threads) per worker | first no-op launch s | later no-op "
        "launches s | step ms, wall | step ms, CPU (all threads) | wall step vs floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    floor = summary.get("floor", {}).get("step_s", {}).get("median")
    for mode, (label, *_rest) in MODES.items():
        entry = summary.get(mode)
        if entry is None or "error" in entry:
            error = entry.get("error") if entry else "not run"
            lines.append(f"| {label} | n/a | n/a | n/a | n/a | n/a | failed: {error} |")
            continue
        step = entry["step_s"]["median"]
        ratio = f"{step / floor:.2f}x" if floor else "n/a"
        threads = "/".join(map(str, entry["worker_threads"]))
        os_threads = "/".join(map(str, entry["worker_os_threads"]))
        lines.append(
            f"| {label} | {threads} ({os_threads}) | {_range(entry['first_launch_s'])} | "
            f"{_range(entry['launch_s'])} | {_range(entry['step_s'], 1e3, '{:.1f}')} | "
            f"{_range(entry['cpu_per_step_s'], 1e3, '{:.1f}')} | {ratio} |"
        )
    m = data["machine"]
    lines += [
        "",
        "Medians (min-max) over rounds. Before the release, the default (fork, 2 threads, after "
        "kernel compute) never finished: the worker waits forever in its first convolution. "
        "1 rank, conv net 1->16->32 channels on 28x28, batch 64, 2 intra-op threads asked for; "
        f"{p['steps']} steps per round (the first left out), the median step's wall time; CPU: "
        "the worker's CPU time per step over all its threads. "
        f"{p['launches']} no-op launches per mode and round (the 1st apart: it starts the "
        "forkserver, or the OpenMP pool is probed). "
        f"{p['rounds']} interleaved rounds, every mode in a fresh interpreter. The fallback's "
        "no-op launch includes its probe: a throw-away child that hangs until the "
        "probe's 3 s deadline, on every launch. "
        f"{m['cpu_count']} CPUs shared with other work (load average "
        f"{data.get('loadavg_before')} before, {m['loadavg']} after): 2 threads per worker on 2 "
        "busy cores make wall step times swing by up to 10x from minute to minute; the CPU "
        "column is the steadier one. Run took "
        f"{data.get('total_seconds', 0):.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    summary = data["summary"]
    released, floor = summary.get("released", {}), summary.get("floor", {})
    if "step_s" not in released or "step_s" not in floor:
        return [
            {
                "name": "fork after kernel compute: step time with the released pool vs no compute",
                "target": "<= 1.1x (the worker keeps its threads)",
                "measured": "n/a",
                "met": None,
            }
        ]
    ratio = released["step_s"]["median"] / floor["step_s"]["median"]
    cpu = released["cpu_per_step_s"]["median"] / floor["cpu_per_step_s"]["median"]
    threads = "/".join(map(str, released["worker_threads"]))
    # Paired per round: both modes ran minutes apart at most, under the same outside load.
    pairs = [
        a["step_median_s"] / b["step_median_s"]
        for a, b in zip(data["rounds"]["released"], data["rounds"]["floor"], strict=False)
        if "error" not in a and "error" not in b
    ]
    paired = f", per round {min(pairs):.2f}-{max(pairs):.2f}" if pairs else ""
    return [
        {
            "name": "fork after kernel compute: step time with the released pool vs no compute",
            "target": "<= 1.1x (the worker keeps its threads)",
            "measured": f"{ratio:.2f}x wall{paired}; {cpu:.2f}x CPU ({threads} threads)",
            "met": ratio <= 1.1,
        }
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    modes = [m for m in MODES if "step_s" in summary.get(m, {})]
    labels = [MODES[m][0].replace(", ", ",\n", 1) for m in modes]
    ys = list(range(len(modes)))

    def whiskers(key: str, scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
        entries = [summary[m][key] for m in modes]
        meds = [e["median"] * scale for e in entries]
        err = [
            [(e["median"] - e["min"]) * scale for e in entries],
            [(e["max"] - e["median"]) * scale for e in entries],
        ]
        return meds, err

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    wall, wall_err = whiskers("step_s", 1e3)
    cpu, cpu_err = whiskers("cpu_per_step_s", 1e3)
    h = 0.38
    left.barh([y - h / 2 for y in ys], wall, h, xerr=wall_err, capsize=3, label="wall")
    left.barh(
        [y + h / 2 for y in ys], cpu, h, xerr=cpu_err, capsize=3, color="tab:green",
        label="CPU (all threads)",
    )  # fmt: skip
    left.set_yticks(ys, labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("conv training step in the worker (ms; median over rounds, min-max)")
    left.legend(fontsize=8, loc="center right")  # beside the short 1-thread bars
    later, later_err = whiskers("launch_s")
    first, first_err = whiskers("first_launch_s")
    right.barh(
        [y - h / 2 for y in ys], first, h, xerr=first_err, capsize=3, color="tab:gray",
        label="1st launch",
    )  # fmt: skip
    right.barh(
        [y + h / 2 for y in ys], later, h, xerr=later_err, capsize=3, color="tab:blue",
        label="later launches",
    )  # fmt: skip
    right.set_xscale("log")
    right.set_yticks(ys, [""] * len(ys))
    right.invert_yaxis()
    right.set_xlabel("launch of a no-op function (s, log)")
    right.legend(fontsize=8, loc="upper right")  # beside the short fork launches
    for ax in (left, right):
        ax.grid(axis="x", which="both", alpha=0.3)
    fig.suptitle(
        f"Threaded workers after the kernel computed ({data['params']['rounds']} rounds, "
        f"{data['machine']['cpu_count']} shared cores: noisy)"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _run_in_fresh_interpreter(mode: str, params: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--mode", mode]
    cmd += ["--launches", str(params["launches"]), "--steps", str(params["steps"])]
    path = [str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "no result within 600 s (hung)"}
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or [f"exit code {run.returncode}"]
        return {"error": tail[0][:300]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, fewer launches and steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--mode", choices=list(MODES), help="(internal) run one mode here")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 4, quick 1)")
    parser.add_argument("--launches", type=int, help="no-op launches per round (4, quick 3)")
    parser.add_argument("--steps", type=int, help="conv steps per round (25, quick 8)")
    args = parser.parse_args(argv)
    params = {
        "rounds": args.rounds or (1 if args.quick else 4),
        "launches": args.launches or (3 if args.quick else 4),
        "steps": args.steps or (8 if args.quick else 25),
        "threads": THREADS,
        "quick": args.quick,
    }
    if args.mode:
        print(json.dumps(run_mode(args.mode, params["launches"], params["steps"])))
        return 0
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    names = list(MODES)
    for index in range(params["rounds"]):
        shift = index % len(names)
        for mode in names[shift:] + names[:shift]:  # rotated: no mode always goes first
            result = _run_in_fresh_interpreter(mode, params)
            rounds[mode].append(result)
            shown = result.get("error") or (
                f"step {result['step_median_s'] * 1e3:.1f} ms, "
                f"CPU {result['cpu_per_step_s'] * 1e3:.1f} ms"
            )
            print(f"round {index + 1} {mode}: {shown}", file=sys.stderr, flush=True)
    data = {
        "params": params,
        "loadavg_before": loadavg_before,
        "summary": summarize(rounds),
        "rounds": rounds,
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    sys.exit(main())
