"""The worker → kernel protocol: every message a rank sends on its control pipe.

Each rank has four pipes to the kernel: ``stdout`` and ``stderr`` (raw bytes, the rank's own
file descriptors 1 and 2, so C extensions' output is captured too), ``stack`` (raw
``faulthandler`` dumps, written on SIGUSR1 and on a crash) and ``control``. On ``control``
every message is one frame of ``multiprocessing.connection.Connection.send_bytes`` (a length
header, then the bytes) holding one of the classes below, pickled with plain ``pickle``
(``Connection.send`` would use multiprocessing's pickler, for which torch registers tensor
reductions through shared memory owned by the sender, gone when the worker exits).

===================  ==========================================  =============================
message              sent by the worker                          what the kernel does
===================  ==========================================  =============================
:class:`Hello`       first thing, before user code               rank is running; its thread
:class:`Reports`     ``report()`` batches (every 0.1 s, at end)  adds to ``result.reports``
:class:`Progress`    ``progress()`` loops                        updates the live monitor
:class:`Rendezvous`  entering / joining ``init_process_group``   the rendezvous watchdog
:class:`Display`     ``display()`` in the rank                   publishes it in the cell
:class:`ClearOutput` ``clear_output()`` in the rank              clears the cell's output
:class:`Returned`    the function returned (before teardown)     tells teardown from a hang
:class:`Imports`     modules it imported that the kernel lacks   warm relaunches (_warm.py)
:class:`Failed`      the function raised (or its value is bad)   the rank's failure record
:class:`Result`      the value's sizes, **then that many raw     reads the bytes into
                     bytes** on the same pipe, unframed          buffers, unpickles the value
:class:`Idle`        a live rank finished a task (or its start)  the task ended on that rank
:class:`DebugPrompt` a rank's debugger waits for a command       asks the notebook for a line
===================  ==========================================  =============================

Live ranks (:class:`nb_dist.Ranks`) have a fifth pipe, ``commands``, the other way: the kernel
sends one :data:`Command` per task (:class:`Call`, :class:`Execute`, :class:`Pull`,
:class:`Push`) and answers a :class:`DebugPrompt` with a :class:`DebugInput`; the rank ends its
task with :class:`Result` or :class:`Failed`, then :class:`Idle`. Closing the pipe ends the rank.

The raw bytes after :class:`Result` are the only unframed data: the value's pickle, then the
bytes of its large tensors (``_values.py``), each read straight into one preallocated buffer
(about twice as fast as ``recv_bytes``' chunked reads), where the tensor then lives.

Report values are pickled one by one in the worker (:class:`ReportValue`), so one value the
kernel cannot unpickle (an instance of a class defined only in the rank) is reported by name
and type while every other value of the batch arrives.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import threading
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

#: Set in a rank's environment (its global rank): a launch from inside a rank is refused
#: (``_kernel/_preflight.py``).
WORKER_ENV_FLAG = "NB_DIST_WORKER_RANK"
#: The rank's collective counter file (``_collectives.py``), in its environment.
COLLECTIVES_ENV = "NB_DIST_COLLECTIVES"


@dataclass(frozen=True)
class Hello:
    pid: int
    #: ``threading.get_ident()`` of the thread that runs the function (to pick its stack).
    thread_ident: int
    at: float


@dataclass(frozen=True)
class ReportValue:
    name: str
    step: int
    at: float  # time.monotonic() in the worker
    type_name: str
    payload: bytes  # the value, pickled on its own

    def value(self) -> Any:
        return pickle.loads(self.payload)


@dataclass(frozen=True)
class Reports:
    values: tuple[ReportValue, ...]


@dataclass(frozen=True)
class Progress:
    key: str
    count: int
    total: int | None


@dataclass(frozen=True)
class Rendezvous:
    stage: str  # "enter" or "done"
    at: float
    world_size: int | None = None
    endpoint: str | None = None


@dataclass(frozen=True)
class Display:
    data: dict[str, Any]
    metadata: dict[str, Any]
    display_id: str | None
    update: bool


@dataclass(frozen=True)
class ClearOutput:
    wait: bool


@dataclass(frozen=True)
class Returned:
    at: float


@dataclass(frozen=True)
class Imports:
    names: tuple[str, ...]


@dataclass(frozen=True)
class Failed:
    """Why a rank failed: the exception's type and message, its traceback, and when."""

    exc_type: str
    message: str
    traceback: str
    at: float


@dataclass(frozen=True)
class Result:
    duration: float
    size: int  # this many raw bytes (the value's pickle) follow on the pipe
    #: then one raw buffer of each of these sizes (large tensors' bytes, ``_values.py``)
    buffers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Idle:
    """A live rank is ready for its next task: how many tasks and collectives it has done."""

    task: int
    collectives: int


@dataclass(frozen=True)
class DebugPrompt:
    """A rank's debugger (post-mortem or breakpoint) shows ``text`` and waits for a line;
    with ``prompt=None`` it only shows ``text``: the debugger has finished."""

    text: str
    prompt: str | None
    #: What the rank does when nobody can answer (said in the cell): "goes on", "was released".
    unanswered: str = "goes on"
    #: Where the rank stopped, plain (``File "f", line L, in name`` and the source line): what
    #: the cell shows instead of ``text`` where nobody can answer, so that output stays the
    #: same whatever colours and layout the installed IPython gives pdb.
    where: str = ""


@dataclass(frozen=True)
class Shown:
    """A cell's last value that cannot be pickled (a figure's artists, a lock): its repr, which
    is all a ``%%ranks`` cell shows of it anyway."""

    type_name: str
    text: str

    def __repr__(self) -> str:
        return self.text


