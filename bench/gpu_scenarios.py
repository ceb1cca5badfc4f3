"""GPU path checks of nb_dist on a real machine: NCCL launches, CUDA pre-flight refusals,
CUDA values coming back to the kernel. Each scenario runs in a fresh interpreter (some poison
CUDA in their parent on purpose); the driver prints one PASS/FAIL/SKIP line per scenario with
what it saw.

Run: ``python bench/gpu_scenarios.py`` (about a minute on a GPU machine; everything SKIPs on a
CPU-only one except the CPU sanity scenario). ``--one NAME`` runs one scenario in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SCENARIO_RESULT "


def _gpus() -> int:
    import torch

    if not torch.version.cuda:
        return 0
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    return max(0, nvml()) if nvml else 0


class Skip(Exception):
    pass


def _need_gpu() -> None:
    if _gpus() < 1:
        raise Skip("no GPU (NVML sees none or torch is a CPU build)")


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _bad_fork_in_child() -> bool:
    """Whether a fork of this process would be a bad CUDA fork (asked in a throw-away child)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        import torch

        os.write(w, b"1" if torch._C._cuda_isInBadFork() else b"0")
        os._exit(0)
    os.close(w)
    data = os.read(r, 1)
    os.waitpid(pid, 0)
    return data == b"1"


# ----------------------------------------------------------------- rank functions
def _nccl_allreduce(value: float = 1.0):
    import torch
    import torch.distributed as dist

    t = torch.full((4,), value, device="cuda")
    dist.all_reduce(t)
    return {
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "device": str(torch.cuda.current_device()),
        "name": torch.cuda.get_device_name(),
        "sum": float(t[0].item()),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _gloo_allreduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "world": dist.get_world_size(), "sum": float(t[0])}


def _count_devices():
    import torch

    return torch.cuda.device_count()


def _cuda_tensor():
    import torch

    return torch.arange(4.0, device="cuda") * 2


def _cuda_nested():
    import torch

    model = torch.nn.Linear(3, 2).cuda()
    return {
        "t": [torch.ones(2, device="cuda"), (torch.zeros(1, device="cuda"),)],
        "model": model,
        "state": model.state_dict(),
        "dev": torch.device("cuda", 0),
    }


def _cuda_state_dict():
    import torch

    model = torch.nn.Linear(1024, 1024).cuda()  # a 4 MiB weight: crosses out of band
    with torch.no_grad():
        model.weight.fill_(0.25)
    transposed = torch.arange(512 * 256, dtype=torch.float32, device="cuda").view(512, 256).t()
    leaf = torch.ones(1 << 15, device="cuda", requires_grad=True)  # 128 KiB, needs grad
    return {"state": model.state_dict(), "weight": model.weight, "half": model.weight.half(),
            "transposed": transposed, "leaf": leaf}  # fmt: skip


def _cuda_report():
    import torch

    import nb_dist

    nb_dist.report("loss", torch.tensor(0.5, device="cuda"))
    nb_dist.report("vec", torch.ones(3, device="cuda"))
    return None


def _cuda_oom():
    import torch

    return torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB


def _describe(value) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor(device={value.device}, type={type(value).__name__})"
    if isinstance(value, torch.nn.Module):
        return f"Module(params on {sorted({str(p.device) for p in value.parameters()})})"
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return repr(value)


# ----------------------------------------------------------------- scenarios
def s_cpu_gloo_2ranks():
    import nb_dist

    out = nb_dist.notebook_launcher(
        _gloo_allreduce, num_processes=2, device="cpu", init_process_group=True
    )
    assert [v["sum"] for v in out] == [2.0, 2.0], out
    return {"values": list(out), "parent_cuda_initialized": _cuda_initialized()}


def s_nccl_1rank_auto():
    _need_gpu()
    import nb_dist

    began = time.perf_counter()
    out = nb_dist.notebook_launcher(_nccl_allreduce, args=(3.0,), num_processes=1,
                                    init_process_group=True)  # fmt: skip
    took = time.perf_counter() - began
    assert out[0]["backend"] == "nccl" and out[0]["sum"] == 3.0, out
    init = _cuda_initialized()
    assert not init, "the launch initialized CUDA in the parent"
    return {"value": out[0], "wall_s": round(took, 2), "parent_cuda_initialized": init,
            "parent_bad_fork_after": _bad_fork_in_child()}  # fmt: skip


