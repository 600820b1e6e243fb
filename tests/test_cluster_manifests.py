"""Cluster manifests: built by pure functions, valid against the upstream CRD schemas."""
import dataclasses
import json

import jsonschema
import pytest

from kfp_pytorch.components.cluster import (FAIRNESS_GATE, ClusterServeSpec, ClusterTrainSpec, S3Access,
                                            dns1123_name, kfp_launcher_configmap, kserve_s3_secret_and_sa,
                                            parse_resources, to_inference_service, to_pytorchjob, to_trainjob)
from kfp_pytorch.components.errors import ConfigError
from kfp_pytorch.components.train import TrainSpec
from k8s_schemas import validate_manifest

IMAGE = "registry.example.com/kfp-pytorch:0.1.0"


def spec(**kw):
    base = dict(train=TrainSpec("s3://data/run1/dataset", "s3://models/run1", workers=4, epochs=3), image=IMAGE,
                namespace="team-a", run_id="8f14e45f-ceea-467f-a0e6-1a2b3c4d5e6f", task="train-op", user="alice",
                nodes=2, resources={"cpu": 4, "memory": "16Gi", "gpu": 2})
    base.update(kw)
    return ClusterTrainSpec(**base)


def test_pytorchjob_is_valid_and_complete():
    job = to_pytorchjob(spec(fairness=True, queue="gpu", active_deadline_seconds=7200, elastic_min_nodes=1,
                             node_selector={"nvidia.com/gpu.present": "true"},
                             tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]))
    validate_manifest(job)
    s = job["spec"]
    assert s["nprocPerNode"] == "2" and s["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert s["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3, "activeDeadlineSeconds": 7200,
                              "ttlSecondsAfterFinished": 86400,
                              "schedulingPolicy": {"minAvailable": 2, "queue": "gpu", "priorityClass": "kfp-pytorch-default"}}
    assert s["elasticPolicy"]["rdzvBackend"] == "c10d"
    pod = s["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["name"] == "pytorch" and c["image"] == IMAGE
    assert c["command"] == ["python", "-m", "torch.distributed.run", "-m", "kfp_pytorch.components.train_worker"]
    assert "s3://data/run1/dataset" in c["args"] and "s3://models/run1" in c["args"]
    assert c["resources"]["limits"] == {"cpu": 4, "memory": "16Gi", "nvidia.com/gpu": 2}
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kfp-pytorch-s3",
                                                                        "key": "AWS_SECRET_ACCESS_KEY"}
    assert "value" not in env["AWS_ACCESS_KEY_ID"]  # never literal
    assert pod["schedulingGates"] == [{"name": FAIRNESS_GATE}] and pod["priorityClassName"] == "kfp-pytorch-default"
    labels = job["metadata"]["labels"]
    assert labels["kfp-pytorch.io/user"] == "alice" and labels["kfp-pytorch.io/task"] == "train-op"


def test_single_node_job_has_no_worker_replicas_and_no_gate_by_default():
    job = to_pytorchjob(spec(nodes=1, resources={"cpu": 4, "gpu": 4}))
    validate_manifest(job)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert "schedulingGates" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def test_job_name_is_deterministic_and_dns1123():
    a, b = spec(), spec()
    assert a.name == b.name and len(a.name) <= 50
    long = spec(run_id="X" * 80, task="Some_Very/Long Task Name" * 4)
    validate_manifest(to_pytorchjob(long))
    assert long.name != spec(run_id="Y" * 80, task="Some_Very/Long Task Name" * 4).name


@pytest.mark.parametrize("raw,ok", [("train-op", True), ("Train_Op", False), ("a" * 70, False), ("-x-", False)])
def test_dns1123_name(raw, ok):
    name = dns1123_name(raw)
    assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert (name == raw) is ok


