"""Submit and follow cluster jobs: PyTorchJob / TrainJob training, KServe InferenceService serving.

Reads state through one watch per job (O(status changes) API calls, not O(time)); streams the
master's log into ours; enforces a timeout; deletes or keeps the job by policy; deletes it when
the run is terminated (SIGTERM). A gang whose pods cannot all be placed fails at the timeout with
"gang could not be placed" and the pods' scheduling reasons, instead of hanging.
"""
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .cluster import (FAIRNESS_GATE, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, LABEL_PREFIX, REGISTERED_MODEL,
                      ClusterServeSpec, ClusterTrainSpec, to_inference_service, to_pytorchjob, to_trainjob)
from .errors import ConfigError, KubernetesError, KubernetesUnavailable, ServingError, TrainingError
from .k8s import Expired, Kube
from .train import WORKER_MODULE

TERMINAL = {"Succeeded", "Failed"}
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""On the Workload Kueue makes for a job: the job's uid."""
KUEUE_GROUP, KUEUE_VERSIONS = "kueue.x-k8s.io", ("v1beta2", "v1beta1")
_KFP_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A KFP run's id (a UUID), as the step's run_id is given it: `kfp-pytorch retry` takes it."""
ADOPTED_LOG_LINES = 100
"""How much of an adopted running job's log the step shows before following it (not hours of it)."""
SUSPEND_FIELD = {"PyTorchJob": "spec.runPolicy.suspend", "TrainJob": "spec.suspend"}
CONDITION_STATE = {"Created": "Created", "Running": "Running", "Restarting": "Restarting", "Succeeded": "Succeeded",
                   "Failed": "Failed", "Complete": "Succeeded", "Suspended": "Suspended"}


def job_state(obj: dict) -> str:
    """The job's state from its conditions: the last condition whose status is True.

    A TrainJob has no Running condition (only Created, Suspended, Complete and Failed): it runs
    when each of its child Jobs (``status.jobsStatus``, from its JobSet) is ready or done, i.e.
    every pod of the trainer's ``node`` Job is ready."""
    state = "Pending"
    status = obj.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in CONDITION_STATE:
            state = CONDITION_STATE[c["type"]]
    jobs = status.get("jobsStatus") or []
    if (state in ("Pending", "Created") and jobs and any(j.get("ready", 0) for j in jobs)
            and all(j.get("ready", 0) + j.get("succeeded", 0) >= 1 and not j.get("failed", 0) for j in jobs)):
        state = "Running"
    return state


JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"


def _is_rank0(labels: dict) -> bool:
    """The pod whose log the step streams: a PyTorchJob's master; a TrainJob's node 0 (the
    trainer's ``node`` Job is an Indexed Job, one completion index per node), not an
    initializer's pod."""
    if "training.kubeflow.org/replica-type" in labels:
        return labels["training.kubeflow.org/replica-type"] == "master"
    if JOBSET_REPLICATED_JOB in labels:
        return (labels[JOBSET_REPLICATED_JOB] == "node" and labels.get("jobset.sigs.k8s.io/job-index", "0") == "0"
                and labels.get("batch.kubernetes.io/job-completion-index", "0") == "0")
    return True


def _main_container(pod) -> str | None:
    """The container that trains: the one running our worker (a TrainJob runtime's name for it
    is its own), else the Training Operator's "pytorch"; not a sidecar a mesh or the platform
    injected (istio-proxy), whose presence makes the API refuse a log read that names none."""
    containers = (pod.spec and pod.spec.containers) or []
    for c in containers:
        if WORKER_MODULE in (c.command or []) + (c.args or []):
            return c.name
    names = [c.name for c in containers]
    return "pytorch" if "pytorch" in names else (names[0] if names else None)


def _kueue_not_admitted(workloads: list[dict]) -> str | None:
    """Why Kueue has not admitted a Workload: the message of its QuotaReserved or Admitted condition
    that is False, e.g. "insufficient unused quota for nvidia.com/gpu ... 4 more needed"; after
    Kueue evicted it (preempted by a higher-priority Workload), why, first."""
    for w in workloads:
        conds = (w.get("status") or {}).get("conditions") or []
        evicted = next((f"Kueue evicted it ({c.get('reason') or 'Evicted'}: {c['message']})" for c in conds
                        if c.get("type") == "Evicted" and c.get("status") == "True" and c.get("message")), None)
        pending = next((f"its Workload is not admitted: {c['message']}" for c in conds
                        if c.get("type") in ("QuotaReserved", "Admitted") and c.get("status") == "False"
                        and c.get("message")), None)
        if evicted or pending:
            return "; ".join(x for x in (evicted, pending) if x)
    return None


