"""A fake of the KFP v2beta1 REST API that ``kfp.Client`` uses, on loopback. It validates bodies.

Endpoints: healthz; pipelines upload / upload_version / list / versions; experiments create / list;
runs create / get / list / terminate / retry; recurringruns create / list / get / delete / enable / disable.
Validation mirrors the server: a run needs a display name and an existing pipeline version (or an inline spec), parameters must be declared
inputs of the pipeline, a cron must parse as robfig/cron's ``Parse`` would take it (5 or 6 fields,
seconds first, or a descriptor such as ``@daily``), an upload must be a parsable PipelineSpec.
``require_token`` makes every call without ``Authorization: Bearer <token>`` a 401.
"""
from __future__ import annotations

import base64
import json
import re
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

import yaml

from servers import reply, serve_in_thread, stop_http


def _page(items: list[dict], q: dict, key: str = "run_id") -> dict:
    """One page of a list, as the API server pages it (backend/src/apiserver/list/list.go):
    ``sort_by`` "field", "field asc" or "field desc" with the primary key breaking ties the same
    way, ``page_size`` 0 for its default of 20 and capped at 200, and an opaque base64
    ``next_page_token`` (here it holds the offset; the server's holds the next row's keys)."""
    words = (q.get("sort_by") or "created_at").lower().split()
    if len(words) > 2 or (len(words) == 2 and words[1] not in ("asc", "desc")):
        raise KfpError(400, f"Invalid input error: Received invalid sort by format {q['sort_by']!r}")
    field = words[0]
    items = sorted(items, key=lambda r: (str(r.get(field) or ""), r.get(key) or ""),
                   reverse=len(words) == 2 and words[1] == "desc")
    size = int(q.get("page_size") or 0)
    if size < 0:
        raise KfpError(400, f"Invalid input error: The page size should be greater than 0. Got {size}")
    size = min(size or 20, 200)
    try:
        start = json.loads(base64.b64decode(q["page_token"]))["offset"] if q.get("page_token") else 0
    except (ValueError, KeyError, TypeError):
        raise KfpError(400, "Invalid input error: Invalid package token") from None
    more = len(items) > start + size
    return {"runs": items[start:start + size], "total_size": len(items),
            "next_page_token": base64.b64encode(json.dumps({"offset": start + size}).encode()).decode() if more else ""}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KfpError(Exception):
    def __init__(self, code: int, message: str):
        self.code, self.message = code, message


