"""``nb-dist`` command line: ``nb-dist demo`` trains a small DDP model through the launcher."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from ._kernel._errors import LaunchError, UnsafeLaunchError


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Launch distributed PyTorch from a Jupyter cell (nb_dist) - command line.",
    )
    parser.add_argument("--version", action="version", version=f"nb_dist {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small classifier with DDP on N CPU processes through notebook_launcher",
        description="Train a small MLP with DistributedDataParallel on N CPU processes, "
        "launched by nb_dist.notebook_launcher (the code path a notebook cell uses). Prints "
        "rank-labelled progress, then loss, accuracy and samples per rank, whether all ranks "
        "ended with identical weights, and the wall time.",
    )
    demo.add_argument(
        "--num-processes", type=int, default=2, metavar="N", help="worker processes (default 2)"
    )
    demo.add_argument(
        "--epochs", type=int, default=3, metavar="N", help="training epochs (default 3)"
    )
    demo.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default="fork",
        help="how workers start (default fork)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    demo.add_argument(
        "--mixed-precision",
        choices=("no", "bf16"),
        default="no",
        help="run forward passes under bf16 autocast (default no)",
    )
    demo.add_argument(
        "--fail-rank",
        type=int,
        default=None,
        metavar="K",
        help="make rank K raise in the 2nd epoch, to see how a failure is reported",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "nb-dist") -> int:
    args = _parser(prog).parse_args(argv)
    from ._demo import run_demo  # imports torch: keep --help and --version fast

    try:
        summary = run_demo(
            num_processes=args.num_processes,
            epochs=args.epochs,
            start_method=args.start_method,
            seed=args.seed,
            mixed_precision=args.mixed_precision,
            fail_rank=args.fail_rank,
        )
    except (UnsafeLaunchError, ValueError, TypeError) as exc:  # refused before anything ran
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:  # WorkerFailedError, LaunchTimeoutError
        print(f"{prog}: the demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if summary.params_identical else 1
