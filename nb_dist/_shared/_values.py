"""A rank's value as it crosses to the kernel: pickled, with large tensors' bytes out of band.

Runs on both sides: a rank dumps (:func:`dumps`), the kernel loads (:func:`loads`) and
:func:`rebuild_tensor` is what the pickle names. Plain ``pickle`` of a tensor goes through
``torch.save`` into a ``bytes`` object, and loading copies it again: for a 100 MB
``state_dict`` that is a quarter of a second at each end. Here a large, plain, contiguous CPU
tensor is reduced to its raw bytes as a pickle-5 ``PickleBuffer``: the rank writes them
straight from the tensor's memory after the pickle (``_protocol.Result`` announces their
sizes), and the kernel reads them into buffers that become the tensors' memory. Any other
object (and any tensor that is not plain: a subclass, a view with gaps, a non-leaf that needs
grad, named dimensions) is pickled as ``pickle`` always does, so a value means the same as it
did. Accelerator tensors are moved to CPU first, so the kernel never unpickles CUDA data.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

#: Tensors from this many bytes on cross out of band (smaller ones: a read each is not worth it).
OUT_OF_BAND = 1 << 16


class _RankPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        self.buffers: list[pickle.PickleBuffer] = []
        super().__init__(file, protocol=5, buffer_callback=self._keep_in_band)

    def _keep_in_band(self, buffer: pickle.PickleBuffer) -> bool:
        """Whether ``buffer`` stays inside the pickle: a small one (a numpy array of a few
        bytes is cheaper there than as a read of its own in the kernel); a large one is
        kept out of band, in order."""
        if buffer.raw().nbytes < OUT_OF_BAND:
            return True
        self.buffers.append(buffer)
        return False

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.device.type in ("cpu", "meta"):
            reduced = _out_of_band(torch, obj)
            return NotImplemented if reduced is None else reduced
        # An accelerator tensor: its CPU copy, whatever happens next (pickle's own reduction
        # of the original would send CUDA data that the kernel must not unpickle).
        moved = _on_cpu(torch, obj)
        reduced = _out_of_band(torch, moved)
        return moved.__reduce_ex__(pickle.HIGHEST_PROTOCOL) if reduced is None else reduced


def _on_cpu(torch: Any, tensor: Any) -> Any:
    """``tensor`` copied to CPU, a parameter still a parameter and a leaf's
    ``requires_grad`` kept (as pickling it on CPU keeps them)."""
    moved = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    if tensor.requires_grad and tensor.is_leaf:
        moved.requires_grad_(True)
    return moved


def _out_of_band(torch: Any, tensor: Any) -> tuple[Any, ...] | None:
    """``tensor`` as (its raw bytes, dtype, shape, grad flags), or ``None`` to pickle it as
    usual (its meaning would not survive a copy of its bytes)."""
    if (
        type(tensor) not in (torch.Tensor, torch.nn.Parameter)
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.nbytes < OUT_OF_BAND
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or _named(tensor)
        or (tensor.requires_grad and not tensor.is_leaf)
        or tensor.__dict__
    ):
        return None
    try:
        raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a dtype numpy or a byte view cannot take
        return None
    parameter = isinstance(tensor, torch.nn.Parameter)
    arguments = (pickle.PickleBuffer(raw), tensor.dtype, tuple(tensor.shape))
    return rebuild_tensor, (*arguments, tensor.requires_grad, parameter)


def _named(tensor: Any) -> bool:
    has_names = getattr(tensor, "has_names", None)  # named tensors: gone from newer torch
    return bool(has_names is not None and has_names())


def rebuild_tensor(
    data: Any, dtype: Any, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> Any:
    """The tensor whose bytes are ``data`` (a buffer the tensor then owns a view of)."""
    import torch

    tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def dumps(value: Any) -> tuple[bytes, list[memoryview]]:
    """``value`` pickled, and the raw buffers that follow the pickle, in order."""
    file = io.BytesIO()
    pickler = _RankPickler(file)
    pickler.dump(value)
    return file.getvalue(), [buffer.raw() for buffer in pickler.buffers]


def loads(data: bytes | bytearray, buffers: list[bytearray]) -> Any:
    """The value :func:`dumps` pickled, its tensors built over ``buffers``."""
    return pickle.loads(data, buffers=buffers)
