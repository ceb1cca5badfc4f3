"""Launch latency: how long a launch of a trivial distributed function takes, start to end.

The function creates the gloo process group, does one tiny all_reduce and destroys the group.
Each launch is timed from the calling process (wall time of the launcher call), for N = 1, 2
and 4 workers:

- nb_dist fork / nb_dist spawn: ``nb_dist.notebook_launcher``;
- floor: ``torch.multiprocessing.start_processes(start_method="fork")`` with MASTER_ADDR/PORT
  set by hand: the least any fork-based launcher can do;
- accelerate: ``accelerate.notebook_launcher`` (torch elastic's agent), when importable;
- nb_dist fork in a kernel: the nb_dist fork launch timed inside a real ipykernel
  (jupyter_client sends the timing loop as a cell, which prints its timings as JSON).

Run: ``python bench/launch_latency.py`` (``--help`` for options). Writes
``bench/results/launch_latency.json`` and ``bench/results/launch_latency.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import queue
import socket
import statistics
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import nb_dist

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (1, 2, 4)
JSON_MARK = "NB_DIST_BENCH_JSON "


# --------------------------------------------------------------------------- what every rank runs
def trivial() -> None:
    """The launched function: process group, one tiny all_reduce, teardown."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


def _floor_worker(local_rank: int, world_size: int, port: int) -> None:
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
    nb_dist.notebook_launcher(trivial, num_processes=n, device="cpu")


def launch_nb_dist_spawn(n: int) -> None:
    nb_dist.notebook_launcher(trivial, num_processes=n, device="cpu", start_method="spawn")


def launch_floor(n: int) -> None:
    torch_mp.start_processes(
        _floor_worker, args=(n, free_port()), nprocs=n, join=True, start_method="fork"
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


# --------------------------------------------------------------------------- timing
def stats(samples: list[float]) -> dict[str, float | int]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "repeats": len(samples),
    }


# A launch that takes longer than this is hung (a fork that inherited a lock held by another
# thread of this process, see bench/README.md): its workers are killed and it is not timed.
HANG_LIMIT = 60.0
HUNG: dict[str, dict[str, int]] = {}


def _kill_children(fired: threading.Event) -> None:
    fired.set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def time_once(name: str, launch: Callable[[int], None], n: int) -> float | None:
    """Seconds one launch took, or None if it hung (counted in HUNG)."""
    fired = threading.Event()
    watchdog = threading.Timer(HANG_LIMIT, _kill_children, args=(fired,))
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
        HUNG.setdefault(name, {}).setdefault(str(n), 0)
        HUNG[name][str(n)] += 1
        return None
    return elapsed


def run_in_process(
    methods: dict[str, tuple[Callable[[int], None], int, tuple[int, ...]]],
) -> dict[str, dict[str, list[float]]]:
    """Time every method for every N; rounds interleave the methods so drift hits all alike."""
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in methods}
    for n in SIZES:
        active = {name: spec for name, spec in methods.items() if n in spec[2]}
        for name, (launch, _, _) in active.items():  # warm-up, discarded
            time_once(name, launch, n)
        rounds = max(repeats for _, repeats, _ in active.values())
        for round_ in range(rounds):
            for name, (launch, repeats, _) in active.items():
                if round_ < repeats:
                    took = time_once(name, launch, n)
                    if took is not None:
                        samples[name].setdefault(str(n), []).append(took)
        medians = {
            name: statistics.median(samples[name][str(n)])
            for name in active
            if samples[name].get(str(n))
        }
        done = ", ".join(f"{name} {value:.3f}" for name, value in medians.items())
        print(f"N={n}: {done} (median s)", file=sys.stderr, flush=True)
    return samples


KERNEL_CELL = textwrap.dedent(
    """
    import json, time
    import torch, torch.distributed as dist
    from nb_dist import notebook_launcher

    def trivial():
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()

    _samples = {}
    for _n in SIZES:
        notebook_launcher(trivial, num_processes=_n, device="cpu")  # warm-up, discarded
        _samples[str(_n)] = []
        for _ in range(REPEATS):
            _began = time.perf_counter()
            notebook_launcher(trivial, num_processes=_n, device="cpu")
            _samples[str(_n)].append(time.perf_counter() - _began)
    print(MARK + json.dumps(_samples))
    """
)


