"""A trained model directory (``model.pt2`` + ``metadata.json``) loaded for inference.

This module needs numpy and torch only, never the rest of kfp-pytorch: the MLflow pyfunc ships it
as code (``code_paths``), so a registered model loads and predicts where kfp-pytorch is not
installed (``mlflow models serve``, a notebook with only MLflow). Raw feature rows go in; the
normalisation recorded by prepare_data is applied here, so clients send raw features.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import re
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
        meta_bytes = (root / "metadata.json").read_bytes()
        self.meta = json.loads(meta_bytes)
        program_bytes = (root / self.meta.get("program", "model.pt2")).read_bytes()
        program = torch.export.load(io.BytesIO(program_bytes))
        self.fingerprint = hashlib.sha256(hashlib.sha256(meta_bytes).digest() + program_bytes).hexdigest()[:12]
        """The model's identity, by content: a server answers with it as the response's
        ``model_version``, so a client sees when another model answers (a redeploy, a canary)."""
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
        shape = self.meta.get("image_shape")
        self.image_shapes: list[list[int]] = ([] if not shape else [list(shape), list(shape[1:])] if shape[0] == 1
                                              else [list(shape)])
        """For a model trained on an image's pixels (``pixel_ROW_COL`` columns, in row-major order),
        the shapes a batch of images may come in besides rows: ``[C, H, W]`` each, as PyTorch
        and a KServe image client send them, or ``[H, W]`` for one channel."""
        self._torch = torch

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows``: raw features ``[n, num_features]`` -> (probabilities ``[n, C]``, labels ``[n]``)."""
        x = np.asarray(rows, dtype=np.float32)
        if x.ndim == 1:  # one row; or none (an empty batch, answered with no predictions)
            x = x.reshape(0, self.num_features) if x.size == 0 else x[None, :]
        if x.ndim > 2 and list(x.shape[1:]) in self.image_shapes:  # images: their pixels are the row, in order
            x = x.reshape(len(x), self.num_features)
        if x.ndim != 2 or x.shape[1] != self.num_features:
            images = " or ".join(f"[n, {', '.join(map(str, s))}]" for s in self.image_shapes)
            raise ValueError(f"expected input of shape [n, {self.num_features}]"
                             + (f" (or images, {images})" if images else "") + f", got {list(x.shape)}")
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
    if image := _image_named_otherwise(features, present):
        return f"{said}; {image}"
    known = set(features)
    near = _near_names(missing[:8], [p for p in present if isinstance(p, str) and p not in known])
    if near:
        return said + f"; did you mean {', '.join(f'{h!r} for {m!r}' for m, h in near)}?"
    theirs = sorted((p for p in present if isinstance(p, str)),  # pixel2 before pixel10
                    key=lambda n: [int(d) if d.isdigit() else d for d in re.split(r"(\d+)", n)])
    if len(missing) == len(features) and theirs:  # not one in common: the table of another model, most likely
        return (f"{said}; the table has none of them (its columns: {theirs[:8]}{' ...' if len(theirs) > 8 else ''}): "
                "is it the table of another model?")
    return said


def _image_named_otherwise(features: list[str], present) -> str | None:
    """What a table's columns are when the model's features are an image's pixels and the table's
    are an image's pixels too, in another naming (``pixel0`` ... ``pixel63`` for the model's
    ``pixel_0_0`` ... ``pixel_7_7``, or numbered from 1 rather than 0) or of another size. Letter by
    letter, ``pixel10`` looks like ``pixel_1_0``: in row-major order it is ``pixel_1_2``, so a
    "did you mean" name by name would be wrong, and the image is named as a whole instead."""
    want = pixel_grid(features)
    if want is None:
        return None
    alike: dict[str, list[str]] = {}  # the table's names by their shape: the pixels are the largest set
    for p in present:
        if isinstance(p, str):
            alike.setdefault(re.sub(r"\d+", "#", p), []).append(p)
    if not alike:
        return None
    names = sorted(max(alike.values(), key=len), key=lambda n: [int(d) for d in re.findall(r"\d+", n)])
    got = pixel_grid(names)
    if got is None:  # (never the model's own names: one of them is missing)
        return None
    (h, w), (gh, gw) = want[1:], got[1:]
    theirs, ours = f"{names[0]} ... {names[-1]}", f"{features[0]} ... {features[-1]}"
    if got == want:
        i = w + 1 if h > 1 else 1  # row 1, column 1: where the two namings part
        return (f"the table's columns {theirs} are the {h}x{w} image's pixels named otherwise (the model's: "
                f"{ours}); rename them in row-major order ({names[i]!r} is the model's {features[i]!r})")
    return (f"the table's columns {theirs} are the pixels of {gh}x{gw} images; the model takes {h}x{w} images "
            f"({ours}): resize the images to {h}x{w}, or train a model on {gh}x{gw} ones")


