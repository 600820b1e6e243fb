"""Cluster backends, the pure half: typed specs -> Kubernetes manifests (no client, no I/O).

``to_pytorchjob(spec)``, ``to_trainjob(spec)``, ``to_inference_service(spec)`` and
``kfp_launcher_configmap(...)`` build plain dicts that are valid against the upstream CRD schemas
(Training Operator v1.9 PyTorchJob, Trainer v2.3 TrainJob, KServe v0.20 InferenceService); a dry
run prints them, and only the Kubernetes edge submits them (build, then submit, as torchx does).

Credentials never appear in a manifest: pods read them from a Secret through ``secretKeyRef``,
and KServe's storage initializer from a ServiceAccount's Secret.
"""
import hashlib
import json
import re
from dataclasses import dataclass, field

from .errors import ConfigError, unknown_field
from .train import WORKER_MODULE, TrainSpec, gpu_share_problem, worker_args

FAIRNESS_GATE = "fairness.kfp-pytorch.io/admission"
"""Scheduling gate the fairness scheduler removes when it admits a gang."""
LABEL_PREFIX = "kfp-pytorch.io"
REGISTERED_MODEL = f"{LABEL_PREFIX}/registered-model"
"""The InferenceService's annotation: the registered version it serves, models:/NAME/VERSION."""
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""Names of most objects: Secrets, LocalQueues..."""
# The image reference grammar of distribution/reference (what containerd and the kubelet parse):
# [domain[:port]/]path[:tag][@digest], path components lower-case. The API server stores any
# string, and a bad one surfaces only as the pod's InvalidImageName after the job was created,
# so it is checked here, before anything is submitted. No maintained Python package parses it.
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(
    rf"^(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")


def image_problem(image: str, what: str) -> str | None:
    """Why ``image`` is not a usable container image reference, or None."""
    if not image:
        return f"image: required ({what}, e.g. registry.example.com/kfp-pytorch:0.1.0)"
    match = IMAGE_REFERENCE.match(image)
    if match is None or len(match["name"]) > 255:  # the grammar's limit on the name
        return (f"image: {image!r} is not an image reference; write [registry[:port]/]name[:tag][@sha256:digest] "
                "with a lower-case name, e.g. registry.example.com/kfp-pytorch:0.1.0")
    return None


def loopback_note(url: str, what: str, instead: str) -> str | None:
    """A note when ``url`` (``http://HOST:PORT`` or ``HOST:PORT``) names this machine's loopback
    (localhost, 127.0.0.0/8, ::1): in a pod that address is the pod itself, so a port-forward that
    works here reaches nothing there. ``what`` names the setting, ``instead`` an address to give."""
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url if "://" in url else f"//{url}").hostname or ""
    try:
        loopback = host == "localhost" or host.endswith(".localhost") or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not loopback:
        return None
    return (f"{what} {url} is this machine's loopback address; in the cluster's pods it is the pod itself, "
            f"so they would not reach it: give the Service's address in the cluster, e.g. {instead}")


def is_dns1123_label(value: str | None, max_len: int = 63) -> bool:
    """A Kubernetes name of the label kind (namespaces, Services): lowercase alphanumerics and '-'."""
    return bool(value) and len(value) <= max_len and DNS1123_LABEL.match(value) is not None


def dns1123_name(*parts: str, max_len: int = 63) -> str:
    """A valid DNS-1123 label derived deterministically from ``parts``.

    Lower-cases, maps other characters to '-', and when too long keeps a readable prefix plus a
    short hash of the full input, so different long inputs stay different names.
    """
    raw = "-".join(p for p in parts if p)
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name) or "x"
    if len(name) > max_len or name != raw:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        if len(name) > max_len:
            name = name[: max_len - 9].rstrip("-") + "-" + digest
    if not name[0].isalnum():
        name = "x" + name[1:]
    return name


LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")


def label_problems(labels, where: str) -> list[str]:
    """Why ``labels`` (a node selector too) is not a Kubernetes label mapping, as ``where.key: why``."""
    if not isinstance(labels, dict):
        return [f"{where}: must be a mapping of label key -> value, got {labels!r}"]
    problems = []
    for k, v in labels.items():
        if not LABEL_KEY.match(str(k)):
            problems.append(f"{where}.{k}: not a valid label key")
        if not isinstance(v, str) or not LABEL_VALUE.match(v) or len(v) > 63:
            problems.append(f"{where}.{k}: {v!r} is not a valid label value (quote \"true\")")
    return problems


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
SHM_VOLUME = "dshm"
S3_CA_DIR = "/etc/kfp-pytorch/s3-ca"
S3_CA_BUNDLE = f"{S3_CA_DIR}/cabundle.crt"
"""Where a pod finds the S3 endpoint's CA (the key KServe's storage initializer reads too)."""


def shm_volume() -> tuple[dict, dict]:
    """(volume, mount): a memory-backed ``/dev/shm``. A container runtime gives a pod 64 MiB of it;
    NCCL between the GPUs of one pod (and DataLoader workers) needs more, and fails with "unhandled
    system error" / a bus error. What it holds counts against the pod's memory limit. Fresh dicts
    each call, as :func:`restricted_security_contexts`."""
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def restricted_security_contexts() -> tuple[dict, dict]:
    """The pod's and its container's securityContext that Pod Security "restricted" asks for
    (Kubeflow's target level for its namespaces): not root (the image's USER is a numeric non-root
    uid, as the Dockerfile's 1000), no privilege escalation, no Linux capabilities, the runtime's
    default seccomp profile. New dicts each call: no manifest shares a nested one with another."""
    return ({"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}})
ISTIO_INJECT = "sidecar.istio.io/inject"
"""Istio's per-pod switch for its sidecar injector (a label; the older annotation is still read)."""
"""Names the job's WorkloadPriorityClass: its Workload's priority in the queue and for preemption."""


def object_name_problems(name, where: str, what: str = "LocalQueue") -> list[str]:
    """An object's name (DNS-1123 subdomain) that also fits a label value (63 characters), as
    Kueue's queue and priority class names must; empty: none given."""
    if name in ("", None):
        return []
    if not isinstance(name, str) or not DNS1123_SUBDOMAIN.match(name) or len(name) > 63:
        return [f"{where}: {name!r} is not a {what} name (lowercase letters, digits, '-' and '.'; at most 63)"]
    return []


def kueue_labels(queue: str, priority_class: str) -> dict:
    """The labels that put a job in a Kueue LocalQueue, with a WorkloadPriorityClass."""
    return {k: v for k, v in ((KUEUE_QUEUE_LABEL, queue), (KUEUE_PRIORITY_LABEL, priority_class)) if v}


def toleration_problems(tolerations, where: str) -> list[str]:
    """The API server's rules for pod tolerations (ValidateTolerations), as ``where[i].field: why``."""
    if not isinstance(tolerations, list):
        return [f"{where}: must be a list of tolerations, got {tolerations!r}"]
    problems = []
    for i, t in enumerate(tolerations):
        at = f"{where}[{i}]"
        if not isinstance(t, dict):
            problems.append(f"{at}: must be a mapping (key, operator, value, effect), got {t!r}")
            continue
        problems += [unknown_field(f"{at}.{k}", k, _TOLERATION_FIELDS) for k in t if k not in _TOLERATION_FIELDS]
        key, op, value = t.get("key") or "", t.get("operator") or "Equal", t.get("value")
        if key and not LABEL_KEY.match(str(key)):
            problems.append(f"{at}.key: {key!r} is not a valid label key")
        if op not in ("Equal", "Exists"):
            problems.append(f"{at}.operator: must be Equal or Exists, got {op!r}")
        elif op == "Exists" and value not in (None, ""):
            problems.append(f"{at}.value: must be empty when operator is Exists, got {value!r}")
        elif op == "Equal" and not key:
            problems.append(f"{at}.operator: must be Exists when key is empty (which tolerates every taint)")
        elif op == "Equal" and value is not None and (not isinstance(value, str) or not LABEL_VALUE.match(value)
                                                      or len(value) > 63):
            problems.append(f"{at}.value: {value!r} is not a valid label value (quote \"true\")")
        if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            problems.append(f"{at}.effect: must be NoSchedule, PreferNoSchedule or NoExecute")
        seconds = t.get("tolerationSeconds")
        if seconds is not None:
            if not isinstance(seconds, int) or isinstance(seconds, bool):
                problems.append(f"{at}.tolerationSeconds: must be a whole number of seconds, got {seconds!r}")
            if t.get("effect") != "NoExecute":
                problems.append(f"{at}.effect: must be NoExecute when tolerationSeconds is set")
    return problems


def _finish_validation(problems: list[str], resources: dict, title: str) -> dict:
    """Add the resources' problems to ``problems``; raise them all together, or return the resources."""
    try:
        res = parse_resources(resources)
    except ConfigError as e:
        problems = problems + e.problems
        res = {}
    if problems:
        raise ConfigError(problems, title=title)
    return res


def parse_resources(res: dict | None, path: str = "resources") -> dict:
    """``{"cpu": "4", "memory": "16Gi", "gpu": 1}`` -> requests/limits; every bad value listed."""
    res = dict(res or {})
    problems, out = [], {}
    names = {"cpu": "cpu", "memory": "memory", "gpu": "nvidia.com/gpu", "nvidia.com/gpu": "nvidia.com/gpu",
             "ephemeral-storage": "ephemeral-storage"}
    for k, v in res.items():
        if k not in names:
            problems.append(f"{path}.{k}: unknown resource (use cpu, memory, gpu)")
            continue
        text = str(v).strip()
        if isinstance(v, bool) or not QUANTITY.match(text):
            problems.append(f"{path}.{k}: {v!r} is not a Kubernetes quantity "
                            f"(examples: cpu '500m' or 4, memory '16Gi', gpu 1)")
            continue
        if names[k] == "nvidia.com/gpu" and not re.fullmatch(r"\d+", text):
            problems.append(f"{path}.{k}: GPUs must be a whole number, got {v!r}")
            continue
        out[names[k]] = int(text) if re.fullmatch(r"\d+", text) else text
    if problems:
        raise ConfigError(problems, "fix the resource values", title="invalid resources")
    return out


@dataclass(frozen=True)
class S3Access:
    """How pods reach MinIO: endpoint in the clear, credentials only by Secret reference."""

    endpoint: str = "http://minio-service.kubeflow:9000"
    secret_name: str = "kfp-pytorch-s3"
    access_key_key: str = "AWS_ACCESS_KEY_ID"
    secret_key_key: str = "AWS_SECRET_ACCESS_KEY"
    region: str = "us-east-1"
    verify_ssl: bool = True
    ca_configmap: str = ""
    """A ConfigMap of the namespace whose ``cabundle.crt`` holds the CA that signed the endpoint's
    certificate (KServe's convention): mounted in the pods at :data:`S3_CA_DIR`, named by
    ``AWS_CA_BUNDLE``, and given to KServe's storage initializer by the Secret's annotation."""

    def env(self) -> list[dict]:
        env = [
            {"name": "AWS_ENDPOINT_URL", "value": self.endpoint},
            {"name": "AWS_REGION", "value": self.region},
            {"name": "S3_VERIFY_SSL", "value": "1" if self.verify_ssl else "0"},
            {"name": "AWS_ACCESS_KEY_ID",
             "valueFrom": {"secretKeyRef": {"name": self.secret_name, "key": self.access_key_key}}},
            {"name": "AWS_SECRET_ACCESS_KEY",
             "valueFrom": {"secretKeyRef": {"name": self.secret_name, "key": self.secret_key_key}}},
        ]
        if self.ca_configmap:
            env.append({"name": "AWS_CA_BUNDLE", "value": S3_CA_BUNDLE})
        return env

    def volumes(self) -> tuple[list[dict], list[dict]]:
        """(volumes, mounts) the pods need to trust the endpoint: the CA's ConfigMap, if any."""
        if not self.ca_configmap:
            return [], []
        return ([{"name": "s3-ca", "configMap": {"name": self.ca_configmap}}],
                [{"name": "s3-ca", "mountPath": S3_CA_DIR, "readOnly": True}])


@dataclass(frozen=True)
class ClusterTrainSpec:
    """Where and how a training job runs in the cluster."""

    train: TrainSpec
    image: str = ""
    """The project's image (see Dockerfile); required."""
    namespace: str = "kubeflow-user"
    run_id: str = "local"
    """KFP run id: with ``task`` it names the job deterministically, so a retried task adopts it."""
    task: str = "train"
    user: str = ""
    """Owner, for labels and fair-share accounting."""
    pipeline: str = "train-and-serve"
    nodes: int = 1
    """Pods (replicas); ``train.workers`` processes are spread as nprocPerNode = workers / nodes."""
    resources: dict = field(default_factory=dict)
    """Per pod: {"cpu": 4, "memory": "16Gi", "gpu": 1}."""
    s3: S3Access = field(default_factory=S3Access)
    clean_pod_policy: str = "Running"
    backoff_limit: int = 3
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = 86400
    fairness: bool = False
    """Add the fairness scheduler's scheduling gate and priority class."""
    priority_class: str = "kfp-pytorch-default"
    queue: str = ""
    """Gang-scheduler queue (Volcano/scheduler-plugins) for runPolicy.schedulingPolicy."""
    elastic_min_nodes: int | None = None
    """Set to enable elasticPolicy with min..nodes replicas (c10d rendezvous)."""
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    pod_labels: dict = field(default_factory=dict)
    """The platform's labels (team, cost centre...): on the job and its pods, beside ours."""
    kueue_queue: str = ""
    """The Kueue LocalQueue the job goes to (label ``kueue.x-k8s.io/queue-name`` on the job only:
    Kueue admits the job as a whole, and suspends it until then)."""
    kueue_priority_class: str = ""
    """The job's Kueue WorkloadPriorityClass (label ``kueue.x-k8s.io/priority-class``, on the job only):
    its order in the queue, and which jobs it may preempt or be preempted by."""
    runtime: str = "torch-distributed"
    """ClusterTrainingRuntime of a TrainJob."""
    restricted: bool = True
    """The pods meet Pod Security "restricted" (:func:`restricted_security_contexts`), so a namespace that
    enforces it admits them. Off: no securityContext, for an image that runs as root or a
    fabric that needs a capability (InfiniBand RDMA's IPC_LOCK)."""
    shm: bool = True
    """Mount a memory-backed ``/dev/shm`` (:func:`shm_volume`) in the training pods. Off for a
    TrainJob runtime that mounts its own there (two mounts at one path make the pods invalid)."""
    image_pull_secrets: tuple = ()
    """Secrets of the private registry the image comes from (``imagePullSecrets``)."""
    istio_sidecar: bool = False
    """Let Istio inject its sidecar into the training pods. Off (``sidecar.istio.io/inject:
    "false"``): a Kubeflow profile namespace has ``istio-injection=enabled``, and there the
    sidecar outlives the training container, so the pods never complete and the job never ends,
    and it can stand between the workers' rendezvous (kubeflow/trainer#1637); KFP's own step
    pods opt out alike."""

    @property
    def name(self) -> str:
        return dns1123_name(self.pipeline, self.run_id[:12], self.task, max_len=50)

    def validate(self) -> dict:
        problems = []
        if problem := image_problem(self.image, "the kfp-pytorch image built from the Dockerfile"):
            problems.append(problem)
        if not is_dns1123_label(self.namespace):
            problems.append(f"namespace: must be a DNS-1123 label, got {self.namespace!r}")
        if self.nodes < 1:
            problems.append(f"nodes: must be >= 1, got {self.nodes}")
        elif self.train.workers % self.nodes:
            problems.append(f"workers ({self.train.workers}) must be a multiple of nodes ({self.nodes})")
        if self.clean_pod_policy not in ("None", "Running", "All"):
            problems.append(f"clean_pod_policy: must be None, Running or All, got {self.clean_pod_policy!r}")
        if self.backoff_limit < 0:
            problems.append(f"backoff_limit: must be >= 0, got {self.backoff_limit}")
        problems += object_name_problems(self.kueue_queue, "kueue_queue")
        problems += object_name_problems(self.kueue_priority_class, "kueue_priority_class", "WorkloadPriorityClass")
        if self.elastic_min_nodes is not None and not 1 <= self.elastic_min_nodes <= self.nodes:
            problems.append(f"elastic_min_nodes: must be in [1, nodes], got {self.elastic_min_nodes}")
        gpus = self.resources.get("gpu", self.resources.get("nvidia.com/gpu"))
        if self.train.device != "cpu" and (problem := gpu_share_problem(self.train.workers, self.nodes, gpus)):
            problems.append(problem)
        return _finish_validation(problems, self.resources, "invalid cluster training settings")

    def labels(self) -> dict:
        out = {**self.pod_labels, "app.kubernetes.io/managed-by": "kfp-pytorch", f"{LABEL_PREFIX}/pipeline": dns1123_name(self.pipeline),
               f"{LABEL_PREFIX}/run-id": dns1123_name(self.run_id), f"{LABEL_PREFIX}/task": dns1123_name(self.task)}
        if self.user:
            out[f"{LABEL_PREFIX}/user"] = dns1123_name(self.user)
        return out

    def job_labels(self) -> dict:
        """The job's own labels: its pods' and Kueue's (queue, priority class), which go on the job only."""
        return {**self.labels(), **kueue_labels(self.kueue_queue, self.kueue_priority_class)}


def _worker_env(spec: ClusterTrainSpec, resources: dict) -> list[dict]:
    """The training container's environment: S3 access, unbuffered output and, for a pod with a
    CPU limit, each worker's share of it as its thread count. PyTorch otherwise sizes its thread
    pools by the node's cores (64, say, where the pod may use 4), and the CFS quota throttles the
    pod to a crawl; torchrun's own default, 1 thread per worker, leaves the rest idle."""
    from kubernetes.utils import parse_quantity

    env = spec.s3.env() + [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if "cpu" in resources:
        threads = max(1, int(parse_quantity(resources["cpu"]) // (spec.train.workers // spec.nodes)))
        env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    return env


def _volumes(spec: ClusterTrainSpec) -> tuple[list[dict], list[dict]]:
    """The training pods' volumes and the training container's mounts: /dev/shm, the S3 CA."""
    volumes, mounts = spec.s3.volumes()
    if spec.shm:
        volume, mount = shm_volume()
        volumes, mounts = [volume, *volumes], [mount, *mounts]
    return volumes, mounts


def _pod_template(spec: ClusterTrainSpec, resources: dict) -> dict:
    pod: dict = {
        "containers": [{
            "name": "pytorch",  # the Training Operator requires this container name
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", "torch.distributed.run", "-m", WORKER_MODULE],
            "args": worker_args(spec.train),
            "env": _worker_env(spec, resources),
            "resources": {"requests": dict(resources), "limits": dict(resources)} if resources else {},
        }],
    }
    if spec.restricted:
        pod["securityContext"], pod["containers"][0]["securityContext"] = restricted_security_contexts()
    volumes, mounts = _volumes(spec)
    if volumes:
        pod["volumes"], pod["containers"][0]["volumeMounts"] = volumes, mounts
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = list(spec.tolerations)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = pull_secrets(spec.image_pull_secrets)
    if spec.fairness:
        pod["schedulingGates"] = [{"name": FAIRNESS_GATE}]
        pod["priorityClassName"] = spec.priority_class
    return {"metadata": _pod_metadata(spec), "spec": pod}


def pull_secrets(names) -> list[dict]:
    return [{"name": n} for n in names]


def pull_secret_problems(names, where: str) -> list[str]:
    """``image_pull_secrets``: a list of Secret names (of type kubernetes.io/dockerconfigjson)."""
    if not isinstance(names, list):
        return [f"{where}: must be a list of Secret names, got {names!r}"]
    return [f"{where}[{i}]: {n!r} is not a valid Secret name (lowercase DNS-1123)" for i, n in enumerate(names)
            if not isinstance(n, str) or not DNS1123_SUBDOMAIN.match(n)]


def _pod_metadata(spec: ClusterTrainSpec) -> dict:
    """The training pods' labels and, unless ``istio_sidecar``, Istio's opt-out: as a label, which
    Istio reads first, and as the annotation older Istio releases read."""
    if spec.istio_sidecar:
        return {"labels": spec.labels()}
    return {"labels": {**spec.labels(), ISTIO_INJECT: "false"}, "annotations": {ISTIO_INJECT: "false"}}


def to_pytorchjob(spec: ClusterTrainSpec) -> dict:
    """A ``kubeflow.org/v1`` PyTorchJob running the same worker entrypoint as the local backend."""
    resources = spec.validate()
    template = _pod_template(spec, resources)
    import copy

    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "OnFailure",
                              "template": copy.deepcopy(template)}
    run_policy: dict = {"cleanPodPolicy": spec.clean_pod_policy, "backoffLimit": spec.backoff_limit,
                        "schedulingPolicy": {"minAvailable": spec.nodes}}
    if spec.queue:
        run_policy["schedulingPolicy"]["queue"] = spec.queue
    if spec.fairness:
        run_policy["schedulingPolicy"]["priorityClass"] = spec.priority_class
    if spec.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = spec.active_deadline_seconds
    if spec.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    body: dict = {"nprocPerNode": str(spec.train.workers // spec.nodes), "runPolicy": run_policy,
                  "pytorchReplicaSpecs": replicas}
    if spec.elastic_min_nodes is not None:
        body["elasticPolicy"] = {"minReplicas": spec.elastic_min_nodes, "maxReplicas": spec.nodes,
                                 "rdzvBackend": "c10d", "maxRestarts": spec.train.max_restarts}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.job_labels()},
            "spec": body}


def to_trainjob(spec: ClusterTrainSpec) -> dict:
    """A ``trainer.kubeflow.org/v1alpha1`` TrainJob on a ClusterTrainingRuntime (Trainer v2)."""
    resources = spec.validate()
    trainer: dict = {
        "image": spec.image,
        "command": ["python", "-m", "torch.distributed.run", "-m", WORKER_MODULE],
        "args": worker_args(spec.train),
        "env": _worker_env(spec, resources),
        "numNodes": spec.nodes,
        "numProcPerNode": spec.train.workers // spec.nodes,
    }
    if resources:
        trainer["resourcesPerNode"] = {"requests": dict(resources), "limits": dict(resources)}
    body: dict = {"runtimeRef": {"name": spec.runtime, "kind": "ClusterTrainingRuntime",
                                 "apiGroup": "trainer.kubeflow.org"},
                  "trainer": trainer}
    if spec.active_deadline_seconds:
        body["activeDeadlineSeconds"] = spec.active_deadline_seconds
    pod: dict = {}
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = list(spec.tolerations)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = pull_secrets(spec.image_pull_secrets)
    if spec.fairness:  # the gate only: a runtime patch cannot set the pods' priority class
        pod["schedulingGates"] = [{"name": FAIRNESS_GATE}]
    node: dict = {"name": "node"}  # the torch-distributed runtime's trainer container, patched by name
    if spec.restricted:
        pod["securityContext"], node["securityContext"] = restricted_security_contexts()
    volumes, mounts = _volumes(spec)
    if volumes:
        pod["volumes"], node["volumeMounts"] = volumes, mounts
    if len(node) > 1:
        pod["containers"] = [node]
    # the runtime's pods ("node": the torch-distributed runtime's replicated job) get our labels
    # and placement through a patch, as Kueue patches them
    body["runtimePatches"] = [{"manager": f"{LABEL_PREFIX}/kfp-pytorch", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
            "metadata": _pod_metadata(spec), **({"spec": pod} if pod else {})}}}}]}}}}]
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.job_labels()},
            "spec": body}