def run_in_kernel(repeats: int, timeout: float = 150.0) -> dict[str, list[float]]:
    """Time the nb_dist fork launch inside a real ipykernel, driven through jupyter_client."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(Path(__file__).resolve().parent.parent))
    client = km.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        code = f"SIZES = {SIZES!r}\nREPEATS = {repeats}\nMARK = {JSON_MARK!r}\n" + KERNEL_CELL
        msg_id = client.execute(code)
        deadline = time.monotonic() + timeout
        text, error = [], None
        while True:
            try:
                msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the kernel cell did not finish within {timeout:g} s") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind == "error":
                error = "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if error:
            raise RuntimeError(f"the kernel cell failed:\n{error}")
        for line in "".join(text).splitlines():
            if line.startswith(JSON_MARK):
                return json.loads(line[len(JSON_MARK) :])
        raise RuntimeError(f"no timings in the kernel's output:\n{''.join(text)}")
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


# --------------------------------------------------------------------------- report
def cell(entry: dict[str, float | int] | None) -> str:
    if entry is None:
        return "n/a"
    return f"{entry['median']:.3f} ({entry['min']:.3f}-{entry['max']:.3f})"


def markdown(results: dict) -> str:
    rows = results["methods"]
    lines = [
        "| method | " + " | ".join(f"N={n} median s (min-max)" for n in SIZES) + " |",
        "| --- | " + " | ".join("---" for _ in SIZES) + " |",
    ]
    for name, per_n in rows.items():
        lines.append(f"| {name} | " + " | ".join(cell(per_n.get(str(n))) for n in SIZES) + " |")
    ratios = results["ratios"]
    lines += [
        "",
        "| ratio (medians) | " + " | ".join(f"N={n}" for n in SIZES) + " |",
        "| --- | " + " | ".join("---" for _ in SIZES) + " |",
    ]
    for name, per_n in ratios.items():
        values = [per_n.get(str(n)) for n in SIZES]
        lines.append(
            f"| {name} | " + " | ".join("n/a" if v is None else f"{v:.2f}x" for v in values) + " |"
        )
    m = results["machine"]
    lines += [
        "",
        f"Machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}, nb_dist {m['nb_dist']}, "
        f"accelerate {m['accelerate'] or 'not installed'}; load average before/after "
        f"{m['loadavg_before']} / {m['loadavg_after']}.",
        f"Repeats per cell: {results['repeats']} (spawn {results['spawn_repeats']}), after one "
        "discarded warm-up launch.",
    ]
    if results["hung"]:
        hung = "; ".join(
            f"{name} N={n}: {count}"
            for name, per_n in results["hung"].items()
            for n, count in per_n.items()
        )
        lines.append(f"Hung launches (workers killed after {HANG_LIMIT:g} s, not timed): {hung}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed launches per cell")
    parser.add_argument("--spawn-repeats", type=int, default=3, help="timed spawn launches")
    parser.add_argument(
        "--kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time nb_dist fork inside a real ipykernel (default on)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)

    loadavg_before = os.getloadavg()
    began = time.perf_counter()
    methods: dict[str, tuple[Callable[[int], None], int, tuple[int, ...]]] = {
        "nb_dist fork": (launch_nb_dist_fork, args.repeats, SIZES),
        "nb_dist spawn": (launch_nb_dist_spawn, args.spawn_repeats, SIZES),
        "floor: torch start_processes fork": (launch_floor, args.repeats, SIZES),
    }
    if accelerate_version() is not None:
        # With num_processes=1 accelerate runs the function in the calling process: no launch.
        methods["accelerate notebook_launcher"] = (
            launch_accelerate,
            args.repeats,
            tuple(n for n in SIZES if n > 1),
        )
    samples = run_in_process(methods)
    kernel_error = None
    if args.kernel:
        try:
            samples["nb_dist fork in ipykernel"] = run_in_kernel(args.repeats)
            print("ipykernel: done", file=sys.stderr, flush=True)
        except (TimeoutError, RuntimeError) as exc:
            kernel_error = f"{type(exc).__name__}: {exc}"
            print(f"ipykernel: skipped, {kernel_error}", file=sys.stderr, flush=True)

    per_method = {
        name: {n: stats(values) for n, values in per_n.items()} for name, per_n in samples.items()
    }
    ratios: dict[str, dict[str, float]] = {}
    floor = per_method["floor: torch start_processes fork"]
    for name in ("nb_dist fork", "nb_dist fork in ipykernel", "accelerate notebook_launcher"):
        if name in per_method:
            ratios[f"{name} / floor"] = {
                n: entry["median"] / floor[n]["median"]
                for n, entry in per_method[name].items()
                if n in floor
            }
    if "accelerate notebook_launcher" in per_method:
        acc = per_method["accelerate notebook_launcher"]
        ratios["nb_dist fork / accelerate"] = {
            n: entry["median"] / acc[n]["median"]
            for n, entry in per_method["nb_dist fork"].items()
            if n in acc
        }
    results = {
        "benchmark": "launch latency of a trivial gloo function (init, all_reduce, destroy)",
        "unit": "seconds",
        "repeats": args.repeats,
        "spawn_repeats": args.spawn_repeats,
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nb_dist": nb_dist.__version__,
            "accelerate": accelerate_version(),
            "platform": platform.platform(),
            "loadavg_before": [round(x, 2) for x in loadavg_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "methods": per_method,
        "ratios": ratios,
        "samples": samples,
        "hung": HUNG,
        "kernel_error": kernel_error,
        "total_seconds": time.perf_counter() - began,
    }
    table = markdown(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_latency.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "launch_latency.md").write_text("# Launch latency\n\n" + table)
    print(table)
    print(f"total {results['total_seconds']:.0f} s; wrote {args.out}/launch_latency.{{json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
