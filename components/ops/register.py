"""KFP component wrapper of :mod:`kfp_pytorch.components.register` (thin: parse inputs, call the runtime)."""
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Input, Metrics, Model

from .._kfp import COMPONENT_KW


@dsl.component(**COMPONENT_KW)
def register_op(model: Input[Model], metrics: Input[Metrics], model_name: str, gate_passed: bool,
                gate_metric: str = "accuracy", tracking_uri: str = ""
                ) -> NamedTuple("Outputs", [("version", int), ("champion", bool), ("registry_uri", str), ("note", str)]):
    """Register a model version in MLflow; move the `champion` alias only if it earned it (note: why
    it moved or stayed)."""
    from collections import namedtuple

    from kfp_pytorch.components.register import RegisterSpec, champion_note, register

    res = register(RegisterSpec(model_uri=model.metadata.get("uri", model.path + "/model"), model_name=model_name,
                                metrics=dict(metrics.metadata), gate_passed=gate_passed, metric=gate_metric,
                                tracking_uri=tracking_uri, run_id=model.metadata.get("mlflow_run_id", "")))
    note = champion_note(res, gate_metric, gate_passed)
    print(f"registered {res['model_uri']}: {note}")
    return namedtuple("Outputs", ["version", "champion", "registry_uri", "note"])(
        int(res["version"]), bool(res["champion"]), res["model_uri"], note)