def _not_created(job: dict) -> tuple[str, str] | None:
    """Why a TrainJob has no pods when the Trainer could not build or create its JobSet (its
    Created condition is False: a runtime that does not fit the TrainJob, a JobSet the API
    refused), and what to look at; None otherwise. The job waits for ever then."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Created" and c.get("status") == "False" and c.get("reason") in (
                "JobsBuildFailed", "JobsCreationFailed"):
            ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
            runtime = ((job.get("spec") or {}).get("runtimeRef") or {}).get("name", "")
            verb = "build" if c["reason"] == "JobsBuildFailed" else "create"
            return (f"the Trainer could not {verb} its Jobs ({c.get('message') or c['reason']})",
                    f"check its runtime (`kubectl get clustertrainingruntime {runtime} -o yaml`) and the Trainer "
                    f"controller's log; `kubectl -n {ns} describe trainjob {name}` shows its events")
    return None


def _trainer_progress(job: dict) -> tuple[str, int | None] | None:
    """What a TrainJob's trainer last reported to the Trainer (``status.trainerStatus``, with the
    TrainJobProgress gate on; our workers report it, see ``trainer_status``), e.g. "40% done,
    about 2m left, epoch 2/5", and the seconds left; None when it reported nothing."""
    ts = (job.get("status") or {}).get("trainerStatus") or {}
    metrics = {m.get("name"): m.get("value") for m in ts.get("metrics") or []}
    left, parts = ts.get("estimatedRemainingSeconds"), []
    if ts.get("progressPercentage") is not None:
        parts.append(f"{ts['progressPercentage']}% done")
    if left is not None:
        parts.append(f"about {_span(left)} left")
    if metrics.get("currentEpoch") and metrics.get("totalEpochs"):
        parts.append(f"epoch {metrics['currentEpoch']}/{metrics['totalEpochs']}")
    return (", ".join(parts), left) if parts else None


def _condition_message(obj: dict, state: str) -> str:
    for c in reversed((obj.get("status") or {}).get("conditions") or []):
        if CONDITION_STATE.get(c.get("type")) == state:
            return c.get("message", "")
    return ""


def _span(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _pending(pods: list) -> tuple[list, list[str]]:
    """The pods not yet placed, and the scheduler's reasons for them (PodScheduled False)."""
    pending = [p for p in pods if not p.status or p.status.phase == "Pending"]
    reasons = sorted({f"{c.reason}: {c.message}" for p in pending for c in ((p.status and p.status.conditions) or [])
                      if c.type == "PodScheduled" and c.status == "False" and c.reason})
    return pending, reasons


def _fairness_gated(pending: list) -> bool:
    """Every pending pod waits for the fairness scheduler's admission (its scheduling gate)."""
    return bool(pending) and all(any(g.name == FAIRNESS_GATE for g in (p.spec and p.spec.scheduling_gates) or [])
                                 for p in pending)


FAIRNESS_HINT = (f"the kfp-pytorch fairness scheduler starts them when it admits the gang, in the order of its users' "
                 f"fair shares, by removing their scheduling gate {FAIRNESS_GATE}: if none runs in the cluster, "
                 "nothing starts them; run it, or turn KFP_PYTORCH_FAIRNESS off")


def _restarts(pod, container: str | None = None) -> int:
    """How many times the kubelet restarted the pod's containers (``container``: that one's, not a
    sidecar's)."""
    return sum(cs.restart_count or 0 for cs in (pod.status and pod.status.container_statuses) or []
               if container is None or cs.name == container)


def _made(pods: list, expected: int) -> str:
    """ "2 of 4 pods made, " when the controller has not made them all (a quota refused the rest)."""
    return f"{len(pods)} of {expected} pods made, " if 0 < len(pods) < expected else ""


def _stuck_text(stuck: dict[str, str]) -> str:
    """The reasons pods cannot start, each once, with the first pod that has it."""
    first: dict[str, str] = {}
    for pod, why in stuck.items():
        first.setdefault(why, pod)
    return "; ".join(f"{pod}: {why}" for why, pod in first.items())


CANNOT_START = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                "CreateContainerConfigError", "CreateContainerError"}
"""Why a placed pod's container does not start, that waiting will not mend: an image the node cannot
pull, a Secret or ConfigMap (key) the pod reads that does not exist."""


def _cannot_start(pods: list) -> dict[str, str]:
    """Pod name -> "Reason: message" for pending pods placed on a node whose container cannot start."""
    out = {}
    for p in pods:
        if p.status and p.status.phase == "Pending":
            for cs in (p.status.init_container_statuses or []) + (p.status.container_statuses or []):
                waiting = cs.state and cs.state.waiting
                if waiting and waiting.reason in CANNOT_START:
                    out[p.metadata.name] = f"{waiting.reason}: {waiting.message or ''}".rstrip(": ")
                    break
    return out


def _refused_hint(ns: str, warning: str) -> str:
    """What to do about the controller's warning that it could not create the pods."""
    if '"/dev/shm": must be unique' in warning:  # the TrainJob's runtime mounts its own
        return ("the training runtime mounts a /dev/shm of its own, beside the one the step adds: set shm_volume: "
                "false in the platform file")
    if "violates PodSecurity" in warning:  # the namespace enforces a Pod Security level they miss
        return (f"the namespace enforces Pod Security (`kubectl get ns {ns} --show-labels`): set restricted_pods: "
                "true in the platform file (the default), which meets \"restricted\", and use an image whose USER "
                "is a numeric non-root uid")
    return (f"`kubectl -n {ns} describe quota` shows the namespace's quota, if that refused pods: ask for more, or "
            "request less (nodes, gpus_per_node)")


def _cannot_start_hint(ns: str, why: dict[str, str]) -> str:
    pod = next(iter(why))
    fix = ("the image runs as root (or as a user by name), and the pods must not, to meet Pod Security "
           "\"restricted\": give the image a numeric non-root USER (the project's Dockerfile has USER 1000), or set "
           "restricted_pods: false in the platform file" if any("runAsNonRoot" in w for w in why.values()) else
           "check the image name and tag, and that the nodes can pull it (a private registry's pull Secret: "
           "image_pull_secrets in the platform file)"
           if any("Image" in w for w in why.values()) else
           "create the Secret or ConfigMap the pods read (the S3 credentials: `kfp-pytorch manifest s3-secret`), or fix "
           "its name in the platform file")
    return f"{fix}; `kubectl -n {ns} describe pod {pod}` shows the details"


