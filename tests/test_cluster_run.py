"""Submit, watch, stream, fail, time out and terminate cluster jobs against the fake API server."""
import dataclasses
import io
import os
import signal
import threading
import time

import pytest

from kfp_pytorch.components.cluster import ClusterServeSpec, ClusterTrainSpec
from kfp_pytorch.components.cluster_run import ClusterServer, ClusterTrainer
from kfp_pytorch.components.errors import (CrdNotInstalled, KubernetesForbidden, KubernetesUnavailable, ServingError,
                                           TrainingError)
from kfp_pytorch.components.k8s import Kube
from kfp_pytorch.components.train import TrainSpec

NS = "team-a"


def spec(nodes=4, run_id="run-123", **kw):
    return ClusterTrainSpec(TrainSpec("s3://data/x", "s3://models/x", workers=nodes), image="reg/kfp-pytorch:0.1.0",
                            namespace=NS, run_id=run_id, task="train-op", user="alice", nodes=nodes, **kw)


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


def test_following_a_job_rides_out_a_broken_and_a_silent_watch(k8s):
    # An API server restart breaks the watch mid-stream, and a load balancer that drops an idle
    # connection leaves it silent for ever. The first ended the step with a bare urllib3
    # traceback although the job ran on; the second hung the step until KFP's own timeout.
    fake, api = k8s
    s = spec(nodes=1)
    fake.watch_faults = ["drop", "stall"]
    out = io.StringIO()
    names = [f"{s.name}-master-0"]
    drive(fake, s.name, 1, [[(names[0], "Running")], [(names[0], "Succeeded")]], delay=0.5)
    res = ClusterTrainer(Kube(api, watch_window_s=2, watch_slack_s=1), out=out).run(s, timeout_s=60)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert f"lost the Kubernetes API while following PyTorchJob {NS}/{s.name}" in text, text
    assert "(the job goes on without us)" in text and "the Kubernetes API answers again after" in text, text
    assert fake.watch_faults == []  # both faults met, and followed past


def test_an_api_that_stays_away_ends_the_step_and_leaves_the_job(k8s):
    fake, api = k8s
    s = spec(nodes=1)
    trainer = ClusterTrainer(Kube(api, watch_window_s=1, watch_slack_s=0.5), out=io.StringIO())
    trainer.api_outage_s = 1.5
    fake.watch_faults = ["drop"] * 50
    with pytest.raises(KubernetesUnavailable) as e:
        trainer.run(s, timeout_s=60)
    assert "has not answered for" in e.value.message and f"while following PyTorchJob {NS}/{s.name}" in e.value.message
    assert f"kubectl -n {NS} get pytorchjob {s.name}" in e.value.hint and "adopts it" in e.value.hint
    assert [o["metadata"]["name"] for o in fake.list("pytorchjobs", NS)] == [s.name]  # left running, not deleted


def test_an_api_that_accepts_and_never_answers_fails_the_step_not_hangs_it(k8s):
    # The client sets no timeout: a create sent to an API server that accepts the connection
    # and never answers (a stuck apiserver, a dead tunnel) hung the step until KFP's own timeout.
    fake, api = k8s
    fake.stalled.add(("create", "pytorchjobs"))
    s, result = spec(nodes=1), {}

    def run():
        try:
            ClusterTrainer(Kube(api, request_timeout_s=0.5), out=io.StringIO()).run(s, timeout_s=60)
        except KubernetesUnavailable as e:
            result["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    hung = t.is_alive()
    fake.unstall.set()
    assert not hung, "the step hung on an API that never answers"
    e = result["error"]
    assert e.message == f"the Kubernetes API did not answer: create pytorchjobs in namespace '{NS}' (ReadTimeoutError)"
    assert "check that the API server is up" in e.hint


def test_a_log_stream_that_cannot_start_does_not_fail_a_job_that_succeeds(k8s):
    # Listing pods (to find the master's) is not granted by every namespace's Role: the step
    # failed with 403 though the job itself went on and succeeded.
    fake, api = k8s
    s = spec(nodes=1)
    fake.denied.add(("list", "pods"))
    out = io.StringIO()
    m = f"{s.name}-master-0"
    drive(fake, s.name, 1, [[(m, "Running")], [(m, "Succeeded")]])
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    assert res.state == "Succeeded", out.getvalue()
    assert "the master's log is not streamed: its pod could not be found (forbidden: cannot list pods" in out.getvalue()
    # a failure is still reported from the job's own conditions
    s2 = spec(nodes=1)  # the same run and task: the succeeded job was deleted
    m2 = f"{s2.name}-master-0"
    drive(fake, s2.name, 1, [[(m2, "Running")], [(m2, "Failed", "OOMKilled")]])
    with pytest.raises(TrainingError, match=f"PyTorchJob {NS}/{s2.name} failed: PyTorchJob {s2.name} is failed"):
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s2, timeout_s=20)
    # pods may be listed, their logs not read: the step says which right is missing, not "ApiException"
    fake.denied.clear()
    fake.denied.add(("get", "pods/log"))
    s3 = spec(nodes=1, run_id="run-456")
    m3 = f"{s3.name}-master-0"
    drive(fake, s3.name, 1, [[(m3, "Running")], [(m3, "Succeeded")]])
    out = io.StringIO()
    assert ClusterTrainer(Kube(api), out=out).run(s3, timeout_s=20).state == "Succeeded"
    assert (f"log stream of {m3} ended: forbidden: cannot get pods/log in namespace '{NS}'" in out.getvalue()
            and 'resources: ["pods/log"], verbs: ["get"]' in out.getvalue()), out.getvalue()


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


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_pods_a_namespace_quota_refuses_are_named_with_the_quota(k8s, monkeypatch, kind):
    # A Kubeflow profile's ResourceQuota refuses pods over its GPU quota: the operator (or the
    # Job controller) records it in an event and makes no pods. The step said "no pods yet: check
    # that the operator is installed", and "gang could not be placed" for a gang half made.
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.3)
    fake.create("resourcequotas", NS, {"metadata": {"name": "kf-resource-quota"},
                                       "spec": {"hard": {"requests.nvidia.com/gpu": "2"}}}, "v1")
    s = spec(nodes=4, resources={"gpu": 1})
    out = io.StringIO()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind=kind, out=out).run(s, timeout_s=1.5)
    refused = ("exceeded quota: kf-resource-quota, requested: requests.nvidia.com/gpu=1, used: "
               "requests.nvidia.com/gpu=2, limited: requests.nvidia.com/gpu=2")
    on = f"FailedCreatePod on PyTorchJob {s.name}" if kind == "PyTorchJob" else f"FailedCreate on Job {s.name}-node-0"
    assert e.value.message.startswith(f"{kind} {NS}/{s.name}: gang could not be placed within 1.5s: 2 of 4 pods made, "
                                      f"2 of 2 pods still pending; {on}: Error creating: pods "), e.value.message
    assert refused in e.value.message
    assert f"`kubectl -n {NS} describe quota` shows the namespace's quota" in e.value.hint
    assert f"2 of 4 pods made, 2 of 2 pods pending; {on}" in out.getvalue(), out.getvalue()

    # nothing fits: no pods at all, and the step says why rather than "check the operator"
    fake.replace("resourcequotas", NS, "kf-resource-quota", {
        "metadata": {"name": "kf-resource-quota"}, "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}}, check_rv=False)
    s2 = spec(nodes=4, resources={"gpu": 1}, run_id="run-456")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind=kind, out=io.StringIO()).run(s2, timeout_s=1.5)
    assert e.value.message.startswith(f"{kind} {NS}/{s2.name}: no pods were created within 1.5s: "), e.value.message
    assert "limited: requests.nvidia.com/gpu=0" in e.value.message and "describe quota" in e.value.hint
    # without the right to read events, what the step said before
    fake.denied.add(("list", "events"))
    s3 = spec(nodes=4, resources={"gpu": 1}, run_id="run-789")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind=kind, out=io.StringIO()).run(s3, timeout_s=1.5)
    assert "no pods were created within 1.5s" in e.value.message and "installed and running" in e.value.hint


