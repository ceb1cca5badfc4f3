"""Collective counter overhead: what counting every torch.distributed collective costs.

``nb_dist/_shared/_collectives.py`` wraps each Python-level collective so that a hang report can say
which collective each rank waits in and how many each rank entered. Two measurements:

- **per call**: in a world of 1 (gloo, one forked process), ``dist.all_reduce`` of a 1-element
  tensor through the wrapper against the original function, ``--calls`` calls each, in
  ``--micro-rounds`` interleaved rounds (the order flipped every round); the overhead is the
  median of the rounds' paired differences (ns per call). A gloo all_reduce costs tens of
  microseconds, so that difference is noisy: the wrapper alone is also timed around a no-op
  function (the same wrapper code, its mmap writes included), which is precise;
- **per training step**: 2 ranks (forked, gloo, one thread each) train an MLP
  64->256->256->10 on a batch of 64 with a hand-written data parallelism: one ``all_reduce``
  per parameter gradient (6 collectives per step), then SGD. After untimed warm-up steps, each
  rank runs ``--rounds`` rounds of three chunks of ``--steps`` steps: ``plain``, ``counted``
  (counter installed) and ``control`` (plain again), ``install``/``uninstall`` between chunks
  after a barrier, the order rotated every round; every step is timed with ``perf_counter``.
  A step's time is the slower rank's. The overhead is the ratio of the median counted and
  plain steps, minus 1. The control is an A/A comparison (control / plain - 1, which is 0
  but for noise): on a small shared machine a gloo step's time has a heavy tail (scheduling
  of 2 ranks and gloo's threads on 2 cores) and drifts by tens of percent within seconds, and
  the control shows how large a difference this run could resolve. CPU time per step is shown
  too. Each counted chunk checks that the counter saw exactly 6 collectives per step.

DDP is not used on purpose: its gradient all-reduces run in C++ and are not counted, so DDP
would pay nothing. Run: ``python bench/collective_counter.py`` (about a minute on 2 cores;
``--quick`` about 20 s). Writes ``bench/results/collective_counter.json`` and prints markdown.
Target: the counter adds <= 1 % to the training step; n/a when the control (A/A) differs by
more than 1 % itself, since the run then cannot resolve 1 %.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, publish, stats

NAME = "collective_counter"
SIZES = (64, 256, 256, 10)
BATCH = 64
RANKS = 2
TARGET_PCT = 1.0
MODES = ("plain", "counted", "control")  # control: plain again, the A/A comparison
HANG_LIMIT = 300.0  # a run taking longer is stuck: its processes are killed


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- per call
def micro(p: dict[str, Any], path: str, port: int, queue: Any) -> None:
    """A world of 1: ns per call of the wrapped and the original all_reduce, and of the wrapper
    around a no-op."""
    import torch
    import torch.distributed as dist

    from nb_dist._shared import _collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _collectives.install(path)
    wrapped = dist.all_reduce
    original = _collectives._originals[(dist, "all_reduce")]
    tensor = torch.ones(1)

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    counted_noop = _collectives._wrap(0, noop)

    def per_call(fn: Any, n: int, *args: Any) -> float:
        began = time.perf_counter_ns()
        for _ in range(n):
            fn(*args)
        return (time.perf_counter_ns() - began) / n

    for fn in (wrapped, original):  # warm-up
        per_call(fn, p["calls"] // 4, tensor)
    rounds: dict[str, list[float]] = {
        "all_reduce wrapped": [],
        "all_reduce original": [],
        "no-op wrapped": [],
        "no-op": [],
    }
    for r in range(p["micro_rounds"]):
        pairs = [("all_reduce wrapped", wrapped), ("all_reduce original", original)]
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            rounds[name].append(per_call(fn, p["calls"], tensor))
        pairs = [("no-op wrapped", counted_noop), ("no-op", noop)]
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            rounds[name].append(per_call(fn, p["noop_calls"]))
    counted = _collectives.count()
    _collectives.uninstall()
    dist.destroy_process_group()
    queue.put({"rounds": rounds, "counted": counted})


# --------------------------------------------------------------------------- per step
def rank_main(rank: int, p: dict[str, Any], path: str, port: int, queue: Any) -> None:
    """One of 2 ranks: warm-up, then rounds of plain, counted and control chunks of steps."""
    import torch
    import torch.distributed as dist

    from nb_dist._shared import _collectives

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS
    )
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index, (n_in, n_out) in enumerate(itertools.pairwise(SIZES)):
        if index:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(n_in, n_out))
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [
        (torch.randn(BATCH, SIZES[0], generator=gen), torch.randint(0, SIZES[-1], (BATCH,)))
        for _ in range(8)
    ]

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        for param in params:  # hand-written data parallelism: one all_reduce per gradient
            dist.all_reduce(param.grad)
            param.grad.div_(RANKS)
        optimizer.step()
        return loss.item()

    for i in range(p["warmup"]):
        step(i)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu = dict.fromkeys(MODES, 0.0)
    for r in range(p["rounds"]):
        shift = r % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            dist.barrier()  # both ranks start the chunk together
            if mode == "counted":
                _collectives.install(path)
            else:
                _collectives.uninstall()
            began_cpu = time.process_time()
            for i in range(p["steps"]):
                began = time.perf_counter()
                loss = step(i)
                times[mode].append(time.perf_counter() - began)
            cpu[mode] += time.process_time() - began_cpu
            if mode == "counted" and _collectives.count() != p["steps"] * len(params):
                raise RuntimeError(
                    f"counted {_collectives.count()} collectives, expected {p['steps']} x 6"
                )
            _collectives.uninstall()
    dist.destroy_process_group()
    queue.put(
        {
            "rank": rank,
            "collectives_per_step": len(params),
            "loss": loss,
            "times": times,
            "cpu_per_step": {mode: cpu[mode] / len(times[mode]) for mode in cpu},
        }
    )


# --------------------------------------------------------------------------- running
def _run(targets: list[tuple[Any, tuple[Any, ...]]], queue: Any) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=fn, args=(*args, queue)) for fn, args in targets]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + HANG_LIMIT
    out = []
    try:
        for _ in procs:
            out.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    bad = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if bad:
        raise RuntimeError(f"benchmark processes failed: exit codes {bad}")
    return out


def measure(p: dict[str, Any]) -> dict[str, Any]:
    from nb_dist._shared import _collectives

    queue = multiprocessing.get_context("fork").Queue()
    paths = [_collectives.create(_folder(), rank) for rank in range(RANKS)]
    try:
        (micro_out,) = _run([(micro, (p, paths[0], _free_port()))], queue)
        port = _free_port()
        ranks = _run([(rank_main, (rank, p, paths[rank], port)) for rank in range(RANKS)], queue)
    finally:
        for path in paths:
            os.unlink(path)
    return {"micro": micro_out, "ranks": sorted(ranks, key=lambda r: r["rank"])}


def summarize(measured: dict[str, Any], chunk: int) -> dict[str, Any]:
    rounds = measured["micro"]["rounds"]
    diffs = [
        w - o
        for w, o in zip(rounds["all_reduce wrapped"], rounds["all_reduce original"], strict=True)
    ]
    noop_diffs = [w - o for w, o in zip(rounds["no-op wrapped"], rounds["no-op"], strict=True)]
    per_call = {name: stats(values) for name, values in rounds.items()}
    ranks = measured["ranks"]
    # A step's time is the slower rank's (the ranks wait for each other in every all_reduce).
    steps = {
        mode: [max(t) for t in zip(*(r["times"][mode] for r in ranks), strict=True)]
        for mode in MODES
    }
    step_stats = {mode: stats(steps[mode]) for mode in MODES}
    cpu = {mode: statistics.fmean(r["cpu_per_step"][mode] for r in ranks) for mode in MODES}
    rounds_pct = {
        mode: [
            100
            * (
                statistics.median(steps[mode][i : i + chunk])
                / statistics.median(steps["plain"][i : i + chunk])
                - 1
            )
            for i in range(0, len(steps["plain"]), chunk)
        ]
        for mode in ("counted", "control")
    }
    plain = step_stats["plain"]["median"]
    per_step_collectives = ranks[0]["collectives_per_step"]
    wrapper_ns = statistics.median(noop_diffs)
    return {
        "per_call_ns": per_call,
        "all_reduce_overhead_ns": stats(diffs),
        "wrapper_ns": stats(noop_diffs),
        "step_s": step_stats,
        "cpu_per_step_s": cpu,
        "overhead_pct": 100 * (step_stats["counted"]["median"] / plain - 1),
        "control_pct": 100 * (step_stats["control"]["median"] / plain - 1),
        "cpu_overhead_pct": 100 * (cpu["counted"] / cpu["plain"] - 1),
        "cpu_control_pct": 100 * (cpu["control"] / cpu["plain"] - 1),
        "round_pct": rounds_pct,
        "collectives_per_step": per_step_collectives,
        # What the wrapper's own cost predicts for one step.
        "estimated_pct": 100 * per_step_collectives * wrapper_ns * 1e-9 / plain,
        "steps_us": {mode: [round(t * 1e6, 1) for t in steps[mode]] for mode in MODES},
    }


# --------------------------------------------------------------------------- report
def markdown(data: dict) -> str:
    call, p, m = data["per_call_ns"], data["params"], data["machine"]

    def ns(key: str) -> str:
        s = call[key]
        return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"

    over = data["all_reduce_overhead_ns"]
    wrap = data["wrapper_ns"]
    steps = data["step_s"]

    def us(s: dict) -> str:
        return f"{s['median'] * 1e6:,.0f} (p95 {s['p95'] * 1e6:,.0f}, n {s['n']:,})"

    def spread(mode: str) -> str:
        pct = sorted(data["round_pct"][mode])
        q1, q3 = pct[len(pct) // 4], pct[(3 * len(pct)) // 4]
        return f"{q1:+.0f} to {q3:+.0f} %"

    lines = [
        "| per call | ns, median over rounds (min-max) |",
        "| --- | ---: |",
        f"| `dist.all_reduce` of 1 element, world of 1, original | {ns('all_reduce original')} |",
        f"| the same through the counter | {ns('all_reduce wrapped')} |",
        f"| difference (paired per round) | {over['median']:,.0f} "
        f"({over['min']:,.0f} to {over['max']:,.0f}) |",
        f"| the wrapper alone (around a no-op), paired | {wrap['median']:,.0f} "
        f"({wrap['min']:,.0f}-{wrap['max']:,.0f}) |",
        "",
        "| training step, 2 ranks | median step µs | vs plain: ratio of medians - 1 | per round, "
        "middle half | CPU per step vs plain |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| plain | {us(steps['plain'])} | | | |",
        f"| counter installed | {us(steps['counted'])} | {data['overhead_pct']:+.2f} % | "
        f"{spread('counted')} | {data['cpu_overhead_pct']:+.2f} % |",
        f"| control (plain again: A/A) | {us(steps['control'])} | {data['control_pct']:+.2f} % | "
        f"{spread('control')} | {data['cpu_control_pct']:+.2f} % |",
        "",
        f"Expected from the wrapper's own cost: {data['collectives_per_step']} x "
        f"{wrap['median']:.0f} ns per step = {data['estimated_pct']:+.3f} % of the plain step.",
        "",
        f"Per call: {p['micro_rounds']} interleaved rounds of {p['calls']:,} all_reduce calls "
        f"each way and {p['noop_calls']:,} no-op calls each way, gloo, one process. Training: "
        f"MLP {'->'.join(map(str, SIZES))}, batch {BATCH} per rank, "
        f"{data['collectives_per_step']} all_reduces per step (one per gradient, no DDP), "
        f"{RANKS} ranks (fork, gloo, one thread each), {p['warmup']} warm-up steps, then "
        f"{p['rounds']} rounds of {p['steps']} plain, {p['steps']} counted and {p['steps']} "
        "control steps (the order rotated every round; install/uninstall between chunks). A "
        "step's time is the slower rank's. CPU: each rank's process time per step, mean of the "
        "ranks. Machine: "
        f"{m['cpu_count']} CPUs, load average before/after {data['loadavg_before']} / "
        f"{m['loadavg']}.",
    ]
    return "\n".join(lines) + "\n"


def targets(data: dict) -> list[dict]:
    """n/a (met=None) when the A/A control itself differs by more than the target: this run's
    noise then hides a difference that small."""
    pct, control = data["overhead_pct"], data["control_pct"]
    resolved = abs(control) <= TARGET_PCT
    return [
        {
            "name": "collective counter: training-step overhead, 2 ranks, 6 collectives/step",
            "target": f"<= {TARGET_PCT:g} %",
            "measured": f"{pct:+.2f} % (A/A control {control:+.2f} %); the wrapper alone: "
            f"{data['wrapper_ns']['median']:.0f} ns per collective, "
            f"{data['estimated_pct']:+.3f} % of a step",
            "met": (pct <= TARGET_PCT) if resolved else None,
        }
    ]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    for mode, color in (("counted", "tab:blue"), ("control", "tab:gray")):
        pct = data["round_pct"][mode]
        ax.plot(range(1, len(pct) + 1), pct, ".", color=color, markersize=3, label=mode)
    ax.axhline(data["overhead_pct"], color="tab:blue", linestyle="--", label="counted, overall")
    ax.axhline(data["control_pct"], color="tab:gray", linestyle="--", label="control, overall")
    ax.axhline(TARGET_PCT, color="tab:red", linestyle=":", label=f"target {TARGET_PCT:g} %")
    ax.set_ylim(-50, 50)
    ax.set_xlabel("round")
    ax.set_ylabel("median step vs plain (%)")
    ax.set_title("Collective counter: training-step overhead, 2 ranks (gloo)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (~20 s)")
    parser.add_argument("--rounds", type=int, help="training rounds (default 120, quick 20)")
    parser.add_argument("--steps", type=int, help="steps per mode and round (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 50)")
    parser.add_argument("--micro-rounds", type=int, help="per-call rounds (20, quick 6)")
    parser.add_argument("--calls", type=int, help="all_reduce calls per round (2000, quick 500)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    p = {
        "rounds": args.rounds or (20 if args.quick else 120),
        "steps": args.steps or 10,
        "warmup": args.warmup or 50,
        "micro_rounds": args.micro_rounds or (6 if args.quick else 20),
        "calls": args.calls or (500 if args.quick else 2000),
        "noop_calls": 20_000 if args.quick else 200_000,
        "quick": args.quick,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    measured = measure(p)
    data = {
        "params": p,
        "loadavg_before": loadavg_before,
        **summarize(measured, p["steps"]),
        "ranks": [
            {key: r[key] for key in ("rank", "cpu_per_step", "loss")} for r in measured["ranks"]
        ],
        "micro_rounds_ns": measured["micro"]["rounds"],
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
