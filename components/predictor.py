"""Framework-neutral inference over a trained model directory (``model.pt2`` + ``metadata.json``),
from a local path or S3.

Used, unchanged, by the KServe predictor (:mod:`.kserve_predictor`) and the in-process baseline of
the serving benchmark; the MLflow pyfunc (:mod:`.mlflow_model`) runs the same
:class:`~.exported_model.ExportedModel`.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .errors import ModelNotFound, StorageNotFound
from .exported_model import ExportedModel, names_of  # noqa: F401  (names_of: the servers' import)
from .storage import Storage, join, parse_uri

MODEL_HINT = "point model_uri at the model/ directory written by train (train_op's model output)"
IS_A_FILE = "it is a file; a trained model is a folder: model.pt2 and metadata.json"


def read_model_metadata(model_uri: str, storage: Storage | None = None) -> dict:
    """A trained model directory's ``metadata.json``; :class:`ModelNotFound` that says what is
    there instead (nothing, a file, a prepared dataset), before anything loads or starts."""
    storage = storage or Storage()
    try:
        meta = json.loads(storage.read_bytes(join(model_uri, "metadata.json")))
    except StorageNotFound as e:
        if storage.stat(model_uri) is not None:
            there = IS_A_FILE
        elif storage.exists(join(model_uri, "model", "metadata.json")):  # train's output_uri, given for its model/
            there = f"it is train's output folder: its model is {join(model_uri, 'model')}"
        else:
            there = "metadata.json missing"
        raise ModelNotFound(f"no trained model at {model_uri} ({there})", MODEL_HINT) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelNotFound(f"no trained model at {model_uri} (its metadata.json is not readable JSON: {e})",
                            MODEL_HINT) from e
    if not isinstance(meta, dict) or "shards" in meta:  # prepare_data's metadata: the dataset, not the model
        raise ModelNotFound(f"no trained model at {model_uri} (it is a prepared dataset)", MODEL_HINT)
    return meta


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
            raise ModelNotFound(f"no trained model at {model_uri} ({Path(e.filename).name} missing)", MODEL_HINT) from e
        except NotADirectoryError as e:  # a file given for the folder
            raise ModelNotFound(f"no trained model at {model_uri} ({IS_A_FILE})", MODEL_HINT) from e