SERVE_RESOURCES = {"cpu": 1, "memory": "2Gi"}
"""The predictor's requests (= limits) unless the platform sets ``serve_resources``."""


@dataclass(frozen=True)
class ClusterServeSpec:
    model_uri: str
    """s3://bucket/prefix/model: KServe's storage initializer copies it to /mnt/models."""
    model_name: str
    image: str = ""
    namespace: str = "kubeflow-user"
    service_account: str = "kfp-pytorch-s3"
    """ServiceAccount whose Secret carries the serving.kserve.io/s3-* annotations."""
    resources: dict = field(default_factory=lambda: dict(SERVE_RESOURCES))
    min_replicas: int = 1
    max_replicas: int = 1
    canary_traffic_percent: int | None = None
    raw_deployment: bool = True
    """RawDeployment mode (no Knative/Istio needed), the usual on-prem choice; else Serverless
    (Knative), which alone has canary rollouts and scale to zero."""
    labels: dict = field(default_factory=dict)
    """The platform's labels: on the InferenceService and its predictor pods."""
    restricted: bool = True
    """As :attr:`ClusterTrainSpec.restricted`, for the predictor's pods."""
    image_pull_secrets: tuple = ()
    registered_model: str = ""
    """``models:/NAME/VERSION``: the InferenceService's annotation :data:`REGISTERED_MODEL` (which
    registered version it serves, for `kubectl get -o yaml` and tools that map the two)."""

    def validate(self) -> dict:
        problems = []
        if problem := image_problem(self.image, "the kfp-pytorch image, which holds the predictor"):
            problems.append(problem)
        if not is_dns1123_label(self.model_name, 45):
            problems.append(f"model_name: must be a DNS-1123 label of at most 45 characters, got {self.model_name!r}")
        if not self.model_uri.startswith(("s3://", "minio://", "pvc://")):
            problems.append(f"model_uri: must be s3://, minio:// or pvc:// for KServe, got {self.model_uri!r}")
        canary = self.canary_traffic_percent
        if canary is not None and not 0 <= canary <= 100:
            problems.append(f"canary_traffic_percent: must be in [0, 100], got {canary}")
            canary = None
        problems += serving_mode_problems(canary, self.min_replicas, self.max_replicas, self.raw_deployment)
        return _finish_validation(problems, self.resources, "invalid serving settings")