def test_trainjob_is_valid():
    tj = to_trainjob(spec())
    validate_manifest(tj)
    t = tj["spec"]["trainer"]
    assert t["numNodes"] == 2 and t["numProcPerNode"] == 2 and t["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 2
    assert tj["spec"]["runtimeRef"]["name"] == "torch-distributed"
    gated = to_trainjob(spec(fairness=True))  # the fairness gate was left off a TrainJob's pods
    validate_manifest(gated)
    pod = gated["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]
    assert pod["spec"]["template"]["spec"]["schedulingGates"] == [{"name": FAIRNESS_GATE}]


def test_inference_service_is_valid():
    isvc = to_inference_service(ClusterServeSpec("minio://models/run1/model", "digits", IMAGE, canary_traffic_percent=10,
                                                 raw_deployment=False, registered_model="models:/digits/3"))
    validate_manifest(isvc)
    assert isvc["metadata"]["annotations"] == {"serving.kserve.io/deploymentMode": "Serverless",
                                               "kfp-pytorch.io/registered-model": "models:/digits/3"}
    p = isvc["spec"]["predictor"]
    assert p["canaryTrafficPercent"] == 10 and p["serviceAccountName"] == "kfp-pytorch-s3"
    c = p["containers"][0]
    # the model is named the way every KServe release reads it for a custom predictor
    assert "storageUris" not in p and "storageUri" not in p
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["STORAGE_URI"] == "s3://models/run1/model" and env["PROTOCOL"] == "v2"
    assert "--model_uri" in c["args"] and "/mnt/models" in c["args"]
    assert c["command"][-1] == "kfp_pytorch.components.kserve_predictor"


def test_a_canary_in_raw_deployment_is_refused_not_rolled_out_to_all_traffic():
    # KServe's canary rollouts are Knative's: in RawDeployment it ignored canaryTrafficPercent and the
    # "10% canary" took all traffic at once
    spec = ClusterServeSpec("s3://models/run1/model", "digits", IMAGE, canary_traffic_percent=10)
    with pytest.raises(ConfigError) as e:
        to_inference_service(spec)
    assert e.value.problems == ["canary_traffic_percent: a canary rollout needs KServe's Serverless mode (Knative); in "
                                "RawDeployment KServe ignores it and sends all traffic to the new version. Set "
                                "serving_mode: Serverless in the platform file, or leave canary_traffic_percent at -1"]
    raw = to_inference_service(dataclasses.replace(spec, canary_traffic_percent=None))
    assert raw["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


def test_the_predictor_is_ready_when_its_model_answers_not_when_it_starts():
    # without a probe a new predictor pod took traffic while it loaded its model
    for raw, port in ((True, {"port": 8080}), (False, {})):
        isvc = to_inference_service(ClusterServeSpec("s3://models/run1/model", "digits", IMAGE, raw_deployment=raw))
        validate_manifest(isvc)
        probe = isvc["spec"]["predictor"]["containers"][0]["readinessProbe"]
        assert probe["httpGet"] == {"path": "/v2/models/digits/ready", **port}  # Knative refuses a port


@pytest.mark.parametrize("lo,hi,problem", [
    (2, 5, None),
    (3, 3, None),
    (0, 2, "min_replicas: 0 (scale to zero) needs KServe's Serverless mode (Knative)"),
    (3, 2, "min_replicas: must be in [1, max_replicas=2], got 3"),
    (1, 0, "max_replicas: must be >= 1, got 0"),
    (1.5, 2, "min_replicas, max_replicas: must be whole numbers, got 1.5, 2"),
])
def test_the_predictors_replicas_are_what_kserve_can_scale_between(lo, hi, problem):
    spec = ClusterServeSpec("s3://models/run1/model", "digits", IMAGE, min_replicas=lo, max_replicas=hi)
    if problem is None:
        isvc = to_inference_service(spec)
        validate_manifest(isvc)
        assert (isvc["spec"]["predictor"]["minReplicas"], isvc["spec"]["predictor"]["maxReplicas"]) == (lo, hi)
    else:
        with pytest.raises(ConfigError) as e:
            to_inference_service(spec)
        assert any(p.startswith(problem) for p in e.value.problems), e.value.problems
    # Knative scales to zero
    if (lo, hi) == (0, 2):
        isvc = to_inference_service(dataclasses.replace(spec, raw_deployment=False))
        validate_manifest(isvc)
        assert isvc["spec"]["predictor"]["minReplicas"] == 0


def test_kserve_secret_annotations_without_credentials():
    secret, sa = kserve_s3_secret_and_sa(S3Access(endpoint="https://minio.lab:9000", verify_ssl=False), "team-a")
    ann = secret["metadata"]["annotations"]
    assert ann == {"serving.kserve.io/s3-endpoint": "minio.lab:9000", "serving.kserve.io/s3-usehttps": "1",
                   "serving.kserve.io/s3-verifyssl": "0", "serving.kserve.io/s3-region": "us-east-1"}
    assert "data" not in secret and "stringData" not in secret and sa["secrets"] == [{"name": "kfp-pytorch-s3"}]


def test_kfp_launcher_configmap():
    import yaml

    cm = kfp_launcher_configmap("team-a")
    assert cm["data"]["defaultPipelineRoot"] == "minio://mlpipeline/v2/artifacts"
    prov = yaml.safe_load(cm["data"]["providers"])["minio"]["default"]
    assert prov["endpoint"] == "minio-service.kubeflow:9000" and prov["disableSSL"] is True
    assert prov["credentials"] == {"fromEnv": False, "secretRef": {"secretName": "mlpipeline-minio-artifact",
                                                                   "accessKeyKey": "accesskey", "secretKeyKey": "secretkey"}}
    with pytest.raises(ConfigError):
        kfp_launcher_configmap("team-a", "gs://bucket")


@pytest.mark.parametrize("res,needle", [
    ({"gpu": "2 GPUs"}, "resources.gpu: '2 GPUs' is not a Kubernetes quantity"),
    ({"gpu": "0.5"}, "GPUs must be a whole number"),
    ({"memory": "16 GB"}, "resources.memory: '16 GB'"),
    ({"tpu": 1}, "resources.tpu: unknown resource"),
])
def test_malformed_resources(res, needle):
    with pytest.raises(ConfigError) as e:
        parse_resources(res)
    assert needle in str(e.value)


def test_missing_image_and_more_are_listed_together():
    with pytest.raises(ConfigError) as e:
        to_pytorchjob(spec(image="", namespace="Bad NS", nodes=3, resources={"gpu": "2 GPUs"}))
    text = str(e.value)
    for needle in ("image: required", "namespace: must be a DNS-1123 label", "multiple of nodes", "2 GPUs"):
        assert needle in text


@pytest.mark.parametrize("image", ["kfp-pytorch", "registry.example.com/kfp-pytorch:0.1.0",
                                   "localhost:5000/team/kfp_pytorch__x-y:v1.2-rc.1", "[::1]:5000/kfp-pytorch",
                                   "ghcr.io/o/kfp-pytorch:0.1@sha256:" + "ab" * 32])
def test_image_references_that_a_kubelet_pulls_are_accepted(image):
    assert to_pytorchjob(spec(image=image))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["image"] == image


@pytest.mark.parametrize("image", ["kfp pytorch", "Registry.example.com/KFP-pytorch", "kfp-pytorch:", "-kfp",
                                   "reg.example.com/", "kfp-pytorch@sha256:abc", "kfp-pytorch:" + "t" * 129,
                                   "reg.example.com/" + "a" * 240])
def test_a_malformed_image_reference_is_refused_before_submission(image):
    with pytest.raises(ConfigError) as e:
        to_pytorchjob(spec(image=image))
    assert f"image: {image!r} is not an image reference" in str(e.value)
    with pytest.raises(ConfigError) as e:
        to_inference_service(ClusterServeSpec("s3://models/digits/v1", "digits", image))
    assert "is not an image reference" in str(e.value)


def test_schema_validation_catches_an_invalid_manifest():
    job = to_pytorchjob(spec())
    job["spec"]["runPolicy"]["backoffLimit"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(job)
    job = to_pytorchjob(spec())
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(job)


def test_no_credentials_in_any_manifest(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "super-secret-value")
    text = json.dumps([to_pytorchjob(spec()), to_trainjob(spec()),
                       to_inference_service(ClusterServeSpec("s3://models/x", "digits", IMAGE)), kfp_launcher_configmap("a")])
    assert "super-secret-value" not in text


def test_the_steps_environment_is_checked_once_with_every_problem_named():
    from kfp_pytorch.components.cluster import ClusterConfig

    cfg = ClusterConfig.from_env({"KFP_PYTORCH_FAIRNESS": "True", "S3_VERIFY_SSL": "no", "KFP_PYTORCH_NAMESPACE": "t"})
    assert cfg.fairness is True and cfg.s3.verify_ssl is False  # 'True' was read as off, 'no' as on
    assert ClusterConfig.from_env({"KFP_PYTORCH_TRAIN_KIND": ""}).train_kind == "PyTorchJob"
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_env({"KFP_PYTORCH_FAIRNESS": "enabled", "KFP_PYTORCH_TRAIN_KIND": "pytorchjob",
                                "KFP_PYTORCH_DELETE_POLICY": "onsuccess", "KFP_PYTORCH_CPU_PER_NODE": "four",
                                "KFP_PYTORCH_MEMORY_PER_NODE": "16GB", "AWS_ENDPOINT_URL": "minio:9000/bucket"})
    assert e.value.problems == [
        "KFP_PYTORCH_FAIRNESS: must be one of 1/true/yes/on or 0/false/no/off, got 'enabled'",
        "KFP_PYTORCH_TRAIN_KIND: must be one of PyTorchJob, TrainJob, got 'pytorchjob'",
        "KFP_PYTORCH_DELETE_POLICY: must be one of on-success, always, never, got 'onsuccess'",
        "KFP_PYTORCH_CPU_PER_NODE: 'four' is not a Kubernetes quantity (examples: cpu '500m' or 4, memory '16Gi', gpu 1)",
        "KFP_PYTORCH_MEMORY_PER_NODE: '16GB' is not a Kubernetes quantity (examples: cpu '500m' or 4, memory '16Gi', gpu 1)",
        "AWS_ENDPOINT_URL: S3 endpoint 'minio:9000/bucket' has a path; the endpoint is the server only"]
    assert "PodDefault" in e.value.hint


def test_the_platform_reaches_the_pods_a_step_creates():
    # the platform file went to the step's pod only: a PyTorchJob's GPU pods got no toleration of
    # the GPU nodes' taint (Pending for ever), referenced the default Secret and its default keys,
    # and were accounted to the namespace rather than the platform's user
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    platform = load_platform({
        "s3_secret": "mlpipeline-minio-artifact", "s3_keys": {"accesskey": "AWS_ACCESS_KEY_ID",
                                                              "secretkey": "AWS_SECRET_ACCESS_KEY"},
        "labels": {"kfp-pytorch.io/user": "alice", "team": "vision"},
        "gpu_node_selector": {"nvidia.com/gpu.present": "true"},
        "gpu_tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, "KFP_PYTORCH_NAMESPACE": "team-a",
                                  **platform_env(platform, gpu=True)})
    train = TrainSpec("s3://data/d", "s3://models/m", workers=4, nodes=2, gpus_per_node=2, backend="cluster")
    job = to_pytorchjob(cfg.train_spec(train))
    validate_manifest(job)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["metadata"]["labels"]["team"] == "vision" and pod["metadata"]["labels"]["kfp-pytorch.io/user"] == "alice"
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e}
        assert refs == {"AWS_ACCESS_KEY_ID": {"name": "mlpipeline-minio-artifact", "key": "accesskey"},
                        "AWS_SECRET_ACCESS_KEY": {"name": "mlpipeline-minio-artifact", "key": "secretkey"}}
    tj = to_trainjob(cfg.train_spec(train))
    validate_manifest(tj)
    [patch] = tj["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]
    assert node["name"] == "node" and pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["metadata"]["labels"]["kfp-pytorch.io/user"] == "alice" and pod["spec"]["tolerations"]
    isvc = to_inference_service(cfg.serve_spec("s3://models/m/model", "digits"))
    validate_manifest(isvc)
    assert isvc["spec"]["predictor"]["labels"]["team"] == "vision" and isvc["metadata"]["labels"]["team"] == "vision"
    # a CPU job is not sent to the GPU nodes
    cpu = to_pytorchjob(cfg.train_spec(TrainSpec("s3://data/d", "s3://models/m", workers=2, backend="cluster",
                                                 device="cpu")))
    assert "nodeSelector" not in cpu["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def test_a_kueue_queue_labels_the_training_job_only():
    # Kueue admits a job by the queue label on the job itself; on the step pods or the pods of
    # the job (the platform's labels go there) it would queue those as well, where Kueue's pod
    # integration is on.
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    platform = load_platform({"kueue_queue": "team-a-gpu", "labels": {"team": "vision"}})
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, "KFP_PYTORCH_NAMESPACE": "team-a",
                                  **platform_env(platform, gpu=True)})
    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    for job in (to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))):
        validate_manifest(job)
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpu"
        assert "kueue.x-k8s.io/queue-name" not in json.dumps(job["spec"])  # not on its pods
    isvc = to_inference_service(cfg.serve_spec("s3://models/m/model", "digits"))
    assert "kueue.x-k8s.io/queue-name" not in json.dumps(isvc)
    assert "kueue.x-k8s.io/queue-name" not in to_pytorchjob(ClusterConfig.from_env(
        {"KFP_PYTORCH_IMAGE": IMAGE}).train_spec(train))["metadata"]["labels"]  # no queue: no label
    with pytest.raises(ConfigError) as e:
        load_platform({"kueue_queue": "Team_A", "labels": {"kueue.x-k8s.io/queue-name": "team-a-gpu"}})
    assert e.value.problems == [
        "kueue_queue: 'Team_A' is not a LocalQueue name (lowercase letters, digits, '-' and '.'; at most 63)",
        "labels.kueue.x-k8s.io/queue-name: would put every step pod and the InferenceService in Kueue's queue too; "
        "write kueue_queue: team-a-gpu instead (it labels only the training job)"]
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_env({"KFP_PYTORCH_KUEUE_QUEUE": "a b"})
    assert e.value.problems == ["KFP_PYTORCH_KUEUE_QUEUE: 'a b' is not a LocalQueue name (lowercase letters, digits, "
                                "'-' and '.'; at most 63)"]


def test_a_kueue_priority_class_labels_the_training_job_only():
    # Kueue orders and preempts a job's Workload by the WorkloadPriorityClass named on the job
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    platform = load_platform({"kueue_queue": "team-a-gpu", "kueue_priority_class": "research"})
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, **platform_env(platform, gpu=True)})
    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    for job in (to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))):
        validate_manifest(job)
        assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research"
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpu"
        assert "kueue.x-k8s.io/priority-class" not in json.dumps(job["spec"])
    assert "kueue.x-k8s.io" not in json.dumps(to_inference_service(cfg.serve_spec("s3://models/m/model", "digits")))
    with pytest.raises(ConfigError) as e:
        load_platform({"kueue_priority_class": "High_Priority", "labels": {"kueue.x-k8s.io/priority-class": "high"}})
    assert e.value.problems == [
        "kueue_priority_class: 'High_Priority' is not a WorkloadPriorityClass name (lowercase letters, digits, '-' "
        "and '.'; at most 63)",
        "labels.kueue.x-k8s.io/priority-class: would reach every step pod and the InferenceService too; write "
        "kueue_priority_class: high instead (it labels only the training job)"]
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_env({"KFP_PYTORCH_KUEUE_PRIORITY_CLASS": "x" * 64})
    assert e.value.problems == [f"KFP_PYTORCH_KUEUE_PRIORITY_CLASS: {'x' * 64!r} is not a WorkloadPriorityClass name "
                                "(lowercase letters, digits, '-' and '.'; at most 63)"]


