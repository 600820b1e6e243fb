"""Model factories used by tests as ``factories:NAME`` (tests/ is on PYTHONPATH of workers)."""
import json
import os
import time
from pathlib import Path

from torch import nn

PET_KEYS = ("TMPDIR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NNODES",
            "PET_NPROC_PER_NODE", "PET_NODE_RANK", "OMP_NUM_THREADS")


def tiny(input_dim, num_classes):
    return nn.Sequential(nn.Linear(input_dim, 16), nn.ReLU(), nn.Linear(16, num_classes))


def env_probe(input_dim, num_classes, image_shape=None):
    """Records the launcher environment each worker sees."""
    out = Path(os.environ["KFP_PYTORCH_TEST_PROBE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps({k: os.environ.get(k) for k in PET_KEYS}))
    return tiny(input_dim, num_classes)


class _Slow(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training:
            time.sleep(0.04)  # makes an epoch last long enough to kill a worker in the middle of it
        return self.inner(x)


def slow(input_dim, num_classes):
    return _Slow(tiny(input_dim, num_classes))


def broken(input_dim, num_classes):
    raise RuntimeError("this factory always fails")


def three_outputs(input_dim, num_classes):
    return nn.Linear(input_dim, 3)


def wrong_width(input_dim, num_classes):
    return nn.Linear(input_dim + 1, num_classes)


def with_batchnorm(input_dim, num_classes):
    return nn.Sequential(nn.Linear(input_dim, 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes))