class FakeKfp:
    def __init__(self):
        self.lock = threading.RLock()
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}
        self.require_token: str | None = None
        self.run_states = ["PENDING", "RUNNING", "SUCCEEDED"]
        """States a run walks through, one per GET."""
        self.failure: tuple[str, str] | None = None
        """(task, message) a FAILED run reports."""
        self.gateway_down: set[int] = set()
        """Which GETs of a run (numbered from 1) the gateway in front answers 503 "no healthy
        upstream", as Istio's does while the API server pod restarts."""
        self.stalled: set[int] = set()
        """Which GETs of a run (numbered from 1) get no answer at all for ``stall_s``: a
        port-forward whose tunnel died keeps the local port open but never answers."""
        self.stalls: list[tuple[str, str]] = []
        """(verb, path regex): requests of any kind that get no answer for ``stall_s``."""
        self.stall_s = 5.0
        self.unstall = threading.Event()
        """Set to end every stall at once (reset and stop set it)."""
        self.run_gets = 0
        self.faults: list[tuple[str, str, int, str]] = []
        """(verb, path regex, HTTP code, message): requests the server fails, as a sick one would."""
        self.stopped = False
        self.server = None
        self.requests: list[tuple[str, str]] = []

    def start(self) -> str:
        fake = self

        class H(_Handler):
            kfp = fake

        self.server, url = serve_in_thread(H)
        return url

    def stop(self) -> None:
        self.stopped = True  # a connection kept alive across the stop is dropped, as a dead port-forward drops it
        self.unstall.set()
        stop_http(self.server)

    def reset(self) -> None:
        with self.lock:
            for d in (self.pipelines, self.versions, self.experiments, self.runs, self.recurring):
                d.clear()
            self.require_token = None
            self.requests.clear()
            self.run_states = ["PENDING", "RUNNING", "SUCCEEDED"]
            self.failure = None
            self.gateway_down = set()
            self.stalled = set()
            self.stalls = []
            self.unstall.set()
            self.unstall = threading.Event()
            self.run_gets = 0
            self.faults = []

    # -- behaviour -----------------------------------------------------------------------------------
    def _spec_inputs(self, spec: dict) -> dict:
        return ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}

    def upload(self, name: str, data: bytes, pipeline_id: str | None = None) -> dict:
        # as the API server's NewV2SpecTemplate: YAML documents, one pipeline spec and at most one
        # platform spec with a kubernetes section (what `compile --platform` writes)
        try:
            docs = [d for d in yaml.safe_load_all(data) if d is not None]
        except yaml.YAMLError as e:
            raise KfpError(400, f"Failed to upload pipeline: unable to decode yaml document: {e}") from None
        spec = platform = None
        for d in docs:
            if isinstance(d, dict) and "pipelineInfo" in d and "root" in d:
                if spec is not None:
                    raise KfpError(400, "Failed to upload pipeline: multiple pipeline specs provided")
                if d.get("schemaVersion") != "2.1.0":
                    raise KfpError(400, "Failed to upload pipeline: KFP only supports schema version 2.1.0")
                spec = d
            elif isinstance(d, dict) and "kubernetes" in (d.get("platforms") or {}):
                if platform is not None:
                    raise KfpError(400, "Failed to upload pipeline: multiple platform specs provided")
                platform = d
        if spec is None:
            raise KfpError(400, "Failed to upload pipeline: no pipeline spec is provided")
        with self.lock:
            if pipeline_id is None:
                if any(p["display_name"] == name for p in self.pipelines.values()):
                    raise KfpError(409, f"Failed to upload pipeline: pipeline with name {name} already exists")
                pid = str(uuid.uuid4())
                self.pipelines[pid] = {"pipeline_id": pid, "display_name": name, "created_at": _now()}
            else:
                if pipeline_id not in self.pipelines:
                    raise KfpError(404, f"pipeline {pipeline_id} not found")
                pid = pipeline_id
                if any(v["pipeline_id"] == pid and v["display_name"] == name for v in self.versions.values()):
                    # the API server's unique index on (PipelineId, Name)
                    raise KfpError(409, f"Failed to create a pipeline version: version name {name} already exists")
            vid = str(uuid.uuid4())
            self.versions[vid] = {"pipeline_id": pid, "pipeline_version_id": vid, "display_name": name,
                                  "created_at": _now(), "pipeline_spec": spec, "platform_spec": platform}
            return self.pipelines[pid] if pipeline_id is None else self.versions[vid]

    def _check_run_body(self, body: dict, kind: str) -> dict:
        problems = []
        if not body.get("display_name"):
            problems.append("display_name is required")
        ref = body.get("pipeline_version_reference") or {}
        spec = body.get("pipeline_spec")
        if spec is None:
            v = self.versions.get(ref.get("pipeline_version_id", ""))
            if not ref or v is None or v["pipeline_id"] != ref.get("pipeline_id"):
                problems.append("pipeline_version_reference must name an existing pipeline and version")
            else:
                spec = v["pipeline_spec"]
        if body.get("experiment_id") and body["experiment_id"] not in self.experiments:
            problems.append(f"experiment {body['experiment_id']} not found")
        params = ((body.get("runtime_config") or {}).get("parameters")) or {}
        declared = self._spec_inputs(spec or {})
        for k in params:
            if k not in declared:
                problems.append(f"parameter {k!r} is not an input of the pipeline")
        if kind == "recurring":
            cron = ((body.get("trigger") or {}).get("cron_schedule") or {}).get("cron")
            if cron is not None and not _robfig_parses(cron):
                problems.append(f"Schedule cron is not a supported format(https://godoc.org/github.com/robfig/cron): "
                                f"{cron!r}")
            window = (body.get("trigger") or {}).get("cron_schedule") or {}
            for key in ("start_time", "end_time"):  # google.protobuf.Timestamp in JSON: RFC 3339, as grpc-gateway parses it
                if key in window and not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)",
                                                      str(window[key])):
                    problems.append(f"proto: invalid google.protobuf.Timestamp value for {key}: {window[key]!r}")
        if problems:
            raise KfpError(400, "Invalid input error: " + "; ".join(problems))
        return spec

    def create_run(self, body: dict) -> dict:
        with self.lock:
            self._check_run_body(body, "run")
            rid = str(uuid.uuid4())
            run = dict(body, run_id=rid, state="PENDING", created_at=_now(), _step=0, storage_state="AVAILABLE",
                       finished_at="1970-01-01T00:00:00Z")  # as the API server reports a run not ended
            self.runs[rid] = run
            return self._public(run)

    def get_run(self, rid: str) -> dict:
        with self.lock:
            run = self.runs.get(rid)
            if run is None:
                raise KfpError(404, f"run {rid} not found")
            if run.get("_cancel"):  # terminated: CANCELING until the next read, then CANCELED
                run["state"] = "CANCELED" if run["_cancel"] == "seen" else "CANCELING"
                run["_cancel"] = "seen"
                return self._public(run)
            if run["state"] in ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED"):  # ended: until a retry
                return self._public(run)
            run["_step"] = min(run["_step"] + 1, len(self.run_states) - 1)
            run["state"] = self.run_states[run["_step"]]
            if run["state"] in ("SUCCEEDED", "FAILED"):
                run["finished_at"] = _now()
            if run["state"] == "FAILED" and self.failure:  # as the API reports a failed run: its error, its tasks
                task, message = self.failure
                run["error"] = {"code": 2, "message": f"task {task} failed"}
                run["run_details"] = {"task_details": [
                    {"run_id": rid, "task_id": "t1", "display_name": "prepare-data-op", "state": "SUCCEEDED"},
                    {"run_id": rid, "task_id": "t2", "display_name": task, "state": "FAILED",
                     "error": {"code": 2, "message": message}}]}
            return self._public(run)

    def terminate_run(self, rid: str) -> dict:
        """As the API server's TerminateRun: a run not yet ended goes to CANCELING (the next read:
        CANCELED, its pods stopped); one that ended is refused, as the server's conditional update is."""
        with self.lock:
            run = self.runs.get(rid)
            if run is None:
                raise KfpError(404, f"run {rid} not found")
            if run["state"] in ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED"):
                raise KfpError(400, f"Failed to terminate run {rid}: the run is in state {run['state']}")
            run["state"], run["_cancel"] = "CANCELING", True
            return {}

    def retry_run(self, rid: str) -> dict:
        """As the API server's RetryRun: a FAILED or CANCELED run (its workflow Failed) starts again,
        PENDING, its error cleared; an archived run, or one in another state, is refused."""
        with self.lock:
            run = self.runs.get(rid)
            if run is None:
                raise KfpError(404, f"run {rid} not found")
            if run.get("storage_state") == "ARCHIVED":
                raise KfpError(400, f"Failed to retry run {rid}: run is archived")
            if run["state"] not in ("FAILED", "CANCELED"):
                raise KfpError(400, f"Failed to retry run {rid}: Workflow must be Failed/Error to retry")
            for k in ("error", "run_details", "_cancel"):
                run.pop(k, None)
            run.update(state="PENDING", _step=0, finished_at="1970-01-01T00:00:00Z")
            run["_retries"] = run.get("_retries", 0) + 1
            return {}

    @staticmethod
    def _public(run: dict) -> dict:
        return {k: v for k, v in run.items() if not k.startswith("_") and k != "pipeline_spec"}

    def create_recurring(self, body: dict) -> dict:
        with self.lock:
            self._check_run_body(body, "recurring")
            rid = str(uuid.uuid4())
            rr = dict(body, recurring_run_id=rid, status="ENABLED", created_at=_now())
            self.recurring[rid] = rr
            return rr


