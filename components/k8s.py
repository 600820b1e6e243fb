"""The one edge to Kubernetes: the official ``kubernetes`` client, and our typed errors.

- 403 -> :class:`KubernetesForbidden` naming the verb, resource and API group to grant.
- 404 on a CRD's group -> :class:`CrdNotInstalled` ("Training Operator is not installed", how to install).
- 409 on create -> adopt the existing object if it carries our run/task labels (idempotent retries).

Everything else about jobs (what to build, what a condition means) lives in pure modules.
"""
import json
import threading

from .errors import CrdNotInstalled, KubernetesError, KubernetesForbidden, KubernetesUnavailable

INSTALL_HINTS = {
    "kubeflow.org": ("the Kubeflow Training Operator (PyTorchJob, kubeflow.org/v1)",
                     'kubectl apply --server-side -k "github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref=v1.9.4"'),
    "trainer.kubeflow.org": ("Kubeflow Trainer v2 (TrainJob, trainer.kubeflow.org/v1alpha1)",
                             'kubectl apply --server-side -k "github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0"'),
    "serving.kserve.io": ("KServe (InferenceService, serving.kserve.io/v1beta1)",
                          "install KServe v0.20 (RawDeployment mode): see kserve.github.io/website, 'Quickstart'"),
}
PLURALS = {"PyTorchJob": "pytorchjobs", "TrainJob": "trainjobs", "InferenceService": "inferenceservices"}


def _message(e) -> str:
    try:
        return json.loads(e.body).get("message", "") if e.body else str(e.reason)
    except (ValueError, TypeError):
        return str(e.body or e.reason)


def map_api_error(e, verb: str, resource: str, group: str = "", namespace: str | None = None):
    """ApiException -> our typed error (or the exception itself when nothing better applies)."""
    status = getattr(e, "status", None)
    where = f" in namespace {namespace!r}" if namespace else ""
    if status == 403:
        return KubernetesForbidden(
            f"forbidden: cannot {verb} {resource}{where} ({_message(e)})",
            f"grant the pipeline's service account a Role with apiGroups: [\"{group}\"], resources: [\"{resource}\"], "
            f"verbs: [\"{verb}\"] (kustomize/ has one), or ask your cluster admin")
    if status == 404 and group in INSTALL_HINTS and verb in ("create", "list", "watch"):
        what, how = INSTALL_HINTS[group]
        name = what.split(" (")[0]
        return CrdNotInstalled(f"{name} is not installed: the cluster does not serve {group} ({what})", f"install it: {how}")
    if status == 401:
        return KubernetesError("the Kubernetes API rejected the credentials (401)",
                               "check the kubeconfig context or the pod's service-account token")
    return KubernetesError(f"Kubernetes API error on {verb} {resource}{where}: {status} {_message(e)}")


def unavailable(e: Exception, verb: str, resource: str, namespace: str | None = None) -> KubernetesUnavailable:
    """A connection-level failure (urllib3: refused, reset, broken mid-stream, timed out) -> our error."""
    reason = getattr(e, "reason", None) or e
    where = f" in namespace {namespace!r}" if namespace else ""
    return KubernetesUnavailable(f"the Kubernetes API did not answer: {verb} {resource}{where} ({type(reason).__name__})",
                                 "check that the API server is up and reachable from here")


