"""``register``: put the trained model in the MLflow registry, guarded by the evaluation gate.

The ``champion`` alias moves only if the gate passed *and* the new version beats the current
champion on the gate metric; otherwise the version is registered (for audit) and tagged
``gate=failed`` or left as a challenger.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .storage import Storage
from .tracking import Tracker


@dataclass(frozen=True)
class RegisterSpec:
    model_uri: str
    model_name: str
    metrics: dict
    gate_passed: bool
    metric: str = "accuracy"
    tracking_uri: str = ""
    """Empty: the embedded sqlite store under KFP_PYTORCH_HOME."""
    run_id: str = ""
    """MLflow run of the training job, to attach the model to."""

    def validate(self) -> None:
        import re

        problems = []
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", self.model_name or ""):
            problems.append(f"model_name: use letters, digits, '-', '_' or '.', at most 128, got {self.model_name!r}")
        if self.metric not in self.metrics:
            problems.append(f"metric: {self.metric!r} is not among the evaluation metrics {sorted(self.metrics)}")
        if problems:
            raise ConfigError(problems, title="invalid register settings")


def register(spec: RegisterSpec, storage: Storage | None = None) -> dict:
    from .predictor import read_model_metadata

    spec.validate()
    storage = storage or Storage()
    read_model_metadata(spec.model_uri, storage)  # a wrong URI is named, not registered as an empty model
    tracker = Tracker(spec.tracking_uri or None)
    with tempfile.TemporaryDirectory(prefix="kfp-pytorch-register-") as tmp:
        local = storage.download_dir(spec.model_uri, Path(tmp) / "model")
        return tracker.register(spec.model_name, local, spec.metrics, spec.gate_passed, spec.metric,
                                run_id=spec.run_id or None)


def champion_note(res: dict, metric: str, gate_passed: bool) -> str:
    """Why the ``champion`` alias moved or stayed, in one line, from :func:`register`'s result. Pure."""
    v, prev, old = res["version"], res.get("previous_champion"), res.get("previous_value")
    if res["champion"]:
        if prev is None:
            return f"version {v} is the first champion of {res['name']!r} ({metric} {res['value']:.4f})"
        if old is None:  # registered before the metric was measured, or judged on another one
            return (f"version {v} is the champion ({metric} {res['value']:.4f}): champion version {prev} has no test "
                    f"{metric} to compare, so the version that has one takes over")
        return f"version {v} is the champion: {metric} {res['value']:.4f} beats version {prev}'s {old:.4f}"
    if not gate_passed:
        return (f"version {v} is registered for audit only (tagged gate=failed); "
                + (f"the champion stays version {prev}" if prev is not None else "there is no champion"))
    if res.get("previous_inputs"):
        return (f"version {v} is registered, not champion: it takes other inputs than champion version {prev} "
                f"({res['inputs']}; the champion: {res['previous_inputs']}), so its {metric} is not compared and the "
                f"clients of {res['name']!r} keep the champion; to serve it, register it under a model_name of its "
                f"own, or make it the champion by hand: MlflowClient().set_registered_model_alias("
                f"{res['name']!r}, 'champion', '{v}')")
    return (f"version {v} is registered, not champion: {metric} {res['value']:.4f} does not beat version {prev}'s "
            f"{old:.4f} (a tie keeps the champion)")
