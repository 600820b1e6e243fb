"""``evaluate``: test-set metrics, confusion matrix, an HTML report, and a pass/fail gate.

The model evaluated is the exported program (``model.pt2``) that the predictor serves, not the
training-time module, so the gate judges exactly what will be deployed.
"""

import base64
import html
import io
import json
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, DatasetError, KfpPytorchError, ModelNotFound
from .exported_model import logits_in_chunks
from .prepare_data import duplicates_note, load_split, read_metadata
from .storage import Storage, join


GATE_METRICS = ("accuracy", "macro_f1", "min_recall")
"""The test metrics a gate may read: macro F1 weighs every class the same, so a model that never
predicts a rare class does not pass on the common ones' accuracy; min_recall (the worst class's
recall) passes only a model that finds at least that share of every class's test rows."""


@dataclass(frozen=True)
class EvaluateSpec:
    dataset_uri: str
    model_uri: str
    """The ``model/`` directory written by train (holds model.pt2 and metadata.json)."""
    threshold: float = 0.9
    """Minimum test ``metric`` for the gate to pass."""
    metric: str = "accuracy"
    """Gate metric: one of :data:`GATE_METRICS`."""

    def validate(self) -> None:
        problems = []
        if not 0 <= self.threshold <= 1:
            problems.append(f"threshold: must be in [0, 1], got {self.threshold}")
        if self.metric not in GATE_METRICS:
            problems.append(f"metric: must be one of {', '.join(GATE_METRICS)}, got {self.metric!r}")
        if problems:
            raise ConfigError(problems, title="invalid evaluate settings")


def load_program(model_uri: str, storage: Storage | None = None):
    """Load the exported program as a callable module, plus its metadata."""
    import torch

    from .predictor import read_model_metadata

    storage = storage or Storage()
    meta = read_model_metadata(model_uri, storage)
    program = torch.export.load(io.BytesIO(storage.read_bytes(join(model_uri, meta.get("program", "model.pt2")))))
    return program.module(), meta


def to_model_scale(x: np.ndarray, data_meta: dict, model_meta: dict, spec: EvaluateSpec) -> np.ndarray:
    """The test rows as the model reads them. Shards hold features normalised with *their* dataset's
    statistics; a model trained on another preparation (a champion judged on fresh data) expects
    its own, so the rows are brought back to raw values and normalised as the model was."""
    features, expected = data_meta.get("features"), model_meta.get("features")
    if expected is not None and features != expected:
        missing = [f for f in expected if f not in features]
        extra = [f for f in features if f not in expected]
        parts = ([f"missing {missing[:8]}"] if missing else []) + ([f"not in the model {extra[:8]}"] if extra else [])
        detail = "; ".join(parts) or "the same columns in another order"
        raise DatasetError(f"the dataset at {spec.dataset_uri} does not have the features the model at "
                           f"{spec.model_uri} was trained on ({detail})",
                           "evaluate on data with the training table's feature columns, in the same order")
    d, m = data_meta["normalization"], model_meta.get("normalization")
    if m is None or (d["mean"] == m["mean"] and d["std"] == m["std"]):
        return x
    raw = x * np.asarray(d["std"], np.float32) + np.asarray(d["mean"], np.float32)
    return ((raw - np.asarray(m["mean"], np.float32)) / np.asarray(m["std"], np.float32)).astype(np.float32)


def to_model_labels(y: np.ndarray, data_meta: dict, model_meta: dict,
                    spec: EvaluateSpec) -> tuple[np.ndarray, list[str] | None]:
    """The test labels as the model's class ids, and the class names by id (None: ids only).
    Names are numbered per preparation, so another preparation's ids are matched by name; a
    name the model never saw gets an id of its own, which no prediction can equal."""
    d, m = data_meta.get("class_names"), model_meta.get("class_names")
    if d is None and m is None:
        return y, None
    if d is None or m is None:
        raise DatasetError(f"the dataset at {spec.dataset_uri} labels classes by "
                           f"{'id' if d is None else 'name'} and the model at {spec.model_uri} by "
                           f"{'name' if d is None else 'id'}",
                           "evaluate on data whose label column holds what the training table's did")
    names = list(m) + sorted(set(d) - set(m))
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([index[d[int(i)]] for i in y], dtype=np.int64), names


