"""``nb-dist`` command line: ``nb-dist demo`` trains a small DDP model through the launcher;
``nb-dist run -n 2 train.py ARGS`` runs a torchrun script with nb_dist's reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from ._kernel import _scripts
from ._kernel._errors import LaunchError, UnsafeLaunchError
from .teach import _editions


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
        "--num-processes",
        type=int,
        default=2,
        metavar="N",
        help="processes, one per rank (default 2)",
    )
    demo.add_argument(
        "--epochs", type=int, default=3, metavar="N", help="training epochs (default 3)"
    )
    demo.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default="fork",
        help="how ranks start (default fork)",
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
    run = commands.add_parser(
        "run",
        help="run a torchrun script on N local ranks, with rank-labelled output and reports",
        description=_scripts.DESCRIPTION + " The exit status is 0 when every rank ended well, "
        "1 when a rank failed or the run timed out, 2 for bad arguments, 130 on Ctrl-C.",
    )
    _scripts.add_options(run)
    edition = commands.add_parser(
        "student-edition",
        help="write the student edition of teaching notebooks (answers blank, no outputs)",
        description="Make the student edition of solutions-edition notebooks: each exercise's "
        "answer becomes its blank (with ...), solutions-only cells and every output are left "
        "out. With --check, write nothing and exit 1 when the editions in OUT are out of date.",
    )
    edition.add_argument("sources", nargs="+", type=Path, metavar="NOTEBOOK")
    edition.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where the student editions go"
    )
    edition.add_argument(
        "--check", action="store_true", help="only say whether the editions in DIR are current"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "nb-dist") -> int:
    args = _parser(prog).parse_args(argv)
    if args.command == "run":
        return _run(args, f"{prog} run")
    if args.command == "student-edition":
        return _student_edition(args, f"{prog} student-edition")
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


def _student_edition(args: argparse.Namespace, prog: str) -> int:
    """``nb-dist student-edition``: write (or, with --check, compare) the student editions."""
    missing = [str(p) for p in args.sources if not p.is_file()]
    if missing:
        print(f"{prog}: error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        if args.check:
            stale = _editions.stale_editions(args.sources, args.out)
            if stale:
                print(
                    f"{prog}: out of date in {args.out}: {', '.join(stale)}. Run "
                    f"'nb-dist student-edition ... --out {args.out}' and commit the result.",
                    file=sys.stderr,
                )
                return 1
            print(f"{prog}: {len(args.sources)} student edition(s) in {args.out} are current")
            return 0
        written = _editions.write_student_editions(args.sources, args.out)
    except ValueError as exc:  # a malformed exercise: nothing was written for it
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{prog}: wrote {len(written)} notebook(s) to {args.out}")
    return 0


def _run(args: argparse.Namespace, prog: str) -> int:
    """``nb-dist run``: the script's launch; the exit status says how it went."""
    try:
        _scripts.run_parsed(args)
    except (UnsafeLaunchError, ValueError, TypeError, OSError) as exc:  # refused: nothing ran
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:  # a rank failed, or the run timed out: the report is the message
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # every rank was stopped
        _forget_unhandled_keyboard_interrupt()
        print(f"{prog}: interrupted: {exc}", file=sys.stderr)
        return 130
    return 0


def _forget_unhandled_keyboard_interrupt() -> None:
    """Keep the exit status 130 after a handled Ctrl-C under ``python -m nb_dist``.

    CPython (3.8 and later) marks a KeyboardInterrupt that leaves code run from a *string*
    (``exec``/``eval`` of source, as ``dataclasses`` does to define methods, often during a
    lazy import) as unhandled, even when a caller catches it; under ``-m`` the interpreter then
    ends itself by SIGINT at exit (status -2) instead of returning 130. Every string ``exec``
    clears that mark when it starts, so a harmless one after the interrupt was handled clears
    it; it cannot hide an interrupt nobody handled.
    """
    exec("pass", {})
