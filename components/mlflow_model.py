"""The MLflow pyfunc flavour of a kfp-pytorch model, logged as *models from code*.

:meth:`~.tracking.Tracker.register` logs this file as the ``python_model`` and
``exported_model.py`` in ``code_paths``; MLflow keeps both beside the model directory and runs this
file when the model is loaded. Nothing is pickled and nothing here imports kfp-pytorch, so
``mlflow.pyfunc.load_model`` and ``mlflow models serve`` work where only MLflow, torch and numpy
are installed (the pip requirements the model declares). Input: rows of raw features. Output: each
row's class (its name where the model has names); with the parameter ``probabilities=True``
(``model.predict(table, params={"probabilities": True})``), a DataFrame of the class and each
class's probability (``label``, ``p_setosa`` ...), for a threshold of one's own.
"""
import mlflow.models
import mlflow.pyfunc
import numpy as np

try:  # as MLflow loads it: exported_model.py is on sys.path from the model's code/ directory
    from exported_model import ExportedModel, lacking, names_of, probability_columns
except ImportError:  # imported from an installed kfp-pytorch (when the model is logged)
    from kfp_pytorch.components.exported_model import ExportedModel, lacking, names_of, probability_columns


class MlflowPredictor(mlflow.pyfunc.PythonModel):
    # predict takes a DataFrame by column name or an array by position (_by_name), which no MLflow
    # type hint says; this is MLflow's own switch (its ChatModel sets it) for a predict it should not
    # wrap in type-hint validation, and without it every log_model warns "Add type hints"
    _skip_type_hint_validation = True

    def load_context(self, context):
        self.model = ExportedModel(context.artifacts["model_dir"])

    def predict(self, context, model_input, params=None):
        rows = np.asarray(_by_name(model_input, self.model.meta.get("features")))
        probs, labels = self.model.predict(rows)
        names = names_of(labels, self.model.class_names)
        shown = labels if names is None else np.asarray(names, dtype=object)
        if not (params or {}).get("probabilities"):
            return shown
        import pandas as pd  # MLflow's own dependency

        columns = probability_columns(probs.shape[1], self.model.class_names)
        return pd.DataFrame({"label": shown, **{c: probs[:, i] for i, c in enumerate(columns)}})


def _by_name(model_input, features):
    """A DataFrame with named columns, as the model's feature columns in training order (another
    order, an id or the label beside them change nothing); anything else, such as an array or a
    frame with numbered columns, as it is, by position.

    No MLflow signature does this: a named one refuses every array, which callers send too."""
    columns = getattr(model_input, "columns", None)
    if columns is None or not features or not all(isinstance(c, str) for c in columns):
        return model_input.to_numpy() if hasattr(model_input, "to_numpy") else model_input
    if missing := lacking(features, set(columns)):
        raise ValueError(f"the input lacks {missing}; send the training table's feature columns (other "
                         "columns are ignored), or an array of them in training order")
    return model_input[list(features)].to_numpy()


mlflow.models.set_model(MlflowPredictor())