def s_nccl_none_one_per_gpu():
    _need_gpu()
    import nb_dist

    out = nb_dist.notebook_launcher(_nccl_allreduce, num_processes=None, init_process_group=True)
    assert len(out) == _gpus() and out[0]["backend"] == "nccl", out
    return {"ranks": len(out), "value": out[0]}


def s_nccl_1rank_spawn():
    _need_gpu()
    import nb_dist

    began = time.perf_counter()
    out = nb_dist.notebook_launcher(_nccl_allreduce, num_processes=1, start_method="spawn",
                                    init_process_group=True)  # fmt: skip
    assert out[0]["backend"] == "nccl", out
    return {"value": out[0], "wall_s": round(time.perf_counter() - began, 2)}


def s_nccl_1rank_fork_no_pg():
    """init_process_group=False (the default): the rank does it itself, the Accelerate way."""
    _need_gpu()
    import nb_dist

    def fn():
        import torch.distributed as dist

        dist.init_process_group("nccl")
        try:
            return _nccl_allreduce(2.0)
        finally:
            dist.destroy_process_group()

    out = nb_dist.notebook_launcher(fn, num_processes=1)
    assert out[0]["sum"] == 2.0, out
    return {"value": out[0]}


def _refusal(call) -> dict:
    try:
        out = call()
    except Exception as exc:
        return {"raised": f"{type(exc).__module__}.{type(exc).__name__}", "message": str(exc)}
    return {"raised": None, "returned": repr(out)[:300]}


def s_two_ranks_one_gpu_auto():
    _need_gpu()
    if _gpus() != 1:
        raise Skip("needs exactly one GPU")
    import nb_dist

    # The default device runs more ranks than GPUs on the CPU (gloo), with a notice.
    got = _refusal(
        lambda: nb_dist.notebook_launcher(_gloo_allreduce, num_processes=2, init_process_group=True)
    )
    assert not got["raised"] and "gloo" in got["returned"], got
    assert not _cuda_initialized(), "the fallback initialized CUDA in the parent"
    return got


def s_two_ranks_one_gpu_device_cuda():
    _need_gpu()
    if _gpus() != 1:
        raise Skip("needs exactly one GPU")
    import nb_dist

    got = _refusal(
        lambda: nb_dist.notebook_launcher(_count_devices, num_processes=2, device="cuda")
    )
    assert got["raised"], got
    return got


def s_two_ranks_one_gpu_device_cpu():
    _need_gpu()
    import nb_dist

    out = nb_dist.notebook_launcher(_gloo_allreduce, num_processes=2, device="cpu",
                                    init_process_group=True)  # fmt: skip
    assert [v["backend"] for v in out] == ["gloo", "gloo"], out
    return {"values": list(out), "parent_cuda_initialized": _cuda_initialized()}


def _raw_rank(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"RAW rank {rank} all_reduce ok: {t.item()}", flush=True)
    dist.destroy_process_group()


def s_raw_nccl_two_ranks_same_gpu():
    """Without nb_dist: what NCCL itself does with two ranks on one GPU (justifies a refusal)."""
    _need_gpu()
    if _gpus() != 1:
        raise Skip("needs exactly one GPU")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_raw_rank, args=(port,), nprocs=2, start_method="spawn")
        return {"outcome": "NCCL accepted two ranks on one GPU"}
    except Exception as exc:
        lines = [ln for ln in str(exc).splitlines() if "rror" in ln or "Duplicate" in ln]
        return {"outcome": "failed", "error": " | ".join(lines[-4:])[:600]}


_POISON = {
    "cuda_init": "torch.cuda.init()",
    "cuda_tensor": "torch.zeros(1, device='cuda')",
    "is_available_nvml": "torch.cuda.is_available()",
}


