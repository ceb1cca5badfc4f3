"""What nb_dist costs a process before it launches anything: its import, and a forked rank.

- **import**: ``import nb_dist`` in a fresh plain Python process that has imported torch
  already (what a notebook's first cell does), timed with ``time.perf_counter`` around the
  import alone; ``--repeats`` processes (15), each a cold interpreter with warm file caches.
  Also how many modules of nb_dist's and of the notebook's side (IPython, widgets,
  matplotlib, traitlets) that import brought in.
- **a forked rank's own memory**: in a real ipykernel (``_common.run_in_kernel``) that
  imported torch and nb_dist, ``notebook_launcher(own_memory, num_processes=2)``, whose ranks
  report their USS (``psutil``: the pages only that process maps, what it added to the
  kernel's copy-on-write image) just before returning; the first launch is not counted (it
  pays one-time imports), the median of the ranks of three more is.

Run: ``python bench/import_cost.py`` (about 20 s on 2 cores). Targets (the architecture
issue): the import ≤ 0.1 s after torch; a forked rank's USS ≤ 16 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from _common import RESULTS, publish, run_in_kernel, stats

NAME = "import_cost"
FRONTEND = ("IPython", "ipywidgets", "matplotlib", "traitlets")

_IMPORT = """
import json, sys, time
import torch
began = time.perf_counter()
import nb_dist
took = time.perf_counter() - began
ours = [m for m in sys.modules if m.startswith("nb_dist")]
front = [m for m in sys.modules if m.split(".")[0] in FRONTEND]
print(json.dumps({"seconds": took, "nb_dist_modules": len(ours), "frontend_modules": len(front)}))
"""

_RANK_USS = """
import json, statistics
import torch
import nb_dist

def own_memory():
    import psutil
    return psutil.Process().memory_full_info().uss / 2**20

nb_dist.notebook_launcher(own_memory, num_processes=2, output="none")
seen = []
for _ in range(3):
    seen += list(nb_dist.notebook_launcher(own_memory, num_processes=2, output="none"))
print(JSON_MARK + json.dumps({"rank_uss_mib": seen}))
"""


def measure(repeats: int) -> dict[str, Any]:
    code = f"FRONTEND = {FRONTEND!r}\n" + textwrap.dedent(_IMPORT)
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)  # fmt: skip
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    memory = run_in_kernel(textwrap.dedent(_RANK_USS), timeout=300)
    samples = {
        "import_after_torch": [r["seconds"] for r in runs],
        "rank_uss_mib": memory["rank_uss_mib"],
    }
    return {
        "repeats": repeats,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "modules": {
            "nb_dist": runs[-1]["nb_dist_modules"],
            "frontend": runs[-1]["frontend_modules"],
        },
    }


def markdown(data: dict) -> str:
    s, m = data["stats"], data["modules"]
    imp, uss = s["import_after_torch"], s["rank_uss_mib"]
    return "\n".join([
        "| what | median | p95 | n |",
        "| --- | ---: | ---: | ---: |",
        f"| `import nb_dist` after torch, plain process | {imp['median'] * 1000:.1f} ms "
        f"| {imp['p95'] * 1000:.1f} ms | {imp['n']} |",
        f"| a forked rank's own memory (USS), in a kernel | {uss['median']:.1f} MiB "
        f"| {uss['p95']:.1f} MiB | {uss['n']} |",
        "",
        f"`import nb_dist` brings in {m['nb_dist']} of nb_dist's modules and {m['frontend']} "
        "of the notebook's side (IPython, widgets, matplotlib, traitlets).",
    ])  # fmt: skip


def targets(data: dict) -> list[dict]:
    s = data["stats"]
    took, uss = s["import_after_torch"]["median"], s["rank_uss_mib"]["median"]
    return [
        {"name": "import nb_dist after torch", "target": "<= 0.1 s",
         "measured": f"{took * 1000:.1f} ms", "met": took <= 0.1},
        {"name": "a forked rank's USS", "target": "<= 16 MiB", "measured": f"{uss:.1f} MiB",
         "met": uss <= 16},
    ]  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 2.6))
    left.boxplot([[v * 1000 for v in data["samples"]["import_after_torch"]]])
    left.set_ylabel("ms")
    left.set_title("import nb_dist after torch", fontsize=9)
    right.boxplot([data["samples"]["rank_uss_mib"]])
    right.set_ylabel("MiB")
    right.set_title("a forked rank's USS", fontsize=9)
    for ax in (left, right):
        ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return publish(sys.modules[__name__], measure(args.repeats), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
