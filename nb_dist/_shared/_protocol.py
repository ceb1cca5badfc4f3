"""The rank → kernel protocol: every message a rank sends on its control pipe.

Each rank has four pipes to the kernel: ``stdout`` and ``stderr`` (raw bytes, the rank's own
file descriptors 1 and 2, so C extensions' output is captured too), ``stack`` (raw
``faulthandler`` dumps, written on SIGUSR1 and on a crash) and ``control``. On ``control``
every message is one frame of ``multiprocessing.connection.Connection.send_bytes`` (a length
header, then the bytes) holding one of the classes below, pickled with plain ``pickle``
(``Connection.send`` would use multiprocessing's pickler, for which torch registers tensor
reductions through shared memory owned by the sender, gone when the rank exits).

======================  ==========================================  =============================
message                 sent by the rank                          what the kernel does
======================  ==========================================  =============================
:class:`Hello`          first thing, before user code               rank is running; its thread
:class:`ReportBatch`    ``report()`` batches (every 0.1 s, at end)  adds to ``result.reports``
:class:`Progress`       ``progress()`` loops                        updates the live monitor
:class:`Rendezvous`     entering / joining ``init_process_group``   the rendezvous watchdog
:class:`Display`        ``display()`` in the rank                   publishes it in the cell
:class:`ClearOutput`    ``clear_output()`` in the rank              clears the cell's output
:class:`Returned`       the function returned (before teardown)     tells teardown from a hang
:class:`Imports`        modules it imported that the kernel lacks   warm relaunches (_warm.py)
:class:`Failed`         the function raised (or its value is bad)   the rank's failure record
:class:`Result`         the value's sizes, **then that many raw     reads the bytes into
                        bytes** on the same pipe, unframed          buffers, unpickles the value
:class:`Idle`           a live rank finished a task (or its start)  the task ended on that rank
:class:`DebugPrompt`    a rank's debugger waits for a command       asks the notebook for a line
======================  ==========================================  =============================

Live ranks (:class:`nb_dist.Ranks`) have a fifth pipe, ``commands``, the other way: the kernel
sends one :data:`Command` per task (:class:`Call`, :class:`Execute`, :class:`Pull`,
:class:`Push`) and answers a :class:`DebugPrompt` with a :class:`DebugInput`; the rank ends its
task with :class:`Result` or :class:`Failed`, then :class:`Idle`. Closing the pipe ends the rank.

The raw bytes after :class:`Result` are the only unframed data: the value's pickle, then the
bytes of its large tensors (``_values.py``), each read straight into one preallocated buffer
(about twice as fast as ``recv_bytes``' chunked reads), where the tensor then lives. The
kernel reads the pipe without blocking (:class:`ControlReader`): frames and values are
assembled across turns of its loop, which meanwhile reads every other rank and keeps time.

Report values are pickled one by one in the rank (:class:`ReportValue`), so one value the
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

#: The rank's collective counter file (``_collectives.py``), in its environment.
COLLECTIVES_ENV = "NB_DIST_COLLECTIVES"

#: A rank's four pipes to its starter, output first: a node's agent forwards them in this
#: order, so a rank's last lines reach the kernel before its exit is read on ``control``.
PIPES = ("stdout", "stderr", "stack", "control")


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
    at: float  # time.monotonic() in the rank
    type_name: str
    payload: bytes  # the value, pickled on its own

    def value(self) -> Any:
        return pickle.loads(self.payload)


@dataclass(frozen=True)
class ReportBatch:
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
    | ReportBatch
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
        case ReportBatch(values=values):
            return ReportBatch(tuple(dataclasses.replace(v, at=v.at + offset) for v in values))
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


@dataclass(frozen=True)
class Value:
    """A :class:`Result` with the raw bytes it announced: the value's pickle and buffers."""

    result: Result
    data: bytearray
    buffers: list[bytearray]


#: What :meth:`ControlReader.read` hands over: a message, a value whose bytes have all
#: arrived, or the error of a frame that did not decode (the frames after it still do).
Arrived = Message | Value | Exception