def _pod_templates(job: dict) -> list[dict]:
    if job["kind"] == "PyTorchJob":
        return [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return [r["template"]["spec"]["template"] for r in
            job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]


def test_training_pods_opt_out_of_istios_sidecar_unless_the_platform_lets_it_in():
    # In a Kubeflow profile namespace (istio-injection=enabled) an injected istio-proxy outlives
    # the training container: the pods never complete and the job never ends (kubeflow/trainer#1637)
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    for platform, inject in (({}, "false"), ({"istio_sidecar": False}, "false"), ({"istio_sidecar": True}, None)):
        cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, **platform_env(load_platform(platform), gpu=True)})
        for job in (to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))):
            validate_manifest(job)
            for t in _pod_templates(job):
                assert t["metadata"]["labels"].get("sidecar.istio.io/inject") == inject, (platform, t)
                assert (t["metadata"].get("annotations") or {}).get("sidecar.istio.io/inject") == inject, (platform, t)
            assert "sidecar.istio.io" not in json.dumps(job["metadata"])  # the pods' setting, not the job's
    with pytest.raises(ConfigError) as e:
        load_platform({"istio_sidecar": "yes", "labels": {"sidecar.istio.io/inject": "true"}})
    assert e.value.problems == [
        "istio_sidecar: must be true or false, got 'yes'",
        "labels.sidecar.istio.io/inject: the training pods' sidecar is set by istio_sidecar (false unless you write "
        "istio_sidecar: true); KFP's step pods opt out of it themselves"]
    with pytest.raises(ConfigError, match="KFP_PYTORCH_ISTIO_SIDECAR"):
        ClusterConfig.from_env({"KFP_PYTORCH_ISTIO_SIDECAR": "maybe"})


