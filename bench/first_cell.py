"""The first cell of a kernel, and a live cell that skips a collective.

Measured in fresh ipykernels (``_common.run_in_kernel``), each configuration in its own kernel,
in interleaved rounds:

- **first DDP launch**: ``import nb_dist`` (which starts importing ``torch._dynamo`` in the
  background, ``nb_dist/_kernel/_warm.py``), 5 s of a user reading, then the kernel's very
  first launch of a small DDP training cell (2 ranks, gloo, an MLP 32-64-10, 20 SGD steps), and
  a later one 3 s after. The same with Accelerate's ``notebook_launcher`` (its first launch
  pays ``torch._dynamo`` in every rank) and with ``NB_DIST_WARM_IMPORTS=0``;
- **first DDP cell of a live session**: ``Ranks(2)`` 5 s after ``import nb_dist``, then a cell
  that builds the same DDP model and trains it, and a second such cell (a later one);
- **a skipped collective on live ranks**: a cell where only rank 0 calls ``all_reduce``, no
  timeout: the seconds until the cell ends (the deadlock detection), and that the session
  works again after;
- **the kernel's memory**: RSS after ``import nb_dist`` and once its background import has
  finished, with and without it.

Targets (issue "live ranks never hang in silence"): the skipped collective ends the cell in
<= 1 s; the first DDP cell of a session <= 1.3x a later one; the first DDP launch <= 0.3x
Accelerate's first. Run: ``python bench/first_cell.py`` (a few minutes; ``--quick``: one
round). Writes ``bench/results/first_cell.json`` and prints markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from _common import RESULTS, publish, run_in_kernel

NAME = "first_cell"

#: The training both the launch and the live cell run: a small MLP under DDP, 20 SGD steps.
TRAINING = """\
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
for _ in range(20):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""

DDP_CELL = (
    """
import json, os, time, psutil, torch, torch.nn as nn, torch.distributed as dist

def rss_mb():
    return psutil.Process().memory_info().rss / 2**20

def ddp_cell():
    dist.init_process_group("gloo")
"""
    + textwrap.indent(TRAINING, "    ")
    + """    del model
    dist.destroy_process_group()
"""
)

LAUNCH = (
    DDP_CELL
    + """
began = time.monotonic()
{import_line}
imported = time.monotonic() - began
rss_import = rss_mb()
time.sleep(5)  # a user reading the next cell
rss_before = rss_mb()
times = []
for i in range(2):
    if i:
        time.sleep(3)
    t = time.monotonic()
    {launch_line}
    times.append(time.monotonic() - t)
print(JSON_MARK + json.dumps({{"import_s": imported, "first_s": times[0], "later_s": times[1],
                              "rss_after_import_mb": rss_import, "rss_5s_mb": rss_before}}))
"""
)

NB_DIST = {
    "import_line": "from nb_dist import notebook_launcher",
    "launch_line": "notebook_launcher(ddp_cell, num_processes=2)",
}
ACCELERATE = {
    "import_line": "from accelerate import notebook_launcher\nimport socket",
    "launch_line": (
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "    notebook_launcher(ddp_cell, num_processes=2, use_port=port)"
    ),
}

SESSION = (
    """
import json, time
began = time.monotonic()
import nb_dist
imported = time.monotonic() - began
time.sleep(5)
ranks = nb_dist.Ranks(2)
ranks.exec("import torch, torch.nn as nn, torch.distributed as dist\\nx = 1")
kept_after_timeout = None
CELL = '''
"""
    + TRAINING
    + """'''
times = []
for _ in range(2):
    t = time.monotonic()
    ranks.exec(CELL)
    times.append(time.monotonic() - t)
t = time.monotonic()
first_line = None
try:
    ranks.exec("if dist.get_rank() == 0:\\n    dist.all_reduce(torch.ones(1))")
    ended = None
except nb_dist.WorkerFailedError as error:
    ended = time.monotonic() - t
    first_line = str(error).splitlines()[0]
usable = ranks.exec("dist.barrier()\\ndist.get_world_size()") == [2, 2]
kept = ranks.exec("'x' in globals()") == [True, True]
t = time.monotonic()
try:  # a wait the counts cannot prove (async_op): the cell's timeout ends it
    ranks.exec("if dist.get_rank() == 0:\\n    dist.barrier(async_op=True).wait()", timeout=1.0)
    after_timeout = None
except nb_dist.LaunchTimeoutError as error:
    after_timeout = time.monotonic() - t - 1.0
    kept_after_timeout = "kept its variables" in str(error)
restarts = ranks.restarts
ranks.close()
print(JSON_MARK + json.dumps({"first_s": times[0], "later_s": times[1], "skipped_s": ended,
                              "skipped_first_line": first_line, "usable_after": usable,
                              "kept": kept, "after_timeout_s": after_timeout,
                              "kept_after_timeout": kept_after_timeout, "restarts": restarts}))
"""
)


