"""What every benchmark shares: machine facts, summary statistics, result files, a real kernel.

Each benchmark module in ``bench/`` follows the same shape, so ``bench/run_all.py`` can run them
one after another and build one report:

- ``NAME``: the result file's stem (``bench/results/<NAME>.json``);
- ``main(argv)``: parses ``--quick`` and ``--out``, measures, writes the JSON with
  :func:`write_result` and prints the markdown;
- ``markdown(data) -> str``: the table(s) for the report;
- ``plot(data, path) -> None``: one PNG figure (matplotlib, Agg backend);
- ``targets(data) -> list[dict]``: each target with ``name``, ``target``, ``measured`` and
  ``met`` (True, False, or None when it could not be measured here).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
JSON_MARK = "NB_DIST_BENCH_JSON "


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", "unknown")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _memory_gib() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().total / 2**30, 1)


def machine_info() -> dict[str, Any]:
    """Facts that make a result comparable: CPUs, memory, platform and library versions."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "nb_dist": _version("nb_dist"),
        "accelerate": _version("accelerate"),
        "git_commit": _git_commit(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def stats(samples: list[float]) -> dict[str, float | int]:
    """Median, p95, mean, min, max and count of a list of samples (seconds or any unit)."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    # Nearest-rank p95: the smallest sample with at least 95% of the samples at or below it.
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    return {
        "median": statistics.median(ordered),
        "p95": p95,
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def write_result(name: str, data: dict[str, Any], out: Path = RESULTS) -> Path:
    """Write ``<out>/<name>.json`` with the machine facts and a timestamp added."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **data,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def publish(module: Any, data: dict[str, Any], out: Path) -> int:
    """End of a benchmark's ``main``: write its JSON, plot it, print its tables and targets."""
    path = write_result(module.NAME, data, out)
    record = json.loads(path.read_text())
    with contextlib.suppress(ImportError):
        module.plot(record, out / f"{module.NAME}.png")
    print(module.markdown(record))
    for target in module.targets(record):
        print(f"target {target['name']}: {target['measured']} -> met={target['met']}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def read_result(name: str, out: Path = RESULTS) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def run_in_kernel(code: str, timeout: float = 300.0, *, stamped: bool = False) -> Any:
    """Run ``code`` as one cell of a fresh ipykernel and return the JSON it prints.

    The cell must print one line ``JSON_MARK + json.dumps(...)``; that value is returned, or
    with ``stamped=True`` ``(value, [(time.monotonic() at receipt, text), ...])`` of every
    stdout stream message (for latency measurements). The kernel starts in the project root
    (so ``nb_dist`` imports as in a notebook) and is shut down afterwards, whatever happens.
    """
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT), env={**os.environ, "OMP_NUM_THREADS": "1"})
    client = km.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        msg_id = client.execute(f"JSON_MARK = {JSON_MARK!r}\n" + code)
        deadline = time.monotonic() + timeout
        received: list[tuple[float, str]] = []
        error = None
        while True:
            try:
                msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the kernel cell did not finish within {timeout:g} s") from None
            now = time.monotonic()
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content.get("name") == "stdout":
                received.append((now, content["text"]))
            elif kind == "error":
                error = "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if error:
            raise RuntimeError(f"the kernel cell failed:\n{error}")
        text = "".join(t for _, t in received)
        for line in text.splitlines():
            if line.startswith(JSON_MARK):
                value = json.loads(line[len(JSON_MARK) :])
                return (value, received) if stamped else value
        raise RuntimeError(f"no JSON line in the kernel's output:\n{text[-2000:]}")
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def leftover_children() -> list[int]:
    """Pids of this process's live descendants (a benchmark must leave none behind)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
    return found


def python() -> str:
    """The interpreter running the benchmarks (for subprocesses such as torchrun)."""
    return sys.executable
