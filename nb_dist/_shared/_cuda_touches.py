"""Where this process first touched CUDA, for the fork refusal to name.

The two torch entry points that poison fork (device counting and initialization) are wrapped
to remember the Python stack of their first call, so a refusal can say, e.g.,
"torch.cuda.is_available() at Cell In[3], line 2". They are wrapped when torch is imported:
at once if it is already, else by a one-shot import hook (``import nb_dist`` may come first,
and must not import torch itself). Only CUDA (or ROCm) builds are wrapped; CPU builds cannot
poison fork.

Only a process that may launch needs it: ``import nb_dist`` starts it outside a rank
(``nb_dist/_at_import.py``), and a process that never launches stops it first thing (a rank
at its entry, a node's agent, the fork server ranks are forked from), so none of them hooks
torch's import or records anything. It lives in ``_shared`` because all of these call it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import traceback
import types
from typing import Any, Literal

from .._shared import _torch_compat

State = Literal["off", "waiting for torch", "recording", "CPU build"]

_first: list[tuple[str, int, str]] | None = None
_state: State = "off"
_log = logging.getLogger(__name__)


def record() -> None:
    """Start recording: now if torch is imported, else as soon as it is (once per process)."""
    global _state
    if _state != "off":
        return
    if "torch" in sys.modules:
        _install()
        return
    _state = "waiting for torch"
    sys.meta_path.insert(0, _WhenTorchArrives())


def stop() -> None:
    """This process never launches (a rank, a node's agent, a fork server): no import hook
    waits for torch, and wrappers already installed (torch came first, or a forked rank
    inherited them) pass every call straight through without recording."""
    global _state
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WhenTorchArrives)]
    _state = "off"


def state() -> State:
    """Whether recording is on, waits for torch, or is not needed (a CPU build)."""
    return _state


def touched() -> bool:
    """Whether anything in this process has counted or initialized CUDA devices yet."""
    return _first is not None


def first_touch() -> list[tuple[str, int, str]] | None:
    """The stack (file, line, function) of the first call that touched CUDA, if any."""
    return _first


def cuda_built() -> bool:
    """Whether the imported torch is built for CUDA or ROCm."""
    import torch

    return bool(torch.version.cuda or getattr(torch.version, "hip", None))


def _install() -> None:
    global _state
    if not cuda_built():
        _state = "CPU build"
        return
    import torch

    def recording(original: Any) -> Any:
        def recorder(*args: Any) -> Any:
            global _first
            if _first is None and _state == "recording":
                frames = traceback.extract_stack()[:-1]
                _first = [(f.filename, f.lineno or 0, f.name) for f in frames]
            return original(*args)

        return recorder

    _torch_compat.wrap_cuda_entry_points(torch, recording)
    _state = "recording"


class _WhenTorchArrives(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is first imported, it lets the usual finders find
    it and has its loader start recording once torch's module has run."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; and the search below must not find this finder
        spec = importlib.util.find_spec("torch")
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_record(module: types.ModuleType) -> None:
            run(module)
            try:
                _install()
            except Exception:  # never break torch's import; a refusal then names no line
                _log.debug("nb_dist: could not wrap torch's CUDA entry points", exc_info=True)

        loader.exec_module = exec_then_record  # type: ignore[method-assign]
        return spec
