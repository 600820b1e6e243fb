"""Kubernetes platform settings of pipeline steps, applied with ``kfp-kubernetes`` at compile time.

Each step gets S3 credentials from a Secret (``use_secret_as_env``, never literal values), the
fairness labels (``add_pod_label``); GPU steps get node selectors and tolerations
(``add_node_selector``, ``add_toleration``). Loaded from YAML, validated once::

    s3_secret: kfp-pytorch-s3
    s3_endpoint: http://minio-service.kubeflow:9000
    s3_ca_configmap: company-ca  # ConfigMap (key cabundle.crt) of the CA that signed an https endpoint
    mlflow_tracking_uri: http://mlflow.kubeflow:5000
    mlflow_secret: mlflow-creds  # MLFLOW_TRACKING_USERNAME/_PASSWORD (or _TOKEN) of a server with auth
    labels: {kfp-pytorch.io/user: alice, kfp-pytorch.io/team: vision}
    gpu_node_selector: {nvidia.com/gpu.present: "true"}
    gpu_tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
    kueue_queue: team-a-gpu  # the Kueue LocalQueue of the training jobs (PyTorchJob / TrainJob)
    kueue_priority_class: research  # ... and their Kueue WorkloadPriorityClass
    istio_sidecar: false   # the training pods opt out of Istio's sidecar (the default; see below)
    restricted_pods: true  # training and predictor pods meet Pod Security "restricted" (the default)
    shm_volume: true       # training pods get a memory-backed /dev/shm for NCCL (the default)
    train_resources: {cpu: 8, memory: 32Gi}  # each PyTorchJob/TrainJob pod's requests (= limits)
    serve_resources: {cpu: 2, memory: 4Gi}   # the KServe predictor's (default cpu 1, memory 2Gi)
    image_pull_secrets: [harbor-pull]  # a private registry's pull Secrets: step, training, predictor pods
    serving_mode: RawDeployment  # KServe's mode for the predictor; Serverless (Knative) for canaries, scale to 0
    retries: 2             # each step, again after a failure (KFP's retry policy) ...
    retry_backoff_s: 60    # ... after 60 s, then 120 s, ...
"""
import re
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from kfp_pytorch.components.cluster import (DNS1123_SUBDOMAIN, ISTIO_INJECT, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL,
                                            S3_CA_BUNDLE, S3_CA_DIR, SERVING_MODES, label_problems,
                                            object_name_problems, pull_secret_problems, s3_keys_problems,
                                            serve_resources_problems, toleration_problems, train_resources_problems)
from kfp_pytorch.components.errors import ConfigError, unknown_field
from kfp_pytorch.components.storage import StorageError, parse_endpoint



