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


def bubble_formula(p: int, m: int) -> float:
    """Notebook 17, after exercise 17-1: the bubble of AFAB and 1F1B, each rank's idle time over
    its compute time, ``(p - 1)/m`` for ``p`` stages and ``m`` microbatches."""
    return (p - 1) / m


def torch_1f1b(p: int, m: int, rank: int) -> Order:
    """Notebook 17, after exercise 17-2: the 1F1B order of stage ``rank`` of ``p`` for ``m``
    microbatches, in the form of PyTorch's ``Schedule1F1B`` (``p - rank`` forwards, then
    pairs of one backward and one forward, then the backwards left)."""
    first = min(p - rank, m)
    forwards = [("F", j) for j in range(m)]
    backwards = [("B", j) for j in range(m)]
    steady = [task for j in range(m - first) for task in (backwards[j], forwards[first + j])]
    return forwards[:first] + steady + backwards[m - first :]


def merge_blocks(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """Notebook 18, exercise 18-1: the ``(m, den, acc)`` of two blocks of keys together (the
    online softmax), each block first brought to the larger of the two maxima."""
    import torch

    top = torch.maximum(a[0], b[0])
    weights = [torch.exp(block[0] - top) for block in (a, b)]
    den = sum(w * block[1] for w, block in zip(weights, (a, b), strict=True))
    acc = sum(w * block[2] for w, block in zip(weights, (a, b), strict=True))
    return top, den, acc


def average_over_dp(model: Any, dp_group: Any) -> None:
    """Notebook 22, exercise 22-2: every gradient of ``model`` replaced, in place, by its mean
    over the ranks of ``dp_group`` (an all-reduce on that group, not on the whole world)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(dp_group)
    with torch.no_grad():
        for parameter in model.parameters():
            grad = parameter.grad
            # a DTensor's gradient (tensor parallelism): its local shard, which shares storage
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=dp_group)
            local.div_(size)


def moe_counts_per_rank(expert: Any, experts_per_rank: int, world_size: int) -> Any:
    """Notebook 19, exercise 19-3: how many of the rows (each for ``expert``, experts placed on
    the ranks in blocks of ``experts_per_rank``) go to each of the ``world_size`` ranks."""
    import torch

    return torch.bincount(expert // experts_per_rank, minlength=world_size)


def moe_combine(returned: Any, token: Any, gate: Any, n_tokens: int) -> Any:
    """Notebook 19, exercise 19-4: the MoE layer's output, ``n_tokens`` rows: each token's
    expert results (the rows of ``returned``) added up, each weighted by its gate."""
    import torch

    out = torch.zeros(n_tokens, returned.shape[1], dtype=returned.dtype)
    return out.index_add(0, token, gate[:, None] * returned)


def ulysses_seq_to_heads(x: Any, group: Any = None) -> Any:
    """Notebook 18, exercise 18-4: DeepSpeed-Ulysses' first all-to-all. ``x`` is this rank's
    ``(b, a, s/N, d)`` shard (its chunk of the sequence, every head); the result is
    ``(b, a/N, s, d)``: every token, in order, of this rank's ``a/N`` heads (rank ``r`` gets
    heads ``r·a/N`` to ``(r + 1)·a/N - 1``), ``N`` the size of ``group``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    b, a, chunk, d = x.shape
    # chunk j of the input goes to rank j: rank j's group of heads along dimension 0
    send = x.reshape(b, world, a // world, chunk, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's chunk of the sequence, for this rank's heads: in rank order
    return received.permute(1, 2, 0, 3, 4).reshape(b, a // world, world * chunk, d)


def ulysses_heads_to_seq(x: Any, group: Any = None) -> Any:
    """Notebook 18, after exercise 18-4: the inverse of :func:`ulysses_seq_to_heads`, the
    all-to-all after attention: ``(b, a/N, s, d)`` back to ``(b, a, s/N, d)``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    b, heads, s, d = x.shape
    # chunk j of the input goes to rank j: rank j's chunk of the sequence along dimension 0
    send = x.reshape(b, heads, world, s // world, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's group of heads, for this rank's tokens: heads in rank order
    return received.transpose(0, 1).reshape(b, world * heads, s // world, d)


def exposed_time(compute: list[tuple[float, float]], comm: list[tuple[float, float]]) -> float:
    """Notebook 21, exercise 21-1: the time covered by some ``comm`` interval and by no
    ``compute`` interval (each a ``(start, end)``; either list may overlap or nest)."""

    def union(intervals: list[tuple[float, float]]) -> list[list[float]]:
        merged: list[list[float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    busy = union(compute)
    exposed = 0.0
    for start, end in union(comm):
        exposed += end - start - sum(max(0.0, min(end, e) - max(start, s)) for s, e in busy)
    return exposed


def fsdp_tp_shard(full: Any, tp_dim: int, i: int, j: int, dp: int, tp: int) -> Any:
    """Notebook 22, exercise 22-4: the part of the full weight ``full`` that rank ``(dp i,
    tp j)`` holds under tensor parallelism on ``tp_dim`` then FSDP: tp's chunk ``j`` along
    ``tp_dim``, then FSDP's chunk ``i`` of it along dimension 0."""
    return full.chunk(tp, dim=tp_dim)[j].chunk(dp, dim=0)[i]


def pp_group_ranks(rank: int, pp: int, dp: int, tp: int) -> list[int]:
    """Notebook 22, exercise 22-5: the ranks of ``rank``'s pp group in a ``(pp, dp, tp)``
    device mesh (row-major): one per stage, at the same ``(dp, tp)`` place as ``rank``."""
    per_stage = dp * tp
    return [stage * per_stage + rank % per_stage for stage in range(pp)]


def interleaved_forwards(p: int, v: int, m: int, rank: int) -> list[tuple[int, int]]:
    """Notebook 17, exercise 17-3: the ``(stage, microbatch)`` forwards that rank ``rank`` of
    ``p`` runs in Megatron's interleaved 1F1B with ``v`` stages per rank (stage ``s`` on rank
    ``s % p``): groups of ``p`` microbatches, in each group the rank's chunks one after the
    other, each for all the group's microbatches (``m`` a multiple of ``p``)."""
    return [
        (chunk * p + rank, j)
        for first in range(0, m, p)
        for chunk in range(v)
        for j in range(first, first + p)
    ]


def interleaved_1f1b(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Notebook 17, after exercise 17-3: the interleaved 1F1B order of rank ``rank`` (actions
    ``("F" | "B", stage, microbatch)``): ``(v - 1) * p + 2 * (p - 1 - rank)`` warm-up forwards
    (as PyTorch's ``ScheduleInterleaved1F1B``), then one forward and one backward at a time,
    then the backwards left; the backwards go in the forwards' order with the chunks
    reversed."""
    forwards = interleaved_forwards(p, v, m, rank)
    backwards = [((v - 1 - s // p) * p + rank, j) for s, j in forwards]
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), v * m)
    order = [("F", s, j) for s, j in forwards[:warmup]]
    for k in range(v * m - warmup):
        order += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
    return order + [("B", s, j) for s, j in backwards[v * m - warmup :]]


def latest_checkpoint(run: Any) -> Any:
    """Notebook 20, exercise 20-2: the ``step_<n>`` folder of ``run`` (a ``Path``) with the
    largest ``n`` that is complete (holds DCP's ``.metadata``, written last), or ``None`` when
    there is none or ``run`` does not exist."""
    if not run.is_dir():
        return None
    complete = [p for p in run.glob("step_*") if (p / ".metadata").exists()]
    return max(complete, key=lambda p: int(p.name.split("_")[1]), default=None)


def ulysses_bytes(n: int, b: int = 2, s: int = 64, h: int = 32) -> float:
    """Notebook 18, exercise 18-5: the bytes one Ulysses rank sends to the others in forward,
    without a mask: four all-to-alls of ``b·(s/n)·h`` float32 values, each sending all but the
    rank's own chunk, ``(n - 1)/n`` of it."""
    return 4 * b * s / n * h * 4 * (n - 1) / n


def ring_bytes(n: int, b: int = 2, s: int = 64, h: int = 32) -> float:
    """Notebook 18, exercise 18-5: the bytes one ring-attention rank sends in forward: ``n - 1``
    hops of one K/V block, ``2·b·(s/n)·h`` float32 values."""
    return (n - 1) * 2 * b * s / n * h * 4


def tp_block_parameters(h: int, n: int) -> float:
    """Notebook 13, after exercise 13-3: the parameters one rank holds of one transformer block
    under Megatron-style tensor parallelism of degree ``n`` (``q``, ``k``, ``v`` and ``fc1``
    split by columns with their biases, ``proj`` and ``fc2`` by rows with whole biases, the
    LayerNorms whole)."""
    split = 12 * h * h + 7 * h  # the four column-split linears and the row-split weights
    repeated = 6 * h  # two row-parallel biases and two LayerNorms, whole on every rank
    return split / n + repeated


def tp_block_activations(b: int, s: int, h: int, a: int, n: int) -> float:
    """Notebook 13, after exercise 13-1: the bytes (fp32) one rank of a tensor-parallel group
    of ``n`` keeps for backward of one block: the LayerNorms' inputs and statistics and the
    inputs of ``q``/``k``/``v`` and ``fc1`` whole, the rest split by ``n``."""
    whole = 4 * b * s * h + 4 * b * s
    split = 12 * b * s * h + a * b * s * s
    return 4 * (whole + split / n)


def linear_backward(grad_y: Any, x: Any, weight: Any) -> tuple[Any, Any, Any]:
    """Notebook 16, after exercise 16-2: one rank's local backward of ``y = x Wᵀ + b`` (no
    collective): the gradients of the input ``x``, of ``weight`` and of the bias, from
    ``∂L/∂y``; the leading dimensions of ``x`` and ``grad_y`` (batch, tokens) are summed over
    for the weight and the bias."""
    dy, flat_x = grad_y.flatten(0, -2), x.flatten(0, -2)
    return grad_y @ weight, dy.T @ flat_x, dy.sum(0)


def sp_partial_parameters(block: Any) -> list[Any]:
    """Notebook 16, after exercise 16-3: the parameters of a transformer block (with ``ln1``,
    ``ln2``, ``attn.proj`` and ``mlp.fc2``) whose gradients sequence parallelism leaves as
    partial sums on each rank: those used on the rank's own tokens only, the LayerNorms' and
    the biases added after the reduce-scatter."""
    return [
        *block.ln1.parameters(),
        *block.ln2.parameters(),
        block.attn.proj.bias,
        block.mlp.fc2.bias,
    ]


def zb_h1(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Notebook 17, after exercise 17-2: the ZB-H1 order (Qi et al., 2023, arXiv:2401.10241)
    of stage ``rank`` of ``p`` for ``m`` microbatches, actions ``("F" | "B" | "W", rank, j)``:
    1F1B's forwards and backwards (B: the input's gradient only), a W (the weights' gradient)
    after each B from the ``rank``-th B on, and the W's held back at the end."""
    order: list[tuple[str, int, int]] = []
    weights = 0  # the W's run so far
    for kind, j in torch_1f1b(p, m, rank):
        order.append((kind, rank, j))
        if kind == "B" and j >= rank:
            order.append(("W", rank, weights))
            weights += 1
    return order + [("W", rank, j) for j in range(weights, m)]


def moe_keep_within_capacity(expert: Any, n_experts: int, capacity: int) -> Any:
    """Notebook 19, exercise 19-1: which rows (each for ``expert``, in queue order) an expert
    keeps: a row is kept while fewer than ``capacity`` earlier rows chose the same expert."""
    import torch

    one_hot = torch.nn.functional.one_hot(expert, n_experts)
    place = (one_hot.cumsum(0) - 1).gather(1, expert[:, None])[:, 0]
    return place < capacity


def moe_dense(x: Any, token: Any, expert: Any, gate: Any, experts: Any) -> Any:
    """Notebook 19: the MoE layer in one process, every expert on every token, each result
    weighted by a (tokens x experts) matrix that holds the kept rows' gates and 0 elsewhere."""
    import torch

    weights = torch.zeros(len(x), len(experts), dtype=x.dtype).index_put((token, expert), gate)
    return sum(weights[:, e : e + 1] * mlp(x) for e, mlp in enumerate(experts))


def plan_costs(
    model: dict[str, int], layout: dict[str, int], fused_qkv: bool = True
) -> dict[str, float]:
    """Notebook 22, exercise 22-6: a training plan's ``memory`` per rank and ``traffic`` per step
    and rank, in bytes (fp32, Adam, no recomputation), for a dense transformer ``model`` (``psi``,
    ``layers``, ``hidden``, ``heads``, ``seq``, ``micro_batch``, ``microbatches``) on a ``layout``
    (``pp``, ``dp``, ``cp``, ``tp``).

    Memory:

    - model states ``16Ψ``, fully sharded over the whole mesh (FSDP over dp and cp, notebook 15);
    - the activations of the stage's layers for ``min(pp, m)`` microbatches in flight (1F1B,
      notebook 17), each block's from :func:`tp_block_activations` on ``s/cp`` tokens, except:
    - the attention scores of notebook 18's hand-written ring attention, which keeps in
      training the ``cp`` score blocks of its queries (:func:`ring_score_bytes`:
      ``a·b·(s/cp)·s`` values, ``1/cp`` of the score matrix, not one ``(s/cp)²`` block), ``1/tp``
      of them per tp rank (a fused, recomputing kernel such as FlashAttention keeps none, which
      the plan does not count);
    - every K/V block the ring received, as notebook 18 measured (the whole ``K`` and ``V``,
      ``2·b·s·h`` values, ``1/tp`` per tp rank), of which :func:`tp_block_activations` counts only
      the rank's own ``1/cp``: ``4·2·b·s·h·(1 - 1/cp)/tp`` bytes more per block.

    Traffic, in notebook 15's units:

    - FSDP's two all-gathers and one reduce-scatter of the stage's tp shard for every
      microbatch, ``m·3·4Ψ/(pp·tp)`` per step: FSDP reshards the stage and reduce-scatters its
      gradients after each microbatch, which keeps the states fully sharded all step, as the
      memory counts them. Keeping the stage gathered between microbatches instead
      (``fully_shard``'s ``reshard_after_forward=False``, with ``set_reshard_after_backward(False)``
      and ``set_requires_gradient_sync(False)`` between microbatches, as
      ``torch.distributed.pipelining``'s stages set them before running FSDP's post-backward
      once after the last) moves about ``2·4Ψ/(pp·tp)`` per step and holds ``4Ψ/(pp·tp)`` bytes
      more of parameters and as much of gradients, which the plan does not count;
    - the tp all-reduces of one ``(b, s/cp, h)`` activation per layer and microbatch: 4 with
      ``q``, ``k`` and ``v`` fused into one linear, as Megatron-LM does; 6 with
      ``fused_qkv=False``, three separate linears each all-reducing its input's gradient, as a
      DTensor plan of ``q``, ``k``, ``v`` does;
    - one activation and one gradient per microbatch across a stage boundary;
    - ring attention's K/V hops forward and backward (:func:`ring_bytes` on ``h/tp`` features).
    """
    pp, dp, cp, tp = layout["pp"], layout["dp"], layout["cp"], layout["tp"]
    layers, h, s = model["layers"], model["hidden"], model["seq"]
    b, m, psi, a = model["micro_batch"], model["microbatches"], model["psi"], model["heads"]
    states = 16 * psi / (pp * dp * cp * tp)
    in_flight = min(pp, m)
    block = tp_block_activations(b, s // cp, h, 0, tp)  # a = 0: every term but the scores
    block += ring_score_bytes(cp, b, a, s) / tp  # the ring's cp blocks of (s/cp)² scores
    block += 4 * 2 * b * s * h * (1 - 1 / cp) / tp  # the K/V blocks received, kept for backward
    activations = layers / pp * in_flight * block
    activation = 4 * b * s / cp * h  # one (b, s/cp, h) tensor in fp32
    traffic = 0.0
    if dp * cp > 1:
        traffic += m * 3 * 4 * psi / (pp * tp)  # resharded between microbatches
    if tp > 1:
        traffic += m * layers / pp * (4 if fused_qkv else 6) * 2 * activation
    if pp > 1:
        traffic += m * 2 * activation
    if cp > 1:
        traffic += m * layers / pp * 2 * ring_bytes(cp, b, s, h // tp)
    return {"memory": states + activations, "traffic": traffic}


def ring_score_bytes(n: int, b: int = 2, a: int = 4, s: int = 64) -> int:
    """Notebook 18, exercise 18-2: the bytes of score blocks one ring-attention rank keeps for
    backward: one ``(b, a, s/n, s/n)`` float32 block for each of the ``n`` steps."""
    return n * b * a * (s // n) ** 2 * 4


def reshard_reads(
    saved: list[tuple[str, int, int]], length: int, world: int, rank: int
) -> list[tuple[str, int, int]]:
    """Notebook 20, exercise 20-1: the pieces ``(file, first row, rows)`` that rank ``rank`` of
    ``world`` reads of a tensor of ``length`` rows saved in the chunks ``saved`` (each
    ``(file, first row, rows)``, in row order), when it holds ``torch.chunk``'s block of rows
    (``ceil(length / world)`` rows per rank, the last ones fewer or none), as FSDP2 does."""
    per_rank = -(-length // world)
    start, end = rank * per_rank, min(length, (rank + 1) * per_rank)
    pieces = []
    for file, first, rows in saved:
        low, high = max(start, first), min(end, first + rows)
        if low < high:
            pieces.append((file, low, high - low))
    return pieces


__all__ = [
    "average_over_dp",
    "block_activations",
    "bubble_formula",
    "exposed_time",
    "fsdp_tp_shard",
    "interleaved_1f1b",
    "interleaved_forwards",
    "latest_checkpoint",
    "linear_backward",
    "merge_blocks",
    "moe_combine",
    "moe_counts_per_rank",
    "moe_dense",
    "moe_keep_within_capacity",
    "plan_costs",
    "pp_group_ranks",
    "reshard_reads",
    "ring_bytes",
    "ring_score_bytes",
    "sp_partial_parameters",
    "torch_1f1b",
    "tp_block_activations",
    "tp_block_parameters",
    "ulysses_bytes",
    "ulysses_heads_to_seq",
    "ulysses_seq_to_heads",
    "zb_h1",
]