def test_training_and_predictor_pods_meet_restricted_pod_security_unless_the_platform_says_not():
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    pod_sc = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    container_sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    for platform, restricted in (({}, True), ({"restricted_pods": False}, False)):
        cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, **platform_env(load_platform(platform), gpu=True)})
        jobs = (to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train)))
        isvc = to_inference_service(cfg.serve_spec("s3://models/m/model", "digits"))
        pods = [t.get("spec", {}) for job in jobs for t in _pod_templates(job)] + [isvc["spec"]["predictor"]]
        for job in (*jobs, isvc):
            validate_manifest(job)
        for pod in pods:
            assert pod.get("securityContext") == (pod_sc if restricted else None), (platform, pod)
            containers = pod.get("containers", [])
            assert [c.get("securityContext") for c in containers] == [container_sc if restricted else None] * len(
                containers) and (containers or not restricted), (platform, pod)
        if restricted:  # a TrainJob patches the runtime's trainer container by its name
            assert [c["name"] for c in _pod_templates(jobs[1])[0]["spec"]["containers"]] == ["node"]
    with pytest.raises(ConfigError, match="restricted_pods: must be true or false, got 'no'"):
        load_platform({"restricted_pods": "no"})


def test_training_pods_get_a_memory_backed_dev_shm_unless_the_platform_says_not():
    # a container's /dev/shm is 64 MiB: NCCL between the GPUs of one pod fails in it
    from kfp_pytorch.components.cluster import ClusterConfig
    from kfp_pytorch.pipelines.platform import load_platform, platform_env

    train = TrainSpec("s3://data/d", "s3://models/m", workers=4, nodes=2, backend="cluster", gpus_per_node=2)
    for platform, shm in (({}, True), ({"shm_volume": False}, False), ({"shm_volume": False, "restricted_pods": False},
                                                                       False)):
        cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": IMAGE, **platform_env(load_platform(platform), gpu=True)})
        for job in (to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))):
            validate_manifest(job)
            for t in _pod_templates(job):
                pod = t.get("spec", {})
                assert pod.get("volumes") == ([{"name": "dshm", "emptyDir": {"medium": "Memory"}}] if shm else None)
                mounts = [c.get("volumeMounts") for c in pod.get("containers", [])]
                assert mounts == ([[{"name": "dshm", "mountPath": "/dev/shm"}]] if shm else
                                  [None] * len(mounts)), (platform, pod)
    with pytest.raises(ConfigError, match="shm_volume: must be true or false, got 'off'"):
        load_platform({"shm_volume": "off"})
    with pytest.raises(ConfigError, match="KFP_PYTORCH_SHM_VOLUME"):
        ClusterConfig.from_env({"KFP_PYTORCH_SHM_VOLUME": "perhaps"})