class ControlReader:
    """One control pipe read as its bytes arrive, never waiting for more (runs in the kernel).

    Frames and the raw bytes after a :class:`Result` are assembled across calls: a value in
    transit (64 MB from a rank on a busy machine, or forwarded from a node) holds neither the
    loop that reads every rank's pipes, nor its timeouts and ■, nor a forwarder filling the
    pipes. Raw bytes are still read straight into one preallocated buffer each."""

    #: Bytes one :meth:`read` takes at most, so one rank's flood leaves the others a turn.
    BUDGET = 16 << 20

    def __init__(self, control: Connection) -> None:
        self._fd = control.fileno()
        os.set_blocking(self._fd, False)
        self._pending = bytearray()  # bytes of frames not yet complete
        self._result: Result | None = None  # the value in transit, if any
        self._sizes: list[int] = []  # the raw buffers still to come
        self._done: list[bytearray] = []  # its raw buffers read so far
        self._buffer = bytearray()  # the one being read
        self._got = 0
        self.closed = False

    @property
    def in_transit(self) -> bool:
        """Whether a value has been announced and not all of its bytes have arrived."""
        return self._result is not None

    def read(self) -> list[Arrived]:
        """What is complete after reading what the pipe holds now (``closed`` set at EOF;
        a value cut off by the EOF is dropped: the rank died while sending it)."""
        arrived: list[Arrived] = []
        budget = self.BUDGET
        while budget > 0 and not self.closed:
            try:
                if self._result is not None and not self._pending:
                    with memoryview(self._buffer) as view:
                        count = os.readv(self._fd, [view[self._got :]])
                    self._got += count
                    self._finish_buffers(arrived)
                else:
                    want = max(1 << 16, self._frame_needs() - len(self._pending))
                    data = os.read(self._fd, min(want, budget))
                    count = len(data)
                    self._pending += data
                    self._parse(arrived)
            except BlockingIOError:
                break
            except OSError:
                count = 0
            if count == 0:
                self.closed = True
            budget -= count
        return arrived

    def _frame_needs(self) -> int:
        """How many bytes the frame at the head of ``_pending`` takes, header included (0
        until its header has arrived)."""
        if len(self._pending) < 4:
            return 0
        (size,) = struct.unpack_from("!i", self._pending)
        if size != -1:
            return 4 + size
        if len(self._pending) < 12:
            return 0
        return 12 + struct.unpack_from("!Q", self._pending, 4)[0]

    def _parse(self, arrived: list[Arrived]) -> None:
        while True:
            if self._result is not None:
                if not self._pending:
                    return
                take = min(len(self._pending), len(self._buffer) - self._got)
                self._buffer[self._got : self._got + take] = self._pending[:take]
                del self._pending[:take]
                self._got += take
                self._finish_buffers(arrived)
                continue
            needs = self._frame_needs()
            if not needs or len(self._pending) < needs:
                return
            header = 4 if struct.unpack_from("!i", self._pending)[0] != -1 else 12
            body = bytes(self._pending[header:needs])
            del self._pending[:needs]
            try:
                message = decode(body)
            except Exception as exc:
                arrived.append(exc)
                continue
            if isinstance(message, Result):
                self._result, self._done = message, []
                self._sizes = [message.size, *message.buffers]
                self._next_buffer()
                self._finish_buffers(arrived)
            else:
                arrived.append(message)

    def _next_buffer(self) -> None:
        self._buffer, self._got = bytearray(self._sizes.pop(0)), 0

    def _finish_buffers(self, arrived: list[Arrived]) -> None:
        """Move on from every buffer that is full; the value once all of them are."""
        while self._result is not None and self._got == len(self._buffer):
            self._done.append(self._buffer)
            if self._sizes:
                self._next_buffer()
                continue
            arrived.append(Value(self._result, self._done[0], self._done[1:]))
            self._result, self._done, self._buffer = None, [], bytearray()
