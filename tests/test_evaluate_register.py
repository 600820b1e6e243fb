"""evaluate (gate, report) and register (MLflow registry) against a real `mlflow server`."""
import json
import subprocess
import sys
import time

import mlflow
import numpy as np
import pytest

from kfp_pytorch.components.errors import ConfigError, RegistryError
from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate
from kfp_pytorch.components.register import RegisterSpec, register
from servers import free_port


def test_evaluate_metrics_gate_and_report(digits_data, trained_model):
    res = evaluate(EvaluateSpec(digits_data, trained_model.model_uri, threshold=0.5))
    m = res["metrics"]
    assert 0.9 < m["accuracy"] <= 1 and m["test_rows"] == 270
    cm = m["confusion_matrix"]
    assert len(cm) == 10 and sum(map(sum, cm)) == 270
    assert sum(cm[i][i] for i in range(10)) / 270 == pytest.approx(m["accuracy"])
    assert res["gate"]["passed"] is True
    html = res["report_html"]
    # confusion, calibration, and the wrong test images (a model of an image's pixels)
    assert html.count("data:image/png;base64,") == 4 and "Gate PASSED" in html
    wrong = 270 - sum(cm[i][i] for i in range(10))
    assert f"<h3>Wrong test images: {wrong} (of 270)</h3>" in html
    # calibration: the reliability diagram's bins hold every test row, and its gaps make the ECE
    cal = res["calibration"]
    assert sum(cal["rows"]) == 270 and "<h3>Calibration</h3>" in html and "<td>ece</td>" in html
    gaps = sum(n * abs(a - c) for n, a, c in zip(cal["rows"], cal["accuracy"], cal["confidence"]) if n)
    assert m["ece"] == pytest.approx(gaps / 270) and 0 <= m["ece"] < 0.2 and 0 < m["log_loss"] < 1
    strict = evaluate(EvaluateSpec(digits_data, trained_model.model_uri, threshold=0.999999, metric="macro_f1"))
    assert strict["gate"]["passed"] is False and "Gate FAILED" in strict["report_html"]
    # the accuracy's 95% interval (Wilson) comes with it; a threshold inside it gets a note
    lo, hi = m["accuracy_ci95_low"], m["accuracy_ci95_high"]
    assert lo < m["accuracy"] < hi <= 1 and 0.02 < hi - lo < 0.1  # 270 rows: a few points wide
    assert res["gate_note"] is None and "95% interval" not in html
    near = evaluate(EvaluateSpec(digits_data, trained_model.model_uri, threshold=(lo + m["accuracy"]) / 2))
    assert near["gate"]["passed"] is True and near["gate_note"].startswith(
        f"the gate passed on 270 test rows: accuracy {m['accuracy']:.4f}, 95% interval {lo:.4f}-{hi:.4f}")
    assert "95% interval" in near["report_html"]
    assert "also training rows" not in html  # digits repeats no row
    # each class's precision and recall, as the confusion matrix has them, the worst recall first
    cmat = np.asarray(cm)
    for i, c in enumerate(res["per_class"]):
        assert c["class"] == i and c["support"] == cmat[i].sum()
        assert c["recall"] == pytest.approx(cmat[i, i] / cmat[i].sum())
        assert c["precision"] == pytest.approx(cmat[i, i] / max(cmat[:, i].sum(), 1))
    worst = min(range(10), key=lambda i: (cmat[i, i] / cmat[i].sum(), i))
    assert m["min_recall"] == pytest.approx(cmat[worst, worst] / cmat[worst].sum())
    assert "<h3>Per class (worst recall first)</h3><table><tr><th>class</th>" in html
    assert html.split("<th>test rows</th></tr>")[1].startswith(f"<tr><td>{worst}</td>")
    # ten classes: the macro one-vs-rest ROC AUC of the served model's probabilities, and no curve
    from sklearn.metrics import roc_auc_score

    from kfp_pytorch.components.predictor import ModelRunner
    from kfp_pytorch.components.prepare_data import load_split, read_metadata

    x, y = load_split(digits_data, "test")
    norm = read_metadata(digits_data)["normalization"]
    probs, _ = ModelRunner(trained_model.model_uri).predict(x * np.asarray(norm["std"]) + np.asarray(norm["mean"]))
    assert m["roc_auc"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr"), abs=1e-4) and res["roc"] is None


def test_evaluate_with_the_dataset_and_the_model_swapped_says_so(digits_data, trained_model):
    # EvaluateSpec(model, data) by position (its fields are dataset first): "no trained model at DATA
    # (it is a prepared dataset)" with the generic hint left the swap to be seen
    from kfp_pytorch.components.errors import ModelNotFound

    with pytest.raises(ModelNotFound) as e:
        evaluate(EvaluateSpec(trained_model.model_uri, digits_data))
    assert e.value.message == f"no trained model at {digits_data} (it is a prepared dataset)"
    assert e.value.hint == ("dataset_uri and model_uri are the other way round: "
                            f"EvaluateSpec(dataset_uri={digits_data!r}, model_uri={trained_model.model_uri!r})")


def test_roc_auc_is_scikit_learns_and_the_two_class_curve_is_drawn_from_it():
    from sklearn.metrics import roc_auc_score

    from kfp_pytorch.components.evaluate import roc_metrics

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    score = np.clip(0.3 * y + rng.normal(0.35, 0.25, 400), 0, 1)
    probs = np.stack([1 - score, score], axis=1)
    metrics, roc = roc_metrics(y, probs, [0, 1])
    assert metrics["roc_auc"] == pytest.approx(roc_auc_score(y, score)) and 0.6 < metrics["roc_auc"] < 0.95
    assert roc["positive"] == 1 and roc["fpr"][0] == roc["tpr"][0] == 0 and roc["fpr"][-1] == roc["tpr"][-1] == 1
    assert np.all(np.diff(roc["fpr"]) >= 0) and np.all(np.diff(roc["tpr"]) >= 0)
    assert np.trapezoid(roc["tpr"], roc["fpr"]) == pytest.approx(metrics["roc_auc"])  # the area of the curve drawn
    assert max(roc["thresholds"]) <= 1  # no +inf: JSON and the KFP UI take it
    # more classes: the macro one-vs-rest mean, over the classes the test split has
    y3 = rng.integers(0, 3, 300)
    p4 = rng.dirichlet([1, 1, 1, 1], 300)
    p4[np.arange(300), y3] += 0.4
    p4 /= p4.sum(axis=1, keepdims=True)
    metrics, roc = roc_metrics(y3, p4, [0, 1, 2, 3])  # class 3: known to the model, absent from the test
    p3 = p4[:, :3] / p4[:, :3].sum(axis=1, keepdims=True)
    assert roc is None and metrics["roc_auc"] == pytest.approx(roc_auc_score(y3, p3, multi_class="ovr"))
    assert roc_metrics(np.zeros(5, int), probs[:5], [0, 1]) == ({}, None)  # one class: no curve, no area
    assert roc_metrics(np.array([0, 2, 0, 2]), probs[:4], [0, 2]) == ({}, None)  # a label with no output


def test_an_image_models_wrong_test_images_are_shown_the_most_confident_first():
    from kfp_pytorch.components.evaluate import MISTAKES_SHOWN, image_mistakes, render_report

    rng = np.random.default_rng(0)
    n = 60
    raw = rng.uniform(0, 16, size=(n, 2 * 3)).astype(np.float32)
    meta = {"image_shape": [1, 2, 3], "normalization": {"mean": [8.0] * 6, "std": [4.0] * 6}}
    x = (raw - 8) / 4  # as the model reads them
    y = np.arange(n) % 3
    probs = np.full((n, 3), 0.1, np.float32)
    probs[np.arange(n), y] = 0.8  # right ...
    wrong = [5, 17, 30, 41]
    for row, conf in zip(wrong, (0.6, 0.95, 0.7, 0.95)):  # ... but these, each at its confidence
        probs[row] = 0.0
        probs[row, (y[row] + 1) % 3], probs[row, y[row]] = conf, 1 - conf
    m = image_mistakes(x, y, probs, meta)
    assert m["rows"] == [17, 41, 30, 5] and m["wrong"] == 4 and m["test_rows"] == n  # a tie: in test order
    assert m["true"] == y[m["rows"]].tolist() and m["predicted"] == [(t + 1) % 3 for t in m["true"]]
    assert m["confidence"] == pytest.approx([0.95, 0.95, 0.7, 0.6])
    np.testing.assert_allclose(m["images"], raw[m["rows"]].reshape(4, 1, 2, 3), rtol=1e-6)  # the raw pixels
    # many mistakes: the most confident ones shown, and said so
    many = np.roll(probs, 1, axis=1)  # every row wrong
    m = image_mistakes(x, y, many, meta)
    assert len(m["images"]) == MISTAKES_SHOWN and m["wrong"] == n
    gate = {"metric": "accuracy", "value": 0.5, "threshold": 0.5, "passed": True}
    page = render_report({"confusion_matrix": [[1, 0], [0, 1]]}, [], ["a", "b"], gate, mistakes=m,
                         class_names=["a", "b", "c"])
    assert f"<h3>Wrong test images: the {MISTAKES_SHOWN} most confident of {n} (of {n})</h3>" in page
    # a model of other features, or one without mistakes: no gallery
    assert image_mistakes(x, y, probs, {"normalization": meta["normalization"]}) is None
    right = np.eye(3, dtype=np.float32)[y]
    assert image_mistakes(x, y, right, meta)["wrong"] == 0
    assert "Wrong test images" not in render_report({"confusion_matrix": [[1]]}, [], ["a"], gate,
                                                    mistakes=image_mistakes(x, y, right, meta))


def test_calibration_is_the_gap_between_confidence_and_accuracy_per_confidence_bin():
    from sklearn.metrics import log_loss

    from kfp_pytorch.components.evaluate import calibration

    # overconfident: 0.99 sure every time, right 7 times in 10
    y = np.array([1] * 7 + [0] * 3)
    metrics, curve = calibration(y, np.tile([0.01, 0.99], (10, 1)))
    assert metrics["ece"] == pytest.approx(0.29) and curve["rows"][-1] == 10 and sum(curve["rows"]) == 10
    assert curve["accuracy"][-1] == pytest.approx(0.7) and curve["confidence"][-1] == pytest.approx(0.99)
    assert curve["accuracy"][0] is None  # an empty bin has no accuracy (not 0)
    assert metrics["log_loss"] == pytest.approx(log_loss(y, np.tile([0.01, 0.99], (10, 1))))
    # two bins, by hand: 0.6 sure and right 1 of 2 (gap 0.1), 1.0 sure and right 2 of 2 (gap 0)
    probs = np.array([[0.6, 0.4], [0.4, 0.6], [1.0, 0.0], [0.0, 1.0]])
    metrics, curve = calibration(np.array([0, 0, 0, 1]), probs, bins=10)
    assert metrics["ece"] == pytest.approx((2 * 0.1 + 2 * 0) / 4)
    assert curve["rows"] == [0, 0, 0, 0, 0, 2, 0, 0, 0, 2]  # 0.6 is in (0.5, 0.6]; 1.0 in the last bin
    # calibrated on average over many rows: the label drawn with the model's own probability
    rng = np.random.default_rng(0)
    p = rng.uniform(size=50_000)
    metrics, _ = calibration((rng.uniform(size=p.size) < p).astype(int), np.c_[1 - p, p])
    assert metrics["ece"] < 0.01
    # float32 softmax rows (sums off by ~1e-7) are taken; a label with no output has no log loss
    f32 = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=np.float32)
    assert set(calibration(np.array([0, 2]), f32)[0]) == {"ece", "log_loss"}
    assert set(calibration(np.array([0, 3]), f32)[0]) == {"ece"}


