"""Regenerate the README's figures from real runs: ``python docs/make_figures.py``.

Each figure is a view's static ``.figure()``; the gradient view and the loss-scale view are
fed by a real 2-rank launch on CPU (gloo), the others by the views' own models.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nb_dist

OUT = Path(__file__).resolve().parent / "figures"


def ddp_gradients() -> None:
    """Tiny DDP run: report gradients under no_sync (local) and after the all-reduce."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # same initial weights on every rank (DDP would broadcast anyway)
    model = torch.nn.Linear(6, 4)
    ddp = DDP(model)
    data = torch.Generator().manual_seed(100 + dist.get_rank())  # a different shard per rank
    for step in range(3):
        x, y = torch.randn(16, 6, generator=data), torch.randn(16, 4, generator=data)
        with ddp.no_sync():
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        nb_dist.report("grad/local", model.weight.grad, step)
        model.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        nb_dist.report("grad/synced", model.weight.grad, step)
        model.zero_grad()


def grad_scaler_trace() -> list[tuple[int, float, bool]]:
    """A real fp16-style GradScaler run on CPU with an overflow injected every 40 steps."""
    from nb_dist.views import scaler_step

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=25)
    trace = []
    for step in range(150):
        x = torch.randn(32, 8)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step % 40 == 39:
            model.weight.grad[0, 0] = float("inf")  # what an fp16 overflow looks like
        trace.append((step, *scaler_step(scaler, opt)))
        opt.zero_grad()
    return trace


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = nb_dist.notebook_launcher(ddp_gradients, num_processes=2, output="none")
    figures = {
        "shard_explorer.png": nb_dist.ShardExplorer(
            dataset_len=10, world_size=3, batch_size=2, shuffle=True, seed=0
        ).figure(),
        "allreduce_stepper.png": nb_dist.AllReduceStepper().figure(step=3),
        "gradient_view.png": nb_dist.GradientView(result.reports).figure(),
        "precision_explorer.png": nb_dist.PrecisionExplorer(65000.0, 2.0).figure(),
        "loss_scale.png": nb_dist.LossScaleView(grad_scaler_trace()).figure(),
    }
    for name, fig in figures.items():
        fig.savefig(OUT / name, dpi=90, bbox_inches="tight")
        print("wrote", OUT / name, file=sys.stderr)


if __name__ == "__main__":
    main()
