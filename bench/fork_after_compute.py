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
the probe, separately) and one launch of a conv training loop on 1 rank with 2 threads,
timed per step inside the worker (median step time).

Run: ``python bench/fork_after_compute.py`` (about a minute on 2 cores; ``--quick`` less).
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
    for _ in range(steps):
        began = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - began)
    return {"step_s": times[1:], "threads": torch.get_num_threads()}


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
        "launch_s": stats(launch_s[1:]),
        "worker_threads": result[0]["threads"],
        "step_s": stats(result[0]["step_s"]),
        "kernel_step_s": stats(kernel_step),
    }


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "| mode | threads per worker | first launch s | later launches s (median) | "
        "step ms (median) | step vs floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    floor = data["modes"].get("floor", {}).get("step_s", {}).get("median")
    for mode, (label, *_rest) in MODES.items():
        entry = data["modes"].get(mode)
        if entry is None or "error" in entry:
            lines.append(f"| {label} | n/a | | | | {entry and entry.get('error')} |")
            continue
        step = entry["step_s"]["median"]
        ratio = f"{step / floor:.2f}x" if floor else "n/a"
        lines.append(
            f"| {label} | {entry['worker_threads']} | {entry['first_launch_s']:.3f} | "
            f"{entry['launch_s']['median']:.3f} | {step * 1e3:.1f} | {ratio} |"
        )
    lines += [
        "",
        "Before the release, the default (fork, 2 threads, after kernel compute) never finished: "
        "the worker waits forever in its first convolution. 1 rank, conv net "
        f"1->16->32 channels on 28x28, batch 64; {data['params']['steps']} steps timed in the "
        f"worker, {data['params']['launches']} no-op launches per mode.",
    ]
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    modes = data["modes"]
    released, floor = modes.get("released", {}), modes.get("floor", {})
    if "step_s" not in released or "step_s" not in floor:
        return []
    ratio = released["step_s"]["median"] / floor["step_s"]["median"]
    return [
        {
            "name": "fork after kernel compute: step time with the released pool vs no compute",
            "target": "<= 1.1x (the worker keeps its threads)",
            "measured": f"{ratio:.2f}x ({released['worker_threads']} threads)",
            "met": ratio <= 1.1,
        }
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if "step_s" in data["modes"].get(m, {})]
    labels = [MODES[m][0] for m in modes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    left.barh(labels, [data["modes"][m]["step_s"]["median"] * 1e3 for m in modes])
    left.set_xlabel("training step (ms, median)")
    right.barh(labels, [data["modes"][m]["launch_s"]["median"] for m in modes], label="later")
    right.barh(
        labels, [data["modes"][m]["first_launch_s"] for m in modes], alpha=0.35, label="first"
    )
    right.set_xscale("log")
    right.set_xlabel("launch of a no-op (s, log)")
    right.legend(loc="lower right")
    right.set_yticklabels([])
    fig.suptitle("Threaded workers after the kernel computed: the safe ways, compared")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--mode", choices=list(MODES), help="(internal) run one mode here")
    parser.add_argument("--launches", type=int)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args(argv)
    params = {
        "launches": args.launches or (3 if args.quick else 6),
        "steps": args.steps or (8 if args.quick else 25),
        "threads": THREADS,
    }
    if args.mode:
        print(json.dumps(run_mode(args.mode, params["launches"], params["steps"])))
        return 0
    modes: dict[str, Any] = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode]
        cmd += ["--launches", str(params["launches"]), "--steps", str(params["steps"])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if run.returncode != 0:
            modes[mode] = {"error": run.stderr.strip().splitlines()[-1:]}
            continue
        modes[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    return publish(sys.modules[__name__], {"params": params, "modes": modes}, args.out)


if __name__ == "__main__":
    sys.exit(main())