def test_a_two_class_model_gets_its_roc_curve_in_the_kfp_ui_and_the_report(digits_data, tmp_path):
    from kfp.dsl import HTML, ClassificationMetrics, Dataset, Metrics, Model

    from kfp_pytorch.components.ops.evaluate import evaluate_op
    from kfp_pytorch.components.prepare_data import PrepareSpec, load_table, prepare_data
    from kfp_pytorch.components.train import TrainSpec, train

    table = load_table("sample://digits")
    table["label"] = np.where(table["label"] < 5, "low", "high")
    table.to_csv(tmp_path / "two.csv", index=False)
    data = str(tmp_path / "data")
    prepare_data(PrepareSpec(str(tmp_path / "two.csv"), data))
    model_uri = train(TrainSpec(data, str(tmp_path / "run"), epochs=1, workers=1, progress="off")).model_uri
    metrics, confusion, report = (Metrics(uri=str(tmp_path / "m")), ClassificationMetrics(uri=str(tmp_path / "c")),
                                  HTML(uri=str(tmp_path / "r")))
    report.path = str(tmp_path / "report.html")
    evaluate_op.python_func(dataset=Dataset(uri=data, metadata={"uri": data}), model=Model(uri=model_uri,
                            metadata={"uri": model_uri}), metrics=metrics, confusion=confusion, report=report,
                            threshold=0.5)
    curve = confusion.metadata["confidenceMetrics"]
    fpr = [p["falsePositiveRate"] for p in curve]
    assert len(curve) > 10 and fpr == sorted(fpr) and fpr[-1] == 1 and curve[-1]["recall"] == 1
    assert np.trapezoid([p["recall"] for p in curve], fpr) == pytest.approx(metrics.metadata["roc_auc"])
    html = (tmp_path / "report.html").read_text()
    # curves, confusion, ROC, calibration, and the wrong test images (named classes: an image's pixels still)
    assert "<h3>ROC curve</h3>" in html and html.count("data:image/png;base64,") == 5
    assert "<h3>Wrong test images: " in html


