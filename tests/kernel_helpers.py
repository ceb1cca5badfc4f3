"""Drive a real ipykernel with jupyter_client and read what each cell published on iopub."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client import BlockingKernelClient, KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from process_helpers import alive_descendants

KERNEL_NAME = "nb-dist-test"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """``text`` without terminal colour codes (pdb's and IPython's change between releases)."""
    return _ANSI.sub("", text)


def start_kernel(
    workdir: Path, env: dict[str, str] | None = None
) -> tuple[KernelManager, BlockingKernelClient]:
    """Start an ipykernel running this very interpreter, with OMP_NUM_THREADS=1 (and ``env``
    on top of the test's environment)."""
    spec_dir = workdir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "nb_dist tests",
                "language": "python",
                "interrupt_mode": "signal",
            }
        )
    )
    specs = KernelSpecManager(kernel_dirs=[str(workdir / "kernels")])
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
    km.connection_file = str(workdir / "connection.json")
    kernel_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    km.start_kernel(env=kernel_env, cwd=str(workdir))
    try:
        kc = connect(km)
    except BaseException:
        km.shutdown_kernel(now=True)
        raise
    return km, kc


def connect(km: KernelManager) -> BlockingKernelClient:
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
    except BaseException:
        kc.stop_channels()
        raise
    return kc


def stop_kernel(km: KernelManager, kc: BlockingKernelClient | None) -> None:
    if kc is not None:
        kc.stop_channels()
    km.shutdown_kernel(now=True)


def kernel_pid(km: KernelManager) -> int:
    return km.provisioner.process.pid  # type: ignore[union-attr]


def kernel_ports(km: KernelManager) -> dict[str, int]:
    info = km.get_connection_info()
    return {name: int(info[name]) for name in info if name.endswith("_port")}


@dataclass
class RunningKernel:
    """A kernel started by :func:`start_kernel`: its manager and the client connected to it.

    ``km, kc = kernel`` unpacks it. The ``kernels`` fixtures (conftest.py) stop every kernel
    they started and check that nothing it started is left.
    """

    km: KernelManager
    kc: BlockingKernelClient | None
    stopped: bool = False

    def __iter__(self) -> Iterator[Any]:
        return iter((self.km, self.kc))

    def restart(self) -> BlockingKernelClient:
        """Restart the kernel process (it keeps its ports) and connect a new client."""
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        self.km.restart_kernel(now=True)
        self.kc = connect(self.km)
        return self.kc

    def stop(self, now: bool = True) -> list[int]:
        """Shut the kernel down (``now=False``: a shutdown request, as a frontend's "Shut down
        kernel" sends) and return the pids of the kernel and of every process below it that
        were alive just before. A second call does nothing and returns ``[]``."""
        if self.stopped:
            return []
        self.stopped = True
        process = getattr(self.km.provisioner, "process", None)
        pids = alive_descendants(process.pid) if process is not None else []
        if self.kc is not None:
            self.kc.stop_channels()
        self.km.shutdown_kernel(now=now)
        return pids


@dataclass
class Message:
    """One iopub message as the test saw it: its type, content, parent and arrival time."""

    msg_type: str
    content: dict[str, Any]
    parent_id: str | None
    arrived: float  # time.monotonic() in the test process
    sent_date: float | None  # the kernel's header date, as time.time()


@dataclass
class Execution:
    """Everything one execute_request produced."""

    code: str
    msg_id: str
    sent_at: float  # time.monotonic()
    mine: list[Message] = field(default_factory=list)  # iopub messages with this parent, to idle
    late: list[Message] = field(default_factory=list)  # with this parent, after idle
    foreign: list[Message] = field(default_factory=list)  # other parents, seen meanwhile
    reply: dict[str, Any] | None = None
    idle_at: float | None = None

    def record(self, msg: Message) -> None:
        """File one iopub message: this request's, its idle status, or another's."""
        if msg.parent_id != self.msg_id:
            self.foreign.append(msg)
        elif msg.msg_type == "status" and msg.content["execution_state"] == "idle":
            self.idle_at = msg.arrived
        else:
            self.mine.append(msg)

    @property
    def streams(self) -> list[Message]:
        return [m for m in self.mine if m.msg_type == "stream"]

    def stdout(self) -> str:
        return "".join(m.content["text"] for m in self.streams if m.content["name"] == "stdout")

    def stderr(self) -> str:
        return "".join(m.content["text"] for m in self.streams if m.content["name"] == "stderr")

    @property
    def error(self) -> dict[str, Any] | None:
        errors = [m.content for m in self.mine if m.msg_type == "error"]
        return errors[-1] if errors else None

    def error_text(self) -> str:
        """The error's evalue and its traceback, without terminal colours."""
        err = self.error
        if err is None:
            return ""
        return err["evalue"] + "\n" + _ANSI.sub("", "\n".join(err["traceback"]))

    @property
    def result_text(self) -> str | None:
        results = [m.content for m in self.mine if m.msg_type == "execute_result"]
        return results[-1]["data"]["text/plain"] if results else None

    @property
    def execution_count(self) -> int:
        assert self.reply is not None
        return self.reply["content"]["execution_count"]

    def expect_ok(self) -> Execution:
        assert self.error is None, f"cell failed:\n{self.code}\n{self.error_text()}"
        assert self.reply is not None and self.reply["content"]["status"] == "ok", self.reply
        assert not self.late, f"messages after idle: {self.late}"
        return self


