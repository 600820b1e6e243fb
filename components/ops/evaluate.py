"""KFP component wrapper of :mod:`kfp_pytorch.components.evaluate` (thin: parse inputs, call the runtime)."""
from kfp import dsl
from kfp.dsl import HTML, ClassificationMetrics, Dataset, Input, Metrics, Model, Output

from .._kfp import COMPONENT_KW


@dsl.component(**COMPONENT_KW)
def evaluate_op(dataset: Input[Dataset], model: Input[Model], metrics: Output[Metrics],
                confusion: Output[ClassificationMetrics], report: Output[HTML], threshold: float = 0.9,
                gate_metric: str = "accuracy") -> bool:
    """Test metrics (ROC AUC among them), confusion matrix (and for two classes the ROC curve) and an
    HTML report; returns whether metric >= threshold.

    The single ``bool`` output (not a NamedTuple) keeps ``dsl.If(evaluate.output)`` resolvable by
    kfp.local's orchestrator, which cannot resolve named outputs in conditions.
    """
    from kfp_pytorch.components._kfp import mark_local_run
    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate

    mark_local_run(metrics)

    res = evaluate(EvaluateSpec(dataset_uri=dataset.metadata.get("uri", dataset.path),
                                model_uri=model.metadata.get("uri", model.path + "/model"),
                                threshold=threshold, metric=gate_metric))
    scalars = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
    for k, v in scalars.items():
        metrics.log_metric(k, v)
    metrics.log_metric("gate_passed", int(res["gate"]["passed"]))
    if res.get("gate_note"):
        print(f"note: {res['gate_note']}")
    names = res["class_names"]  # the KFP UI's confusion matrix reads best with the classes' names
    confusion.log_confusion_matrix([names[c] if names else str(c) for c in res["classes"]],
                                   res["metrics"]["confusion_matrix"])
    if res.get("roc"):  # two classes: the KFP UI draws the ROC curve beside the matrix
        roc = res["roc"]
        confusion.log_roc_curve(roc["fpr"], roc["tpr"], roc["thresholds"])
    with open(report.path, "w") as f:
        f.write(res["report_html"])
    return bool(res["gate"]["passed"])
