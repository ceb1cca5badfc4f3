"""Runs in each rank's process: its entry point, from the fork (or spawn) to ``os._exit``.

A forked rank starts as a copy of the kernel, threads gone but sockets, streams and signal
handlers inherited. Before running any user code it cuts every tie to the kernel: its own
process group, its own stdout/stderr pipes (never the kernel's ZMQ/iopub machinery), death
when the kernel dies, and the standard torch.distributed environment. Then it runs one
function (``_oneshot.py``) or serves a live rank's tasks (``_serve.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import io
import os
import pickle
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._shared import _cuda_touches, _protocol, _reporting
from .._shared._env import RANK_ENV_FLAG
from .._shared._protocol import COLLECTIVES_ENV
from . import _debug, _frameworks, _oneshot, _serve
from ._oneshot import flush_all
from ._spec import RankChannels, RankSpec

_PR_SET_PDEATHSIG = 1
#: What the kernel (or a node's agent) signals a rank with: stop, interrupt, dump the stack.
_KERNEL_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}


def spawn_main() -> None:
    """Entry point of a rank started with ``spawn``: its spec arrives on stdin."""
    spec, fds = pickle.loads(sys.stdin.buffer.read())
    channels = RankChannels(**{name: Connection(fd) for name, fd in fds.items()})
    run_rank(spec, channels, forked=False)


def forkserver_main(spec: RankSpec, channels: RankChannels) -> None:
    """Entry point of a rank started by multiprocessing's ``forkserver``."""
    run_rank(spec, channels, forked=False)


def run_rank(spec: RankSpec, channels: RankChannels, forked: bool) -> None:
    """Run one rank to completion and leave the process with ``os._exit``; never returns."""
    code = 1
    try:
        code = _run(spec, channels, forked)
    except BaseException:  # last resort: the report path itself failed
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        flush_all()
        os._exit(code)


def _run(spec: RankSpec, channels: RankChannels, forked: bool) -> int:
    # What the kernel had: modules imported beyond these may be worth importing there (_warm).
    kernel_modules = set(sys.modules) if forked and spec.report_imports else None
    _detach_from_kernel(spec, channels, forked)
    control = channels.control
    main_ident = threading.main_thread().ident or threading.get_ident()
    _protocol.send(control, _protocol.Hello(os.getpid(), main_ident, time.monotonic()))
    sink = _reporting.install_sink(control, spec.rank)
    if forked:
        _forward_display(sink.send)
    _debug.install(sink.send, channels.commands, spec.rank, spec.debug)
    _wait_for_gate(channels.gate)

    if spec.session:
        return _serve.serve(spec, channels, sink, lambda: _prepare_torch(spec, sink.send))
    return _oneshot.run(spec, channels, sink, kernel_modules, _prepare_torch)


