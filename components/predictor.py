"""Framework-neutral inference over a trained model directory (``model.pt2`` + ``metadata.json``).

Used, unchanged, by the KServe predictor (:mod:`.kserve_predictor`), the MLflow pyfunc wrapper
(:mod:`.mlflow_model`) and the in-process baseline of the serving benchmark. Raw feature rows go
in; the normalisation recorded by prepare_data is applied here, so clients send raw features.
"""
from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np

from .errors import ServingError
from .storage import Storage, join, parse_uri


class ModelRunner:
    """Loads a model directory (local path or s3:// URI) once; ``predict`` is thread-safe."""

    def __init__(self, model_uri: str, storage: Storage | None = None):
        import torch

        self.model_uri = model_uri
        storage = storage or Storage()
        loc = parse_uri(model_uri)
        if loc.is_s3:
            self._tmp = tempfile.TemporaryDirectory(prefix="kfp-pytorch-model-")
            storage.download_dir(model_uri, self._tmp.name)
            root = Path(self._tmp.name)
        else:
            root = loc.path
        try:
            self.meta = json.loads((root / "metadata.json").read_text())
            program = torch.export.load(io.BytesIO((root / self.meta.get("program", "model.pt2")).read_bytes()))
        except FileNotFoundError as e:
            raise ServingError(f"no trained model at {model_uri} ({Path(e.filename).name} missing)",
                               "point model_uri at the model/ directory written by train") from e
        self.module = program.module()
        self.num_features = int(self.meta["input_shape"][0])
        norm = self.meta["normalization"]
        self.mean = np.asarray(norm["mean"], dtype=np.float32)
        self.std = np.asarray(norm["std"], dtype=np.float32)
        self.classes = list(self.meta["classes"])
        self.class_names: list[str] | None = self.meta.get("class_names")
        """Names by class id when the model was trained on a text label column."""
        self._torch = torch

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows``: raw features ``[n, num_features]`` -> (probabilities ``[n, C]``, labels ``[n]``)."""
        x = np.asarray(rows, dtype=np.float32)
        if x.ndim == 1:  # one row; or none (an empty batch, answered with no predictions)
            x = x.reshape(0, self.num_features) if x.size == 0 else x[None, :]
        if x.ndim != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"expected input of shape [n, {self.num_features}], got {list(x.shape)}")
        if not np.isfinite(x).all():  # a NaN row would come back as class 0 with NaN probabilities
            bad = sorted({int(i) for i in np.nonzero(~np.isfinite(x).all(axis=1))[0]})
            raise ValueError(f"rows {bad[:10]}{' ...' if len(bad) > 10 else ''} hold NaN or infinite features "
                             "(or values beyond FP32's range); send finite raw features")
        x = (x - self.mean) / self.std
        with self._torch.inference_mode():
            logits = self.module(self._torch.from_numpy(x))
            probs = self._torch.softmax(logits, dim=1).numpy()
        return probs, probs.argmax(1).astype(np.int64)


def names_of(labels: np.ndarray, class_names: list[str] | None) -> list[str] | None:
    """The class names of predicted ids (None when the model has ids only)."""
    return None if class_names is None else [class_names[int(i)] for i in labels]


def model_dir_uri(uri: str) -> str:
    """Accept the train output root or its ``model/`` directory."""
    return uri if uri.rstrip("/").endswith("model") else join(uri, "model")
