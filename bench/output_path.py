"""Output path: how fast a worker's ``print`` reaches the notebook, and whether every line does.

Every line a rank prints carries its rank, a sequence number and ``time.monotonic()`` taken
just before the ``print`` (``CLOCK_MONOTONIC`` is system-wide on Linux, so stamps taken in
different processes of one machine compare directly). Launches use 2 ranks, fork,
``output="all"``.

Where a line "arrives": nb_dist's launching thread writes each labelled line to the caller's
``sys.stdout``. For the duration of each launch this benchmark replaces ``sys.stdout`` with a
thin recorder (:class:`LineRecorder`) that stamps every complete line it receives with
``time.monotonic()`` and forwards the write unchanged to the real stream: that is the moment
nb_dist has delivered the line into the kernel. Inside a real ipykernel the real stream is
ipykernel's ``OutStream``; from a plain process it is ``/dev/null`` (so the comparison shows
what the kernel's stream costs, and the terminal is not flooded).

(a) Latency: each rank prints ``--lat-lines`` lines ``--interval`` apart (200 lines, 10 ms);
latency = arrival - print stamp, per rank (median, p95, max). Measured inside a real ipykernel
(the cell imports this file and runs the same functions as the plain process), and again from
the client side: the benchmark process, the kernel's jupyter_client, stamps each iopub
``stream`` message when it receives it (same machine, same clock). The client-side figure adds
ipykernel's part of the path (its ``OutStream`` buffer, the IO thread, ZMQ, message
deserialisation), which is outside nb_dist: nb_dist flushes the stream after every batch of
lines it writes, so ipykernel's 0.2 s ``flush_interval`` does not apply.

(b) Throughput: one rank (of 2) prints ``--lines`` lines as fast as it can, and a variant in
which both ranks do so concurrently. Per launch: wall time from the launcher call to the last
line's arrival, lines/s over that time, the streaming rate (first to last arrival) and how long
the printing loop itself took in the worker (a full pipe blocks the worker, so a slow reader
would show there). Every run checks, per rank, that sequence numbers arrive exactly
0, 1, ..., n-1: no line lost, duplicated or reordered, and each labelled with its own rank.
The client-side stream is checked the same way.

Run: ``python bench/output_path.py`` (about 20-25 s on 2 cores; ``--quick`` about 15 s).
Writes ``bench/results/output_path.json`` (every latency sample, every run, the parameters)
and ``output_path.png``, and prints the markdown tables. Target: print -> kernel <= 50 ms p95.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from _common import BENCH, RESULTS, leftover_children, publish, run_in_kernel, stats

NAME = "output_path"
TAG = "NBOP"
TARGET_P95_MS = 50.0
RANKS = 2
LINE_RE = re.compile(rf"^\[rank (\d+)\] {TAG} (\S+) (\d+) (\d+) (\d+\.\d+)$")


# --------------------------------------------------------------------------- what every rank runs
def paced_printer(run: str, lines: int, interval: float) -> None:
    """Print ``lines`` stamped lines, one every ``interval`` seconds (a training loop's log)."""
    rank = int(os.environ["RANK"])
    due = time.monotonic()
    for seq in range(lines):
        print(f"{TAG} {run} {rank} {seq} {time.monotonic():.6f}")
        due += interval
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def burst_printer(run: str, lines: int, printing: int) -> tuple[float, float] | None:
    """Ranks below ``printing`` print ``lines`` stamped lines as fast as they can."""
    rank = int(os.environ["RANK"])
    if rank >= printing:
        return None
    began = time.monotonic()
    for seq in range(lines):
        print(f"{TAG} {run} {rank} {seq} {time.monotonic():.6f}")
    return began, time.monotonic()


# --------------------------------------------------------------------------- the kernel side
class LineRecorder:
    """Stands in for ``sys.stdout`` during a launch: stamps each complete line, forwards all."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> int:
        now = time.monotonic()
        self.real.write(text)
        *complete, self._partial = (self._partial + text).split("\n")
        self.lines.extend((now, line) for line in complete)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _launch_recorded(function: Any, args: tuple, forward: Any) -> dict[str, Any]:
    """One 2-rank launch with ``sys.stdout`` replaced by a recorder that forwards to ``forward``."""
    import nb_dist

    real = sys.stdout
    recorder = LineRecorder(real if forward is None else forward)
    sys.stdout = recorder
    try:
        began = time.monotonic()
        result = nb_dist.notebook_launcher(
            function, args=args, num_processes=RANKS, device="cpu", output="all"
        )
        returned = time.monotonic()
    finally:
        sys.stdout = real
    return {"began": began, "returned": returned, "values": list(result), "lines": recorder.lines}


def parse_lines(stamped: list[tuple[float, str]]) -> dict[str, dict[int, list[list[float]]]]:
    """``{run: {rank: [[seq, print stamp, arrival], ...]}}`` in arrival order.

    A line whose label (``[rank K]``) differs from the rank inside it is kept under rank -1.
    """
    runs: dict[str, dict[int, list[list[float]]]] = {}
    for arrival, line in stamped:
        match = LINE_RE.match(line)
        if match is None:
            continue
        label, run, rank, seq, stamp = match.groups()
        key = int(rank) if label == rank else -1
        runs.setdefault(run, {}).setdefault(key, []).append([int(seq), float(stamp), arrival])
    return runs


def check_lines(per_rank: dict[int, list[list[float]]], expected: dict[int, int]) -> dict:
    """Lost, duplicated, reordered and mislabelled lines against ``{rank: lines expected}``."""
    lost = duplicated = reordered = 0
    for rank, count in expected.items():
        seqs = [int(entry[0]) for entry in per_rank.get(rank, [])]
        unique = set(seqs)
        lost += len(set(range(count)) - unique)
        duplicated += len(seqs) - len(unique)
        reordered += sum(1 for a, b in itertools.pairwise(seqs) if b < a)
    mislabelled = len(per_rank.get(-1, []))
    extra = sum(len(v) for k, v in per_rank.items() if k not in expected and k != -1)
    ok = not (lost or duplicated or reordered or mislabelled or extra)
    return {
        "lost": lost,
        "duplicated": duplicated,
        "reordered": reordered,
        "mislabelled": mislabelled,
        "unexpected": extra,
        "ok": ok,
    }


def latency_ms(per_rank: dict[int, list[list[float]]]) -> dict[str, list[float]]:
    return {
        str(rank): [round((arrival - stamp) * 1000, 4) for _, stamp, arrival in entries]
        for rank, entries in sorted(per_rank.items())
        if rank >= 0
    }


def measure_context(params: dict[str, Any], to_devnull: bool) -> dict[str, Any]:
    """Everything measured in one process (a kernel, or the plain benchmark process).

    ``to_devnull``: the recorder forwards to /dev/null instead of the real ``sys.stdout``.
    """
    sink = open(os.devnull, "w") if to_devnull else None  # noqa: SIM115 - closed below
    try:
        _launch_recorded(burst_printer, ("warm", 20, RANKS), sink)  # warm-up, discarded
        lat = _launch_recorded(
            paced_printer, ("lat", params["lat_lines"], params["interval"]), sink
        )
        per_rank = parse_lines(lat["lines"]).get("lat", {})
        latency = {
            "began": lat["began"],
            "launch_s": lat["returned"] - lat["began"],
            "samples_ms": latency_ms(per_rank),
            "check": check_lines(per_rank, dict.fromkeys(range(RANKS), params["lat_lines"])),
        }
        runs = []
        for repeat in range(params["repeats"]):
            for printing in (1, RANKS):
                run = f"tp{repeat}x{printing}"
                out = _launch_recorded(burst_printer, (run, params["lines"], printing), sink)
                runs.append(_throughput_record(run, printing, params["lines"], out))
        return {"latency": latency, "throughput": runs}
    finally:
        if sink is not None:
            sink.close()


def _throughput_record(run: str, printing: int, lines: int, out: dict) -> dict[str, Any]:
    per_rank = parse_lines(out["lines"]).get(run, {})
    arrivals = [entry[2] for entries in per_rank.values() for entry in entries]
    total = lines * printing
    first, last = (min(arrivals), max(arrivals)) if arrivals else (out["began"], out["returned"])
    producer = [end - start for start, end in filter(None, out["values"])]
    return {
        "run": run,
        "ranks_printing": printing,
        "lines_per_rank": lines,
        "lines_total": total,
        "began": out["began"],
        "launch_to_last_line_s": last - out["began"],
        "launch_to_return_s": out["returned"] - out["began"],
        "first_to_last_line_s": last - first,
        "lines_per_s": total / (last - out["began"]),
        "stream_lines_per_s": total / (last - first) if last > first else None,
        "worker_print_loop_s": producer,
        "check": check_lines(per_rank, dict.fromkeys(range(printing), lines)),
    }


# --------------------------------------------------------------------------- the ipykernel part
KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import output_path as _op
_out = _op.measure_context({params!r}, to_devnull=False)
print(JSON_MARK + json.dumps(_out))
"""


def run_kernel_recording(code: str, timeout: float = 240.0) -> tuple[Any, list[tuple[float, str]]]:
    """Run ``code`` in a fresh ipykernel; its JSON value and its stdout lines, each stamped
    with the arrival (in this process) of the stream message that completed it."""
    value, received = run_in_kernel(code, timeout, stamped=True)
    return value, _split_messages(received)


def _split_messages(received: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """Stream messages -> complete lines, each stamped with the arrival of its last piece."""
    lines: list[tuple[float, str]] = []
    partial = ""
    for when, text in received:
        *complete, partial = (partial + text).split("\n")
        lines.extend((when, line) for line in complete)
    return lines


def client_side(kernel: dict[str, Any], lines: list[tuple[float, str]]) -> dict[str, Any]:
    """The same latency and checks, from the lines as the kernel's client received them."""
    runs = parse_lines(lines)
    per_rank = runs.get("lat", {})
    n = len(kernel["latency"]["samples_ms"].get("0", []))
    out: dict[str, Any] = {
        "latency": {
            "samples_ms": latency_ms(per_rank),
            "check": check_lines(per_rank, dict.fromkeys(range(RANKS), n)),
        },
        "throughput": [],
    }
    for record in kernel["throughput"]:
        got = runs.get(record["run"], {})
        arrivals = [entry[2] for entries in got.values() for entry in entries]
        last = max(arrivals) if arrivals else None
        took = None if last is None else last - record["began"]
        expected = dict.fromkeys(range(record["ranks_printing"]), record["lines_per_rank"])
        out["throughput"].append(
            {
                "run": record["run"],
                "ranks_printing": record["ranks_printing"],
                "lines_total": record["lines_total"],
                "launch_to_last_line_s": took,
                "lines_per_s": None if took is None else record["lines_total"] / took,
                "check": check_lines(got, expected),
            }
        )
    return out


# --------------------------------------------------------------------------- summaries
def _summaries(samples_ms: dict[str, list[float]]) -> dict[str, dict]:
    out = {rank: stats(values) for rank, values in samples_ms.items()}
    out["all"] = stats([v for values in samples_ms.values() for v in values])
    return out


def _tp_summary(runs: list[dict]) -> dict[str, dict]:
    """Per number of printing ranks: medians over the repeats, and whether every run was clean."""
    out: dict[str, dict] = {}
    for printing in sorted({r["ranks_printing"] for r in runs}):
        chosen = [r for r in runs if r["ranks_printing"] == printing]

        def med(key: str, chosen: list[dict] = chosen) -> float | None:
            values = [r[key] for r in chosen if r.get(key) is not None]
            return stats(values)["median"] if values else None

        out[str(printing)] = {
            "lines_total": chosen[0]["lines_total"],
            "repeats": len(chosen),
            "launch_to_last_line_s": med("launch_to_last_line_s"),
            "lines_per_s": med("lines_per_s"),
            "stream_lines_per_s": med("stream_lines_per_s"),
            "launch_to_return_s": med("launch_to_return_s"),
            "worker_print_loop_s": stats(
                [s for r in chosen for s in r.get("worker_print_loop_s", [])]
            ).get("median"),
            "lost": sum(r["check"]["lost"] for r in chosen),
            "reordered": sum(r["check"]["reordered"] for r in chosen),
            "duplicated": sum(r["check"]["duplicated"] for r in chosen),
            "mislabelled": sum(r["check"]["mislabelled"] for r in chosen),
            "ok": all(r["check"]["ok"] for r in chosen),
        }
    return out


def summarize(contexts: dict[str, dict]) -> dict[str, Any]:
    return {
        name: {
            "latency_ms": _summaries(ctx["latency"]["samples_ms"]),
            "latency_ok": ctx["latency"]["check"]["ok"],
            "throughput": _tp_summary(ctx["throughput"]),
        }
        for name, ctx in contexts.items()
    }


# --------------------------------------------------------------------------- report
WHERE = {
    "ipykernel": "ipykernel: line written to the kernel's sys.stdout",
    "ipykernel client": "ipykernel -> jupyter_client (iopub message received)",
    "plain": "plain process: line written to sys.stdout",
}


def markdown(data: dict) -> str:
    summary = data["summary"]
    p = data["params"]
    lines = [
        f"Latency print -> delivery, 2 ranks, {p['lat_lines']} lines each, "
        f"{p['interval'] * 1000:g} ms apart (ms):",
        "",
        "| where | rank | median | p95 | max | lines | all arrived in order |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for context, label in WHERE.items():
        entry = summary.get(context)
        if not entry:
            continue
        for rank in sorted(k for k in entry["latency_ms"] if k != "all"):
            s = entry["latency_ms"][rank]
            if not s.get("n"):
                continue
            lines.append(
                f"| {label} | {rank} | {s['median']:.2f} | {s['p95']:.2f} | {s['max']:.2f} "
                f"| {s['n']} | {'yes' if entry['latency_ok'] else '**no**'} |"
            )
    lines += [
        "",
        f"Throughput, {p['lines']} lines per printing rank, as fast as print() goes "
        f"(medians of {p['repeats']} launches):",
        "",
        "| where | ranks printing | lines | launch -> last line s | lines/s | stream lines/s "
        "| worker print loop s | launch -> return s | lost / reordered / dup. |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    for context, label in WHERE.items():
        entry = summary.get(context)
        if not entry:
            continue
        for printing, s in entry["throughput"].items():
            lines.append(
                f"| {label} | {printing} | {s['lines_total']} | "
                f"{f(s.get('launch_to_last_line_s'), '.3f')} | {f(s.get('lines_per_s'), ',.0f')} | "
                f"{f(s.get('stream_lines_per_s'), ',.0f')} | "
                f"{f(s.get('worker_print_loop_s'), '.3f')} | "
                f"{f(s.get('launch_to_return_s'), '.3f')} | "
                f"{s['lost']} / {s['reordered']} / {s['duplicated']} |"
            )
    notes = [
        "",
        "Latency is measured from `time.monotonic()` in the worker just before `print` to the "
        "moment nb_dist writes the labelled line to the kernel's `sys.stdout` (a recorder in "
        "its place forwards to the real stream). The jupyter_client rows add ipykernel's own "
        "path (OutStream, IO thread, ZMQ, the client's message parsing), which nb_dist does "
        "not control; nb_dist flushes after every batch of lines, so ipykernel's 0.2 s flush "
        "interval does not delay them. Throughput 'launch -> last line' includes starting "
        "the 2 workers; 'stream lines/s' is first to last line; the plain process forwards "
        "to /dev/null.",
    ]
    if data.get("kernel_error"):
        notes.append(f"The ipykernel part failed: {data['kernel_error']}")
    notes.append(
        f"Load average {data.get('loadavg_before')} before, {data.get('loadavg_after')} after; "
        f"run took {data.get('seconds', 0):.0f} s."
    )
    return "\n".join(lines + notes) + "\n"


def targets(data: dict) -> list[dict]:
    summary = data["summary"]
    kernel = summary.get("ipykernel")
    if kernel:
        per_rank = {k: v for k, v in kernel["latency_ms"].items() if k != "all" and v.get("n")}
        worst = max(v["p95"] for v in per_rank.values())
        measured = ", ".join(f"rank {k}: {v['p95']:.1f} ms" for k, v in sorted(per_rank.items()))
        latency = {
            "name": "print -> kernel latency",
            "target": f"p95 <= {TARGET_P95_MS:g} ms (in ipykernel)",
            "measured": f"p95 {measured}",
            "met": worst <= TARGET_P95_MS,
        }
    else:
        latency = {
            "name": "print -> kernel latency",
            "target": f"p95 <= {TARGET_P95_MS:g} ms (in ipykernel)",
            "measured": "not measured (the ipykernel part failed)",
            "met": None,
        }
    checked = {
        name: entry
        for name, entry in summary.items()
        if name in ("ipykernel", "plain")  # what nb_dist delivers; the client row is ipykernel's
    }
    lines = sum(
        s["lines_total"] * s["repeats"] for e in checked.values() for s in e["throughput"].values()
    )
    bad = {
        name: sum(
            s["lost"] + s["reordered"] + s["duplicated"] + s["mislabelled"]
            for s in e["throughput"].values()
        )
        for name, e in checked.items()
    }
    ok = all(
        e["latency_ok"] and all(s["ok"] for s in e["throughput"].values()) for e in checked.values()
    )
    order = {
        "name": "no loss, no reordering",
        "target": "every line of every rank, in order, correctly labelled",
        "measured": f"{lines:,} burst lines + latency runs checked ("
        + ", ".join(f"{name}: {n} bad" for name, n in bad.items())
        + ")",
        "met": ok if checked else None,
    }
    return [latency, order]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    colors = {"0": "#1f77b4", "1": "#d62728"}
    series = [("ipykernel", "-", "kernel sys.stdout"), ("ipykernel client", ":", "jupyter_client")]
    if "ipykernel" not in data["samples"]:
        series = [("plain", "-", "plain process")]
    for context, style, label in series:
        samples = data["samples"].get(context, {}).get("latency", {}).get("samples_ms", {})
        for rank, values in sorted(samples.items()):
            if not values:
                continue
            xs = sorted(max(v, 1e-3) for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            color = colors.get(rank, "gray")
            ax.step(
                xs, ys, where="post", linestyle=style, color=color, label=f"rank {rank}, {label}"
            )
            if style == "-":
                p95 = stats(values)["p95"]
                ax.axvline(p95, color=color, linestyle="--", linewidth=0.8)
                ax.annotate(
                    f"p95 {p95:.2f} ms",
                    (p95, 0.45 - 0.1 * int(rank)),
                    xytext=(4, 0),
                    textcoords="offset points",
                    fontsize=7,
                    color=color,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
                )
    ax.axvline(
        TARGET_P95_MS, color="black", linewidth=1.0, label=f"target p95 {TARGET_P95_MS:g} ms"
    )
    ax.set_xscale("log")
    ax.set_xlabel("latency from print in the worker to arrival, ms (log)")
    ax.set_ylabel("fraction of lines (CDF)")
    p = data["params"]
    ax.set_title(
        f"print -> kernel latency, {p['ranks']} ranks, {p['interval'] * 1000:g} ms between lines"
    )
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~15 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--lat-lines", type=int, help="lines per rank in the latency run")
    parser.add_argument("--interval", type=float, default=0.01, help="s between latency lines")
    parser.add_argument("--lines", type=int, default=10_000, help="lines per printing rank")
    parser.add_argument("--repeats", type=int, help="throughput launches per variant")
    parser.add_argument(
        "--kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure inside a real ipykernel (default on)",
    )
    args = parser.parse_args(argv)
    params = {
        "quick": args.quick,
        "ranks": RANKS,
        "lat_lines": args.lat_lines or (100 if args.quick else 200),
        "interval": args.interval,
        "lines": args.lines,
        "repeats": args.repeats or (1 if args.quick else 3),
        "start_method": "fork",
        "output": "all",
    }
    os.environ["OMP_NUM_THREADS"] = "1"
    began = time.perf_counter()
    loadavg_before = [round(x, 2) for x in os.getloadavg()]

    samples: dict[str, Any] = {}
    kernel_error = None
    if args.kernel:
        try:
            code = KERNEL_CELL.format(bench=str(BENCH), params=params)
            in_kernel, client_lines = run_kernel_recording(code)
            samples["ipykernel"] = in_kernel
            samples["ipykernel client"] = client_side(in_kernel, client_lines)
            print("ipykernel: done", file=sys.stderr, flush=True)
        except (TimeoutError, RuntimeError) as exc:
            kernel_error = f"{type(exc).__name__}: {exc}"
            print(f"ipykernel: skipped, {kernel_error}", file=sys.stderr, flush=True)
    samples["plain"] = measure_context(params, to_devnull=True)
    print("plain process: done", file=sys.stderr, flush=True)

    leftovers = leftover_children()
    data: dict[str, Any] = {
        "what": "latency and throughput of worker output into the kernel",
        "params": params,
        "samples": samples,
        "summary": summarize(samples),
        "kernel_error": kernel_error,
        "leftover_processes": leftovers,
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - began, 1),
    }
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