def _poisoned(how: str, import_first: bool = True) -> dict:
    _need_gpu()
    if import_first:
        import torch

        import nb_dist
    else:
        os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        import torch

        torch.cuda.is_available()  # before nb_dist: not recorded, and not NVML-based
        import nb_dist
    if import_first:
        eval(_POISON[how], {"torch": torch})
    got = _refusal(lambda: nb_dist.notebook_launcher(_count_devices, num_processes=1))
    got["parent_cuda_initialized"] = _cuda_initialized()
    if got["raised"]:  # the way out the message gives
        got["spawn_after"] = _refusal(
            lambda: list(
                nb_dist.notebook_launcher(_count_devices, num_processes=1, start_method="spawn")
            )
        )
    return got


def s_poison_cuda_init():
    got = _poisoned("cuda_init")
    assert got["raised"] and "CUDA was already initialized" in got["message"], got
    assert "torch.cuda.init()" in got["message"] or "line" in got["message"], got
    return got


def s_poison_cuda_tensor():
    got = _poisoned("cuda_tensor")
    assert got["raised"] and "CUDA was already initialized" in got["message"], got
    return got


def s_is_available_with_nvml_not_poisoned():
    got = _poisoned("is_available_nvml")
    assert not got["raised"], got  # NVML-based check: fork stays safe
    return got


def s_is_available_before_import():
    got = _poisoned("x", import_first=False)
    assert got["raised"] and "before nb_dist was imported" in got["message"], got
    return got


def s_result_cuda_tensor():
    _need_gpu()
    import nb_dist

    out = nb_dist.notebook_launcher(_cuda_tensor, num_processes=1)
    init = _cuda_initialized()
    assert str(out[0].device) == "cpu" and out[0].tolist() == [0, 2, 4, 6], out
    assert not init, "unpickling the result initialized CUDA in the parent"
    return {"value": _describe(out[0]), "parent_cuda_initialized": init,
            "parent_bad_fork_after": _bad_fork_in_child()}  # fmt: skip


def s_result_cuda_nested_module():
    _need_gpu()
    import nb_dist

    out = nb_dist.notebook_launcher(_cuda_nested, num_processes=1)
    init = _cuda_initialized()
    desc = _describe(out[0])
    assert not init, f"parent CUDA initialized; value {desc}"
    # a second launch still forks safely
    again = nb_dist.notebook_launcher(_count_devices, num_processes=1)
    return {"value": desc, "parent_cuda_initialized": init, "launch_after": list(again)}


def s_result_large_cuda_state_dict():
    _need_gpu()
    import torch

    import nb_dist

    out = nb_dist.notebook_launcher(_cuda_state_dict, num_processes=1)
    init = _cuda_initialized()
    value = out[0]
    weight, half = value["weight"], value["half"]
    assert not init, "unpickling the result initialized CUDA in the parent"
    assert value["state"]["weight"].device.type == "cpu", _describe(value)
    assert torch.equal(value["state"]["weight"], torch.full((1024, 1024), 0.25)), "weight"
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad, type(weight)
    assert half.dtype == torch.float16 and half.device.type == "cpu", half
    # Not contiguous: pickled as pickle does, from its CPU copy (never CUDA data).
    transposed = value["transposed"]
    expected = torch.arange(512 * 256, dtype=torch.float32).view(512, 256).t()
    assert transposed.device.type == "cpu" and torch.equal(transposed, expected), transposed
    assert value["leaf"].device.type == "cpu" and value["leaf"].requires_grad, value["leaf"]
    return {"value": _describe(value), "parent_cuda_initialized": init}


def s_report_cuda_tensor():
    _need_gpu()
    import nb_dist

    out = nb_dist.notebook_launcher(_cuda_report, num_processes=1)
    reps = {name: _describe(out.reports[name][0]) for name in out.reports}
    init = _cuda_initialized()
    assert not init, reps
    return {"reports": reps, "parent_cuda_initialized": init}


def s_rank_cuda_oom():
    _need_gpu()
    import nb_dist

    got = _refusal(lambda: nb_dist.notebook_launcher(_cuda_oom, num_processes=1))
    assert got["raised"] and "WorkerFailedError" in got["raised"], got
    got["message"] = got["message"][:400]
    again = nb_dist.notebook_launcher(_count_devices, num_processes=1)
    got["launch_after"] = list(again)
    return got


