"""A rank that returns right after ``init_process_group`` against a slower peer.

gloo's ``connectFullMesh`` finishes on one rank before the other; without a barrier the
first rank's function returns, the process exits, and the peer still connecting to it fails
with "Connection closed by peer". nb_dist sets torch's own ``TORCH_DIST_INIT_BARRIER=1`` in
every rank (a store-based barrier at the end of ``init_process_group``/``new_group``). This
runs N launches of init-and-return with the barrier off and on, on a machine loaded with
spinning processes (the race needs a rank that is scheduled late), and prints failures and
the time per launch.

    python bench/init_race.py [--launches 150] [--ranks 2] [--spinners 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist

import nb_dist


def init_and_return() -> int:
    dist.init_process_group("gloo")
    return dist.get_rank()


def trial(launches: int, ranks: int, barrier: str) -> tuple[int, float]:
    os.environ["TORCH_DIST_INIT_BARRIER"] = barrier  # the ranks inherit the user's setting
    failures, started = 0, time.perf_counter()
    for _ in range(launches):
        try:
            nb_dist.notebook_launcher(
                init_and_return, num_processes=ranks, output="none", timeout=60
            )
        except nb_dist.LaunchError:
            failures += 1
    return failures, (time.perf_counter() - started) / launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=150)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--spinners", type=int, default=4)
    args = parser.parse_args()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)
    ]
    try:
        print(f"{args.launches} launches of {args.ranks} ranks, {args.spinners} spinners")
        for barrier in ("0", "1"):
            failures, per_launch = trial(args.launches, args.ranks, barrier)
            print(
                f"TORCH_DIST_INIT_BARRIER={barrier}: {failures} failed, "
                f"{per_launch * 1000:.0f} ms per launch"
            )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


if __name__ == "__main__":
    main()