class _Outage:
    """Rides out an API server that stops answering while we follow an object: a control-plane
    upgrade, a watch connection that broke or went silent. The object goes on without us, so
    we re-watch from the last resourceVersion we saw, with backoff, for up to ``limit_s``; only
    then do we give up, leaving the object as it is."""

    def __init__(self, say, limit_s: float, what: str, hint: str):
        self.say, self.limit_s, self.what, self.hint = say, limit_s, what, hint
        self.since: float | None = None
        self.tries = 0

    def lost(self, e: KubernetesUnavailable) -> None:
        """Called on each failed watch: say so once, wait, or give up past the limit."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.say(f"[kfp-pytorch] lost the Kubernetes API while following {self.what} ({e.message}); "
                     f"re-watching for up to {_span(self.limit_s)} (the job goes on without us)")
        if now - self.since >= self.limit_s:
            raise KubernetesUnavailable(
                f"the Kubernetes API has not answered for {_span(now - self.since)} while following {self.what} "
                f"({e.message})", self.hint) from e
        self.tries += 1
        time.sleep(min(0.5 * 2 ** min(self.tries - 1, 6), 30.0, max(self.limit_s - (now - self.since), 0.05)))

    def back(self) -> None:
        if self.since is not None:
            self.say(f"[kfp-pytorch] the Kubernetes API answers again after {_span(time.monotonic() - self.since)}")
            self.since, self.tries = None, 0


@dataclass
class ClusterRunResult:
    name: str
    namespace: str
    kind: str
    state: str
    adopted: bool
    api_calls: int
    seconds_to_running: float | None
    deleted: bool


class ClusterTrainer:
    """Runs a ClusterTrainSpec as a PyTorchJob (default) or TrainJob and follows it to the end."""

    pending_report_after_s = 60.0
    """A job not Running after this long gets its pods' scheduling reasons in the step's log ..."""
    pending_report_every_s = 300.0
    """... and again this often while it waits (each report is one pod list)."""
    api_outage_s = 600.0
    """How long an API server that stops answering is waited for (a control-plane upgrade) before
    the step gives up; the job is left running, and a retry of the step adopts it."""

    def __init__(self, kube: Kube, kind: str = "PyTorchJob", delete_policy: str = "on-success",
                 out=None, poll_pods: bool = True):
        if kind not in ("PyTorchJob", "TrainJob"):
            raise ConfigError([f"kind: must be PyTorchJob or TrainJob, got {kind!r}"])
        if delete_policy not in ("on-success", "always", "never"):
            raise ConfigError([f"delete_policy: must be on-success, always or never, got {delete_policy!r}"])
        self.kube, self.kind, self.delete_policy = kube, kind, delete_policy
        self.out = out or sys.stdout
        self.poll_pods = poll_pods
        """Report why a job that is not running yet waits (its pods' scheduling reasons)."""

    def manifest(self, spec: ClusterTrainSpec) -> dict:
        return to_pytorchjob(spec) if self.kind == "PyTorchJob" else to_trainjob(spec)

    def _selector(self, name: str) -> str:
        return (f"training.kubeflow.org/job-name={name}" if self.kind == "PyTorchJob"
                else f"jobset.sigs.k8s.io/jobset-name={name}")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self, spec: ClusterTrainSpec, timeout_s: float = 3600.0) -> ClusterRunResult:
        kube = self.kube
        calls0 = kube.calls
        obj = self.manifest(spec)
        group, version, plural = kube.gvp(obj)
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        labels = {k: v for k, v in obj["metadata"]["labels"].items() if k.startswith(LABEL_PREFIX)}
        t0 = time.monotonic()
        current, adopted = kube.create_or_adopt(obj, labels)
        self._say(f"[kfp-pytorch] {'adopted existing' if adopted else 'created'} {self.kind} {ns}/{name}")
        if adopted and job_state(current) == "Failed":
            current = self._start_again(obj, current, labels)
        state, running_at, log_thread = job_state(current), None, None
        if state == "Running":  # adopted as it runs (a retried step): no event will say so
            running_at = 0.0
            progress = _trainer_progress(current)
            self._say(f"[kfp-pytorch] {self.kind} {name} is running" + (f" ({progress[0]})" if progress else "")
                      + f"; its log from the last {ADOPTED_LOG_LINES} lines:")
            log_thread = self._start_log_stream(ns, name, tail_lines=ADOPTED_LOG_LINES)
        rv = current["metadata"]["resourceVersion"]
        prev, said_progress = None, None
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            def _on_term(signum, frame):
                raise KeyboardInterrupt("run terminated")
            prev = signal.signal(signal.SIGTERM, _on_term)
        deleted = False
        outage = _Outage(self._say, self.api_outage_s, f"{self.kind} {ns}/{name}",
                         f"the {self.kind} was left as it is: `kubectl -n {ns} get {self.kind.lower()} {name}` shows it; "
                         "a retry of this step adopts it and follows it on")
        try:
            deadline = t0 + timeout_s
            next_report = t0 + self.pending_report_after_s
            while state not in TERMINAL and time.monotonic() < deadline:
                waiting = self.poll_pods and running_at is None
                horizon = min(deadline, next_report) if waiting else deadline
                if waiting and time.monotonic() >= next_report:
                    self._report_pending(ns, name, time.monotonic() - t0, current, spec.nodes)
                    next_report = time.monotonic() + self.pending_report_every_s
                    continue
                try:
                    for event, o in kube.watch(group, version, plural, ns, name, rv, horizon - time.monotonic()):
                        outage.back()
                        if event == "DELETED":  # nothing left to follow: the wait would run to the timeout
                            raise TrainingError(f"{self.kind} {ns}/{name} was deleted while {state} (by kubectl or "
                                                "another controller), before it ended",
                                                "run the step again to create it anew (it resumes from the last "
                                                "checkpoint)")
                        rv, current = o["metadata"]["resourceVersion"], o  # the latest, for what we say of it
                        if (state == "Running" and (log_thread is None or not log_thread.is_alive())
                                and (progress := _trainer_progress(o)) and progress[0] != said_progress):
                            # no log to follow (no right to read it): the trainer's own reports instead
                            said_progress = progress[0]
                            self._say(f"[kfp-pytorch] {self.kind} {name}: {said_progress}")
                        new = job_state(o)
                        if new != state:
                            state = new
                            if state == "Suspended" and running_at is not None:
                                # preempted (Kueue evicts a running job by suspending it): its pods go
                                text, hint = self._suspended(o)
                                self._say(f"[kfp-pytorch] {self.kind} {name}: Suspended after it ran: {text}; its "
                                          f"pods are deleted, and it goes on from its last checkpoint once resumed "
                                          f"({hint})")
                            else:
                                self._say(f"[kfp-pytorch] {self.kind} {name}: {state}")
                            if state == "Running" and running_at is not None:
                                # running again (resumed, or restarted): new pods, a new log to stream
                                if log_thread is not None:
                                    log_thread.stop.set()  # its pod is gone: stop waiting for it
                                log_thread = self._start_log_stream(ns, name)
                        if state == "Running" and running_at is None:
                            running_at = time.monotonic() - t0
                            log_thread = self._start_log_stream(ns, name)
                        if state in TERMINAL or time.monotonic() >= deadline:
                            break
                        if running_at is None and time.monotonic() >= horizon:
                            break  # time to say why it still waits
                    outage.back()  # the watch ended as the server ends it: the API answers
                except Expired:  # our RV fell out of the server's history: re-read, re-watch
                    try:
                        current = kube.get(group, version, plural, ns, name)
                    except KubernetesUnavailable as e:
                        outage.lost(e)
                        continue
                    rv, state = current["metadata"]["resourceVersion"], job_state(current)
                except KubernetesUnavailable as e:
                    outage.lost(e)
            if state == "Succeeded":
                if self.delete_policy in ("on-success", "always"):
                    deleted = self._clean_up((group, version, plural), ns, name, "it succeeded")
                return ClusterRunResult(name, ns, self.kind, state, adopted, kube.calls - calls0, running_at, deleted)
            if state == "Failed":
                error = self._failure(ns, name, current)
            else:
                error = self._timeout(ns, name, timeout_s, current, spec.nodes)
            if self.delete_policy == "always" or (state != "Failed" and self.delete_policy != "never"):
                self._clean_up((group, version, plural), ns, name, "it failed" if state == "Failed" else "its timeout")
            raise error
        except KeyboardInterrupt:  # SIGTERM (run terminated in KFP) or Ctrl-C: take the job down too
            # within the pod's grace period (30 s by default) before the kubelet's SIGKILL
            if self._clean_up((group, version, plural), ns, name, "the run was terminated", within_s=10.0):
                self._say(f"[kfp-pytorch] run terminated: deleted {self.kind} {ns}/{name}")
            raise
        finally:
            if in_main and prev is not None:
                signal.signal(signal.SIGTERM, prev)
            if log_thread is not None:
                log_thread.stop.set()
                log_thread.join(timeout=2)

    def _clean_up(self, gvp: tuple[str, str, str], ns: str, name: str, after: str,
                  within_s: float | None = None) -> bool:
        """Delete the job once it is over for this step; True when it is gone. Best effort: the
        outcome is already known, so a delete the API refuses (no right to delete, an API server
        that is down) must not turn a success into a failure, hide why the job failed, or replace
        a terminated run's interrupt. The job is left, and we say how to delete it.

        ``within_s`` bounds the whole delete, retries included (urllib3 retries an idempotent
        request that timed out, so a request timeout alone does not): a terminated step has the
        pod's grace period before the kubelet kills it, and must say what it left before that."""
        result: dict = {}

        def delete() -> None:
            try:
                self.kube.delete(*gvp, ns, name)
                result["ok"] = True
            except KubernetesError as e:
                result["error"] = e.message

        if within_s is None:
            delete()
        else:
            worker = threading.Thread(target=delete, daemon=True, name="kfp-pytorch-delete")
            worker.start()
            worker.join(within_s)
            if worker.is_alive():
                result["error"] = f"the Kubernetes API did not answer the delete within {within_s:g} s"
        if result.get("ok"):
            return True
        self._say(f"[kfp-pytorch] could not delete {self.kind} {ns}/{name} after {after} ({result['error']}); it is "
                  f"left as it is: `kubectl -n {ns} delete {self.kind.lower()} {name}` deletes it")
        return False

    def _start_again(self, obj: dict, failed: dict, labels: dict) -> dict:
        """A job of this run and task that failed in an earlier attempt: the step is being retried
        (KFP's retry policy, or a retried run), so it gets a new job rather than the old failure
        again. Training resumes from the last checkpoint the failed job saved."""
        kube = self.kube
        group, version, plural = kube.gvp(obj)
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        why = _condition_message(failed, "Failed")
        self._say(f"[kfp-pytorch] {self.kind} {ns}/{name} failed in an earlier attempt"
                  + (f" ({why})" if why else "") + "; deleting it to start it again (training resumes from its "
                  "last checkpoint)")
        kube.delete(group, version, plural, ns, name, foreground=True)
        if not kube.wait_gone(group, version, plural, ns, name, timeout=self.api_outage_s):
            raise TrainingError(f"{self.kind} {ns}/{name} of an earlier, failed attempt is still being deleted after "
                                f"{_span(self.api_outage_s)}",
                                f"`kubectl -n {ns} get pods -l {self._selector(name)}` shows what holds it up; "
                                "retry the step once it is gone")
        current, _ = kube.create_or_adopt(obj, labels)
        self._say(f"[kfp-pytorch] created {self.kind} {ns}/{name} anew")
        return current

    def _operator(self) -> str:
        """What creates this kind's pods."""
        return "the Kubeflow training operator" if self.kind == "PyTorchJob" else "the Trainer and JobSet controllers"

    def _suspended(self, job: dict) -> tuple[str, str]:
        """Why a suspended job waits, and what to look at. No pods exist while a job is suspended,
        so "no pods: check the operator" would send the user the wrong way. Kueue suspends every
        job labelled with a queue (its webhook) and resumes it when the queue admits it."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        why = _condition_message(job, "Suspended")
        labels = job["metadata"].get("labels") or {}
        queue, priority = labels.get(KUEUE_QUEUE_LABEL), labels.get(KUEUE_PRIORITY_LABEL)
        text = "suspended" + (f" ({why})" if why else "")
        if queue:
            text = f"{text}: Kueue starts it when its LocalQueue {queue!r} admits it"
            hint = (f"`kubectl -n {ns} get workloads` shows whether it is admitted, and `kubectl -n {ns} describe "
                    f"workload` why not (quota, flavors); `kubectl -n {ns} get localqueue {queue}` its queue")
            workloads = self._kueue_workloads(job)
            if workloads == []:
                # Kueue makes a Workload for each job it manages; without one, the job waits for nothing.
                # A WorkloadPriorityClass that does not exist stops Kueue there, and says so only in an
                # event (WorkloadPriorityClassNotFound) and its own log.
                text += "; Kueue has made no Workload for it, so no queue will admit it"
                if warning := self._latest_warning(ns, name):  # Kueue's event says why, where we may read it
                    text += f" ({warning})"
                hint = ((f"check that WorkloadPriorityClass {priority!r} exists (`kubectl get workloadpriorityclass "
                         f"{priority}`) and " if priority else "check that ")
                        + f"Kueue manages {self.kind}s (its integrations); `kubectl -n {ns} describe "
                        f"{self.kind.lower()} {name}` shows Kueue's events")
            elif workloads and (why := _kueue_not_admitted(workloads)):
                text += f"; {why}"
            return text, hint
        return (f"{text}: no pods are created until it is resumed",
                f"something set {SUSPEND_FIELD[self.kind]} (a queueing controller, or kubectl): `kubectl -n {ns} "
                f"describe {self.kind.lower()} {name}` shows its events")

    def _held(self, job: dict) -> tuple[str, str] | None:
        """Why a job has no pods that is held before any pod is made (suspended, or a TrainJob the
        Trainer could not build), and what to look at; None when it is not."""
        return self._suspended(job) if job_state(job) == "Suspended" else _not_created(job)

    def _kueue_workloads(self, job: dict) -> list[dict] | None:
        """The job's Kueue Workloads (labelled with the job's uid). Best effort: None when they
        cannot be read (no right to list workloads, or no such API)."""
        ns, uid = job["metadata"]["namespace"], job["metadata"].get("uid")
        for version in KUEUE_VERSIONS:
            try:
                return self.kube.list(KUEUE_GROUP, version, "workloads", ns, f"{KUEUE_JOB_UID_LABEL}={uid}")
            except KubernetesError:  # this version not served, or not ours to read: try the next
                continue
        return None

    def _report_pending(self, ns: str, name: str, waited: float, job: dict, expected: int = 0) -> None:
        """Say in the step's log why the job is not running yet: what a user would otherwise
        learn only from `kubectl describe pod`, or at the timeout."""
        if (why := self._held(job)) is not None:
            self._say(f"[kfp-pytorch] {self.kind} {name}: not running after {_span(waited)}: {why[0]} ({why[1]})")
            return
        try:
            pods = self.kube.pods(ns, self._selector(name))
        except Exception as e:  # best effort, as the log stream: the watch decides the outcome
            self._say(f"[kfp-pytorch] {self.kind} {name}: not running after {_span(waited)} "
                      f"(its pods could not be listed: {e})")
            return
        head = f"[kfp-pytorch] {self.kind} {name}: not running after {_span(waited)}"
        pending, reasons = _pending(pods)
        if stuck := _cannot_start(pods):
            self._say(f"{head}: {len(stuck)} of {len(pods)} pods cannot start ({_stuck_text(stuck)}; "
                      f"{_cannot_start_hint(ns, stuck)})")
            return
        warning = self._latest_warning(ns, name) if pending or not pods else None
        if not pods:
            self._say(f"{head}: no pods yet: {warning} ({_refused_hint(ns, warning)})" if warning else
                      f"{head}: no pods yet ({self._operator()} creates them: check that it is installed and running)")
            return
        self._say(f"{head}: {_made(pods, expected)}{len(pending)} of {len(pods)} pods pending"
                  + (f" ({'; '.join(reasons)})" if reasons else "") + (f"; {warning}" if warning else "")
                  + (f" ({FAIRNESS_HINT})" if _fairness_gated(pending) else ""))

    def _start_log_stream(self, ns: str, name: str, tail_lines: int | None = None):
        try:
            pods = self.kube.pods(ns, self._selector(name))
        except KubernetesError as e:  # best effort: the watch decides the outcome
            self._say(f"[kfp-pytorch] the master's log is not streamed: its pod could not be found ({e.message})")
            return None
        master = [p for p in pods if _is_rank0(p.metadata.labels or {})]
        if not master:
            return None
        pod, container = master[0].metadata.name, _main_container(master[0])
        restarts = _restarts(master[0], container)
        stop = threading.Event()

        def pump():
            nonlocal restarts
            tail = tail_lines
            while True:
                try:
                    for line in self.kube.follow_log(ns, pod, tail, container):
                        self._say(f"[{pod}] {line}")
                except Exception as e:  # log streaming is best effort; the watch decides the outcome
                    self._say(f"[kfp-pytorch] log stream of {pod} ended: " + (
                        f"{e.message} ({e.hint})" if isinstance(e, KubernetesError) and e.hint else
                        getattr(e, "message", None) or type(e).__name__))
                    return
                # Its container ended. The pod ends with it (the watch says how), or, under restartPolicy
                # OnFailure, the kubelet starts a new container in the same pod, whose log is a new one.
                now = self._restarted(ns, pod, container, restarts, stop)
                if now is None:
                    return
                restarts, tail = now, None
                self._say(f"[kfp-pytorch] {pod}: its container restarted (restart {restarts}; the job's "
                          "backoffLimit counts them); its new log follows")

        t = threading.Thread(target=pump, daemon=True)
        t.stop = stop  # type: ignore[attr-defined]  # set when the run ends: no more waiting for restarts
        t.start()
        return t

    container_poll_s = 2.0
    """How often a log stream whose container ended looks whether the kubelet restarted it."""

    def _restarted(self, ns: str, pod: str, container: str | None, restarts: int,
                   stop: threading.Event) -> int | None:
        """Wait until the pod's container runs again after ``restarts`` restarts; its restart count
        then, or None when the pod is over (ended, deleted) or the run is."""
        while not stop.wait(self.container_poll_s):
            try:
                p = self.kube.pod(ns, pod)
            except KubernetesError:
                return None
            if p.status is None or p.status.phase in ("Succeeded", "Failed"):
                return None
            now = _restarts(p, container)
            if now > restarts and any(cs.state and cs.state.running for cs in p.status.container_statuses or []
                                      if container is None or cs.name == container):
                return now
        return None

    def _latest_warning(self, ns: str, name: str) -> str | None:
        """The latest Warning event on the job or the objects named after it (a TrainJob's child
        Jobs): where the controller says why it made no pods, e.g. a namespace's ResourceQuota
        (every Kubeflow profile can have one) refused them: "exceeded quota: kf-resource-quota,
        requested: requests.nvidia.com/gpu=4 ...". Best effort: None without the right to read events."""
        try:
            events = self.kube.events(ns, "type=Warning")
        except KubernetesError:
            return None
        mine = [e for e in events if e.involved_object and e.involved_object.kind != "Pod" and (
            e.involved_object.name == name or (e.involved_object.name or "").startswith(name + "-"))]
        if not mine:
            return None

        def when(e) -> float:
            t = e.last_timestamp or e.event_time or e.metadata.creation_timestamp
            return t.timestamp() if t else 0.0
        e = max(mine, key=when)
        return f"{e.reason} on {e.involved_object.kind} {e.involved_object.name}: {e.message}"

    def _pods_or_none(self, ns: str, name: str) -> list | None:
        """The job's pods, or None when they cannot be listed (no right to, an API outage): what
        went wrong with the job is said from its own conditions then, not lost to this error."""
        try:
            return self.kube.pods(ns, self._selector(name))
        except KubernetesError as e:
            self._say(f"[kfp-pytorch] the pods of {self.kind} {ns}/{name} could not be listed ({e.message})")
            return None

    def _failure(self, ns: str, name: str, job: dict) -> TrainingError:
        pods = self._pods_or_none(ns, name) or []
        failed = [p for p in pods if p.status and p.status.phase == "Failed"]
        detail = _condition_message(job, "Failed")
        if failed:
            p = failed[0]
            reason, main = "Error", _main_container(p)
            for cs in p.status.container_statuses or []:
                if cs.state and cs.state.terminated and cs.name == main:
                    reason = cs.state.terminated.reason or reason
            labels = p.metadata.labels or {}
            rtype = labels.get("training.kubeflow.org/replica-type", labels.get(JOBSET_REPLICATED_JOB, "replica"))
            tail = self.kube.log_tail(ns, p.metadata.name, 20, main)
            lines = "\n".join(f"    {line}" for line in tail.splitlines()[-20:])
            run_id = ((job.get("metadata") or {}).get("labels") or {}).get(f"{LABEL_PREFIX}/run-id", "")
            retry = (f"retry the run (`kfp-pytorch retry {run_id}`, or Retry in the KFP UI): this task then"
                     if _KFP_RUN_ID.fullmatch(run_id) else "a retry of this task")
            return TrainingError(f"{self.kind} {ns}/{name} failed: {rtype} replica {p.metadata.name} ended with "
                                 f"{reason}. {detail}\n  last lines of its log:\n{lines}",
                                 f"fix the cause above; {retry} adopts or recreates the job and resumes "
                                 "from the last checkpoint")
        return TrainingError(f"{self.kind} {ns}/{name} failed: {detail}")

    def _timeout(self, ns: str, name: str, timeout_s: float, job: dict | None = None,
                 expected: int = 0) -> TrainingError:
        if job is not None and (why := self._held(job)):
            return TrainingError(f"{self.kind} {ns}/{name} did not finish within {timeout_s:g}s: {why[0]}",
                                 f"{why[1]}; or raise the timeout")
        pods = self._pods_or_none(ns, name)
        if pods is None:
            return TrainingError(f"{self.kind} {ns}/{name} did not finish within {timeout_s:g}s",
                                 f"`kubectl -n {ns} describe {self.kind.lower()} {name}` and its pods show why")
        pending, reasons = _pending(pods)
        if stuck := _cannot_start(pods):
            return TrainingError(f"{self.kind} {ns}/{name} did not start within {timeout_s:g}s: {len(stuck)} of "
                                 f"{len(pods)} pods cannot start ({_stuck_text(stuck)})", _cannot_start_hint(ns, stuck))
        warning = self._latest_warning(ns, name) if pending or not pods else None
        quota = _refused_hint(ns, warning) if warning else ""
        if _fairness_gated(pending):  # never offered to a scheduler: not "could not be placed"
            return TrainingError(f"{self.kind} {ns}/{name} was not admitted by the fairness scheduler within "
                                 f"{timeout_s:g}s: {_made(pods, expected)}{len(pending)} of {len(pods)} pods wait "
                                 "behind its scheduling gate", FAIRNESS_HINT)
        if pending:
            return TrainingError(
                f"{self.kind} {ns}/{name}: gang could not be placed within {timeout_s:g}s: {_made(pods, expected)}"
                f"{len(pending)} of {len(pods)} pods still pending" + (f" ({'; '.join(reasons)})" if reasons else "")
                + (f"; {warning}" if warning else ""),
                "reduce nodes/resources, or wait for capacity (raise the timeout); "
                "`kubectl describe pod` shows the scheduler's reasons" + (f"; {quota}" if quota else ""))
        if warning:
            return TrainingError(f"{self.kind} {ns}/{name}: no pods were created within {timeout_s:g}s: {warning}",
                                 quota)
        if not pods:
            return TrainingError(f"{self.kind} {ns}/{name}: no pods were created within {timeout_s:g}s",
                                 f"{self._operator()} creates them: check that it is installed and running, and its events "
                                 f"(`kubectl -n {ns} describe {self.kind.lower()} {name}`)")
        if job is not None and (progress := _trainer_progress(job)):
            text, left = progress
            return TrainingError(f"{self.kind} {ns}/{name} did not finish within {timeout_s:g}s: its trainer reports "
                                 f"{text}", "raise the timeout" + (f" (to about {timeout_s + left:.0f}s at this pace)"
                                                                   if left else "") + " or reduce epochs; run the step "
                                 "again: training resumes from its last checkpoint")
        return TrainingError(f"{self.kind} {ns}/{name} did not finish within {timeout_s:g}s",
                             "raise the timeout or reduce epochs")


