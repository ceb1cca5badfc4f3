"""Step overhead: what a launcher adds to every training step, against torchrun running a script.

The same small DDP training loop (bench/_ddp_loop.py: an MLP 64->256->256->10, batch 64 per
rank, SGD, cross-entropy, fixed synthetic batches and seeds, gloo, 2 ranks, one intra-op thread
per rank; warm-up steps untimed) runs under:

- ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2 bench/_ddp_loop.py`` as a
  script, workers' stdout to /dev/null (rank 0 writes its timings to a JSON file): the baseline;
- ``nb_dist``: ``nb_dist.notebook_launcher(train, ..., num_processes=2)`` (fork);
- ``accelerate``: ``accelerate.notebook_launcher`` (fork, torch elastic's agent; it returns
  nothing, so rank 0 writes its timings to a JSON file);
- ``nb_dist + report``: nb_dist with ``nb_dist.report("loss", loss)`` every step;
- ``nb_dist + print``: nb_dist with one ``print`` per step (the rank-labelled output path: a
  pipe per rank, line-buffered, read, labelled and written by the launching process; that
  process's stdout goes to /dev/null here);
- ``torchrun + print``: torchrun with one ``print`` per step into a pseudo-terminal (what a user
  running torchrun in a terminal gets: Python line-buffers stdout on a tty), drained by a thread
  of this process. Informative: it shows what printing costs without a launcher in between.

Every rank times each step with ``time.perf_counter`` (and the whole timed loop, in wall and in its
process's CPU time); a launch's step time is the slowest rank's median step (ranks wait for each
other in every all_reduce, so they agree closely). The configurations run in ``--rounds``
interleaved rounds (the order rotated every round), so a change of machine load hits them all
alike; the table shows the median over rounds with min-max, and the ratios of those medians. The
loop is deterministic: every launch of every configuration must end with the same loss, which the
run checks.

Caveat for busy machines: torchrun starts every worker in a session of its own, which Linux's
autogroup scheduler treats as a separate group. On a busy machine that alone changed step times
(workers started by hand in new sessions vs in the caller's: 1.2-1.4x slower on this 2-core
machine under a load average of 4). It should matter much less on a quiet machine: judge the
target on a quiet run.

Run: ``python bench/step_overhead.py`` (about 90 s on 2 cores; ``--quick`` about 35 s, without
``torchrun + print``). Writes ``bench/results/step_overhead.json`` and prints a markdown table.
Target: nb_dist / torchrun <= 1.02; secondary: report and print variants / nb_dist <= 1.02.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pty
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from _common import BENCH, RESULTS, ROOT, publish, python, stats
from _ddp_loop import train

import nb_dist

NAME = "step_overhead"
RANKS = 2
SIZES = (64, 256, 256, 10)
BATCH = 64
TARGET = 1.02
HANG_LIMIT = 90.0  # a launch taking longer is hung: its processes are killed, it is not timed
BASELINE = "torchrun"
CONFIGS = (
    "torchrun",
    "nb_dist",
    "accelerate",
    "nb_dist + report",
    "nb_dist + print",
    "torchrun + print",
)
RATIOS = (
    ("nb_dist", "torchrun"),
    ("accelerate", "torchrun"),
    ("nb_dist", "accelerate"),
    ("nb_dist + report", "nb_dist"),
    ("nb_dist + print", "nb_dist"),
    ("torchrun + print", "torchrun"),
)
TARGETED = (
    ("nb_dist", "torchrun"),
    ("nb_dist + report", "nb_dist"),
    ("nb_dist + print", "nb_dist"),
)


# --------------------------------------------------------------------------- the launchers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(p: dict[str, Any], mode: str, out: str | None = None) -> tuple:
    return (p["steps"], p["warmup"], SIZES, BATCH, mode, out)


def launch_nb_dist(p: dict[str, Any], mode: str, scratch: Path) -> list[dict]:
    expected = (p["steps"] + p["warmup"]) if mode == "print" else 0
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        result = nb_dist.notebook_launcher(
            train, _train_args(p, mode), num_processes=RANKS, device="cpu"
        )
    printed = [sum(line.startswith("step ") for line in log.splitlines()) for log in result.logs]
    if mode == "print" and printed != [expected] * RANKS:
        raise RuntimeError(f"nb_dist + print: expected {expected} lines per rank, got {printed}")
    if mode == "report":
        got = [len(result.reports["loss"][r]) for r in range(RANKS)]
        if got != [p["steps"] + p["warmup"]] * RANKS:
            raise RuntimeError(f"nb_dist + report: {got} reports per rank")
    return result[0]


def launch_accelerate(p: dict[str, Any], mode: str, scratch: Path) -> list[dict]:
    from accelerate import notebook_launcher

    out = scratch / f"accelerate-{uuid.uuid4().hex}.json"
    # It prints "Launching training on 2 CPUs."; its port is fixed unless use_port is given.
    # torch elastic makes a folder per run in the temporary folder: the scratch folder, here.
    saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            notebook_launcher(
                train,
                _train_args(p, mode, str(out)),
                num_processes=RANKS,
                use_port=str(free_port()),
            )
    finally:
        tempfile.tempdir = saved
    return json.loads(out.read_text())


def _drain(fd: int, counter: list[int]) -> None:
    """Read a pseudo-terminal until it closes, counting the printed steps (a muted terminal)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            return
        if not chunk:
            return
        counter[0] += chunk.count(b"step ")


