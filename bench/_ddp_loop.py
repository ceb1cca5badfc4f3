"""The DDP training loop that every launcher runs in bench/step_overhead.py and bench/scaling.py.

One function, :func:`train`, is used two ways, so every launcher runs byte-for-byte the same loop:

- imported: ``nb_dist.notebook_launcher(train, ...)`` and ``accelerate.notebook_launcher(train,
  ...)`` fork workers that call it (rank 0 returns every rank's timings; with ``out=`` it also
  writes them to a JSON file, which is how the accelerate launcher, which returns nothing,
  hands them back);
- as a script under torchrun: ``python -m torch.distributed.run --nproc-per-node 2
  bench/_ddp_loop.py --out timings.json ...`` (rank 0 writes the JSON file).

Each rank creates the gloo process group itself, builds an MLP (same seed on every rank), wraps it
in DistributedDataParallel and trains it with SGD on a few fixed synthetic batches (seeded per
rank) for ``warmup`` untimed steps, then ``steps`` timed ones: ``time.perf_counter`` around every
step and around the whole timed loop (wall time, and the process's CPU time). ``mode`` adds
per-step work: ``"report"`` calls ``nb_dist.report("loss", loss)``, ``"print"`` prints one
line. With ``comm_rounds`` it also times bare ``all_reduce`` calls of a flat tensor as large as
the model's gradients (each after a barrier, so the ranks start together).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # DDP imports it: see N_BATCHES below
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# DistributedDataParallel's constructor imports torch._dynamo (1.5-5 s and 70 MiB on 2 cores).
# Imported here, at module level: a forked worker (nb_dist, accelerate) inherits it from the
# launching process that imported this module, and a torchrun worker imports it at start-up, as
# it would anyway. Either way it stays out of the timed steps and out of every launch's time.
N_BATCHES = 8  # distinct synthetic batches per rank, cycled


def mlp(sizes: tuple[int, ...]) -> torch.nn.Sequential:
    """Linear layers of the given widths with ReLU between them."""
    layers: list[torch.nn.Module] = []
    for index, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        if index:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(n_in, n_out))
    return torch.nn.Sequential(*layers)


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "mean_s": statistics.fmean(ordered),
        "p95_s": ordered[max(0, -(-95 * len(ordered) // 100) - 1)],
        "min_s": ordered[0],
        "max_s": ordered[-1],
    }


def train(
    steps: int,
    warmup: int,
    sizes: tuple[int, ...] = (64, 256, 256, 10),
    batch: int = 64,
    mode: str = "plain",
    out: str | None = None,
    comm_rounds: int = 0,
    keep_steps: bool = False,
) -> list[dict[str, Any]] | None:
    """Train ``steps`` timed DDP steps; rank 0 returns every rank's timings, the others None."""
    if mode not in ("plain", "report", "print"):
        raise ValueError(f"mode={mode!r} must be 'plain', 'report' or 'print'")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        record = _timed_run(steps, warmup, tuple(sizes), batch, mode, comm_rounds, keep_steps)
        # The DDP model is gone by now (it lived in _timed_run), except for reference cycles:
        # collect them while the process group is alive. A DDP reducer freed after
        # destroy_process_group() holds the group's last reference and destroys it holding the
        # GIL, while gloo's worker thread may still need the GIL to free a finished collective's
        # tensors: a deadlock (torch 2.13; seen here as a rank hung at the end of a launch).
        gc.collect()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, record)
    finally:
        dist.destroy_process_group()
    if record["rank"] != 0:
        return None
    if out is not None:
        path = Path(out)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(gathered))
        partial.replace(path)  # complete or absent, never half-written
    return gathered


def _timed_run(
    steps: int,
    warmup: int,
    sizes: tuple[int, ...],
    batch: int,
    mode: str,
    comm_rounds: int,
    keep_steps: bool,
) -> dict[str, Any]:
    """Build the model, train, time; this rank's record. The model dies with this frame."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = DistributedDataParallel(mlp(sizes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = [
        (
            torch.randn(batch, sizes[0], generator=generator),
            torch.randint(0, sizes[-1], (batch,), generator=generator),
        )
        for _ in range(N_BATCHES)
    ]
    report = None
    if mode == "report":
        from nb_dist import report

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % N_BATCHES]
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if report is not None:
            report("loss", loss)
        elif mode == "print":
            print(f"step {i} loss {loss.item():.4f}")
        return loss

    for i in range(warmup):
        step(i)
    dist.barrier()
    clock = time.perf_counter
    times = [0.0] * steps
    loss = None
    cpu_began, began = time.process_time(), clock()
    for i in range(steps):
        t0 = clock()
        loss = step(warmup + i)
        times[i] = clock() - t0
    loop_s = clock() - began
    cpu_s = time.process_time() - cpu_began  # this process, all its threads (gloo's included)

    record: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "world_size": world,
        "steps": steps,
        "loop_s": loop_s,
        "loop_mean_s": loop_s / steps,
        "cpu_per_step_s": cpu_s / steps,
        **_summary(times),
        "final_loss": None if loss is None else loss.item(),
        "threads": torch.get_num_threads(),
    }
    if keep_steps:
        record["step_s"] = times
    if comm_rounds:
        numel = sum(p.numel() for p in model.parameters())
        flat = torch.ones(numel)
        for _ in range(2):  # warm-up
            dist.all_reduce(flat)
        comm = []
        for _ in range(comm_rounds):
            dist.barrier()
            t0 = clock()
            dist.all_reduce(flat)
            comm.append(clock() - t0)
        record["grad_numel"] = numel
        record["comm"] = {**_summary(comm), "samples_s": comm}
    return record


def main(argv: list[str] | None = None) -> int:
    """Entry point under torchrun: the same loop, rank 0 writes the timings to ``--out``."""
    parser = argparse.ArgumentParser(description="nb_dist benchmark DDP loop (run by torchrun)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--sizes", default="64,256,256,10", help="MLP widths, comma-separated")
    parser.add_argument("--batch", type=int, default=64, help="batch per rank")
    parser.add_argument("--mode", default="plain", choices=("plain", "report", "print"))
    parser.add_argument("--comm-rounds", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON file for the timings (rank 0)")
    args = parser.parse_args(argv)
    train(
        args.steps,
        args.warmup,
        tuple(int(s) for s in args.sizes.split(",")),
        args.batch,
        args.mode,
        args.out,
        args.comm_rounds,
    )
    return 0


if __name__ == "__main__":
    code = main()
    # Leave like a forked worker does (nb_dist's, and multiprocessing's under accelerate): with
    # os._exit, after flushing. A normal interpreter exit runs C++ static destructors, and about
    # 1 exit in 12 aborts there on this machine (torch 2.13, after destroy_process_group:
    # "terminate called without an active exception", no Python frame), failing the torchrun
    # run after the timings were taken.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