@dataclass(frozen=True)
class Platform:
    s3_secret: str = "kfp-pytorch-s3"
    s3_keys: dict = field(default_factory=lambda: {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                                                   "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"})
    """Secret key -> environment variable."""
    s3_endpoint: str = ""
    s3_ca_configmap: str = ""
    """A ConfigMap in the namespace whose ``cabundle.crt`` holds the CA that signed the S3
    endpoint's certificate (an on-prem MinIO behind the company's CA; KServe's convention). Every
    step pod and training pod mounts it and names it in ``AWS_CA_BUNDLE`` (read by the storage
    client and by MLflow's boto3); KServe's storage initializer gets it through the S3 Secret's
    ``serving.kserve.io/s3-cabundle-configmap`` (``kfp-pytorch manifest s3-secret``)."""
    mlflow_tracking_uri: str = ""
    """The MLflow server every step reports to (``MLFLOW_TRACKING_URI``) when ``tracking_uri`` is empty."""
    mlflow_secret: str = ""
    """A Secret with the credentials of an MLflow server that requires them (MLflow's basic-auth
    app; a token for an auth proxy): any of the keys ``MLFLOW_TRACKING_USERNAME``,
    ``MLFLOW_TRACKING_PASSWORD`` and ``MLFLOW_TRACKING_TOKEN``, which MLflow's client reads. Only
    the steps that talk to MLflow (train logs its run, register) get them."""
    labels: dict = field(default_factory=dict)
    gpu_node_selector: dict = field(default_factory=dict)
    gpu_tolerations: list = field(default_factory=list)
    kueue_queue: str = ""
    """The Kueue LocalQueue the training jobs go to: Kueue admits a job as a whole when its queue
    has quota, and holds it suspended until then. Only the job is labelled, not the step pods or
    the InferenceService (a queue label in ``labels`` would put those in the queue too)."""
    kueue_priority_class: str = ""
    """The Kueue WorkloadPriorityClass of the training jobs: their order in the queue and which
    jobs they may preempt. Kueue reads it from jobs it manages (with ``kueue_queue``, or a
    namespace default queue)."""
    istio_sidecar: bool = False
    """Let Istio inject its sidecar into the training pods (PyTorchJob / TrainJob). Off by default:
    in a Kubeflow profile namespace (``istio-injection=enabled``) the sidecar keeps a finished pod
    running, so the job never completes. Turn it on only where a mesh policy requires it and
    the sidecar ends with the pod (Istio's native sidecars)."""
    restricted_pods: bool = True
    """The training and predictor pods meet Pod Security "restricted" (non-root, no privilege
    escalation, no capabilities, RuntimeDefault seccomp), so a namespace enforcing it admits them.
    false: no securityContext, for an image that runs as root or an RDMA fabric that needs IPC_LOCK."""
    shm_volume: bool = True
    """The training pods get a memory-backed ``/dev/shm`` (a container's is 64 MiB, too small for
    NCCL between the GPUs of a pod). false: for a TrainJob runtime that mounts its own there."""
    train_resources: dict = field(default_factory=dict)
    """CPU and memory of each training pod (requests = limits: Guaranteed QoS, the last evicted, and
    what Kueue counts against a queue's quota). Without them a CPU job's pods request nothing. Their
    GPUs are the run's ``gpus_per_node``."""
    serve_resources: dict = field(default_factory=dict)
    """CPU and memory of the KServe predictor (default cpu 1, memory 2Gi); its HPA scales on CPU use
    against this request."""
    serving_mode: str = "RawDeployment"
    """KServe's deployment mode of the predictor: RawDeployment (a Deployment and an HPA; no Knative
    needed) or Serverless (Knative), which alone has canary rollouts and scale to zero."""
    image_pull_secrets: list = field(default_factory=list)
    """Secrets (``kubernetes.io/dockerconfigjson``) of the private registry the images come from:
    every step pod, training pod and predictor pod pulls with them."""
    retries: int = 0
    """KFP retries each step this many times after a failure (an evicted pod, a preempted node, a
    storage or API outage). The steps are safe to retry: a cluster step adopts the job or
    InferenceService its failed attempt made (both named by run and task) and training resumes
    from its last checkpoint."""
    retry_backoff_s: int = 60
    """The wait before the first retry; it doubles for each next one (KFP's backoff factor 2)."""


