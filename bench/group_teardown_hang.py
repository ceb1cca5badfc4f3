"""Group-teardown hang: how often torch itself hangs a rank after the function returns.

The PyTorch DDP tutorial series' ``main`` calls ``destroy_process_group()`` while its
``Trainer`` still holds the DDP model, which is freed when ``main`` returns. In a process
forked from a parent that imported ``torch._dynamo`` (a kernel after any DDP or
``torch.compile`` cell), the gloo group's destructor can then join its threads holding the GIL
while one of them waits for the GIL: the rank never exits (pytorch/pytorch#56297).

A rate, not a pass/fail test: each trial is a fresh Python process that runs the tutorial's
``main`` on 2 ranks ``--launches`` times in a row, and counts as hung when a launch's ranks
have not all exited ``--hang-after`` seconds after the launch started (they are then killed).
Three modes, ``--trials`` trials each, interleaved:

- ``torch+dynamo``: a bare ``multiprocessing`` fork launch (no launcher), ``torch._dynamo``
  imported in the parent first: the bug itself. When this reaches 0, a torch release fixed it;
- ``torch``: the same without ``torch._dynamo`` in the parent (the rare case);
- ``nb_dist+dynamo``: ``nb_dist.notebook_launcher`` in the first mode's parent; nb_dist's
  ranks keep every group until ``os._exit`` (``nb_dist/_rank/_groups.py``). Target: 0 hangs.

Run: ``python bench/group_teardown_hang.py`` (a few minutes on 2 cores; ``--quick`` about a
minute). Writes ``bench/results/group_teardown_hang.json`` and prints markdown. The regression
test of the same patterns, in CI, is ``tests/test_group_teardown.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish

NAME = "group_teardown_hang"
MODES = ("torch+dynamo", "torch", "nb_dist+dynamo")

TRIAL = textwrap.dedent(
    """
    import os, sys, time
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mode, launches, hang_after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if mode.endswith("+dynamo"):
        import torch._dynamo  # noqa: F401 - what a kernel has after its first DDP cell
    import multiprocessing
    import socket
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP


    class Trainer:
        def __init__(self, model):
            self.model = DDP(model)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

        def train(self, steps):
            for _ in range(steps):
                x, y = torch.randn(32, 20), torch.randn(32, 1)
                self.opt.zero_grad()
                F.mse_loss(self.model(x), y).backward()
                self.opt.step()


    def main(steps):
        dist.init_process_group("gloo")
        trainer = Trainer(nn.Linear(20, 1))
        trainer.train(steps)
        dist.destroy_process_group()
        # returning frees `trainer` and with it the DDP model


    def rank(r, port):
        os.environ.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        main(64)


    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


    def bare_launch():
        ctx = multiprocessing.get_context("fork")
        port = free_port()
        procs = [ctx.Process(target=rank, args=(r, port)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + hang_after
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        return bool(hung)


    def nb_dist_launch():
        from nb_dist import LaunchTimeoutError, notebook_launcher
        try:
            notebook_launcher(main, args=(64,), num_processes=2, output="none",
                              timeout=hang_after, hang_notice_after=None)
        except LaunchTimeoutError:
            return True
        return False


    launch = nb_dist_launch if mode.startswith("nb_dist") else bare_launch
    hung_at = None
    for i in range(launches):
        if launch():
            hung_at = i
            break
    print("RESULT", "hung" if hung_at is not None else "ok", hung_at)
    """
)


def _trial(mode: str, launches: int, hang_after: float) -> dict[str, Any]:
    began = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", TRIAL, mode, str(launches), str(hang_after)],
        cwd=ROOT, capture_output=True, text=True, timeout=hang_after * launches + 120,
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"outcome": "error", "detail": run.stderr[-800:], "seconds": 0.0}
    _, outcome, at = line.split()
    return {
        "outcome": outcome,
        "hung_at_launch": None if at == "None" else int(at),
        "seconds": round(time.monotonic() - began, 2),
    }


def measure(trials: int, launches: int, hang_after: float) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for i in range(trials):
        for mode in MODES:  # interleaved: a slow patch of the machine hits every mode
            result = _trial(mode, launches, hang_after)
            runs[mode].append(result)
            print(f"trial {i + 1}/{trials} {mode}: {result['outcome']}", file=sys.stderr)
    summary = {
        mode: {
            "trials": len(found),
            "hung": sum(r["outcome"] == "hung" for r in found),
            "errors": sum(r["outcome"] == "error" for r in found),
        }
        for mode, found in runs.items()
    }
    return {
        "trials": trials, "launches_per_trial": launches, "hang_after_s": hang_after,
        "summary": summary, "runs": runs,
    }  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"Each trial: a fresh process, {data['launches_per_trial']} launches of the DDP "
        f"tutorial's `main` on 2 ranks; hung = a launch not done after "
        f"{data['hang_after_s']:g} s.",
        "",
        "| mode | trials | hung | rate |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode, row in data["summary"].items():
        rate = row["hung"] / row["trials"] if row["trials"] else 0.0
        lines.append(f"| {mode} | {row['trials']} | {row['hung']} | {rate:.0%} |")
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    ours = data["summary"]["nb_dist+dynamo"]
    return [
        {
            "name": "nb_dist ranks never hang in group teardown",
            "target": "0 hung trials",
            "measured": f"{ours['hung']} of {ours['trials']}",
            "met": ours["hung"] == 0 and ours["errors"] == 0,
        }
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(data["summary"])
    rates = [100 * data["summary"][m]["hung"] / max(1, data["summary"][m]["trials"]) for m in modes]
    fig, ax = plt.subplots(figsize=(6, 3), dpi=120)
    ax.bar(modes, rates, color=["tab:red", "tab:orange", "tab:blue"])
    ax.set_ylabel("trials that hung (%)")
    ax.set_ylim(0, 100)
    ax.set_title("DDP model freed after destroy_process_group(): hangs")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 trials per mode")
    parser.add_argument("--trials", type=int, default=12, help="trials per mode (default 12)")
    parser.add_argument("--launches", type=int, default=4, help="launches per trial (4)")
    parser.add_argument("--hang-after", type=float, default=20.0, help="seconds (20)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    trials = 4 if args.quick else args.trials
    return publish(sys.modules[__name__], measure(trials, args.launches, args.hang_after), args.out)


if __name__ == "__main__":
    sys.exit(main())
