"""``train_and_serve``: prepare -> train -> evaluate -> (gate) register -> serve.

The same pipeline runs on one machine (kfp.local, local DDP workers, local model server) and,
unchanged, on a Kubeflow cluster (the ``backend`` parameters select PyTorchJob and KServe there).
Every arrow carries a URI in artifact metadata, never data bytes in parameters.
"""
import math
import re

from kfp import dsl

from kfp_pytorch.components.cluster import replicas_problems
from kfp_pytorch.components.evaluate import GATE_METRICS
from kfp_pytorch.components.ops.evaluate import evaluate_op
from kfp_pytorch.components.prepare_data import columns_problems, parse_columns, sample_problem, seed_problem
from kfp_pytorch.components.storage import StorageError, parse_uri
from kfp_pytorch.components.tracking import tracking_uri_problem
from kfp_pytorch.components.train import BUILTIN_MODELS, gpu_share_problem, training_settings_problems
from kfp_pytorch.components.ops.prepare_data import prepare_data_op
from kfp_pytorch.components.ops.register import register_op
from kfp_pytorch.components.ops.serve import serve_op
from kfp_pytorch.components.ops.train import train_op

from .platform import Platform, apply_platform


def build(platform: Platform | None = None):
    """The pipeline; with ``platform`` every step gets its Kubernetes settings (see platform.py)."""

    @dsl.pipeline(name="train-and-serve",
                  description="Prepare a dataset, train a PyTorch model with DDP, evaluate it, and if it passes the "
                              "gate register it in MLflow and serve it over the Open Inference Protocol v2.")
    def train_and_serve(dataset_uri: str = "sample://digits", model_name: str = "digits", model_arch: str = "mlp",
                        epochs: int = 8, batch_size: int = 64, lr: float = 0.005, seed: int = 42, workers: int = 2,
                        threshold: float = 0.9, storage_root: str = "", tracking_uri: str = "",
                        train_backend: str = "local", serve_backend: str = "local", serve_port: int = 0,
                        nodes: int = 1, gpus_per_node: int = 0, canary_traffic_percent: int = -1,
                        checkpoint_every_s: float = 600.0, serve_min_replicas: int = 1,
                        serve_max_replicas: int = 1, label_column: str = "label", feature_columns: str = "",
                        early_stopping_patience: int = 0, gate_metric: str = "accuracy",
                        class_weight: str = "none", lr_schedule: str = "constant", weight_decay: float = 0.0):
        prep = prepare_data_op(dataset_uri=dataset_uri, label_column=label_column, feature_columns=feature_columns,
                               seed=seed, storage_root=storage_root)
        prep.set_display_name("prepare data")
        # Never cached: KFP keys its cache on the inputs, and dataset_uri names data that changes
        # under it (a nightly export to the same key), so a scheduled retraining would reuse the
        # first run's dataset forever. A fresh dataset artifact makes train miss the cache too;
        # evaluate, a function of its inputs, may hit it.
        prep.set_caching_options(False)
        apply_platform(prep, platform)
        tr = train_op(dataset=prep.outputs["dataset"], model_arch=model_arch, epochs=epochs, batch_size=batch_size,
                      lr=lr, seed=seed, workers=workers, backend=train_backend, storage_root=storage_root,
                      tracking_uri=tracking_uri, nodes=nodes, gpus_per_node=gpus_per_node,
                      checkpoint_every_s=checkpoint_every_s, early_stopping_patience=early_stopping_patience,
                      class_weight=class_weight, lr_schedule=lr_schedule,
                      weight_decay=weight_decay, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                      task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER)
        tr.set_display_name("train (PyTorchJob)")
        apply_platform(tr, platform, gpu=True, mlflow=True)  # local backend: the workers run in this pod
        ev = evaluate_op(dataset=prep.outputs["dataset"], model=tr.outputs["model"], threshold=threshold,
                         gate_metric=gate_metric)
        ev.set_display_name("evaluate")
        apply_platform(ev, platform)
        with dsl.If(ev.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 (KFP condition syntax)
            reg = register_op(model=tr.outputs["model"], metrics=ev.outputs["metrics"], model_name=model_name,
                              gate_passed=ev.outputs["Output"], gate_metric=gate_metric, tracking_uri=tracking_uri)
            reg.set_display_name("register (MLflow)")
            reg.set_caching_options(False)  # acts on MLflow: a cached step would register nothing
            apply_platform(reg, platform, mlflow=True)
            # Only a new champion is served: a retraining that passes the gate but does not beat the
            # champion replaced it at the endpoint, while the registry kept the better one. The step
            # decides, given register's verdict: kfp.local (2.17) cannot read a NamedTuple output in
            # a condition nested in another, so a dsl.If here never served locally.
            sv = serve_op(model=tr.outputs["model"], model_name=model_name, port=serve_port, backend=serve_backend,
                          canary_traffic_percent=canary_traffic_percent, min_replicas=serve_min_replicas,
                          max_replicas=serve_max_replicas, champion=reg.outputs["champion"],
                          registered_model=reg.outputs["registry_uri"])
            sv.set_display_name("serve (KServe v2)")
            sv.set_caching_options(False)  # acts on the cluster: a cached step would report a server it did not check
            apply_platform(sv, platform)

    train_and_serve.pipeline_func.param_docs = PARAM_DOCS
    return train_and_serve


# The pipeline's parameters that shape the training job, by the TrainSpec field each sets: the train
# step gets them through train_op, and `manifest`'s dry run builds the same job from them.
TRAIN_SPEC_PARAMS = {
    "model": "model_arch", "epochs": "epochs", "batch_size": "batch_size", "lr": "lr", "seed": "seed",
    "workers": "workers", "nodes": "nodes", "gpus_per_node": "gpus_per_node", "checkpoint_every_s": "checkpoint_every_s",
    "early_stopping_patience": "early_stopping_patience", "class_weight": "class_weight", "lr_schedule": "lr_schedule",
    "weight_decay": "weight_decay",
}

# The tracking URIs MLflow opens a store for (a driver may follow '+': postgresql+psycopg2://).


def validate_params(p: dict) -> list[str]:
    """Every problem with a full parameter set (defaults applied), with the parameter's name."""
    problems = []
    if not p["dataset_uri"]:
        problems.append("dataset_uri: must be set (a path, s3://bucket/key.csv or sample://digits)")
    elif problem := sample_problem(p["dataset_uri"]):
        problems.append(problem)
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", p["model_name"]):
        problems.append(f"model_name: must be a DNS-1123 label (lower-case letters, digits, '-'), got {p['model_name']!r}")
    if p["model_arch"] not in BUILTIN_MODELS and ":" not in p["model_arch"]:
        problems.append(f"model_arch: must be one of {', '.join(BUILTIN_MODELS)} or 'package.module:function', "
                        f"got {p['model_arch']!r}")
    for k in ("epochs", "batch_size", "workers"):
        if p[k] < 1:
            problems.append(f"{k}: must be >= 1, got {p[k]}")
    if not 0 < p["lr"] < math.inf:  # NaN too
        problems.append(f"lr: must be a finite number > 0, got {p['lr']}")
    problems += columns_problems(p["label_column"], parse_columns(p["feature_columns"]))
    if problem := seed_problem(p["seed"]):
        problems.append(problem)
    problems += training_settings_problems(p)
    if not 0 <= p["threshold"] <= 1:
        problems.append(f"threshold: must be in [0, 1], got {p['threshold']}")
    if p["gate_metric"] not in GATE_METRICS:
        problems.append(f"gate_metric: must be one of {', '.join(GATE_METRICS)}, got {p['gate_metric']!r}")
    if p["storage_root"] and not re.match(r"^(s3|minio)://[^/]+", p["storage_root"]):
        problems.append(f"storage_root: must be s3://BUCKET[/PREFIX] or minio://..., got {p['storage_root']!r}")
    for k in ("storage_root", "dataset_uri"):  # a bucket name S3 would refuse, found before any step or pod
        if re.match(r"^(s3|minio)://[^/]+", p[k]):
            try:
                parse_uri(p[k])
            except StorageError as e:
                problems.append(f"{k}: {e.message}" + (f" ({e.hint})" if e.hint else ""))
    if p["tracking_uri"] and (problem := tracking_uri_problem(p["tracking_uri"])):
        problems.append(problem)
    if not 0 <= p["serve_port"] <= 65535:
        problems.append(f"serve_port: must be in [0, 65535], got {p['serve_port']}")
    for k in ("train_backend", "serve_backend"):
        if p[k] not in ("local", "cluster"):
            problems.append(f"{k}: must be local or cluster, got {p[k]!r}")
        elif p[k] == "cluster" and not p["storage_root"]:
            problems.append(f"{k}: cluster needs storage_root=s3://BUCKET/PREFIX (pods read and write MinIO)")
    if p["nodes"] < 1 or p["workers"] % max(p["nodes"], 1):
        problems.append(f"nodes: must be >= 1 and divide workers ({p['workers']}), got {p['nodes']}")
    if p["gpus_per_node"] < 0:
        problems.append(f"gpus_per_node: must be >= 0, got {p['gpus_per_node']}")
    elif p["train_backend"] == "cluster" and (problem := gpu_share_problem(p["workers"], p["nodes"], p["gpus_per_node"])):
        problems.append(problem)
    if not (p["canary_traffic_percent"] == -1 or 0 <= p["canary_traffic_percent"] <= 100):
        problems.append(f"canary_traffic_percent: -1 (all traffic) or 0..100, got {p['canary_traffic_percent']}")
    problems += replicas_problems(p["serve_min_replicas"], p["serve_max_replicas"], raw_deployment=None,
                                  names=("serve_min_replicas", "serve_max_replicas"))
    return problems


# Parameters that only one backend reads: given for the other, they change nothing.
_BACKEND_ONLY = (
    ("train_backend", "cluster", ("nodes", "gpus_per_node"), "a PyTorchJob's pods and their GPUs"),
    ("serve_backend", "cluster", ("canary_traffic_percent",), "a KServe canary rollout"),
    ("serve_backend", "cluster", ("serve_min_replicas", "serve_max_replicas"), "the InferenceService's replicas"),
    ("serve_backend", "local", ("serve_port",), "the local model server's port"),
)


def inert_params(given: set[str], p: dict) -> list[str]:
    """A note for each group of ``given`` parameters that the chosen backends do not read (the run
    goes ahead: a parameter set shared between a cluster and this machine is not an error)."""
    notes = []
    for backend, needs, names, what in _BACKEND_ONLY:
        unread = [n for n in names if n in given]
        if unread and p.get(backend) != needs:
            many = len(unread) > 1
            notes.append(f"{', '.join(unread)} only appl{'y' if many else 'ies'} with {backend}={needs} ({what}); "
                         f"this run has {backend}={p.get(backend)}, so {'they change' if many else 'it changes'} nothing")
    return notes


PARAM_DOCS = {
    "dataset_uri": "CSV, Parquet, JSON Lines or Feather table (or a folder of Parquet files): local path, s3://bucket/key, minio://bucket/key, or sample://digits",
    "model_name": "registered model and endpoint name (DNS-1123 label)",
    "model_arch": "mlp, cnn (for an image table: columns named as its pixels, pixel0... or pixel_ROW_COL), or a factory package.module:function",
    "epochs": "training epochs",
    "batch_size": "per-worker batch size",
    "lr": "AdamW learning rate",
    "seed": "seed of the split and of training",
    "workers": "DDP worker processes (PyTorchJob replicas x nprocPerNode)",
    "threshold": "minimum test gate_metric for register and serve to run",
    "storage_root": "s3://bucket/prefix for shards, checkpoints and models (empty: the KFP artifact store)",
    "tracking_uri": "MLflow tracking URI (empty: embedded sqlite under KFP_PYTORCH_HOME)",
    "train_backend": "local (torchrun here) or cluster (a PyTorchJob, or a Trainer v2 TrainJob where the step's env sets "
                     "KFP_PYTORCH_TRAIN_KIND=TrainJob)",
    "serve_backend": "local (model server here) or cluster (KServe InferenceService)",
    "serve_port": "local model server port (0: the port of the server already serving model_name, so its URL stays; else a free one)",
    "nodes": "pods of the PyTorchJob or TrainJob (cluster backend); workers are spread over them",
    "gpus_per_node": "GPUs per pod (cluster backend)",
    "canary_traffic_percent": "KServe canary share for the new version (-1: all traffic)",
    "serve_min_replicas": "KServe predictor replicas at least (cluster serving)",
    "serve_max_replicas": "KServe predictor replicas at most: above the minimum, an HPA scales on CPU use",
    "checkpoint_every_s": "seconds between checkpoints within an epoch (0: at epoch ends only)",
    "label_column": "the table's label column: class ids (0, 1, ...) or class names",
    "feature_columns": "comma-separated feature columns, in order (empty: every column but the label)",
    "gate_metric": "the test metric the threshold applies to and a new champion must beat: accuracy, "
                   "macro_f1 for a table where some classes are rare, or min_recall: the worst class's recall",
    "weight_decay": "AdamW's decoupled weight decay, a regulariser (0: none, plain Adam; 0.01 is usual)",
    "lr_schedule": "constant, or cosine: the learning rate anneals from lr to 0 over the epochs",
    "class_weight": "none, or balanced: each class weighs as much in the loss, however rare (with gate_metric=macro_f1)",
    "early_stopping_patience": "stop after this many epochs without a lower validation loss, and keep the best "
                               "epoch's model (0: train every epoch, keep the last)",
}


train_and_serve = build()