def send(kc: BlockingKernelClient, code: str, store_history: bool = True) -> Execution:
    code = textwrap.dedent(code).strip("\n") + "\n"
    sent_at = time.monotonic()
    # stop_on_error=False, as nbval sends: the harness waits for each reply before the next
    # request, and ipykernel 6.17 (Colab's, Kaggle's) aborts a request that arrives just after
    # an error reply when the erring request asked to stop on error.
    msg_id = kc.execute(code, store_history=store_history, stop_on_error=False)
    return Execution(code=code, msg_id=msg_id, sent_at=sent_at)


def _to_message(raw: dict[str, Any]) -> Message:
    date = raw["header"].get("date")
    return Message(
        msg_type=raw["msg_type"],
        content=raw["content"],
        parent_id=(raw.get("parent_header") or {}).get("msg_id"),
        arrived=time.monotonic(),
        sent_date=date.timestamp() if hasattr(date, "timestamp") else None,
    )


def collect(
    kc: BlockingKernelClient, run: Execution, timeout: float = 60, late_window: float = 1.0
) -> Execution:
    """Read iopub until this request's idle status, then ``late_window`` s more, and the reply."""
    deadline = time.monotonic() + timeout
    while run.idle_at is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no idle status within {timeout} s for cell:\n{run.code}")
        try:
            run.record(_to_message(kc.get_iopub_msg(timeout=min(remaining, 0.5))))
        except queue.Empty:
            continue
    _await_reply(kc, run, deadline, timeout)
    late_until = time.monotonic() + late_window
    while (remaining := late_until - time.monotonic()) > 0:
        try:
            msg = _to_message(kc.get_iopub_msg(timeout=remaining))
        except queue.Empty:
            break
        (run.late if msg.parent_id == run.msg_id else run.foreign).append(msg)
    return run


def _await_reply(kc: BlockingKernelClient, run: Execution, deadline: float, timeout: float) -> None:
    """Read shell replies until this request's."""
    while run.reply is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no execute_reply within {timeout} s for cell:\n{run.code}")
        try:
            reply = kc.get_shell_msg(timeout=min(remaining, 0.5))
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == run.msg_id:
            run.reply = reply


def wait_for(
    kc: BlockingKernelClient,
    run: Execution,
    seen: Callable[[Message], bool],
    timeout: float = 60,
) -> Message:
    """Read iopub (recording into ``run``, as :func:`collect` does) until a message of this
    request for which ``seen`` is true has arrived, and return it: a handshake with the cell
    while it still runs. Fails if the cell goes idle first or nothing comes within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for msg in run.mine:
            if seen(msg):
                return msg
        if run.idle_at is not None:
            raise AssertionError(f"the cell ended before the awaited output:\n{run.code}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"the awaited output did not come within {timeout} s")
        try:
            run.record(_to_message(kc.get_iopub_msg(timeout=min(remaining, 0.5))))
        except queue.Empty:
            continue


def execute(
    kc: BlockingKernelClient,
    code: str,
    timeout: float = 60,
    late_window: float = 0.0,
    store_history: bool = True,
) -> Execution:
    """Run ``code`` in the kernel and return what it published (see :func:`collect`);
    ``store_history=False`` runs it as nbval does, outside the kernel's history."""
    return collect(kc, send(kc, code, store_history), timeout=timeout, late_window=late_window)


def line_in(code: str, marker: str) -> int:
    """1-based line number of the first line of a cell's code that contains ``marker``."""
    for number, line in enumerate(textwrap.dedent(code).strip("\n").splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(f"{marker!r} not in cell:\n{code}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_files(folder: Path, pattern: str, count: int, within: float) -> list[Path]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern))
        if len(found) >= count and all(p.read_text() for p in found):
            return found
        time.sleep(0.02)
    raise AssertionError(f"{count} files {pattern} did not appear in {folder} within {within} s")


@dataclass
class Conversation:
    """A cell run with ``allow_stdin=True``: the prompts it asked and what it published."""

    run: Execution
    prompts: list[str]


def execute_answering(
    kc: BlockingKernelClient, code: str, answers: list[Any], timeout: float = 60
) -> Conversation:
    """Run ``code`` with a frontend that answers ``input_request``s with ``answers`` in turn.

    This is what JupyterLab's input box does for ``input()``; an answer beyond the list is
    an error (the cell asked more than the test expected). An answer that is a callable is
    called instead of answering (e.g. the kernel manager's ``interrupt_kernel``)."""
    code = textwrap.dedent(code).strip("\n") + "\n"
    run = Execution(code=code, msg_id=kc.execute(code, allow_stdin=True), sent_at=time.monotonic())
    pending, prompts = list(answers), []
    deadline = time.monotonic() + timeout
    while run.idle_at is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no idle within {timeout} s; prompts so far: {prompts}")
        try:
            request = kc.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            request = None
        if request is not None and request["msg_type"] == "input_request":
            prompts.append(request["content"]["prompt"])
            if not pending:
                raise AssertionError(f"unexpected prompt {prompts[-1]!r}; prompts: {prompts}")
            answer = pending.pop(0)
            if callable(answer):
                answer()
            else:
                kc.input(answer)
        try:
            run.record(_to_message(kc.get_iopub_msg(timeout=0.02)))
        except queue.Empty:
            continue
    _await_reply(kc, run, time.monotonic() + 10, 10)
    return Conversation(run, prompts)
