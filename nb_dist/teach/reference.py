"""Reference implementations of the notebooks' coding exercises, for the cells after them.

A notebook asks the student to write a function and checks it; the cells after the check need
a working version whatever the student wrote. They import it from here, after the exercise, so
the student edition never shows the answer in the notebook itself. Each function is the one its
exercise asks for (the solutions edition holds the worked answer, with its explanation). Torch
is imported inside the functions that need it, so importing this module stays light.
"""

from __future__ import annotations

from typing import Any

Order = list[tuple[str, int]]


def block_activations(b: int, s: int, h: int, a: int) -> int:
    """Notebook 13, exercise 13-1: the bytes one transformer block keeps for backward in
    fp32, for a batch of ``b`` sequences of ``s`` tokens, width ``h`` and ``a`` heads."""
    per_element = 4
    token_terms = 16 * b * s * h + 4 * b * s  # every (b, s, ·) tensor the table lists
    attention_matrix = a * b * s * s  # the softmax output
    return per_element * (token_terms + attention_matrix)


def torch_1f1b(p: int, m: int, rank: int) -> Order:
    """Notebook 16, after exercise 16-2: the 1F1B order of stage ``rank`` of ``p`` for ``m``
    microbatches, in the form of PyTorch's ``Schedule1F1B`` (``p - rank`` forwards, then
    pairs of one backward and one forward, then the backwards left)."""
    first = min(p - rank, m)
    forwards = [("F", j) for j in range(m)]
    backwards = [("B", j) for j in range(m)]
    steady = [task for j in range(m - first) for task in (backwards[j], forwards[first + j])]
    return forwards[:first] + steady + backwards[m - first :]


def merge_blocks(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """Notebook 17, exercise 17-1: the ``(m, den, acc)`` of two blocks of keys together (the
    online softmax), each block first brought to the larger of the two maxima."""
    import torch

    top = torch.maximum(a[0], b[0])
    weights = [torch.exp(block[0] - top) for block in (a, b)]
    den = sum(w * block[1] for w, block in zip(weights, (a, b), strict=True))
    acc = sum(w * block[2] for w, block in zip(weights, (a, b), strict=True))
    return top, den, acc


def average_over_dp(model: Any, dp_group: Any) -> None:
    """Notebook 18, exercise 18-2: every gradient of ``model`` replaced, in place, by its mean
    over the ranks of ``dp_group`` (an all-reduce on that group, not on the whole world)."""
    import torch.distributed as dist

    size = dist.get_world_size(dp_group)
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad, group=dp_group)
        parameter.grad.div_(size)


def moe_counts_per_rank(expert: Any, experts_per_rank: int, world_size: int) -> Any:
    """Notebook 19, exercise 19-2: how many of the rows (each for ``expert``, experts placed on
    the ranks in blocks of ``experts_per_rank``) go to each of the ``world_size`` ranks."""
    import torch

    return torch.bincount(expert // experts_per_rank, minlength=world_size)


def moe_combine(returned: Any, token: Any, gate: Any, n_tokens: int) -> Any:
    """Notebook 19, exercise 19-3: the MoE layer's output, ``n_tokens`` rows: each token's
    expert results (the rows of ``returned``) added up, each weighted by its gate."""
    import torch

    out = torch.zeros(n_tokens, returned.shape[1], dtype=returned.dtype)
    return out.index_add(0, token, gate[:, None] * returned)


__all__ = [
    "average_over_dp",
    "block_activations",
    "merge_blocks",
    "moe_combine",
    "moe_counts_per_rank",
    "torch_1f1b",
]