def cpu_memory_problems(res, where: str, gpus: str) -> list[str]:
    """A pod's CPU and memory from the platform file (``serve_resources``, ``train_resources``);
    ``gpus`` says where its GPUs come from instead."""
    if not isinstance(res, dict):
        return [f"{where}: must be a mapping like {{cpu: 4, memory: 16Gi}}, got {res!r}"]
    problems = [f"{where}.{k}: {gpus}" if k in ("gpu", "nvidia.com/gpu") else
                f"{where}.{k}: unknown resource (use cpu, memory)" for k in res if k not in ("cpu", "memory")]
    try:
        parse_resources({k: v for k, v in res.items() if k in ("cpu", "memory")}, where)
    except ConfigError as e:
        problems += e.problems
    return problems


def serve_resources_problems(res, where: str) -> list[str]:
    return cpu_memory_problems(res, where, "the predictor runs on CPU; give cpu and memory")


def train_resources_problems(res, where: str) -> list[str]:
    return cpu_memory_problems(res, where, "a training pod's GPUs are the run's gpus_per_node parameter")


CANARY_NEEDS_SERVERLESS = (
    "canary_traffic_percent: a canary rollout needs KServe's Serverless mode (Knative); in RawDeployment KServe "
    "ignores it and sends all traffic to the new version. Set serving_mode: Serverless in the platform file, or "
    "leave canary_traffic_percent at -1")