def launch_torchrun(p: dict[str, Any], mode: str, scratch: Path) -> list[dict]:
    out = scratch / f"torchrun-{uuid.uuid4().hex}.json"
    command = [
        python(),
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(BENCH / "_ddp_loop.py"),
        "--steps",
        str(p["steps"]),
        "--warmup",
        str(p["warmup"]),
        "--sizes",
        ",".join(map(str, SIZES)),
        "--batch",
        str(BATCH),
        "--mode",
        mode,
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)  # stdout buffered as Python chooses: a tty, line by line
    env["TMPDIR"] = str(scratch)  # torch elastic's per-run folders go with the scratch folder
    lines = [0]
    drain = None
    if mode == "print":
        leader, follower = pty.openpty()
        drain = threading.Thread(target=_drain, args=(leader, lines), daemon=True)
        drain.start()
        stdout: int = follower
    else:
        leader = follower = -1
        stdout = subprocess.DEVNULL
    errors = scratch / f"torchrun-{uuid.uuid4().hex}.err"
    try:
        with open(errors, "w") as err:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=stdout, stderr=err, start_new_session=True
            )
            if follower >= 0:
                os.close(follower)
                follower = -1
            try:
                code = proc.wait(timeout=HANG_LIMIT)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                raise
        if drain is not None:
            drain.join(timeout=10)
        if code != 0 or not out.exists():
            raise RuntimeError(f"torchrun exited with {code}:\n{errors.read_text()[-3000:]}")
    finally:
        for fd in (follower, leader):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
    if mode == "print":
        expected = RANKS * (p["steps"] + p["warmup"])
        if lines[0] != expected:
            raise RuntimeError(f"torchrun + print: expected {expected} lines, got {lines[0]}")
    return json.loads(out.read_text())


LAUNCHERS: dict[str, tuple[Callable[[dict, str, Path], list[dict]], str]] = {
    "torchrun": (launch_torchrun, "plain"),
    "nb_dist": (launch_nb_dist, "plain"),
    "accelerate": (launch_accelerate, "plain"),
    "nb_dist + report": (launch_nb_dist, "report"),
    "nb_dist + print": (launch_nb_dist, "print"),
    "torchrun + print": (launch_torchrun, "print"),
}


# --------------------------------------------------------------------------- running
def kill_tree(pid: int | None = None) -> list[int]:
    """Kill ``pid`` (default: this process's children) and all its descendants; their pids."""
    try:
        root = psutil.Process(pid) if pid else psutil.Process()
        victims = root.children(recursive=True) + ([root] if pid else [])
    except psutil.Error:
        return []
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(victims, timeout=5)
    return [proc.pid for proc in victims]


def run_once(name: str, p: dict[str, Any], scratch: Path) -> dict[str, Any] | None:
    """One launch of one configuration: its ranks' records and wall time; None if it hung."""
    launch, mode = LAUNCHERS[name]
    fired = threading.Event()

    def watchdog() -> None:
        fired.set()
        kill_tree()

    timer = threading.Timer(HANG_LIMIT, watchdog)
    timer.daemon = True
    began = time.perf_counter()
    timer.start()
    try:
        ranks = launch(p, mode, scratch)
    except Exception as exc:
        if not (fired.is_set() or isinstance(exc, subprocess.TimeoutExpired)):
            raise
        print(f"{name}: hung, killed after {HANG_LIMIT:g} s", file=sys.stderr, flush=True)
        return None
    finally:
        timer.cancel()
    ranks = sorted(ranks, key=lambda r: r["rank"])
    return {
        "wall_s": time.perf_counter() - began,
        "step_s": max(r["median_s"] for r in ranks),  # the slowest rank's median step
        "loop_mean_s": max(r["loop_mean_s"] for r in ranks),
        "cpu_per_step_s": sum(r["cpu_per_step_s"] for r in ranks) / len(ranks),
        "ranks": ranks,
    }