def _detach_from_kernel(spec: RankSpec, channels: RankChannels, forked: bool) -> None:
    """Cut every tie to the kernel before user code runs."""
    # Own process group: Jupyter's interrupt (sent to the kernel's whole group) must reach the
    # kernel only; the kernel then stops the ranks itself, in order.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent(spec)

    # Our own stdout/stderr, at the file-descriptor level so C extensions are captured too.
    os.dup2(channels.stdout.fileno(), 1)
    os.dup2(channels.stderr.fileno(), 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = _text_stream(1)
    sys.stderr = _text_stream(2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - stays open for the process lifetime
    # The "original" streams too: code that writes to sys.__stderr__ must not reach the kernel.
    setattr(sys, "__stdout__", sys.stdout)  # noqa: B010 - typeshed marks them Final
    setattr(sys, "__stderr__", sys.stderr)  # noqa: B010

    if forked:
        for fd in spec.close_fds:
            _close_quietly(fd)
        _close_inherited_listeners(keep=set(channels.named_fds().values()))
        _silence_inherited_display()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The signals the kernel stops, interrupts and asks for stacks with must get through: a
    # process started from a thread that blocks them (a Ray worker's, on a cluster node)
    # inherits them blocked, and a blocked SIGINT or SIGUSR1 is silently dropped.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _KERNEL_SIGNALS)
    # Python-level stacks on demand (the kernel sends SIGUSR1 on a hang or timeout) and on a
    # crash. faulthandler writes from the signal handler in C, so it works even while the main
    # thread is blocked inside a collective.
    faulthandler.register(signal.SIGUSR1, file=channels.stack.fileno(), all_threads=True)
    # Disabled first: a kernel connected to Ray has faulthandler enabled and Ray's own crash
    # handlers installed over it, and enable() on an enabled faulthandler only changes its
    # file, leaving those handlers to swallow the rank's "Fatal Python error".
    faulthandler.disable()
    faulthandler.enable(file=sys.stderr, all_threads=False)

    threading.Thread(
        target=_lifeline_watch, args=(channels.lifeline,), name="nb_dist-lifeline", daemon=True
    ).start()

    os.environ.update(spec.env)
    os.environ[RANK_ENV_FLAG] = str(spec.rank)
    # A rank never launches: the CUDA-touch recorder a forked rank inherits from the kernel,
    # or that ``import nb_dist`` started in a spawned one, records nothing here.
    _cuda_touches.stop()
    _frameworks.become_a_script()  # a torchrun rank, not the kernel's interactive console


def _wait_for_gate(gate: Connection) -> None:
    """Wait until the kernel has started every rank: it then closes the gate's write end.

    The kernel hosts the rendezvous store, whose server thread resolves the address of each
    rank that connects (getnameinfo, with a reverse DNS lookup). A rank forked while that
    thread holds libc's resolver lock inherits the lock held and hangs forever at its own
    first lookup, inside init_process_group. So no rank may connect before the last is forked.
    """
    with contextlib.suppress(EOFError, OSError):
        while True:
            gate.recv_bytes()
    gate.close()


def _die_with_parent(spec: RankSpec) -> None:
    """Ask Linux to SIGKILL this rank when the process that started it dies."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    # The parent may have died between fork and prctl; then nobody would ever kill us.
    if spec.check_parent and os.getppid() != spec.parent_pid:
        os._exit(1)


def _lifeline_watch(lifeline: Connection) -> None:
    """Block on the lifeline pipe; the kernel holds the only write end, so EOF means it died."""
    try:
        while True:
            lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
    )


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _close_inherited_listeners(keep: set[int]) -> None:
    """Close listening sockets inherited from the kernel (its ZMQ ports, the rendezvous store).

    A rank that outlives the kernel for a moment must not keep the kernel's ports bound, or a
    restarted kernel cannot bind them again. Connected sockets a user opened are left alone.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd <= 2 or fd in keep:
            continue
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        finally:
            sock.detach()
        if listening:
            _close_quietly(fd)


def _silence_inherited_display() -> None:
    """Make ``display()`` in a forked rank print text, not publish on the kernel's iopub."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return
    shell = ipython.get_ipython()
    publisher = getattr(shell, "display_pub", None)
    if publisher is None:
        return

    def publish(data: dict[str, Any], metadata: Any = None, **kwargs: Any) -> None:
        text = data.get("text/plain")
        if text is not None:
            print(text)

    publisher.publish = publish


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _forward_display(send: Callable[[_protocol.Message], None]) -> None:
    """Send ``display()`` output (HTML, images, figures, updates) to the kernel to show.

    The rank's copy of the kernel's shell formats objects as usual (``_repr_html_``,
    matplotlib's inline backend, ``display_id`` handles); only the publishing step, which
    would write to the kernel's iopub socket, is replaced by a message to the kernel, which
    publishes the bundle in the launching cell (or prints its text where no frontend is).
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    publisher = getattr(shell, "display_pub", None)
    if publisher is None:
        return

    def publish(
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        source: Any = None,
        *,
        transient: dict[str, Any] | None = None,
        update: bool = False,
        **kwargs: Any,
    ) -> None:
        flush_all()  # what was printed before the display arrives before it
        if _WIDGET_VIEW in data:
            # A widget's model lives in this rank, whose comm messages cannot reach the
            # frontend: the cell would show "Error displaying widget". Its text form instead.
            data = {"text/plain": data.get("text/plain", "<widget>")}
        display_id = (transient or {}).get("display_id")
        with contextlib.suppress(OSError, EOFError):
            send(_protocol.Display(dict(data), dict(metadata or {}), display_id, bool(update)))

    def clear_output(wait: bool = False) -> None:
        with contextlib.suppress(OSError, EOFError):
            send(_protocol.ClearOutput(bool(wait)))

    publisher.publish = publish
    publisher.clear_output = clear_output


def _prepare_torch(spec: RankSpec, send: Callable[[_protocol.Message], None]) -> None:
    import torch

    from . import _groups, _rendezvous

    _rendezvous.install(send, spec.env["MASTER_ADDR"], int(spec.env["MASTER_PORT"]))
    _groups.install()  # no process group is destroyed before os._exit (a hang or SIGABRT)
    _groups.fresh_group_names()  # as in a fresh process, whatever the kernel did before
    counter = spec.env.get(COLLECTIVES_ENV)
    if counter:
        from .._shared import _collectives

        _collectives.install(counter)  # which collective this rank is in, for hang reports
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.use_gpu:
        torch.cuda.set_device(spec.local_rank)
    if spec.init_process_group:
        import torch.distributed as dist

        dist.init_process_group(backend=spec.backend)