SERVING_MODES = ("RawDeployment", "Serverless")


def serving_mode_problems(canary_traffic_percent: int | None, min_replicas, max_replicas, raw_deployment: bool,
                          names: tuple[str, str] = ("min_replicas", "max_replicas")) -> list[str]:
    """What KServe's mode allows: a canary and scale to zero are Knative's (Serverless) alone."""
    problems = [CANARY_NEEDS_SERVERLESS] if canary_traffic_percent is not None and raw_deployment else []
    return problems + replicas_problems(min_replicas, max_replicas, raw_deployment, names)


def replicas_problems(min_replicas, max_replicas, raw_deployment: bool | None = True,
                      names: tuple[str, str] = ("min_replicas", "max_replicas")) -> list[str]:
    """The predictor's replicas: KServe scales between them (in RawDeployment with an HPA on CPU
    use, so the predictor's CPU request matters). Scale to zero is Knative's alone; ``None``: the
    mode is not known yet (a pipeline's parameters), so 0 passes here and is judged by the step."""
    lo, hi = names
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (min_replicas, max_replicas)):
        return [f"{lo}, {hi}: must be whole numbers, got {min_replicas!r}, {max_replicas!r}"]
    if max_replicas < 1:
        return [f"{hi}: must be >= 1, got {max_replicas}"]
    if min_replicas == 0 and raw_deployment:
        return [f"{lo}: 0 (scale to zero) needs KServe's Serverless mode (Knative), and the predictor runs as a "
                "RawDeployment; use 1 or more, or set serving_mode: Serverless in the platform file"]
    if not 0 <= min_replicas <= max_replicas:
        return [f"{lo}: must be in [1, {hi}={max_replicas}], got {min_replicas}"]
    return []


