"""Typed, actionable errors shared by every kfp-pytorch module.

Each error says what is wrong and what to do next (``hint``). The CLI prints ``str(err)`` and exits
with ``exit_code``; nothing a user can cause by bad input should surface as a bare traceback.
Retryable failures (a server that is down for a moment) are kept apart from permanent ones
(``TemporaryError`` vs the rest), as kopf does.
"""
from __future__ import annotations


class KfpPytorchError(Exception):
    """Base of all kfp-pytorch errors: a message plus the next step for the user."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class TemporaryError(KfpPytorchError):
    """A failure that may pass if retried (server unreachable, timeout)."""


class ConfigError(KfpPytorchError):
    """Bad configuration or parameters; lists every problem with its path."""

    exit_code = 2

    def __init__(self, problems: list[str] | str, hint: str | None = None, title: str = "invalid configuration"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{title}:\n{body}", hint)


def unknown_field(path: str, name: str, known) -> str:
    """The problem line for a field ``name`` (at ``path``) that is not one of ``known``: the likely
    meant ones for a typo (``gpu_tolerance``) or for a nested form of flat fields (``s3:`` for
    ``s3_secret``, ``s3_endpoint``), else every known field."""
    import difflib

    known = sorted(known)
    text = str(name)
    near = difflib.get_close_matches(text, known, n=3, cutoff=0.6) or [k for k in known if k.startswith(f"{text}_")]
    if near:
        said = " or ".join(map(repr, near)) if len(near) < 3 else ", ".join(map(repr, near[:-1])) + f" or {near[-1]!r}"
        return f"{path}: unknown field; did you mean {said}?"
    return f"{path}: unknown field (known: {', '.join(known)})"


class DatasetError(KfpPytorchError):
    """The dataset is missing or does not pass validation."""

    exit_code = 2


class StorageError(KfpPytorchError):
    """S3/MinIO or local storage failed."""


class StorageNotFound(StorageError):
    """The object or bucket does not exist."""


class StorageAuthError(StorageError):
    """The credentials were refused."""


class StorageUnreachable(StorageError, TemporaryError):
    """The S3 endpoint did not answer."""


class ModelFactoryError(KfpPytorchError):
    """A model factory ``module:function`` could not be imported or called."""

    exit_code = 2


class TrainingError(KfpPytorchError):
    """Distributed training failed."""


class ServingError(KfpPytorchError):
    """The model server could not start or answer."""


class RequestRefused(ServingError):
    """The model server answered an inference request with an HTTP error status (``status``)."""

    def __init__(self, message: str, status: int, hint: str | None = None):
        super().__init__(message, hint)
        self.status = status


class PipelineFailed(KfpPytorchError):
    """A local pipeline run failed: the failed step and its error; the run's log holds the rest."""


class ModelNotFound(ServingError):
    """No trained model where a model URI points (nothing there, a file, a dataset): evaluate,
    register and a local server say so before they load or start anything."""

    exit_code = 2


class PortInUseError(ServingError):
    """The requested port is taken by another process."""

    exit_code = 2


class RegistryError(KfpPytorchError):
    """The MLflow tracking server or registry failed."""


class KubernetesError(KfpPytorchError):
    """The Kubernetes API refused or failed a request."""


class KubernetesUnavailable(KubernetesError, TemporaryError):
    """The API server did not answer, or a watch's connection broke or went silent (a control-plane
    upgrade, a load balancer that dropped an idle connection). The jobs go on without us."""


class KubernetesForbidden(KubernetesError):
    """RBAC denied a verb on a resource; the message names both."""

    exit_code = 3


class CrdNotInstalled(KubernetesError):
    """The API group of a CRD (Training Operator, Trainer, KServe) is not served by the cluster."""

    exit_code = 3


def untrusted_certificate(server: str, error: BaseException) -> str:
    """How an https server whose certificate failed verification is named, with OpenSSL's reason
    (``unable to get local issuer certificate``, a hostname mismatch) when the error carries it."""
    import re

    why = re.search(r"certificate verify failed: ([^(')]+)", str(error))
    return f"{server} has a TLS certificate this machine does not trust" + (f" ({why.group(1).strip()})" if why else "")
