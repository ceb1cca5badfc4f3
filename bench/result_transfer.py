"""Result transfer: how long it takes to bring a rank's return value (a state_dict) to the kernel.

Rank 0 of a 2-rank fork launch builds a state_dict of float32 tensors (``--sizes`` MiB in all,
4 to 10 tensors, deterministic contents) and returns it; rank 1 returns None. Measured per
size, in interleaved rounds:

- ``payload``: the launch that returns the state_dict; ``baseline``: the same function, which
  builds the same tensors but returns None in their place. ``payload - baseline`` (paired per
  round) is what the return costs, seen from the caller;
- ``result path``: from ``time.monotonic()`` in rank 0 just before ``return`` to the moment the
  launcher returns in the kernel (same clock: CLOCK_MONOTONIC is system-wide on Linux). Its
  breakdown comes from two timing shims installed for the measurement, both calling the real
  code unchanged: around ``nb_dist._shared._values.dumps`` (serialise in the worker; it prints
  its timestamps to the rank's stderr, read back from ``result.logs``) and around
  ``_values.loads`` (unpickle in the kernel). So: worker
  teardown (stamp -> pickling starts), serialise, pipe transfer (pickling done -> the kernel
  holds all bytes), unpickle, and the launcher's end (reaping, closing pipes);
- ``floor``: the same bytes through a plain ``os.pipe`` between two processes: a forked child
  builds the same state_dict, stamps, ``pickle.dumps`` it and writes it; the parent reads it
  into one preallocated buffer and ``pickle.loads`` it: what a launcher that pickles the value
  as ``pickle`` does pays.

Every returned state_dict is compared with a fresh rebuild (same keys, dtypes, shapes,
``torch.equal`` values). The caller's peak RSS during each transfer is taken both from a
psutil sampling thread (every 2 ms) and from the kernel's own high-water mark (``VmHWM``,
reset before each launch through ``/proc/self/clear_refs``); it is reported above the RSS
before the launch, in multiples of the payload. The floor shows about 3: the received value
itself, the bytes it came in (alive while ``pickle.loads`` runs), and, inside
``pickle.loads``, one ``bytes`` object per tensor storage (torch pickles a storage as a
``torch.save`` blob, and the unpickler's memo keeps each blob until it returns).

nb_dist's result path, for reference (``nb_dist/_shared/_values.py``): the worker pickles the
value with its large tensors' bytes out of band (pickle 5), sends the sizes in a control
message, then writes the small pickle and each tensor's bytes, straight from its memory, to
the control pipe; the kernel reads each into its own preallocated buffer, which becomes the
tensor's memory. Expect about 1x the payload in the kernel, and no serialise or unpickle copy.

Run: ``python bench/result_transfer.py`` (about a minute on 2 cores; ``--quick``: 1 and
100 MiB only, fewer rounds, about 20 s). Also runs the 100 MiB case inside a real ipykernel
(``--no-kernel`` to skip). Writes
``bench/results/result_transfer.json`` (every sample, the parameters) and
``result_transfer.png``, and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import re
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import BENCH, RESULTS, leftover_children, publish, run_in_kernel, stats

NAME = "result_transfer"
SIZES_MIB = (1, 100, 500)
TARGET_RATIO = 1.5
MIB = 2**20
DUMPS_TAG = "NBRT_DUMPS"
_HEADER = struct.Struct("!ddQ")  # floor: stamp, pickled-at, byte count


# --------------------------------------------------------------------------- the payload
def tensor_count(mib: int) -> int:
    return 4 if mib < 10 else (8 if mib < 200 else 10)


def build_state(mib: int) -> dict[str, torch.Tensor]:
    """A state_dict of ``mib`` MiB of float32 tensors; the same contents on every call."""
    count = tensor_count(mib)
    numel = mib * MIB // 4 // count
    return {
        f"layer{i}.weight": torch.arange(numel, dtype=torch.float32).add_(0.5 * i)
        for i in range(count)
    }


def verify(state: Any, mib: int) -> bool:
    """Is ``state`` exactly what :func:`build_state` builds? One tensor rebuilt at a time."""
    if not isinstance(state, dict):
        return False
    count = tensor_count(mib)
    numel = mib * MIB // 4 // count
    if sorted(state) != sorted(f"layer{i}.weight" for i in range(count)):
        return False
    for i in range(count):
        got = state[f"layer{i}.weight"]
        if got.dtype != torch.float32 or got.shape != (numel,):
            return False
        if not torch.equal(got, torch.arange(numel, dtype=torch.float32).add_(0.5 * i)):
            return False
    return True


# --------------------------------------------------------------------------- what every rank runs
def make_state(mib: int, send: bool) -> tuple[float, dict | None] | None:
    """Rank 0 builds the state_dict and returns ``(stamp, state or None)``; rank 1: None."""
    torch.set_num_threads(1)
    if int(os.environ["RANK"]) != 0:
        return None
    state = build_state(mib)
    stamp = time.monotonic()
    return stamp, (state if send else None)


# --------------------------------------------------------------------------- timing shims
class _TimedLoads:
    """Times the kernel's ``_values.loads`` of a large value (its pickle and its buffers)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.loads_log: list[tuple[float, float, int]] = []

    def __call__(self, data: Any, buffers: list[Any]) -> Any:
        size = len(data) + sum(len(b) for b in buffers)
        if size < 65536:
            return self._real(data, buffers)
        began = time.monotonic()
        value = self._real(data, buffers)
        self.loads_log.append((began, time.monotonic(), size))
        return value