def to_inference_service(spec: ClusterServeSpec) -> dict:
    """A ``serving.kserve.io/v1beta1`` InferenceService running our TorchPredictor (OIP v2)."""
    resources = spec.validate()
    uri = "s3://" + spec.model_uri[len("minio://"):] if spec.model_uri.startswith("minio://") else spec.model_uri
    predictor: dict = {
        "serviceAccountName": spec.service_account,
        "minReplicas": spec.min_replicas,
        "maxReplicas": spec.max_replicas,
        "containers": [{
            "name": "kserve-container",
            "image": spec.image,
            "command": ["python", "-m", "kfp_pytorch.components.kserve_predictor"],
            "args": ["--model_name", spec.model_name, "--model_uri", "/mnt/models", "--http_port", "8080",
                     "--enable_grpc", "false"],
            # KServe's storage initializer copies the model from MinIO (credentials: the service
            # account's annotated Secret) to /mnt/models before the predictor starts. A custom
            # predictor names the model with STORAGE_URI on the kserve-container: every KServe
            # release reads it. spec.predictor.storageUris is newer (0.16): older releases prune
            # the unknown field, so the predictor started without its model, and 0.16.0 failed to
            # reconcile it for s3:// (kserve/kserve#4819). PROTOCOL tells KServe we speak OIP v2.
            "env": [{"name": "STORAGE_URI", "value": uri}, {"name": "PROTOCOL", "value": "v2"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "ports": [{"containerPort": 8080, "protocol": "TCP"}],
            # Ready once the model is loaded and answers, not when the process starts: without a
            # probe a new pod took traffic while it loaded (a canary or a new version's rollout
            # refused requests), and KServe called the InferenceService Ready too soon. Knative
            # (serverless mode) refuses a probe port: it probes the serving port itself.
            "readinessProbe": {"httpGet": {"path": f"/v2/models/{spec.model_name}/ready",
                                           **({"port": 8080} if spec.raw_deployment else {})},
                               "periodSeconds": 5, "failureThreshold": 3},
            "resources": {"requests": dict(resources), "limits": dict(resources)},
        }],
    }
    if spec.restricted:
        predictor["securityContext"], predictor["containers"][0]["securityContext"] = restricted_security_contexts()
    if spec.image_pull_secrets:
        predictor["imagePullSecrets"] = pull_secrets(spec.image_pull_secrets)
    if spec.canary_traffic_percent is not None:
        predictor["canaryTrafficPercent"] = spec.canary_traffic_percent
    if spec.labels:
        predictor["labels"] = dict(spec.labels)  # KServe puts the component's labels on its pods
    meta: dict = {"name": spec.model_name, "namespace": spec.namespace,
                  "labels": {**spec.labels, "app.kubernetes.io/managed-by": "kfp-pytorch"}}
    # said either way, so the InferenceService does not depend on the cluster's default mode
    meta["annotations"] = {"serving.kserve.io/deploymentMode": SERVING_MODES[0 if spec.raw_deployment else 1]}
    if spec.registered_model:
        meta["annotations"][REGISTERED_MODEL] = spec.registered_model
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
            "spec": {"predictor": predictor}}


def kserve_s3_secret_and_sa(s3: S3Access, namespace: str, service_account: str = "kfp-pytorch-s3") -> list[dict]:
    """The annotated Secret (without data: create it with kubectl) and the ServiceAccount that uses it.

    Secret data is never generated: ``kubectl -n NS create secret generic kfp-pytorch-s3
    --from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...`` then apply this
    to annotate it.
    """
    from urllib.parse import urlparse

    ep = urlparse(s3.endpoint if "://" in s3.endpoint else f"http://{s3.endpoint}")
    return [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": s3.secret_name, "namespace": namespace, "annotations": {
             "serving.kserve.io/s3-endpoint": ep.netloc,
             "serving.kserve.io/s3-usehttps": "1" if ep.scheme == "https" else "0",
             "serving.kserve.io/s3-verifyssl": "1" if s3.verify_ssl else "0",
             "serving.kserve.io/s3-region": s3.region,
             **({"serving.kserve.io/s3-cabundle-configmap": s3.ca_configmap} if s3.ca_configmap else {})}}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": service_account, "namespace": namespace},
         "secrets": [{"name": s3.secret_name}]},
    ]


