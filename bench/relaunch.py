"""Warm relaunch: the DDP training cell that people re-run all day, first launch and later ones.

The launched function is a small but real DDP training cell on 2 ranks (gloo):
``init_process_group``, an MLP 32-64-10 wrapped in ``DistributedDataParallel``, 20 SGD steps
on a fixed batch, ``del`` of the model, ``destroy_process_group``. ``DistributedDataParallel``
imports ``torch._dynamo`` (hundreds of modules) the first time it runs in a process; a forked
worker that does not inherit it from the launching process imports it again, on every launch.
nb_dist's warm imports (``nb_dist/_kernel/_warm.py``) import in the launching process, in a
background thread after a fork launch, what the workers had to import, so the next launch
inherits it.

Configurations, each run in a fresh interpreter (so every "1st launch" is a real first one):

- ``nb_dist``: ``nb_dist.notebook_launcher(cell, num_processes=2)`` with the defaults (warm
  imports on), with a 3 s pause before each later launch, as a user re-running a cell would
  (the background import normally finishes in it; what was still left to wait for is recorded);
- ``nb_dist, back-to-back``: the same without the pause: the 2nd launch waits for the background
  import (``nb_dist._kernel._warm.wait()``) and pays what is left of it;
- ``nb_dist warm_imports=False``: every launch's workers import ``torch._dynamo`` themselves;
- ``accelerate``: ``accelerate.notebook_launcher(cell, num_processes=2, use_port=<free>)``;
- ``pre-imported floor``: ``nb_dist`` with ``warm_imports=False`` after ``import
  torch._dynamo`` once in the launching process before the first launch (its time recorded
  separately): what a launch costs when nothing is left to import.

Every configuration but "back-to-back" pauses 3 s before each later launch. Each configuration
makes 4 launches (the 1st, then the 2nd-4th: "later"), timed from the launcher call until it
returns with every worker reaped. The configurations run in interleaved rounds (the order
rotated each round), in a plain Python process and again inside a real ipykernel (``_common.
run_in_kernel``, a fresh kernel per configuration) for nb_dist, accelerate and the floor.

Also recorded, per configuration: the launching process's RSS and USS (``psutil``
``memory_full_info``) after its imports, after the 1st launch (and the pause, and the warm
import finished), and after the last launch: the memory the warm imports cost; the time to
import the launcher; and a breakdown of each launch: in every rank, timestamps (system-wide
``time.monotonic``) at function entry, after ``init_process_group``, after the DDP constructor,
after the steps and after ``destroy_process_group``, and whether ``torch._dynamo`` was already
there at entry; in the launching process for nb_dist, the launcher's own wait for a background
import, the store's creation and the forks (wrappers around ``nb_dist._kernel._warm.wait``,
``nb_dist._kernel._ports.open_store`` and ``Supervisor._start_all``, microseconds each).

A launch that takes longer than ``HANG_LIMIT`` is killed and counted as hung, not timed. The
machine this was written on has 2 cores and other work on it: compare rows of one run.

Run: ``python bench/relaunch.py`` (about 10 minutes on 2 cores; ``--quick``: 1 round, kernel
for nb_dist and accelerate only). Writes ``bench/results/relaunch.json`` and ``relaunch.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import BENCH, JSON_MARK, RESULTS, ROOT, publish, run_in_kernel, stats

NAME = "relaunch"
RANKS = 2
STEPS = 20
LAUNCHES = 4
PAUSE_S = 3.0
HANG_LIMIT = 120.0
# name -> launcher, warm imports, pause before later launches, torch._dynamo imported first
CONFIGS: dict[str, dict[str, Any]] = {
    "nb_dist": {"launcher": "nb_dist", "warm": True, "pause": True, "preimport": False},
    "nb_dist, back-to-back": {
        "launcher": "nb_dist",
        "warm": True,
        "pause": False,
        "preimport": False,
    },
    "nb_dist warm_imports=False": {
        "launcher": "nb_dist",
        "warm": False,
        "pause": True,
        "preimport": False,
    },
    "accelerate": {"launcher": "accelerate", "warm": None, "pause": True, "preimport": False},
    "pre-imported floor": {"launcher": "nb_dist", "warm": False, "pause": True, "preimport": True},
}
KERNEL_CONFIGS = ("nb_dist", "accelerate", "pre-imported floor")
QUICK_KERNEL_CONFIGS = ("nb_dist", "accelerate")
TARGET_FLOOR = 1.3
TARGET_ACCELERATE = 0.25


# --------------------------------------------------------------------------- the launched cell
def ddp_cell(out_dir: str) -> float:
    """A DDP training cell: process group, DDP model, 20 SGD steps, teardown; timestamps."""
    entered = time.monotonic()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    had_dynamo = "torch._dynamo" in sys.modules
    modules_at_entry = len(sys.modules)
    dist.init_process_group("gloo")
    pg_done = time.monotonic()
    torch.manual_seed(0)
    ddp_cpu = time.process_time()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DistributedDataParallel(model)
    ddp_done = time.monotonic()
    ddp_cpu = time.process_time() - ddp_cpu
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
    steps_done = time.monotonic()
    value = float(loss.detach())
    rank = dist.get_rank()
    del ddp, model, opt
    dist.destroy_process_group()
    ended = time.monotonic()
    record = {
        "rank": rank,
        "entered": entered,
        "pg_done": pg_done,
        "ddp_done": ddp_done,
        "ddp_cpu_s": ddp_cpu,
        "steps_done": steps_done,
        "ended": ended,
        "had_dynamo": had_dynamo,
        "modules_at_entry": modules_at_entry,
        "modules_at_end": len(sys.modules),
        "loss": value,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    return value


# --------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory() -> dict[str, float]:
    import psutil

    info = psutil.Process().memory_full_info()
    return {"rss_mb": info.rss / 2**20, "uss_mb": info.uss / 2**20}


class _Probe:
    """Timestamps of nb_dist's steps in the launching process (wrappers; behaviour unchanged)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def install(self) -> None:
        from nb_dist._kernel import _ports as ports
        from nb_dist._kernel import _warm
        from nb_dist._kernel._supervisor import Supervisor

        def wrap(owner: Any, attr: str, label: str) -> None:
            original = getattr(owner, attr)

            def timed(*args: Any, **kwargs: Any) -> Any:
                began = time.monotonic()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.events.append((label, began, time.monotonic()))

            setattr(owner, attr, timed)

        wrap(_warm, "wait", "warm_wait")
        wrap(ports, "open_store", "store")
        wrap(Supervisor, "_start_all", "fork")

    def take(self, since: float) -> dict[str, list[float]]:
        """``{label: [began, ended]}`` of the first event of each label since ``since``."""
        out: dict[str, list[float]] = {}
        for label, began, ended in self.events:
            if began >= since and label not in out:
                out[label] = [began, ended]
        self.events.clear()
        return out


