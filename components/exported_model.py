"""A trained model directory (``model.pt2`` + ``metadata.json``) loaded for inference.

This module needs numpy and torch only, never the rest of kfp-pytorch: the MLflow pyfunc ships it
as code (``code_paths``), so a registered model loads and predicts where kfp-pytorch is not
installed (``mlflow models serve``, a notebook with only MLflow). Raw feature rows go in; the
normalisation recorded by prepare_data is applied here, so clients send raw features.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

EXPORT_MAX_BATCH = 65536
"""The largest batch the exported program takes (train_worker.export_program's dynamic dimension)."""
CHUNK_ROWS = 8192
"""Rows per forward pass when serving a request: larger ones are split."""


class ExportedModel:
    """The exported program of ``root`` and its metadata; ``predict`` is thread-safe.

    A missing ``metadata.json`` or program raises FileNotFoundError; bad rows raise ValueError.
    """

    def __init__(self, root: str | Path):
        import torch

        root = Path(root)
        self.meta = json.loads((root / "metadata.json").read_text())
        program = torch.export.load(io.BytesIO((root / self.meta.get("program", "model.pt2")).read_bytes()))
        self.module = program.module()
        self.num_features = int(self.meta["input_shape"][0])
        norm = self.meta["normalization"]
        self.mean = np.asarray(norm["mean"], dtype=np.float32)
        self.std = np.asarray(norm["std"], dtype=np.float32)
        self.classes = list(self.meta["classes"])
        self.num_classes = int(self.meta.get("num_classes", len(self.classes)))
        """The width of the probabilities the program answers with."""
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
        if not len(x):
            probs = np.zeros((0, self.num_classes), dtype=np.float32)
            return probs, np.zeros(0, dtype=np.int64)
        with self._torch.inference_mode():
            probs = self._torch.softmax(logits_in_chunks(self.module, self._torch.from_numpy(x)), dim=1).numpy()
        return probs, probs.argmax(1).astype(np.int64)


def logits_in_chunks(module, x):
    """``module(x)`` over chunks of :data:`CHUNK_ROWS` rows: the program is exported for batches of
    up to :data:`EXPORT_MAX_BATCH` rows, and a larger one failed its shape guard (an AssertionError:
    a 500 at the server, a crash in evaluation). ``x``: a non-empty tensor."""
    import torch

    return torch.cat([module(x[i:i + CHUNK_ROWS]) for i in range(0, len(x), CHUNK_ROWS)])


def lacking(features: list[str], present) -> str | None:
    """``N of the model's M feature columns: [...]`` for the features not in ``present``, in
    training order (the first 8 named); None when none is missing. One wording for every reader of
    a table by column name: the model servers, the MLflow model, ``serve predict``."""
    missing = [f for f in features if f not in present]
    if not missing:
        return None
    said = (f"{len(missing)} of the model's {len(features)} feature columns: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    known = set(features)
    near = _near_names(missing[:8], [p for p in present if isinstance(p, str) and p not in known])
    return said + (f"; did you mean {', '.join(f'{h!r} for {m!r}' for m, h in near)}?" if near else "")


def _near_names(missing: list[str], others: list[str]) -> list[tuple[str, str]]:
    """``(missing, present)`` pairs where a present name that the model does not know is the missing
    one in another case or spacing, or with a slip of a letter or two (``Age`` for ``age``), so that
    the error names the rename rather than leaving the reader to compare two lists (prepare_data's
    "did you mean" for a column setting; this module may not import it)."""
    import difflib

    def key(name: str) -> str:
        return "".join(name.split()).casefold()

    by_key = {key(o): o for o in reversed(others)}  # the first of names alike wins
    pairs, used = [], set()
    for m in missing:
        hit = by_key.get(key(m))
        if hit is None:
            close = difflib.get_close_matches(key(m), [k for k, o in by_key.items() if o not in used], n=1, cutoff=0.8)
            hit = by_key[close[0]] if close else None
        if hit is not None and hit not in used:
            used.add(hit)
            pairs.append((m, hit))
    return pairs


def probability_columns(num_classes: int, class_names: list[str] | None) -> list[str]:
    """The name of each class's probability column: ``p_setosa`` by the class's name where the
    model has names, else ``p_3`` by its id (``serve predict --probabilities`` and the MLflow model's
    ``probabilities`` parameter name them alike)."""
    return [f"p_{class_names[c] if class_names and c < len(class_names) else c}" for c in range(num_classes)]


def names_of(labels: np.ndarray, class_names: list[str] | None) -> list[str] | None:
    """The class names of predicted ids (None when the model has ids only)."""
    return None if class_names is None else [class_names[int(i)] for i in labels]