def test_the_report_says_when_test_rows_were_also_trained_on(digits_data, trained_model, tmp_path):
    import json
    import shutil

    data = shutil.copytree(digits_data, tmp_path / "data")
    meta = json.loads((data / "metadata.json").read_text())
    meta["duplicates"] = {"rows": 9, "test_rows_in_train": 7, "conflicting": 0}  # as prepare_data counts them
    (data / "metadata.json").write_text(json.dumps(meta))
    html = evaluate(EvaluateSpec(str(data), trained_model.model_uri, threshold=0.5))["report_html"]
    assert ("<p style='color:#9a6700'>7 of the 270 test rows are also training rows, so the test metrics are "
            "optimistic (9 repeated rows in the table; drop them") in html


def test_the_accuracy_interval_is_wilsons():
    from kfp_pytorch.components.evaluate import accuracy_interval, gate_note

    # reference values of the Wilson score interval (Newcombe 1998, table I: 81/263 -> 0.2553-0.3662)
    assert accuracy_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert accuracy_interval(2, 2) == pytest.approx((0.3424, 1.0), abs=1e-4)  # "1.0 accuracy" on 2 rows
    assert accuracy_interval(0, 0) == (0.0, 1.0)
    m = {"accuracy": 1.0, "accuracy_ci95_low": 0.3424, "accuracy_ci95_high": 1.0, "test_rows": 2}
    assert "on 2 test rows" in gate_note({"metric": "accuracy", "threshold": 0.9, "passed": True}, m)
    assert gate_note({"metric": "macro_f1", "threshold": 0.9, "passed": True}, m) is None
    assert gate_note({"metric": "accuracy", "threshold": 0.3, "passed": True}, m) is None  # surely above


def test_the_min_recall_gate_notes_a_class_with_too_few_test_rows_to_be_sure():
    from kfp_pytorch.components.evaluate import accuracy_interval, gate_note

    def note(rows, t):
        passed = min(r[i] / sum(r) for i, r in enumerate(rows) if sum(r)) >= t
        return gate_note({"metric": "min_recall", "threshold": t, "passed": passed}, {"confusion_matrix": rows},
                         ["cat", "dog", "fox"])

    # passed: 'fox' found 5 of 5 times is not surely above 0.9; 'cat' 97 of 100 is
    lo, hi = accuracy_interval(5, 5)
    assert note([[97, 3, 0], [0, 200, 0], [0, 0, 5]], 0.9) == (
        f"the gate passed on few test rows of class fox: its recall 1.0000 (5 of 5), 95% interval {lo:.4f}-{hi:.4f}, "
        "which the threshold 0.9000 falls in; more test rows of it would make the verdict sure")
    assert note([[970, 30, 0], [0, 2000, 0], [0, 0, 500]], 0.9) is None  # every class surely above
    # failed: 'fox' 4 of 5 may be above 0.7 ... unless another class is surely below it
    assert note([[97, 3, 0], [0, 200, 0], [0, 1, 4]], 0.85).startswith("the gate failed on few test rows of class fox: "
                                                                        "its recall 0.8000 (4 of 5)")
    assert note([[50, 50, 0], [0, 200, 0], [0, 1, 4]], 0.85) is None  # 'cat' 50 of 100 surely fails
    assert note([[0, 0, 0], [0, 200, 0], [0, 0, 5]], 0.9).endswith("(5 of 5), 95% interval "
                                                                     f"{lo:.4f}-{hi:.4f}, which the threshold 0.9000 "
                                                                     "falls in; more test rows of it would make the verdict sure")
    # no confusion matrix to read (an older run's summary): no note
    assert gate_note({"metric": "min_recall", "threshold": 0.9, "passed": True}, {"min_recall": 1.0}) is None


