"""Runs in a launch's rank: the user's function, once, and its value or its failure.

``_entry.py`` has cut the rank's ties to the kernel; here the function is loaded (shipped by
value for spawn/forkserver), the process group is made, the function runs, and what it
returned (or raised) goes to the kernel on the control pipe. Live ranks (``_serve.py``) send
their values and failures with the same helpers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._shared import _protocol, _shipping, _values
from .._shared._frames import from_user_code
from .._shared._imports import worth_importing
from .._shared._reporting import _Sink
from . import _debug
from ._spec import RankChannels, RankSpec

PrepareTorch = Callable[[RankSpec, Callable[[_protocol.Message], None]], None]


def run(
    spec: RankSpec,
    channels: RankChannels,
    sink: _Sink,
    kernel_modules: set[str] | None,
    prepare_torch: PrepareTorch,
) -> int:
    """Run the function; the rank's exit code (its value or failure is sent on the way)."""
    control = channels.control
    started = time.monotonic()
    try:
        function, args = _load_function(spec)
        prepare_torch(spec, sink.send)
        try:
            value = function(*args)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # sys.exit(0) in a rank is a normal end, as under torchrun
        # Tell the kernel before tearing down: destroying the group closes this rank's
        # connections, which can make a peer still waiting in a collective fail at once, and
        # that failure is explained by "rank K had already returned" (a skipped collective).
        # It also tells a teardown that hangs apart from a function that never returns.
        sink.send(_protocol.Returned(time.monotonic()))
        destroy_process_group()
    except BaseException as exc:
        sink.close()  # reports made before the failure still reach the kernel, first
        _report_exception(control, exc, spec)
        _report_imports(control, kernel_modules)
        _debug.after_failure(exc, functools.partial(_protocol.send, control))
        return 1
    sink.close()
    _report_imports(control, kernel_modules)
    flush_all()
    try:
        data, buffers = _values.dumps(value)
    except Exception as exc:
        _protocol.send(control, unpicklable(value, exc, spec.rank))
        return 1
    # The sizes, then the raw bytes (see _protocol.Result).
    _protocol.send_result(control, result(started, data, buffers), data, buffers)
    return 0


def result(started: float, data: bytes, buffers: list[memoryview]) -> _protocol.Result:
    """The :class:`~_protocol.Result` that announces a value's pickle and buffers."""
    sizes = tuple(buffer.nbytes for buffer in buffers)
    return _protocol.Result(time.monotonic() - started, len(data), sizes)


def unpicklable(value: Any, exc: Exception, rank: int) -> _protocol.Failed:
    """The failure of a rank whose value cannot be pickled for the kernel."""
    message = (
        f"rank {rank} returned a value of type {_protocol.type_name(value)} that "
        f"cannot be sent back to the kernel ({type(exc).__name__}: {exc}). Return something "
        "picklable (numbers, strings, lists, dicts, tensors, a state_dict), or save it to a "
        "file and return the path."
    )
    return _protocol.Failed("UnpicklableResultError", message, "", time.monotonic())


def _load_function(spec: RankSpec) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if spec.payload is None:
        assert spec.function is not None
        return spec.function, spec.args
    import linecache

    linecache.cache.update(spec.linecache_entries)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    function, args = _shipping.loads(spec.payload)
    return function, tuple(args)


def destroy_process_group() -> None:
    """Destroy a process group the function left behind, so no warning is printed at exit."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _report_exception(control: Connection, exc: BaseException, spec: RankSpec) -> None:
    with contextlib.suppress(OSError, EOFError):
        _protocol.send(control, failure(exc, spec))


def failure(exc: BaseException, spec: RankSpec) -> _protocol.Failed:
    """The :class:`~_protocol.Failed` message for ``exc``, its traceback from the user's code."""
    failed_at = time.monotonic()
    tb = from_user_code(exc.__traceback__)
    text = "".join(traceback.TracebackException(type(exc), exc, tb).format())
    message = str(exc)
    if spec.init_process_group and isinstance(exc, ValueError) and "twice" in message:
        message = (
            f"{message} The launcher already created the default process group in this rank "
            "because the launch used init_process_group=True. Remove your own "
            "torch.distributed.init_process_group(...) call, or launch with "
            "init_process_group=False and keep it."
        )
    return _protocol.Failed(_protocol.type_name(exc), message, text, failed_at)


def _report_imports(control: Connection, kernel_modules: set[str] | None) -> None:
    if kernel_modules is None:
        return
    names = worth_importing(set(sys.modules) - kernel_modules)
    if names:
        with contextlib.suppress(OSError, EOFError):
            _protocol.send(control, _protocol.Imports(tuple(names)))


def flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C-level stdio buffers (printf from extensions)
