"""Report training progress to Kubeflow Trainer: ``status.trainerStatus`` of the TrainJob.

With the Trainer's ``TrainJobProgress`` feature gate on (KEP-2779, kubeflow/trainer#3227), the
Trainer injects three variables into every container of a TrainJob's pods:

    KUBEFLOW_TRAINER_STATUS_URL      https://…/apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainjobs/NAME/status
    KUBEFLOW_TRAINER_STATUS_CA_CERT  the CA that signed its status server's certificate
    KUBEFLOW_TRAINER_STATUS_TOKEN    a projected ServiceAccount token (audience trainer.kubeflow.org)

and writes what the pods POST there (``{"trainerStatus": {...}}``) into the TrainJob's status:
``kubectl get trainjob`` then shows PROGRESS %, and the Kubeflow SDK, the dashboard and this
project's cluster step read the progress, the time left and the latest metrics. Without those
variables (a PyTorchJob, the local backend, the gate off) nothing is reported.

Written here rather than imported: the Kubeflow SDK's ``update_runtime_status`` is not in a
release yet (``kubeflow`` 0.5.0 has none), and the SDK would bring the Kubernetes client,
pydantic and the Katib API into every training image for one POST.

Training never waits for the Trainer: reports go from a background thread that sends the newest
one at most every ``min_interval_s`` (the SDK's 5 s throttle), so a slow or absent status server
costs the training loop nothing, and the last report (100 %) is always sent at the end.
"""
from __future__ import annotations

import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

ENV_URL, ENV_CA, ENV_TOKEN = "KUBEFLOW_TRAINER_STATUS_URL", "KUBEFLOW_TRAINER_STATUS_CA_CERT", "KUBEFLOW_TRAINER_STATUS_TOKEN"
METRIC_VALUE_MAX = 64
"""The CRD's maxLength for a metric's name and value (and at most 256 metrics)."""


def trainer_status(progress: float | None = None, remaining_s: float | None = None,
                   metrics: dict | None = None) -> dict:
    """The ``trainerStatus`` object the CRD defines: progressPercentage an int in [0, 100],
    estimatedRemainingSeconds an int >= 0, metrics as strings of at most 64 characters, and the
    lastUpdatedTime the API requires."""
    status: dict = {"lastUpdatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if progress is not None:
        status["progressPercentage"] = max(0, min(100, int(progress)))
    if remaining_s is not None:
        status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, round(remaining_s)))
    if metrics:
        status["metrics"] = [{"name": str(k)[:METRIC_VALUE_MAX],
                              "value": (f"{v:.6g}" if isinstance(v, float) else str(v))[:METRIC_VALUE_MAX]}
                             for k, v in list(metrics.items())[:256] if str(v)]
    return status


class TrainerStatusReporter:
    """Sends the newest progress to the Trainer's status server from a daemon thread.

    :meth:`update` never blocks and never raises; :meth:`close` sends the last report (waiting
    at most ``close_timeout_s``). A failure is said once on stderr, and training goes on."""

    def __init__(self, url: str, token_path: str | None, ca_file: str | None, min_interval_s: float = 5.0,
                 timeout_s: float = 5.0, err=None):
        self.url, self.token_path, self.min_interval_s, self.timeout_s = url, token_path, min_interval_s, timeout_s
        self.err = err or sys.stderr
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file and os.path.exists(ca_file) else None
        self.sent = 0
        self._cond = threading.Condition()
        self._pending: dict | None = None
        self._closing = False
        self._warned = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kfp-pytorch-trainer-status")
        self._thread.start()

    @classmethod
    def from_env(cls, env=None, **kw) -> TrainerStatusReporter | None:
        """A reporter when the Trainer asked for reports (its variables are set), else None."""
        env = os.environ if env is None else env
        url = env.get(ENV_URL)
        return cls(url, env.get(ENV_TOKEN), env.get(ENV_CA), **kw) if url else None

    def update(self, progress: float | None = None, remaining_s: float | None = None,
               metrics: dict | None = None) -> None:
        with self._cond:
            self._pending = trainer_status(progress, remaining_s, metrics)
            self._cond.notify()

    def close(self, close_timeout_s: float = 10.0) -> None:
        """Send what is pending now (not after the interval), then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(close_timeout_s)

    def _loop(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                # the throttle: coalesce what comes within the interval into the newest report
                while not self._closing and (wait := last + self.min_interval_s - time.monotonic()) > 0:
                    self._cond.wait(wait)
                status, self._pending = self._pending, None
                closing = self._closing
            if status is not None:
                last = time.monotonic()
                self._send(status)
            if closing:
                with self._cond:
                    if self._pending is None:
                        return

    def _send(self, status: dict) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_path:  # projected tokens rotate: read it for each report
                with open(self.token_path) as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            req = urllib.request.Request(self.url, data=json.dumps({"trainerStatus": status}).encode(),
                                         headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as resp:
                resp.read()
            self.sent += 1
        except urllib.error.HTTPError as e:  # the Trainer answers with a metav1.Status
            body = e.read().decode("utf-8", "replace").strip()
            try:
                body = json.loads(body).get("message") or body
            except (ValueError, AttributeError):
                pass
            self._warn(f"HTTP {e.code}: {str(body)[:300] or e.reason}")
        except (OSError, ValueError) as e:  # refused, timed out, TLS, an unreadable token file
            self._warn(str(getattr(e, "reason", None) or e))

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            self.err.write(f"[kfp-pytorch] could not report progress to the Trainer at {self.url} ({why}); training "
                           "goes on, and its progress shows in its log only\n")
            self.err.flush()
