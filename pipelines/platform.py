"""Kubernetes platform settings of pipeline steps, applied with ``kfp-kubernetes`` at compile time.

Each step gets S3 credentials from a Secret (``use_secret_as_env``, never literal values), the
fairness labels (``add_pod_label``); GPU steps get node selectors and tolerations
(``add_node_selector``, ``add_toleration``). Loaded from YAML, validated once::

    s3_secret: kfp-pytorch-s3
    s3_endpoint: http://minio-service.kubeflow:9000
    mlflow_tracking_uri: http://mlflow.kubeflow:5000
    labels: {kfp-pytorch.io/user: alice, kfp-pytorch.io/team: vision}
    gpu_node_selector: {nvidia.com/gpu.present: "true"}
    gpu_tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
"""
import re
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from kfp_pytorch.components.errors import ConfigError
from kfp_pytorch.components.storage import StorageError, parse_endpoint

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Platform:
    s3_secret: str = "kfp-pytorch-s3"
    s3_keys: dict = field(default_factory=lambda: {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                                                   "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"})
    """Secret key -> environment variable."""
    s3_endpoint: str = ""
    mlflow_tracking_uri: str = ""
    """The MLflow server every step reports to (``MLFLOW_TRACKING_URI``) when ``tracking_uri`` is empty."""
    labels: dict = field(default_factory=dict)
    gpu_node_selector: dict = field(default_factory=dict)
    gpu_tolerations: list = field(default_factory=list)


_KNOWN = tuple(f.name for f in fields(Platform))


_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # DNS-1123 subdomain
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
            problems.append(f"{k}: unknown field (known: {', '.join(sorted(_KNOWN))})")
    for k in ("s3_secret", "s3_endpoint", "mlflow_tracking_uri"):
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
    if isinstance(data.get("s3_secret"), str) and not _SECRET_NAME.match(data["s3_secret"]):
        problems.append(f"s3_secret: {data['s3_secret']!r} is not a valid Secret name (lowercase DNS-1123)")
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
    for where in ("labels", "gpu_node_selector"):
        section = data.get(where) or {}
        if not isinstance(section, dict):
            problems.append(f"{where}: must be a mapping of label key -> value, got {section!r}")
            continue
        for k, v in section.items():
            if not _LABEL_KEY.match(str(k)):
                problems.append(f"{where}.{k}: not a valid label key")
            if not isinstance(v, str) or not _LABEL_VALUE.match(v) or len(v) > 63:
                problems.append(f"{where}.{k}: {v!r} is not a valid label value (quote \"true\")")
    tolerations = data.get("gpu_tolerations") or []
    if not isinstance(tolerations, list):
        problems.append(f"gpu_tolerations: must be a list of tolerations, got {tolerations!r}")
        tolerations = []
    for i, t in enumerate(tolerations):
        if not isinstance(t, dict):
            problems.append(f"gpu_tolerations[{i}]: must be a mapping (key, operator, value, effect), got {t!r}")
        else:
            problems += [f"gpu_tolerations[{i}]{p}" for p in _toleration_problems(t)]
    if problems:
        raise ConfigError(problems, "fix the platform file", title="invalid platform settings")
    return Platform(**{k: v for k, v in data.items() if v is not None})


_TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")


def _toleration_problems(t: dict) -> list[str]:
    """The API server's rules for a pod toleration (ValidateTolerations), as ``.field: why``."""
    problems = [f".{k}: unknown field (known: {', '.join(_TOLERATION_FIELDS)})" for k in t if k not in _TOLERATION_FIELDS]
    key, op, value = t.get("key") or "", t.get("operator") or "Equal", t.get("value")
    if key and not _LABEL_KEY.match(str(key)):
        problems.append(f".key: {key!r} is not a valid label key")
    if op not in ("Equal", "Exists"):
        problems.append(f".operator: must be Equal or Exists, got {op!r}")
    elif op == "Exists" and value not in (None, ""):
        problems.append(f".value: must be empty when operator is Exists, got {value!r}")
    elif op == "Equal" and not key:
        problems.append(".operator: must be Exists when key is empty (which tolerates every taint)")
    elif op == "Equal" and value is not None and (not isinstance(value, str) or not _LABEL_VALUE.match(value)
                                                  or len(value) > 63):
        problems.append(f".value: {value!r} is not a valid label value (quote \"true\")")
    if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        problems.append(".effect: must be NoSchedule, PreferNoSchedule or NoExecute")
    seconds = t.get("tolerationSeconds")
    if seconds is not None:
        if not isinstance(seconds, int) or isinstance(seconds, bool):
            problems.append(f".tolerationSeconds: must be a whole number of seconds, got {seconds!r}")
        if t.get("effect") != "NoExecute":
            problems.append(".effect: must be NoExecute when tolerationSeconds is set")
    return problems


def apply_platform(task, platform: Platform | None, gpu: bool = False):
    """Attach the platform settings to one pipeline task (returns it, like kfp.kubernetes does)."""
    if platform is None:
        return task
    from kfp import kubernetes

    kubernetes.use_secret_as_env(task, platform.s3_secret, dict(platform.s3_keys))
    if platform.s3_endpoint:
        task.set_env_variable("AWS_ENDPOINT_URL", platform.s3_endpoint)
    if platform.mlflow_tracking_uri:
        task.set_env_variable("MLFLOW_TRACKING_URI", platform.mlflow_tracking_uri)
    for k, v in platform.labels.items():
        kubernetes.add_pod_label(task, k, v)
    if gpu:
        for k, v in platform.gpu_node_selector.items():
            kubernetes.add_node_selector(task, k, v)
        for t in platform.gpu_tolerations:
            kubernetes.add_toleration(task, key=t.get("key"), operator=t.get("operator", "Equal"), value=t.get("value"),
                                      effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
    return task