@pytest.mark.parametrize("reason, message, fix", [
    ("ImagePullBackOff", 'Back-off pulling image "reg/kfp-pytorch:0.1.0"', "check the image name and tag"),
    ("CreateContainerConfigError", 'secret "kfp-pytorch-s3" not found', "create the Secret or ConfigMap"),
    # restricted pods (runAsNonRoot) from an image whose USER is root: the kubelet will not start it
    ("CreateContainerConfigError", "container has runAsNonRoot and image will run as root (pod: \"x\", container: "
     "pytorch)", "the image runs as root (or as a user by name), and the pods must not"),
])
def test_pods_that_cannot_start_say_why_not_that_the_gang_cannot_be_placed(k8s, monkeypatch, reason, message, fix):
    # A placed pod whose image cannot be pulled, or whose Secret does not exist, stays Pending:
    # the step said "2 of 2 pods pending" and, at the timeout, "gang could not be placed: wait
    # for capacity", which sends the user to the wrong place.
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.5)
    s = spec(nodes=2)
    out = io.StringIO()

    def kubelet():
        deadline = time.monotonic() + 10
        while len(pods_of(fake, s.name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in pods_of(fake, s.name):
            fake.set_pod_waiting(NS, p, reason, message)
    threading.Thread(target=kubelet, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=out).run(s, timeout_s=3)
    assert e.value.message == (f"PyTorchJob {NS}/{s.name} did not start within 3s: 2 of 2 pods cannot start "
                               f"({s.name}-master-0: {reason}: {message})"), e.value.message
    assert e.value.hint.startswith(fix) and f"`kubectl -n {NS} describe pod {s.name}-master-0`" in e.value.hint
    assert f"2 of 2 pods cannot start ({s.name}-master-0: {reason}: {message}; {fix}" in out.getvalue(), out.getvalue()


def test_the_log_stream_follows_a_container_the_kubelet_restarts(k8s, monkeypatch):
    # Under restartPolicy OnFailure a failed container restarts in the same pod (the job stays
    # Running): the master's log stream ended with the first container, and the resumed
    # training's log never reached the step.
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "container_poll_s", 0.1)
    s = spec(nodes=1)
    m = f"{s.name}-master-0"
    out = io.StringIO()

    def kubelet():
        deadline = time.monotonic() + 10
        while not pods_of(fake, s.name) and time.monotonic() < deadline:
            time.sleep(0.02)
        fake.append_log(NS, m, "epoch 1/2\nRuntimeError: NCCL timeout\n")
        fake.set_pod_phase(NS, m, "Running")
        _wait_for(out, "NCCL timeout")
        fake.restart_container(NS, m)
        _wait_for(out, "its new log follows")
        fake.append_log(NS, m, "resumed from epoch 1\nepoch 2/2 loss=0.2\n")
        _wait_for(out, "epoch 2/2")
        fake.set_pod_phase(NS, m, "Succeeded")
    threading.Thread(target=kubelet, daemon=True).start()
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert f"[kfp-pytorch] {m}: its container restarted (restart 1; the job's backoffLimit counts them)" in text, text
    assert text.index("NCCL timeout") < text.index("its container restarted") < text.index(f"[{m}] epoch 2/2 loss=0.2")


def test_a_retried_task_that_adopts_a_running_job_follows_it(k8s, monkeypatch):
    # A retried step (its pod evicted) adopts its job as it runs. No event says it runs, so the
    # master's log was not streamed, and after a minute the step said it was "not running: 0 of
    # 1 pods pending", every 5 minutes to the end.
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.3)
    s = spec(nodes=1)
    kube = Kube(api)
    kube.create_or_adopt(ClusterTrainer(kube).manifest(s), {})
    m = f"{s.name}-master-0"
    deadline = time.monotonic() + 10
    while not pods_of(fake, s.name) and time.monotonic() < deadline:
        time.sleep(0.02)
    fake.append_log(NS, m, "".join(f"step {i}\n" for i in range(1, 301)))
    fake.set_pod_phase(NS, m, "Running")
    out = io.StringIO()

    def later():
        deadline = time.monotonic() + 10
        while "step 300" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.8)  # past the first pending report, had there been one
        fake.append_log(NS, m, "step 301\n")
        fake.set_pod_phase(NS, m, "Succeeded")
    threading.Thread(target=later, daemon=True).start()
    res = ClusterTrainer(kube, out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.adopted and res.state == "Succeeded" and res.seconds_to_running == 0.0, text
    assert f"PyTorchJob {s.name} is running; its log from the last 100 lines:" in text
    assert f"[{m}] step 201\n" in text and f"[{m}] step 301\n" in text and f"[{m}] step 200\n" not in text, text
    assert "not running after" not in text, text


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
    assert e.value.hint == ("fix the cause above; a retry of this task adopts or recreates the job and resumes from "
                            "the last checkpoint")  # run-123 is no KFP run's id


def test_a_failed_job_of_a_kfp_run_says_how_to_retry_the_run(k8s):
    fake, api = k8s
    run_id = "0b6c4c1e-7d2f-4c41-9e0a-3f1d2c5b6a7e"  # as KFP names a run, and the step's run_id is given it
    s = spec(nodes=1, run_id=run_id)

    def failing():
        deadline = time.monotonic() + 10
        while not pods_of(fake, s.name) and time.monotonic() < deadline:
            time.sleep(0.02)
        fake.set_pod_phase(NS, f"{s.name}-master-0", "Failed", "Error")
    threading.Thread(target=failing, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=20)
    assert e.value.hint == (f"fix the cause above; retry the run (`kfp-pytorch retry {run_id}`, or Retry in the KFP "
                            "UI): this task then adopts or recreates the job and resumes from the last checkpoint")


def test_pods_held_for_the_fairness_scheduler_say_so_not_that_the_gang_cannot_be_placed(k8s, monkeypatch):
    # With KFP_PYTORCH_FAIRNESS the pods carry the fairness scheduler's gate: no scheduler sees
    # them until it admits the gang. The step said "gang could not be placed: wait for capacity"
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.3)
    s = spec(nodes=2, fairness=True)
    out = io.StringIO()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=out).run(s, timeout_s=1.5)
    assert e.value.message == (f"PyTorchJob {NS}/{s.name} was not admitted by the fairness scheduler within 1.5s: 2 "
                               "of 2 pods wait behind its scheduling gate"), e.value.message
    assert e.value.hint.startswith("the kfp-pytorch fairness scheduler starts them when it admits the gang"), e.value.hint
    assert "fairness.kfp-pytorch.io/admission: if none runs in the cluster, nothing starts them" in e.value.hint
    text = out.getvalue()
    assert ("2 of 2 pods pending (SchedulingGated: Scheduling is blocked due to non-empty scheduling gates) (the "
            "kfp-pytorch fairness scheduler starts them") in text, text


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_a_namespace_that_enforces_restricted_pod_security_admits_the_training_pods(k8s, monkeypatch, kind):
    # Kubeflow enforces Pod Security "restricted" on its namespaces, and profiles may too: the
    # pods, without a securityContext, were refused, and the step said only "no pods yet"
    fake, api = k8s
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.3)
    fake.create("namespaces", None, {"metadata": {"name": NS, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}}, "v1")
    s = spec(nodes=2)
    if kind == "PyTorchJob":
        drive(fake, s.name, 2, [[(p, "Running") for p in (f"{s.name}-master-0", f"{s.name}-worker-0")],
                                [(f"{s.name}-master-0", "Succeeded")]])
    else:
        _drive_trainjob(fake, s.name, 2, [[(0, "Running"), (1, "Running")], [(1, "Succeeded"), (0, "Succeeded")]])
    assert ClusterTrainer(Kube(api), kind=kind, out=io.StringIO()).run(s, timeout_s=20).state == "Succeeded"
    # restricted_pods: false (a root image, RDMA's IPC_LOCK) is refused there, and the step says why
    s2 = spec(nodes=2, run_id="run-456", restricted=False)
    out = io.StringIO()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind=kind, out=out).run(s2, timeout_s=1.5)
    assert e.value.message.startswith(f"{kind} {NS}/{s2.name}: no pods were created within 1.5s: "), e.value.message
    assert ('is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false (container '
            '"pytorch" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities'
            .replace("pytorch", "pytorch" if kind == "PyTorchJob" else "node")) in e.value.message, e.value.message
    assert e.value.hint.startswith(f"the namespace enforces Pod Security (`kubectl get ns {NS} --show-labels`): set "
                                   "restricted_pods: true"), e.value.hint
    assert "no pods yet: " in out.getvalue() and "set restricted_pods: true" in out.getvalue(), out.getvalue()