class Kube:
    """Thin facade over the official client; counts API calls (for the watcher benchmark).

    A watch asks the server to end it within ``watch_window_s`` and reads it with a client-side
    timeout ``watch_slack_s`` longer. Without one, a connection that went silent (a load
    balancer dropping an idle connection, a half-open socket after an API server restart) blocks
    the read for ever: the server-side ``timeoutSeconds`` alone cannot end a stream that no
    longer reaches us (kubernetes-client/python's known hanging watch).

    Every other call has ``request_timeout_s`` to be answered (the client sets no timeout of its
    own, so a create or get sent to an API server that accepts and never answers hung the step);
    one that times out is a :class:`KubernetesUnavailable`, as a refused connection is."""

    def __init__(self, api_client=None, watch_window_s: float = 300.0, watch_slack_s: float = 30.0,
                 request_timeout_s: float = 60.0):
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    import os

                    # Read KUBECONFIG now: the client library reads it once, at import time.
                    config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
                except (config.ConfigException, FileNotFoundError) as e:
                    raise KubernetesError("no Kubernetes configuration found",
                                          "run inside a cluster, or set KUBECONFIG / ~/.kube/config") from e
            api_client = client.ApiClient()
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.calls = 0
        self._lock = threading.Lock()
        self.watch_window_s, self.watch_slack_s = watch_window_s, watch_slack_s
        self.request_timeout = (min(10.0, request_timeout_s), request_timeout_s)

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def _call(self, verb, resource, group, namespace, fn, *args, ok: tuple[int, ...] = (), **kw):
        """One counted API call with our typed errors; a status in ``ok`` returns None instead."""
        import urllib3
        from kubernetes.client.rest import ApiException

        self._count()
        kw.setdefault("_request_timeout", self.request_timeout)
        try:
            return fn(*args, **kw)
        except ApiException as e:
            if e.status in ok:
                return None
            raise map_api_error(e, verb, resource, group, namespace) from e
        except urllib3.exceptions.HTTPError as e:
            raise unavailable(e, verb, resource, namespace) from e

    # -- custom objects --------------------------------------------------------------------------
    @staticmethod
    def gvp(obj: dict) -> tuple[str, str, str]:
        group, version = obj["apiVersion"].split("/")
        return group, version, PLURALS[obj["kind"]]

    def create_or_adopt(self, obj: dict, match_labels: dict) -> tuple[dict, bool]:
        """Create; if it exists and carries ``match_labels``, adopt it (a retried task), else refuse."""
        group, version, plural = self.gvp(obj)
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        created = self._call("create", plural, group, ns, self.custom.create_namespaced_custom_object,
                             group, version, ns, plural, obj, ok=(409,))
        if created is not None:
            return created, False
        existing = self.get(group, version, plural, ns, name)
        labels = existing["metadata"].get("labels") or {}
        if any(labels.get(k) != v for k, v in match_labels.items()):
            raise KubernetesError(f"{obj['kind']} {ns}/{name} exists but belongs to another run or task",
                                  "delete it, or use another run")
        return existing, True

    def get(self, group, version, plural, ns, name) -> dict:
        return self._call("get", plural, group, ns, self.custom.get_namespaced_custom_object, group, version, ns, plural, name)

    def list(self, group, version, plural, ns, label_selector: str = "") -> list[dict]:
        return self._call("list", plural, group, ns, self.custom.list_namespaced_custom_object, group, version, ns,
                          plural, label_selector=label_selector)["items"]

    def delete(self, group, version, plural, ns, name, foreground: bool = False) -> None:
        """Delete (a 404 is fine). ``foreground``: the object stays, being deleted, until its pods are
        gone, so that a job of the same name created after :meth:`wait_gone` meets no old pods."""
        self._call("delete", plural, group, ns, self.custom.delete_namespaced_custom_object, group, version, ns,
                   plural, name, propagation_policy="Foreground" if foreground else None, ok=(404,))

    def wait_gone(self, group, version, plural, ns, name, timeout: float = 300.0) -> bool:
        """Poll until the object is gone (404); False if it is still there after ``timeout``."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            if self._call("get", plural, group, ns, self.custom.get_namespaced_custom_object,
                          group, version, ns, plural, name, ok=(404,)) is None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def patch(self, group, version, plural, ns, name, body: dict) -> dict:
        return self._call("patch", plural, group, ns, self.custom.patch_namespaced_custom_object,
                          group, version, ns, plural, name, body)

    def watch(self, group, version, plural, ns, name, resource_version: str, timeout: float):
        """Yield (type, object) for one object from ``resource_version``, for at most ``timeout``
        (and the watch window); raises 410 as ``Expired``, a broken or silent connection as
        ``KubernetesUnavailable``. Callers re-watch from the last resourceVersion they saw."""
        import urllib3
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        self._count()
        w = watch.Watch()
        window = max(1, int(min(timeout, self.watch_window_s)))
        try:
            for ev in w.stream(self.custom.list_namespaced_custom_object, group, version, ns, plural,
                               field_selector=f"metadata.name={name}", resource_version=resource_version,
                               timeout_seconds=window, _request_timeout=(10, window + self.watch_slack_s)):
                yield ev["type"], ev["object"]
        except ApiException as e:
            if e.status == 410:
                raise Expired() from e
            raise map_api_error(e, "watch", plural, group, ns) from e
        except urllib3.exceptions.HTTPError as e:
            raise unavailable(e, "watch", plural, ns) from e
        finally:
            w.stop()

    # -- pods ------------------------------------------------------------------------------------
    def pods(self, ns: str, selector: str) -> list:
        return self._call("list", "pods", "", ns, self.core.list_namespaced_pod, ns, label_selector=selector).items

    def pod(self, ns: str, name: str):
        return self._call("get", "pods", "", ns, self.core.read_namespaced_pod, name, ns)

    def events(self, ns: str, field_selector: str = "") -> list:
        return self._call("list", "events", "", ns, self.core.list_namespaced_event, ns,
                          field_selector=field_selector).items

    def log_tail(self, ns: str, pod: str, lines: int = 20, container: str | None = None) -> str:
        """The last ``lines`` of the pod's log ("" when it cannot be read); ``container`` names
        the container, which the API requires of a pod with more than one (a sidecar's)."""
        kw = {"container": container} if container else {}
        try:
            return self._call("get", "pods/log", "", ns, self.core.read_namespaced_pod_log, pod, ns, tail_lines=lines,
                              **kw)
        except KubernetesError:
            return ""

    def follow_log(self, ns: str, pod: str, tail_lines: int | None = None, container: str | None = None):
        """Yield the pod's log lines as they come (until the container ends); with ``tail_lines``,
        from that many lines back, not from the start; ``container`` as for :meth:`log_tail`."""
        self._count()
        kw = {"tail_lines": tail_lines} if tail_lines is not None else {}
        if container:
            kw["container"] = container
        from kubernetes.client.rest import ApiException

        try:
            resp = self.core.read_namespaced_pod_log(pod, ns, follow=True, _preload_content=False, **kw)
        except ApiException as e:  # e.g. no right to read pods/log: say so, not "ApiException"
            raise map_api_error(e, "get", "pods/log", "", ns) from e
        try:
            buf = b""
            for chunk in resp.stream(1024):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    yield line.decode(errors="replace")
            if buf:
                yield buf.decode(errors="replace")
        finally:
            resp.release_conn()


class Expired(Exception):
    """A watch's resourceVersion fell out of the server's history (410 Gone): re-list, re-watch."""