@pytest.mark.parametrize("cpu,threads", [(4, "2"), ("8", "4"), ("500m", "1"), ("3", "1"), (None, None)])
def test_each_worker_gets_its_share_of_the_pods_cpus_as_threads(cpu, threads):
    # PyTorch sizes its thread pools by the node's cores, not the pod's CPU limit: the CFS quota
    # then throttles a pod of 4 CPUs running 64 threads
    res = {"memory": "8Gi", **({"cpu": cpu} if cpu is not None else {})}
    s = spec(resources=res)  # 4 workers on 2 pods: 2 a pod
    for job in (to_pytorchjob(s), to_trainjob(s)):
        validate_manifest(job)
        c = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0] \
            if job["kind"] == "PyTorchJob" else job["spec"]["trainer"]
        assert {e["name"]: e.get("value") for e in c["env"]}.get("OMP_NUM_THREADS") == threads, job["kind"]


def test_the_platform_settings_in_a_steps_environment_are_checked():
    from kfp_pytorch.components.cluster import ClusterConfig

    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_env({"KFP_PYTORCH_POD_LABELS": "{team: vision}",
                                "KFP_PYTORCH_GPU_TOLERATIONS": '[{"operator": "Exists", "value": "x"}]',
                                "KFP_PYTORCH_S3_KEYS": '{"accesskey": "AWS_ACCESS_KEY_ID"}'})
    assert e.value.problems == [
        "KFP_PYTORCH_POD_LABELS: must be JSON, got '{team: vision}'",
        "KFP_PYTORCH_GPU_TOLERATIONS[0].value: must be empty when operator is Exists, got 'x'",
        "KFP_PYTORCH_S3_KEYS: no Secret key maps to AWS_SECRET_ACCESS_KEY"]


def test_each_worker_process_of_a_pod_gets_its_own_gpu():
    with pytest.raises(ConfigError, match="each of a pod's 2 worker processes needs a GPU of its own, got 1"):
        to_pytorchjob(spec(resources={"gpu": 1}))  # 4 workers on 2 nodes
    to_pytorchjob(spec(resources={"gpu": 1}, nodes=4))  # one process per pod
    to_pytorchjob(spec(resources={"cpu": 4}))  # CPU pods: gloo, any number of processes
    cpu = TrainSpec("s3://data/d", "s3://models/m", workers=4, device="cpu")
    to_pytorchjob(spec(train=cpu, resources={"gpu": 1}))  # asked to train on CPU: the GPU is not shared out
