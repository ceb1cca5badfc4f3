"""Run every benchmark, one after another, and build one report: JSON, PNG plots and markdown.

    python bench/run_all.py            # the full suite, a few minutes on 2 cores
    python bench/run_all.py --quick    # a smoke run of everything, into bench/results/quick/
    python bench/run_all.py --only launch_latency memory
    python bench/run_all.py --report-only   # rebuild plots and markdown from existing JSON

Each benchmark runs in its own fresh interpreter (so one benchmark's imports, threads and
memory cannot colour the next one's numbers) and writes ``bench/results/<name>.json``. Then
this script writes:

- ``bench/results/run.json``: the machine, every benchmark's data and every target, in one file;
- ``bench/results/<name>.png``: one plot per benchmark;
- ``bench/results/REPORT.md``: the targets table, then each benchmark's tables and plot;
- the README's "Performance" section (between the ``bench:start``/``bench:end`` markers): the
  targets table and the plots, so the README always shows the latest real run.

Run it on a machine that is otherwise idle: every number is a wall-clock time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import BENCH, RESULTS, ROOT, machine_info, read_result

# In the order they run; cheap and launch-sensitive ones first, on a machine still cool.
BENCHMARKS = (
    "import_cost",
    "launch_latency",
    "step_overhead",
    "output_path",
    "result_transfer",
    "memory",
    "scaling",
    "relaunch",
    "fork_after_compute",
    "collective_counter",
    "debug_entry",
    "live_ranks",
    "group_teardown_hang",
    "fork_beside_store",
    "first_cell",
    "fast_lane",
)
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# A benchmark that runs longer than this is stuck: it is killed and reported as failed.
LIMIT_S = 600


def run_one(name: str, quick: bool, out: Path) -> dict[str, Any]:
    """Run ``bench/<name>.py`` in a fresh interpreter; return how it went."""
    cmd = [sys.executable, str(BENCH / f"{name}.py"), "--out", str(out)]
    if quick:
        cmd.append("--quick")
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    # The checkout's nb_dist, whatever is installed: the numbers are for this code.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=LIMIT_S, start_new_session=True)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - started
    status = "ok" if code == 0 else ("timed out" if code is None else f"exit code {code}")
    print(f"== {name}: {status} in {seconds:.0f} s\n", flush=True)
    return {"status": status, "seconds": round(seconds, 1)}


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _fmt_met(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


def _when(results: dict[str, dict[str, Any]], machine: dict[str, Any]) -> str:
    """When and at which commit the numbers were measured: each benchmark's own JSON says;
    a report rebuilt from results of several runs says so instead of stamping today."""
    stamps = sorted(
        {(str(d.get("finished_at", ""))[:10], str(d.get("machine", {}).get("git_commit")))
         for d in results.values()}
    )  # fmt: skip
    if len(stamps) == 1:
        date, commit = stamps[0]
        return f"commit {commit}; {date}."
    dates = sorted({date for date, _ in stamps if date})
    return (
        f"measured {dates[0]} to {dates[-1]} at several commits (each benchmark's JSON has "
        f"its own); report built at commit {machine['git_commit']}."
    )


def build_report(out: Path, runs: dict[str, dict[str, Any]]) -> str:
    """Plots, REPORT.md and run.json from the JSON files in ``out``; returns the README part."""
    import matplotlib

    matplotlib.use("Agg")

    sections, target_rows, combined = [], [], {}
    for name in BENCHMARKS:
        data = read_result(name, out)
        if data is None:
            sections.append(
                f"## {name}\n\nNo result: {runs.get(name, {}).get('status', 'not run')}."
            )
            continue
        module = _module(name)
        combined[name] = data
        png = out / f"{name}.png"
        try:
            module.plot(data, png)
        except Exception as exc:  # a broken plot must not hide the numbers
            print(f"plot of {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        body = module.markdown(data).strip()
        image = f"\n\n![{name}]({png.name})" if png.exists() else ""
        sections.append(f"## {name}\n\n{body}{image}")
        for t in module.targets(data):
            target_rows.append((name, t))

    machine = machine_info()
    table = [
        "| what | target | measured | result |",
        "| --- | --- | --- | --- |",
    ]
    for _name, t in target_rows:
        table.append(f"| {t['name']} | {t['target']} | {t['measured']} | {_fmt_met(t['met'])} |")
    table_md = "\n".join(table)
    header = (
        f"Machine: {machine['cpu_count']} CPUs, {machine['memory_gib']} GiB, "
        f"{machine['platform']}; Python {machine['python']}, torch {machine['torch']}, "
        f"nb_dist {machine['nb_dist']}, accelerate {machine['accelerate']}; "
        + _when(combined, machine)
    )
    report = "\n\n".join(["# Benchmark report", header, "## Targets", table_md, *sections])
    (out / "REPORT.md").write_text(report + "\n")
    (out / "run.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "runs": runs,
                "targets": [{"benchmark": n, **t} for n, t in target_rows],
                "results": combined,
            },
            indent=2,
        )
        + "\n"
    )
    return header + "\n\n" + table_md


def update_readme(targets_md: str, out: Path) -> bool:
    """Replace the README's bench section with the targets table and the plots."""
    text = README.read_text()
    if START not in text or END not in text:
        print(f"README.md has no {START} ... {END} section; left unchanged.", file=sys.stderr)
        return False
    rel = os.path.relpath(out, ROOT)
    images = "\n".join(
        f"![{name}]({rel}/{name}.png)" for name in BENCHMARKS if (out / f"{name}.png").exists()
    )
    block = (
        f"{START}\n<!-- written by `python bench/run_all.py`; do not edit by hand -->\n\n"
        f"{targets_md}\n\nEvery table, with the method behind it: "
        f"[{rel}/REPORT.md]({rel}/REPORT.md).\n\n{images}\n{END}"
    )
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    README.write_text(pattern.sub(lambda _: block, text))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run of everything")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    parser.add_argument("--report-only", action="store_true", help="rebuild from existing JSON")
    parser.add_argument(
        "--out", type=Path, help="results folder (default bench/results, bench/results/quick)"
    )
    parser.add_argument(
        "--no-readme", action="store_true", help="leave README.md unchanged (e.g. for --quick)"
    )
    args = parser.parse_args(argv)
    # A smoke run must not overwrite the numbers of the last full run.
    out = (args.out or (RESULTS / "quick" if args.quick else RESULTS)).resolve()
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict[str, Any]] = {}
    if not args.report_only:
        started = time.monotonic()
        for name in args.only or BENCHMARKS:
            runs[name] = run_one(name, args.quick, out)
        print(f"all benchmarks: {time.monotonic() - started:.0f} s", flush=True)
    targets_md = build_report(out, runs)
    print(targets_md)
    print(f"\nreport: {out / 'REPORT.md'}")
    if not (args.no_readme or args.quick):
        update_readme(targets_md, out)
    failed = [name for name, r in runs.items() if r["status"] != "ok"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
