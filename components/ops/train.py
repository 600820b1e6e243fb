"""KFP component wrapper of :mod:`kfp_pytorch.components.train` (thin: parse inputs, call the runtime)."""
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from .._kfp import COMPONENT_KW


@dsl.component(**COMPONENT_KW)
def train_op(dataset: Input[Dataset], model: Output[Model], metrics: Output[Metrics], model_arch: str = "mlp",
             epochs: int = 8, batch_size: int = 64, lr: float = 0.005, seed: int = 42, workers: int = 2,
             max_restarts: int = 3, backend: str = "local", storage_root: str = "",
             tracking_uri: str = "", nodes: int = 1, gpus_per_node: int = 0, run_id: str = "",
             task_name: str = "train", checkpoint_every_s: float = 600.0,
             early_stopping_patience: int = 0, class_weight: str = "none",
             lr_schedule: str = "constant", weight_decay: float = 0.0) -> NamedTuple("Outputs", [("mlflow_run_id", str), ("samples_per_second", float)]):
    """Distributed training as a PyTorchJob-shaped job; logs per-epoch metrics to KFP and MLflow.
    ``early_stopping_patience`` > 0: stop once that many epochs have not lowered the validation
    loss, and export the best epoch's weights. ``class_weight="balanced"``: a rare class's rows weigh
    more in the loss, as much in all as a common class's. ``run_id`` and ``task_name`` name the
    cluster job (``backend="cluster"``): pass ``dsl.PIPELINE_JOB_ID_PLACEHOLDER``
    and ``dsl.PIPELINE_TASK_NAME_PLACEHOLDER``, so that the job is found by its run in ``kubectl``;
    left empty, it is named from this step's output URI, which is as unique."""
    import os
    from collections import namedtuple

    from kfp_pytorch.components._kfp import (CHECKPOINT_NOTE_ENV, RESUME_ENV, artifact_store_uri, checkpoint_note_path,
                                             mark_local_run, resumed_output_uri)
    from kfp_pytorch.components.prepare_data import read_metadata
    from kfp_pytorch.components.tracking import Tracker
    from kfp_pytorch.components.train import TrainSpec, seed_checkpoint, train

    mark_local_run(model)
    out = artifact_store_uri(model, storage_root)
    if note := checkpoint_note_path(model, out):  # a local run's checkpoints on S3, noted in its folder
        os.environ[CHECKPOINT_NOTE_ENV] = str(note)
    spec = TrainSpec(dataset_uri=dataset.metadata.get("uri", dataset.path), output_uri=out, model=model_arch,
                     epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, workers=workers,
                     max_restarts=max_restarts, backend=backend, nodes=nodes, gpus_per_node=gpus_per_node,
                     run_id=run_id, task=task_name, checkpoint_every_s=checkpoint_every_s,
                     early_stopping_patience=early_stopping_patience, class_weight=class_weight,
                     lr_schedule=lr_schedule, weight_decay=weight_decay)
    if resumed := os.environ.get(RESUME_ENV):  # a local run that resumes another: from its checkpoint
        done = seed_checkpoint(spec, resumed_output_uri(model, storage_root, resumed))
        print(f"[kfp-pytorch] training resumes from {resumed}'s last checkpoint ({done} epoch(s) trained)"
              if done is not None else f"note: {resumed} left no training checkpoint: training starts from the beginning",
              flush=True)
    # MLflow first: a server that is down or refuses the credentials fails the step now, not after
    # the hours of training it would then not record
    tracker = Tracker(tracking_uri or None)
    result = train(spec)
    for h in result.history:
        for k in ("loss", "accuracy", "val_accuracy", "samples_per_second"):
            metrics.log_metric(f"epoch{h['epoch']:02d}_{k}", round(float(h[k]), 6))
    final = result.exported  # the last epoch's, or with early stopping the best one's
    metrics.log_metric("final_val_accuracy", float(final["val_accuracy"]))
    metrics.log_metric("exported_epoch", final["epoch"])
    metrics.log_metric("epochs_trained", len(result.history))
    metrics.log_metric("restarts", result.restarts)
    run_id = tracker.log_training(
        f"train-{model_arch}", {k: getattr(spec, k) for k in ("model", "epochs", "batch_size", "lr", "seed", "workers",
                                                              "early_stopping_patience", "class_weight",
                                                              "lr_schedule", "weight_decay")},
        result.history, summary={"exported_epoch": final["epoch"], "epochs_trained": len(result.history)},
        data=read_metadata(spec.dataset_uri))
    model.metadata.update({"uri": result.model_uri, "framework": "pytorch", "model_arch": model_arch,
                           "mlflow_run_id": run_id, "val_accuracy": float(final["val_accuracy"])})
    rate = sum(h["samples_per_second"] for h in result.history) / len(result.history)
    return namedtuple("Outputs", ["mlflow_run_id", "samples_per_second"])(run_id, float(rate))
