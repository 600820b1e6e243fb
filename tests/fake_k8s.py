"""A fake Kubernetes API *server* on loopback that speaks the real REST protocol.

The official ``kubernetes`` client talks to it unmodified (no patched methods). It enforces the
rules our code depends on:

- resourceVersion: every write bumps a global counter; PUT with a stale
  ``metadata.resourceVersion`` is ``409 Conflict``; POST of an existing name is ``409 AlreadyExists``;
- ``labelSelector`` (equality and set-based) and ``fieldSelector`` (metadata.name/namespace,
  spec.nodeName, status.phase);
- watch from a resourceVersion (``?watch=true``), with ``410 Gone`` when it is older than the
  retained history, and ``timeoutSeconds``;
- ``pods/binding`` (refused while the pod has scheduling gates), ``pods/log``;
- ``spec.priority`` immutable; scheduling gates can only be removed after creation;
- the status subresource (``/status`` writes only status; main writes never change status);
- merge, strategic-merge and JSON patches; ``403`` for denied (verb, resource); ``404`` for a CRD
  group that is not installed.

As Istio's injector, it adds an ``istio-proxy`` container to a pod created in a namespace
labelled ``istio-injection=enabled`` unless the pod opts out, and ``pods/log`` of a pod with more
than one container must name one, as the API server requires. Pod Security admission refuses a
pod that misses "restricted" in a namespace that enforces it, with the API server's message.

``FakeCluster.operator`` simulates the Training Operator and KServe: a PyTorchJob gets its pods,
whose phases the test moves (``set_pod_phase``), and the job's conditions follow; an
InferenceService becomes Ready.
"""
from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from servers import reply, serve_in_thread, stop_http

CORE = {"pods": True, "events": True, "secrets": True, "configmaps": True, "serviceaccounts": True, "resourcequotas": True,
        "nodes": False, "namespaces": False}  # plural -> namespaced
KINDS = {"pods": "Pod", "events": "Event", "secrets": "Secret", "configmaps": "ConfigMap", "resourcequotas": "ResourceQuota",
         "serviceaccounts": "ServiceAccount", "nodes": "Node", "namespaces": "Namespace", "leases": "Lease",
         "pytorchjobs": "PyTorchJob", "trainjobs": "TrainJob", "inferenceservices": "InferenceService",
         "workloads": "Workload", "workloadpriorityclasses": "WorkloadPriorityClass"}
GROUPS = {("coordination.k8s.io", "v1"): {"leases"},
          ("kubeflow.org", "v1"): {"pytorchjobs"},
          ("trainer.kubeflow.org", "v1alpha1"): {"trainjobs"},
          ("serving.kserve.io", "v1beta1"): {"inferenceservices"},
          ("kueue.x-k8s.io", "v1beta1"): {"workloads", "workloadpriorityclasses"}}
WITH_STATUS = {"pods", "pytorchjobs", "trainjobs", "inferenceservices", "nodes", "namespaces"}


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


# ---- selectors ------------------------------------------------------------------------------------
def _match_labels(selector: str, labels: dict) -> bool:
    if not selector:
        return True
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if not term:
            continue
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (key in labels and labels[key] in vals):
                return False
            continue
        m = re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)", term)
        if m:
            key, op, val = m.groups()
            if op == "!=":
                if labels.get(key) == val:
                    return False
            elif labels.get(key) != val:
                return False
            continue
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: dict, path: str):
    cur = obj
    for p in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


FIELD_LABELS = {
    "pods": {"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase", "spec.schedulerName"},
    "events": {"metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
               "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion", "reason", "type"},
}
"""The field selectors each resource supports (the API server refuses others); metadata.name and
metadata.namespace for every resource."""


def _match_fields(selector: str, obj: dict, plural: str) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term.strip())
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector {term!r}")
        key, op, val = m.groups()
        if key not in FIELD_LABELS.get(plural, {"metadata.name", "metadata.namespace"}):
            raise ApiError(400, "BadRequest", f'field label not supported: {key}')
        got = _field(obj, key) or ""
        if (op == "!=") == (got == val):
            return False
    return True