def test_a_trainjob_runtime_with_a_dev_shm_of_its_own_says_to_leave_out_the_steps(k8s):
    # The step mounts a memory-backed /dev/shm in the training pods (NCCL needs more than 64 MiB);
    # a ClusterTrainingRuntime that mounts its own makes two mounts at one path: the API server
    # refuses the pods, and the step names the platform setting that leaves its own out
    fake, api = k8s
    fake.operator.trainer_runtime_pod = {
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}]}
    s = spec(nodes=2)
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind="TrainJob", out=io.StringIO()).run(s, timeout_s=1.5)
    assert "volumeMounts[1].mountPath: Invalid value: \"/dev/shm\": must be unique" in e.value.message, e.value.message
    assert e.value.hint.startswith("the training runtime mounts a /dev/shm of its own, beside the one the step adds: "
                                   "set shm_volume: false in the platform file"), e.value.hint
    s2 = spec(nodes=2, run_id="run-456", shm=False)
    _drive_trainjob(fake, s2.name, 2, [[(0, "Running"), (1, "Running")], [(1, "Succeeded"), (0, "Succeeded")]])
    assert ClusterTrainer(Kube(api), kind="TrainJob", delete_policy="never", out=io.StringIO()).run(
        s2, timeout_s=20).state == "Succeeded"
    pods = fake.list("pods", NS, f"jobset.sigs.k8s.io/jobset-name={s2.name}")
    assert [p["spec"]["volumes"] for p in pods] == [fake.operator.trainer_runtime_pod["volumes"]] * 2


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
@pytest.mark.parametrize("istio_sidecar", [False, True])
def test_in_an_istio_namespace_the_training_pods_opt_out_and_their_log_is_read_beside_a_sidecar(k8s, kind,
                                                                                             istio_sidecar):
    # A Kubeflow profile namespace has istio-injection=enabled. The training pods opt out of the
    # sidecar (it would keep them running after training); where the platform lets it in, the API
    # refuses a log read that names no container ("a container name must be specified"), and the
    # step streamed nothing and its failure showed no log
    fake, api = k8s
    fake.create("namespaces", None, {"metadata": {"name": NS, "labels": {"istio-injection": "enabled"}}}, "v1")
    s = spec(nodes=2, istio_sidecar=istio_sidecar)
    if kind == "PyTorchJob":
        names = [f"{s.name}-master-0", f"{s.name}-worker-0"]
        drive(fake, s.name, 2, [[(p, "Running") for p in names], [(names[0], "Failed", "OOMKilled")]],
              logs="epoch 1/2 loss=0.5\nRuntimeError: CUDA out of memory\n")
        pods = lambda: pods_of(fake, s.name)  # noqa: E731
    else:
        _drive_trainjob(fake, s.name, 2, [[(0, "Running"), (1, "Running")], [(0, "Failed", "OOMKilled")]],
                        logs="epoch 1/2 loss=0.5\nRuntimeError: CUDA out of memory\n")
        pods = lambda: _trainjob_pods(fake, s.name)  # noqa: E731
    out = io.StringIO()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind=kind, out=out).run(s, timeout_s=20)
    containers = [[c["name"] for c in fake.get("pods", NS, p)["spec"]["containers"]] for p in pods()]
    assert all(c[-1] == "istio-proxy" for c in containers) == istio_sidecar, containers
    assert all(len(c) == 1 for c in containers) != istio_sidecar, containers
    text = out.getvalue()
    assert "epoch 1/2 loss=0.5" in text and "log stream of" not in text, text
    assert "ended with OOMKilled" in e.value.message and "CUDA out of memory" in e.value.message, e.value.message


def test_a_retried_step_starts_a_job_that_failed_in_its_earlier_attempt_again(k8s):
    # With a retry policy (platform `retries`) the retried step adopted the failed job of its
    # earlier attempt and failed again at once: no retry ever trained.
    fake, api = k8s
    s = spec(nodes=1)
    kube = Kube(api)
    old = kube.create_or_adopt(ClusterTrainer(kube).manifest(s), {})[0]
    m = f"{s.name}-master-0"
    drive(fake, s.name, 1, [[(m, "Running")], [(m, "Failed", "Evicted")]], delay=0.05)
    deadline = time.monotonic() + 10
    while "Failed" not in str(fake.get("pytorchjobs", NS, s.name).get("status")) and time.monotonic() < deadline:
        time.sleep(0.05)
    def recreated() -> bool:
        jobs = fake.list("pytorchjobs", NS)
        return bool(jobs) and jobs[0]["metadata"]["uid"] != old["metadata"]["uid"] and bool(pods_of(fake, s.name))

    def second_attempt():  # the kubelet moves the new job's pod, once there is one
        deadline = time.monotonic() + 20
        while not recreated() and time.monotonic() < deadline:
            time.sleep(0.02)
        drive(fake, s.name, 1, [[(m, "Running")], [(m, "Succeeded")]], delay=0.3)

    seen = len(fake.requests)
    threading.Thread(target=second_attempt, daemon=True).start()
    out = io.StringIO()
    res = ClusterTrainer(kube, out=out).run(s, timeout_s=30)
    text = out.getvalue()
    assert res.state == "Succeeded" and res.adopted, text
    assert f"PyTorchJob {NS}/{s.name} failed in an earlier attempt (PyTorchJob {s.name} is failed" in text, text
    assert "deleting it to start it again" in text and "created PyTorchJob" in text and "anew" in text, text
    assert ("delete", "pytorchjobs") in fake.requests[seen:]
    assert fake.list("pytorchjobs", NS) == []  # the new one succeeded and was cleaned up


def test_unplaceable_gang_fails_at_timeout_with_reason(k8s):
    fake, api = k8s
    s = spec(nodes=4)
    drive(fake, s.name, 4, [[(f"{s.name}-worker-{i}", "Pending", "Unschedulable",
                              "0/8 nodes are available: 8 Insufficient nvidia.com/gpu") for i in range(3)]], delay=0.05)
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=2)
    assert "gang could not be placed" in str(e.value) and "Insufficient nvidia.com/gpu" in str(e.value)
    assert fake.list("pytorchjobs", NS) == []  # deleted: it would only hold partial resources


def test_a_waiting_job_says_why_in_the_step_log_before_the_timeout(k8s, monkeypatch):
    # the step's log said nothing between "created" and the timeout (an hour by default)
    fake, api = k8s
    s = spec(nodes=4)
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 1.0)
    monkeypatch.setattr(ClusterTrainer, "pending_report_every_s", 1.5)
    drive(fake, s.name, 4, [[(f"{s.name}-worker-{i}", "Pending", "Unschedulable",
                              "0/8 nodes are available: 8 Insufficient nvidia.com/gpu") for i in range(3)]], delay=0.05)
    out = io.StringIO()
    with pytest.raises(TrainingError, match="gang could not be placed"):
        ClusterTrainer(Kube(api), out=out).run(s, timeout_s=4.5)
    reports = [line for line in out.getvalue().splitlines() if "not running after" in line]
    assert len(reports) >= 2, out.getvalue()
    assert reports[0].startswith(f"[kfp-pytorch] PyTorchJob {s.name}: not running after 1s: 4 of 4 pods pending (")
    assert "Unschedulable: 0/8 nodes are available: 8 Insufficient nvidia.com/gpu" in reports[0]
    # no pods at all: the operator is what is missing
    s2 = spec(nodes=1)
    out = io.StringIO()
    fake.operator.installed = False
    try:
        with pytest.raises(TrainingError) as e:
            ClusterTrainer(Kube(api), out=out).run(s2, timeout_s=2.5)
    finally:
        fake.operator.installed = True
    assert "no pods yet (the Kubeflow training operator creates them: check that it is installed and running)" \
        in out.getvalue()
    assert "no pods were created within 2.5s" in str(e.value) and "training operator" in str(e.value)


