"""Shipping code by value from the kernel to its ranks (both sides: the kernel dumps, a rank loads).

A function defined in a cell lives in ``__main__``, which a spawned or forkserver rank (and a
live rank receiving a task) cannot import, so it travels by value with cloudpickle. From
cloudpickle 3.1.3 on, every code object it ships is renamed ``<dynamic-code>`` (to make
payloads deterministic), and a rank's traceback, its hang stack and ``%debug`` would then say
``File "<dynamic-code>"`` instead of ``Cell In[5]`` with its source line. :func:`dumps` keeps
each code object's own file name: it lets cloudpickle reduce the code object as it always does
and restores ``co_filename`` when the rank rebuilds it. Nested functions and lambdas are code
objects inside their parent's constants, so they pass through the same step.

Only public pickling hooks are used (``reducer_override``, ``dispatch_table``), so this works
with every cloudpickle version nb_dist supports, renaming or not.
"""

from __future__ import annotations

import io
import types
from collections.abc import Callable
from typing import Any

import cloudpickle


def _with_filename(
    build: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str
) -> types.CodeType:
    """Rebuild a code object as cloudpickle does, then give it back its own file name."""
    code = build(*args)
    if code.co_filename == filename:
        return code
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # untyped base class
    """cloudpickle's pickler, but code objects keep their file name (see the module doc)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            reduce = self.dispatch_table.get(types.CodeType)
            if reduce is not None:
                build, args = reduce(obj)[:2]
                return _with_filename, (build, args, obj.co_filename)
        return super().reducer_override(obj)


def dumps(value: Any) -> bytes:
    """``cloudpickle.dumps(value)``, keeping the file names of the code it ships."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """The inverse of :func:`dumps` (in a rank)."""
    return cloudpickle.loads(data)