# ---- patches --------------------------------------------------------------------------------------
def _merge(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _strategic(target, patch):
    """Strategic merge: like merge, but lists of named items (containers, env, gates) merge by name."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and isinstance(out.get(k), list) and all(isinstance(x, dict) and "name" in x for x in v + out[k]):
            merged = {x["name"]: x for x in out[k]}
            for x in v:
                if x.get("$patch") == "delete":
                    merged.pop(x["name"], None)
                else:
                    merged[x["name"]] = _strategic(merged.get(x["name"]), x)
            out[k] = list(merged.values())
        else:
            out[k] = _strategic(out.get(k), v)
    return out


def _json_patch(doc, ops):
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")] if op["path"] != "" else []
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1] if parts else None
        kind = op["op"]
        try:
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent[last]
                if cur != op["value"]:
                    raise ApiError(422, "Invalid", f"test failed at {op['path']}")
            elif kind == "remove":
                if isinstance(parent, list):
                    parent.pop(int(last))
                else:
                    del parent[last]
            elif kind in ("add", "replace"):
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(op["value"])
                    elif kind == "add":
                        parent.insert(int(last), op["value"])
                    else:
                        parent[int(last)] = op["value"]
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiError(422, "Invalid", f"replace of missing path {op['path']}")
                    parent[last] = op["value"]
            else:
                raise ApiError(400, "BadRequest", f"unsupported JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"JSON patch failed at {op['path']}: {e}") from None
    return doc


# ---- the store ------------------------------------------------------------------------------------
class FakeCluster:
    def __init__(self, history: int = 1000):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.objects: dict[str, dict[tuple, dict]] = {}
        self.rv = 100
        self.events: deque = deque(maxlen=history)
        self.logs: dict[tuple, list[str]] = {}
        self.log_epochs: dict[tuple, int] = {}
        """(ns, pod) -> its container's incarnation: a follow of an earlier one ends."""
        self.denied: set[tuple[str, str]] = set()
        """(verb, plural) pairs that return 403."""
        self.stalled: set[tuple[str, str]] = set()
        """(verb, plural) pairs that get no answer until :attr:`unstall` is set, as from an API
        server that accepts the connection and never answers."""
        self.missing_groups: set[str] = set()
        """API groups whose CRDs are 'not installed' (404)."""
        self.requests: list[tuple[str, str]] = []
        self.watch_faults: list[str] = []
        """What the next watches meet, one entry each: "drop" (the connection breaks mid-stream,
        as when the API server restarts) or "stall" (the stream goes silent and never ends, as a
        connection a load balancer dropped without telling us)."""
        self.unstall = threading.Event()
        self.operator = Operator(self)
        self.server = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> str:
        cluster = self

        class Handler(_Handler):
            fake = cluster

        self.server, url = serve_in_thread(Handler)
        return url

    def stop(self) -> None:
        self.unstall.set()
        stop_http(self.server)
        with self.cond:
            self.cond.notify_all()

    # -- generic operations ------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, plural: str, kind: str, obj: dict) -> None:
        self.events.append((int(obj["metadata"]["resourceVersion"]), plural, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def create(self, plural: str, ns: str | None, obj: dict, api_version: str) -> dict:
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
                raise ApiError(422, "Invalid", f'{KINDS[plural]} "{name}" is invalid: metadata.name: Invalid value')
            store = self.objects.setdefault(plural, {})
            if (ns, name) in store:
                raise ApiError(409, "AlreadyExists", f'{plural} "{name}" already exists')
            if plural == "pods":
                self._validate_pod(name, obj)
                self._admit_pod_security(ns, name, obj)
                self._admit_quota(ns, name, obj)
            if ns and plural != "namespaces":
                meta["namespace"] = ns
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=now_iso(), generation=1)
            meta.setdefault("labels", {})
            obj.setdefault("apiVersion", api_version)
            obj.setdefault("kind", KINDS[plural])
            if plural in WITH_STATUS:  # the status subresource: status is not settable on create
                obj["status"] = {"phase": "Pending"} if plural == "pods" else {}
            if plural == "pods":
                spec = obj.setdefault("spec", {})
                if "priority" not in spec:
                    spec["priority"] = 0
                self._istio_inject(ns, obj)
                if spec.get("schedulingGates"):  # as the API server marks a gated pod on create
                    obj["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                                                    "message": "Scheduling is blocked due to non-empty scheduling gates"}]
            if self.operator.kueue and "kueue.x-k8s.io/queue-name" in meta["labels"]:  # Kueue's mutating webhook
                if plural == "pytorchjobs":
                    obj["spec"].setdefault("runPolicy", {})["suspend"] = True
                elif plural == "trainjobs":
                    obj["spec"]["suspend"] = True
            store[(ns, name)] = obj
            self._emit(plural, "ADDED", obj)
            self.operator.on_event(plural, "ADDED", obj)
            return copy.deepcopy(obj)

    def _istio_inject(self, ns: str, pod: dict) -> None:
        """Istio's sidecar injector (a mutating webhook): in a namespace labelled
        ``istio-injection=enabled`` (every Kubeflow profile's), a pod gets an ``istio-proxy``
        container unless it opts out (``sidecar.istio.io/inject: "false"``, label or annotation)."""
        namespace = self.objects.get("namespaces", {}).get((None, ns))
        if not namespace or (namespace["metadata"].get("labels") or {}).get("istio-injection") != "enabled":
            return
        meta = pod["metadata"]
        if "false" in ((meta.get("labels") or {}).get("sidecar.istio.io/inject"),
                       (meta.get("annotations") or {}).get("sidecar.istio.io/inject")):
            return
        pod["spec"].setdefault("containers", []).append({"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.26.0",
                                                         "args": ["proxy", "sidecar"]})

    @staticmethod
    def _validate_pod(name: str, pod: dict) -> None:
        """The API server's pod validation of volumes (ValidatePodSpec): unique volume names, every
        mount naming a volume, one mount per path in a container. 422, with its field paths."""
        spec = pod.get("spec") or {}
        errors, volumes = [], set()
        for i, v in enumerate(spec.get("volumes") or []):
            if v.get("name") in volumes:
                errors.append(f'spec.volumes[{i}].name: Duplicate value: "{v.get("name")}"')
            volumes.add(v.get("name"))
        for kind in ("initContainers", "containers"):
            for ci, c in enumerate(spec.get(kind) or []):
                paths = set()
                for mi, m in enumerate(c.get("volumeMounts") or []):
                    if m.get("name") not in volumes:
                        errors.append(f'spec.{kind}[{ci}].volumeMounts[{mi}].name: Not found: "{m.get("name")}"')
                    if m.get("mountPath") in paths:
                        errors.append(f'spec.{kind}[{ci}].volumeMounts[{mi}].mountPath: Invalid value: '
                                      f'"{m.get("mountPath")}": must be unique')
                    paths.add(m.get("mountPath"))
        if errors:
            raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: '
                                          + (errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"))

    def _admit_pod_security(self, ns: str, name: str, pod: dict) -> None:
        """Pod Security admission at level "restricted", where the namespace enforces it
        (``pod-security.kubernetes.io/enforce: restricted``), with the API server's message."""
        namespace = self.objects.get("namespaces", {}).get((None, ns))
        if not namespace or (namespace["metadata"].get("labels") or {}).get(
                "pod-security.kubernetes.io/enforce") != "restricted":
            return
        spec = pod.get("spec") or {}
        psc = spec.get("securityContext") or {}
        containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
        sc = {c["name"]: c.get("securityContext") or {} for c in containers}

        def names(bad) -> str:
            return ", ".join(f'"{n}"' for n in bad)
        out = []
        if bad := [n for n, c in sc.items() if c.get("allowPrivilegeEscalation") is not False]:
            out.append(f"allowPrivilegeEscalation != false (container{'s' * (len(bad) > 1)} {names(bad)} must set "
                       "securityContext.allowPrivilegeEscalation=false)")
        if bad := [n for n, c in sc.items() if "ALL" not in ((c.get("capabilities") or {}).get("drop") or [])
                   or set((c.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}]:
            out.append(f"unrestricted capabilities (container{'s' * (len(bad) > 1)} {names(bad)} must set "
                       'securityContext.capabilities.drop=["ALL"])')
        if bad := [n for n, c in sc.items() if c.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True]:
            out.append(f"runAsNonRoot != true (pod or container{'s' * (len(bad) > 1)} {names(bad)} must set "
                       "securityContext.runAsNonRoot=true)")
        if bad := [n for n, c in sc.items() if (c.get("seccompProfile") or psc.get("seccompProfile") or {}).get(
                "type") not in ("RuntimeDefault", "Localhost")]:
            out.append(f"seccompProfile (pod or container{'s' * (len(bad) > 1)} {names(bad)} must set "
                       'securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')
        if out:
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": '
                                             + ", ".join(out))

    def _admit_quota(self, ns: str, name: str, pod: dict) -> None:
        """The ResourceQuota admission plugin, for the GPU quota of a Kubeflow profile
        (``requests.nvidia.com/gpu``, whole GPUs) and the pod count: a pod over either is refused."""
        def gpus(p: dict) -> int:  # an extended resource's request defaults to its limit
            return sum(int((c.get("resources") or {}).get("requests", {}).get(
                "nvidia.com/gpu", (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0)))
                for c in p.get("spec", {}).get("containers", []))
        live = [p for (n, _), p in self.objects.get("pods", {}).items()
                if n == ns and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        for (n, qname), quota in sorted(self.objects.get("resourcequotas", {}).items(), key=lambda kv: str(kv[0])):
            if n != ns:
                continue
            for res, (want, used) in {"requests.nvidia.com/gpu": (gpus(pod), sum(map(gpus, live))),
                                      "pods": (1, len(live))}.items():
                hard = quota["spec"].get("hard", {}).get(res)
                if hard is not None and want and used + want > int(hard):
                    raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: {qname}, requested: '
                                                     f"{res}={want}, used: {res}={used}, limited: {res}={hard}")

    def get(self, plural: str, ns: str | None, name: str) -> dict:
        with self.lock:
            obj = self.objects.get(plural, {}).get((ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            return copy.deepcopy(obj)

    def list(self, plural: str, ns: str | None, label_selector: str = "", field_selector: str = "") -> list[dict]:
        with self.lock:
            out = [copy.deepcopy(o) for (n, _), o in sorted(self.objects.get(plural, {}).items(), key=lambda kv: str(kv[0]))
                   if (ns is None or n == ns) and _match_labels(label_selector, o["metadata"].get("labels") or {})
                   and _match_fields(field_selector, o, plural)]
            return out

    def _check_update(self, plural: str, old: dict, new: dict) -> None:
        if plural == "pods":
            if new.get("spec", {}).get("priority") != old.get("spec", {}).get("priority"):
                raise ApiError(422, "Invalid", "Pod is invalid: spec.priority: Forbidden: field is immutable")
            old_gates = [g["name"] for g in old.get("spec", {}).get("schedulingGates") or []]
            new_gates = [g["name"] for g in new.get("spec", {}).get("schedulingGates") or []]
            if not set(new_gates) <= set(old_gates):
                raise ApiError(422, "Invalid", "Pod is invalid: spec.schedulingGates: Forbidden: only deletion is "
                                               "allowed, but found new scheduling gate")
            if old.get("spec", {}).get("nodeName") and new.get("spec", {}).get("nodeName") != old["spec"]["nodeName"]:
                raise ApiError(422, "Invalid", "Pod is invalid: spec.nodeName: Forbidden: field is immutable")

    def replace(self, plural: str, ns: str | None, name: str, obj: dict, status_only: bool = False,
                check_rv: bool = True) -> dict:
        with self.lock:
            store = self.objects.get(plural, {})
            old = store.get((ns, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if check_rv and rv and rv != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the object has '
                                                "been modified; please apply your changes to the latest version and try again")
            new = copy.deepcopy(old)
            if status_only:
                new["status"] = copy.deepcopy(obj.get("status", {}))
            else:
                for k, v in obj.items():
                    if k in ("status", "metadata"):
                        continue
                    new[k] = copy.deepcopy(v)
                for k in list(new):
                    if k not in obj and k not in ("status", "metadata", "apiVersion", "kind"):
                        del new[k]
                meta = obj.get("metadata") or {}
                for k in ("labels", "annotations", "finalizers", "ownerReferences"):
                    if k in meta:
                        new["metadata"][k] = copy.deepcopy(meta[k])
                if plural not in WITH_STATUS and "status" in obj:
                    new["status"] = copy.deepcopy(obj["status"])
                self._check_update(plural, old, new)
            if new == old:
                return copy.deepcopy(old)
            spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
            if spec_of(new) != spec_of(old):  # as the API server: generation counts changes of the desired state
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            store[(ns, name)] = new
            self._emit(plural, "MODIFIED", new)
            self.operator.on_event(plural, "MODIFIED", new)
            return copy.deepcopy(new)

    def patch(self, plural: str, ns: str | None, name: str, patch, content_type: str, status_only: bool = False) -> dict:
        with self.lock:
            old = self.get(plural, ns, name)
            if "json-patch" in content_type:
                new = _json_patch(old, patch)
            elif "strategic" in content_type:
                if plural in ("pytorchjobs", "trainjobs", "inferenceservices"):
                    raise ApiError(415, "UnsupportedMediaType", "strategic merge patch is not supported for custom resources")
                new = _strategic(old, patch)
            else:
                new = _merge(old, patch)
            return self.replace(plural, ns, name, new, status_only=status_only, check_rv=False)

    def delete(self, plural: str, ns: str | None, name: str) -> dict:
        with self.lock:
            obj = self.objects.get(plural, {}).pop((ns, name), None)
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            obj["metadata"]["resourceVersion"] = self._next_rv()
            if plural == "pods":  # its log goes with it: a new pod of the same name starts a new one
                self.logs.pop((ns, name), None)
                self.cond.notify_all()
            self._emit(plural, "DELETED", obj)
            self.operator.on_event(plural, "DELETED", obj)
            return obj

    def bind(self, ns: str, name: str, body: dict) -> dict:
        with self.lock:
            pod = self.get("pods", ns, name)
            if pod["spec"].get("schedulingGates"):
                raise ApiError(409, "Conflict", f'pod {name} has scheduling gates and cannot be bound')
            if pod["spec"].get("nodeName"):
                raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            node = (body.get("target") or {}).get("name")
            if not node:
                raise ApiError(400, "BadRequest", "binding target name is required")
            pod["spec"]["nodeName"] = node
            pod.setdefault("status", {})["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self.replace("pods", ns, name, pod, check_rv=False)
            self.replace("pods", ns, name, pod, status_only=True, check_rv=False)
            return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    # -- helpers for tests -------------------------------------------------------------------------
    def set_pod_phase(self, ns: str, name: str, phase: str, reason: str = "", message: str = "") -> None:
        with self.lock:
            pod = self.get("pods", ns, name)
            st = pod.setdefault("status", {})
            st["phase"] = phase
            if phase in ("Succeeded", "Failed"):  # the first container ended so; a sidecar, as it does
                st["containerStatuses"] = [{"name": c["name"], "ready": False, "restartCount": 0, "image": "x",
                                            "imageID": "", "state": {"terminated": {
                                                "exitCode": 0 if phase == "Succeeded" or i else 1,
                                                "reason": "Completed" if i else reason or (
                                                    "Completed" if phase == "Succeeded" else "Error"),
                                                "message": "" if i else message}}}
                                           for i, c in enumerate(pod["spec"].get("containers") or [{"name": "pytorch"}])]
            if phase == "Pending" and reason:
                st["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": reason, "message": message}]
            self.replace("pods", ns, name, pod, status_only=True, check_rv=False)

    def set_pod_waiting(self, ns: str, name: str, reason: str, message: str, init: bool = False) -> None:
        """A pod placed on a node whose containers (``init``: its init containers) wait: an image
        the kubelet cannot pull, a Secret it cannot read, an init container that keeps failing
        (the kubelet's reasons and messages)."""
        with self.lock:
            pod = self.get("pods", ns, name)
            waiting = [{"name": c["name"], "ready": False, "restartCount": 3 if reason == "CrashLoopBackOff" else 0,
                        "image": c.get("image", ""), "imageID": "",
                        "state": {"waiting": {"reason": reason, "message": message}}}
                       for c in pod["spec"]["initContainers" if init else "containers"]]
            pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                             "initContainerStatuses" if init else "containerStatuses": waiting}
            self.replace("pods", ns, name, pod, status_only=True, check_rv=False)

    def restart_container(self, ns: str, name: str) -> None:
        """The kubelet restarts a running pod's container (restartPolicy OnFailure): the pod stays,
        the old container's log stream ends, and the new container's log starts empty."""
        with self.cond:
            pod = self.get("pods", ns, name)
            st = pod.setdefault("status", {})
            restarts = 1 + max([cs.get("restartCount", 0) for cs in st.get("containerStatuses") or []] or [0])
            st["containerStatuses"] = [{"name": c["name"], "ready": True, "restartCount": restarts, "image": "x",
                                        "imageID": "", "state": {"running": {"startedAt": now_iso()}}}
                                       for c in pod["spec"]["containers"]]
            self.logs[(ns, name)] = []
            self.log_epochs[(ns, name)] = self.log_epochs.get((ns, name), 0) + 1
            self.replace("pods", ns, name, pod, status_only=True, check_rv=False)
            self.cond.notify_all()

    def append_log(self, ns: str, pod: str, text: str) -> None:
        with self.cond:
            self.logs.setdefault((ns, pod), []).extend(text.splitlines(keepends=True))
            self.cond.notify_all()


class Operator:
    """Training Operator and KServe, simulated just enough: the test moves pods, we follow."""

    def __init__(self, fake: FakeCluster):
        self.fake = fake
        self.isvc_ready = True
        self.isvc_domain = "example.com"
        """KServe's ingress domain (config-domain; example.com unless configured): status.url's host."""
        self.isvc_address: str | None = None
        """status.address.url, the in-cluster URL; None: http://NAME.NS.svc.cluster.local, as KServe writes it."""
        self.installed = True
        """False: no operator runs in this cluster (its CRDs are there, nothing acts on them)."""
        self.kserve_storage_uris = True
        """False: a KServe before 0.16, which has no ``spec.predictor.storageUris`` (its CRD prunes
        the field), so a model named only there is never downloaded."""
        self.kueue = False
        """True: Kueue's job webhook runs, and suspends (``runPolicy.suspend``) every PyTorchJob
        created with a ``kueue.x-k8s.io/queue-name`` label until a test admits it by resuming it;
        Kueue's controller makes the job's Workload, not admitted, saying why."""
        self.trainer_build_fails = False
        """True: the Trainer cannot build a TrainJob's JobSet from its runtime (Created False,
        JobsBuildFailed), so it makes no pods."""
        self.trainer_runtime_pod: dict = {"containers": [{"name": "node"}]}
        """The ClusterTrainingRuntime's pod spec (the ``node`` replicated job's); a TrainJob's
        runtime patch merges into it strategically, by name, as the Trainer does."""
        self.trainer_progress_url: str | None = None
        """The Trainer's TrainJobProgress gate is on, with its status server at this URL: its
        Progress plugin labels a TrainJob's pods ``trainer.kubeflow.org/trainjob-name`` and gives
        their containers the KUBEFLOW_TRAINER_STATUS_* variables (see fake_trainer_status)."""
        self.kueue_pending = ("couldn't assign flavors to pod set master: insufficient unused quota for "
                              "nvidia.com/gpu in flavor default-flavor, 4 more needed")

    def on_event(self, plural: str, kind: str, obj: dict) -> None:
        if not self.installed:
            return
        f = self.fake
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        if plural == "pytorchjobs" and kind in ("ADDED", "MODIFIED"):
            job = obj
            conds = (job.get("status") or {}).get("conditions") or []
            suspended = bool((job["spec"].get("runPolicy") or {}).get("suspend"))
            was_suspended = bool(conds) and conds[-1]["type"] == "Suspended"
            queue = (job["metadata"].get("labels") or {}).get("kueue.x-k8s.io/queue-name")
            if kind == "ADDED" and self.kueue and queue:  # Kueue's job controller: the job's Workload
                self._kueue_workload(job, queue, "PyTorchJob", "kubeflow.org/v1")
            if suspended:  # the training operator creates no pods for a suspended job, and deletes its pods
                for pod in f.list("pods", ns, f"training.kubeflow.org/job-name={name}"):
                    f.delete("pods", ns, pod["metadata"]["name"])
                self._set_job(ns, name, "Suspended", "PyTorchJobSuspended", f"PyTorchJob {name} is suspended.")
                return
            if kind == "MODIFIED" and not was_suspended:
                return
            for rtype, rs in job["spec"]["pytorchReplicaSpecs"].items():
                for i in range(rs.get("replicas", 1)):
                    tmpl = copy.deepcopy(rs["template"])
                    labels = dict(tmpl.get("metadata", {}).get("labels", {}))
                    labels.update({"training.kubeflow.org/job-name": name,
                                   "training.kubeflow.org/replica-type": rtype.lower(),
                                   "training.kubeflow.org/replica-index": str(i)})
                    pod = {"metadata": {"name": f"{name}-{rtype.lower()}-{i}", "labels": labels,
                                        "annotations": dict(tmpl.get("metadata", {}).get("annotations", {})),
                                        "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                                             "name": name, "uid": job["metadata"]["uid"]}]},
                           "spec": tmpl["spec"]}
                    try:
                        f.create("pods", ns, pod, "v1")
                    except ApiError as e:  # the operator records it on the job, and tries again later
                        self._warn(ns, "PyTorchJob", name, job["metadata"]["uid"], "FailedCreatePod",
                                   f"Error creating: {e.message}")
            self._set_job(ns, name, "Created", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
        elif plural == "trainjobs" and kind in ("ADDED", "MODIFIED"):
            self._trainer(obj, kind)
        elif plural == "pods" and kind in ("MODIFIED",):
            labels = obj["metadata"].get("labels") or {}
            if job := labels.get("training.kubeflow.org/job-name"):
                self._reconcile_job(ns, job)
            elif job := labels.get("jobset.sigs.k8s.io/jobset-name"):
                self._reconcile_trainjob(ns, job)
        elif plural in ("pytorchjobs", "trainjobs") and kind == "DELETED":
            selector = "training.kubeflow.org/job-name" if plural == "pytorchjobs" else "jobset.sigs.k8s.io/jobset-name"
            for pod in f.list("pods", ns, f"{selector}={name}"):
                f.delete("pods", ns, pod["metadata"]["name"])
        elif plural == "inferenceservices" and kind == "ADDED":  # the predictor's pod, as KServe's Deployment makes it
            predictor = obj["spec"]["predictor"]
            container = dict((predictor.get("containers") or [{"name": "kserve-container", "image": "kserve/model"}])[0])
            try:
                f.create("pods", ns, {"metadata": {
                    "name": f"{name}-predictor-{uuid.uuid4().hex[:10]}-{uuid.uuid4().hex[:5]}",
                    "labels": {"serving.kserve.io/inferenceservice": name, "component": "predictor"}},
                    "spec": {"serviceAccountName": predictor.get("serviceAccountName", "default"),
                             "initContainers": [{"name": "storage-initializer", "image": "kserve/storage-initializer"}],
                             "containers": [container]}}, "v1")
            except ApiError as e:
                self._warn(ns, "ReplicaSet", f"{name}-predictor", obj["metadata"]["uid"], "FailedCreate",
                           f"Error creating: {e.message}")
            self.on_event(plural, "MODIFIED", obj)
        elif plural == "inferenceservices" and kind == "DELETED":
            for pod in f.list("pods", ns, f"serving.kserve.io/inferenceservice={name}"):
                f.delete("pods", ns, pod["metadata"]["name"])
        elif (plural == "inferenceservices" and kind in ("ADDED", "MODIFIED") and self.isvc_ready
              and (obj.get("status") or {}).get("observedGeneration") != obj["metadata"]["generation"]):
            # KServe rolls the new generation out, then reports it: until then the status is the last one's
            ready = self._storage_uri(obj["spec"]["predictor"]) is not None
            threading.Timer(0.05, self._isvc_ready, args=(ns, name, obj["metadata"]["generation"], ready)).start()

    def _warn(self, ns: str, kind: str, name: str, uid: str, reason: str, message: str) -> None:
        """A Warning event on an object, as a controller's event recorder writes it."""
        self.fake.create("events", ns, {
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}"}, "type": "Warning", "reason": reason,
            "message": message, "count": 1, "lastTimestamp": now_iso(),
            "involvedObject": {"kind": kind, "name": name, "namespace": ns, "uid": uid}}, "v1")

    def _trainer(self, job: dict, kind: str) -> None:
        """Kubeflow Trainer v2 with the torch-distributed runtime: a JobSet whose ``node`` Job is
        an Indexed Job of numNodes pods. A TrainJob has no Running condition: its
        ``status.jobsStatus`` says when the node Job is ready."""
        f = self.fake
        ns, name, uid = job["metadata"]["namespace"], job["metadata"]["name"], job["metadata"]["uid"]
        labels = job["metadata"].get("labels") or {}
        if kind == "ADDED" and self.kueue and (queue := labels.get("kueue.x-k8s.io/queue-name")):
            self._kueue_workload(job, queue, "TrainJob", "trainer.kubeflow.org/v1alpha1")
        conds = (job.get("status") or {}).get("conditions") or []
        was_suspended = any(c["type"] == "Suspended" and c["status"] == "True" for c in conds)
        if job["spec"].get("suspend"):  # the JobSet is suspended: its Jobs' pods are deleted
            for pod in f.list("pods", ns, f"jobset.sigs.k8s.io/jobset-name={name}"):
                f.delete("pods", ns, pod["metadata"]["name"])
            self._set_trainjob(ns, name, "Suspended", "True", "Suspended", "TrainJob is suspended")
            return
        if kind == "MODIFIED" and not was_suspended:
            return
        if was_suspended:
            self._set_trainjob(ns, name, "Suspended", "False", "Resumed", "TrainJob is resumed")
        if self.trainer_build_fails:
            self._set_trainjob(ns, name, "Created", "False", "JobsBuildFailed", "Failed to build Jobs")
            return
        trainer = job["spec"]["trainer"]
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        tmpl = patch["template"]["spec"]["template"]
        pod_spec = _strategic(self.trainer_runtime_pod, tmpl.get("spec", {}))
        for i in range(trainer.get("numNodes", 1)):
            pod_labels = {**tmpl.get("metadata", {}).get("labels", {}), "jobset.sigs.k8s.io/jobset-name": name,
                          "jobset.sigs.k8s.io/replicatedjob-name": "node", "jobset.sigs.k8s.io/job-index": "0",
                          "batch.kubernetes.io/job-completion-index": str(i)}
            env = list(trainer.get("env", []))
            if self.trainer_progress_url:
                pod_labels["trainer.kubeflow.org/trainjob-name"] = name
                env += [{"name": "KUBEFLOW_TRAINER_STATUS_URL", "value": f"{self.trainer_progress_url}/apis/"
                         f"trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/status"},
                        {"name": "KUBEFLOW_TRAINER_STATUS_CA_CERT", "value": "/var/run/secrets/kubeflow/trainer/ca.crt"},
                        {"name": "KUBEFLOW_TRAINER_STATUS_TOKEN", "value": "/var/run/secrets/kubeflow/trainer/token"}]
            try:
                f.create("pods", ns, {
                    "metadata": {"name": f"{name}-node-0-{i}-{uuid.uuid4().hex[:5]}", "labels": pod_labels,
                                 "annotations": dict(tmpl.get("metadata", {}).get("annotations", {})),
                                 "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": f"{name}-node-0",
                                                      "uid": uid}]},
                    "spec": {**pod_spec, "containers": [{  # the runtime's, patched by name
                        **next((c for c in pod_spec.get("containers", []) if c["name"] == "node"), {}),
                        "name": "node", "image": trainer["image"], "command": trainer["command"],
                        "args": trainer["args"], "env": env,
                        "resources": trainer.get("resourcesPerNode", {})}]}}, "v1")
            except ApiError as e:  # the Job controller records it on the child Job
                self._warn(ns, "Job", f"{name}-node-0", uid, "FailedCreate", f"Error creating: {e.message}")
        self._set_trainjob(ns, name, "Created", "True", "JobsCreationSucceeded", "Succeeded to create Jobs",
                           jobs_status={"active": 1})

    def _reconcile_trainjob(self, ns: str, name: str) -> None:
        pods = self.fake.list("pods", ns, f"jobset.sigs.k8s.io/jobset-name={name}")
        phases = [p.get("status", {}).get("phase") for p in pods]
        if "Failed" in phases:
            self._set_trainjob(ns, name, "Failed", "True", "FailedJobs", "jobset failed due to one or more job failures",
                               jobs_status={"failed": 1})
        elif pods and all(ph == "Succeeded" for ph in phases):
            self._set_trainjob(ns, name, "Complete", "True", "AllJobsCompleted", "jobset completed successfully",
                               jobs_status={"succeeded": 1})
        elif pods and all(ph == "Running" for ph in phases):
            self._set_trainjob(ns, name, None, jobs_status={"active": 1, "ready": 1})

    def _set_trainjob(self, ns, name, ctype, status="True", reason="", message="", jobs_status=None) -> None:
        f = self.fake
        try:
            job = f.get("trainjobs", ns, name)
        except ApiError:
            return
        st = job.setdefault("status", {})
        if jobs_status is None and any((c["type"], c["status"], c["reason"]) == (ctype, status, reason)
                                       for c in st.get("conditions") or []):
            return  # no change: no event (the controller would loop on its own updates)
        if ctype:
            conds = [c for c in st.get("conditions") or [] if c["type"] != ctype]
            st["conditions"] = conds + [{"type": ctype, "status": status, "reason": reason, "message": message,
                                         "lastTransitionTime": now_iso()}]
        if jobs_status is not None:
            st["jobsStatus"] = [{"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0,
                                 **jobs_status}]
        f.replace("trainjobs", ns, name, job, status_only=True, check_rv=False)

    def _kueue_workload(self, job: dict, queue: str, kind: str, api_version: str) -> None:
        """Kueue's job controller makes the job's Workload, with the priority of the job's
        WorkloadPriorityClass (label ``kueue.x-k8s.io/priority-class``). A class that does not
        exist stops it there: no Workload, an event on the job, and the job stays suspended."""
        f = self.fake
        ns, name, uid = job["metadata"]["namespace"], job["metadata"]["name"], job["metadata"]["uid"]
        spec = {"queueName": queue, "podSets": []}
        if pc := job["metadata"]["labels"].get("kueue.x-k8s.io/priority-class"):
            try:
                wpc = f.get("workloadpriorityclasses", None, pc)
            except ApiError:
                self._warn(ns, kind, name, uid, "WorkloadPriorityClassNotFound", f'WorkloadPriorityClass "{pc}" not found')
                return
            spec.update(priorityClassName=pc, priorityClassSource="kueue.x-k8s.io/workloadpriorityclass",
                        priority=wpc["value"])
        f.create("workloads", ns, {
            "metadata": {"name": f"{kind.lower()}-{name}-{uid[:5]}", "labels": {"kueue.x-k8s.io/job-uid": uid},
                         "ownerReferences": [{"apiVersion": api_version, "kind": kind,
                                              "name": name, "uid": uid, "controller": True}]},
            "spec": spec,
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": self.kueue_pending, "lastTransitionTime": now_iso()}]}},
            "kueue.x-k8s.io/v1beta1")

    def _storage_uri(self, predictor: dict) -> str | None:
        """Where KServe's storage initializer fetches the model from, found as KServe finds it:
        the model spec's storageUri, storageUris (0.16 on), or a custom predictor's STORAGE_URI
        env on its kserve-container."""
        if uri := (predictor.get("model") or {}).get("storageUri"):
            return uri
        if self.kserve_storage_uris and predictor.get("storageUris"):
            return predictor["storageUris"][0]["uri"]
        for c in predictor.get("containers") or []:
            if c.get("name") == "kserve-container":
                return next((e.get("value") for e in c.get("env") or [] if e["name"] == "STORAGE_URI"), None)
        return None

    def _isvc_ready(self, ns, name, generation, ready: bool = True) -> None:
        f = self.fake
        try:
            isvc = f.get("inferenceservices", ns, name)
        except ApiError:
            return
        if ready:
            conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": now_iso()},
                          {"type": "PredictorReady", "status": "True", "lastTransitionTime": now_iso()}]
        else:  # no model was fetched: the predictor finds /mnt/models empty and crash-loops
            why = {"status": "False", "reason": "CrashLoopBackOff", "lastTransitionTime": now_iso(),
                   "message": "back-off restarting failed container kserve-container"}
            conditions = [{"type": "Ready", **why}, {"type": "PredictorReady", **why}]
        isvc["status"] = {"url": f"http://{name}.{ns}.{self.isvc_domain}",
                          "address": {"url": self.isvc_address or f"http://{name}.{ns}.svc.cluster.local"},
                          "observedGeneration": generation, "conditions": conditions}
        f.replace("inferenceservices", ns, name, isvc, status_only=True, check_rv=False)

    def _set_job(self, ns, name, ctype, reason, message) -> None:
        f = self.fake
        try:
            job = f.get("pytorchjobs", ns, name)
        except ApiError:
            return
        st = job.setdefault("status", {})
        conds = st.setdefault("conditions", [])
        if conds and conds[-1]["type"] == ctype:
            return
        conds[:] = [c for c in conds if c["type"] != ctype]  # one condition per type, as the operator keeps them
        for c in conds:
            c["status"] = "False"
        conds.append({"type": ctype, "status": "True", "reason": reason, "message": message,
                      "lastUpdateTime": now_iso(), "lastTransitionTime": now_iso()})
        f.replace("pytorchjobs", ns, name, job, status_only=True, check_rv=False)

    def _reconcile_job(self, ns, name) -> None:
        f = self.fake
        pods = f.list("pods", ns, f"training.kubeflow.org/job-name={name}")
        phases = {p["metadata"]["name"]: p.get("status", {}).get("phase") for p in pods}
        master = [p for p in pods if p["metadata"]["labels"]["training.kubeflow.org/replica-type"] == "master"]
        failed = [p for p in pods if p.get("status", {}).get("phase") == "Failed"]
        if failed:
            p = failed[0]
            term = (p["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("terminated", {})
            rtype = p["metadata"]["labels"]["training.kubeflow.org/replica-type"]
            self._set_job(ns, name, "Failed", "PyTorchJobFailed",
                          f"PyTorchJob {name} is failed because 1 {rtype.capitalize()} replica(s) failed. "
                          f"{p['metadata']['name']}: {term.get('reason', 'Error')}")
        elif master and master[0].get("status", {}).get("phase") == "Succeeded":
            self._set_job(ns, name, "Succeeded", "PyTorchJobSucceeded", f"PyTorchJob {name} is successfully completed.")
        elif pods and all(ph == "Running" for ph in phases.values()):
            self._set_job(ns, name, "Running", "PyTorchJobRunning", f"PyTorchJob {name} is running.")


# ---- HTTP ------------------------------------------------------------------------------------------
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeCluster
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        return json.loads(self._raw or b"{}") if self._raw else {}

    def _route(self, verb: str):
        # Always consume the request body first: an early error reply must not leave bytes on a
        # keep-alive connection for the next request to trip over.
        n = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(n) if n else b""
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        path = url.path.rstrip("/")
        if path in ("/api", "/apis", "/version"):
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]} if path == "/api" else
                              {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"})
        m = _PATH.match(path)
        if not m:
            return self._send(404, ApiError(404, "NotFound", "the server could not find the requested resource").status())
        g = m.groupdict()
        group, version = (g["group"], g["version"]) if g["group"] else ("", "v1")
        plural, ns, name, sub = g["plural"], g["ns"], g["name"], g["sub"]
        api_version = f"{group}/{version}" if group else "v1"
        f = self.fake
        if group and (group in f.missing_groups or (group, version) not in GROUPS or plural not in GROUPS[(group, version)]):
            return self._send(404, ApiError(404, "NotFound", "the server could not find the requested resource").status())
        if not group and plural not in CORE:
            return self._send(404, ApiError(404, "NotFound", "the server could not find the requested resource").status())
        watch = str(q.get("watch", "")).lower() in ("true", "1")
        kverb = {"GET": "watch" if watch else ("get" if name else "list"), "POST": "create", "PUT": "update",
                 "PATCH": "patch", "DELETE": "delete"}[verb]
        resource = f"{plural}/{sub}" if sub else plural
        f.requests.append((kverb, resource))
        if (kverb, resource) in f.stalled or (kverb, plural) in f.stalled:
            f.unstall.wait(600)
            self.close_connection = True
            return
        if (kverb, resource) in f.denied or (kverb, plural) in f.denied:
            msg = (f'{resource} is forbidden: User "system:serviceaccount:{ns or "default"}:pipeline-runner" cannot '
                   f'{kverb} resource "{plural}" in API group "{group}"'
                   + (f' in the namespace "{ns}"' if ns else ""))
            return self._send(403, ApiError(403, "Forbidden", msg).status())
        try:
            if verb == "GET":
                if sub == "log":
                    return self._logs(ns, name, q)
                if name:
                    return self._send(200, f.get(plural, ns, name))
                if watch:
                    return self._watch(plural, ns, q)
                items = f.list(plural, ns, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                return self._send(200, {"kind": KINDS[plural] + "List", "apiVersion": api_version,
                                        "metadata": {"resourceVersion": str(f.rv)}, "items": items})
            if verb == "POST":
                body = self._body()
                if sub == "binding":
                    return self._send(201, f.bind(ns, name, body))
                return self._send(201, f.create(plural, ns, body, api_version))
            if verb == "PUT":
                return self._send(200, f.replace(plural, ns, name, self._body(), status_only=sub == "status"))
            if verb == "PATCH":
                return self._send(200, f.patch(plural, ns, name, self._body(), self.headers.get("Content-Type", ""),
                                               status_only=sub == "status"))
            if verb == "DELETE":
                return self._send(200, f.delete(plural, ns, name))
        except ApiError as e:
            return self._send(e.code, e.status())
        except (ValueError, KeyError, TypeError) as e:
            return self._send(400, ApiError(400, "BadRequest", f"bad request: {e}").status())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, plural: str, ns: str | None, q: dict) -> None:
        f = self.fake
        since = int(q.get("resourceVersion") or 0)
        timeout = float(q.get("timeoutSeconds") or 300)
        sel, fsel = q.get("labelSelector", ""), q.get("fieldSelector", "")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with f.lock:
            fault = f.watch_faults.pop(0) if f.watch_faults else None
        if fault == "drop":
            self.wfile.write(b"40\r\n{\"type\": \"MODIFIED\"")  # a chunk cut short, then the socket closes
            self.wfile.flush()
            self.close_connection = True
            return
        if fault == "stall":
            f.unstall.wait(600)
            self.close_connection = True
            return
        deadline = time.monotonic() + timeout
        with f.cond:
            if since and f.events and since < f.events[0][0] - 1:
                self._chunk(json.dumps({"type": "ERROR", "object": ApiError(
                    410, "Expired", f"too old resource version: {since} ({f.events[0][0]})").status()}).encode() + b"\n")
                self._chunk(b"")
                return
            if not since:  # a watch without RV starts with the current state, as ADDED events
                for obj in f.list(plural, ns, sel, fsel):
                    self._chunk(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
                since = f.rv
            try:
                while time.monotonic() < deadline and f.server is not None:
                    pending = [e for e in f.events if e[0] > since and e[1] == plural]
                    for rv, _, kind, obj in pending:
                        since = rv
                        if ns and obj["metadata"].get("namespace") != ns:
                            continue
                        if not (_match_labels(sel, obj["metadata"].get("labels") or {}) and _match_fields(fsel, obj, plural)):
                            continue
                        self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    if pending:
                        since = max(since, pending[-1][0])
                    f.cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError):
                return

    def _logs(self, ns: str, name: str, q: dict) -> None:
        f = self.fake
        pod = f.get("pods", ns, name)
        names = [c["name"] for c in pod["spec"].get("containers", [])]
        container = q.get("container")
        if container is None and len(names) > 1:  # the API server's rule: name one of several
            raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: "
                                              f"[{' '.join(names)}]")
        if container is not None and container not in names:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if container is not None and container != names[0]:  # a sidecar's log: not the one the test writes
            return reply(self, 200, b"", "text/plain")
        follow = str(q.get("follow", "")).lower() in ("true", "1")
        tail = int(q["tailLines"]) if "tailLines" in q else None
        if not follow:
            lines = f.logs.get((ns, name), [])
            return reply(self, 200, "".join(lines[-tail:] if tail else lines).encode(), "text/plain")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = max(0, len(f.logs.get((ns, name), [])) - tail) if tail is not None else 0
        epoch = f.log_epochs.get((ns, name), 0)
        try:
            with f.cond:
                while f.server is not None and f.log_epochs.get((ns, name), 0) == epoch:
                    lines = f.logs.get((ns, name), [])
                    for line in lines[sent:]:
                        self._chunk(line.encode())
                    sent = len(lines)
                    try:
                        phase = f.get("pods", ns, name).get("status", {}).get("phase")
                    except ApiError:
                        break
                    if phase in ("Succeeded", "Failed"):
                        break
                    f.cond.wait(timeout=0.5)
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    def do_PATCH(self):
        self._route("PATCH")

    def do_DELETE(self):
        self._route("DELETE")