@pytest.fixture
def kueue(k8s, monkeypatch):
    """The fake API server with Kueue, and a step that says after 0.5 s why its job waits."""
    k8s[0].operator.kueue = True
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.5)
    monkeypatch.setattr(ClusterTrainer, "pending_report_every_s", 60)
    return k8s


def _wait_for(out: io.StringIO, text: str, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)


def _set_suspend(fake, plural: str, name: str, value: bool) -> None:
    """Suspend or resume a job, as Kueue does (a PyTorchJob's runPolicy.suspend, a TrainJob's suspend)."""
    job = fake.get(plural, NS, name)
    (job["spec"].setdefault("runPolicy", {}) if plural == "pytorchjobs" else job["spec"])["suspend"] = value
    fake.replace(plural, NS, name, job)


def _admit_once_reported(fake, plural: str, name: str, out: io.StringIO) -> None:
    """In the background, as Kueue does once the queue has room: resume the job (once the step
    has said why it waits)."""
    def admit():
        _wait_for(out, "not running after")
        _set_suspend(fake, plural, name, False)
    threading.Thread(target=admit, daemon=True).start()


def test_a_job_kueue_holds_says_so_and_runs_once_admitted(kueue):
    # Kueue suspends a job labelled with a queue until the queue admits it: no pods exist
    # meanwhile, and the step's log said "no pods yet: check that the training operator is
    # installed", sending the user the wrong way.
    fake, api = kueue
    s = spec(nodes=1, kueue_queue="team-a-gpu")
    m = f"{s.name}-master-0"
    out = io.StringIO()

    _admit_once_reported(fake, "pytorchjobs", s.name, out)
    drive(fake, s.name, 1, [[(m, "Running")], [(m, "Succeeded")]])
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert (f"s: suspended (PyTorchJob {s.name} is suspended.): Kueue starts it when its LocalQueue 'team-a-gpu' "
            "admits it" in text), text
    assert f"PyTorchJob {s.name}: not running after " in text
    assert ("its Workload is not admitted: couldn't assign flavors to pod set master: insufficient unused quota "
            "for nvidia.com/gpu in flavor default-flavor, 4 more needed" in text), text
    assert f"`kubectl -n {NS} get workloads` shows whether it is admitted" in text
    assert "no pods yet" not in text

    # never admitted: the timeout says it never started, and why
    s2 = spec(nodes=1, kueue_queue="team-a-gpu", run_id="run-456")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s2, timeout_s=1.5)
    assert e.value.message.startswith(f"PyTorchJob {NS}/{s2.name} did not finish within 1.5s: suspended (PyTorchJob "
                                      f"{s2.name} is suspended.): Kueue starts it")
    assert "`kubectl -n team-a get localqueue team-a-gpu`" in e.value.hint
    assert "4 more needed" in e.value.message
    # without the right to read Workloads, the rest is still said
    fake.denied.add(("list", "workloads"))
    s3 = spec(nodes=1, kueue_queue="team-a-gpu", run_id="run-789")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s3, timeout_s=1.5)
    assert "Kueue starts it when its LocalQueue 'team-a-gpu' admits it" in e.value.message
    assert "Workload" not in e.value.message


def test_a_job_kueue_preempts_says_why_and_streams_its_log_again_once_resumed(k8s):
    # Kueue evicts a running job (a higher-priority Workload needs its quota) by suspending it:
    # its pods are deleted. The step said only "Suspended", and once the job ran again its new
    # master's log was not streamed.
    fake, api = k8s
    s = spec(nodes=1, kueue_queue="team-a-gpu")
    m = f"{s.name}-master-0"
    out = io.StringIO()

    def set_suspend(value: bool) -> None:
        _set_suspend(fake, "pytorchjobs", s.name, value)

    def wait_for(text: str) -> None:
        _wait_for(out, text)

    def kueue_and_kubelet():
        wait_for(f"created PyTorchJob {NS}/{s.name}")
        wait_for(f"{s.name}: Created")
        fake.append_log(NS, m, "epoch 1/3 loss=0.9\n")
        fake.set_pod_phase(NS, m, "Running")
        wait_for("epoch 1/3")
        fake.create("workloads", NS, {  # what Kueue says of the Workload it evicts, then holds
            "metadata": {"name": "pytorchjob-x", "labels": {"kueue.x-k8s.io/job-uid": fake.get(
                "pytorchjobs", NS, s.name)["metadata"]["uid"]}},
            "spec": {"queueName": "team-a-gpu", "podSets": []},
            "status": {"conditions": [
                {"type": "Evicted", "status": "True", "reason": "Preempted", "lastTransitionTime": "2026-12-04T00:00:00Z",
                 "message": "Preempted to accommodate a workload (UID: 42) due to prioritization in the ClusterQueue"},
                {"type": "QuotaReserved", "status": "False", "reason": "Pending", "lastTransitionTime":
                 "2026-12-04T00:00:00Z", "message": "couldn't assign flavors to pod set master: insufficient quota"}]}},
            "kueue.x-k8s.io/v1beta1")
        set_suspend(True)
        wait_for("Suspended after it ran")
        set_suspend(False)  # admitted again: the operator makes new pods
        deadline = time.monotonic() + 10
        while not fake.list("pods", NS) and time.monotonic() < deadline:
            time.sleep(0.02)
        fake.append_log(NS, m, "resumed from epoch 1\nepoch 3/3 loss=0.2\n")
        fake.set_pod_phase(NS, m, "Running")
        wait_for("epoch 3/3")
        fake.set_pod_phase(NS, m, "Succeeded")

    threading.Thread(target=kueue_and_kubelet, daemon=True).start()
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert (f"PyTorchJob {s.name}: Suspended after it ran: suspended (PyTorchJob {s.name} is suspended.): Kueue starts "
            "it when its LocalQueue 'team-a-gpu' admits it; Kueue evicted it (Preempted: Preempted to accommodate a "
            "workload (UID: 42) due to prioritization in the ClusterQueue); its Workload is not admitted: couldn't "
            "assign flavors to pod set master: insufficient quota; its pods are deleted, and it goes on from its last "
            "checkpoint once resumed" in text), text
    assert f"[{m}] resumed from epoch 1" in text and f"[{m}] epoch 3/3 loss=0.2" in text, text


