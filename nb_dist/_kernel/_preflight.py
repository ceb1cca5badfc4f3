"""Pre-flight checks: refuse a launch, before any rank starts, when it cannot work.

Each refusal says what was found, why it breaks a launch, and what to do about it (where
possible without restarting the kernel). None of these checks initializes CUDA in the kernel.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._shared import _cuda_touches, _torch_compat
from .._shared._env import RANK_ENV_FLAG
from .._starter._processes import REAP_WITHIN, process_state, reap_within
from ._errors import UnsafeLaunchError
from ._tracebacks import innermost_user_frame

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------ kernel state
def check_not_nested() -> None:
    rank = os.environ.get(RANK_ENV_FLAG)
    if rank is not None:
        raise UnsafeLaunchError(
            f"notebook_launcher was called from inside rank {rank} of a launch. A "
            "launch cannot start ranks of its own. Call notebook_launcher from the notebook "
            "(the kernel) only, and run the inner work directly in the function."
        )


def check_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    raise UnsafeLaunchError(
        "A torch.distributed process group is already initialized in this kernel "
        f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}). Ranks forked "
        "now would inherit a copy of it that talks to nobody, and their own "
        "init_process_group would fail. Call torch.distributed.destroy_process_group() in the "
        "notebook, keep init_process_group inside the launched function, and launch again."
    )


def check_accelerate_state() -> None:
    # Never import accelerate here: if it is not imported, no state can exist.
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    found = [
        name
        for name in ("AcceleratorState", "PartialState")
        if getattr(getattr(state, name, None), "_shared_state", None)
    ]
    if not found:
        return
    raise UnsafeLaunchError(
        f"An Accelerate {' and '.join(found)} already {'exists' if len(found) == 1 else 'exist'} "
        "in this kernel (an Accelerator() "
        "or PartialState() was created in a cell). Forked ranks would inherit that "
        "single-process state instead of building their own for their rank. Create the "
        "Accelerator inside the launched function. To continue without restarting the kernel, "
        "run: from accelerate.state import AcceleratorState; "
        "AcceleratorState._reset_state(reset_partial_state=True), then launch again."
    )


# ------------------------------------------------------------------ CUDA
def _cuda_built() -> bool:
    return _cuda_touches.cuda_built()


def cuda_touched() -> bool:
    """Whether anything in this process has counted or initialized CUDA devices yet."""
    return _cuda_touches.touched()


#: How long the throw-away child that counts GPUs may take (a wedged driver never answers).
PROBE_WITHIN = 30.0


def ask_in_child(ask: Callable[[], dict[str, Any]], within: float) -> dict[str, Any] | None:
    """Run ``ask`` in a forked child and return its answer (JSON); ``None`` if it does not
    answer within ``within`` s (the child is then killed and reaped). A child that fails, or
    whose answer is broken, gives ``{}``: it answered, with nothing.

    The kernel never runs ``ask`` itself: what it touches (the CUDA driver) stays untouched
    here. The pipe is read with ``select`` so the deadline holds even when the child never
    writes or never exits.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the throw-away child: answer and leave, nothing else
        try:
            os.close(read_fd)
            os.write(write_fd, json.dumps(ask()).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + within
    chunks: list[bytes] = []
    answered = False
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:  # EOF: the child wrote its answer and closed the pipe by leaving
                answered = True
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        _end_child(pid, kill=not answered)
    if not answered:
        return None
    try:
        answer = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _end_child(pid: int, kill: bool) -> None:
    """Reap the throw-away child (killed first if ``kill``) without waiting on it forever.

    A process inside a wedged driver can be in uninterruptible sleep, where even SIGKILL
    waits until the driver call returns (closing the driver at exit can wedge too). Then it is
    left to a daemon thread that reaps it whenever it ends, so the cell is not held.
    """
    if not kill and reap_within(pid, REAP_WITHIN) is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if reap_within(pid, REAP_WITHIN) is not None:
        return
    _log.warning(
        "The throw-away process %d that asked the CUDA driver about the GPUs did not end "
        "within %g s of SIGKILL (state: %s); it is reaped in the background when the driver "
        "lets it go. If it stays, check the GPUs with nvidia-smi.",
        pid,
        REAP_WITHIN,
        process_state(pid),
    )
    threading.Thread(
        target=reap_within, args=(pid, None), name=f"nb_dist-reap-{pid}", daemon=True
    ).start()


@dataclass
class CudaState:
    gpus: int
    poisoned: bool
    where: str | None


def _count_gpus(torch: Any, in_bad_fork: Callable[[], bool]) -> dict[str, Any]:
    """In the throw-away child: whether it is in a bad fork, and how many GPUs CUDA sees."""
    bad = in_bad_fork()
    return {"bad": bad, "count": -1 if bad else int(torch.cuda.device_count())}


def probe_cuda(within: float | None = None) -> CudaState:
    """Count visible GPUs and find out whether fork is already poisoned, without touching CUDA.

    ``torch.cuda.is_initialized()`` misses the commonest poisoning (``is_available()`` without
    NVML poisons fork without initializing), and torch's own bad-fork flag is only
    set in a child. So fork a throw-away child that asks torch whether it is in a bad fork and
    counts the devices, and exits. Milliseconds, and skipped entirely on CPU builds. A child
    that does not answer within ``within`` s (:data:`PROBE_WITHIN` unless given: a wedged
    driver) is killed and the launch refused, instead of every launch hanging in silence.
    """
    if not _cuda_built():
        return CudaState(gpus=0, poisoned=False, where=None)
    import torch

    limit = PROBE_WITHIN if within is None else within
    in_bad_fork = _torch_compat.bad_fork_check(torch)  # looked up here: a lack is logged here
    report = ask_in_child(lambda: _count_gpus(torch, in_bad_fork), limit)
    if report is None:
        raise UnsafeLaunchError(
            f"Checking this machine's GPUs took more than {limit:g} s: a throw-away process "
            "that asked the CUDA driver how many GPUs there are did not answer, so the driver "
            "may be stuck (every launch would hang at its first CUDA call). Check the GPUs "
            "with nvidia-smi (if it hangs too, the driver needs an administrator or a "
            "reboot), or launch with device='cpu' to run on the CPU without asking the driver."
        )
    initialized: Any = torch.cuda.is_initialized  # untyped in torch
    poisoned = bool(report.get("bad")) or bool(initialized())
    count = int(report.get("count", -1))
    if count < 0:
        count = _torch_compat.gpus_from_nvml(torch)
    first = _cuda_touches.first_touch()
    where = innermost_user_frame(first) if first else None
    return CudaState(gpus=count, poisoned=poisoned, where=where)


def cuda_poisoned_error(state: CudaState) -> UnsafeLaunchError:
    where = (
        f"It was first touched by {state.where}."
        if state.where
        else "It was touched before nb_dist was imported (import nb_dist first, and the "
        "launcher will name the line next time)."
    )
    return UnsafeLaunchError(
        "CUDA was already initialized in this kernel. "
        f"{where} Ranks forked from the kernel now cannot use CUDA: each would fail with "
        "'Cannot re-initialize CUDA in forked subprocess'. Even torch.cuda.is_available() "
        "(unless PYTORCH_NVML_BASED_CUDA_CHECK=1, which importing nb_dist sets), creating a "
        "CUDA tensor, or loading a checkpoint onto the GPU in a cell does this. "
        "To continue without restarting the kernel, launch with start_method='spawn' (fresh "
        "processes; the function is shipped with cloudpickle). To keep fork, restart the "
        "kernel and keep every CUDA call (model.to('cuda'), torch.cuda.*) inside the launched "
        "function."
    )