def _kill_children(fired: threading.Event) -> None:
    import psutil

    fired.set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def launch_once(config: dict[str, Any], probe: _Probe | None) -> dict[str, Any]:
    """One launch of the cell; its wall time and every rank's timestamps."""
    out_dir = tempfile.mkdtemp(prefix="nb_dist_relaunch_")
    fired = threading.Event()
    watchdog = threading.Timer(HANG_LIMIT, _kill_children, args=(fired,))
    watchdog.daemon = True
    error = None
    watchdog.start()
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    called = time.monotonic()
    try:
        if config["launcher"] == "nb_dist":
            import nb_dist

            nb_dist.notebook_launcher(
                ddp_cell, args=(out_dir,), num_processes=RANKS, warm_imports=config["warm"]
            )
        else:
            from accelerate import notebook_launcher

            with contextlib.redirect_stdout(io.StringIO()):  # "Launching training on 2 CPUs."
                notebook_launcher(
                    ddp_cell, args=(out_dir,), num_processes=RANKS, use_port=str(free_port())
                )
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        watchdog.cancel()
    returned = time.monotonic()
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)

    def cpu(a: Any, b: Any) -> float:
        return (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)

    ranks = []
    for rank in range(RANKS):
        path = Path(out_dir, f"rank{rank}.json")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
            path.unlink()
    with contextlib.suppress(OSError):
        os.rmdir(out_dir)
    return {
        "wall_s": None if (error or fired.is_set()) else returned - called,
        "called": called,
        "returned": returned,
        "hung": fired.is_set(),
        "error": error,
        "ranks": ranks,
        "nb_dist": probe.take(called) if probe else None,
        # CPU seconds during the launch: the launching process (all its threads), and the
        # reaped workers (and any helper process the launcher started and reaped).
        "launcher_cpu_s": cpu(self_before, self_after),
        "workers_cpu_s": cpu(children_before, children_after),
    }