def test_a_job_naming_a_missing_workload_priority_class_says_so(k8s):
    # Kueue makes no Workload for a job whose WorkloadPriorityClass does not exist: the job stays
    # suspended for ever, and only an event on it (and Kueue's log) says why.
    fake, api = k8s
    fake.operator.kueue = True
    s = spec(nodes=1, kueue_queue="team-a-gpu", kueue_priority_class="research")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=1.5)
    assert ("Kueue has made no Workload for it, so no queue will admit it (WorkloadPriorityClassNotFound on PyTorchJob "
            f'{s.name}: WorkloadPriorityClass "research" not found)' in e.value.message), e.value.message
    assert e.value.hint.startswith("check that WorkloadPriorityClass 'research' exists (`kubectl get "
                                   "workloadpriorityclass research`) and Kueue manages PyTorchJobs"), e.value.hint
    assert f"`kubectl -n {NS} describe pytorchjob {s.name}` shows Kueue's events" in e.value.hint
    assert [ev["reason"] for ev in fake.list("events", NS)] == ["WorkloadPriorityClassNotFound"]

    # once the class exists, the Workload carries its priority and the step says why it waits
    fake.create("workloadpriorityclasses", None, {"metadata": {"name": "research"}, "value": 1000},
                "kueue.x-k8s.io/v1beta1")
    s2 = spec(nodes=1, kueue_queue="team-a-gpu", kueue_priority_class="research", run_id="run-456")
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s2, timeout_s=1.5)
    assert "its Workload is not admitted: couldn't assign flavors" in e.value.message
    [w] = [w for w in fake.list("workloads", NS) if w["spec"]["queueName"] == "team-a-gpu"]
    assert (w["spec"]["priorityClassName"], w["spec"]["priority"]) == ("research", 1000)


def _drive_trainjob(fake, name, nodes, steps, logs=""):
    """As the JobSet's Job controller and the kubelet would, for a TrainJob's node pods: ``steps``
    are lists of (completion index, phase)."""
    def run():
        deadline = time.monotonic() + 10
        while len(_trainjob_pods(fake, name)) < nodes and time.monotonic() < deadline:
            time.sleep(0.02)
        pods = _trainjob_pods(fake, name)
        for step in steps:
            time.sleep(0.2)
            for index, phase, *reason in step:
                if logs and phase == "Running" and index == 0:
                    fake.append_log(NS, pods[index], logs)
                fake.set_pod_phase(NS, pods[index], phase, *reason)
    threading.Thread(target=run, daemon=True).start()


def _trainjob_pods(fake, name):
    """The node pods by completion index."""
    pods = fake.list("pods", NS, f"jobset.sigs.k8s.io/jobset-name={name}")
    return [p["metadata"]["name"] for p in sorted(
        pods, key=lambda p: int(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]))]


def test_a_trainjob_runs_streams_node_0s_log_and_is_cleaned_up(k8s):
    # A TrainJob has no Running condition: it runs when its JobSet's node Job is ready
    # (status.jobsStatus). Before, the step never saw it run: no log was streamed, and every
    # 5 minutes the step's log said it was "not running".
    fake, api = k8s
    s = spec(nodes=3)
    out = io.StringIO()
    _drive_trainjob(fake, s.name, 3, [[(i, "Running") for i in (2, 1, 0)], [(i, "Succeeded") for i in (1, 2, 0)]],
                    logs="epoch 1/2 loss=0.5\nepoch 2/2 loss=0.2\n")
    res = ClusterTrainer(Kube(api), kind="TrainJob", out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded" and res.deleted, text
    assert res.seconds_to_running is not None, text
    assert f"TrainJob {s.name}: Running" in text
    pod0 = [line for line in text.splitlines() if "epoch 2/2 loss=0.2" in line]
    assert pod0 and pod0[0].startswith(f"[{s.name}-node-0-0-"), text  # node 0's log, not another node's
    assert fake.list("trainjobs", NS) == [] and _trainjob_pods(fake, s.name) == []


def test_a_failed_trainjob_names_its_node_pod_and_log(k8s):
    fake, api = k8s
    s = spec(nodes=2)
    _drive_trainjob(fake, s.name, 2, [[(0, "Running"), (1, "Running")], [(1, "Failed", "OOMKilled")]])
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind="TrainJob", out=io.StringIO()).run(s, timeout_s=20)
    assert e.value.message.startswith(f"TrainJob {NS}/{s.name} failed: node replica {s.name}-node-0-1-"), e.value.message
    assert "ended with OOMKilled. jobset failed due to one or more job failures" in e.value.message


def test_a_trainjob_that_times_out_says_how_far_its_trainer_got(trainer_status, tmp_path):
    # With the Trainer's TrainJobProgress gate on, node 0 reports its progress (trainer_status);
    # a step that times out says how far training got and how long it needs, not only "did not
    # finish"
    from kfp_pytorch.components.trainer_status import TrainerStatusReporter

    fake, api, server = trainer_status
    s = spec(nodes=2)
    _drive_trainjob(fake, s.name, 2, [[(0, "Running"), (1, "Running")]])

    def node0_reports():
        deadline = time.monotonic() + 10
        while not (pods := _trainjob_pods(fake, s.name)) and time.monotonic() < deadline:
            time.sleep(0.02)
        token = tmp_path / "token"
        token.write_text(server.token_for(NS, pods[0]))
        env = server.env(NS, s.name, token)
        reporter = TrainerStatusReporter.from_env(env)
        reporter.update(40, 150, {"currentEpoch": 2, "totalEpochs": 5, "loss": 0.31})
        reporter.close()
    threading.Thread(target=node0_reports, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind="TrainJob", delete_policy="never", out=io.StringIO()).run(s, timeout_s=2)
    assert e.value.message == (f"TrainJob {NS}/{s.name} did not finish within 2s: its trainer reports 40% done, about "
                               "2m left, epoch 2/5"), e.value.message
    assert e.value.hint.startswith("raise the timeout (to about 152s at this pace) or reduce epochs"), e.value.hint
    out = io.StringIO()  # the step run again adopts the running job: how far it is, first
    with pytest.raises(TrainingError):
        ClusterTrainer(Kube(api), kind="TrainJob", out=out).run(s, timeout_s=0.5)
    assert f"TrainJob {s.name} is running (40% done, about 2m left, epoch 2/5); its log from" in out.getvalue()


def test_a_trainjob_whose_log_cannot_be_read_shows_its_trainers_progress(trainer_status, tmp_path):
    # A Role without pods/log: no log streams, and the step said nothing until the job ended.
    # The trainer's reports to the Trainer (status.trainerStatus) say how it goes instead.
    from kfp_pytorch.components.trainer_status import TrainerStatusReporter

    fake, api, server = trainer_status
    fake.denied.add(("get", "pods/log"))
    s = spec(nodes=1)
    _drive_trainjob(fake, s.name, 1, [[(0, "Running")]])
    out = io.StringIO()

    def node0_reports():
        deadline = time.monotonic() + 10
        while "log stream of" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        [pod] = _trainjob_pods(fake, s.name)
        token = tmp_path / "token"
        token.write_text(server.token_for(NS, pod))
        reporter = TrainerStatusReporter.from_env(server.env(NS, s.name, token), min_interval_s=0)
        for pct, left, epoch in ((40, 150, 2), (80, 40, 4)):
            reporter.update(pct, left, {"currentEpoch": epoch, "totalEpochs": 5})
            time.sleep(0.3)
        reporter.close()
        fake.set_pod_phase(NS, pod, "Succeeded")
    threading.Thread(target=node0_reports, daemon=True).start()
    res = ClusterTrainer(Kube(api), kind="TrainJob", out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert f"log stream of {s.name}-node-0-0-" in text and "forbidden: cannot get pods/log" in text, text
    assert (f"TrainJob {s.name}: 40% done, about 2m left, epoch 2/5\n" in text
            and f"TrainJob {s.name}: 80% done, about 40s left, epoch 4/5\n" in text), text


def test_a_trainjob_the_trainer_cannot_build_says_so(k8s, monkeypatch):
    # The Trainer marks a TrainJob it cannot build a JobSet for (a runtime that does not fit it)
    # Created=False and makes no pods: the step said "no pods yet: check that the Trainer is
    # installed" every 5 minutes, and at the timeout.
    fake, api = k8s
    fake.operator.trainer_build_fails = True
    monkeypatch.setattr(ClusterTrainer, "pending_report_after_s", 0.3)
    s = spec(nodes=2)
    out = io.StringIO()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), kind="TrainJob", out=out).run(s, timeout_s=1.5)
    assert e.value.message == (f"TrainJob {NS}/{s.name} did not finish within 1.5s: the Trainer could not build its "
                               "Jobs (Failed to build Jobs)")
    assert e.value.hint.startswith("check its runtime (`kubectl get clustertrainingruntime torch-distributed -o yaml`) "
                                   "and the Trainer controller's log"), e.value.hint
    assert "s: the Trainer could not build its Jobs (Failed to build Jobs) (check its runtime" in out.getvalue()
    assert "no pods yet" not in out.getvalue()