def measure(p: dict[str, Any], configs: list[str]) -> dict[str, Any]:
    launches: dict[str, list[dict]] = {name: [] for name in configs}
    order: list[list[str]] = []
    hung: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="nb_dist_step_") as tmp:
        scratch = Path(tmp)
        for round_index in range(p["rounds"]):
            shift = round_index % len(configs)
            this_round = configs[shift:] + configs[:shift]
            order.append(this_round)
            for name in this_round:
                sample = run_once(name, p, scratch)
                if sample is None:
                    hung[name] = hung.get(name, 0) + 1
                    continue
                sample["round"] = round_index
                launches[name].append(sample)
            done = ", ".join(
                f"{n} {launches[n][-1]['step_s'] * 1e6:.0f}" for n in configs if launches[n]
            )
            print(
                f"round {round_index + 1}/{p['rounds']}: {done} (µs/step)",
                file=sys.stderr,
                flush=True,
            )
    return {"launches": launches, "order": order, "hung": hung}


def summarize(launches: dict[str, list[dict]]) -> dict[str, Any]:
    """Per configuration: stats over rounds; per ratio: ratio of medians and paired ratios."""
    per_config: dict[str, Any] = {}
    for name, samples in launches.items():
        if samples:
            per_config[name] = {
                "step_s": stats([s["step_s"] for s in samples]),
                "loop_mean_s": stats([s["loop_mean_s"] for s in samples]),
                "cpu_per_step_s": stats([s["cpu_per_step_s"] for s in samples]),
                "launch_wall_s": stats([s["wall_s"] for s in samples]),
            }
    ratios: dict[str, Any] = {}
    for num, den in RATIOS:
        if num not in per_config or den not in per_config:
            continue
        by_round = {s["round"]: s["step_s"] for s in launches[den]}
        paired = [
            s["step_s"] / by_round[s["round"]] for s in launches[num] if s["round"] in by_round
        ]
        ratios[f"{num} / {den}"] = {
            "median_ratio": per_config[num]["step_s"]["median"]
            / per_config[den]["step_s"]["median"],
            "loop_mean_ratio": per_config[num]["loop_mean_s"]["median"]
            / per_config[den]["loop_mean_s"]["median"],
            "cpu_ratio": per_config[num]["cpu_per_step_s"]["median"]
            / per_config[den]["cpu_per_step_s"]["median"],
            "paired": paired,
            "paired_min": min(paired) if paired else None,
            "paired_max": max(paired) if paired else None,
        }
    return {"per_config": per_config, "ratios": ratios}


def final_losses(launches: dict[str, list[dict]]) -> list[list[float]]:
    """The distinct per-rank final losses over all launches: one entry if all trained alike."""
    seen = {
        tuple(round(r["final_loss"], 6) for r in s["ranks"])
        for samples in launches.values()
        for s in samples
    }
    return [list(losses) for losses in sorted(seen)]