def test_evaluate_on_another_preparation_judges_what_the_server_would_answer(trained_model, tmp_path):
    import numpy as np

    from kfp_pytorch.components.errors import DatasetError
    from kfp_pytorch.components.predictor import ModelRunner
    from kfp_pytorch.components.prepare_data import PrepareSpec, _split, load_table, prepare_data

    # fresh data, prepared on its own: digits 0-4 only, so its normalisation is not the model's
    table = load_table("sample://digits")
    table = table[table["label"] < 5].reset_index(drop=True)
    table.to_csv(tmp_path / "fresh.csv", index=False)
    spec = PrepareSpec(str(tmp_path / "fresh.csv"), str(tmp_path / "fresh"))
    prepare_data(spec)
    res = evaluate(EvaluateSpec(spec.output_uri, trained_model.model_uri, threshold=0.5))
    # the served model reads raw rows and normalises them as it was trained: the same test rows, raw
    y = table["label"].to_numpy()
    test = _split(y, spec)["test"]
    raw = table.drop(columns=["label"]).to_numpy(dtype=np.float32)[test]
    _, served = ModelRunner(trained_model.model_uri).predict(raw)
    assert res["metrics"]["accuracy"] == pytest.approx(float((served == y[test]).mean()), abs=1e-12)
    # the model's ten classes stay in the confusion matrix: a prediction of 7 is counted as wrong, not dropped
    cm = np.array(res["metrics"]["confusion_matrix"])
    assert cm.shape == (10, 10) and cm.sum() == len(test) and cm[5:].sum() == 0
    # other feature columns: refused, not evaluated on shifted inputs
    table.rename(columns={"pixel_0_0": "x"}).to_csv(tmp_path / "other.csv", index=False)
    prepare_data(PrepareSpec(str(tmp_path / "other.csv"), str(tmp_path / "other")))
    with pytest.raises(DatasetError, match=r"does not have the features the model .* was trained on \(missing "
                                           r"\['pixel_0_0'\]; not in the model \['x'\]\)"):
        evaluate(EvaluateSpec(str(tmp_path / "other"), trained_model.model_uri))


@pytest.mark.parametrize("k,texts,ticks", [(10, 100, 10), (40, 0, 40), (300, 0, 20)])
def test_the_confusion_matrix_is_drawn_for_its_class_count(k, texts, ticks):
    # 300 classes wrote 90,000 counts into the cells: 140 s for an unreadable report
    import matplotlib.pyplot as plt
    import numpy as np

    from kfp_pytorch.components.evaluate import confusion_figure

    fig = confusion_figure(np.ones((k, k), dtype=int), [f"class-{i}" for i in range(k)])
    ax = fig.axes[0]
    assert len(ax.texts) == texts and len(ax.get_xticks()) == ticks == len(ax.get_yticklabels())
    assert ax.get_xticklabels()[-1].get_text() == f"class-{k - 1}"  # the last class is always named
    plt.close(fig)


def test_a_test_split_larger_than_one_program_batch_is_evaluated(digits_data, trained_model, tmp_path):
    # the whole split went through the exported program at once: past 65,536 rows, an AssertionError
    import numpy as np
    import pandas as pd

    from kfp_pytorch.components.exported_model import EXPORT_MAX_BATCH
    from kfp_pytorch.components.prepare_data import PrepareSpec, load_split, prepare_data, read_metadata

    x, y = load_split(digits_data, "train")
    norm = read_metadata(digits_data)["normalization"]
    n = int(EXPORT_MAX_BATCH / 0.45) + 200
    pick = np.random.default_rng(0).integers(0, len(x), n)
    table = pd.DataFrame(x[pick] * np.asarray(norm["std"]) + np.asarray(norm["mean"]),
                         columns=read_metadata(digits_data)["features"])
    table["target"] = y[pick]
    table.to_parquet(tmp_path / "big.parquet")
    big = str(tmp_path / "big")
    prepare_data(PrepareSpec(str(tmp_path / "big.parquet"), big, label_column="target", val_fraction=0.05,
                             test_fraction=0.45, shard_rows=20000))
    m = evaluate(EvaluateSpec(big, trained_model.model_uri, threshold=0.5))["metrics"]
    assert m["test_rows"] > EXPORT_MAX_BATCH and m["accuracy"] > 0.9


def test_evaluate_rejects_bad_settings(digits_data, trained_model):
    with pytest.raises(ConfigError):
        evaluate(EvaluateSpec(digits_data, trained_model.model_uri, threshold=2, metric="auc"))


def _metrics(acc):
    return {"accuracy": acc, "macro_f1": acc}


