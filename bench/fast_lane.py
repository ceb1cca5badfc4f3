"""How long the fast lane takes: ``python -m pytest -m fast``, the suite a developer runs
before each commit (unit tests and one launch per feature).

Runs the lane ``--repeats`` times (1) in a fresh interpreter from the project root, and
records the wall time, how many tests ran and passed, and the ten slowest tests (pytest's
``--durations``). The promise (README, "Tests"): the fast lane in at most 3 minutes on
2 cores. Run it on an otherwise idle machine: ``python bench/fast_lane.py`` (2-3 minutes).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish, stats

NAME = "fast_lane"
LIMIT_S = 180.0
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")
_SLOW = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)$", re.MULTILINE)


def run_once() -> dict[str, Any]:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "fast", "-q", "-p", "no:cacheprovider",
         "--durations=10"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    wall = time.perf_counter() - began
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind.rstrip("s"): int(n) for n, kind in _SUMMARY.findall(tail)}
    slowest = [(name, float(s)) for s, name in _SLOW.findall(done.stdout)][:10]
    return {"wall_s": wall, "returncode": done.returncode, "counts": counts, "slowest": slowest}


def measure(repeats: int) -> dict[str, Any]:
    runs = [run_once() for _ in range(repeats)]
    return {
        "repeats": repeats,
        "runs": runs,
        "stats": {"wall_s": stats([r["wall_s"] for r in runs])},
    }


def markdown(data: dict) -> str:
    last = data["runs"][-1]
    wall = data["stats"]["wall_s"]
    rows = [
        "| what | median | max | n |",
        "| --- | ---: | ---: | ---: |",
        f"| `python -m pytest -m fast`, wall | {wall['median']:.0f} s | {wall['max']:.0f} s "
        f"| {wall['n']} |",
        "",
        f"Tests: {last['counts']} (exit status {last['returncode']}). The slowest:",
        "",
        "| test | s |",
        "| --- | ---: |",
    ]
    rows += [f"| `{name}` | {seconds:.1f} |" for name, seconds in last["slowest"]]
    return "\n".join(rows)


def targets(data: dict) -> list[dict]:
    wall = data["stats"]["wall_s"]["median"]
    passed = all(r["returncode"] == 0 for r in data["runs"])
    return [
        {"name": "the fast lane, 2 cores", "target": f"<= {LIMIT_S:.0f} s, all passed",
         "measured": f"{wall:.0f} s, {'all passed' if passed else 'FAILURES'}",
         "met": wall <= LIMIT_S and passed},
    ]  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = data["runs"][-1]["slowest"]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = [name.split("::")[-1][:50] for name, _ in last][::-1]
    ax.barh(names, [s for _, s in last][::-1])
    ax.set_xlabel("s")
    ax.set_title(f"fast lane: {data['stats']['wall_s']['median']:.0f} s; its slowest tests",
                 fontsize=9)  # fmt: skip
    ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return publish(sys.modules[__name__], measure(args.repeats), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
