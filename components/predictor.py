"""Framework-neutral inference over a trained model directory (``model.pt2`` + ``metadata.json``),
from a local path or S3.

Used, unchanged, by the KServe predictor (:mod:`.kserve_predictor`) and the in-process baseline of
the serving benchmark; the MLflow pyfunc (:mod:`.mlflow_model`) runs the same
:class:`~.exported_model.ExportedModel`.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import ServingError
from .exported_model import ExportedModel, names_of  # noqa: F401  (names_of: the servers' import)
from .storage import Storage, join, parse_uri


class ModelRunner(ExportedModel):
    """An :class:`ExportedModel` loaded once from a local path or an s3:// URI."""

    def __init__(self, model_uri: str, storage: Storage | None = None):
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
            super().__init__(root)
        except FileNotFoundError as e:
            raise ServingError(f"no trained model at {model_uri} ({Path(e.filename).name} missing)",
                               "point model_uri at the model/ directory written by train") from e


def model_dir_uri(uri: str) -> str:
    """Accept the train output root or its ``model/`` directory."""
    return uri if uri.rstrip("/").endswith("model") else join(uri, "model")