def test_champion_moves_only_when_earned(mlflow_server, trained_model, s3):
    uri = mlflow_server.url
    name = "digits-champion"
    first = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.95), True, tracking_uri=uri))
    assert first["champion"] is True and first["previous_champion"] is None
    worse = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.93), True, tracking_uri=uri))
    assert worse["champion"] is False and worse["version"] == first["version"] + 1
    failed = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.99), False, tracking_uri=uri))
    assert failed["champion"] is False
    better = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.97), True, tracking_uri=uri))
    assert better["champion"] is True and better["previous_champion"] == first["version"]
    # the step's log says why the alias moved or stayed
    from kfp_pytorch.components.register import champion_note

    v = first["version"]
    assert champion_note(first, "accuracy", True) == f"version {v} is the first champion of 'digits-champion' (accuracy 0.9500)"
    assert champion_note(worse, "accuracy", True) == (f"version {v + 1} is registered, not champion: accuracy 0.9300 "
                                                      f"does not beat version {v}'s 0.9500 (a tie keeps the champion)")
    assert champion_note(failed, "accuracy", False) == (f"version {v + 2} is registered for audit only (tagged "
                                                        f"gate=failed); the champion stays version {v}")
    assert champion_note(better, "accuracy", True) == f"version {v + 3} is the champion: accuracy 0.9700 beats version {v}'s 0.9500"
    # a champion registered before min_recall was measured: the first version judged on it takes over
    judged = register(RegisterSpec(trained_model.model_uri, name, {**_metrics(0.96), "min_recall": 0.9}, True,
                                   metric="min_recall", tracking_uri=uri))
    assert judged["champion"] is True and champion_note(judged, "min_recall", True) == (
        f"version {v + 4} is the champion (min_recall 0.9000): champion version {v + 3} has no test min_recall to "
        "compare, so the version that has one takes over")
    assert champion_note({"name": name, "version": 1, "champion": False, "previous_champion": None, "value": 0.5},
                         "accuracy", False) == "version 1 is registered for audit only (tagged gate=failed); there is no champion"
    client = mlflow.MlflowClient(uri)
    assert int(client.get_model_version_by_alias(name, "champion").version) == judged["version"]
    assert client.get_model_version(name, str(failed["version"])).tags["gate"] == "failed"
    # The registered model loads as an MLflow pyfunc (artifacts went to S3) and predicts.
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    import numpy as np

    assert model.predict(np.zeros((3, 64), dtype=np.float32)).shape == (3,)
    # a table is read by column name: another order and an id and the label beside the features
    # predict as the features in training order do; a missing feature is named
    import pandas as pd

    from kfp_pytorch.components.prepare_data import load_table

    table = load_table("sample://digits").head(40)
    features = [c for c in table.columns if c != "label"]
    expected = model.predict(table[features].to_numpy(np.float32))
    assert (expected == table["label"].to_numpy()).mean() > 0.8  # the right rows: mostly right answers
    shuffled = table[["label", *features[::-1]]].assign(id=[f"r{i}" for i in range(len(table))])
    assert (model.predict(shuffled) == expected).all()
    assert (model.predict(pd.DataFrame(table[features].to_numpy())) == expected).all()  # numbered: by position
    # each class's probability, on request, in columns named as serve predict --probabilities names them
    probs = model.predict(shuffled, params={"probabilities": True})
    assert list(probs.columns) == ["label", *[f"p_{c}" for c in range(10)]]
    assert (probs["label"].to_numpy() == expected).all()
    p = probs[[f"p_{c}" for c in range(10)]].to_numpy()
    assert np.allclose(p.sum(axis=1), 1, atol=1e-5) and (p.argmax(axis=1) == expected).all()
    with pytest.raises(Exception, match=r"the input lacks 2 of the model's 64 feature columns: \['pixel_0_3', 'pixel_7_7'\]"):
        model.predict(shuffled.drop(columns=["pixel_0_3", "pixel_7_7"]))
    # ... and where kfp-pytorch is not installed: MLflow, torch and numpy are all it declares and needs
    code = ("import sys; sys.modules['kfp_pytorch'] = sys.modules['minio'] = None\n"
            "import mlflow, numpy as np\n"
            f"mlflow.set_tracking_uri({uri!r})\n"
            f"print(mlflow.pyfunc.load_model('models:/{name}@champion').predict(np.zeros((2, 64), 'float32')).tolist())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and r.stdout.strip().startswith("["), r.stderr[-2000:]
    reqs = mlflow.pyfunc.get_model_dependencies(f"models:/{name}@champion")
    assert {line.split("==")[0] for line in open(reqs).read().split()} == {"mlflow", "torch", "numpy"}


def test_embedded_sqlite_store_is_the_default(trained_model, tmp_path, capfd):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = register(RegisterSpec(trained_model.model_uri, "digits-embedded", _metrics(0.9), True))
    advice = [str(w.message) for w in caught if "input example" in str(w.message) or "type hints" in str(w.message)]
    assert advice == []  # MLflow's advice that does not apply to this model is not printed in every step's log
    assert "Downloading artifacts" not in capfd.readouterr().err  # no bar redrawn line by line into a log
    assert res["champion"] is True
    import os

    assert os.path.exists(os.path.join(os.environ["KFP_PYTORCH_HOME"], "mlflow.db"))


def _at_once(ready: str, go: str, *args: str, n: int = 4) -> list[str]:
    """Each of ``n`` processes runs ``ready`` (imports, a connection), waits for one start time,
    then runs ``go``; their outputs, once all have succeeded. sys.argv[1] is the start time."""
    code = ("import os, sys, time; from kfp_pytorch.components.tracking import Tracker\n" + ready
            + "time.sleep(max(0, float(sys.argv[1]) - time.time()))\n" + go)
    start = str(time.time() + 10)  # time enough for every process to be ready: they race from there
    procs = [subprocess.Popen([sys.executable, "-c", code, start, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [err[-600:] for _, err in outs]
    return [out.strip() for out, _ in outs]


def test_runs_that_open_a_new_embedded_store_at_once_all_open_it(tmp_path):
    # Two runs at once on a fresh KFP_PYTORCH_HOME (two notebooks, a scheduled and a manual run):
    # each found no tables in the sqlite store and created them, and one failed its train step
    # with "table experiments already exists". Four processes, released together.
    outs = _at_once("import mlflow\n", "print(Tracker(sys.argv[2]).experiment_id)", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(set(outs)) == 1  # one experiment, found by all four


def test_a_version_fetched_by_several_processes_at_once_is_downloaded_once(mlflow_server, trained_model, tmp_path):
    # serve start and serve predict of one version at once: each downloaded it and replaced the
    # folder, the one that another had just returned (and a server started from) among them
    v = register(RegisterSpec(trained_model.model_uri, "fetched-at-once", _metrics(0.95), True,
                              tracking_uri=mlflow_server.url))["version"]
    outs = _at_once("t = Tracker(sys.argv[2], experiment=None)\n",
                    "d = t.fetch_model(sys.argv[3], sys.argv[4])['model_dir']; print(d, os.stat(d.parent).st_ino)",
                    mlflow_server.url, f"models:/fetched-at-once/{v}", str(tmp_path / "models"))
    assert len(set(outs)) == 1, outs  # one folder, never replaced under another's feet
    [folder] = [p for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")]
    assert outs[0].startswith(f"{folder}/") and (folder / "MLmodel").is_file()
    assert not [p for p in (tmp_path / "models").iterdir() if p.is_dir() and p.name.startswith(".")]  # no download left


def test_unreachable_tracking_server_is_reported(trained_model):
    with pytest.raises(RegistryError) as e:
        register(RegisterSpec(trained_model.model_uri, "x", _metrics(0.9), True,
                              tracking_uri=f"http://127.0.0.1:{free_port()}"))
    assert "cannot reach the MLflow tracking server" in str(e.value)


def test_an_mlflow_server_with_auth_and_tls_says_what_the_step_lacks(mlflow_auth_server, trained_model, s3, tmp_path,
                                                                     monkeypatch):
    """MLflow's basic-auth app, then the same server behind TLS signed by a private CA."""
    import ssl

    from mlflow.server.auth.client import AuthServiceClient

    from conftest import MLFLOW_ADMIN_PASSWORD
    from fake_trainer_status import _self_signed
    from servers import tls_proxy

    uri, name = mlflow_auth_server.url, "digits-auth"
    spec = RegisterSpec(trained_model.model_uri, name, _metrics(0.9), True, tracking_uri=uri)
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RegistryError) as e:
        register(spec)
    assert e.value.message == f"open experiment: the MLflow server at {uri} requires credentials (You are not authenticated)"
    assert e.value.hint.startswith("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    assert "platform file's mlflow_secret" in e.value.hint
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
    with pytest.raises(RegistryError, match=r"the MLflow server at .* refused the credentials of user 'admin' "):
        register(spec)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_ADMIN_PASSWORD)
    assert register(spec)["champion"] is True  # the admin creates the experiment and the model
    # a user who may read them but not write (the server's default permission is READ)
    AuthServiceClient(uri).create_user("bob", "bob-Passw0rd-123")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "bob-Passw0rd-123")
    with pytest.raises(RegistryError) as e:
        register(spec)
    assert e.value.message == f"register model: the MLflow server at {uri} denies user 'bob' (Permission denied)"
    assert e.value.hint.startswith("ask the MLflow admin to give user 'bob' EDIT on the experiment 'kfp-pytorch'")

    # behind TLS with the company's CA: untrusted until MLFLOW_TRACKING_SERVER_CERT_PATH names that CA
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_ADMIN_PASSWORD)
    ca, cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    listener, https = tls_proxy(int(uri.rsplit(":", 1)[1]), tls)
    try:
        over_tls = RegisterSpec(trained_model.model_uri, name, _metrics(0.95), True, tracking_uri=https)
        with pytest.raises(RegistryError) as e:
            register(over_tls)
        assert e.value.message == (f"open experiment: the MLflow server at {https} has a TLS certificate this machine "
                                   "does not trust (unable to get local issuer certificate)"), e.value.message
        assert e.value.hint.startswith("set MLFLOW_TRACKING_SERVER_CERT_PATH")
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(tmp_path / "missing.pem"))
        with pytest.raises(RegistryError, match="MLFLOW_TRACKING_SERVER_CERT_PATH: no such file"):
            register(over_tls)
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca))
        assert register(over_tls)["champion"] is True
    finally:
        listener.close()


def test_the_train_step_checks_mlflow_before_it_trains(mlflow_auth_server, digits_data, tmp_path, monkeypatch):
    # a step whose MLflow refused it trained for hours first, then failed to record the run
    from kfp.dsl import Dataset, Metrics, Model

    from kfp_pytorch.components.ops.train import train_op

    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    model = Model(uri=str(tmp_path / "model"))
    model.path = str(tmp_path / "model")
    with pytest.raises(RegistryError, match="requires credentials"):
        train_op.python_func(dataset=Dataset(uri=digits_data, metadata={"uri": digits_data}), model=model,
                             metrics=Metrics(uri=str(tmp_path / "metrics")), epochs=1, workers=1,
                             tracking_uri=mlflow_auth_server.url)
    assert not (tmp_path / "model").exists()  # nothing trained, no checkpoint written


def test_the_train_step_records_each_epoch_and_the_exported_one_in_mlflow(mlflow_server, digits_data, tmp_path):
    from kfp.dsl import Dataset, Metrics, Model
    from mlflow import MlflowClient

    from kfp_pytorch.components.ops.train import train_op
    from kfp_pytorch.components.prepare_data import read_metadata
    from kfp_pytorch.components.tracking import dataset_input

    model, metrics = Model(uri=str(tmp_path / "model")), Metrics(uri=str(tmp_path / "metrics"))
    model.path = str(tmp_path / "model")
    out = train_op.python_func(dataset=Dataset(uri=digits_data, metadata={"uri": digits_data}), model=model,
                               metrics=metrics, epochs=2, workers=1, early_stopping_patience=4,
                               tracking_uri=mlflow_server.url)
    run = MlflowClient(mlflow_server.url).get_run(out.mlflow_run_id)
    assert run.data.params["early_stopping_patience"] == "4" and run.data.params["epochs"] == "2"
    assert [m.step for m in MlflowClient(mlflow_server.url).get_metric_history(run.info.run_id, "val_loss")] == [1, 2]
    assert run.data.metrics["exported_epoch"] == 2 and run.data.metrics["epochs_trained"] == 2
    assert metrics.metadata["exported_epoch"] == 2 and metrics.metadata["epochs_trained"] == 2
    assert model.metadata["mlflow_run_id"] == out.mlflow_run_id
    # the prepared table is the run's training dataset: MLflow's "Datasets used", found by its digest
    [used] = run.inputs.dataset_inputs
    data = read_metadata(digits_data)
    assert [(t.key, t.value) for t in used.tags] == [("mlflow.data.context", "training")]
    assert used.dataset.name == "digits" and used.dataset.source_type == "code"
    assert json.loads(used.dataset.source) == {"tags": {"uri": "sample://digits"}}
    assert [c["name"] for c in json.loads(used.dataset.schema)["mlflow_colspec"]] == [*data["features"], "label"]
    assert json.loads(used.dataset.profile) == {"num_rows": 1797, "train_rows": 1257, "val_rows": 270, "test_rows": 270,
                                                "num_classes": 10, "repeated_rows": 0, "test_rows_in_train": 0}
    again = dataset_input(data).dataset  # the same prepared data: the same digest; other shards, another
    other = dataset_input({**data, "shards": {"train": [{"sha256": "0" * 64}]}}).dataset
    assert used.dataset.digest == again.digest != other.digest and len(again.digest) == 12


def test_a_server_too_old_for_dataset_inputs_still_records_the_run(mlflow_server, digits_data, capsys):
    """MLflow before 2.4 has no runs/log-inputs endpoint: Flask's 404. The run keeps its metrics."""
    from http.server import BaseHTTPRequestHandler

    from mlflow import MlflowClient

    from kfp_pytorch.components.prepare_data import read_metadata
    from kfp_pytorch.components.tracking import Tracker
    from servers import forward, reply, serve_in_thread, stop_http

    class OldServer(BaseHTTPRequestHandler):
        def _forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            if "log-inputs" in self.path:
                return reply(self, 404, b"<!doctype html><title>404 Not Found</title>", "text/html")
            forward(self, mlflow_server.url, body)

        do_GET = do_POST = _forward

        def log_message(self, *a):
            pass

    old, url = serve_in_thread(OldServer)
    try:
        history = [{"epoch": 1, "loss": 0.5, "accuracy": 0.8, "val_loss": 0.6, "val_accuracy": 0.7,
                    "samples_per_second": 100.0}]
        rid = Tracker(url).log_training("train-old", {"epochs": 1}, history, data=read_metadata(digits_data))
    finally:
        stop_http(old)
    run = MlflowClient(mlflow_server.url).get_run(rid)
    assert run.data.metrics["val_accuracy"] == 0.7 and run.data.params["epochs"] == "1"
    assert run.info.status == "FINISHED" and not run.inputs.dataset_inputs
    err = capsys.readouterr().err
    assert f"warning: the MLflow server at {url} did not record the training dataset (" in err
    assert "the run's metrics are recorded without it" in err


def test_a_model_of_other_inputs_never_takes_the_champions_place(mlflow_server, trained_model, tmp_path):
    """A version trained on another table (other features, other classes) was promoted by a metric
    measured on other data, and its endpoint then refused every client of the champion."""
    import shutil

    from kfp_pytorch.components.register import champion_note

    uri, name = mlflow_server.url, "digits-inputs"
    other = shutil.copytree(trained_model.model_uri, tmp_path / "other")
    meta = json.loads((other / "metadata.json").read_text())
    meta["features"] = [f"f{i}" for i in range(len(meta["features"]))]  # same shape, another table's columns
    (other / "metadata.json").write_text(json.dumps(meta))
    first = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.95), True, tracking_uri=uri))
    assert first["champion"] is True and first["inputs"] == "64 features, 10 classes (0, 1, 2, 3, ...)"
    moved = register(RegisterSpec(str(other), name, _metrics(0.99), True, tracking_uri=uri))
    v = first["version"]
    assert moved["champion"] is False and moved["previous_inputs"] == first["inputs"]
    note = champion_note(moved, "accuracy", True)
    assert note.startswith(f"version {v + 1} is registered, not champion: it takes other inputs than champion "
                           f"version {v} (64 features, 10 classes (0, 1, 2, 3, ...); the champion: 64 features, ")
    assert f"set_registered_model_alias('{name}', 'champion', '{v + 1}')" in note
    client = mlflow.MlflowClient(uri)
    tags = [client.get_model_version(name, str(x)).tags for x in (v, v + 1)]
    assert tags[0]["inputs"] != tags[1]["inputs"] and tags[1]["gate"] == "passed"
    # the same inputs again: judged by the metric, as before
    same = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.97), True, tracking_uri=uri))
    assert same["champion"] is True and same["previous_inputs"] is None and same["previous_champion"] == v
    # a champion registered before versions kept their inputs: nothing to tell them apart, the metric decides
    client.delete_model_version_tag(name, str(same["version"]), "inputs")
    assert register(RegisterSpec(str(other), name, _metrics(0.98), True, tracking_uri=uri))["champion"] is True
    from kfp_pytorch.components.tracking import model_interface

    assert model_interface(tmp_path / "no-such-model") == (None, "inputs not known (no metadata.json)")