# --------------------------------------------------------------------------- report
def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def markdown(data: dict) -> str:
    per = data["per_config"]
    lines = [
        "| configuration | step µs, median (min-max) | loop mean µs/step | CPU µs/step "
        "| launch wall s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in data["configs"]:
        if name not in per:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a |")
            continue
        s, m, w = per[name]["step_s"], per[name]["loop_mean_s"], per[name]["launch_wall_s"]
        cpu = per[name]["cpu_per_step_s"]
        lines.append(
            f"| {name} | {_us(s['median'])} ({_us(s['min'])}-{_us(s['max'])}) | "
            f"{_us(m['median'])} | {_us(cpu['median'])} | {w['median']:.1f} |"
        )
    lines += [
        "",
        "| ratio | median step | per-round range | loop mean | CPU | target |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    targeted = {f"{a} / {b}" for a, b in TARGETED}
    for key, r in data["ratios"].items():
        lines.append(
            f"| {key} | {r['median_ratio']:.3f} | {r['paired_min']:.3f}-{r['paired_max']:.3f} | "
            f"{r['loop_mean_ratio']:.3f} | {r['cpu_ratio']:.3f} | "
            f"{f'<= {TARGET}' if key in targeted else '-'} |"
        )
    p, m = data["params"], data["machine"]
    losses = data["final_losses"]
    lines += [
        "",
        f"MLP {'->'.join(map(str, SIZES))}, batch {BATCH} per rank, {RANKS} ranks (gloo, DDP, one "
        f"thread each), {p['steps']} timed steps after {p['warmup']} warm-up steps, "
        f"{p['rounds']} interleaved rounds. Step time: the slowest rank's median step (each step "
        "timed with `perf_counter` inside the worker); loop mean: the whole timed loop / steps "
        "(includes stalls); CPU: each worker process's CPU time per timed step (all its threads), "
        "mean of the ranks: unlike wall time, not inflated by other programs on a busy machine. "
        "Prints: nb_dist's labelled output goes to /dev/null in the launching "
        "process; torchrun's to a pseudo-terminal drained by this process. Every launch ended "
        f"with the same loss: {'yes' if len(losses) == 1 else f'NO ({losses})'}. "
        f"Machine: {m['cpu_count']} CPUs, load average before/after "
        f"{data['loadavg_before']} / {m['loadavg']}.",
    ]
    if data["hung"]:
        hung = ", ".join(f"{name}: {count}" for name, count in data["hung"].items())
        lines.append(f"Hung launches (killed after {HANG_LIMIT:g} s, not timed): {hung}.")
    return "\n".join(lines) + "\n"


def targets(data: dict) -> list[dict]:
    out = []
    for num, den in TARGETED:
        key = f"{num} / {den}"
        ratio = data["ratios"].get(key)
        out.append(
            {
                "name": f"step-time ratio {key}",
                "target": f"<= {TARGET}",
                "measured": "n/a"
                if ratio is None
                else (
                    f"{ratio['median_ratio']:.3f} (per round {ratio['paired_min']:.2f}-"
                    f"{ratio['paired_max']:.2f}; CPU per step {ratio['cpu_ratio']:.3f})"
                ),
                "met": None if ratio is None else ratio["median_ratio"] <= TARGET,
            }
        )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in data["configs"] if n in data["per_config"]]
    summary = [data["per_config"][n]["step_s"] for n in names]
    medians = [s["median"] * 1e6 for s in summary]
    spread = [
        [(s["median"] - s["min"]) * 1e6 for s in summary],
        [(s["max"] - s["median"]) * 1e6 for s in summary],
    ]
    palette = {"torchrun": "tab:gray", "accelerate": "tab:orange"}
    colors = [palette.get(n.split(" + ")[0], "tab:blue") for n in names]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.bar(
        range(len(names)),
        medians,
        color=colors,
        yerr=spread,
        capsize=4,
        label="median over rounds (bars: min-max)",
    )
    for i, n in enumerate(names):
        rounds = [s["step_s"] * 1e6 for s in data["launches"][n]]
        ax.plot(
            [i] * len(rounds),
            rounds,
            "k.",
            markersize=4,
            label="one round (slowest rank's median)" if i == 0 else None,
        )
    ax.set_xticks(range(len(names)), [n.replace(" + ", "\n+ ") for n in names], fontsize=8)
    ax.set_ylabel("time per training step (µs)")
    ax.set_title(f"Step time of the same DDP loop, {RANKS} ranks (gloo)")
    top = max(s["max"] for s in summary) * 1e6
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run (~35 s): no 'torchrun + print'"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 6, quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per launch (300, quick 200)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (50, quick 30)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    p = {
        # More short rounds rather than few long ones: on a shared 2-core machine the speed
        # changes from minute to minute, and paired per-round ratios need many rounds.
        "rounds": args.rounds or (2 if args.quick else 6),
        "steps": args.steps or (200 if args.quick else 300),
        "warmup": args.warmup or (30 if args.quick else 50),
        "quick": args.quick,
        "ranks": RANKS,
        "mlp": list(SIZES),
        "batch_per_rank": BATCH,
    }
    configs = list(CONFIGS)
    if args.quick:
        configs.remove("torchrun + print")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        configs.remove("accelerate")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    try:
        measured = measure(p, configs)
    finally:
        leftover = kill_tree()
    if leftover:
        print(f"killed leftover processes {leftover}", file=sys.stderr)
    data = {
        "params": p,
        "configs": configs,
        "loadavg_before": loadavg_before,
        **summarize(measured["launches"]),
        "final_losses": final_losses(measured["launches"]),
        "order": measured["order"],
        "hung": measured["hung"],
        "leftover_processes_killed": leftover,
        "launches": measured["launches"],
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
