"""The ``@dsl.component`` wrappers, one module per component.

They live apart from the runtime modules because KFP's executor imports a step's code with a
minimal ``kfp.dsl`` in which ``dsl.component`` does not exist: runtime modules must not define
components at import time.
"""
from .evaluate import evaluate_op
from .prepare_data import prepare_data_op
from .register import register_op
from .serve import serve_op
from .train import train_op

__all__ = ["prepare_data_op", "train_op", "evaluate_op", "register_op", "serve_op"]