def test_a_trainjob_kueue_holds_says_so_and_runs_once_admitted(kueue):
    fake, api = kueue
    s = spec(nodes=1, kueue_queue="team-a-gpu")
    out = io.StringIO()

    _admit_once_reported(fake, "trainjobs", s.name, out)
    _drive_trainjob(fake, s.name, 1, [[(0, "Running")], [(0, "Succeeded")]])
    res = ClusterTrainer(Kube(api), kind="TrainJob", out=out).run(s, timeout_s=20)
    text = out.getvalue()
    assert res.state == "Succeeded", text
    assert ("s: suspended (TrainJob is suspended): Kueue starts it when its LocalQueue "
            "'team-a-gpu' admits it; its Workload is not admitted: couldn't assign flavors" in text), text
    [w] = fake.list("workloads", NS)
    assert w["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"


def test_sigterm_deletes_the_job(k8s):
    fake, api = k8s
    s = spec(nodes=1)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=20)
    assert fake.list("pytorchjobs", NS) == []


def test_a_delete_the_api_refuses_leaves_the_job_and_keeps_the_outcome(k8s):
    # Deleting the finished job is cleanup: a Role without "delete" (or an API server down at
    # that moment) failed a step whose training had succeeded, and replaced a terminated run's
    # interrupt with a 403.
    fake, api = k8s
    fake.denied.add(("delete", "pytorchjobs"))
    s = spec(nodes=1)
    out = io.StringIO()
    m = f"{s.name}-master-0"
    drive(fake, s.name, 1, [[(m, "Running")], [(m, "Succeeded")]])
    res = ClusterTrainer(Kube(api), out=out).run(s, timeout_s=20)
    assert res.state == "Succeeded" and not res.deleted, out.getvalue()
    assert (f"could not delete PyTorchJob {NS}/{s.name} after it succeeded (forbidden: cannot delete pytorchjobs"
            in out.getvalue()), out.getvalue()
    assert f"`kubectl -n {NS} delete pytorchjob {s.name}` deletes it" in out.getvalue()
    assert [o["metadata"]["name"] for o in fake.list("pytorchjobs", NS)] == [s.name]

    fake.delete("pytorchjobs", NS, s.name)  # as an admin would, with kubectl
    s2 = spec(nodes=1)
    out = io.StringIO()
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):
        ClusterTrainer(Kube(api), out=out).run(s2, timeout_s=20)
    assert f"could not delete PyTorchJob {NS}/{s2.name} after the run was terminated" in out.getvalue()
    assert "run terminated: deleted" not in out.getvalue()


def test_a_terminated_run_whose_delete_gets_no_answer_ends_within_the_grace_period(k8s):
    # KFP's SIGTERM is followed by the kubelet's SIGKILL 30 s later: a delete sent to an API
    # server that never answers waited for the whole request timeout, and the step was killed
    # without saying that its job was left.
    fake, api = k8s
    fake.stalled.add(("delete", "pytorchjobs"))
    s = spec(nodes=1)
    out = io.StringIO()
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ClusterTrainer(Kube(api), out=out).run(s, timeout_s=60)
    took = time.monotonic() - t0
    fake.unstall.set()
    # the abandoned delete retries once answered (urllib3): let it end here, or it deletes the
    # next test's job of the same name
    for t in threading.enumerate():
        if t.name == "kfp-pytorch-delete":
            t.join(30)
    assert took < 28, f"the step needed {took:.0f} s to end after SIGTERM"
    assert (f"could not delete PyTorchJob {NS}/{s.name} after the run was terminated (the Kubernetes API did not "
            "answer the delete within 10 s); it is left as it is" in out.getvalue()), out.getvalue()


