"""How long debugging a rank takes to start, in a real ipykernel answered like JupyterLab.

Measured, in one fresh kernel, interleaved over rounds (2 ranks, gloo, a function that fails
on rank 1 after one barrier):

- ``failure_to_error``: the launch's wall time until ``WorkerFailedError`` reaches the cell,
  without and with ``debug="postmortem"`` (holding the rank must not slow the report);
- ``enter_post_mortem``: from sending ``%debug`` to the first ``input_request`` (the
  ``[rank 1] (Pdb)`` box appearing);
- ``command_round_trip``: from answering a prompt (``p y``) to the next ``input_request``;
- ``breakpoint_enter``: from sending a cell whose function calls ``nb_dist.breakpoint(rank=1)``
  to its first prompt (includes the launch: fork, process group, barrier).

No target is set by the issue for these; they are reported. Run: ``python bench/debug_entry.py``
(``--quick``: 2 rounds).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish, stats

NAME = "debug_entry"

SETUP = """
import nb_dist, time, torch.distributed as dist
def g(x):
    y = x * 3
    raise ValueError(f"bad {y}")
def f():
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        g(7)
    dist.barrier()
def pausing():
    dist.init_process_group("gloo")
    secret = 41
    nb_dist.breakpoint(rank=1)
    return secret
"""

FAIL = """
began = time.monotonic()
try:
    nb_dist.notebook_launcher(f, num_processes=2, debug={debug!r})
except nb_dist.WorkerFailedError as error:
    print("ELAPSED", time.monotonic() - began)
    err = error
"""


class _Kernel:
    """A fresh ipykernel whose input requests are answered from a script, timed."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, answers: tuple[str, ...] = ()) -> tuple[str, list[float]]:
        """Run a cell; its stdout and the time.monotonic() of each input request."""
        msg_id = self.kc.execute(code, allow_stdin=True)
        pending, prompts, out = list(answers), [], []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                self.kc.get_stdin_msg(timeout=0.001)
                prompts.append(time.monotonic())
                self.kc.input(pending.pop(0) if pending else "q")
            except queue.Empty:
                pass
            try:
                msg = self.kc.get_iopub_msg(timeout=0.001)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            if msg["msg_type"] == "error":
                raise RuntimeError("\n".join(msg["content"]["traceback"]))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out), prompts
        raise TimeoutError(code)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def measure(rounds: int) -> dict[str, Any]:
    kernel = _Kernel()
    samples: dict[str, list[float]] = {
        "failure_to_error_plain": [],
        "failure_to_error_postmortem": [],
        "enter_post_mortem": [],
        "command_round_trip": [],
        "breakpoint_enter": [],
    }
    try:
        kernel.run(SETUP)
        kernel.run(FAIL.format(debug=None))  # warm: the first launch imports more
        for _ in range(rounds):
            for debug in (None, "postmortem"):
                out, _ = kernel.run(FAIL.format(debug=debug))
                key = "failure_to_error_" + ("postmortem" if debug else "plain")
                samples[key].append(float(out.split("ELAPSED")[1].split()[0]))
            sent = time.monotonic()
            _, prompts = kernel.run("err.debug()", ("p y", "q"))
            samples["enter_post_mortem"].append(prompts[0] - sent)
            samples["command_round_trip"].append(prompts[1] - prompts[0])
            sent = time.monotonic()
            _, prompts = kernel.run("nb_dist.notebook_launcher(pausing, num_processes=2)", ("c",))
            samples["breakpoint_enter"].append(prompts[0] - sent)
    finally:
        kernel.close()
    return {
        "rounds": rounds,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
    }


def markdown(data: dict) -> str:
    labels = {
        "failure_to_error_plain": "a failing launch until its error (plain)",
        "failure_to_error_postmortem": 'the same with `debug="postmortem"`',
        "enter_post_mortem": "`err.debug()` until the first pdb prompt",
        "command_round_trip": "one pdb command (`p y`) until the next prompt",
        "breakpoint_enter": "a launch with `nb_dist.breakpoint(rank=1)` until its prompt",
    }
    lines = ["| debugging a rank (2 ranks, ipykernel) | median | p95 |", "| --- | ---: | ---: |"]
    for key, label in labels.items():
        s = data["stats"][key]
        lines.append(f"| {label} | {s['median'] * 1000:.0f} ms | {s['p95'] * 1000:.0f} ms |")
    return "\n".join(lines)


def targets(data: dict) -> list[dict]:
    return []  # reported, not judged: the issue sets no target


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(data["samples"])
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.boxplot([[v * 1000 for v in data["samples"][k]] for k in keys], orientation="horizontal")
    ax.set_yticks(range(1, len(keys) + 1), keys, fontsize=7)
    ax.set_xlabel("ms")
    ax.set_title("debugging a rank: time to a prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    data = measure(2 if args.quick else 8)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