def accuracy_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of an accuracy of ``correct`` of ``n`` (scipy's binomtest): on a small
    test split the point estimate alone overstates what is known."""
    from scipy.stats import binomtest

    if n == 0:
        return 0.0, 1.0
    ci = binomtest(int(correct), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def gate_note(gate: dict, metrics: dict, classes: list | None = None) -> str | None:
    """A note when the test split is too small for the gate's verdict to be sure: the 95 % interval
    of the accuracy, or for ``min_recall`` of a class's recall (from ``metrics["confusion_matrix"]``,
    its rows named by ``classes``), reaches across the threshold. None otherwise."""
    if gate["metric"] == "min_recall" and "confusion_matrix" in metrics:
        return _recall_note(gate, np.asarray(metrics["confusion_matrix"]), classes)
    if gate["metric"] != "accuracy" or "accuracy_ci95_low" not in metrics:
        return None
    lo, hi, t = metrics["accuracy_ci95_low"], metrics["accuracy_ci95_high"], gate["threshold"]
    if not lo < t <= hi:
        return None
    return (f"the gate {'passed' if gate['passed'] else 'failed'} on {metrics['test_rows']} test rows: accuracy "
            f"{metrics['accuracy']:.4f}, 95% interval {lo:.4f}-{hi:.4f}, which the threshold {t:.4f} falls in; "
            "a larger table (more test rows) would make the verdict sure")


def _recall_note(gate: dict, m: np.ndarray, classes: list | None) -> str | None:
    """The min_recall gate's verdict is sure when a class is surely below the threshold (it failed),
    or when every class is surely at or above it (it passed); else the class that makes it unsure."""
    t, stats = gate["threshold"], {}
    for i in range(len(m)):
        if (rows := int(m[i].sum())) > 0:
            stats[i] = (int(m[i, i]), rows, *accuracy_interval(int(m[i, i]), rows))
    below = [i for i, (c, n, _, _) in stats.items() if c / n < t]
    if below and any(stats[i][3] < t for i in below):
        return None
    unsure = below or [i for i, (_, _, lo, _) in stats.items() if lo < t]
    if not unsure:
        return None
    i = min(unsure, key=lambda i: (stats[i][0] / stats[i][1], i))
    correct, rows, lo, hi = stats[i]
    return (f"the gate {'passed' if gate['passed'] else 'failed'} on few test rows of class "
            f"{classes[i] if classes else i}: its recall {correct / rows:.4f} ({correct} of {rows}), 95% interval "
            f"{lo:.4f}-{hi:.4f}, which the threshold {t:.4f} falls in; more test rows of it would make the verdict sure")


def compute_metrics(y_true: np.ndarray, y_pred: np.ndarray, classes: list[int]) -> dict:
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score

    lo, hi = accuracy_interval(int((np.asarray(y_true) == np.asarray(y_pred)).sum()), len(y_true))
    present = sorted(int(c) for c in np.unique(y_true))
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "accuracy_ci95_low": lo,
        "accuracy_ci95_high": hi,
        "macro_f1": float(f1_score(y_true, y_pred, average="macro", labels=classes, zero_division=0)),
        "macro_precision": float(precision_score(y_true, y_pred, average="macro", labels=classes, zero_division=0)),
        "macro_recall": float(recall_score(y_true, y_pred, average="macro", labels=classes, zero_division=0)),
        # the worst recall among the classes the test split has (a class without test rows has none)
        "min_recall": float(min(recall_score(y_true, y_pred, average=None, labels=present, zero_division=0),
                                default=0.0)),
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=classes).tolist(),
        "test_rows": int(len(y_true)),
    }


def per_class(y_true: np.ndarray, y_pred: np.ndarray, classes: list[int]) -> list[dict]:
    """Precision, recall, F1 and support of each class (scikit-learn's classification report), in
    ``classes`` order: where a model's errors are, which the macro means hide. Pure."""
    from sklearn.metrics import precision_recall_fscore_support

    p, r, f, n = precision_recall_fscore_support(y_true, y_pred, labels=classes, zero_division=0)
    return [{"class": c, "precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(n[i])}
            for i, c in enumerate(classes)]


def weakest_class(names: list[str], matrix: list[list[int]]) -> dict | None:
    """The class with the worst recall in a confusion matrix (rows: true class, columns: predicted),
    and the class its rows were most often taken for: ``{"class", "recall", "correct", "rows",
    "taken_for", "taken_rows"}``. None when every class with test rows was found in full. Pure."""
    m = np.asarray(matrix, dtype=np.int64).reshape(len(names), len(names))
    support = m.sum(axis=1)
    rows = [i for i in range(len(names)) if support[i] > 0]
    if not rows:
        return None
    worst = min(rows, key=lambda i: (m[i, i] / support[i], i))
    if m[worst, worst] == support[worst]:
        return None
    off = m[worst].copy()
    off[worst] = -1
    other = int(off.argmax())
    return {"class": names[worst], "recall": float(m[worst, worst] / support[worst]), "correct": int(m[worst, worst]),
            "rows": int(support[worst]), "taken_for": names[other], "taken_rows": int(m[worst, other])}


def roc_metrics(y_true: np.ndarray, probs: np.ndarray, classes: list[int]) -> tuple[dict, dict | None]:
    """The area under the ROC curve, and for two classes the curve itself. Pure.

    Two classes: the ROC of the second (its probability as the score; the area is the same for
    either class). More: the macro mean of one-vs-rest areas (scikit-learn's ``ovr``) over the
    classes of the test split, the probabilities renormalised over them. ``({}, None)`` when it is
    undefined: one class in the test split, or a label the model has no output for."""
    from sklearn.metrics import roc_auc_score, roc_curve

    present = sorted(int(c) for c in np.unique(y_true))
    if len(present) < 2 or present[-1] >= probs.shape[1]:
        return {}, None
    if len(present) == 2:
        positive = present[1]
        score = probs[:, positive] / probs[:, present].sum(axis=1).clip(1e-12)
        fpr, tpr, thresholds = roc_curve(y_true == positive, score)
        # the first threshold is +inf (no row positive), which JSON and KFP's UI do not take
        roc = {"positive": positive, "fpr": fpr.tolist(), "tpr": tpr.tolist(),
               "thresholds": np.minimum(thresholds, 1.0).tolist()}
        return {"roc_auc": float(roc_auc_score(y_true == positive, score))}, roc
    p = probs[:, present]
    p = p / p.sum(axis=1, keepdims=True).clip(1e-12)
    return {"roc_auc": float(roc_auc_score(y_true, p, multi_class="ovr", average="macro", labels=present))}, None


CALIBRATION_BINS = 15


def calibration(y_true: np.ndarray, probs: np.ndarray, bins: int = CALIBRATION_BINS) -> tuple[dict, dict]:
    """Whether the model's confidence means what it says: of the rows it answers with confidence
    0.9 (its top class's probability, which the server answers), are 90 % right? Pure.

    Returns ``({"ece", "log_loss"}, curve)``. ``ece``: the expected calibration error (Guo et al.,
    2017), the row-weighted gap between accuracy and mean confidence over ``bins`` equal-width
    confidence bins; 0 is calibrated. ``log_loss``: the test cross-entropy (scikit-learn's), left out
    when a test label has no output. ``curve``: per bin, its rows, accuracy and mean confidence
    (None where empty), for the reliability diagram. scikit-learn's ``calibration_curve`` is for one
    class's probability (two classes); the top-label form a multi-class confidence needs is the few
    bin counts below."""
    from sklearn.metrics import log_loss

    y_true, probs = np.asarray(y_true), np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum(axis=1, keepdims=True).clip(1e-12)  # float32 softmax: sums off by ~1e-7
    conf, correct = probs.max(axis=1), probs.argmax(axis=1) == y_true
    # bin b holds confidences in (b/bins, (b+1)/bins]; a confidence of 1/k or below (k classes) is in bin 0
    idx = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    rows = np.bincount(idx, minlength=bins)
    right = np.bincount(idx, weights=correct, minlength=bins)
    confident = np.bincount(idx, weights=conf, minlength=bins)
    metrics = {"ece": float(np.abs(right - confident).sum() / max(len(y_true), 1))}
    if len(y_true) and int(y_true.max()) < probs.shape[1]:
        metrics["log_loss"] = float(log_loss(y_true, probs, labels=np.arange(probs.shape[1])))
    curve = {"bins": bins, "rows": rows.tolist(),
             "accuracy": [float(r / n) if n else None for r, n in zip(right, rows)],
             "confidence": [float(c / n) if n else None for c, n in zip(confident, rows)]}
    return metrics, curve


def calibration_figure(curve: dict, ece: float):
    """The reliability diagram: each confidence bin's accuracy against the diagonal of a calibrated
    model, with how many test rows fall in each bin below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = curve["bins"]
    left = np.arange(bins) / bins
    acc = np.array([a if a is not None else np.nan for a in curve["accuracy"]])
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(4.6, 5.4), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.bar(left, np.nan_to_num(acc), width=1 / bins, align="edge", edgecolor="#24292f", color="#0969da",
           alpha=0.75, label="accuracy")
    ax.plot([0, 1], [0, 1], color="#999", linestyle=":", label="calibrated")
    ax.set(ylabel="accuracy", title=f"Calibration (test): ECE {ece:.4f}", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="upper left")
    hist.bar(left, curve["rows"], width=1 / bins, align="edge", edgecolor="#24292f", color="#8c959f")
    hist.set(xlabel="confidence (top class's probability)", ylabel="test rows")
    fig.tight_layout()
    return fig


MISTAKES_SHOWN = 24
"""How many of an image model's wrong test images the report shows, the most confident first."""


def image_mistakes(x: np.ndarray, y: np.ndarray, probs: np.ndarray, model_meta: dict) -> dict | None:
    """For a model trained on an image's pixels (its metadata's ``image_shape``): the test images it
    got wrong, the most confident mistakes first (up to :data:`MISTAKES_SHOWN`), as raw pixels
    ``[n, C, H, W]`` with their true and predicted class and the confidence; None for a model of
    other features. ``x``: the rows as the model reads them (normalised by its statistics)."""
    shape = model_meta.get("image_shape")
    if not shape or int(np.prod(shape)) != x.shape[1] or not len(y):
        return None
    pred = probs.argmax(1)
    wrong = np.nonzero(pred != y)[0]
    conf = probs[wrong, pred[wrong]]
    shown = wrong[np.argsort(-conf, kind="stable")][:MISTAKES_SHOWN]  # ties: in test-split order
    norm = model_meta["normalization"]
    raw = x[shown] * np.asarray(norm["std"], np.float32) + np.asarray(norm["mean"], np.float32)
    return {"images": raw.reshape(len(shown), *shape), "true": y[shown].tolist(), "predicted": pred[shown].tolist(),
            "confidence": probs[shown, pred[shown]].tolist(), "rows": shown.tolist(), "wrong": len(wrong),
            "test_rows": len(y)}


def mistakes_figure(mistakes: dict, names: list[str] | None = None):
    """The wrong test images in a grid, each titled ``true -> predicted`` and the confidence. One
    channel is drawn in grey, three as RGB; each image is scaled to its own range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = mistakes["images"]
    n = len(images)
    cols = min(8, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.35 * cols, 1.6 * rows), squeeze=False)
    name = (lambda c: str(names[c])) if names else str
    for ax in axes.ravel():
        ax.axis("off")
    for ax, img, t, p, c in zip(axes.ravel(), images, mistakes["true"], mistakes["predicted"], mistakes["confidence"]):
        img = img.transpose(1, 2, 0) if img.shape[0] == 3 else img[0]
        lo, hi = float(img.min()), float(img.max())
        img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
        ax.imshow(img, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{name(t)} \u2192 {name(p)}\n{c:.2f}", fontsize=7)
    fig.suptitle("true \u2192 predicted, confidence", fontsize=8)
    return fig


def roc_figure(roc: dict, auc: float, name: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.4))
    ax.plot(roc["fpr"], roc["tpr"], label=f"class {name}: AUC {auc:.4f}")
    ax.plot([0, 1], [0, 1], color="#999", linestyle=":", label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (test)", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="lower right")
    return fig


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def confusion_figure(cm: np.ndarray, classes: list):
    """The confusion matrix as a figure sized for the class count: counts written in the cells up
    to 25 classes (10,000 text objects for 100 classes took 16 s and were unreadable), every class
    named up to 40, then 20 of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(classes)
    side = min(4.4 + 0.1 * k, 14)
    fig, ax = plt.subplots(figsize=(side + 0.6, side))
    im = ax.imshow(cm, cmap="Blues", interpolation="nearest")
    ticks = list(range(k)) if k <= 40 else sorted(set(np.linspace(0, k - 1, 20).round().astype(int).tolist()))
    labels = [str(classes[t]) for t in ticks]
    ax.set(xticks=ticks, yticks=ticks, xlabel="predicted", ylabel="true", title="Confusion matrix (test)")
    ax.set_xticklabels(labels, rotation=90 if k > 10 or max(map(len, labels), default=0) > 3 else 0, fontsize=8)
    ax.set_yticklabels(labels, fontsize=8)
    if k <= 25:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if cm[i, j] > cm.max() / 2 else "black")
    fig.colorbar(im, ax=ax)
    return fig


def render_report(metrics: dict, history: list[dict], classes: list, gate: dict,
                  exported_epoch: int | None = None, data_note: str | None = None, roc: dict | None = None,
                  classes_report: list[dict] | None = None, calibration_curve: dict | None = None,
                  mistakes: dict | None = None, class_names: list[str] | None = None) -> str:
    """A self-contained HTML page (plots inlined as PNG) that the KFP UI renders. ``exported_epoch``:
    the epoch whose weights were evaluated, marked on the curves when it is not the last (an early
    stop kept the best). ``data_note``: a caution about the test split (rows also trained on).
    ``roc``: :func:`roc_metrics`' curve of a two-class test split (with its class's ``name``), drawn.
    ``classes_report``: :func:`per_class`, as a table by ``classes`` (the ticks: names or ids), the
    worst recall first. ``calibration_curve``: :func:`calibration`'s bins, drawn as a reliability
    diagram. ``mistakes``: :func:`image_mistakes`, drawn as a grid of images (named by
    ``class_names`` where the label column held names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    imgs = []
    if history:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        ep = [h["epoch"] for h in history]
        a1.plot(ep, [h["loss"] for h in history], "o-", label="train")
        a1.plot(ep, [h["val_loss"] for h in history], "s-", label="validation")
        a1.set(title="Loss", xlabel="epoch")
        a2.plot(ep, [h["accuracy"] for h in history], "o-", label="train")
        a2.plot(ep, [h["val_accuracy"] for h in history], "s-", label="validation")
        a2.set(title="Accuracy", xlabel="epoch", ylim=(0, 1.02))
        if exported_epoch is not None and exported_epoch != ep[-1]:
            for ax in (a1, a2):
                ax.axvline(exported_epoch, color="#9a6700", linestyle="--",
                           label=f"model: epoch {exported_epoch} (early stop)")
        a1.legend()
        a2.legend()
        imgs.append(("Training curves", _png(fig)))
        plt.close(fig)
    fig = confusion_figure(np.array(metrics["confusion_matrix"]), classes)
    imgs.append(("Confusion matrix", _png(fig)))
    plt.close(fig)
    if roc is not None:
        fig = roc_figure(roc, metrics["roc_auc"], roc.get("name", str(roc["positive"])))
        imgs.append(("ROC curve", _png(fig)))
        plt.close(fig)
    if calibration_curve is not None and "ece" in metrics:
        fig = calibration_figure(calibration_curve, metrics["ece"])
        imgs.append(("Calibration", _png(fig)))
        plt.close(fig)
    if mistakes is not None and mistakes["wrong"]:
        fig = mistakes_figure(mistakes, class_names)
        shown = len(mistakes["images"])
        imgs.append((f"Wrong test images: {'the ' + str(shown) + ' most confident of ' if shown < mistakes['wrong'] else ''}"
                     f"{mistakes['wrong']} (of {mistakes['test_rows']})", _png(fig)))
        plt.close(fig)
    verdict = "PASSED" if gate["passed"] else "FAILED"
    color = "#1a7f37" if gate["passed"] else "#cf222e"
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4f}</td></tr>"
                   for k, v in metrics.items() if isinstance(v, float))
    figs = "".join(f"<h3>{html.escape(t)}</h3><img alt='{html.escape(t)}' src='data:image/png;base64,{b}'/>"
                   for t, b in imgs)
    if history and exported_epoch is not None and exported_epoch != history[-1]["epoch"]:
        rows += (f"<tr><td>model</td><td>epoch {exported_epoch} of {history[-1]['epoch']}: training stopped "
                 "early, and the epoch with the lowest validation loss was kept</td></tr>")
    if classes_report:
        head = "".join(f"<th>{h}</th>" for h in ("class", "precision", "recall", "F1", "test rows"))
        def undefined_or(c, k):  # a class without test rows has no recall (nor F1): not 0, and not the worst
            return "&ndash;" if c["support"] == 0 else f"{c[k]:.4f}"

        body = "".join(f"<tr><td>{html.escape(str(classes[i]))}</td><td>{c['precision']:.4f}</td>"
                       f"<td>{undefined_or(c, 'recall')}</td><td>{undefined_or(c, 'f1')}</td><td>{c['support']}</td></tr>"
                       for i, c in sorted(enumerate(classes_report),
                                          key=lambda ic: (ic[1]["support"] == 0, ic[1]["recall"], ic[0])))
        figs = f"<h3>Per class (worst recall first)</h3><table><tr>{head}</tr>{body}</table>" + figs
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kfp-pytorch evaluation</title>"
            f"<style>body{{font-family:sans-serif;margin:1.5em}}td{{padding:2px 12px}}</style></head><body>"
            f"<h2>Evaluation report</h2><p style='color:{color};font-weight:bold'>Gate {verdict}: "
            f"{html.escape(gate['metric'])} = {gate['value']:.4f} (threshold {gate['threshold']:.4f})</p>"
            + "".join(f"<p style='color:#9a6700'>{html.escape(n)}</p>" for n in (gate_note(gate, metrics, classes), data_note) if n)
            + f"<table>{rows}</table>{figs}</body></html>")


def _holds_model(uri: str, storage: Storage) -> bool:
    from .predictor import read_model_metadata

    try:
        read_model_metadata(uri, storage)
    except KfpPytorchError:
        return False
    return True


def evaluate(spec: EvaluateSpec, storage: Storage | None = None) -> dict:
    """Returns ``{"metrics", "gate", "gate_note", "report_html", "classes", "class_names", "roc",
    "per_class", "calibration"}``."""
    import torch

    spec.validate()
    storage = storage or Storage()
    try:
        module, model_meta = load_program(spec.model_uri, storage)
    except ModelNotFound as e:  # EvaluateSpec(model, dataset): its fields are dataset first
        if _holds_model(spec.dataset_uri, storage):
            e.hint = (f"dataset_uri and model_uri are the other way round: EvaluateSpec(dataset_uri={spec.model_uri!r}, "
                      f"model_uri={spec.dataset_uri!r})")
        raise
    data_meta = read_metadata(spec.dataset_uri, storage)
    x, y = load_split(spec.dataset_uri, "test", storage, data_meta)
    x = to_model_scale(x, data_meta, model_meta, spec)
    y, names = to_model_labels(y, data_meta, model_meta, spec)
    with torch.no_grad():
        probs = torch.softmax(logits_in_chunks(module, torch.from_numpy(x)), dim=1).numpy()
    pred = probs.argmax(1)
    # a class the model knows but the test split lacks still counts when the model predicts it
    classes = sorted(set(np.unique(y).tolist()) | set(model_meta.get("classes", [])))
    metrics = compute_metrics(y, pred, classes)
    auc, roc = roc_metrics(y, probs, classes)
    metrics.update(auc)
    calibrated, reliability = calibration(y, probs)
    metrics.update(calibrated)
    by_class = per_class(y, pred, classes)
    if roc is not None:
        roc["name"] = names[roc["positive"]] if names else str(roc["positive"])
    value = metrics[spec.metric]
    gate = {"metric": spec.metric, "value": value, "threshold": spec.threshold, "passed": bool(value >= spec.threshold)}
    history_uri = join(spec.model_uri.rstrip("/").rsplit("/", 1)[0], "history.json")
    history = json.loads(storage.read_bytes(history_uri)) if storage.exists(history_uri) else []
    ticks = classes if names is None else [names[c] for c in classes]
    return {"metrics": metrics, "gate": gate, "classes": classes, "class_names": names, "roc": roc,
            "per_class": by_class, "calibration": reliability, "gate_note": gate_note(gate, metrics, ticks),
            "report_html": render_report(metrics, history, ticks, gate, model_meta.get("training", {}).get("exported_epoch"),
                                         duplicates_note(data_meta.get("duplicates", {}), data_meta["rows"]), roc,
                                         by_class, reliability, image_mistakes(x, y, probs, model_meta), names)}
