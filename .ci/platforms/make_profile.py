"""Write a platform profile: the packages a kernel and nb_dist need, at a platform's versions.

A profile is the platform's own `pip freeze` reduced to the closure of ROOTS (torch, the
kernel, widget and plotting stacks, Accelerate, the test runner the platform ships), each pinned
to the version the platform has. .ci/run installs a profile into a fresh venv of the platform's
Python, then installs nb_dist the way a user would and fails if pip changed any of it.

    python .ci/platforms/make_profile.py FREEZE --platform NAME --source TEXT --out FILE

FREEZE is a file or an https URL of the platform's freeze, e.g. Colab's public record
https://raw.githubusercontent.com/googlecolab/backend-info/COMMIT/pip-freeze.gpu.txt
(Kaggle's image is built on a Colab image: use Colab's freeze at the commit it names). Run it
with the platform's Python version (a venv of `pyenv` 3.12 or 3.13): pip resolves the closure
for the interpreter running it, from the package index.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import urllib.request
from datetime import date
from pathlib import Path

# What a notebook kernel running nb_dist and its kernel-level tests imports. Everything these
# need comes along at the platform's version.
ROOTS = [
    "torch",
    "ipykernel",
    "ipython",
    "ipywidgets",
    "jupyter_client",
    "traitlets",
    "matplotlib",
    "numpy",
    "cloudpickle",
    "psutil",
    "accelerate",
    "transformers",  # notebook 09 runs a Trainer where it is installed
    "pytest",
    "nbformat",
    "nbclient",
    "nbconvert",
    "packaging",
]

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(source: str) -> dict[str, str]:
    """name -> version for every `name==version` line (local labels such as +cu128 dropped:
    the index's build of that release is what a profile installs)."""
    if source.startswith("https://"):
        with urllib.request.urlopen(source, timeout=60) as response:
            text = response.read().decode()
    else:
        text = Path(source).read_text()
    pins = {}
    for line in text.splitlines():
        if match := _PIN.match(line.strip()):
            pins[_normal(match[1])] = match[2].split("+")[0]
    return pins


def _cuda_library(name: str) -> bool:
    return name.startswith(("nvidia-", "cuda-"))


def index_pins(pins: dict[str, str]) -> dict[str, str]:
    """The pins pip can hold from the package index. A platform's torch is a build of the
    PyTorch index for one CUDA (2.11.0+cu128); the package index's build of the same release may
    be made for another (2.11.0 there needs CUDA 13), so the CUDA libraries follow torch's own
    requirements, not the platform's pins. On a machine without a GPU both builds run on CPU."""
    return {name: version for name, version in pins.items() if not _cuda_library(name)}


def resolve(held: dict[str, str]) -> dict[str, str]:
    """The closure of ROOTS as pip resolves it with every held platform pin as a constraint."""
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch, "platform.txt")
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(held.items())))
        report = Path(scratch, "report.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                "-c",
                str(constraints),
                *ROOTS,
            ],
            check=True,
        )
        installs = json.loads(report.read_text())["install"]
    return {_normal(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("freeze", help="the platform's pip freeze: a file or an https URL")
    parser.add_argument("--platform", required=True, help="its name, for the header")
    parser.add_argument("--source", required=True, help="where the freeze came from")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    pins = read_freeze(args.freeze)
    missing = [root for root in ROOTS if _normal(root) not in pins]
    if missing:
        sys.exit(f"the freeze has no {', '.join(missing)}: is it a platform's full freeze?")
    held = index_pins(pins)
    resolved = resolve(held)
    drifted = {n: v for n, v in resolved.items() if n in held and held[n] != v}
    if drifted:
        sys.exit(f"pip resolved other versions than the platform's: {drifted}")
    python = ".".join(platform.python_version_tuple()[:2])
    lines = [
        f"# {args.platform}'s versions of what a kernel running nb_dist needs ({len(resolved)}",
        f"# packages), Python {python}. From:",
        f"#   {args.source}",
        f"# Written {date.today()} by .ci/platforms/make_profile.py: rerun it for a new release.",
        f"# python-version: {python}",
        *(f"{name}=={version}" for name, version in sorted(resolved.items())),
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {len(resolved)} packages")


if __name__ == "__main__":
    main()