def _near_names(missing: list[str], others: list[str]) -> list[tuple[str, str]]:
    """``(missing, present)`` pairs where a present name that the model does not know is the missing
    one in another case or spacing, or with a slip of a letter or two and the same numbers (``Age``
    for ``age``, never ``sensor_11`` for ``sensor_10``), so that the error names the rename rather
    than leaving the reader to compare two lists (prepare_data's "did you mean" for a column
    setting; this module may not import it)."""
    import difflib

    def key(name: str) -> str:
        return "".join(name.split()).casefold()

    by_key = {key(o): o for o in reversed(others)}  # the first of names alike wins
    numbers = {k: re.findall(r"\d+", o) for k, o in by_key.items()}
    pairs, used = [], set()
    for m in missing:
        hit = by_key.get(key(m))
        if hit is None:  # a slip of letters keeps the numbers: 'sensor_11' is another column than 'sensor_10'
            same = re.findall(r"\d+", m)
            close = difflib.get_close_matches(key(m), [k for k, o in by_key.items() if o not in used
                                                       and numbers[k] == same], n=1, cutoff=0.8)
            hit = by_key[close[0]] if close else None
        if hit is not None and hit not in used:
            used.add(hit)
            pairs.append((m, hit))
    return pairs


_NUMBERED = re.compile(r"(\D*?)(\d+)")
_GRID = re.compile(r"(\D*?)(\d+)(\D+)(\d+)")


def pixel_grid(names: list[str]) -> list[int] | None:
    """``[1, H, W]`` when the columns are named as one image's pixels in row-major order, else None.

    Two namings are read, as image tables come: numbered pixels (``pixel0`` ... ``pixel783``, or
    from 1 as Fashion-MNIST's CSVs have them, or bare ``0`` ... ``783``) of a square image, and a
    grid of rows and columns (``pixel_0_0`` ... ``pixel_7_7``, ``1x1`` ... ``28x28``), of any
    height and width. One prefix throughout. Anything else is no image: a table of features in
    another naming is not convolved over as if its neighbouring columns were neighbouring pixels."""
    names = [str(n) for n in names]
    if len(names) < 4:
        return None
    numbered = [_NUMBERED.fullmatch(n) for n in names]
    if all(numbered) and len({m.group(1) for m in numbered}) == 1:
        side = math.isqrt(len(names))
        first = int(numbered[0].group(2))
        if side * side == len(names) and first in (0, 1) and \
                [int(m.group(2)) for m in numbered] == list(range(first, first + len(names))):
            return [1, side, side]
        return None
    grid = [_GRID.fullmatch(n) for n in names]
    if not all(grid) or len({(m.group(1), m.group(3)) for m in grid}) != 1:
        return None
    cells = [(int(m.group(2)), int(m.group(4))) for m in grid]
    first = cells[0]
    if first not in ((0, 0), (1, 1)):
        return None
    h, w = cells[-1][0] - first[0] + 1, cells[-1][1] - first[1] + 1
    expected = [(first[0] + r, first[1] + c) for r in range(h) for c in range(w)]
    return [1, h, w] if cells == expected else None


def probability_columns(num_classes: int, class_names: list[str] | None) -> list[str]:
    """The name of each class's probability column: ``p_setosa`` by the class's name where the
    model has names, else ``p_3`` by its id (``serve predict --probabilities`` and the MLflow model's
    ``probabilities`` parameter name them alike)."""
    return [f"p_{class_names[c] if class_names and c < len(class_names) else c}" for c in range(num_classes)]


def names_of(labels: np.ndarray, class_names: list[str] | None) -> list[str] | None:
    """The class names of predicted ids (None when the model has ids only)."""
    return None if class_names is None else [class_names[int(i)] for i in labels]
