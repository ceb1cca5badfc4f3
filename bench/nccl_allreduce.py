"""NCCL on one GPU through nb_dist: all_reduce latency and bandwidth, and launch times.

Two parts, both through ``nb_dist.notebook_launcher`` from a plain Python process:

- one launch of 1 rank on the GPU (NCCL, ``init_process_group=True``) that times
  ``dist.all_reduce`` in place on float32 tensors of 1 KiB to 256 MiB (CUDA events, a few
  warm-ups, then the median of the timed calls), and the same sizes with gloo on CPU (1 rank,
  up to 64 MiB). With one rank NCCL moves no data between GPUs: the figures are the floor a
  collective costs (launch and kernel overhead), and "algbw" is size / time (busbw is 0 for
  one rank);
- launch time, call to return, of a 1-rank launch whose function does one all_reduce of one
  element: NCCL on the GPU (fork; the first launch of the process is "cold"), the same with
  spawn, and gloo on CPU (``device='cpu'``).

Run: ``python bench/nccl_allreduce.py`` (under a minute on an H100; ``--quick`` fewer
repeats). On a machine without a GPU only the gloo rows are measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
GLOO_MAX = 64 << 20


def _sweep(backend_device: str, sizes: list[int], iters: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    cuda = backend_device == "cuda"
    rows = []
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32, device=backend_device)
        n = iters if size < (16 << 20) else max(5, iters // 4)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(n):
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                dist.all_reduce(t)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - began)
        # host-side latency of one call incl. sync (what a training loop waits for)
        began = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        host = (time.perf_counter() - began) / n
        med = statistics.median(times)
        rows.append({"bytes": size, "median_us": med * 1e6, "min_us": min(times) * 1e6,
                     "host_us": host * 1e6, "algbw_GBps": size / med / 1e9, "n": n})  # fmt: skip
        del t
    return rows


def _sweep_rank(device: str, sizes: list[int], iters: int) -> dict:
    import torch
    import torch.distributed as dist

    info = {"backend": dist.get_backend(), "rows": _sweep(device, sizes, iters)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _one_allreduce(device: str) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _launch_times(nb_dist, device: str, method: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        nb_dist.notebook_launcher(_one_allreduce, args=(device,), num_processes=1,
                                  device=device, start_method=method,
                                  init_process_group=True)  # fmt: skip
        times.append(time.perf_counter() - began)
    return times


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    sys.path.insert(0, ROOT)
    import torch

    import nb_dist

    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    gpu = bool(torch.version.cuda) and nvml is not None and nvml() > 0
    repeats = 3 if quick else 6
    iters = 20 if quick else 50
    result: dict = {"torch": torch.__version__, "gpu": gpu, "launch": {}}

    # Launch times first (the NCCL "cold" one is the first launch of this process).
    plans = [("gloo cpu fork", "cpu", "fork", repeats)]
    if gpu:
        plans = [("nccl cuda fork", "cuda", "fork", repeats), *plans,
                 ("nccl cuda spawn", "cuda", "spawn", 2)]  # fmt: skip
    for label, device, method, n in plans:
        result["launch"][label] = _launch_times(nb_dist, device, method, n)

    sweeps = {}
    if gpu:
        out = nb_dist.notebook_launcher(_sweep_rank, args=("cuda", SIZES, iters),
                                        num_processes=1, init_process_group=True)  # fmt: skip
        sweeps["nccl (1 rank, GPU)"] = out[0]
    out = nb_dist.notebook_launcher(
        _sweep_rank, args=("cpu", [s for s in SIZES if s <= GLOO_MAX], iters),
        num_processes=1, device="cpu", init_process_group=True,
    )  # fmt: skip
    sweeps["gloo (1 rank, CPU)"] = out[0]
    result["sweeps"] = sweeps
    result["parent_cuda_initialized"] = bool(torch.cuda.is_initialized())

    print("\n### all_reduce, 1 rank, in place, float32")
    print("| backend | size | median | min | host (incl. sync) | algbw GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, info in sweeps.items():
        for r in info["rows"]:
            size = f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"
            print(f"| {label} | {size} | {r['median_us']:.1f} us | {r['min_us']:.1f} us | "
                  f"{r['host_us']:.1f} us | {r['algbw_GBps']:.1f} |")  # fmt: skip
    if "nccl (1 rank, GPU)" in sweeps:
        s = sweeps["nccl (1 rank, GPU)"]
        print(f"(GPU: {s.get('gpu')}, NCCL {s.get('nccl')})")
    print("\n### 1-rank launch, call to return (one all_reduce of one element)")
    print("| launch | first (cold) | median of the rest | min | n |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, ts in result["launch"].items():
        rest = ts[1:] or ts
        print(f"| {label} | {ts[0]:.2f} s | {statistics.median(rest):.2f} s | "
              f"{min(rest):.2f} s | {len(ts)} |")  # fmt: skip
    print(f"\nparent CUDA initialized after all launches: {result['parent_cuda_initialized']}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "nccl_allreduce.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