def s_live_ranks_gpu():
    _need_gpu()
    import nb_dist

    with nb_dist.Ranks(1) as ranks:
        first = ranks.run(_nccl_allreduce, 5.0)
        ranks.exec("import torch\nx = torch.ones(3, device='cuda') * 7")
        pulled = ranks.pull("x")
        backend = ranks.plan.backend
    init = _cuda_initialized()
    assert first[0]["sum"] == 5.0 and not init, (first, init)
    return {"backend": backend, "run": first[0], "pulled": _describe(pulled[0]),
            "parent_cuda_initialized": init}  # fmt: skip


_KERNEL_CELLS = [
    "import nb_dist, torch",
    "def count():\n    import torch\n    return torch.cuda.device_count()",
    "r = nb_dist.notebook_launcher(count, num_processes=1); print('FIRST', list(r))",
    "def cuda_value():\n    import torch\n    return torch.ones(2, device='cuda')",
    "v = nb_dist.notebook_launcher(cuda_value, num_processes=1)[0]; "
    "print('VALUE', v.device, torch.cuda.is_initialized())",
    "torch.cuda.init()",
    "nb_dist.notebook_launcher(count, num_processes=1)",
    "print('SPAWN', list(nb_dist.notebook_launcher(count, num_processes=1, start_method='spawn')))",
]


def s_kernel_refusal():
    """In a real ipykernel: a launch, a CUDA value back, then torch.cuda.init() in a cell and
    a launch, which must be refused naming the cell; spawn then works."""
    _need_gpu()
    try:
        from jupyter_client.manager import KernelManager
    except ImportError as exc:
        raise Skip(f"jupyter_client missing: {exc}") from None
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kc = km.client()
    seen = []
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        for cell in _KERNEL_CELLS:
            msg_id = kc.execute(cell)
            text, error = "", None
            deadline = time.monotonic() + 120
            while True:
                msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    text += content["text"]
                elif kind == "error":
                    error = f"{content['ename']}: {content['evalue']}"
                elif kind == "status" and content["execution_state"] == "idle":
                    break
            seen.append({"cell": cell.splitlines()[0][:60], "out": text.strip()[-300:],
                         "error": error})  # fmt: skip
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    refused = seen[6]["error"] or ""
    assert "CUDA was already initialized" in refused and "Cell In[" in refused, seen
    assert "VALUE cpu False" in seen[4]["out"], seen
    return {"cells": seen}


SCENARIOS = {name[2:]: fn for name, fn in globals().items() if name.startswith("s_")}


def run_one(name: str) -> None:
    try:
        result = {"status": "PASS", "detail": SCENARIOS[name]()}
    except Skip as exc:
        result = {"status": "SKIP", "detail": str(exc)}
    except BaseException as exc:
        result = {"status": "FAIL", "detail": f"{type(exc).__name__}: {exc}",
                  "tb": traceback.format_exc()[-1500:]}  # fmt: skip
    print(MARK + json.dumps(result, default=repr), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        run_one(argv[1])
        return 0
    names = argv or list(SCENARIOS)
    failed = 0
    for name in names:
        began = time.monotonic()
        limit = 90 if name == "kernel_refusal" else 60
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], cwd=ROOT,
                                  capture_output=True, text=True, timeout=limit)  # fmt: skip
            out, err = done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
            err = f"TIMEOUT after {limit} s\n" + str(exc.stderr or "")
            out = out or ""
        lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
        result = json.loads(lines[-1][len(MARK):]) if lines else {
            "status": "FAIL", "detail": "no result line", "tb": (out + err)[-2000:]}  # fmt: skip
        took = time.monotonic() - began
        failed += result["status"] == "FAIL"
        print(f"== {name}: {result['status']} ({took:.1f} s)")
        print(textwrap.indent(json.dumps(result["detail"], indent=1, default=repr)[:3000], "   "))
        if result["status"] == "FAIL":
            print(textwrap.indent(result.get("tb", ""), "   | "))
            print(textwrap.indent(err[-1500:], "   ! "))
        noise = [ln for ln in err.splitlines() if "arn" in ln or "rror" in ln]
        if noise and result["status"] != "FAIL":
            print(textwrap.indent("\n".join(noise[-6:]), "   stderr: "))
        sys.stdout.flush()
    print(f"scenarios: {len(names)}, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