def test_register_validates_name_and_metric(trained_model):
    with pytest.raises(ConfigError) as e:
        register(RegisterSpec(trained_model.model_uri, "bad name!", {"accuracy": 1.0}, True, metric="auc"))
    assert "model_name" in str(e.value) and "metric" in str(e.value)


def test_a_registry_that_refuses_the_champion_read_stops_the_step(mlflow_server, trained_model, s3):
    """Only "no such model / no such alias" means no champion; a refused read must not promote a worse model."""
    from http.server import BaseHTTPRequestHandler

    from servers import forward, reply, serve_in_thread, stop_http

    name = "digits-guarded"
    first = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.95), True, tracking_uri=mlflow_server.url))
    assert first["champion"] is True

    class AuthProxy(BaseHTTPRequestHandler):
        """An auth proxy in front of the real server that denies registry reads to this user."""

        def _forward(self):
            if "/registered-models/" in self.path and self.command == "GET":
                return reply(self, 403, b'{"error_code": "PERMISSION_DENIED", "message": "no read access to the registry"}')
            forward(self, mlflow_server.url, self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        def log_message(self, *args):
            pass

    server, url = serve_in_thread(AuthProxy)
    try:
        with pytest.raises(RegistryError, match=r"register model: the MLflow server at .* denies this caller \(no read access to the registry\)"):
            register(RegisterSpec(trained_model.model_uri, name, _metrics(0.50), True, tracking_uri=url))
    finally:
        stop_http(server)
    # nothing was registered and the champion did not move
    client = mlflow.MlflowClient(mlflow_server.url)
    assert int(client.get_model_version_by_alias(name, "champion").version) == first["version"]
    assert {int(v.version) for v in client.search_model_versions(f"name='{name}'")} == {first["version"]}
    # a model with versions but no champion yet: the first version that passes its gate takes it
    client.delete_registered_model_alias(name, "champion")
    again = register(RegisterSpec(trained_model.model_uri, name, _metrics(0.90), True, tracking_uri=mlflow_server.url))
    assert again["champion"] is True and again["previous_champion"] is None


def test_the_weakest_class_and_min_recall_skip_classes_the_test_split_lacks():
    from kfp_pytorch.components.evaluate import compute_metrics, weakest_class

    # class 2 has no test rows but is predicted once: its recall is undefined, not 0
    y, pred = np.array([0, 0, 0, 0, 1, 1]), np.array([0, 0, 0, 2, 1, 0])
    m = compute_metrics(y, pred, [0, 1, 2])
    assert m["min_recall"] == pytest.approx(0.5) and m["macro_recall"] == pytest.approx((0.75 + 0.5 + 0) / 3)
    assert weakest_class(["a", "b", "c"], m["confusion_matrix"]) == {
        "class": "b", "recall": 0.5, "correct": 1, "rows": 2, "taken_for": "a", "taken_rows": 1}
    assert weakest_class(["a", "b"], [[3, 0], [0, 2]]) is None  # every class found in full
    assert weakest_class(["a", "b"], [[0, 0], [0, 0]]) is None
    # a tie goes to the first class, and its rows to the class they went to most
    assert weakest_class(["a", "b", "c"], [[1, 0, 1], [1, 1, 0], [0, 0, 3]])["class"] == "a"
    assert weakest_class(["a", "b", "c"], [[1, 1, 3], [0, 2, 0], [0, 0, 3]])["taken_for"] == "c"
    # the report's per-class table: a class without test rows has no recall, and is not listed as the worst
    from kfp_pytorch.components.evaluate import per_class, render_report

    gate = {"metric": "accuracy", "value": m["accuracy"], "threshold": 0.5, "passed": True}
    html = render_report(m, [], ["a", "b", "c"], gate, classes_report=per_class(y, pred, [0, 1, 2]))
    table = html.split("<th>test rows</th></tr>")[1].split("</table>")[0]
    assert [r.split("</td>")[0] for r in table.split("<tr><td>")[1:]] == ["b", "a", "c"]
    assert "<tr><td>c</td><td>0.0000</td><td>&ndash;</td><td>&ndash;</td><td>0</td></tr>" in table


def test_a_scored_tables_weakest_class_is_found_by_name_or_id():
    import pandas as pd

    from kfp_pytorch.components.batch_predict import weakest_label

    frame = pd.DataFrame({"prediction": ["setosa", "virginica", "versicolor", "versicolor", "virginica"],
                          "label": ["setosa", "versicolor", "versicolor", "virginica", "virginica"]})
    assert weakest_label(frame) == {"class": "versicolor", "recall": 0.5, "correct": 1, "rows": 2,
                                    "taken_for": "virginica", "taken_rows": 1}
    ids = pd.DataFrame({"prediction": [10, 2, 2, 9], "label": [10, 10, 2, 9]})  # ids in number order: 2, 9, 10
    assert weakest_label(ids) == {"class": "10", "recall": 0.5, "correct": 1, "rows": 2, "taken_for": "2",
                                  "taken_rows": 1}
    assert weakest_label(ids.drop(columns="label")) is None and weakest_label(ids.assign(prediction=ids["label"])) is None


def test_a_tables_labels_are_compared_as_predictions_are_written():
    import pandas as pd

    from kfp_pytorch.components.batch_predict import label_text, weakest_label

    assert [label_text(v) for v in (3.0, np.float64(4.0), 7, "setosa", True, 2.5)] == ["3", "4", "7", "setosa", "True", "2.5"]
    assert [label_text(v) for v in (None, float("nan"), np.nan, "", "  ")] == [None] * 5
    # rows without a label are left out of the weakest class
    frame = pd.DataFrame({"prediction": [1, 1, 2, 2], "label": ["1", None, "2", None]})
    assert weakest_label(frame) is None
    assert weakest_label(frame.assign(label=[None] * 4)) is None
