"""Reusable KFP v2 components for PyTorch, and the runtime functions behind them.

Each component module holds a plain runtime function that tests call directly, and a thin
``@dsl.component`` wrapper (``*_op``) that parses inputs and calls it. Modules:

- ``prepare_data``: dataset URI -> validated, stratified, normalised shards in the store;
- ``train``: PyTorchJob-shaped distributed training (``local`` backend: torchrun workers);
- ``evaluate``: test metrics, confusion matrix, HTML report, pass/fail gate;
- ``register``: MLflow model registry with a guarded ``champion`` alias;
- ``serve``: Open Inference Protocol v2 model server (KServe ``Model`` class).

Edges (one module per outside system): ``storage`` (S3/MinIO via the ``minio`` SDK) and
``tracking`` (MLflow).
"""
