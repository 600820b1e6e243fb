"""Reusable KFP v2 components for PyTorch, and the runtime functions behind them.

Each component is a plain runtime function that tests and notebooks call directly, and a thin
``@dsl.component`` wrapper in :mod:`kfp_pytorch.components.ops` (``prepare_data_op``, ``train_op``,
``evaluate_op``, ``register_op``, ``serve_op``) that parses the step's inputs and calls it. Runtime
modules:

- ``prepare_data``: dataset URI -> validated, stratified, normalised shards in the store;
- ``train``: PyTorchJob-shaped distributed training (``local`` backend: torchrun workers running
  ``train_worker``; ``cluster`` backend: a PyTorchJob or TrainJob built by ``cluster`` and
  followed by ``cluster_run``);
- ``evaluate``: test metrics, confusion matrix, HTML report, pass/fail gate;
- ``register``: MLflow model registry with a guarded ``champion`` alias (``mlflow_model``: the
  pyfunc flavour);
- ``serve``: Open Inference Protocol v2 model server (``kserve_predictor``: the KServe ``Model``
  class), locally or as a KServe InferenceService; ``batch_predict`` scores a whole table.

Edges (one module per outside system): ``storage`` (S3/MinIO via the ``minio`` SDK), ``tracking``
(MLflow) and ``k8s`` (the Kubernetes API). Errors users act on are in ``errors``.
"""