@contextlib.contextmanager
def timing_shims() -> Any:
    """Wrap nb_dist's serialise (worker) and unpickle (kernel) steps with timestamps."""
    from nb_dist._shared import _values

    original_dumps, original_loads = _values.dumps, _values.loads

    def timed_dumps(value: Any) -> tuple[bytes, list[memoryview]]:
        began = time.monotonic()
        data, buffers = original_dumps(value)
        ended = time.monotonic()
        size = len(data) + sum(b.nbytes for b in buffers)
        if size >= 65536:
            print(f"{DUMPS_TAG} {began:.6f} {ended:.6f} {size}", file=sys.stderr, flush=True)
        return data, buffers

    shim = _TimedLoads(original_loads)
    _values.dumps, _values.loads = timed_dumps, shim  # type: ignore[assignment]
    try:
        yield shim
    finally:
        _values.dumps, _values.loads = original_dumps, original_loads


# --------------------------------------------------------------------------- memory
def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakRSS:
    """This process's peak RSS during a block: a 2 ms psutil sampler and the kernel's VmHWM."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.sampled = 0
        self.hwm: int | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, self._process.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakRSS:
        self.hwm_reset = _reset_hwm()
        self.before = self._process.memory_info().rss
        self.sampled = self.before
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.hwm = _read_hwm() if self.hwm_reset else None

    def extra_mib(self) -> dict[str, float | None]:
        hwm = None if self.hwm is None else (self.hwm - self.before) / MIB
        return {"sampled": (self.sampled - self.before) / MIB, "hwm": hwm}


# --------------------------------------------------------------------------- one measurement
def nb_dist_once(mib: int, send: bool, shim: _TimedLoads) -> dict[str, Any]:
    """One 2-rank launch returning the state_dict (``send``) or None in its place."""
    import nb_dist

    shim.loads_log.clear()
    gc.collect()
    with PeakRSS() as memory:
        began = time.monotonic()
        result = nb_dist.notebook_launcher(
            make_state, args=(mib, send), num_processes=2, device="cpu", output="none"
        )
        returned = time.monotonic()
    stamp, state = result[0]
    record: dict[str, Any] = {
        "wall_s": returned - began,
        "result_path_s": returned - stamp,
        "rank1_is_none": result[1] is None,
    }
    if send:
        record["peak_extra_mib"] = memory.extra_mib()
        dumps = [line.split() for line in result.logs[0].splitlines() if line.startswith(DUMPS_TAG)]
        if dumps and shim.loads_log:
            _, d0, d1, nbytes = dumps[-1]
            l0, l1, _ = shim.loads_log[-1]
            record["pickled_bytes"] = int(nbytes)
            record["breakdown_s"] = {
                "worker teardown": float(d0) - stamp,
                "serialise": float(d1) - float(d0),
                "pipe transfer": l0 - float(d1),
                "unpickle": l1 - l0,
                "launcher end": returned - l1,
            }
        record["correct"] = verify(state, mib) and record["rank1_is_none"]
    del result, state
    gc.collect()
    return record


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_into(fd: int, buffer: bytearray) -> None:
    view, pos = memoryview(buffer), 0
    while pos < len(buffer):
        got = os.readv(fd, [view[pos:]])
        if got == 0:
            raise EOFError("the floor's child closed the pipe early")
        pos += got


def floor_once(mib: int) -> dict[str, Any]:
    """The same state_dict through a plain os.pipe from a forked child, with pickle."""
    gc.collect()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_fd)
            torch.set_num_threads(1)
            state = build_state(mib)
            stamp = time.monotonic()
            data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            _write_all(write_fd, _HEADER.pack(stamp, time.monotonic(), len(data)))
            _write_all(write_fd, data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        with PeakRSS() as memory:  # while the child builds the state_dict
            header = bytearray(_HEADER.size)
            _read_into(read_fd, header)
            stamp, pickled, nbytes = _HEADER.unpack(header)
            buffer = bytearray(nbytes)
            _read_into(read_fd, buffer)
            received = time.monotonic()
            state = pickle.loads(buffer)
            loaded = time.monotonic()
            del buffer
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    record = {
        "result_path_s": loaded - stamp,
        "pickled_bytes": nbytes,
        "breakdown_s": {
            "serialise": pickled - stamp,
            "pipe transfer": received - pickled,
            "unpickle": loaded - received,
        },
        "peak_extra_mib": memory.extra_mib(),
        "correct": verify(state, mib),
    }
    del state
    gc.collect()
    return record


def measure_size(mib: int, repeats: int, with_floor: bool = True) -> dict[str, list[dict]]:
    """``repeats`` rounds of baseline, payload (and floor) launches for one size."""
    out: dict[str, list[dict]] = {"baseline": [], "payload": [], "floor": []}
    with timing_shims() as shim:
        for _ in range(repeats):
            out["baseline"].append(nb_dist_once(mib, False, shim))
            out["payload"].append(nb_dist_once(mib, True, shim))
            if with_floor:
                out["floor"].append(floor_once(mib))
    return out


def warm_up() -> None:
    """One discarded launch (imports, first fork of a fresh process)."""
    with timing_shims() as shim:
        nb_dist_once(1, True, shim)


KERNEL_CELL = """
import json, sys
sys.path.insert(0, {bench!r})
import result_transfer as _rt
_rt.warm_up()
_out = _rt.measure_size({mib!r}, {repeats!r}, with_floor=False)
print(JSON_MARK + json.dumps(_out))
"""


# --------------------------------------------------------------------------- summaries
def _median(values: list[float]) -> float | None:
    return stats(values)["median"] if values else None


def summarize(samples: dict[str, dict[str, dict[str, list[dict]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for context, per_size in samples.items():
        out[context] = {}
        for size, runs in per_size.items():
            mib = int(size)
            payload, baseline, floor = runs["payload"], runs["baseline"], runs["floor"]
            diffs = [p["wall_s"] - b["wall_s"] for p, b in zip(payload, baseline, strict=False)]
            path = _median([r["result_path_s"] for r in payload])
            floor_path = _median([r["result_path_s"] for r in floor])
            parts = [r["breakdown_s"] for r in payload if "breakdown_s" in r]
            floor_parts = [r["breakdown_s"] for r in floor]

            def peak(records: list[dict], mib: int = mib) -> float | None:
                values = [
                    max(v for v in r["peak_extra_mib"].values() if v is not None)
                    for r in records
                    if r.get("peak_extra_mib")
                ]
                return max(values) / mib if values else None

            out[context][size] = {
                "repeats": len(payload),
                "payload_wall_s": _median([r["wall_s"] for r in payload]),
                "baseline_wall_s": _median([r["wall_s"] for r in baseline]),
                "payload_minus_baseline_s": _median(diffs),
                "result_path_s": path,
                "mib_per_s": mib / path if path else None,
                "breakdown_s": {k: _median([p[k] for p in parts]) for k in parts[0]}
                if parts
                else {},
                "floor_s": floor_path,
                "floor_mib_per_s": mib / floor_path if floor_path else None,
                "floor_breakdown_s": {
                    k: _median([p[k] for p in floor_parts]) for k in floor_parts[0]
                }
                if floor_parts
                else {},
                "ratio_to_floor": path / floor_path if path and floor_path else None,
                "peak_extra_x_payload": peak(payload),
                "floor_peak_extra_x_payload": peak(floor),
                "correct": all(r["correct"] for r in payload + floor),
            }
    return out


# --------------------------------------------------------------------------- report
def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(data: dict) -> str:
    lines = [
        "| where | size MiB | nb_dist result path s (MiB/s) | payload - baseline launch s "
        "| pipe floor s (MiB/s) | nb_dist / floor | caller peak RSS, x payload: nb_dist / "
        "floor | value correct |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for context, per_size in data["summary"].items():
        for size, s in per_size.items():
            lines.append(
                f"| {context} | {size} | {_f(s['result_path_s'], '.3f')} "
                f"({_f(s['mib_per_s'], ',.0f')}) | {_f(s['payload_minus_baseline_s'], '.3f')} | "
                f"{_f(s['floor_s'], '.3f')} ({_f(s['floor_mib_per_s'], ',.0f')}) | "
                f"{_f(s['ratio_to_floor'], '.2f')}x | {_f(s['peak_extra_x_payload'], '.2f')} / "
                f"{_f(s['floor_peak_extra_x_payload'], '.2f')} | "
                f"{'yes' if s['correct'] else '**no**'} |"
            )
    steps = ["worker teardown", "serialise", "pipe transfer", "unpickle", "launcher end"]
    lines += [
        "",
        "Where the time goes (medians, s; floor in parentheses):",
        "",
        "| where | size MiB | " + " | ".join(steps) + " |",
        "| --- | --- | " + " | ".join("---" for _ in steps) + " |",
    ]
    for context, per_size in data["summary"].items():
        for size, s in per_size.items():
            cells = []
            for step in steps:
                ours = s["breakdown_s"].get(step)
                theirs = s["floor_breakdown_s"].get(step)
                cell = _f(ours, ".3f")
                if theirs is not None:
                    cell += f" ({theirs:.3f})"
                cells.append(cell)
            lines.append(f"| {context} | {size} | " + " | ".join(cells) + " |")
    p = data["params"]
    notes = [
        "",
        "Rank 0 of a 2-rank fork launch returns a state_dict of float32 tensors; rank 1 "
        "returns None. Result path: from `time.monotonic()` in rank 0 just before `return` to "
        "the launcher's return in the caller. Floor: a forked child pickles the same "
        "state_dict into a plain `os.pipe`; the parent reads it into one buffer and unpickles "
        f"it. Medians of {p['repeats']} rounds ({p['repeats_large']} for >= 500 MiB); peak RSS "
        "is the caller's, above its RSS before the launch (1.0 = the returned value itself).",
    ]
    if data.get("kernel_error"):
        notes.append(f"The ipykernel part failed: {data['kernel_error']}")
    notes.append(
        f"Load average {data.get('loadavg_before')} before, {data.get('loadavg_after')} after; "
        f"run took {data.get('seconds', 0):.0f} s."
    )
    return "\n".join(lines + notes) + "\n"


def targets(data: dict) -> list[dict]:
    out = []
    for size, s in data["summary"].get("plain", {}).items():
        ratio = s["ratio_to_floor"]
        small = int(size) < 100  # fixed costs (ms) dominate: informative only
        out.append(
            {
                "name": f"return a {size} MiB state_dict to the caller",
                "target": f"<= {TARGET_RATIO}x a plain os.pipe + pickle"
                + (" (informative: ms-scale fixed costs dominate)" if small else ""),
                "measured": "not measured"
                if ratio is None
                else f"{ratio:.2f}x ({s['result_path_s']:.3f} s vs {s['floor_s']:.3f} s)"
                + ("" if s["correct"] else ", VALUE WRONG"),
                "met": None if ratio is None or small else (ratio <= TARGET_RATIO and s["correct"]),
            }
        )
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    plain = data["samples"].get("plain", {})
    sizes = sorted(plain, key=int)
    series = [
        (
            "payload",
            "result_path_s",
            "nb_dist result path (rank 0 return -> launcher return)",
            "o",
            "#1f77b4",
        ),
        ("floor", "result_path_s", "floor: os.pipe + pickle between 2 processes", "s", "#7f7f7f"),
    ]
    for kind, key, label, marker, color in series:
        xs, med, lo, hi = [], [], [], []
        for size in sizes:
            values = [r[key] for r in plain[size][kind]]
            if not values:
                continue
            s = stats(values)
            xs.append(int(size))
            med.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax.errorbar(xs, med, yerr=[lo, hi], marker=marker, color=color, capsize=3, label=label)
    diff_x, diff_y = [], []
    for size in sizes:
        value = data["summary"]["plain"][size]["payload_minus_baseline_s"]
        if value and value > 0:
            diff_x.append(int(size))
            diff_y.append(value)
    ax.plot(diff_x, diff_y, "^--", color="#ff7f0e", label="nb_dist launch with payload - without")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state_dict size, MiB (log)")
    ax.set_ylabel("seconds (log; median, whiskers min-max)")
    ax.set_title("Returning a state_dict from rank 0 to the caller")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~20 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument(
        "--sizes", type=int, nargs="+", help="sizes in MiB (default 1 100 500; --quick: 1 100)"
    )
    parser.add_argument("--repeats", type=int, help="rounds per size below 500 MiB")
    parser.add_argument("--repeats-large", type=int, help="rounds per size of 500 MiB and more")
    parser.add_argument(
        "--kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure 100 MiB inside a real ipykernel (default on)",
    )
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes or (SIZES_MIB[:2] if args.quick else SIZES_MIB))
    repeats = args.repeats or (2 if args.quick else 5)
    repeats_large = args.repeats_large or (1 if args.quick else 3)
    kernel_repeats = 1 if args.quick else 3
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

    began = time.perf_counter()
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    warm_up()
    samples: dict[str, dict[str, dict[str, list[dict]]]] = {"plain": {}}
    for mib in sizes:
        rounds = repeats_large if mib >= 500 else repeats
        samples["plain"][str(mib)] = measure_size(mib, rounds)
        s = summarize({"plain": {str(mib): samples["plain"][str(mib)]}})["plain"][str(mib)]
        print(
            f"{mib} MiB: result path {s['result_path_s']:.3f} s, floor {s['floor_s']:.3f} s, "
            f"payload - baseline {s['payload_minus_baseline_s']:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    kernel_error = None
    if args.kernel:
        try:
            code = KERNEL_CELL.format(bench=str(BENCH), mib=100, repeats=kernel_repeats)
            samples["ipykernel"] = {"100": run_in_kernel(code, timeout=240.0)}
            print("ipykernel: done", file=sys.stderr, flush=True)
        except (TimeoutError, RuntimeError) as exc:
            kernel_error = f"{type(exc).__name__}: {exc}"
            print(f"ipykernel: skipped, {kernel_error}", file=sys.stderr, flush=True)

    data: dict[str, Any] = {
        "what": "time to return a state_dict from rank 0 to the caller, vs a plain pipe",
        "unit": "seconds; sizes in MiB (2**20 bytes) of float32 tensor data",
        "params": {
            "quick": args.quick,
            "sizes_mib": list(sizes),
            "tensors_per_size": {str(m): tensor_count(m) for m in sizes},
            "repeats": repeats,
            "repeats_large": repeats_large,
            "kernel_size_mib": 100 if args.kernel else None,
            "kernel_repeats": kernel_repeats if args.kernel else None,
            "ranks": 2,
            "start_method": "fork",
            "output": "none",
            "pickle_protocol": pickle.HIGHEST_PROTOCOL,
        },
        "samples": samples,
        "summary": summarize(samples),
        "kernel_error": kernel_error,
        "leftover_processes": leftover_children(),
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - began, 1),
    }
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
