"""The MLflow pyfunc flavour of a kfp-pytorch model, so ``mlflow models serve`` works too."""
from __future__ import annotations

import mlflow.pyfunc
import numpy as np


class MlflowPredictor(mlflow.pyfunc.PythonModel):
    """Wraps :class:`~kfp_pytorch.components.predictor.ModelRunner`; input: rows of raw features."""

    def load_context(self, context):
        from kfp_pytorch.components.predictor import ModelRunner

        self.runner = ModelRunner(context.artifacts["model_dir"])

    def predict(self, context, model_input, params=None):
        rows = model_input.to_numpy() if hasattr(model_input, "to_numpy") else np.asarray(model_input)
        _, labels = self.runner.predict(rows)
        return labels
