"""The shape of the PyTorch DDP tutorial series' torchrun script (`multigpu_torchrun.py`),
rewritten for CPU ranks (gloo): train, save a snapshot every epoch, resume from it when run
again. Run with torchrun, `nb-dist run`, `%torchrun` or `nb_dist.run_script`.

--crash-rank K --crash-marker PATH makes rank K crash once in epoch 1 (the marker file says it
crashed already), as a test of restarts.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, data, optimizer, save_every, snapshot_path, crash):
        self.rank = int(os.environ["RANK"])
        self.model, self.data, self.optimizer = model, data, optimizer
        self.save_every, self.snapshot_path, self.crash = save_every, snapshot_path, crash
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print(f"Loading snapshot {snapshot_path}")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path):
        snapshot = torch.load(path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.data.sampler.set_epoch(epoch)
        steps = 0
        for source, targets in self.data:
            self._run_batch(source, targets)
            steps += 1
        size = self.data.batch_size
        print(f"[GPU{self.rank}] Epoch {epoch} | Batchsize: {size} | Steps: {steps}")
        crash_rank, marker = self.crash
        if epoch == 1 and self.rank == crash_rank and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"rank {self.rank} crashed in epoch {epoch}")

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            dist.barrier()  # the next epoch (or a resume) sees the snapshot


def main(args):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    crash = (args.crash_rank, args.crash_marker)
    trainer = Trainer(model, loader, optimizer, args.save_every, args.snapshot_path, crash)
    trainer.train(args.total_epochs)
    checksum = sum(p.double().sum().item() for p in trainer.model.parameters())
    print(f"rank {dist.get_rank()} checksum {checksum:.10f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-marker", default="")
    main(parser.parse_args())
