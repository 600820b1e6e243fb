"""Submit, watch, stream, fail, time out and terminate cluster jobs against the fake API server."""
import io
import os
import signal
import threading
import time

import pytest

from kfp_pytorch.components.cluster import ClusterServeSpec, ClusterTrainSpec
from kfp_pytorch.components.cluster_run import ClusterServer, ClusterTrainer
from kfp_pytorch.components.errors import CrdNotInstalled, KubernetesForbidden, ServingError, TrainingError
from kfp_pytorch.components.k8s import Kube
from kfp_pytorch.components.train import TrainSpec

NS = "team-a"


def spec(nodes=4, **kw):
    return ClusterTrainSpec(TrainSpec("s3://d/x", "s3://m/x", workers=nodes), image="reg/kfp-pytorch:0.1.0",
                            namespace=NS, run_id="run-123", task="train-op", user="alice", nodes=nodes, **kw)


def pods_of(fake, name):
    return sorted(p["metadata"]["name"] for p in fake.list("pods", NS, f"training.kubeflow.org/job-name={name}"))


def drive(fake, name, n_pods, phases, logs="", delay=0.2):
    """In the background, as the operator and kubelet would: wait for the pods, then move them."""
    def run():
        deadline = time.monotonic() + 10
        while len(pods_of(fake, name)) < n_pods and time.monotonic() < deadline:
            time.sleep(0.02)
        for step in phases:
            time.sleep(delay)
            for pod, phase, *reason in step:
                if logs and phase == "Running" and pod.endswith("master-0"):
                    fake.append_log(NS, pod, logs)
                fake.set_pod_phase(NS, pod, phase, *reason)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_job_runs_streams_master_log_and_is_cleaned_up(k8s):
    fake, api = k8s
    s = spec()
    out = io.StringIO()
    names = [f"{s.name}-master-0"] + [f"{s.name}-worker-{i}" for i in range(3)]
    drive(fake, s.name, 4, [[(p, "Running") for p in names], [(names[0], "Succeeded")]],
          logs="epoch 1/2 loss=0.5\nepoch 2/2 loss=0.2\n")
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    assert res.state == "Succeeded" and not res.adopted and res.deleted
    text = out.getvalue()
    assert "epoch 2/2 loss=0.2" in text and "Running" in text
    assert res.api_calls <= 8  # create, one watch, pod list, log follow, delete: O(status changes)
    assert fake.list("pytorchjobs", NS) == []


def test_retried_task_adopts_its_job(k8s):
    fake, api = k8s
    s = spec(nodes=1)
    kube = Kube(api)
    first = kube.create_or_adopt(ClusterTrainer(kube).manifest(s), {})[0]
    names = [f"{s.name}-master-0"]
    drive(fake, s.name, 1, [[(names[0], "Running")], [(names[0], "Succeeded")]])
    res = ClusterTrainer(kube, delete_policy="never", out=io.StringIO()).run(s, timeout_s=20)
    assert res.adopted and res.state == "Succeeded" and not res.deleted
    assert [o["metadata"]["uid"] for o in fake.list("pytorchjobs", NS)] == [first["metadata"]["uid"]]


def test_failure_names_replica_reason_and_log(k8s):
    fake, api = k8s
    s = spec(nodes=2)
    m, w = f"{s.name}-master-0", f"{s.name}-worker-0"

    def failing():
        deadline = time.monotonic() + 10
        while len(pods_of(fake, s.name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in (m, w):
            fake.set_pod_phase(NS, p, "Running")
        time.sleep(0.2)
        fake.append_log(NS, w, "step 10\nRuntimeError: CUDA out of memory\n")
        fake.set_pod_phase(NS, w, "Failed", "OOMKilled")
    threading.Thread(target=failing, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=20)
    text = str(e.value)
    assert f"worker replica {w} ended with OOMKilled" in text and "CUDA out of memory" in text
    assert fake.list("pytorchjobs", NS)  # on-success policy keeps failed jobs for debugging


def test_unplaceable_gang_fails_at_timeout_with_reason(k8s):
    fake, api = k8s
    s = spec(nodes=4)
    drive(fake, s.name, 4, [[(f"{s.name}-worker-{i}", "Pending", "Unschedulable",
                              "0/8 nodes are available: 8 Insufficient nvidia.com/gpu") for i in range(3)]], delay=0.05)
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=2)
    assert "gang could not be placed" in str(e.value) and "Insufficient nvidia.com/gpu" in str(e.value)
    assert fake.list("pytorchjobs", NS) == []  # deleted: it would only hold partial resources


def test_sigterm_deletes_the_job(k8s):
    fake, api = k8s
    s = spec(nodes=1)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=20)
    assert fake.list("pytorchjobs", NS) == []


def test_rbac_and_missing_operator_errors(k8s):
    fake, api = k8s
    fake.denied.add(("create", "pytorchjobs"))
    with pytest.raises(KubernetesForbidden) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(spec(nodes=1), timeout_s=5)
    assert "cannot create pytorchjobs" in str(e.value) and 'verbs: ["create"]' in e.value.hint
    fake.denied.clear()
    fake.missing_groups.add("kubeflow.org")
    with pytest.raises(CrdNotInstalled) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(spec(nodes=1), timeout_s=5)
    assert "Training Operator is not installed" in str(e.value) and "kubectl apply" in e.value.hint


def test_inference_service_ready_and_canary_update(k8s):
    fake, api = k8s
    server = ClusterServer(Kube(api), out=io.StringIO())
    first = server.run(ClusterServeSpec("s3://m/run1/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS), 10)
    assert first["url"] == f"http://digits.{NS}.svc.cluster.local" and not first["updated"]
    second = server.run(ClusterServeSpec("s3://m/run2/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS,
                                         canary_traffic_percent=20), 10)
    isvc = fake.get("inferenceservices", NS, "digits")
    assert second["updated"] and isvc["spec"]["predictor"]["canaryTrafficPercent"] == 20
    assert isvc["spec"]["predictor"]["containers"][0]["env"][0]["value"] == "s3://m/run2/model"


def test_inference_service_not_ready_times_out(k8s):
    fake, api = k8s
    fake.operator.isvc_ready = False
    with pytest.raises(ServingError, match="not Ready within 1s"):
        ClusterServer(Kube(api), out=io.StringIO()).run(
            ClusterServeSpec("s3://m/x", "stuck", "reg/kfp-pytorch:0.1.0", namespace=NS), 1)
