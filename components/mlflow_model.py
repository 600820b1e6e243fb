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
        from kfp_pytorch.components.predictor import names_of

        rows = model_input.to_numpy() if hasattr(model_input, "to_numpy") else np.asarray(model_input)
        _, labels = self.runner.predict(rows)
        names = names_of(labels, self.runner.class_names)
        return labels if names is None else np.asarray(names, dtype=object)
