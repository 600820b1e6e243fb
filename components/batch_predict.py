"""Predictions for a whole table from a running model server (local, or a KServe InferenceService).

The client half of serving: rows go over the Open Inference Protocol v2 in batches, as raw
features (the server applies the training normalisation), and come back as labels (class names
where the training table had them) with their confidence. Columns are matched by name against the
features the model was trained on, so a table with its columns in another order, or with extra
columns (an id, the label), is predicted correctly; a table missing one is refused with the names,
never predicted on shifted inputs. The names come from the model's ``metadata.json`` when its
directory is known (a local server's record has it), else from the server's own model metadata
(``GET /v2/models/{name}``: a KServe InferenceService reached by URL).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, NoReturn

import numpy as np

from .errors import DatasetError, RequestRefused, ServingError
from .exported_model import lacking, probability_columns
from .prepare_data import is_number_dtype
from .serve import infer, model_inputs, server_status, unknown_server
from .storage import Storage

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Target:
    """Where to send rows: the server's base URL, the model's name there, and the model
    directory (for its feature names), when known."""

    url: str
    name: str
    model_uri: str | None = None
    host_header: str | None = None
    """The InferenceService's host, when ``url`` is the ingress gateway's address."""
    token: str | None = field(default=None, repr=False)
    """A bearer token for a gateway that authenticates (never shown)."""
    pid: int | None = None
    """A local server's process, from its record: one that another serves in its place (a run that
    redeployed the name) is said to be replaced, not unreachable."""


def server_base_url(url: str, name: str) -> str:
    """The server's base URL from ``url``, which may be a model's endpoint as `serve list` and the
    run summary print it (``.../v2/models/NAME/infer``): the requests add that path, and a
    doubled one was a bare 404. Pure."""
    import re

    m = re.fullmatch(r"(.*?)/v2/models/([^/]+)(?:/versions/[^/]+)?(?:/(?:infer|ready))?/?", url)
    if m is None:
        return url.rstrip("/")
    if m.group(2) != name:
        raise ServingError(f"--url {url!r} is the endpoint of the model {m.group(2)!r}, not of {name!r}",
                           f"give the model's name as NAME ({m.group(2)!r}), or the server's base URL {m.group(1)!r}")
    return m.group(1)


def resolve_target(name: str, url: str | None = None, model_uri: str | None = None,
                   host_header: str | None = None, token: str | None = None) -> Target:
    """A local server by name (its record holds URL and model), or any server by ``url``."""
    if url:
        return Target(server_base_url(url, name), name, model_uri, host_header, token)
    if host_header:
        raise ServingError("--host-header goes with --url (the ingress gateway's address)",
                           "a local server is reached by its name alone")
    info = server_status(name)
    if info is None or info.get("unreadable") or not info.get("url"):
        raise ServingError(unknown_server(name),
                           f"`kfp-pytorch serve start {name} --model-uri models:/{name}@champion` serves a registered "
                           f"model here; `kfp-pytorch serve list` shows the local servers; for a KServe "
                           "InferenceService pass --url (its status.url) and the model's name")
    if not info["alive"]:  # told before the table is read, and by what starts it again
        raise ServingError(f"the local model server {name!r} is down (its process {info.get('pid')} is gone: a reboot, "
                           "a crash or a kill)", f"`kfp-pytorch serve start {name}` starts it again with its model")
    return Target(info["url"], name, model_uri or info.get("model_uri"), pid=info.get("pid"))


def model_features(model_uri: str, storage: Storage | None = None) -> dict:
    """The model's metadata (features, class names) from its directory, or from a registered
    version (``models:/NAME/VERSION``, ``models:/NAME@ALIAS``: downloaded once, as ``serve start``
    does, from the registry MLFLOW_TRACKING_URI names, else the embedded one)."""
    from .predictor import read_model_metadata

    if model_uri.startswith("models:"):
        from .tracking import Tracker

        model_uri = str(Tracker(None, experiment=None).fetch_model(model_uri)["model_dir"])
    return read_model_metadata(model_uri, storage or Storage())


def feature_matrix(table, features: list[str] | None, label_column: str, source: str) -> tuple[np.ndarray, list]:
    """The rows as the model reads them (raw features in training order) and the true labels
    (empty when the table has no label column). Pure: no I/O."""
    import pandas as pd

    if features is not None:
        if missing := lacking(features, set(table.columns)):
            raise DatasetError(f"{source} lacks {missing}",
                               "send a table with the training table's feature columns (other columns are ignored)")
        cols = list(features)
    else:  # no metadata: every column but the label, in the table's order
        cols = [c for c in table.columns if c != label_column]
    if table.empty:
        raise DatasetError(f"{source} has no rows", "send a table with at least one row")
    named = table.columns[table.columns.duplicated()]
    if twice := [c for c in dict.fromkeys([*cols, label_column]) if c in named]:  # which would the model read?
        raise DatasetError(f"{source} has {'columns' if len(twice) > 1 else 'a column'} named twice: "
                           f"{', '.join(map(repr, twice))}", "give each column a name of its own")
    # numbers as training takes them, told by the columns' types (a Series a column costs 25 us:
    # 4 s for the 150k columns of a 224x224 RGB image's pixels)
    dtypes = dict(zip(table.columns, table.dtypes))
    numbers = {dtype: is_number_dtype(dtype) for dtype in {dtypes[c] for c in cols}}
    if bad := [c for c in cols if not numbers[dtypes[c]]]:
        col = table[bad[0]]
        if pd.api.types.is_complex_dtype(col):  # numbers, but no real ones: the first is shown
            odd = []
        else:  # the first cell that is no number
            odd = np.flatnonzero((pd.to_numeric(col.astype(object), errors="coerce").isna() & col.notna()).to_numpy())
        row = int(odd[0]) if len(odd) else 0
        raise DatasetError(f"{source}: feature column {bad[0]!r} is not numeric (row {row + 1}: {col.iloc[row]!r})"
                           + (f"; so are {bad[1:8]}" if len(bad) > 1 else ""),
                           "features are sent as numbers; fix or drop those values")
    with np.errstate(over="ignore", invalid="ignore"):  # past FP32's range: inf, found below
        if len(table) < len(cols):  # wide and short: one copy of the few rows costs less than a Series a column
            x = table[cols].to_numpy(dtype=np.float32, na_value=np.nan)  # a nullable column's gaps: NaN
        else:
            # Each column is cast straight into its place: ``table[cols].to_numpy()`` would first copy
            # every feature as it is (float64: 256 MB for 500k x 64), then cast that copy. Filled a
            # column at a time, the rows are in column order (their transpose); requests take their
            # rows contiguous.
            x = np.empty((len(cols), len(table)), dtype=np.float32)
            for i, c in enumerate(cols):
                col = table[c]
                x[i] = (col.to_numpy(dtype=np.float32, na_value=np.nan)  # as above
                        if isinstance(col.dtype, pd.api.extensions.ExtensionDtype) else col.to_numpy())
            x = x.T
    if not np.isfinite(x).all():  # an empty cell, "n/a" (NaN to pandas) or a number beyond FP32: by row and column
        rows, where = np.nonzero(~np.isfinite(x))
        cells = ", ".join(f"row {r + 1} {cols[c]!r}" for r, c in zip(rows[:5], where[:5]))
        raise DatasetError(f"{source}: {len(rows)} feature value(s) are empty, NaN or infinite: {cells}"
                           + (" ..." if len(rows) > 5 else ""), "fill or drop those rows; the model needs every feature")
    return x, table[label_column].tolist() if label_column in table.columns else []


BATCH_BYTES = 4 << 20
"""What a request carries by default: about 4 MiB of FP32 features."""
MAX_BATCH_ROWS = 4096
"""... in at most this many rows. Through the local server (binary tensors, 64 features) 256-row
batches gave 46k rows/s, 1024 117k and 4096 196k: past that the request's fixed cost is paid off."""