def _kernel(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        return run_in_kernel(code, timeout=120)
    except TimeoutError:  # a launcher that hung (its kernel is shut down): counted, not timed
        return {"hung": True}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(rounds: int) -> dict[str, Any]:
    configs = {
        "nb_dist": lambda: _kernel(LAUNCH.format(**NB_DIST)),
        "nb_dist, warm off": lambda: _kernel(
            LAUNCH.format(**NB_DIST), {"NB_DIST_WARM_IMPORTS": "0"}
        ),
        "accelerate": lambda: _kernel(LAUNCH.format(**ACCELERATE)),
        "live session": lambda: _kernel(SESSION),
        "live session, warm off": lambda: _kernel(SESSION, {"NB_DIST_WARM_IMPORTS": "0"}),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for i in range(rounds):
        order = list(configs)[i % len(configs) :] + list(configs)[: i % len(configs)]
        for name in order:
            runs[name].append(configs[name]())
            print(f"round {i + 1}/{rounds} {name}: {runs[name][-1]}", file=sys.stderr)
    return {"rounds": rounds, "runs": runs}


def _median(data: dict[str, Any], config: str, key: str) -> float | None:
    values = [run[key] for run in data["runs"][config] if run.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "Fresh ipykernels; medians over the rounds; seconds.",
        "",
        "| configuration | first DDP cell | a later one | kernel RSS after import (MB) "
        "| 5 s later (MB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for config in data["runs"]:
        first, later = _median(data, config, "first_s"), _median(data, config, "later_s")
        rss = _median(data, config, "rss_after_import_mb")
        rss5 = _median(data, config, "rss_5s_mb")
        lines.append(
            f"| {config} | {first:.3f} | {later:.3f} | {_fmt(rss, '.0f')} | {_fmt(rss5, '.0f')} |"
        )
    hung = {c: sum(1 for r in runs if r.get("hung")) for c, runs in data["runs"].items()}
    if any(hung.values()):
        lines += ["", "Runs that hung (killed after 120 s, not timed): " + ", ".join(
            f"{c}: {n}" for c, n in hung.items() if n)]  # fmt: skip
    skipped = _median(data, "live session", "skipped_s")
    after = _median(data, "live session", "after_timeout_s")
    runs = data["runs"]["live session"]
    kept = sum(1 for r in runs if r.get("kept") and r.get("kept_after_timeout"))
    lines += ["", f"A skipped collective on live ranks, no timeout: the cell ended after "
              f"{_fmt(skipped, '.2f')} s (median), the blocked rank freed and the group formed "
              f"again. A cell's timeout on a rank blocked in a collective: usable "
              f"{_fmt(after, '.2f')} s after the timeout. Variables kept in {kept} of "
              f"{len(runs)} sessions (both cases), restarts: "
              f"{sum(r.get('restarts', 0) for r in runs)}."]  # fmt: skip
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    runs = data["runs"]["live session"]
    skipped = _median(data, "live session", "skipped_s")
    after = _median(data, "live session", "after_timeout_s")
    first, later = (_median(data, "live session", k) for k in ("first_s", "later_s"))
    ours, theirs = _median(data, "nb_dist", "first_s"), _median(data, "accelerate", "first_s")
    usable = all(run.get("usable_after") for run in runs)
    kept = all(run.get("kept") and run.get("kept_after_timeout") for run in runs)
    session = first / later if first and later else None
    launch = ours / theirs if ours and theirs else None
    return [
        {"name": "skipped collective ends a live cell", "target": "<= 1 s",
         "measured": f"{_fmt(skipped, '.2f')} s",
         "met": skipped is not None and skipped <= 1.0 and usable},
        {"name": "after a timeout on a rank blocked in a collective: variables kept, usable",
         "target": "<= 1 s", "measured": f"{_fmt(after, '.2f')} s",
         "met": kept and after is not None and after <= 1.0},
        {"name": "first DDP cell of a session vs a later one", "target": "<= 1.3x",
         "measured": f"{_fmt(session, '.2f')}x", "met": session is not None and session <= 1.3},
        {"name": "first DDP launch vs Accelerate's first", "target": "<= 0.3x",
         "measured": f"{_fmt(launch, '.2f')}x", "met": launch is not None and launch <= 0.3},
    ]  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(data["runs"])
    first = [_median(data, c, "first_s") or 0.0 for c in configs]
    later = [_median(data, c, "later_s") or 0.0 for c in configs]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=120)
    xs = range(len(configs))
    ax.bar([x - 0.2 for x in xs], first, width=0.4, label="first DDP cell")
    ax.bar([x + 0.2 for x in xs], later, width=0.4, label="a later one")
    ax.set_xticks(list(xs), configs, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("The first DDP cell of a kernel, 5 s after import")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return publish(sys.modules[__name__], measure(1 if args.quick else args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
