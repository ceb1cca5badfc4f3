"""The class Ray starts on each node: the node agent, without nb_dist's kernel side.

Runs in the kernel (:func:`agent_class`) and in each agent's Ray worker (the class it returns,
which refers to nothing of this module).
Ray imports an actor's class in a fresh worker, and importing any module of nb_dist first runs
``nb_dist/__init__.py``: the kernel's API, with torch, ipywidgets and matplotlib. The agent
uses none of it (its ranks import torch in their own processes), and on a cold launch that
import is on the critical path before each node's fork server can even start (about 1.3 s
on 2 cores). So Ray gets a class defined here at run time, which cloudpickle ships by value
(it has no importable name): its ``__init__`` puts a bare ``nb_dist`` package (its path,
nothing run) in ``sys.modules`` unless nb_dist is imported already, imports
``nb_dist._node._agent`` and makes the real :class:`~nb_dist._node._agent.NodeAgent`; each
method calls the agent's. The agent's process runs nothing but the agent, so nothing there
misses the API.
"""

from __future__ import annotations

import functools
from typing import Any

from ._agent import NodeAgent

#: The agent's methods the kernel calls through Ray: every public one of ``NodeAgent``.
METHODS = tuple(
    name for name, value in vars(NodeAgent).items() if callable(value) and not name.startswith("_")
)


@functools.cache
def agent_class() -> type:
    """A class with :data:`METHODS` that makes a ``NodeAgent`` where Ray starts it."""

    def __init__(self: Any, *args: Any) -> None:
        import importlib
        import importlib.util
        import sys

        if "nb_dist" not in sys.modules:
            spec = importlib.util.find_spec("nb_dist")
            if spec is not None:
                sys.modules["nb_dist"] = importlib.util.module_from_spec(spec)
        agent = importlib.import_module("nb_dist._node._agent")
        self._agent = agent.NodeAgent(*args)

    def calling(name: str) -> Any:
        def call(self: Any, *args: Any) -> Any:
            return getattr(self._agent, name)(*args)

        call.__name__ = call.__qualname__ = name
        return call

    namespace: dict[str, Any] = {"__init__": __init__, "__module__": __name__}
    namespace.update({name: calling(name) for name in METHODS})
    return type("NodeAgent", (), namespace)
