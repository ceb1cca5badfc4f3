"""The rank side of live ranks (:class:`nb_dist.Ranks`): a rank that serves tasks.

A live rank is started like a launch's rank (``_entry.py`` cuts its ties to the kernel
and creates the process group), then, instead of running one function, it reads tasks from
its ``commands`` pipe until the kernel closes it: run a function, run a cell's source in the
rank's namespace, pull values out of it, push values into it (``_protocol.Command``). Each
task ends with :class:`~_protocol.Result` or :class:`~_protocol.Failed`, then
:class:`~_protocol.Idle`, which carries the task and collective counts the kernel checks
before the next task (ranks out of step would pair the wrong collectives and hang).

The kernel interrupts a task with SIGINT (``KeyboardInterrupt`` here, only while a task runs);
a rank that cannot be interrupted (blocked in native code) is killed by the kernel instead.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import linecache
import signal
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from .._shared import _collectives, _protocol, _shipping, _values
from .._shared._reporting import _Sink
from . import _debug
from ._oneshot import destroy_process_group, failure, flush_all, result, unpicklable
from ._spec import RankChannels, RankSpec


class _Interrupts:
    """SIGINT raises ``KeyboardInterrupt`` only while a task runs, never in the loop."""

    def __init__(self) -> None:
        self.in_task = False

    def handler(self, signum: int, frame: types.FrameType | None) -> None:
        if self.in_task and not _protocol.sending():  # never half a frame on the pipe
            raise KeyboardInterrupt


def serve(spec: RankSpec, channels: RankChannels, sink: _Sink, prepare: Callable[[], None]) -> int:
    """Create the process group, then serve tasks until the kernel closes the pipe."""
    assert channels.commands is not None
    commands = channels.commands
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts.handler)
    try:
        prepare()
    except BaseException as exc:
        sink.send(failure(exc, spec))
        sink.close()
        return 1
    namespace = _namespace()
    tasks = 0
    sink.send(_protocol.Idle(tasks, _collectives.count()))
    while True:
        try:
            command = _protocol.receive_command(commands)
        except (EOFError, OSError):
            break  # the kernel closed the session
        except KeyboardInterrupt:  # pragma: no cover - the handler raises only in a task
            continue
        if isinstance(command, _protocol.DebugInput):
            continue  # an answer to a prompt that is gone
        tasks += 1
        value = _run_task(spec, sink, command, namespace, interrupts)
        idle = _protocol.Idle(tasks, _collectives.count())
        if value is None:
            sink.send(idle)
        else:  # the value and the Idle in one write: a cell ends as its value arrives
            sink.send_result(*value, then=idle)
    with contextlib.suppress(Exception):
        destroy_process_group()
    sink.close()
    flush_all()
    return 0


def _namespace() -> dict[str, Any]:
    """The rank's namespace: the kernel's user namespace as it was at fork time.

    A forked rank has a copy of the kernel's IPython shell, whose ``user_ns`` is the
    notebook's globals; forked from a plain script, it has the script's ``__main__``. A
    spawned rank (or one under ``python -m``) starts from an empty module.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    user_ns = getattr(shell, "user_ns", None)
    if isinstance(user_ns, dict):
        return user_ns
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__spec__", None) is None and hasattr(main, "__file__"):
        return main.__dict__
    return {"__name__": "__main__", "__builtins__": builtins}


def _run_task(
    spec: RankSpec,
    sink: _Sink,
    command: _protocol.Command,
    namespace: dict[str, Any],
    interrupts: _Interrupts,
) -> tuple[_protocol.Result, bytes, list[memoryview]] | None:
    """Run one task; its value to send (``None``: its failure was sent)."""
    started = time.monotonic()
    try:
        interrupts.in_task = True
        try:
            value = _perform(command, namespace, spec.rank)
        finally:
            interrupts.in_task = False
        flush_all()  # what the task printed arrives before its value
    except BaseException as exc:
        flush_all()
        sink.send(failure(exc, spec))
        _debug.after_failure(exc, sink.send)
        return None
    try:
        data, buffers = _values.dumps(value)
    except Exception as exc:
        if not isinstance(command, _protocol.Execute):
            sink.send(unpicklable(value, exc, spec.rank))
            return None
        # A cell's last expression is shown, not used: its repr is enough (as IPython shows).
        data, buffers = _values.dumps(
            _protocol.Shown(_protocol.type_name(value), _safe_repr(value))
        )
    return result(started, data, buffers), data, buffers


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a broken __repr__ must not fail the cell
        return f"<{_protocol.type_name(value)} (repr failed: {type(exc).__name__})>"


def _perform(command: _protocol.Command, namespace: dict[str, Any], rank: int) -> Any:
    match command:
        case _protocol.Call(payload=payload):
            function, args, kwargs = _shipping.loads(payload)
            return _in_namespace(function, namespace)(*args, **kwargs)
        case _protocol.Execute(source=source, filename=filename):
            return execute(source, filename, namespace)
        case _protocol.Pull(names=names):
            missing = [name for name in names if name not in namespace]
            if missing:
                listed = ", ".join(repr(name) for name in missing)
                raise NameError(f"{listed} not defined on rank {rank}")
            values = tuple(namespace[name] for name in names)
            return values[0] if len(values) == 1 else values
        case _protocol.Push(payload=payload):
            namespace.update(_shipping.loads(payload))
            return None
    raise TypeError(f"unexpected command {command!r}")  # pragma: no cover


def execute(source: str, filename: str, namespace: dict[str, Any]) -> Any:
    """Run a cell's ``source`` in ``namespace``; the value of its last expression, as IPython
    shows it in ``Out[n]`` (``None`` when the cell ends with a statement or a ``;``)."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    tree = ast.parse(source, filename)
    last: ast.expr | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = tree.body.pop().value  # type: ignore[attr-defined]
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last), filename, "eval"), namespace)


def _in_namespace(function: Any, namespace: dict[str, Any]) -> Any:
    """``function`` with the rank's namespace as its globals.

    cloudpickle ships a notebook function by value with a private copy of the globals it
    uses. Run against that copy, it would not see what earlier cells made on this rank (its
    model, its optimizer). So it runs in the rank's namespace; from the copy, functions,
    classes and modules (code) replace the rank's, other values (data) only fill in names the
    rank lacks: code comes from the kernel, data stays on the ranks (``push`` changes it).
    """
    if not isinstance(function, types.FunctionType) or function.__module__ != "__main__":
        return function
    for name, value in function.__globals__.items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if name not in namespace or isinstance(value, (types.FunctionType, type, types.ModuleType)):
            namespace[name] = value
    rebound = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    return rebound
