"""Where the embedded (one-machine) default keeps its state.

``KFP_PYTORCH_HOME`` (default ``~/.kfp-pytorch``) holds the embedded MLflow store, kfp.local's
pipeline root and the pid files of local model servers.
"""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    p = Path(os.environ.get("KFP_PYTORCH_HOME", "~/.kfp-pytorch")).expanduser().resolve()
    p.mkdir(parents=True, exist_ok=True)
    return p