def default_batch_rows(features: int) -> int:
    """Rows per request when none is given: :data:`BATCH_BYTES` of features, at most
    :data:`MAX_BATCH_ROWS` rows, at least one (4096 for 64 features, 1337 for 784, 6 for a
    224x224 RGB image)."""
    return max(1, min(MAX_BATCH_ROWS, BATCH_BYTES // (4 * max(1, features))))


def predict_rows(target: Target, x: np.ndarray, batch_size: int | None = None,
                 on_batch: Callable[[int], None] | None = None, binary: bool = True) -> dict:
    """Send ``x`` in batches (``batch_size`` rows; None: :func:`default_batch_rows`); returns
    ``label`` (ids), ``class`` (names, or None), ``confidence`` and ``probabilities`` (``[n,
    classes]``). ``binary``: the rows, and the answers, as raw tensors (see
    :func:`~.serve.infer`), JSON from the first batch a server refuses that way; False: JSON."""
    if batch_size is None:
        batch_size = default_batch_rows(x.shape[1] if x.ndim == 2 else 1)
    if batch_size < 1:
        raise ServingError(f"batch size must be >= 1, got {batch_size}")
    labels, names, conf, all_probs = [], [], [], []

    def send(rows: np.ndarray) -> dict:
        return infer(target.url, target.name, rows if binary else rows.tolist(), timeout=60.0,
                     host_header=target.host_header, token=target.token, binary=binary)

    for start in range(0, len(x), batch_size):
        rows = x[start:start + batch_size]
        try:
            try:
                resp = send(rows)
            except RequestRefused:
                if not (binary and start == 0):
                    raise
                # a server that answered with an error: one without the binary tensor extension gets
                # the same rows as JSON numbers, and every batch after (a refusal of the rows themselves
                # is then JSON's to say). One that could not be reached, or timed out, is not asked twice.
                binary = False
                resp = send(rows)
        except ServingError as e:
            if start and (now := _replaced(target)):
                raise ServingError(f"rows {start + 1}-{start + len(rows)}: the local model server {target.name!r} was "
                                   f"replaced while the table was predicted ({now}); the rows before came from the "
                                   "model it served before, so nothing is written",
                                   "run serve predict again: every row from one model") from e
            raise ServingError(f"rows {start + 1}-{start + len(rows)}: {e.message}", e.hint) from e
        version = resp.get("model_version")  # our servers' content fingerprint of the model
        if start == 0:
            first = version
        elif version != first and None not in (version, first):
            _another_model(target, start, len(rows), first, version)
        out = {o["name"]: o for o in resp.get("outputs", [])}
        if "label" not in out or "probabilities" not in out:
            raise ServingError(f"the server at {target.url} answered without 'label' and 'probabilities' outputs "
                               f"(got {sorted(out)})", "is it a kfp-pytorch model server? check the URL and name")
        k = len(rows)
        labels.append(np.asarray(out["label"]["data"], dtype=np.int64))
        probs = np.asarray(out["probabilities"]["data"], dtype=np.float64).reshape(k, -1)
        conf.append(probs.max(axis=1))
        all_probs.append(probs)
        if "class" in out:
            names.extend(out["class"]["data"])
        if on_batch is not None:
            on_batch(k)
    return {"label": np.concatenate(labels).tolist() if labels else [], "class": names or None,
            "confidence": np.concatenate(conf).tolist() if conf else [],
            "probabilities": np.concatenate(all_probs) if all_probs else np.zeros((0, 0))}


def _another_model(target: Target, start: int, k: int, first: str, now: str) -> NoReturn:
    """Batches answered by two models: one table's predictions are never a mix of them."""
    rows = f"rows {start + 1}-{start + k}"
    if target.pid is not None:  # a local server: the endpoint kept its URL through a redeploy
        where = _replaced(target) or f"model version {now}"
        raise ServingError(f"{rows}: the local model server {target.name!r} was replaced while the table was "
                           f"predicted ({where}); the rows before came from the model it served before, so "
                           "nothing is written", "run serve predict again: every row from one model")
    raise ServingError(f"{rows}: the server at {target.url} answered with another model (model_version {now}) than "
                       f"the rows before ({first}): it was redeployed, or a canary splits its traffic between two "
                       "models, while the table was predicted; nothing is written",
                       "run serve predict again once one model serves (a KServe canary: once it is promoted, or "
                       "rolled back)")


def _replaced(target: Target) -> str | None:
    """What serves a local target's name now, when another process than the one the predictions
    began with: a redeploy stops the old server once the new one is up."""
    if target.pid is None:
        return None
    info = server_status(target.name)
    if info is None or info.get("pid") in (None, target.pid):
        return None
    return f"now pid {info['pid']} at {info.get('url')}, model {info.get('model_uri')}"


class Predictions(NamedTuple):
    frame: "pd.DataFrame"
    """row, prediction, confidence, with ``probabilities`` one ``p_<class>`` column per class,
    and the row's label when the table has one."""
    accuracy: float | None
    """Of the labelled rows, the share predicted right; None without labels, or when no label is
    one of the model's classes (the table names them otherwise: ids for a model of names, say)."""
    label_column: str
    """The column compared with the predictions: the one given, or the model's own."""

    # three fields, as notebooks unpack them (preds, accuracy, label = ...); the rest rides on the frame
    @property
    def unknown_labels(self) -> dict[str, int]:
        """Labels of the table that are none of the model's classes, with their rows: those rows
        can never be predicted right (empty where the model's classes are not known: a server by URL)."""
        return self.frame.attrs.get("unknown_labels", {})

    @property
    def model_classes(self) -> list[str] | None:
        """The model's classes as predictions are written (names, else ids); None where not known."""
        return self.frame.attrs.get("model_classes")


def predict_table(target: Target, table, label_column: str | None = None, source: str = "the table",
                  batch_size: int | None = None, on_batch: Callable[[int], None] | None = None,
                  storage: Storage | None = None, probabilities: bool = False, binary: bool = True) -> Predictions:
    """Predict every row of ``table``.

    Accuracy is given when the table has the label column: a predicted class name (or id, for a
    model trained on numeric labels) against the row's label. ``label_column`` None: the column
    the model was trained to predict (its metadata's), else ``label``. ``binary``: as
    :func:`predict_rows` has it (False: JSON requests and answers)."""
    import pandas as pd

    if target.model_uri:
        meta = model_features(target.model_uri, storage)
    else:  # a server reached by URL: the feature names it declares (none: the table's columns in order)
        meta = {"features": model_inputs(target.url, target.name, host_header=target.host_header,
                                         token=target.token)}
    label_column = label_column or meta.get("label_column") or "label"
    x, truth = feature_matrix(table, meta.get("features"), label_column, source)
    res = predict_rows(target, x, batch_size, on_batch, binary=binary)
    shown = res["class"] if res["class"] is not None else res["label"]
    out = pd.DataFrame({"row": np.arange(1, len(x) + 1), "prediction": shown,
                        "confidence": np.round(res["confidence"], 4)})
    if probabilities:  # a column per class, by its name where the model's metadata has one (p_setosa), else id (p_3)
        probs = res["probabilities"]
        for c, column in enumerate(probability_columns(probs.shape[1], meta.get("class_names"))):
            out[column] = np.round(probs[:, c], 6)
    accuracy, unknown, classes = None, {}, model_classes(meta, res)
    if truth:
        # each distinct label is read once (a table has few: its classes), then taken row by row
        codes, distinct = pd.factorize(pd.Series(truth, dtype=object), use_na_sentinel=False)
        texts = [label_text(t) for t in distinct]
        labels = np.asarray(texts + [None], dtype=object)[codes]  # the [None]: an object array even of one text
        ids = res["class"] is None and all(t is None or t.lstrip("-").isdigit() for t in texts)
        # the label column as the prediction column is typed: ids as integers (empty cells as <NA>), names as text
        out["label"] = (pd.array([None if t is None else int(t) for t in texts], dtype="Int64").take(codes) if ids
                        else labels.tolist())
        has = labels != None  # noqa: E711 (elementwise: the rows with a label)
        scored = np.asarray(shown, dtype=object)[has].astype(str) == labels[has].astype(str)
        if classes is not None:
            known, per_text = set(classes), Counter()
            for text, n in zip(texts, np.bincount(codes, minlength=len(texts))):
                if text is not None and text not in known and n:
                    per_text[text] += int(n)
            unknown = dict(per_text.most_common())
        # no label a class of the model: the table names the classes otherwise, and 0 would be no score
        accuracy = float(np.mean(scored)) if len(scored) and sum(unknown.values()) < len(scored) else None
    out.attrs.update(unknown_labels=unknown, model_classes=classes)
    return Predictions(out, accuracy, label_column)


def model_classes(meta: dict, res: dict) -> list[str] | None:
    """The classes the model predicts, as :func:`predict_table` writes them: its class names, or
    its class ids (those it was trained on where its metadata is known, else one per output);
    None for a server by URL that answers with names, whose other names are not known."""
    if meta.get("class_names"):
        return [str(c) for c in meta["class_names"]]
    if res["class"] is not None:
        return None
    if meta.get("classes"):
        return [str(c) for c in meta["classes"]]
    return [str(c) for c in range(res["probabilities"].shape[1])] if len(res["probabilities"]) else None


def table_bytes(frame: "pd.DataFrame", name: str) -> tuple[bytes, str]:
    """``frame`` as the file ``name`` asks for, by its suffix: Parquet (``.parquet``, ``.pq``),
    JSON Lines (``.jsonl``, ``.ndjson``), JSON records (``.json``), Feather (``.feather``,
    ``.arrow``), else CSV, the formats a table is read in; and its content type. Pure."""
    import io
    from pathlib import PurePosixPath

    from .prepare_data import FEATHER_SUFFIXES, JSON_LINES_SUFFIXES, PARQUET_SUFFIXES

    suffix = PurePosixPath(name).suffix.lower()
    buf = io.BytesIO()
    if suffix in PARQUET_SUFFIXES:
        frame.to_parquet(buf, index=False)
        return buf.getvalue(), "application/vnd.apache.parquet"
    if suffix in FEATHER_SUFFIXES:
        frame.reset_index(drop=True).to_feather(buf)
        return buf.getvalue(), "application/vnd.apache.arrow.file"
    if suffix in (*JSON_LINES_SUFFIXES, ".json"):
        lines = suffix != ".json"
        text = frame.to_json(orient="records", lines=lines) + ("\n" if lines else "")
        return text.encode(), "application/x-ndjson" if lines else "application/json"
    return frame.to_csv(index=False).encode(), "text/csv"


def label_text(value) -> str | None:
    """A table's label as a prediction is written, to compare them: a class id read as a float is
    an integer (pandas reads an id column with an empty cell as floats: 3.0 is class 3); an empty
    cell is None, a row without a label, which no score counts."""
    if value is None or (isinstance(value, (float, np.floating)) and np.isnan(value)):
        return None
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    text = str(value)
    return text if text.strip() else None


def weakest_label(frame: "pd.DataFrame") -> dict | None:
    """:func:`~.evaluate.weakest_class` of a :class:`Predictions` frame with a ``label`` column: the
    true class whose rows were predicted worst, and what they were taken for. Labels and predictions
    are compared as text, as the accuracy is; rows without a label are left out. None without
    labels, or when every class was found."""
    if "label" not in frame:
        return None
    import pandas as pd

    from .evaluate import weakest_class

    labelled = frame[frame["label"].notna()]
    truth, pred = labelled["label"].astype(str), labelled["prediction"].astype(str)
    names = sorted(set(pd.unique(truth)) | set(pd.unique(pred)),
                   key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    # counted by class index: scikit-learn's confusion_matrix sorted the 500k labels as strings (3 s)
    index, k = {n: i for i, n in enumerate(names)}, len(names)
    cells = truth.map(index).to_numpy(np.int64) * k + pred.map(index).to_numpy(np.int64)
    return weakest_class(names, np.bincount(cells, minlength=k * k).reshape(k, k).tolist() if names else [])