# ------------------------------------------------------------------ kernel → a live rank
@dataclass(frozen=True)
class Call:
    """Run a function: ``payload`` is cloudpickle of ``(function, args, kwargs)``."""

    task: int
    payload: bytes


@dataclass(frozen=True)
class Execute:
    """Run source in the rank's namespace; the last expression's value is the result."""

    task: int
    source: str
    filename: str


@dataclass(frozen=True)
class Pull:
    task: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Push:
    """Set names in the rank's namespace: ``payload`` is cloudpickle of a dict."""

    task: int
    payload: bytes


#: Names a :class:`Push` may not set (the kernel refuses them; the rank would break its own
#: namespace).
RESERVED = frozenset({"__builtins__", "__name__"})


@dataclass(frozen=True)
class DebugInput:
    """The notebook's answer to a :class:`DebugPrompt` (``None``: no frontend can answer)."""

    line: str | None


Command = Call | Execute | Pull | Push | DebugInput

Message = (
    Hello
    | Reports
    | Progress
    | Rendezvous
    | Display
    | ClearOutput
    | Returned
    | Imports
    | Failed
    | Result
    | Idle
    | DebugPrompt
)


class _Sending(threading.local):
    depth = 0


_sending = _Sending()


def sending() -> bool:
    """Whether this thread is writing or reading a frame now: an interrupt must not cut it
    in two (a live rank's SIGINT handler then lets it pass; the kernel repeats it)."""
    return _sending.depth > 0


def receive_command(commands: Connection) -> Command:
    """The next command on a rank's ``commands`` pipe, read whole (see :func:`sending`)."""
    _sending.depth += 1
    try:
        data = commands.recv_bytes()
    finally:
        _sending.depth -= 1
    return decode_command(data)


def send(control: Connection, message: Message | Command) -> None:
    """Send one message as one frame (see the module docstring)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    _sending.depth += 1
    try:
        control.send_bytes(data)
    finally:
        _sending.depth -= 1


def decode(data: bytes) -> Message:
    """The message in one frame; ``TypeError`` if it is not one of this module's classes."""
    message = pickle.loads(data)
    if not isinstance(message, _MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(message).__name__}")
    return typing.cast(Message, message)


_MESSAGE_TYPES = typing.get_args(Message)  # the classes of the union, listed once
_COMMAND_TYPES = typing.get_args(Command)


def on_kernel_clock(message: Message, offset: float) -> Message:
    """``message`` with its times (``time.monotonic()`` in the rank) moved by ``offset`` s.

    A rank on another machine stamps its messages with that machine's monotonic clock, which
    counts from a different moment than the kernel's: the kernel adds the node's measured
    offset, so "who failed first" compares times on one clock."""
    if not offset:
        return message
    match message:
        case Reports(values=values):
            return Reports(tuple(dataclasses.replace(v, at=v.at + offset) for v in values))
        case Hello() | Rendezvous() | Returned() | Failed():
            return dataclasses.replace(message, at=message.at + offset)
    return message


def decode_command(data: bytes) -> Command:
    """The command in one frame on the ``commands`` pipe; ``TypeError`` if it is not one."""
    command = pickle.loads(data)
    if not isinstance(command, _COMMAND_TYPES):
        raise TypeError(f"not a command: {type(command).__name__}")
    return typing.cast(Command, command)


def report_value(name: str, step: int, at: float, value: Any) -> ReportValue:
    """Pickle one reported value on its own (raises if it cannot be pickled)."""
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return ReportValue(name, step, at, type_name(value), payload)


def type_name(obj: object) -> str:
    """``module.Class`` of an object (or class), without ``builtins.``/``__main__.``."""
    cls = obj if isinstance(obj, type) else type(obj)
    module = cls.__module__
    if module in ("builtins", "__main__", None):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def send_result(
    control: Connection,
    result: Result,
    data: bytes,
    buffers: Sequence[memoryview] = (),
    then: Message | None = None,
) -> None:
    """Send ``result``, the raw bytes it announces (the value's pickle, then its buffers) and
    ``then`` (a live rank's :class:`Idle`), in as few writes as the pipe takes: one, for a
    small value. A node's agent forwards what it has read as soon as it reads it, so a second
    write could reach the kernel a whole long poll later (a live cell waits for its Idle)."""
    parts: list[bytes | memoryview] = [_frame(result), data, *buffers]
    if then is not None:
        parts.append(_frame(then))
    _sending.depth += 1
    try:
        _write_all(control.fileno(), parts)
    finally:
        _sending.depth -= 1


def _frame(message: Message) -> bytes:
    """``message`` framed as ``Connection.send_bytes`` frames it (``recv_bytes`` reads it): a
    4-byte big-endian length (-1 and an 8-byte one from 2 GiB on), then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write ``parts`` in order with ``writev`` (partial writes resumed where they stopped)."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while written and views:
            if written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            else:
                views[0], written = views[0][written:], 0


_IOV_MAX = 1024  # Linux's limit on the buffers of one writev


def read_raw(control: Connection, size: int) -> bytearray:
    """Read the ``size`` raw bytes that follow a :class:`Result`, into one buffer."""
    buffer = bytearray(size)
    with memoryview(buffer) as view:
        got = 0
        while got < size:
            count = os.readv(control.fileno(), [view[got:]])
            if count == 0:
                raise EOFError(f"the pipe closed after {got} of {size} bytes")
            got += count
    return buffer
