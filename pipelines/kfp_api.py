"""The one edge to the KFP API (``kfp.Client``): upload, run, follow, schedule, list.

Reachability and authentication are checked first with one short request, so an unreachable
or auth-protected host gets a clear error in seconds (``kfp.Client`` itself retries for ~25 s).
"""
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import requests

from kfp_pytorch.components.errors import KfpPytorchError, TemporaryError, untrusted_certificate

from .registry import PipelineEntry

TERMINAL = {"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "CANCELING"}
RETRYABLE = {"FAILED", "CANCELED"}
"""The states KFP retries a run in (its Argo workflow Failed or Error: a terminated run's is Failed)."""


class KfpApiError(KfpPytorchError):
    exit_code = 3


class KfpApiUnavailable(KfpApiError, TemporaryError):
    """The API did not answer, or its gateway said it is down for now (HTTP 502/503/504):
    a port-forward that dropped, an ml-pipeline pod that restarts. Worth retrying."""


GATEWAY_DOWN = (502, 503, 504)


def projected_token() -> tuple[str | None, str]:
    """The token kfp.Client uses by itself when none is given: the projected service-account token
    a Kubeflow notebook gets (PodDefault "access-ml-pipeline"), at $KF_PIPELINES_SA_TOKEN_PATH or
    /var/run/secrets/kubeflow/pipelines/token; (None, path) when there is none."""
    import os

    from kfp.client import KF_PIPELINES_SA_TOKEN_ENV, KF_PIPELINES_SA_TOKEN_PATH

    path = os.environ.get(KF_PIPELINES_SA_TOKEN_ENV) or KF_PIPELINES_SA_TOKEN_PATH
    try:
        return Path(path).read_text().strip() or None, path
    except OSError:  # not in a Kubeflow notebook: no such file
        return None, path


def _check_host(host: str, token: str | None, source: str = "--token / KF_PIPELINES_TOKEN",
                ca_cert: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = requests.get(f"{host.rstrip('/')}/apis/v2beta1/healthz", headers=headers, timeout=5, allow_redirects=False,
                         verify=ca_cert or True)
    except requests.exceptions.SSLError as e:
        raise KfpApiError(untrusted_certificate(f"the KFP API at {host}", e),
                          "pass --ca-cert (or set KF_PIPELINES_CA_CERT) with the PEM file of the CA that signed it") from e
    except requests.RequestException as e:
        raise KfpApiError(f"cannot reach the KFP API at {host} ({type(e).__name__})",
                          "check --host (e.g. kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80, then "
                          "--host http://127.0.0.1:8080)") from e
    if r.status_code in (401, 403) or (300 <= r.status_code < 400 and "oauth" in r.headers.get("Location", "") + r.text):
        sent = f"; it refused {source}" if token else ""
        raise KfpApiError(f"the KFP API at {host} requires authentication (HTTP {r.status_code}){sent}",
                          "pass --token or set KF_PIPELINES_TOKEN (a service-account token with access to the "
                          "namespace); in a Kubeflow notebook, enable the PodDefault 'Allow access to Kubeflow "
                          "Pipelines', which projects one")


def _bound_requests(api_client, timeout: tuple[float, float]) -> None:
    """Give every request of ``api_client`` (the one kfp.Client's APIs share) a default timeout.

    kfp.Client sets none and its methods take none, so a KFP API that accepts the connection and
    never answers (a port-forward whose tunnel died, an API server stuck on its database) hung
    ``runs``, ``schedule`` or an upload for ever. The generated client builds its REST client from
    its Configuration; this one is the same but for a default ``_request_timeout`` (a call that
    passes its own, as following a run does, keeps it)."""
    from kfp_server_api.rest import RESTClientObject

    class _Bounded(RESTClientObject):
        def request(self, *a, _request_timeout=None, **kw):
            return super().request(*a, _request_timeout=_request_timeout or timeout, **kw)

    api_client.rest_client = _Bounded(api_client.configuration)


class KfpApi:
    def __init__(self, host: str, namespace: str | None = None, token: str | None = None,
                 request_timeout_s: float = 60.0, ca_cert: str | None = None):
        """``ca_cert``: the PEM file of the CA that signed an https endpoint's certificate (an
        on-prem Kubeflow behind the company's CA)."""
        import warnings

        import kfp

        with warnings.catch_warnings():  # kfp.Client warns on every construction that it needs KFP >= 2.0.0-beta.2,
            # a line of noise on each command; a KFP v1 server answers the v2beta1 calls with an HTTP 404 that
            # _call reports with the call that failed
            warnings.filterwarnings("ignore", message="This client only works with Kubeflow Pipeline", category=FutureWarning)
            self._connect(kfp, host, namespace, token, ca_cert)
        _bound_requests(self.client.runs.api_client, (min(10.0, request_timeout_s), request_timeout_s))
        self.host = host
        self.namespace = namespace

    def _connect(self, kfp, host: str, namespace: str | None, token: str | None, ca_cert: str | None) -> None:
        if token:
            _check_host(host, token, ca_cert=ca_cert)
            self.client = kfp.Client(host=host, namespace=namespace or "", existing_token=token, ssl_ca_cert=ca_cert)
        else:
            # In a Kubeflow notebook the token is a projected file the kubelet rotates (about
            # hourly). kfp.Client reads it by itself only when no host is given, so with --host
            # it sent none; its credentials hook re-reads the file for each request, so a run
            # followed for hours keeps a valid token.
            from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

            projected, path = projected_token()
            _check_host(host, projected, f"the projected service-account token {path}", ca_cert)
            self.client = kfp.Client(host=host, namespace=namespace or "", ssl_ca_cert=ca_cert, credentials=(
                ServiceAccountTokenVolumeCredentials(path) if projected else None))

    def _call(self, what: str, fn, *a, **kw):
        import kfp_server_api

        import urllib3

        try:
            # kfp.Client prints "Pipeline/Experiment/Run details: LINK" on stdout outside a notebook:
            # on stderr, stdout stays what this tool says (a script reads the run id from it)
            with contextlib.redirect_stdout(sys.stderr):
                return fn(*a, **kw)
        except kfp_server_api.ApiException as e:
            if e.status in (401, 403):
                raise KfpApiError(f"{what}: the KFP API refused the request (HTTP {e.status})",
                                  "pass --token or set KF_PIPELINES_TOKEN; check your access to the namespace") from e
            msg = e.body.decode(errors="replace") if isinstance(e.body, bytes) else (e.body or e.reason)
            kind = KfpApiUnavailable if e.status in GATEWAY_DOWN else KfpApiError
            raise kind(f"{what} failed: HTTP {e.status}: {str(msg).strip()[:300]}") from e
        except urllib3.exceptions.HTTPError as e:  # refused, reset or timed out: kfp_server_api speaks urllib3
            reason = getattr(e, "reason", None) or e
            raise KfpApiUnavailable(f"{what}: the KFP API at {self.host} did not answer ({type(reason).__name__})",
                                    "check that it is up and that a port-forward to it still runs") from e

    def upload(self, entry: PipelineEntry) -> tuple[str, str]:
        """Upload the compiled pipeline; returns (pipeline_id, version_id).

        A version is named by its content (``NAME-<sha256 of the compiled spec, 12 hex>``): the same
        spec reuses its version, and a changed one (code, platform file) gets a new one. KFP refuses
        a second version of the same name, so time-stamped names collided for submissions within
        one second, and every submission added a version."""
        import hashlib
        import json

        from kfp import compiler

        from ..components._kfp import check_component_image

        check_component_image()
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / f"{entry.name}.yaml")
            compiler.Compiler().compile(entry.func, package_path=path)
            name = entry.func.pipeline_spec.pipeline_info.name
            version_name = f"{name}-{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]}"
            pid = self._call("look up pipeline", self.client.get_pipeline_id, name)
            if pid is None:
                p = self._call("upload pipeline", self.client.upload_pipeline, path, pipeline_name=name,
                               namespace=self.namespace)
                pid = p.pipeline_id
                versions = self._call("list versions", self.client.list_pipeline_versions, pid)
                return pid, versions.pipeline_versions[0].pipeline_version_id

            def existing() -> str | None:
                flt = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name",
                                                  "string_value": version_name}]})
                found = self._call("list versions", self.client.list_pipeline_versions, pid, filter=flt)
                return next((v.pipeline_version_id for v in found.pipeline_versions or []
                             if v.display_name == version_name), None)

            if vid := existing():
                return pid, vid
            try:
                v = self._call("upload pipeline version", self.client.upload_pipeline_version, path,
                               pipeline_version_name=version_name, pipeline_id=pid)
            except KfpApiError:
                if vid := existing():  # uploaded at the same moment by another submission
                    return pid, vid
                raise
            return pid, v.pipeline_version_id

    def find_experiment(self, name: str) -> str | None:
        """The experiment's id, or None when there is none of that name (nothing is created). Only
        absence is None: a refused or failed lookup raises, where it was taken for "no experiment"
        and the create that followed failed with a misleading error (or made a second one)."""
        try:
            return self._call("look up experiment", self.client.get_experiment, experiment_name=name,
                              namespace=self.namespace).experiment_id
        except ValueError:  # kfp.Client: "No experiment is found with name ..."
            return None

    def experiment_names(self) -> list[str]:
        resp = self._call("list experiments", self.client.list_experiments, namespace=self.namespace, page_size=100)
        return sorted(e.display_name for e in resp.experiments or [])

    def experiment_id(self, name: str) -> str:
        """The experiment's id, created when missing (what submit and schedule need)."""
        eid = self.find_experiment(name)
        if eid is None:
            eid = self._call("create experiment", self.client.create_experiment, name,
                             namespace=self.namespace).experiment_id
        return eid

    def submit(self, entry: PipelineEntry, params: dict, experiment: str, run_name: str | None = None) -> str:
        pid, vid = self.upload(entry)
        eid = self.experiment_id(experiment)
        run = self._call("create run", self.client.run_pipeline, experiment_id=eid,
                         job_name=run_name or f"{entry.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                         pipeline_id=pid, version_id=vid, params=params)
        return run.run_id

    def run_or_error(self, run_id: str):
        """The run ``run_id``, or an error that says there is none (KFP answers 404, or 400 or 500
        for an id that is not a UUID, depending on its version and database)."""
        try:
            return self._call("get run", self.client.runs.run_service_get_run, run_id=run_id)
        except KfpApiError as e:
            status, body = getattr(e.__cause__, "status", None), str(getattr(e.__cause__, "body", "")).lower()
            if status in (400, 404) or (status == 500 and "not found" in body):
                raise KfpApiError(f"the KFP API at {self.host} has no run {run_id!r}",
                                  f"`kfp-pytorch runs --host {self.host}` lists the runs and their ids") from e
            raise

    def cancel(self, run_id: str) -> tuple[bool, str]:
        """Terminate the run as the KFP UI's Terminate does (KFP stops its pods; the run goes to
        CANCELING, then CANCELED). Returns whether this call asked for it, and the run's state after;
        a run that already ended is left as it is."""
        state = str(self.run_or_error(run_id).state)
        if state in TERMINAL:
            return False, state
        self._call("terminate run", self.client.terminate_run, run_id)
        return True, str(self._call("get run", self.client.runs.run_service_get_run, run_id=run_id).state)

    def retry(self, run_id: str) -> str:
        """Retry a FAILED or CANCELED run as the KFP UI's Retry does: KFP runs its failed and stopped
        steps again, in the same run, and not the steps that succeeded. A step's outputs keep their
        URIs, so a train step trains on from its last checkpoint. Returns the run's state after; an
        error that says what to do for a run that cannot be retried (running, succeeded, archived)."""
        run = self.run_or_error(run_id)
        state = str(run.state)
        if str(getattr(run, "storage_state", "") or "") == "ARCHIVED":  # the API server refuses it
            raise KfpApiError(f"run {run_id} is archived: KFP retries no archived run",
                              "restore it in the KFP UI (Runs, Archived, Restore) and retry it again")
        if state not in RETRYABLE:
            raise KfpApiError(f"run {run_id} is {state}: only a FAILED or CANCELED run is retried",
                              "`kfp-pytorch submit` starts a new run" if state in ("SUCCEEDED", "SKIPPED") else
                              f"`kfp-pytorch follow {run_id}` follows it; `kfp-pytorch cancel {run_id}` stops it")
        self._call("retry run", self.client.runs.run_service_retry_run, run_id=run_id)
        return str(self._call("get run", self.client.runs.run_service_get_run, run_id=run_id).state)

    def follow(self, run_id: str, timeout_s: float = 24 * 3600, interval: float = 2.0, out=None,
               outage_s: float = 300.0, request_timeout_s: float = 30.0) -> str:
        """Show the run's state as it changes, until it ends; returns the final state (the last
        run read is kept in :attr:`last_run`).

        The run goes on on the server whatever happens here, so an API that stops answering (a
        port-forward that drops, an API server pod that restarts) is waited for, with backoff, for
        up to ``outage_s``; only then does following stop, with the run's URL to go on with.

        Each read of the run has ``request_timeout_s`` to be answered. kfp.Client sets no timeout,
        so a port-forward whose tunnel died (the local port still accepts, nothing answers) hung
        following for ever; a read that times out now counts as an outage like a refused one.
        The generated API that kfp.Client exposes (``client.runs``) takes ``_request_timeout``."""
        out = out or sys.stderr
        t0, last, down_since, tries = time.monotonic(), None, None, 0

        def stamp() -> str:
            return f"[{time.monotonic() - t0:7.1f}s]"

        while True:
            try:
                run = self._call("get run", self.client.runs.run_service_get_run, run_id=run_id,
                                 _request_timeout=(min(10.0, request_timeout_s), request_timeout_s))
            except KfpApiUnavailable as e:
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                    out.write(f"{stamp()} lost the KFP API: {e.message}; retrying for up to {outage_s:.0f} s "
                              f"(the run goes on on the server)\n")
                    out.flush()
                if now - down_since >= outage_s or now - t0 > timeout_s:
                    raise KfpApiUnavailable(
                        f"stopped following run {run_id}: the KFP API at {self.host} has not answered for "
                        f"{now - down_since:.0f} s ({e.message})",
                        f"the run goes on on the server: see {self.host.rstrip('/')}/#/runs/details/{run_id}, "
                        f"or `kfp-pytorch follow {run_id} --host {self.host}` once the API is back") from e
                tries += 1
                time.sleep(min(interval * 2 ** min(tries - 1, 5), 30.0, max(outage_s - (now - down_since), 0.05)))
                continue
            if down_since is not None:
                out.write(f"{stamp()} the KFP API answers again after {time.monotonic() - down_since:.0f} s\n")
                down_since, tries = None, 0
            self.last_run = run
            state = str(run.state)
            if state != last:
                out.write(f"{stamp()} run {run_id}: {state}\n")
                out.flush()
                last = state
            if state in TERMINAL or time.monotonic() - t0 > timeout_s:
                return state
            time.sleep(interval)

    @staticmethod
    def failure_lines(run) -> list[str]:
        """What a failed run says about why: the run's error and each failed task's, by name."""
        lines = []
        if run is None:
            return lines
        if getattr(run, "error", None) is not None and run.error.message:
            lines.append(f"error: {run.error.message}")
        details = getattr(run, "run_details", None)
        for task in (details.task_details if details is not None else None) or []:
            if str(task.state) == "FAILED":
                why = task.error.message if task.error is not None and task.error.message else ""
                lines.append(f"failed task: {task.display_name}" + (f": {why}" if why else ""))
        return lines

    def recurring_runs_named(self, name: str, experiment: str) -> list:
        """The experiment's recurring runs called ``name`` (none when the experiment does not exist)."""
        import json

        eid = self.find_experiment(experiment)
        if eid is None:
            return []
        flt = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "string_value": name}]})
        resp = self._call("list recurring runs", self.client.list_recurring_runs, experiment_id=eid, page_size=100,
                          filter=flt)
        return [rr for rr in resp.recurring_runs or [] if rr.display_name == name]

    def schedule(self, entry: PipelineEntry, params: dict, cron: str, experiment: str, name: str | None = None,
                 max_concurrency: int = 1, replace: bool = False, start_time: str | None = None,
                 end_time: str | None = None) -> tuple[str, list[str]]:
        """Create the recurring run; returns its id and the ids of those it replaced. A recurring run
        of the same name in the experiment is refused (re-running ``schedule`` after a change would
        otherwise start the pipeline twice per slot, kubeflow/pipelines#7435) unless ``replace``: then
        the new one is created first and the old ones deleted after, so a failure leaves a schedule."""
        name = name or f"{entry.name}-schedule"
        existing = self.recurring_runs_named(name, experiment)
        if existing and not replace:
            old = ", ".join(f"{rr.recurring_run_id} ({rr.status}, '{rr.trigger.cron_schedule.cron}')"
                            if rr.trigger and rr.trigger.cron_schedule else rr.recurring_run_id for rr in existing)
            raise KfpApiError(f"experiment {experiment!r} already has a recurring run named {name!r}: {old}",
                              "pass --replace to replace it with this one, or --name to add another beside it")
        pid, vid = self.upload(entry)
        eid = self.experiment_id(experiment)
        rr = self._call("create recurring run", self.client.create_recurring_run, experiment_id=eid,
                        job_name=name, cron_expression=cron, pipeline_id=pid,
                        version_id=vid, params=params, max_concurrency=max_concurrency, no_catchup=True,
                        start_time=start_time, end_time=end_time)
        for i, old in enumerate(existing):
            try:
                self._call(f"delete the replaced recurring run {old.recurring_run_id}",
                           self.client.delete_recurring_run, old.recurring_run_id)
            except KfpApiError as e:  # both now trigger: say which is which, and what is left to do
                left = [o.recurring_run_id for o in existing[i:]]
                raise type(e)(f"{e.message}\n  the new recurring run {rr.recurring_run_id} was created and is "
                              f"enabled; {len(left)} replaced one(s) still run beside it: {', '.join(left)}",
                              "delete or disable those in the KFP UI (Recurring runs), or run the same command "
                              "with --replace again once the API answers") from e
        return rr.recurring_run_id, [old.recurring_run_id for old in existing]

    def recurring_runs(self, experiment: str) -> list | None:
        """The experiment's recurring runs, oldest first; None when the experiment does not exist."""
        eid = self.find_experiment(experiment)
        if eid is None:
            return None
        out, token = [], ""
        while True:
            resp = self._call("list recurring runs", self.client.list_recurring_runs, experiment_id=eid,
                              namespace=self.namespace, page_size=100, page_token=token, sort_by="created_at")
            out += resp.recurring_runs or []
            token = resp.next_page_token or ""
            if not token:
                return out

    def _named_or_error(self, name: str, experiment: str) -> list:
        found = self.recurring_runs_named(name, experiment)
        if not found:
            known = sorted({rr.display_name for rr in self.recurring_runs(experiment) or []})
            raise KfpApiError(f"experiment {experiment!r} has no recurring run named {name!r}"
                              + (f" (it has: {', '.join(known)})" if known else " (it has none)"),
                              "`kfp-pytorch schedules` lists them; --experiment names another experiment")
        return found

    def unschedule(self, name: str, experiment: str) -> list[str]:
        """Delete the experiment's recurring runs called ``name``; returns their ids. Runs they
        started are left alone (they are runs like any other)."""
        found = self._named_or_error(name, experiment)
        for rr in found:
            self._call(f"delete recurring run {rr.recurring_run_id}", self.client.delete_recurring_run,
                       rr.recurring_run_id)
        return [rr.recurring_run_id for rr in found]

    def set_enabled(self, name: str, experiment: str, enabled: bool) -> list:
        """Pause (``enabled=False``) or resume the experiment's recurring runs called ``name``, as the
        KFP UI's Enable/Disable does; returns them as they are after. Runs already started go on."""
        found = self._named_or_error(name, experiment)
        action, call = (("enable", self.client.enable_recurring_run) if enabled
                        else ("disable", self.client.disable_recurring_run))
        for rr in found:
            self._call(f"{action} recurring run {rr.recurring_run_id}", call, rr.recurring_run_id)
        return [self._call(f"get recurring run {rr.recurring_run_id}", self.client.get_recurring_run,
                           rr.recurring_run_id) for rr in found]

    def runs(self, experiment: str | None = None, limit: int = 50) -> tuple[list, int] | None:
        """The newest ``limit`` runs (0: all), newest first, and how many there are; None when
        ``experiment`` does not exist (listing creates nothing). Pages through the API's list."""
        eid = None
        if experiment:
            eid = self.find_experiment(experiment)
            if eid is None:
                return None
        out: list = []
        token, total = "", 0
        while True:
            want = 100 if not limit else min(100, limit - len(out))
            resp = self._call("list runs", self.client.list_runs, experiment_id=eid, namespace=self.namespace,
                              page_size=want, page_token=token, sort_by="created_at desc")
            out += resp.runs or []
            total = max(total, resp.total_size or 0, len(out))
            token = resp.next_page_token or ""
            if not token or (limit and len(out) >= limit):
                return out, total