def run_config(name: str, launches: int = LAUNCHES, pause: float = PAUSE_S) -> dict[str, Any]:
    """In this (fresh) process: import, measure memory, launch ``launches`` times."""
    config = CONFIGS[name]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict[str, Any] = {"config": name}
    began = time.perf_counter()
    import torch  # a DDP notebook's kernel has torch: its import is not in the launch times

    out["import_torch_s"] = time.perf_counter() - began
    began = time.perf_counter()
    if config["launcher"] == "nb_dist":
        import nb_dist  # noqa: F401
    else:
        from accelerate import notebook_launcher  # noqa: F401
    out["import_launcher_s"] = time.perf_counter() - began
    probe = None
    if config["launcher"] == "nb_dist":
        probe = _Probe()
        probe.install()
    mem = {"before": memory()}
    if config["preimport"]:
        began = time.perf_counter()
        import torch._dynamo  # noqa: F401

        out["preimport_s"] = time.perf_counter() - began
        mem["after_preimport"] = memory()
    records = []
    waited_after_pause = []
    for index in range(launches):
        if index and config["pause"]:
            time.sleep(pause)
            if config["launcher"] == "nb_dist":
                from nb_dist._kernel import _warm

                # What the background import still had left after the pause (0: it was done).
                waited_after_pause.append(_warm.wait())
        if index == 1 and config["pause"]:
            mem["after_first"] = memory()
        records.append(launch_once(config, probe))
    if config["launcher"] == "nb_dist":
        from nb_dist._kernel import _warm

        out["final_wait_s"] = _warm.wait()
        out["warm_imported"] = _warm.imported()
    mem["end"] = memory()
    out.update(memory=mem, launches=records, waited_after_pause_s=waited_after_pause)
    out["parent_has_dynamo_at_end"] = "torch._dynamo" in sys.modules
    return out


KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import relaunch as _rl
_out = _rl.run_config({name!r}, {launches!r}, {pause!r})
print(JSON_MARK + json.dumps(_out))
"""


def run_fresh(context: str, name: str, launches: int, pause: float) -> dict[str, Any]:
    """``run_config`` in a fresh interpreter: a plain Python process or a fresh ipykernel."""
    if context == "ipykernel":
        code = KERNEL_CELL.format(bench=str(BENCH), name=name, launches=launches, pause=pause)
        return run_in_kernel(code, timeout=HANG_LIMIT * launches + 120)
    cmd = [sys.executable, __file__, "--config", name, "--launches", str(launches)]
    cmd += ["--pause", str(pause)]
    path = os.pathsep.join(filter(None, [str(ROOT), str(BENCH), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=HANG_LIMIT * launches + 120
    )
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(JSON_MARK):
            return json.loads(line[len(JSON_MARK) :])
    raise RuntimeError(f"{name}: no result (exit {run.returncode}): {run.stderr[-1500:]}")


def measure(p: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict]]] = {"plain": {}, "ipykernel": {}}
    errors: list[str] = []
    plan = [("plain", list(p["configs"]))]
    if p["kernel_configs"]:
        plan.append(("ipykernel", list(p["kernel_configs"])))
    for round_index in range(p["rounds"]):
        for context, names in plan:
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:  # rotated: no config always goes first
                try:
                    result = run_fresh(context, name, p["launches"], p["pause_s"])
                except Exception as exc:
                    errors.append(f"{context} {name}: {type(exc).__name__}: {str(exc)[-300:]}")
                    print(errors[-1], file=sys.stderr, flush=True)
                    continue
                runs[context].setdefault(name, []).append(result)
                walls = [r["wall_s"] for r in result["launches"]]
                shown = ", ".join("hung" if w is None else f"{w:.2f}" for w in walls)
                print(
                    f"round {round_index + 1} {context} {name}: {shown} s",
                    file=sys.stderr,
                    flush=True,
                )
    return {"runs": runs, "errors": errors}


# --------------------------------------------------------------------------- summaries
BREAKDOWN_ROWS = (
    ("call -> store opened (checks, warm wait, OpenMP release)", "pre_store"),
    ("  of which waiting for a background import", "warm_wait"),
    ("rendezvous store created", "store"),
    ("forking 2 workers", "fork"),
    ("forks done -> function entered (slowest rank)", "to_entry"),
    ("call -> function entered (slowest rank)", "call_to_entry"),
    ("init_process_group (gloo, slowest rank)", "init_pg"),
    ("DistributedDataParallel(model) (slowest rank)", "ddp"),
    ("  its CPU time (slowest rank)", "ddp_cpu"),
    ("20 SGD steps (slowest rank)", "steps"),
    ("destroy_process_group (slowest rank)", "destroy"),
    ("function returned (last rank) -> launcher returned", "teardown"),
    ("total (launcher call)", "total"),
    ("CPU time of the launching process during the launch", "launcher_cpu"),
    ("CPU time of the workers (sum)", "workers_cpu"),
)


def breakdown_one(launch: dict[str, Any]) -> dict[str, float] | None:
    ranks = launch["ranks"]
    if launch["wall_s"] is None or len(ranks) != RANKS:
        return None
    out = {
        "call_to_entry": max(r["entered"] for r in ranks) - launch["called"],
        "init_pg": max(r["pg_done"] - r["entered"] for r in ranks),
        "ddp": max(r["ddp_done"] - r["pg_done"] for r in ranks),
        "steps": max(r["steps_done"] - r["ddp_done"] for r in ranks),
        "destroy": max(r["ended"] - r["steps_done"] for r in ranks),
        "teardown": launch["returned"] - max(r["ended"] for r in ranks),
        "total": launch["wall_s"],
        "ddp_cpu": max(r.get("ddp_cpu_s", 0.0) for r in ranks),
        "launcher_cpu": launch.get("launcher_cpu_s", 0.0),
        "workers_cpu": launch.get("workers_cpu_s", 0.0),
    }
    parent = launch.get("nb_dist") or {}
    if "store" in parent and "fork" in parent:
        out["pre_store"] = parent["store"][0] - launch["called"]
        wait = parent.get("warm_wait")
        out["warm_wait"] = wait[1] - wait[0] if wait and wait[0] < parent["store"][0] else 0.0
        out["store"] = parent["store"][1] - parent["store"][0]
        out["fork"] = parent["fork"][1] - parent["fork"][0]
        out["to_entry"] = max(r["entered"] for r in ranks) - parent["fork"][1]
    return out


def summarize(runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for context, per_name in runs.items():
        for name, results in per_name.items():
            first, later, by_index = [], [], {}
            parts: dict[str, dict[str, list[float]]] = {"first": {}, "later": {}}
            dynamo: dict[str, list[bool]] = {"first": [], "later": []}
            hung = 0
            for result in results:
                for index, launch in enumerate(result["launches"]):
                    wall = launch["wall_s"]
                    kind = "first" if index == 0 else "later"
                    hung += launch["hung"]
                    if wall is None:
                        continue
                    (first if index == 0 else later).append(wall)
                    by_index.setdefault(str(index + 1), []).append(wall)
                    dynamo[kind] += [r["had_dynamo"] for r in launch["ranks"]]
                    for key, value in (breakdown_one(launch) or {}).items():
                        parts[kind].setdefault(key, []).append(value)

            def med(key: str, results: list[dict] = results) -> float | None:
                values = [r[key] for r in results if r.get(key) is not None]
                return statistics.median(values) if values else None

            mem = {}
            for point in ("before", "after_preimport", "after_first", "end"):
                values = [r["memory"][point] for r in results if point in r["memory"]]
                if values:
                    mem[point] = {
                        k: statistics.median(v[k] for v in values) for k in ("rss_mb", "uss_mb")
                    }
            waits = [w for r in results for w in r.get("waited_after_pause_s", [])]
            summary.setdefault(context, {})[name] = {
                "first": stats(first),
                "later": stats(later),
                "by_index": {k: stats(v) for k, v in by_index.items()},
                "breakdown": {
                    kind: {k: stats(v) for k, v in per.items()} for kind, per in parts.items()
                },
                "dynamo_inherited": {k: (sum(v), len(v)) for k, v in dynamo.items()},
                "memory": mem,
                "import_launcher_s": med("import_launcher_s"),
                "import_torch_s": med("import_torch_s"),
                "preimport_s": stats([r["preimport_s"] for r in results if "preimport_s" in r]),
                "waited_after_pause_s": stats(waits),
                "warm_imported": sorted({m for r in results for m in r.get("warm_imported", [])}),
                "hung": hung,
                "runs": len(results),
            }
    return summary


def _median(data: dict, context: str, name: str, kind: str) -> float | None:
    entry = data["summary"].get(context, {}).get(name, {}).get(kind, {})
    return entry.get("median") if entry.get("n") else None


def ratios(data: dict) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    pairs = {
        "nb_dist later / floor later": (("nb_dist", "later"), ("pre-imported floor", "later")),
        "nb_dist back-to-back later / floor later": (
            ("nb_dist, back-to-back", "later"),
            ("pre-imported floor", "later"),
        ),
        "nb_dist later / accelerate later": (("nb_dist", "later"), ("accelerate", "later")),
        "nb_dist first / accelerate first": (("nb_dist", "first"), ("accelerate", "first")),
        "nb_dist later / nb_dist first": (("nb_dist", "later"), ("nb_dist", "first")),
        "warm_imports=False later / floor later": (
            ("nb_dist warm_imports=False", "later"),
            ("pre-imported floor", "later"),
        ),
    }
    for label, ((a, ka), (b, kb)) in pairs.items():
        for context in ("plain", "ipykernel"):
            num, den = _median(data, context, a, ka), _median(data, context, b, kb)
            out.setdefault(label, {})[context] = num / den if num and den else None
    return out


# --------------------------------------------------------------------------- report
def _cell(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "n/a"
    return f"{entry['median']:.2f} ({entry['min']:.2f}-{entry['max']:.2f}, n={entry['n']})"


def _ms(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "-"
    return f"{entry['median'] * 1e3:.0f}"


def markdown(data: dict) -> str:
    p = data["params"]
    lines = [
        "| where | configuration | 1st launch s, median (min-max, n) | "
        "2nd-4th launches s, median (min-max, n) | torch._dynamo inherited (1st / later) |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for context in ("plain", "ipykernel"):
        for name in CONFIGS:
            entry = data["summary"].get(context, {}).get(name)
            if not entry:
                continue
            inherited = entry["dynamo_inherited"]
            shown = " / ".join(f"{a} of {b} ranks" for a, b in inherited.values())
            lines.append(
                f"| {context} | {name} | {_cell(entry['first'])} | {_cell(entry['later'])} | "
                f"{shown} |"
            )
    lines += ["", "| ratio of medians | plain | ipykernel |", "| --- | ---: | ---: |"]
    for label, per in data["ratios"].items():
        cells = " | ".join("n/a" if per.get(c) is None else f"{per[c]:.2f}x" for c in per)
        lines.append(f"| {label} | {cells} |")

    # Memory of the launching process.
    lines += [
        "",
        "| where | configuration | RSS MB before -> after 1st launch -> end | "
        "USS MB before -> after 1st -> end | USS added by the end |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for context in ("plain", "ipykernel"):
        for name in CONFIGS:
            mem = data["summary"].get(context, {}).get(name, {}).get("memory")
            if not mem or "before" not in mem:
                continue
            points = [k for k in ("before", "after_preimport", "after_first", "end") if k in mem]
            rss = " -> ".join(f"{mem[k]['rss_mb']:.0f}" for k in points)
            uss = " -> ".join(f"{mem[k]['uss_mb']:.0f}" for k in points)
            added = mem["end"]["uss_mb"] - mem["before"]["uss_mb"]
            lines.append(f"| {context} | {name} | {rss} | {uss} | {added:+.0f} |")
    cost = data.get("memory_cost", {})
    for context, c in cost.items():
        lines.append(
            f"\nWarm imports' memory cost ({context}, medians): RSS {c['rss_mb']:+.0f} MB, USS "
            f"{c['uss_mb']:+.0f} MB (nb_dist minus nb_dist warm_imports=False, growth from "
            "before the 1st launch to the end)."
        )

    # Breakdown of a warm launch.
    cols = [
        ("nb_dist", "later"),
        ("pre-imported floor", "later"),
        ("nb_dist", "first"),
        ("accelerate", "later"),
    ]
    for context in ("plain", "ipykernel"):
        present = [
            (n, k) for n, k in cols if data["summary"].get(context, {}).get(n, {}).get("breakdown")
        ]
        if not present:
            continue
        lines += [
            "",
            f"Where a launch's time goes ({context}, ms, medians over launches; slowest rank "
            "per launch):",
            "",
            "| step | " + " | ".join(f"{n}, {k}" for n, k in present) + " |",
            "| --- | " + " | ".join("---:" for _ in present) + " |",
        ]
        for label, key in BREAKDOWN_ROWS:
            cells = [_ms(data["summary"][context][n]["breakdown"][k].get(key)) for n, k in present]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")

    plain = data["summary"].get("plain", {})
    notes = [""]
    floor = plain.get("pre-imported floor", {})
    if floor.get("preimport_s", {}).get("n"):
        notes.append(
            f"`import torch._dynamo` in the launching process (the floor's one-time cost): "
            f"{_cell(floor['preimport_s'])} s."
        )
    imports = ", ".join(
        f"{name} {plain[name]['import_launcher_s']:.2f} s"
        for name in ("nb_dist", "accelerate")
        if plain.get(name, {}).get("import_launcher_s") is not None
    )
    if imports:
        notes.append(f"Importing the launcher (not in the launch times, median): {imports}.")
    waits = plain.get("nb_dist", {}).get("waited_after_pause_s", {})
    if waits.get("n"):
        notes.append(
            f"Background import still running after the {p['pause_s']:g} s pause: waited "
            f"{waits['median']:.2f} s median (max {waits['max']:.2f} s) before later launches."
        )
    warm = plain.get("nb_dist", {}).get("warm_imported")
    if warm:
        notes.append(f"Modules the warm import brought in: {', '.join(warm)}.")
    m = data["machine"]
    notes.append(
        f"{RANKS} ranks, gloo, MLP 32-64-10, {STEPS} SGD steps per launch; {p['launches']} "
        f"launches per configuration in a fresh interpreter, {p['rounds']} interleaved rounds "
        f"(order rotated); {p['pause_s']:g} s pause before each later launch except "
        f"back-to-back. {m['cpu_count']} CPUs shared with other work (load average "
        f"{data['loadavg_before']} before, {m['loadavg']} after): wall times are noisy, "
        f"compare rows of this run. Run took {data['total_seconds']:.0f} s."
    )
    hung = [
        f"{c} {n}: {e['hung']}"
        for c, per in data["summary"].items()
        for n, e in per.items()
        if e["hung"]
    ]
    if hung:
        notes.append(
            f"Hung launches (killed after {HANG_LIMIT:g} s, not timed): {'; '.join(hung)}."
        )
    if data.get("errors"):
        notes.append("Errors: " + "; ".join(data["errors"]))
    return "\n".join(lines + notes) + "\n"


def targets(data: dict) -> list[dict]:
    r = data["ratios"]
    specs = [
        (
            "later launches of a DDP cell vs the pre-imported floor",
            "nb_dist later / floor later",
            TARGET_FLOOR,
        ),
        (
            "later launches of a DDP cell vs Accelerate's",
            "nb_dist later / accelerate later",
            TARGET_ACCELERATE,
        ),
        ("1st launch of a DDP cell vs Accelerate's", "nb_dist first / accelerate first", 1.0),
    ]
    out = []
    for context in ("plain", "ipykernel"):
        where = "" if context == "plain" else " (ipykernel)"
        for name, key, limit in specs:
            value = r.get(key, {}).get(context)
            out.append(
                {
                    "name": name + where,
                    "target": f"<= {limit:g}x",
                    "measured": "n/a" if value is None else f"{value:.2f}x",
                    "met": None if value is None else value <= limit,
                }
            )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    contexts = [c for c in ("plain", "ipykernel") if data["summary"].get(c)]
    widths = [len([n for n in CONFIGS if n in data["summary"][c]]) for c in contexts]
    fig, axes = plt.subplots(
        1, len(contexts), figsize=(11, 4.8), dpi=120, squeeze=False, sharey=True,
        gridspec_kw={"width_ratios": widths},
    )  # fmt: skip
    top = max(
        e[kind]["max"]
        for c in contexts
        for e in data["summary"][c].values()
        for kind in ("first", "later")
        if e[kind].get("n")
    )
    for ax, context in zip(axes[0], contexts, strict=True):
        per = data["summary"][context]
        names = [n for n in CONFIGS if n in per]
        for offset, kind, color in ((-0.2, "first", "tab:gray"), (0.2, "later", "tab:blue")):
            xs, meds, lo, hi = [], [], [], []
            for i, name in enumerate(names):
                entry = per[name][kind]
                if not entry.get("n"):
                    continue
                xs.append(i + offset)
                meds.append(entry["median"])
                lo.append(entry["median"] - entry["min"])
                hi.append(entry["max"] - entry["median"])
            label = "1st launch" if kind == "first" else "2nd-4th launches"
            ax.bar(xs, meds, width=0.4, color=color, yerr=[lo, hi], capsize=3, label=label)
            for x, v, up in zip(xs, meds, hi, strict=True):
                ax.annotate(
                    f"{v:.2f}", (x, v + up), textcoords="offset points", xytext=(0, 2),
                    ha="center", fontsize=7,
                )  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylim(0.1, top * 2.5)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xticks(
            range(len(names)),
            [n.replace(", ", ",\n").replace(" warm", "\nwarm").replace("d floor", "d\nfloor")
             for n in names],
            fontsize=8,
        )  # fmt: skip
        ax.set_title(
            f"{'plain Python process' if context == 'plain' else 'ipykernel'}", fontsize=10
        )
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("launch wall time (s, log; median, whiskers min-max)")
    axes[0][0].legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(
        f"Re-running a DDP training cell ({RANKS} ranks, gloo, {STEPS} SGD steps): "
        "1st launch vs later launches"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def memory_cost(summary: dict) -> dict[str, dict[str, float]]:
    out = {}
    for context, per in summary.items():
        warm, cold = (
            per.get("nb_dist", {}).get("memory"),
            per.get("nb_dist warm_imports=False", {}).get("memory"),
        )
        if warm and cold and "end" in warm and "end" in cold:
            out[context] = {
                key: (warm["end"][key] - warm["before"][key])
                - (cold["end"][key] - cold["before"][key])
                for key in ("rss_mb", "uss_mb")
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round; kernel: nb_dist, accelerate")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--launches", type=int, default=LAUNCHES)
    parser.add_argument("--pause", type=float, default=PAUSE_S)
    parser.add_argument("--no-kernel", action="store_true", help="skip the ipykernel part")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--config", choices=list(CONFIGS), help="(internal) run one config here")
    args = parser.parse_args(argv)
    if args.config:
        print(JSON_MARK + json.dumps(run_config(args.config, args.launches, args.pause)))
        return 0
    configs = list(CONFIGS)
    kernel = [] if args.no_kernel else list(QUICK_KERNEL_CONFIGS if args.quick else KERNEL_CONFIGS)
    try:
        import accelerate  # noqa: F401
    except ImportError:
        configs.remove("accelerate")
        kernel = [n for n in kernel if n != "accelerate"]
    p = {
        "rounds": args.rounds or (1 if args.quick else 3),
        "launches": args.launches,
        "pause_s": args.pause,
        "configs": configs,
        "kernel_configs": kernel,
        "ranks": RANKS,
        "steps": STEPS,
        "quick": args.quick,
    }
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    measured = measure(p)
    data: dict[str, Any] = {
        "params": p,
        "loadavg_before": loadavg_before,
        "summary": summarize(measured["runs"]),
        "errors": measured["errors"],
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    data["memory_cost"] = memory_cost(data["summary"])
    data["ratios"] = ratios(data)
    data["runs"] = measured["runs"]
    data["targets"] = targets(data)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
