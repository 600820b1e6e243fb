"""Baseline of the training benchmark: a hand-written torchrun DDP script, nothing else.

Same shards, model, seed, batch size and steps as kfp-pytorch's train worker; no checkpoints,
no progress bar, no storage layer. Prints one JSON line with its training-loop seconds, in total and per epoch.
"""
import glob
import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(data_dir: str, epochs: int, batch_size: int, lr: float, seed: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = [], []
    for f in sorted(glob.glob(f"{data_dir}/train/*.npz")):
        with np.load(f) as z:
            xs.append(z["x"])
            ys.append(z["y"])
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    meta = json.load(open(f"{data_dir}/metadata.json"))
    torch.manual_seed(seed)
    d = meta["num_features"]
    model = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(128, meta["num_classes"]))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler)
    seconds = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
        seconds.append(time.perf_counter() - t0)
    if rank == 0:
        print("BASELINE " + json.dumps({"train_seconds": sum(seconds), "epoch_seconds": seconds,
                                        "samples": len(x) * epochs}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