def test_a_job_deleted_by_someone_else_ends_the_wait_at_once(k8s):
    # the DELETED event was read as one more update: the step waited for the job to the timeout
    from kubernetes import client

    fake, api = k8s
    s = spec(nodes=1)
    name = f"{s.name}-master-0"
    drive(fake, s.name, 1, [[(name, "Running")]], delay=0.1)

    def kubectl_delete():
        deadline = time.monotonic() + 10
        while not fake.list("pytorchjobs", NS) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        client.CustomObjectsApi(api).delete_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", s.name)

    threading.Thread(target=kubectl_delete, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        ClusterTrainer(Kube(api), out=io.StringIO()).run(s, timeout_s=60)
    assert f"PyTorchJob {NS}/{s.name} was deleted while" in str(e.value) and "run the step again" in e.value.hint

    fake.operator.isvc_ready = False

    def delete_isvc():
        time.sleep(1)
        client.CustomObjectsApi(api).delete_namespaced_custom_object("serving.kserve.io", "v1beta1", NS,
                                                                     "inferenceservices", "gone")

    threading.Thread(target=delete_isvc, daemon=True).start()
    with pytest.raises(ServingError, match=f"InferenceService {NS}/gone was deleted"):
        ClusterServer(Kube(api), out=io.StringIO()).run(
            ClusterServeSpec("s3://models/x", "gone", "reg/kfp-pytorch:0.1.0", namespace=NS), 60)


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
    # Serverless: KServe's canary rollouts are Knative's
    first = server.run(ClusterServeSpec("s3://models/run1/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS,
                                        raw_deployment=False, registered_model="models:/digits/1"), 10)
    assert first["url"] == f"http://digits.{NS}.example.com" and not first["updated"]
    assert first["cluster_url"] == f"http://digits.{NS}.svc.cluster.local"
    annotations = fake.get("inferenceservices", NS, "digits")["metadata"]["annotations"]
    assert annotations["kfp-pytorch.io/registered-model"] == "models:/digits/1"
    second = server.run(ClusterServeSpec("s3://models/run2/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS,
                                         canary_traffic_percent=20, raw_deployment=False,
                                         registered_model="models:/digits/2"), 10)
    isvc = fake.get("inferenceservices", NS, "digits")
    # the annotation names the version rolled out now; KServe's own annotations stay
    assert isvc["metadata"]["annotations"] == {"serving.kserve.io/deploymentMode": "Serverless",
                                               "kfp-pytorch.io/registered-model": "models:/digits/2"}
    # ready means the new version is rolled out, not the old one's Ready still standing in the status
    assert isvc["metadata"]["generation"] == isvc["status"]["observedGeneration"] == 2
    assert second["updated"] and isvc["spec"]["predictor"]["canaryTrafficPercent"] == 20
    env = {e["name"]: e["value"] for e in isvc["spec"]["predictor"]["containers"][0]["env"]}
    assert env["STORAGE_URI"] == "s3://models/run2/model"


def test_an_update_drops_what_the_new_version_no_longer_sets(k8s):
    # A JSON merge patch keeps every key it does not name: a canary share of the previous rollout
    # stayed on a version meant to take all traffic, and an InferenceService made by an earlier
    # release (storageUris) kept that beside STORAGE_URI.
    from kubernetes import client

    fake, api = k8s
    server = ClusterServer(Kube(api), out=io.StringIO())
    server.run(ClusterServeSpec("s3://models/run1/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS,
                                canary_traffic_percent=20, raw_deployment=False, registered_model="models:/digits/1"),
               10)
    custom = client.CustomObjectsApi(api)
    custom.patch_namespaced_custom_object("serving.kserve.io", "v1beta1", NS, "inferenceservices", "digits", {
        "spec": {"predictor": {"storageUris": [{"uri": "s3://models/run1/model", "mountPath": "/mnt/models"}]}}})
    server.run(ClusterServeSpec("s3://models/run2/model", "digits", "reg/kfp-pytorch:0.1.0", namespace=NS,
                                raw_deployment=False), 10)
    isvc = fake.get("inferenceservices", NS, "digits")
    assert "kfp-pytorch.io/registered-model" not in isvc["metadata"]["annotations"]  # no version claimed for it
    predictor = isvc["spec"]["predictor"]
    assert "canaryTrafficPercent" not in predictor and "storageUris" not in predictor, predictor
    env = {e["name"]: e["value"] for e in predictor["containers"][0]["env"]}
    assert env["STORAGE_URI"] == "s3://models/run2/model"


def test_inference_service_is_ready_on_a_kserve_before_storage_uris(k8s):
    # KServe before 0.16 has no spec.predictor.storageUris: its CRD pruned the field we wrote,
    # the storage initializer never ran, and the predictor crash-looped on an empty /mnt/models.
    fake, api = k8s
    fake.operator.kserve_storage_uris = False
    out = io.StringIO()
    served = ClusterServer(Kube(api), out=out).run(
        ClusterServeSpec("s3://models/run1/model", "older", "reg/kfp-pytorch:0.1.0", namespace=NS), 10)
    assert served["url"] == f"http://older.{NS}.example.com", out.getvalue()


def test_waiting_for_an_inference_service_rides_out_a_silent_watch(k8s):
    fake, api = k8s
    fake.watch_faults = ["stall"]
    out = io.StringIO()
    served = ClusterServer(Kube(api, watch_window_s=2, watch_slack_s=1), out=out).run(
        ClusterServeSpec("s3://models/run1/model", "quiet", "reg/kfp-pytorch:0.1.0", namespace=NS), 30)
    assert served["url"] == f"http://quiet.{NS}.example.com"
    assert f"lost the Kubernetes API while following InferenceService {NS}/quiet" in out.getvalue()


def test_inference_service_not_ready_times_out(k8s):
    fake, api = k8s
    fake.operator.isvc_ready = False
    with pytest.raises(ServingError, match="not Ready within 1s"):
        ClusterServer(Kube(api), out=io.StringIO()).run(
            ClusterServeSpec("s3://models/x", "stuck", "reg/kfp-pytorch:0.1.0", namespace=NS), 1)


@pytest.mark.parametrize("reason, message, init, says, hint", [
    ("ImagePullBackOff", 'Back-off pulling image "reg/kfp-pytorch:0.1.0"', False,
     "its predictor pods cannot start ({pod}: ImagePullBackOff: Back-off pulling image",
     "check the image name and tag, and that the nodes can pull it (a private registry's pull Secret: "
     "image_pull_secrets in the platform file)"),
    ("CrashLoopBackOff", "back-off 40s restarting failed container=storage-initializer", True,
     "the storage initializer of {pod} cannot fetch the model (it failed 3 times)",
     "`kubectl -n team-a logs {pod} -c storage-initializer` says why: check the S3 endpoint and credentials of "
     "ServiceAccount kfp-pytorch-s3"),
])
def test_an_inference_service_whose_pods_cannot_start_says_why(k8s, monkeypatch, reason, message, init, says, hint):
    # KServe's conditions say only that the predictor is not available; the pods say why: in the
    # step's log while it waits, and at the timeout
    fake, api = k8s
    fake.operator.isvc_ready = False
    monkeypatch.setattr(ClusterServer, "pods_report_after_s", 0.5)
    out = io.StringIO()

    def kubelet():
        deadline = time.monotonic() + 5
        while not fake.list("pods", NS) and time.monotonic() < deadline:
            time.sleep(0.05)
        fake.set_pod_waiting(NS, fake.list("pods", NS)[0]["metadata"]["name"], reason, message, init=init)
    threading.Thread(target=kubelet, daemon=True).start()
    with pytest.raises(ServingError) as e:
        ClusterServer(Kube(api), out=out).run(
            ClusterServeSpec("s3://models/x", "stuck", "reg/kfp-pytorch:0.1.0", namespace=NS), 2)
    [pod] = [p["metadata"]["name"] for p in fake.list("pods", NS)]
    assert e.value.message.startswith(f"InferenceService {NS}/stuck not Ready within 2s: " + says.format(pod=pod)), \
        e.value.message
    assert e.value.hint.startswith(hint.format(pod=pod)), e.value.hint
    assert f"InferenceService {NS}/stuck not ready yet: {says.format(pod=pod)}" in out.getvalue(), out.getvalue()


def test_a_waiting_inference_service_says_why_as_its_status_changes(k8s):
    # KServe reports why in the conditions; the step's log said nothing until the timeout
    fake, api = k8s
    fake.operator.isvc_ready = False
    why = {"type": "PredictorReady", "status": "False", "reason": "ContainersNotReady",
           "message": "containers with unready status: [storage-initializer]"}

    def kserve_reports():
        deadline = time.monotonic() + 5
        while not fake.list("inferenceservices", NS) and time.monotonic() < deadline:
            time.sleep(0.05)
        isvc = fake.get("inferenceservices", NS, "slow")
        for conditions in ([why], [why], [dict(why, message="Back-off pulling image")]):  # the same twice: said once
            time.sleep(0.2)
            isvc["status"] = {"conditions": [{"type": "Ready", "status": "False"}, *conditions]}
            fake.replace("inferenceservices", NS, "slow", isvc, status_only=True, check_rv=False)

    threading.Thread(target=kserve_reports, daemon=True).start()
    out = io.StringIO()
    with pytest.raises(ServingError) as e:
        ClusterServer(Kube(api), out=out).run(
            ClusterServeSpec("s3://models/x", "slow", "reg/kfp-pytorch:0.1.0", namespace=NS), 2)
    lines = [line for line in out.getvalue().splitlines() if "not ready yet" in line]
    assert lines == [f"[kfp-pytorch] InferenceService {NS}/slow not ready yet: Ready False; PredictorReady: ContainersNotReady "
                     "containers with unready status: [storage-initializer]",
                     f"[kfp-pytorch] InferenceService {NS}/slow not ready yet: Ready False; PredictorReady: ContainersNotReady "
                     "Back-off pulling image"], out.getvalue()
    assert "Back-off pulling image" in str(e.value)


def _kubeconfig(tmp_path, url):
    import yaml

    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
           "clusters": [{"name": "fake", "cluster": {"server": url}}],
           "users": [{"name": "u", "user": {"token": "fake-token"}}],
           "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": NS}}]}
    p = tmp_path / "kubeconfig"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_train_runtime_uses_the_cluster_backend(k8s, _fake_k8s_server, s3, bucket, tmp_path, monkeypatch):
    """train(backend='cluster') submits a PyTorchJob through a kubeconfig, and reads the result from S3."""
    import json

    from kfp_pytorch.components.train import train

    fake, _ = k8s
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, _fake_k8s_server[1])))
    monkeypatch.setenv("KFP_PYTORCH_IMAGE", "reg/kfp-pytorch:0.1.0")
    monkeypatch.setenv("KFP_PYTORCH_NAMESPACE", NS)
    out = f"s3://{bucket}/run"
    ts = TrainSpec(f"s3://{bucket}/data", out, workers=2, nodes=2, gpus_per_node=1, backend="cluster",
                   run_id="8f14e45f", task="train-op", timeout_s=20)
    s3.write_bytes(f"s3://{bucket}/data/metadata.json", b'{"num_features": 64}')  # prepare_data's, read first

    def kubelet(out=out, export=True):  # the pods "run" the worker: they write the history, then succeed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(fake.list("pods", NS)) < 2:
            time.sleep(0.02)
        pods = [p["metadata"]["name"] for p in fake.list("pods", NS)]
        for p in pods:
            fake.set_pod_phase(NS, p, "Running")
        s3.write_bytes(f"{out}/history.json", json.dumps([{"epoch": 1, "loss": 0.3, "seconds": 1.0}]).encode())
        if export:
            s3.write_bytes(f"{out}/model/metadata.json", json.dumps({"training": {"exported_epoch": 1}}).encode())
        fake.set_pod_phase(NS, [p for p in pods if "master" in p][0], "Succeeded")

    threading.Thread(target=kubelet, daemon=True).start()
    result = train(ts)
    assert result.history[0]["loss"] == 0.3 and result.model_uri == f"{out}/model" and result.exported_epoch == 1
    created = [r for r in fake.requests if r == ("create", "pytorchjobs")]
    assert created == [("create", "pytorchjobs")]
    # a job that succeeds without exporting a model (an image whose command does something else)
    for kind in ("pytorchjobs", "pods"):
        for obj in fake.list(kind, NS):
            fake.delete(kind, NS, obj["metadata"]["name"])
    threading.Thread(target=kubelet, kwargs={"out": f"{out}-2", "export": False}, daemon=True).start()
    with pytest.raises(TrainingError) as e:
        train(dataclasses.replace(ts, output_uri=f"{out}-2", run_id="c9f0f895"))
    assert e.value.message == f"the training job finished but exported no model ({out}-2/model/metadata.json is missing)"