def _by_name(items: list[dict], flt: str | None) -> list[dict]:
    """The KFP list filter kfp.Client sends: one EQUALS predicate on display_name."""
    if not flt:
        return items
    want = json.loads(flt)["predicates"][0]
    name = want.get("string_value") or want.get("stringValue")
    return [x for x in items if x["display_name"] == name]


class _Handler(BaseHTTPRequestHandler):
    kfp: FakeKfp
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._send(code, {"error_message": message, "code": {400: 3, 401: 16, 403: 7, 404: 5, 409: 6}.get(code, 2),
                          "message": message})

    def _handle(self, verb: str) -> None:
        k = self.kfp
        if k.stopped:
            self.close_connection = True
            return
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        url = urlparse(self.path)
        q = {a: b[0] for a, b in parse_qs(url.query).items()}
        path = url.path.rstrip("/")
        k.requests.append((verb, path))
        if k.require_token and self.headers.get("Authorization") != f"Bearer {k.require_token}":
            return self._error(401, "Unauthenticated: request is missing a valid bearer token")
        if any(verb == s_verb and re.fullmatch(s_path, path) for s_verb, s_path in k.stalls):
            k.unstall.wait(k.stall_s)
            self.close_connection = True
            return
        for f_verb, f_path, code, message in k.faults:
            if verb == f_verb and re.fullmatch(f_path, path):
                return self._error(code, message)
        if verb == "GET" and re.fullmatch(r"/apis/v2beta1/runs/[^/]+", path):
            with k.lock:
                k.run_gets += 1
                down = k.run_gets in k.gateway_down
                stall = k.run_gets in k.stalled
            if stall:
                k.unstall.wait(k.stall_s)
                self.close_connection = True
                return
            if down:
                return reply(self, 503, b"no healthy upstream", "text/plain")
        try:
            if path == "/apis/v2beta1/healthz":
                return self._send(200, {"multi_user": False})
            if path == "/apis/v2beta1/pipelines/upload" and verb == "POST":
                data = self._file(raw)
                return self._send(200, k.upload(q.get("name") or "pipeline", data))
            if path == "/apis/v2beta1/pipelines/upload_version" and verb == "POST":
                data = self._file(raw)
                return self._send(200, k.upload(q.get("name") or "version", data, q.get("pipelineid")))
            if path == "/apis/v2beta1/pipelines" and verb == "GET":
                items = _by_name(list(k.pipelines.values()), q.get("filter"))
                return self._send(200, {"pipelines": items, "total_size": len(items)})
            m = re.fullmatch(r"/apis/v2beta1/pipelines/([^/]+)/versions", path)
            if m and verb == "GET":
                items = _by_name([dict((a, b) for a, b in v.items() if a not in ("pipeline_spec", "platform_spec"))
                                  for v in k.versions.values() if v["pipeline_id"] == m.group(1)], q.get("filter"))
                items.sort(key=lambda v: v["created_at"], reverse=True)
                return self._send(200, {"pipeline_versions": items, "total_size": len(items)})
            if path == "/apis/v2beta1/experiments":
                if verb == "POST":
                    body = json.loads(raw or b"{}")
                    if not body.get("display_name"):
                        return self._error(400, "Invalid input error: experiment display_name is required")
                    eid = str(uuid.uuid4())
                    k.experiments[eid] = dict(body, experiment_id=eid, created_at=_now(), storage_state="AVAILABLE")
                    return self._send(200, k.experiments[eid])
                items = _by_name(list(k.experiments.values()), q.get("filter"))
                return self._send(200, {"experiments": items, "total_size": len(items)})
            m = re.fullmatch(r"/apis/v2beta1/experiments/([^/]+)", path)
            if m:
                e = k.experiments.get(m.group(1))
                return self._send(200, e) if e else self._error(404, "experiment not found")
            if path == "/apis/v2beta1/runs":
                if verb == "POST":
                    return self._send(200, k.create_run(json.loads(raw or b"{}")))
                items = [FakeKfp._public(r) for r in k.runs.values()
                         if not q.get("experiment_id") or r.get("experiment_id") == q["experiment_id"]]
                return self._send(200, _page(items, q))
            m = re.fullmatch(r"/apis/v2beta1/runs/([^/:]+):terminate", path)
            if m and verb == "POST":
                return self._send(200, k.terminate_run(m.group(1)))
            m = re.fullmatch(r"/apis/v2beta1/runs/([^/:]+):retry", path)
            if m and verb == "POST":
                return self._send(200, k.retry_run(m.group(1)))
            m = re.fullmatch(r"/apis/v2beta1/runs/([^/:]+)", path)
            if m and verb == "GET":
                return self._send(200, k.get_run(m.group(1)))
            if path == "/apis/v2beta1/recurringruns":
                if verb == "POST":
                    return self._send(200, k.create_recurring(json.loads(raw or b"{}")))
                items = _by_name([r for r in k.recurring.values()
                                  if not q.get("experiment_id") or r.get("experiment_id") == q["experiment_id"]],
                                 q.get("filter"))
                return self._send(200, {"recurringRuns": items, "total_size": len(items)})
            m = re.fullmatch(r"/apis/v2beta1/recurringruns/([^/:]+):(enable|disable)", path)
            if m and verb == "POST":  # as the API server's ChangeJobMode: idempotent, the runs started go on
                with k.lock:
                    rr = k.recurring.get(m.group(1))
                    if rr is None:
                        return self._error(404, f"Job {m.group(1)} not found")
                    on = m.group(2) == "enable"
                    rr.update(mode="ENABLE" if on else "DISABLE", status="ENABLED" if on else "DISABLED")
                return self._send(200, {})
            m = re.fullmatch(r"/apis/v2beta1/recurringruns/([^/:]+)", path)
            if m and verb in ("GET", "DELETE"):
                with k.lock:
                    rr = k.recurring.get(m.group(1))
                    if rr is None:
                        return self._error(404, f"Job {m.group(1)} not found")
                    if verb == "DELETE":
                        del k.recurring[m.group(1)]
                        return self._send(200, {})
                return self._send(200, rr)
            return self._error(404, f"no route {verb} {path}")
        except KfpError as e:
            return self._error(e.code, e.message)

    def _file(self, raw: bytes) -> bytes:
        ctype = self.headers.get("Content-Type", "")
        if "multipart/form-data" not in ctype:
            raise KfpError(400, "upload must be multipart/form-data with an uploadfile field")
        from email.parser import BytesParser
        from email.policy import HTTP

        msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
        for part in msg.iter_parts():
            if part.get_param("name", header="content-disposition") == "uploadfile":
                return part.get_payload(decode=True)
        raise KfpError(400, "upload is missing the uploadfile field")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


_ROBFIG_DESCRIPTORS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


def _robfig_parses(cron: str) -> bool:
    """The shape robfig/cron v1's Parse accepts (KFP's API server validates with it): 5 or 6 fields
    (second minute hour dom month [dow]), or a descriptor. Field values are not checked here."""
    words = cron.split()
    if words and words[0].startswith("@"):
        if words[0] == "@every":
            return len(words) == 2 and re.fullmatch(r"((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+", words[1]) is not None
        return len(words) == 1 and words[0] in _ROBFIG_DESCRIPTORS
    return len(words) in (5, 6)
