"""The ``nb-dist demo``: train a small classifier with DDP on N CPU processes.

It goes through :func:`nb_dist.notebook_launcher`, the same code path a notebook cell uses, so
it doubles as a smoke test of an installation. :func:`train` is what every rank runs (module
level, so ``spawn``/``forkserver`` ranks can import it); :func:`run_demo` launches it from
the calling process and prints a summary.

Everything a DDP training needs is in :func:`train` (the sharded loader and one epoch's
training in two small helpers), in the order a real script does it: create the process group,
build the same data on every rank, shard it with a ``DistributedSampler`` (and ``set_epoch`` so
each epoch shuffles differently), wrap the model in ``DistributedDataParallel`` (which averages
gradients across ranks in ``backward``), train, and evaluate.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ._kernel._launcher import notebook_launcher

NUM_FEATURES = 8
NUM_CLASSES = 4
TRAIN_POINTS = 4096
HELD_OUT_POINTS = 1024
BATCH_SIZE = 64
LEARNING_RATE = 0.05


def make_data(seed: int) -> tuple[Any, Any, Any, Any]:
    """A 4-class problem: Gaussian blobs around random centres, the same on every rank.

    Returns ``(x_train, y_train, x_held_out, y_held_out)``. Built from a fixed
    ``torch.Generator`` so every rank (and every run with the same seed) gets identical data;
    the ``DistributedSampler`` then gives each rank its own share of the training set.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=gen) * 2.0
    total = TRAIN_POINTS + HELD_OUT_POINTS
    labels = torch.randint(0, NUM_CLASSES, (total,), generator=gen)
    points = centres[labels] + torch.randn(total, NUM_FEATURES, generator=gen)
    return (
        points[:TRAIN_POINTS],
        labels[:TRAIN_POINTS],
        points[TRAIN_POINTS:],
        labels[TRAIN_POINTS:],
    )