MANAGED_PREDICTOR_KEYS = ("canaryTrafficPercent", "storageUris", "labels")
"""Predictor fields this tool writes or once wrote (storageUris, before STORAGE_URI)."""


def _update(current: dict, new: dict) -> dict:
    """The merge patch that makes ``current`` spec ``new``: a JSON merge patch keeps every key it
    does not name, so the managed predictor fields the new version leaves out are named with
    null (removed). Others' additions (a transformer, KServe's defaults) are kept."""
    patch = dict(new, predictor=dict(new["predictor"]))
    for key in MANAGED_PREDICTOR_KEYS:
        if key in (current.get("predictor") or {}) and key not in new["predictor"]:
            patch["predictor"][key] = None
    return patch


class ClusterServer:
    """Creates (or updates, for a canary) a KServe InferenceService and waits until it is Ready."""

    api_outage_s = 600.0
    """As ClusterTrainer's: how long an API server that stops answering is waited for."""
    pods_report_after_s = 60.0
    """Not Ready after this long: look at the predictor's pods for why (KServe's conditions say only
    "not available" for an image that cannot be pulled) ..."""
    pods_report_every_s = 300.0
    """... and again this often (each look is one pod list)."""

    def __init__(self, kube: Kube, out=None):
        self.kube = kube
        self.out = out or sys.stdout

    _say = ClusterTrainer._say

    def run(self, spec: ClusterServeSpec, timeout_s: float = 600.0) -> dict:
        kube = self.kube
        obj = to_inference_service(spec)
        group, version, plural = kube.gvp(obj)
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        current, existed = kube.create_or_adopt(obj, {"app.kubernetes.io/managed-by": "kfp-pytorch"})
        if existed:  # a new model version: update in place; canaryTrafficPercent splits traffic
            # the annotation names the version now served (removed for a model not registered)
            current = kube.patch(group, version, plural, ns, name,
                                 {"metadata": {"annotations": {REGISTERED_MODEL: spec.registered_model or None}},
                                  "spec": _update(current["spec"], obj["spec"])})
        rv = current["metadata"]["resourceVersion"]
        deadline = time.monotonic() + timeout_s
        said: list[str] = []
        outage = _Outage(self._say, self.api_outage_s, f"InferenceService {ns}/{name}",
                         f"the InferenceService was left as it is: `kubectl -n {ns} get inferenceservice {name}` "
                         "shows it; run the serve step again to follow it on")
        next_look = time.monotonic() + self.pods_report_after_s
        said_pods = None
        while time.monotonic() < deadline:
            if time.monotonic() >= next_look and not _isvc_ready(current):
                next_look = time.monotonic() + self.pods_report_every_s
                why, hint = self._predictor_pods_why(ns, name, spec.service_account)
                if why and why != said_pods:
                    said_pods = why
                    self._say(f"[kfp-pytorch] InferenceService {ns}/{name} not ready yet: {why} ({hint})")
            if _isvc_ready(current):
                status = current.get("status") or {}
                url = status.get("url", "")
                # status.url is the external host (Knative/ingress domain, example.com by default);
                # status.address.url the in-cluster one (*.svc.cluster.local), which pods can reach
                cluster_url = (status.get("address") or {}).get("url") or None
                self.out.write(f"[kfp-pytorch] InferenceService {ns}/{name} ready at {url}"
                               + (f" (in the cluster: {cluster_url})" if cluster_url else "") + "\n")
                return {"name": name, "namespace": ns, "url": url, "cluster_url": cluster_url,
                        "infer_url": f"{url}/v2/models/{spec.model_name}/infer", "updated": existed}
            try:
                horizon = min(deadline, next_look)
                for event, o in kube.watch(group, version, plural, ns, name, rv, horizon - time.monotonic()):
                    outage.back()
                    if event == "DELETED":
                        raise ServingError(f"InferenceService {ns}/{name} was deleted (by kubectl or another "
                                           "controller) before it was Ready", "run the serve step again")
                    rv, current = o["metadata"]["resourceVersion"], o
                    if _isvc_ready(o) or time.monotonic() >= horizon:
                        break
                    if (why := _not_ready(o)) and why != said:  # each change of why it waits, once
                        said = why
                        self.out.write(f"[kfp-pytorch] InferenceService {ns}/{name} not ready yet: {'; '.join(why)}\n")
                        self.out.flush()
                outage.back()
            except Expired:
                try:
                    current = kube.get(group, version, plural, ns, name)
                except KubernetesUnavailable as e:
                    outage.lost(e)
                    continue
                rv = current["metadata"]["resourceVersion"]
            except KubernetesUnavailable as e:
                outage.lost(e)
        reasons = _not_ready(current)
        pods_why, hint = self._predictor_pods_why(ns, name, spec.service_account)
        raise ServingError(f"InferenceService {ns}/{name} not Ready within {timeout_s:g}s"
                           + (f" ({'; '.join(reasons)})" if reasons else "") + (f": {pods_why}" if pods_why else ""),
                           hint or "kubectl describe inferenceservice shows why (image pull, storage initializer, "
                                   "S3 secret)")

    def _predictor_pods_why(self, ns: str, name: str, service_account: str) -> tuple[str, str] | tuple[None, None]:
        """Why the predictor's pods do not start, which KServe's conditions say only as "not
        available": an image that cannot be pulled, a Secret that does not exist, or a storage
        initializer that cannot fetch the model (wrong S3 endpoint or credentials, a model URI with
        nothing there) and fails again and again. Best effort: (None, None) when none of these."""
        try:
            pods = self.kube.pods(ns, f"serving.kserve.io/inferenceservice={name}")
        except KubernetesError:
            return None, None
        if stuck := _cannot_start(pods):
            return f"its predictor pods cannot start ({_stuck_text(stuck)})", _cannot_start_hint(ns, stuck)
        for p in pods:
            for cs in (p.status and p.status.init_container_statuses) or []:
                waiting, last = cs.state and cs.state.waiting, cs.last_state and cs.last_state.terminated
                if cs.name == "storage-initializer" and waiting and waiting.reason == "CrashLoopBackOff":
                    return (f"the storage initializer of {p.metadata.name} cannot fetch the model (it failed "
                            f"{cs.restart_count} times" + (f", last with exit code {last.exit_code}" if last else "")
                            + ")",
                            f"`kubectl -n {ns} logs {p.metadata.name} -c storage-initializer` says why: check the S3 "
                            f"endpoint and credentials of ServiceAccount {service_account} (`kfp-pytorch manifest "
                            "s3-secret`) and that the model's URI holds the model")
        return None, None


def _not_ready(obj: dict) -> list[str]:
    """The InferenceService's conditions that are not True: why it is not Ready."""
    out = []
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            why = " ".join(x for x in (c.get("reason"), c.get("message")) if x)
            out.append(f"{c.get('type')}: {why}" if why else f"{c.get('type')} {c.get('status', 'Unknown')}")
    return out


def _isvc_ready(obj: dict) -> bool:
    """Ready *for the spec we wrote*: after an update the status still says Ready for the previous
    generation until KServe has rolled the new one out (status.observedGeneration catches up)."""
    status = obj.get("status") or {}
    observed, generation = status.get("observedGeneration"), obj["metadata"].get("generation")
    if observed is not None and generation is not None and observed < generation:
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
