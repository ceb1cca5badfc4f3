"""Report overhead: what ``nb_dist.report()`` costs per call and per training step.

A tiny model (``Linear(32, 32)`` + SGD, batch 16, so that any per-step cost shows) is trained
for ``--steps`` steps inside a 1-rank and a 2-rank launch, in three variants:

- ``none``: no reporting (the baseline);
- ``report``: ``nb_dist.report("loss", loss)`` every step (a 0-d tensor: ``.item()`` included);
- ``print``: ``print(f"step {i} loss {loss.item():.4f}")`` every step (the usual alternative:
  every line goes through the rank's pipe, gets labelled and written by the launcher).

Each launch runs the three variants in alternating chunks (``--chunks`` per variant, the order
rotated every chunk, ``--steps`` timed steps per variant), so a change of machine load hits them
all alike; each rank measures seconds per step per variant, wall and CPU (its process's CPU
time, the reports' flusher thread included: it does not count time other programs take on a
busy machine). The table shows medians over ``--repeats`` launches of the mean over ranks, and
the overhead of ``report`` and ``print`` against ``none``: the median of the launches' paired
ratios. It also times ``report()`` itself inside a launch (ns per call for a float, a 0-d
tensor and a 32-element tensor, paced like a training loop and back to back; and
``tensor.item()`` alone for comparison), and estimates the per-step overhead from that cost.

Run: ``python bench/report_overhead.py`` (about a minute on 2 cores; ``--help`` for options).
Writes ``bench/results/report_overhead.json`` and prints a markdown table. Target: the
``report`` overhead below 2 % of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import nb_dist

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("none", "report", "print")
SIZES = (1, 2)
WARMUP = 300
TARGET_PCT = 2.0


# --------------------------------------------------------------------------- what every rank runs
def train(steps: int, chunks: int) -> dict[str, tuple[float, float]]:
    """Train the tiny model ``steps`` steps per variant; per variant, seconds per step (wall, CPU).

    The variants alternate in ``chunks`` chunks each (none, report, print, none, ...; the order
    rotated every chunk), so a change of machine load hits them all alike. CPU time is the
    whole worker process's (the reports' flusher thread included); unlike wall time it does not
    count time taken by other programs on a busy machine.
    """
    torch.manual_seed(nb_dist.rank())
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 32)

    def run(mode: str, count: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(count):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if mode == "report":
                nb_dist.report("loss", loss)
            elif mode == "print":
                print(f"step {i} loss {loss.item():.4f}")
        return time.perf_counter() - wall, time.process_time() - cpu

    run("none", WARMUP)
    totals = {mode: [0.0, 0.0] for mode in MODES}
    per_chunk = steps // chunks
    for chunk in range(chunks):
        for mode in MODES[chunk % 3 :] + MODES[: chunk % 3]:
            wall, cpu = run(mode, per_chunk)
            totals[mode][0] += wall
            totals[mode][1] += cpu
    return {
        mode: (w / (per_chunk * chunks), c / (per_chunk * chunks))
        for mode, (w, c) in totals.items()
    }


def per_call_costs(calls: int) -> dict[str, float]:
    """ns per call of report() with several kinds of value, in a launch (the sink is active).

    ``paced``: bursts of 100 calls with a 2 ms pause between them, in process CPU time (the mean
    over bursts, so the batches the caller pickles and sends itself every 512 entries are
    included): the cost to a training loop. ``tight loop``: back-to-back calls, which end up
    waiting for the kernel to take the batches (its unpickling is the limit): the channel's
    throughput, not a step cost.
    """
    scalar = torch.tensor(0.5)
    vector = torch.randn(32)
    bodies = {
        "float": lambda: nb_dist.report("f", 0.5),
        "0-d tensor": lambda: nb_dist.report("t", scalar),
        "32-element tensor": lambda: nb_dist.report("v", vector),
        "tensor.item() alone": scalar.item,
    }

    def tight(body, count: int) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter_ns()
            for _ in range(count):
                body()
            best = min(best, (time.perf_counter_ns() - start) / count)
        return best

    def paced(body, count: int) -> float:
        total = 0
        for _ in range(count // 100):
            start = time.process_time_ns()  # CPU time: robust to other programs' load
            for _ in range(100):
                body()
            total += time.process_time_ns() - start
            time.sleep(0.002)
        return total / (count // 100 * 100)

    costs = {}
    for name, body in bodies.items():
        count = calls // 20 if "32-element" in name else calls  # ~0.1 ms per call
        empty_paced, empty_tight = paced(lambda: None, count), tight(lambda: None, count)
        if "alone" in name:  # no channel involved: back to back is its cost
            costs[f"{name}, tight loop"] = round(tight(body, count) - empty_tight, 1)
            continue
        costs[f"report({name}), paced"] = round(paced(body, count) - empty_paced, 1)
        costs[f"report({name}), tight loop"] = round(tight(body, count) - empty_tight, 1)
    return costs


# --------------------------------------------------------------------------- the kernel side
def launch(n: int, steps: int, chunks: int) -> dict[str, tuple[float, float]]:
    """One launch; per variant, the mean over ranks of (wall, CPU) seconds per step."""
    with contextlib.redirect_stdout(io.StringIO()) as out:  # the printed steps go here
        result = nb_dist.notebook_launcher(train, (steps, chunks), num_processes=n)
    timed = steps // chunks * chunks
    lines = out.getvalue().count("\n")
    assert lines >= n * timed, f"expected {n * timed} printed lines, got {lines}"
    assert all(len(result.reports["loss"][r]) == timed for r in range(n))
    return {
        mode: (
            statistics.fmean(rank[mode][0] for rank in result),
            statistics.fmean(rank[mode][1] for rank in result),
        )
        for mode in MODES
    }


def markdown(results: dict) -> str:
    rows = [
        "| ranks | time | no reports (µs/step) | report loss every step | overhead "
        "| print every step | overhead |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, entry in results["per_step"].items():
        for clock in ("wall", "cpu"):
            us = {mode: entry[clock]["median_s"][mode] * 1e6 for mode in MODES}
            pct = entry[clock]["overhead_pct"]
            rows.append(
                f"| {n} | {clock} | {us['none']:.1f} | {us['report']:.1f} | "
                f"{pct['report']:+.1f} % | {us['print']:.1f} | {pct['print']:+.1f} % |"
            )
    rows += [
        "",
        "Estimated from the paced per-call cost of `report(0-d tensor)` over the baseline CPU "
        "step: "
        + ", ".join(
            f"{n} rank{'s' if n != '1' else ''}: {pct:+.2f} %"
            for n, pct in results["estimated_report_overhead_pct"].items()
        )
        + ".",
    ]
    rows += ["", "| call (in a launch) | ns/call |", "| --- | ---: |"]
    rows += [f"| `{name}` | {ns:,.0f} |" for name, ns in results["per_call_ns"].items()]
    m = results["machine"]
    rows += [
        "",
        f"{results['steps']} timed steps per variant and launch ({results['chunks']} alternating "
        f"chunks each) after {WARMUP} warm-up steps; µs/step are medians over "
        f"{results['repeats']} launches, overheads medians of the launches' paired ratios (CPU: "
        "the worker process's CPU time, flusher thread included). "
        f"Machine: {m['cpu_count']} CPUs, Python {m['python']}, torch {m['torch']}, load "
        f"average {m['loadavg_before']} / {m['loadavg_after']}.",
    ]
    return "\n".join(rows)


def summarize(samples: list[tuple[float, float]], baseline: list[tuple[float, float]]) -> dict:
    """Per clock: the samples, their median, and the median paired overhead vs the baseline."""
    out = {}
    for index, clock in enumerate(("wall", "cpu")):
        values = [sample[index] for sample in samples]
        base = [sample[index] for sample in baseline]
        ratios = [v / b - 1 for v, b in zip(values, base, strict=True)]
        out[clock] = {"samples_s": values, "median_s": statistics.median(values)}
        out[clock]["overhead_pct"] = round(100 * statistics.median(ratios), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="timed steps per variant, launch")
    parser.add_argument("--chunks", type=int, default=6, help="interleaved chunks per variant")
    parser.add_argument("--repeats", type=int, default=5, help="launches per number of ranks")
    parser.add_argument("--calls", type=int, default=20_000, help="report() calls per loop")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    loadavg_before = os.getloadavg()
    began = time.monotonic()

    launch(1, 300, 3)  # warm-up launch (imports, page cache), discarded
    samples: dict[int, dict[str, list[tuple[float, float]]]] = {
        n: {mode: [] for mode in MODES} for n in SIZES
    }
    for round_index in range(args.repeats):
        for n in SIZES:
            for mode, sample in launch(n, args.steps, args.chunks).items():
                samples[n][mode].append(sample)
        print(f"round {round_index + 1}/{args.repeats} done", file=sys.stderr)
    per_call = nb_dist.notebook_launcher(per_call_costs, (args.calls,), num_processes=1)[0]

    per_step = {}
    for n in SIZES:
        by_mode = {mode: summarize(samples[n][mode], samples[n]["none"]) for mode in MODES}
        per_step[str(n)] = {
            clock: {
                "samples_s": {mode: by_mode[mode][clock]["samples_s"] for mode in MODES},
                "median_s": {mode: by_mode[mode][clock]["median_s"] for mode in MODES},
                "overhead_pct": {
                    mode: by_mode[mode][clock]["overhead_pct"] for mode in ("report", "print")
                },
            }
            for clock in ("wall", "cpu")
        }
    call_ns = per_call["report(0-d tensor), paced"]
    estimated = {
        n: round(100 * call_ns * 1e-9 / entry["cpu"]["median_s"]["none"], 2)
        for n, entry in per_step.items()
    }
    results = {
        "benchmark": "report_overhead",
        "steps": args.steps,
        "chunks": args.chunks,
        "warmup_steps": WARMUP,
        "repeats": args.repeats,
        "model": "Linear(32, 32) + SGD, batch 16, MSE loss",
        "per_step": per_step,
        "per_call_ns": per_call,
        "estimated_report_overhead_pct": estimated,
        "target_report_overhead_pct": TARGET_PCT,
        "target_met": {
            **{
                clock: all(
                    e[clock]["overhead_pct"]["report"] < TARGET_PCT for e in per_step.values()
                )
                for clock in ("wall", "cpu")
            },
            "estimated": all(pct < TARGET_PCT for pct in estimated.values()),
        },
        "total_seconds": round(time.monotonic() - began, 1),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nb_dist": nb_dist.__version__,
            "platform": platform.platform(),
            "loadavg_before": [round(x, 2) for x in loadavg_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    for clock, met in results["target_met"].items():
        print(f"target ({clock}: report overhead < {TARGET_PCT} %): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
