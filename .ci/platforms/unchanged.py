"""Record the packages of this environment, or fail if any recorded one changed since.

    python unchanged.py --record FILE          write every installed package's version
    python unchanged.py FILE --after "STEP"    exit 1, naming each package STEP changed

Run with the environment's own interpreter: it reads that environment's installed packages.
A platform's runtime breaks when pip replaces its packages (Colab's kernel stack), so a
profile of .ci/run fails when installing nb_dist changed any of them.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """name -> version of every package installed here (pip itself left out)."""
    found = {_normal(d.metadata["Name"]): d.version for d in metadata.distributions()}
    found.pop("pip", None)
    return found


def changes(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """'name: old -> new' (or '-> removed') for every package of ``before`` not as it was."""
    return [
        f"{name}: {version} -> {now.get(name, 'removed')}"
        for name, version in sorted(before.items())
        if now.get(name) != version
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--record", action="store_true", help="write the record, check nothing")
    parser.add_argument(
        "--after", default="the last step", help="what was installed, for the message"
    )
    args = parser.parse_args(argv)
    if args.record:
        args.file.write_text("".join(f"{n}=={v}\n" for n, v in sorted(installed().items())))
        return 0
    before = dict(line.split("==", 1) for line in args.file.read_text().split())
    changed = changes(before, installed())
    if changed:
        print(
            f"{args.after} changed {len(changed)} of the platform's packages:\n  "
            + "\n  ".join(changed)
            + "\nOn the platform this replaces what its runtime was built with. Lower the"
            " requirement in pyproject.toml that pulled it in to the platform's version.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