def kfp_launcher_configmap(namespace: str, pipeline_root: str = "minio://mlpipeline/v2/artifacts",
                           s3: S3Access | None = None) -> dict:
    """The per-namespace ``kfp-launcher`` ConfigMap: MinIO pipeline root and provider credentials."""
    import yaml
    from urllib.parse import urlparse

    s3 = s3 or S3Access(endpoint="http://minio-service.kubeflow:9000", secret_name="mlpipeline-minio-artifact",
                        access_key_key="accesskey", secret_key_key="secretkey", region="minio")
    if not pipeline_root.startswith(("minio://", "s3://")):
        raise ConfigError([f"pipeline_root: must be minio://BUCKET/PREFIX or s3://..., got {pipeline_root!r}"],
                          title="invalid launcher settings")
    ep = urlparse(s3.endpoint if "://" in s3.endpoint else f"http://{s3.endpoint}")
    provider = {"default": {"endpoint": ep.netloc, "disableSSL": ep.scheme != "https", "region": s3.region,
                            "credentials": {"fromEnv": False, "secretRef": {
                                "secretName": s3.secret_name, "accessKeyKey": s3.access_key_key,
                                "secretKeyKey": s3.secret_key_key}}}}
    scheme = pipeline_root.split("://")[0]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kfp-launcher", "namespace": namespace},
            "data": {"defaultPipelineRoot": pipeline_root,
                     "providers": yaml.safe_dump({scheme: provider}, sort_keys=False)}}


