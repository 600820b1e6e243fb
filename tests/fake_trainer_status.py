"""Kubeflow Trainer's progress status server (``TrainJobProgress`` gate, kubeflow/trainer
pkg/progress), on loopback, over HTTPS, in front of a :class:`fake_k8s.FakeCluster`.

It does what the real one does with a report, and refuses what it refuses:

- ``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainjobs/NAME/status`` only (404 else);
- a bearer token is required (401 without one, or with one it did not issue: the real server
  reviews it with a TokenReview), and it must be a token of a live pod of *that* TrainJob,
  labelled ``trainer.kubeflow.org/trainjob-name`` (403 otherwise);
- the body is at most 64 KiB (413), ``{"trainerStatus": {...}}`` valid against the TrainJob
  CRD's schema, lastUpdatedTime included (422 with the reason);
- it merge-patches ``status.trainerStatus`` into the TrainJob (a watch sees it) and answers 200.

Errors are ``metav1.Status`` objects, as the real server writes them.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import threading
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import jsonschema
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fake_k8s import ApiError, FakeCluster
from k8s_schemas import schema_for
from servers import reply, serve_in_thread, stop_http

LABEL_TRAINJOB_NAME = "trainer.kubeflow.org/trainjob-name"
MAX_BODY = 1 << 16
_PATH = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")


def _self_signed(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 it signed: (ca.crt, tls.crt, tls.key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-webhook-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-controller-manager")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class TrainerStatusServer:
    def __init__(self, cluster: FakeCluster, directory: Path):
        self.cluster = cluster
        self.ca, self._cert, self._key = _self_signed(directory)
        self.tokens: dict[str, tuple[str, str, str]] = {}
        """token -> (namespace, pod, pod uid): what a TokenReview would say of it."""
        self.received: list[tuple[int, str, dict | None]] = []
        """(HTTP code, path, body) of every request."""
        self.lock = threading.Lock()
        self.server = None
        self.url = ""

    def start(self) -> str:
        status = self

        class Handler(_Handler):
            fake = status

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._cert, self._key)
        self.server, self.url = serve_in_thread(Handler, tls=context)
        return self.url

    def stop(self) -> None:
        stop_http(self.server)

    def status_url(self, ns: str, name: str) -> str:
        return f"{self.url}/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/status"

    def token_for(self, ns: str, pod: str) -> str:
        """The projected token (audience trainer.kubeflow.org) the kubelet mounts in the pod."""
        uid = self.cluster.get("pods", ns, pod)["metadata"]["uid"]
        token = f"fake-projected-{uuid.uuid4().hex}"
        self.tokens[token] = (ns, pod, uid)
        return token

    def env(self, ns: str, name: str, token_file: Path) -> dict[str, str]:
        """The variables the Trainer's Progress plugin injects into the job's containers."""
        return {"KUBEFLOW_TRAINER_STATUS_URL": self.status_url(ns, name),
                "KUBEFLOW_TRAINER_STATUS_CA_CERT": str(self.ca), "KUBEFLOW_TRAINER_STATUS_TOKEN": str(token_file)}

    def handle(self, path: str, auth: str, raw: bytes, length: int) -> tuple[int, dict]:
        m = _PATH.match(path)
        if not m:
            return _status(404, "NotFound", "Not found")
        ns, name = m.groups()
        if not auth.startswith("Bearer ") or not auth[len("Bearer "):]:
            return _status(401, "Unauthorized", "Missing Authorization header" if not auth else
                           "Invalid Authorization header format")
        who = self.tokens.get(auth[len("Bearer "):].strip())
        if who is None:
            return _status(401, "Unauthorized", "Invalid or expired token")
        if length > MAX_BODY:
            return _status(413, "RequestEntityTooLarge", "Payload too large")
        tns, pod_name, uid = who
        try:
            pod = self.cluster.get("pods", tns, pod_name)
        except ApiError:
            pod = None
        if (tns != ns or pod is None or pod["metadata"]["uid"] != uid
                or (pod["metadata"].get("labels") or {}).get(LABEL_TRAINJOB_NAME) != name):
            return _status(403, "Forbidden", "Forbidden")
        try:
            body = json.loads(raw)
            trainer_status = body.get("trainerStatus") if isinstance(body, dict) else None
            if trainer_status is not None:
                schema = schema_for("trainer.kubeflow.org/v1alpha1", "TrainJob")
                jsonschema.Draft7Validator(schema["properties"]["status"]["properties"]["trainerStatus"]).validate(
                    trainer_status)
                if "lastUpdatedTime" not in trainer_status:  # the CRD's x-kubernetes-validations rule
                    raise jsonschema.ValidationError("lastUpdatedTime is required when trainerStatus is present")
        except (ValueError, jsonschema.ValidationError) as e:
            return _status(422, "Invalid", f"TrainJob.trainer.kubeflow.org \"{name}\" is invalid: "
                                           f"{getattr(e, 'message', e)}")
        try:
            self.cluster.patch("trainjobs", ns, name, {"status": {"trainerStatus": trainer_status}},
                               "application/merge-patch+json", status_only=True)
        except ApiError as e:
            return _status(500, "InternalError", "Internal error") if e.code != 404 else _status(
                404, "NotFound", e.message)
        return 200, body


def _status(code: int, reason: str, message: str) -> tuple[int, dict]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    fake: TrainerStatusServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(min(length, MAX_BODY + 1)) if length else b""
        code, body = self.fake.handle(self.path, self.headers.get("Authorization", ""), raw, length)
        with self.fake.lock:
            try:
                sent = json.loads(raw) if raw else None
            except ValueError:
                sent = None
            self.fake.received.append((code, self.path, sent))
        reply(self, code, json.dumps(body).encode())

    def do_GET(self):
        code, body = _status(404, "NotFound", "Not found")  # POST only, as the real mux
        reply(self, code, json.dumps(body).encode())
