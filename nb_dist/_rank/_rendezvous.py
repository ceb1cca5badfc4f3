"""Rank side of the rendezvous: who hosts the store, and telling the kernel how it goes.

The kernel hosts the rendezvous store (see ``ports.py``) and tells every rank so through
``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's own convention: then every rank connects to
``MASTER_ADDR:MASTER_PORT`` as a client. Code written for a plain ``init_process_group`` often
sets its own address first (the PyTorch DDP tutorial's ``os.environ["MASTER_PORT"] = "12355"``,
or ``init_method="tcp://127.0.0.1:12355"``). Nobody listens there, and every rank would wait.
So when a rank's rendezvous goes to another address than the launcher's, the launcher's
convention is dropped for that call and rank 0 hosts the store there, exactly as a plain
``init_process_group`` outside any launcher does.

The same hooks tell the kernel when a rank enters the rendezvous and when its process group is
up, so the kernel can stop a rendezvous that will never complete (a rank that never calls
``init_process_group``, a wrong ``world_size``) within seconds instead of torch's 30 minutes.

Both hooks wrap torch functions that are looked up by name at call time
(``torch.distributed.rendezvous._create_c10d_store``, and ``rendezvous`` /
``_update_default_pg`` in ``distributed_c10d``), so they also apply to an
``init_process_group`` imported before the launch. They are private to torch and reached
through ``_shared/_torch_compat.py``: where a torch version lacks one of them, that hook is not
installed and the launch runs without it (logged, see :func:`install`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._shared import _torch_compat
from .._shared._net import is_loopback
from .._shared._protocol import Message, Rendezvous

_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

Send = Callable[[Message], None]

_log = logging.getLogger(__name__)


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    return is_loopback(a) and is_loopback(b)


#: The torch functions the hooks wrap, by module (each listed in ``_torch_compat.PRIVATES``).
#: A torch release that renames one switches its feature off (see :func:`install`);
#: tests/test_torch_hooks.py fails loudly when the tested torch lacks one.
HOOKED = {
    "torch.distributed.rendezvous": ("_create_c10d_store",),
    "torch.distributed.distributed_c10d": ("rendezvous", "_update_default_pg"),
}


def install(send: Send, launch_host: str, launch_port: int) -> list[str]:
    """Install both hooks in this rank (idempotent); ``send`` delivers a control message.

    Returns the hooks that this torch does not allow (``module.function`` names), logged on
    this module's logger. Without them a launch still runs: a rendezvous that cannot
    complete is then stopped by the launch's ``timeout`` instead of within seconds, and a
    function that picks its own address must pick the launcher's.
    """
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return []
    except ImportError:  # pragma: no cover - torch without distributed support
        return []
    # By module path: ``torch.distributed.rendezvous`` as an attribute is the function.
    c10d = _torch_compat.c10d()
    rendezvous_module = _torch_compat.module("torch.distributed.rendezvous")
    missing = []
    if rendezvous_module is None or not _wrap_store_factory(
        rendezvous_module, launch_host, launch_port
    ):
        missing.append("torch.distributed.rendezvous._create_c10d_store")
    if c10d is None or not _wrap_rendezvous(c10d, send):
        missing.append("torch.distributed.distributed_c10d.rendezvous/_update_default_pg")
    if missing:
        _log.info(
            "this torch has no %s, so those rendezvous hooks are off: a rendezvous that cannot "
            "complete is stopped by the launch's timeout instead of within seconds, and code "
            "that picks its own rendezvous address must use MASTER_ADDR and MASTER_PORT.",
            ", ".join(missing),
        )
    return missing


def _wrap_store_factory(module: Any, host: str, port: int) -> bool:
    """Wrap ``module._create_c10d_store``; whether it is wrapped (``False``: torch lacks it)."""
    return _torch_compat.replace(
        module, "_create_c10d_store", lambda original: _store_factory(original, host, port)
    )


def _store_factory(original: Any, launch_host: str, launch_port: int) -> Any:
    if getattr(original, "_nb_dist_hook", False):
        return original  # installed already

    @functools.wraps(original)
    def create_store(hostname: str, port: int, *args: Any, **kwargs: Any) -> Any:
        elsewhere = int(port) != launch_port or not _same_host(str(hostname), launch_host)
        if not (elsewhere and os.environ.get(_AGENT_STORE) == "True"):
            return original(hostname, port, *args, **kwargs)
        # The function chose its own address: rank 0 hosts the store there, as it would
        # without a launcher. Only for this call; the variable is restored afterwards.
        os.environ[_AGENT_STORE] = "False"
        try:
            return original(hostname, port, *args, **kwargs)
        finally:
            os.environ[_AGENT_STORE] = "True"

    create_store._nb_dist_hook = True  # type: ignore[attr-defined]
    return create_store


def _wrap_rendezvous(c10d: Any, send: Send) -> bool:
    """Wrap ``rendezvous`` and ``_update_default_pg`` (both or neither); whether they are."""
    found = _torch_compat.lookup(c10d, "rendezvous", "_update_default_pg")
    if found is None:
        return False
    rendezvous, update = found
    if getattr(rendezvous, "_nb_dist_hook", False):
        return True

    @functools.wraps(rendezvous)
    def entering(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Iterator[Any]:
        asked = world_size if world_size != -1 else _int_env("WORLD_SIZE")
        with contextlib.suppress(OSError, EOFError):
            send(Rendezvous("enter", time.monotonic(), asked, _endpoint(url)))
        return rendezvous(url, rank, world_size, **kwargs)  # type: ignore[no-any-return]

    @functools.wraps(update)
    def updated(pg: Any) -> Any:
        result = update(pg)
        if pg is not None:
            with contextlib.suppress(OSError, EOFError):
                send(Rendezvous("done", time.monotonic()))
        return result

    entering._nb_dist_hook = True  # type: ignore[attr-defined]
    _torch_compat.replace(c10d, "rendezvous", lambda _: entering)
    _torch_compat.replace(c10d, "_update_default_pg", lambda _: updated)
    return True


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _endpoint(url: str) -> str:
    """Where this rendezvous goes, as ``host:port`` (env:// reads the environment)."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.scheme == "tcp" and parsed.hostname:
        return f"{parsed.hostname}:{parsed.port}"
    if parsed.scheme == "env":
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return url