def output_key(output_uri: str) -> str:
    """The job's run id for a train step not given the KFP run's (a user's pipeline that calls
    train_op without ``run_id``): 12 hex digits of its output URI, which KFP makes per run and task.
    A fixed one named every such run's job alike, and the next run adopted the last one's finished
    job (and its model) as a retry of its own. Pure."""
    import hashlib

    return hashlib.sha256(output_uri.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ClusterConfig:
    """Infrastructure settings of the cluster backends, from the step's environment (never from
    pipeline parameters): set them once per namespace, e.g. with a PodDefault or the kfp-launcher."""

    image: str = ""
    namespace: str = "default"
    user: str = ""
    s3: S3Access = field(default_factory=S3Access)
    cpu_per_node: str = ""
    memory_per_node: str = ""
    fairness: bool = False
    train_kind: str = "PyTorchJob"
    delete_policy: str = "on-success"
    service_account: str = "kfp-pytorch-s3"
    pod_labels: dict = field(default_factory=dict)
    gpu_node_selector: dict = field(default_factory=dict)
    gpu_tolerations: list = field(default_factory=list)
    kueue_queue: str = ""
    kueue_priority_class: str = ""
    istio_sidecar: bool = False
    restricted: bool = True
    shm: bool = True
    serve_resources: dict = field(default_factory=lambda: dict(SERVE_RESOURCES))
    image_pull_secrets: tuple = ()
    serving_mode: str = "RawDeployment"

    @classmethod
    def from_env(cls, env: dict | None = None) -> "ClusterConfig":
        import os
        from pathlib import Path

        from .storage import StorageError, flag, flag_problem, parse_endpoint

        env = dict(os.environ if env is None else env)
        problems = [p for p in (flag_problem(k, env.get(k)) for k in ("KFP_PYTORCH_FAIRNESS", "S3_VERIFY_SSL",
                                                                      "KFP_PYTORCH_ISTIO_SIDECAR",
                                                                      "KFP_PYTORCH_RESTRICTED_PODS",
                                                                      "KFP_PYTORCH_SHM_VOLUME")) if p]
        for key, allowed in (("KFP_PYTORCH_TRAIN_KIND", ("PyTorchJob", "TrainJob")),
                             ("KFP_PYTORCH_DELETE_POLICY", ("on-success", "always", "never")),
                             ("KFP_PYTORCH_SERVING_MODE", SERVING_MODES)):
            if env.get(key) and env[key] not in allowed:
                problems.append(f"{key}: must be one of {', '.join(allowed)}, got {env[key]!r}")
        for key, res in (("KFP_PYTORCH_CPU_PER_NODE", "cpu"), ("KFP_PYTORCH_MEMORY_PER_NODE", "memory")):
            if env.get(key):
                try:
                    parse_resources({res: env[key]}, key)
                except ConfigError as e:
                    problems += [q.replace(f"{key}.{res}:", f"{key}:") for q in e.problems]
        if env.get("AWS_ENDPOINT_URL"):
            try:
                parse_endpoint(env["AWS_ENDPOINT_URL"])
            except StorageError as e:
                problems.append(f"AWS_ENDPOINT_URL: {e.message}")
        # the platform file's settings, passed on by apply_platform for the pods the step creates
        loaded = {}
        for key, empty, check in (("KFP_PYTORCH_POD_LABELS", {}, label_problems),
                                  ("KFP_PYTORCH_GPU_NODE_SELECTOR", {}, label_problems),
                                  ("KFP_PYTORCH_GPU_TOLERATIONS", [], toleration_problems),
                                  ("KFP_PYTORCH_S3_KEYS", {}, s3_keys_problems),
                                  ("KFP_PYTORCH_SERVE_RESOURCES", dict(SERVE_RESOURCES), serve_resources_problems),
                                  ("KFP_PYTORCH_IMAGE_PULL_SECRETS", [], pull_secret_problems)):
            loaded[key] = empty
            if env.get(key):
                try:
                    loaded[key] = json.loads(env[key])
                except ValueError:
                    problems.append(f"{key}: must be JSON, got {env[key]!r}")
                    continue
                problems += check(loaded[key], key)
        problems += object_name_problems(env.get("KFP_PYTORCH_KUEUE_QUEUE"), "KFP_PYTORCH_KUEUE_QUEUE")
        problems += object_name_problems(env.get("KFP_PYTORCH_KUEUE_PRIORITY_CLASS"), "KFP_PYTORCH_KUEUE_PRIORITY_CLASS",
                                         "WorkloadPriorityClass")
        problems += object_name_problems(env.get("KFP_PYTORCH_S3_CA_CONFIGMAP"), "KFP_PYTORCH_S3_CA_CONFIGMAP",
                                         "ConfigMap")
        if problems:
            raise ConfigError(problems, "fix the step's environment (a PodDefault, the platform file or the "
                                        "kfp-launcher settings)", title="invalid cluster settings")
        ns = env.get("KFP_PYTORCH_NAMESPACE")
        sa_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        if not ns and sa_ns.exists():
            ns = sa_ns.read_text().strip()
        return cls(
            image=env.get("KFP_PYTORCH_IMAGE", ""),
            namespace=ns or "default",
            user=(env.get("KFP_PYTORCH_USER") or loaded["KFP_PYTORCH_POD_LABELS"].get(f"{LABEL_PREFIX}/user")
                  or ns or ""),
            s3=S3Access(endpoint=env.get("AWS_ENDPOINT_URL", S3Access.endpoint),
                        secret_name=env.get("KFP_PYTORCH_S3_SECRET", S3Access.secret_name),
                        **_secret_keys(loaded["KFP_PYTORCH_S3_KEYS"]),
                        region=env.get("AWS_REGION", S3Access.region),
                        verify_ssl=flag(env.get("S3_VERIFY_SSL"), True),
                        ca_configmap=env.get("KFP_PYTORCH_S3_CA_CONFIGMAP") or ""),
            cpu_per_node=env.get("KFP_PYTORCH_CPU_PER_NODE", ""),
            memory_per_node=env.get("KFP_PYTORCH_MEMORY_PER_NODE", ""),
            fairness=flag(env.get("KFP_PYTORCH_FAIRNESS"), False),
            train_kind=env.get("KFP_PYTORCH_TRAIN_KIND") or "PyTorchJob",
            delete_policy=env.get("KFP_PYTORCH_DELETE_POLICY") or "on-success",
            service_account=env.get("KFP_PYTORCH_SERVICE_ACCOUNT", "kfp-pytorch-s3"),
            pod_labels=loaded["KFP_PYTORCH_POD_LABELS"],
            gpu_node_selector=loaded["KFP_PYTORCH_GPU_NODE_SELECTOR"],
            gpu_tolerations=loaded["KFP_PYTORCH_GPU_TOLERATIONS"],
            kueue_queue=env.get("KFP_PYTORCH_KUEUE_QUEUE") or "",
            kueue_priority_class=env.get("KFP_PYTORCH_KUEUE_PRIORITY_CLASS") or "",
            istio_sidecar=flag(env.get("KFP_PYTORCH_ISTIO_SIDECAR"), False),
            restricted=flag(env.get("KFP_PYTORCH_RESTRICTED_PODS"), True),
            shm=flag(env.get("KFP_PYTORCH_SHM_VOLUME"), True),
            serve_resources={**SERVE_RESOURCES, **loaded["KFP_PYTORCH_SERVE_RESOURCES"]},
            image_pull_secrets=tuple(loaded["KFP_PYTORCH_IMAGE_PULL_SECRETS"]),
            serving_mode=env.get("KFP_PYTORCH_SERVING_MODE") or "RawDeployment",
        )

    def train_spec(self, train: "TrainSpec") -> ClusterTrainSpec:
        resources: dict = {}
        if self.cpu_per_node:
            resources["cpu"] = self.cpu_per_node
        if self.memory_per_node:
            resources["memory"] = self.memory_per_node
        if train.gpus_per_node:
            resources["gpu"] = train.gpus_per_node
        gpu = train.gpus_per_node > 0  # GPU placement for GPU pods only (CPU jobs stay off GPU nodes)
        return ClusterTrainSpec(train=train, image=self.image, namespace=self.namespace, run_id=train.run_id or output_key(train.output_uri),
                                task=train.task, user=self.user, nodes=train.nodes, resources=resources, s3=self.s3,
                                fairness=self.fairness, pod_labels=self.pod_labels, kueue_queue=self.kueue_queue,
                                kueue_priority_class=self.kueue_priority_class, istio_sidecar=self.istio_sidecar,
                                restricted=self.restricted, shm=self.shm,
                                image_pull_secrets=self.image_pull_secrets, node_selector=self.gpu_node_selector if gpu else {},
                                tolerations=self.gpu_tolerations if gpu else [])

    def serve_spec(self, model_uri: str, model_name: str, canary_traffic_percent: int | None = None,
                   min_replicas: int = 1, max_replicas: int = 1, registered_model: str = "") -> ClusterServeSpec:
        return ClusterServeSpec(model_uri, model_name, self.image, self.namespace, self.service_account,
                                resources=dict(self.serve_resources), min_replicas=min_replicas,
                                max_replicas=max_replicas, image_pull_secrets=self.image_pull_secrets,
                                raw_deployment=self.serving_mode == "RawDeployment",
                                canary_traffic_percent=canary_traffic_percent, labels=self.pod_labels,
                                restricted=self.restricted, registered_model=registered_model)


_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def s3_keys_problems(keys, where: str) -> list[str]:
    """``keys`` maps the S3 Secret's keys to environment variables (the platform's ``s3_keys``)."""
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        return [f"{where}: must map the Secret's keys to environment variable names, got {keys!r}"]
    return [f"{where}: no Secret key maps to {name}" for name in _S3_ENV if name not in keys.values()]


def _secret_keys(keys: dict) -> dict:
    """S3Access's ``access_key_key`` / ``secret_key_key`` from an ``s3_keys`` mapping (none: the defaults)."""
    by_env = {v: k for k, v in keys.items()}
    return ({"access_key_key": by_env["AWS_ACCESS_KEY_ID"], "secret_key_key": by_env["AWS_SECRET_ACCESS_KEY"]}
            if keys else {})


def dump_yaml(docs: list[dict]) -> str:
    """Multi-document YAML as kubectl users expect: no anchors, multi-line strings as blocks."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):
            return True

    def _str(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)