def test_train_steps_given_no_run_id_name_their_jobs_by_their_output(k8s, _fake_k8s_server, s3, bucket, tmp_path,
                                                                    monkeypatch):
    # A user's pipeline that calls train_op without run_id: every run's job had one name, so with
    # the job kept (a failed one, or KFP_PYTORCH_DELETE_POLICY=never) the next run adopted it as a
    # retry of its own and reported another run's training.
    import json

    from kfp_pytorch.components.cluster import output_key
    from kfp_pytorch.components.train import train

    fake, _ = k8s
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, _fake_k8s_server[1])))
    monkeypatch.setenv("KFP_PYTORCH_IMAGE", "reg/kfp-pytorch:0.1.0")
    monkeypatch.setenv("KFP_PYTORCH_NAMESPACE", NS)
    monkeypatch.setenv("KFP_PYTORCH_DELETE_POLICY", "never")

    def kubelet(out, loss):  # the new job's pod "runs" the worker: it writes its history, then succeeds
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not [p for p in fake.list("pods", NS) if p["status"].get("phase")
                                                   in (None, "Pending")]:
            time.sleep(0.02)
        pod = [p["metadata"]["name"] for p in fake.list("pods", NS) if p["status"].get("phase") in (None, "Pending")][0]
        fake.set_pod_phase(NS, pod, "Running")
        s3.write_bytes(f"{out}/history.json", json.dumps([{"epoch": 1, "loss": loss, "seconds": 1.0}]).encode())
        s3.write_bytes(f"{out}/model/metadata.json", json.dumps({"training": {"exported_epoch": 1}}).encode())
        fake.set_pod_phase(NS, pod, "Succeeded")

    s3.write_bytes(f"s3://{bucket}/data/metadata.json", b'{"num_features": 64}')
    losses = {}
    for run, loss in (("a", 0.3), ("b", 0.2)):
        out = f"s3://{bucket}/v2/artifacts/mine/{run}/train-op/model"
        threading.Thread(target=kubelet, args=(out, loss), daemon=True).start()
        result = train(TrainSpec(f"s3://{bucket}/data", out, workers=1, backend="cluster", task="train-op",
                                 timeout_s=20))
        losses[run] = result.history[0]["loss"]
    assert losses == {"a": 0.3, "b": 0.2}  # each run's own training, not the first's twice
    jobs = sorted(j["metadata"]["name"] for j in fake.list("pytorchjobs", NS))
    assert len(jobs) == 2 and [r for r in fake.requests if r == ("create", "pytorchjobs")] == [("create", "pytorchjobs")] * 2
    key = output_key(f"s3://{bucket}/v2/artifacts/mine/a/train-op/model")
    assert len(key) == 12 and any(key in j for j in jobs)  # a retry of the same task: the same name, adopted


def test_the_serve_step_in_a_pod_smoke_tests_the_in_cluster_address(k8s, _fake_k8s_server, trained_model, tmp_path,
                                                                     monkeypatch):
    # status.url is the ingress host (example.com unless the domain is configured), which a pod
    # cannot resolve; the step's smoke test went there and failed on every default install.
    from kfp_pytorch.components.serve import ServeSpec, serve, stop_server

    fake, _ = k8s
    predictor = serve(ServeSpec(trained_model.model_uri, "digits"))  # stands in for the predictor pod
    try:
        fake.operator.isvc_address = predictor.url
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, _fake_k8s_server[1])))
        monkeypatch.setenv("KFP_PYTORCH_IMAGE", "reg/kfp-pytorch:0.1.0")
        monkeypatch.setenv("KFP_PYTORCH_NAMESPACE", NS)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # as in every pod
        spec = ServeSpec("s3://models/run1/model", "digits", backend="cluster", startup_timeout_s=10,
                         min_replicas=2, max_replicas=5)
        ep = serve(spec, sample_row=[0.0] * 64)
        assert ep.url == f"http://digits.{NS}.example.com" and ep.infer_url.startswith(ep.url)
        predictor_spec = fake.get("inferenceservices", NS, "digits")["spec"]["predictor"]
        assert (predictor_spec["minReplicas"], predictor_spec["maxReplicas"]) == (2, 5)
        assert ep.cluster_url == predictor.url and ep.smoke_test["label"] is not None
        # off the cluster (a laptop with a kubeconfig), the external URL is what there is: said plainly
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        fake.operator.isvc_domain = "invalid"  # never resolves (RFC 2606)
        with pytest.raises(ServingError) as e:
            serve(ServeSpec("s3://models/run2/model", "digits", backend="cluster", startup_timeout_s=10),
                  sample_row=[0.0] * 64)
        assert f"its URL http://digits.{NS}.invalid is not reachable from this machine" in str(e.value)
        assert "KServe's config-domain" in e.value.hint and predictor.url in e.value.hint
    finally:
        stop_server("digits")


def test_a_serve_step_the_predictors_sidecar_resets_says_why(k8s, _fake_k8s_server, tmp_path, monkeypatch):
    # Under Istio's STRICT mutual TLS the predictor's sidecar resets a plain-text caller from
    # outside the mesh (KFP's step pods): the step said "check `kfp-pytorch serve list`", a local command
    import socket
    import struct

    from kfp_pytorch.components.serve import ServeSpec, serve

    fake, _ = k8s
    sidecar = socket.socket()
    sidecar.bind(("127.0.0.1", 0))
    sidecar.listen()

    def reset_every_caller():
        while True:
            try:
                conn, _ = sidecar.accept()
            except OSError:  # closed: the test is over
                return
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
            conn.close()

    threading.Thread(target=reset_every_caller, daemon=True).start()
    try:
        fake.operator.isvc_address = f"http://127.0.0.1:{sidecar.getsockname()[1]}"
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, _fake_k8s_server[1])))
        monkeypatch.setenv("KFP_PYTORCH_IMAGE", "reg/kfp-pytorch:0.1.0")
        monkeypatch.setenv("KFP_PYTORCH_NAMESPACE", NS)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        with pytest.raises(ServingError) as e:
            serve(ServeSpec("s3://models/run1/model", "digits", backend="cluster", startup_timeout_s=10),
                  sample_row=[0.0] * 64)
    finally:
        sidecar.close()
    assert e.value.message.startswith("could not reach the model server at " + fake.operator.isvc_address)
    assert (f"the InferenceService is Ready; its in-cluster address {fake.operator.isvc_address} did not answer this "
            "step's pod") in e.value.message, e.value.message
    assert "mutual TLS in STRICT mode" in e.value.hint and "PeerAuthentication in PERMISSIVE mode (selector " \
           "serving.kserve.io/inferenceservice: digits)" in e.value.hint and "serve list" not in e.value.hint


def test_cluster_backend_needs_object_storage():
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.components.train import train

    with pytest.raises(ConfigError, match="cluster backend needs s3://"):
        train(TrainSpec("/local/data", "/local/out", backend="cluster"))