def make_model(seed: int) -> Any:
    """A small MLP. DDP copies rank 0's weights to every rank when it wraps the model."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


def parameter_checksum(model: Any) -> str:
    """SHA-256 of the exact bytes of every parameter: equal only if the weights are identical."""
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(epochs: int = 3, seed: int = 0, fail_rank: int | None = None) -> dict[str, Any]:
    """What every rank runs: DDP training of the MLP on this rank's share of the data.

    Rank 0 prints one progress line per epoch; every rank prints one line at the end. Returns
    this rank's final training loss, held-out accuracy, samples seen and parameter checksum.
    ``fail_rank`` makes that rank raise during the second epoch (or the only one), to show how
    a failure is reported.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ._shared._precision import mixed_precision

    dist.init_process_group("gloo")  # env:// : the launcher set RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()

    x_train, y_train, x_held_out, y_held_out = make_data(seed)
    sampler, loader = _sharded_loader(x_train, y_train, seed, rank, world)

    model = DistributedDataParallel(make_model(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    samples = 0
    epoch_loss = float("nan")
    accuracy = float("nan")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        started = time.perf_counter()
        fail = rank == fail_rank and epoch == min(1, epochs - 1)
        total, count = _train_epoch(model, loader, optimizer, loss_fn, rank, epoch, fail)
        samples += count
        epoch_loss = total / max(count, 1)
        accuracy = _accuracy(model, x_held_out, y_held_out)
        # The mean loss over all ranks: one collective that every rank must call.
        stats = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{epochs}: loss {stats[0].item() / stats[1].item():.4f} "
                f"(mean over {world} ranks), held-out accuracy {accuracy:.3f}, "
                f"{time.perf_counter() - started:.2f} s",
                flush=True,
            )

    checksum = parameter_checksum(model.module)
    print(
        f"done: {samples} samples seen, final loss {epoch_loss:.4f}, held-out accuracy "
        f"{accuracy:.3f}, parameters {checksum[:12]} (mixed precision {mixed_precision()})",
        flush=True,
    )
    # Free DDP before destroying the group. Its C++ Reducer holds the process group and is
    # freed with the GIL held; if it dropped the group's last reference, gloo's destructor
    # would wait for its worker thread, which may need the GIL: a rare hang at exit.
    del model, optimizer
    gc.collect()  # DDP sits in a reference cycle: free it now, not at some later collection
    dist.destroy_process_group()
    return {
        "rank": rank,
        "loss": epoch_loss,
        "accuracy": accuracy,
        "samples": samples,
        "checksum": checksum,
        "pid": os.getpid(),
    }


def _sharded_loader(x: Any, y: Any, seed: int, rank: int, world: int) -> tuple[Any, Any]:
    """This rank's ``DistributedSampler`` over ``(x, y)`` and the ``DataLoader`` that uses it."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dataset = TensorDataset(x, y)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed
    )
    return sampler, DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


def _train_epoch(
    model: Any, loader: Any, optimizer: Any, loss_fn: Any, rank: int, epoch: int, fail: bool
) -> tuple[float, int]:
    """One pass over this rank's shard: ``(summed loss, samples)``; ``fail`` raises at step 3."""
    from ._shared._precision import autocast

    model.train()
    total, count = 0.0, 0
    for step, (x, y) in enumerate(loader):
        if fail and step == 3:
            raise RuntimeError(
                f"rank {rank} failed on purpose in epoch {epoch + 1}, step {step} (--fail-rank)"
            )
        optimizer.zero_grad()
        with autocast("cpu"):
            loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        optimizer.step()
        total += loss.item() * len(y)
        count += len(y)
    return total, count


def _accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    from ._shared._precision import autocast

    model.eval()
    with torch.no_grad(), autocast("cpu"):
        predicted = model.module(x).argmax(dim=1)  # .module: no DDP hooks for a local eval
    return float((predicted == y).float().mean().item())


@dataclass
class DemoSummary:
    """What :func:`run_demo` returns: one dict per rank (see :func:`train`) and the totals."""

    num_processes: int
    epochs: int
    start_method: str
    mixed_precision: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    params_identical: bool = False
    wall_time: float = 0.0

    @property
    def min_accuracy(self) -> float:
        return float(min(r["accuracy"] for r in self.ranks))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serializable): the fields, with one dict per rank."""
        return asdict(self)

    def table(self) -> str:
        """The per-rank table, the weight check and the wall time, as printed by the demo."""
        lines = [
            f"nb_dist demo: {self.num_processes} processes ({self.start_method}), "
            f"{self.epochs} epochs, mixed precision {self.mixed_precision}",
            f"{'rank':>4}  {'loss':>8}  {'accuracy':>8}  {'samples':>7}",
        ]
        for r in self.ranks:
            lines.append(
                f"{r['rank']:>4}  {r['loss']:>8.4f}  {r['accuracy']:>8.3f}  {r['samples']:>7}"
            )
        checksum = self.ranks[0]["checksum"][:12] if self.ranks else "-"
        if self.params_identical:
            lines.append(f"parameters identical on all ranks: yes (sha256 {checksum})")
        else:
            differing = ", ".join(f"{r['rank']}: {r['checksum'][:12]}" for r in self.ranks)
            lines.append(f"parameters identical on all ranks: NO ({differing})")
        lines.append(f"wall time: {self.wall_time:.2f} s (launch to teardown)")
        return "\n".join(lines)


def run_demo(
    num_processes: int = 2,
    epochs: int = 3,
    start_method: str = "fork",
    seed: int = 0,
    mixed_precision: str = "no",
    fail_rank: int | None = None,
    timeout: float | None = 300.0,
    quiet: bool = False,
) -> DemoSummary:
    """Launch :func:`train` on ``num_processes`` CPU ranks and print a summary per rank.

    Raises what :func:`~nb_dist.notebook_launcher` raises (``WorkerFailedError`` when a rank
    fails, ``ValueError`` for a bad argument). ``quiet=True`` hides the ranks' output and the
    summary (the returned :class:`DemoSummary` still has everything).
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be a positive whole number (1, 2, 3, ...).")
    if start_method == "fork":
        # DistributedDataParallel imports torch._dynamo (about 2 s) the first time it is built.
        # Importing it here once lets every forked rank inherit it, instead of each rank
        # importing it again, all at once, on the same cores.
        import torch._dynamo  # noqa: F401
    result = notebook_launcher(
        train,
        args=(epochs, seed, fail_rank),
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        start_method=start_method,
        device="cpu",
        timeout=timeout,
        output="none" if quiet else "all",
    )
    summary = DemoSummary(
        num_processes=num_processes,
        epochs=epochs,
        start_method=result.start_method,
        mixed_precision=mixed_precision.lower(),
        ranks=list(result),
        params_identical=len({r["checksum"] for r in result}) == 1,
        wall_time=result.wall_time,
    )
    if not quiet:
        print(summary.table(), flush=True)
    return summary