_KNOWN = tuple(f.name for f in fields(Platform))
MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")  # what the API server accepts for an env var name
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def load_platform(data: dict | None) -> Platform:
    """Validate once; raises ConfigError listing every problem with its path."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError([f"(top level): must be a mapping, got {type(data).__name__}"],
                          "a platform file is a YAML mapping: " + ", ".join(_KNOWN), title="invalid platform settings")
    data = dict(data or {})
    problems = []
    for k in data:
        if k not in _KNOWN:
            problems.append(unknown_field(str(k), k, _KNOWN))
    for k in ("s3_secret", "s3_endpoint", "mlflow_tracking_uri", "mlflow_secret"):
        if k in data and not isinstance(data[k], str):
            problems.append(f"{k}: must be a string, got {data[k]!r}")
    if isinstance(data.get("s3_endpoint"), str) and data["s3_endpoint"]:
        try:  # as the pods' storage config will read it
            parse_endpoint(data["s3_endpoint"])
        except StorageError:
            problems.append(f"s3_endpoint: {data['s3_endpoint']!r} is not an S3 endpoint; write http(s)://HOST[:PORT], "
                            "e.g. http://minio-service.kubeflow:9000")
    uri = data.get("mlflow_tracking_uri")
    if isinstance(uri, str) and uri:
        parts = urlsplit(uri)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # a pod's own sqlite or file store would go with the pod
            problems.append(f"mlflow_tracking_uri: {uri!r} is not an MLflow server; write http(s)://HOST[:PORT], "
                            "e.g. http://mlflow.kubeflow:5000")
    for k in ("s3_secret", "mlflow_secret"):
        if isinstance(data.get(k), str) and data[k] and not DNS1123_SUBDOMAIN.match(data[k]):
            problems.append(f"{k}: {data[k]!r} is not a valid Secret name (lowercase DNS-1123)")
    keys = data.get("s3_keys")
    if keys is not None:
        if not isinstance(keys, dict):
            problems.append(f"s3_keys: must be a mapping of Secret key -> environment variable, got {keys!r}")
        else:
            for k, v in keys.items():
                if not _SECRET_KEY.match(str(k)):
                    problems.append(f"s3_keys.{k}: not a valid Secret key")
                if not isinstance(v, str) or not _ENV_NAME.match(v):
                    problems.append(f"s3_keys.{k}: {v!r} is not a valid environment variable name")
            problems += s3_keys_problems(keys, "s3_keys")  # the storage client reads these two
    for k in ("istio_sidecar", "restricted_pods", "shm_volume"):
        if data.get(k) is not None and not isinstance(data[k], bool):
            problems.append(f"{k}: must be true or false, got {data[k]!r}")
    for k, lo, hi in (("retries", 0, 10), ("retry_backoff_s", 0, 3600)):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            problems.append(f"{k}: must be a whole number in [{lo}, {hi}], got {v!r}")
    for where in ("labels", "gpu_node_selector"):
        problems += label_problems(data.get(where) or {}, where)
    problems += object_name_problems(data.get("kueue_queue"), "kueue_queue")
    problems += object_name_problems(data.get("s3_ca_configmap"), "s3_ca_configmap", "ConfigMap")
    problems += object_name_problems(data.get("kueue_priority_class"), "kueue_priority_class", "WorkloadPriorityClass")
    for label, key, why in ((KUEUE_QUEUE_LABEL, "kueue_queue", "would put every step pod and the InferenceService "
                                                               "in Kueue's queue too"),
                            (KUEUE_PRIORITY_LABEL, "kueue_priority_class", "would reach every step pod and the "
                                                                           "InferenceService too")):
        if isinstance(data.get("labels"), dict) and label in data["labels"]:
            problems.append(f"labels.{label}: {why}; write {key}: {data['labels'][label]} instead (it labels only "
                            "the training job)")
    if isinstance(data.get("labels"), dict) and ISTIO_INJECT in data["labels"]:
        problems.append(f"labels.{ISTIO_INJECT}: the training pods' sidecar is set by istio_sidecar (false unless "
                        "you write istio_sidecar: true); KFP's step pods opt out of it themselves")
    problems += toleration_problems(data.get("gpu_tolerations") or [], "gpu_tolerations")
    if data.get("serving_mode") is not None and data["serving_mode"] not in SERVING_MODES:
        problems.append(f"serving_mode: must be {' or '.join(SERVING_MODES)}, got {data['serving_mode']!r}")
    if data.get("image_pull_secrets") is not None:
        problems += pull_secret_problems(data["image_pull_secrets"], "image_pull_secrets")
    if data.get("train_resources") is not None:
        problems += train_resources_problems(data["train_resources"], "train_resources")
    if data.get("serve_resources") is not None:
        problems += serve_resources_problems(data["serve_resources"], "serve_resources")
    if problems:
        raise ConfigError(problems, "fix the platform file", title="invalid platform settings")
    return Platform(**{k: v for k, v in data.items() if v is not None})


def platform_env(platform: Platform, gpu: bool = False) -> dict[str, str]:
    """The environment a step gets from the platform: its own settings (endpoint, MLflow server),
    and those of the pods it creates with the cluster backends (PyTorchJob/TrainJob pods read the
    same Secret and keys, carry the same labels and, for GPU pods, the same placement) through
    :meth:`~kfp_pytorch.components.cluster.ClusterConfig.from_env`."""
    import json

    env = {"KFP_PYTORCH_S3_SECRET": platform.s3_secret, "KFP_PYTORCH_S3_KEYS": json.dumps(platform.s3_keys)}
    if platform.s3_endpoint:
        env["AWS_ENDPOINT_URL"] = platform.s3_endpoint
    if platform.mlflow_tracking_uri:
        env["MLFLOW_TRACKING_URI"] = platform.mlflow_tracking_uri
    if platform.s3_ca_configmap:  # the step's own reads (mounted by apply_platform) and its pods'
        env["AWS_CA_BUNDLE"] = S3_CA_BUNDLE
        env["KFP_PYTORCH_S3_CA_CONFIGMAP"] = platform.s3_ca_configmap
    if platform.labels:
        env["KFP_PYTORCH_POD_LABELS"] = json.dumps(platform.labels)
    if platform.kueue_queue:
        env["KFP_PYTORCH_KUEUE_QUEUE"] = platform.kueue_queue
    if platform.kueue_priority_class:
        env["KFP_PYTORCH_KUEUE_PRIORITY_CLASS"] = platform.kueue_priority_class
    if platform.istio_sidecar:
        env["KFP_PYTORCH_ISTIO_SIDECAR"] = "true"
    if not platform.restricted_pods:
        env["KFP_PYTORCH_RESTRICTED_PODS"] = "false"
    if not platform.shm_volume:
        env["KFP_PYTORCH_SHM_VOLUME"] = "false"
    for key, env_name in (("cpu", "KFP_PYTORCH_CPU_PER_NODE"), ("memory", "KFP_PYTORCH_MEMORY_PER_NODE")):
        if key in platform.train_resources:
            env[env_name] = str(platform.train_resources[key])
    if platform.serve_resources:
        env["KFP_PYTORCH_SERVE_RESOURCES"] = json.dumps(platform.serve_resources)
    if platform.serving_mode != "RawDeployment":
        env["KFP_PYTORCH_SERVING_MODE"] = platform.serving_mode
    if platform.image_pull_secrets:
        env["KFP_PYTORCH_IMAGE_PULL_SECRETS"] = json.dumps(platform.image_pull_secrets)
    if gpu and platform.gpu_node_selector:
        env["KFP_PYTORCH_GPU_NODE_SELECTOR"] = json.dumps(platform.gpu_node_selector)
    if gpu and platform.gpu_tolerations:
        env["KFP_PYTORCH_GPU_TOLERATIONS"] = json.dumps(platform.gpu_tolerations)
    return env


def apply_platform(task, platform: Platform | None, gpu: bool = False, mlflow: bool = False):
    """Attach the platform settings to one pipeline task (returns it, like kfp.kubernetes does).
    ``gpu``: the task may train on GPUs itself (local backend) or start GPU pods (cluster backend).
    ``mlflow``: the task talks to MLflow, and gets its credentials."""
    if platform is None:
        return task
    from kfp import kubernetes

    kubernetes.use_secret_as_env(task, platform.s3_secret, dict(platform.s3_keys))
    if platform.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(platform.image_pull_secrets))
    if mlflow and platform.mlflow_secret:  # each key optional: a user and password, or a token
        kubernetes.use_secret_as_env(task, platform.mlflow_secret, {k: k for k in MLFLOW_CREDENTIALS}, optional=True)
    if platform.s3_ca_configmap:
        kubernetes.use_config_map_as_volume(task, platform.s3_ca_configmap, mount_path=S3_CA_DIR)
    for k, v in platform_env(platform, gpu).items():
        task.set_env_variable(k, v)
    for k, v in platform.labels.items():
        kubernetes.add_pod_label(task, k, v)
    if platform.retries:
        # KFP retries a failed step's pod; backoff_max_duration bounds all the retries together
        task.set_retry(num_retries=platform.retries, backoff_duration=f"{platform.retry_backoff_s}s",
                       backoff_factor=2.0, backoff_max_duration="3600s")
    if gpu:
        for k, v in platform.gpu_node_selector.items():
            kubernetes.add_node_selector(task, k, v)
        for t in platform.gpu_tolerations:
            kubernetes.add_toleration(task, key=t.get("key"), operator=t.get("operator", "Equal"), value=t.get("value"),
                                      effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
    return task
