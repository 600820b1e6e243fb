"""``serve``: put a trained model behind an Open Inference Protocol v2 endpoint.

Backends (one seam, like train):

- ``local``: starts :mod:`.kserve_predictor` (KServe's ``ModelServer`` around our
  ``TorchPredictor``) as a detached process on 127.0.0.1, waits for ``/v2/models/{name}/ready``,
  smoke-tests one prediction and returns the endpoint. The server outlives the pipeline step (that
  is its point); ``kfp-pytorch serve list`` / ``serve stop NAME`` manage it through a pid file.
- ``cluster``: a KServe InferenceService running the very same predictor class (separate issue).
"""

import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import requests
from urllib3.util.wait import wait_for_read

from .errors import ConfigError, KfpPytorchError, PortInUseError, RequestRefused, ServingError
from .paths import held, home, locked
from .processes import alive, same_process, start_ticks, wall_start

PREDICTOR_MODULE = "kfp_pytorch.components.kserve_predictor"
WAITING_FOR_PORT = "kfp-pytorch: model loaded, waiting for port"
"""The line a redeploy's successor prints once its model is loaded (``--wait_for_port_s``)."""


@dataclass(frozen=True)
class ServeSpec:
    model_uri: str
    """The model/ directory written by train (local path or s3://)."""
    model_name: str = "model"
    """The name in the endpoint path /v2/models/{name}/infer (DNS-1123 label)."""
    backend: str = "local"
    host: str = "127.0.0.1"
    port: int = 0
    """0: the port of the server already serving this name (a redeploy keeps its URL), else a free one."""
    startup_timeout_s: float = 120.0
    canary_traffic_percent: int = -1
    """Cluster backend: share of traffic for the new version (-1: all of it)."""
    min_replicas: int = 1
    max_replicas: int = 1
    """Cluster backend: KServe scales the predictor between these (on CPU use); one server locally."""
    registered_model: str = ""
    """The registry's name for this model, ``models:/NAME/VERSION`` (empty: not registered, or not
    known): `serve list` and the InferenceService's annotation say which version serves."""

    def validate(self) -> None:
        import re

        from .cluster import replicas_problems
        from .tracking import registered_version

        problems = []
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.model_name or ""):
            problems.append(f"model_name: must be a DNS-1123 label (lower-case letters, digits, '-'), got {self.model_name!r}")
        if not 0 <= self.port <= 65535:
            problems.append(f"port: must be in [0, 65535], got {self.port}")
        if self.backend not in BACKENDS:
            problems.append(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.model_uri:
            problems.append("model_uri: must be set")
        if self.registered_model and registered_version(self.registered_model) is None:
            problems.append(f"registered_model: must be a registered version, models:/NAME/VERSION, got "
                            f"{self.registered_model!r}")
        problems += replicas_problems(self.min_replicas, self.max_replicas)
        if self.backend == "cluster" and not self.model_uri.startswith(("s3://", "minio://")):
            problems.append(f"model_uri: the cluster backend needs s3:// or minio://, got {self.model_uri!r}; "
                            "set storage_root")
        if problems:
            raise ConfigError(problems, title="invalid serve settings")


@dataclass
class Endpoint:
    name: str
    url: str
    """Base URL of the server, e.g. http://127.0.0.1:8080."""
    infer_url: str
    pid: int | None
    model_uri: str
    smoke_test: dict | None = None
    cluster_url: str | None = None
    """Cluster backend: the InferenceService's in-cluster address (status.address.url)."""
    replaced: dict | None = None
    """Local backend: the record of the live server this one replaced (None: none was up)."""
    note: str | None = None
    """Local backend: what the user must know of this deploy (its URL changed after all)."""
    registered_model: str = ""
    """:attr:`ServeSpec.registered_model`: the registered version served, when known."""


def server_log(name: str, previous: bool = False) -> Path:
    """The log of local server ``name``; ``previous``: that of the server it replaced (the one that
    died, before `serve start`), as `kubectl logs --previous` reads a restarted container's."""
    return _servers_dir() / f"{name}{'.previous' if previous else ''}.log"


def follow_log(name: str, tail: int | None = None, poll_s: float = 0.2, grace_s: float = 3.0):
    """``kubectl logs -f`` for local server ``name``: yields ``("log", text)`` as its log grows (the
    last ``tail`` lines first) and ``("note", text)`` for what happens to the server. A redeploy swaps
    in the new server's log under the same name (``tail -F``), so it goes on with that one from its
    first line; it ends once the server has been down or stopped for ``grace_s``, with no deploy of
    the name under way, and its log has nothing more. The log must exist."""
    path = server_log(name)
    f = open(path, errors="replace")
    try:
        yield "log", "".join(collections.deque(f, maxlen=tail) if tail is not None else f.readlines())
        info = server_status(name)
        if not (info and info.get("alive")):
            yield "note", _ended(name, info)
            return
        gone_since = None
        while True:
            if chunk := f.read():
                yield "log", chunk
                continue
            try:
                replaced = os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
            except FileNotFoundError:  # moved aside by a redeploy, the new one not yet in its place
                replaced = False
            if replaced:
                f.close()
                f = open(path, errors="replace")
                yield "note", f"{name} was redeployed: the new server's log follows"
                continue
            info = server_status(name)
            # a deploy of the name is under way: its record names the server it replaces until the
            # new one serves, and a successor taking the port over can take longer than grace_s on
            # a loaded machine (the follower ended there, before the new server's log)
            if info and info.get("alive") or held(deploy_lock(name)):
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since >= grace_s:
                yield "note", _ended(name, info)
                return
            time.sleep(poll_s)
    finally:
        f.close()


def _ended(name: str, info: dict | None) -> str:
    if info is None:
        return f"{name} was stopped (serve stop): its log ends here"
    return (f"{name}'s server is down (pid {info.get('pid')} is gone): its log ends here; `kfp-pytorch serve start "
            f"{name}` starts it again")


def _servers_dir() -> Path:
    d = home() / "servers"
    d.mkdir(parents=True, exist_ok=True)
    return d


def deploy_lock(name: str) -> Path:
    """The lock file every deploy of server ``name`` holds from reading the server it replaces to
    writing its own record (:meth:`LocalServeBackend.start`)."""
    return _servers_dir() / f"{name}.lock"


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def port_holder(port: int) -> str:
    """Who listens on ``port`` on this machine, for the error that says it is taken: another of
    the local model servers (``the local model server 'iris'``), else the process (``pid 4242
    (python -m http.server 8080)``); "" when the system will not tell (another user's process,
    macOS without privileges)."""
    import psutil

    for info in list_servers():
        if info.get("alive") and _port_of(info) == port:
            return f"the local model server {info['name']!r} (`kfp-pytorch serve stop {info['name']}` stops it)"
    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
        if pids:
            cmd = " ".join(psutil.Process(pid := min(pids)).cmdline())
            return f"pid {pid} ({cmd[:80] + '...' if len(cmd) > 80 else cmd})"
    except (psutil.Error, OSError):
        pass
    return ""


def port_taken(port: int, host: str, hint: str, what: str = "port") -> PortInUseError:
    """The error for a port another process holds, naming that process where it can; ``what``:
    the name the user gave the port by (``serve_port``)."""
    who = port_holder(port)
    return PortInUseError(f"{what} {port} on {host} is already in use" + (f" by {who}" if who else ""), hint)


def some_names(names, most: int = 8) -> str:
    """``a, b, c and 4 more``: the first ``most`` names and how many else, for a message's one line."""
    names = list(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _pick_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# One keep-alive connection per model server and thread, on the standard library's http.client.
# Not requests: its per-call machinery (hooks, cookies, proxy and netrc lookups from the
# environment) costs about 2.5 ms a request on a slow machine, as much as the model server itself.
# Not a urllib3 pool either: its response wrapper, header containers and retry and timeout
# objects add about 0.35 ms of Python a request over a bare connection (interleaved p50s against
# the local model server: 2.09 against 1.73 ms), 15 % of a request. What the pool did that
# http.client does not, a check before reuse that the server has not closed the idle connection,
# is urllib3's own ``wait_for_read`` below. No retries: an inference is not idempotent for a
# caller that counts.
_LOCAL = threading.local()


@dataclass
class _Conn:
    conn: http.client.HTTPConnection
    prefix: str
    """The base URL's path prefix (often empty)."""
    origin: str
    """scheme://host:port, for error messages."""


def _connection(url: str) -> _Conn:
    """This thread's kept-alive connection to the server at ``url``."""
    conns = _LOCAL.__dict__.setdefault("conns", {})
    found = conns.get(url)
    if found is None:
        try:
            parts = urllib.parse.urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError:  # a port that is not a number
            parts, host, port = None, None, None
        if parts is None or parts.scheme not in ("http", "https") or not host:
            raise ServingError(f"not a model server URL: {url!r}",
                               "give the server's base URL, e.g. http://127.0.0.1:8080 "
                               "(`kfp-pytorch serve list` shows it)")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port)
        shown = f"[{host}]" if ":" in host else host
        found = conns[url] = _Conn(conn, parts.path.rstrip("/"), f"{parts.scheme}://{shown}:{conn.port}")
    return found


def infer(url: str, name: str, rows, timeout: float = 10.0, host_header: str | None = None,
          token: str | None = None, binary: bool = False) -> dict:
    """One OIP v2 request with FP32 rows over a kept-alive connection; returns the parsed response.

    ``host_header``: the InferenceService's host (``status.url``'s) when ``url`` is the ingress
    gateway's address, as KServe's docs call it (``curl -H "Host: ..."``): Istio routes by it.
    ``token``: sent as ``Authorization: Bearer``, for a gateway that authenticates (Kubeflow's
    oauth2-proxy in front of Istio). ``binary``: the rows go as raw little-endian FP32 after the
    JSON header (the protocol's binary tensor extension, which KServe and Triton read), not as
    JSON numbers: a 4096-row batch of 20 features took 66 ms instead of 114 ms. The outputs are
    then asked for the same way (``binary_data_output``) and decoded here, so the response reads
    as a JSON one does (each output's ``data`` a flat list) whichever way the server sent them."""
    headers = None
    if binary:
        import numpy as np

        x = np.ascontiguousarray(rows, dtype="<f4")
        if x.ndim != 2 or not x.size:
            raise ServingError("no rows to send: infer needs at least one row of features",
                               "pass rows as an array of shape [rows, features]")
        raw = x.tobytes()
        head = json.dumps({"inputs": [{"name": "input-0", "shape": list(x.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": len(raw)}}],
                           "parameters": {"binary_data_output": True}}).encode()
        body = head + raw
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    else:
        rows = [list(map(float, r)) for r in rows]
        if not rows or not rows[0]:
            raise ServingError("no rows to send: infer needs at least one row of features",
                               "pass rows as a list of equal-length lists of numbers")
        body = json.dumps({"inputs": [{"name": "input-0", "shape": [len(rows), len(rows[0])], "datatype": "FP32",
                                       "data": [v for r in rows for v in r]}]}).encode()
    status, data, head_len = _request(url, "POST", f"/v2/models/{name}/infer", body, timeout, host_header, token,
                                      headers)
    if status == 404 and (served := _models(url, timeout, host_header, token)) is not None and name not in served:
        raise ServingError(f"the server at {url} serves no model named {name!r} (it serves: "
                           f"{', '.join(map(repr, served)) or 'none'})",
                           "give the name the model is served under (the InferenceService's name)")
    if status != 200:
        raise RequestRefused(f"inference request failed: HTTP {status}: {data[:300].decode(errors='replace')}", status)
    if head_len is None:
        return json.loads(data)
    return _binary_response(data, head_len, url)


# numpy's little-endian dtype of each OIP datatype the binary extension carries (BYTES: length-prefixed)
_OIP_DTYPES = {"BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "i1",
               "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


def _binary_response(data: bytes, head_len: int, url: str) -> dict:
    """A response with binary outputs (``Inference-Header-Content-Length``): its JSON header, with
    each binary output's raw bytes, in the header's order, decoded into ``data`` as JSON gives it.
    Written here, not ``kserve.InferResponse.from_bytes``: that one drops ``model_version`` (which
    tells a table's batches answered by two models apart) and importing kserve takes 2.4 s of every
    `serve predict`; the layout is the protocol's binary tensor extension."""
    import numpy as np

    def bad(why: str) -> ServingError:
        return ServingError(f"the server at {url} sent a malformed binary response: {why}",
                            "send JSON instead (serve predict --encoding json; binary=False in Python), and report "
                            "the server's name and version")

    try:
        resp = json.loads(data[:head_len])
    except ValueError as e:
        raise bad(f"its {head_len}-byte JSON header does not parse ({e})") from None
    if not isinstance(resp, dict) or not isinstance(resp.get("outputs", []), list) or not all(
            isinstance(o, dict) for o in resp.get("outputs", [])):
        raise bad("its JSON header is not an object whose 'outputs' is a list of outputs")
    pos = head_len
    for out in resp.get("outputs", []):
        params = out.get("parameters") or {}
        size = params.pop("binary_data_size", None)
        if size is None:
            continue
        out["parameters"] = params or None  # as KServe's JSON answer has it, binary_data_size aside
        raw, pos = data[pos:pos + size], pos + size
        if len(raw) != size:
            raise bad(f"output {out.get('name')!r} has {len(raw)} of its {size} bytes")
        kind = out.get("datatype")
        if kind == "BYTES":
            items, i = [], 0
            while i < len(raw):
                n = int.from_bytes(raw[i:i + 4], "little")
                if i + 4 + n > len(raw):
                    raise bad(f"output {out.get('name')!r}: an element of {n} bytes runs past its {size}")
                items.append(raw[i + 4:i + 4 + n].decode(errors="replace"))
                i += 4 + n
            out["data"] = items
        elif kind in _OIP_DTYPES:
            out["data"] = np.frombuffer(raw, dtype=_OIP_DTYPES[kind]).tolist()
        else:
            raise bad(f"output {out.get('name')!r} has datatype {kind!r}, which has no binary form")
    return resp


def model_inputs(url: str, name: str, timeout: float = 10.0, host_header: str | None = None,
                 token: str | None = None) -> list[str] | None:
    """The feature names the server declares for model ``name`` (OIP v2 model metadata, ``GET
    /v2/models/{name}``: one ``[-1]`` input per column, as our predictor declares them); None when
    it declares no named columns (one ``[n, features]`` input, or a server without metadata).
    Reaching the server and authenticating fail as :func:`infer` does."""
    inputs = _get_field(url, f"/v2/models/{name}", "inputs", timeout, host_header, token)
    if not isinstance(inputs, list) or not inputs or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and i.get("shape") == [-1] for i in inputs):
        return None
    return [i["name"] for i in inputs]


def _models(url: str, timeout: float, host_header: str | None, token: str | None) -> list[str] | None:
    """The names of the models the server serves (``GET /v2/models``, KServe's model repository
    listing); None when it does not list them."""
    models = _get_field(url, "/v2/models", "models", timeout, host_header, token)
    return [str(m) for m in models] if isinstance(models, list) else None


def _get_field(url: str, path: str, key: str, timeout: float, host_header: str | None, token: str | None):
    """``key`` of the JSON object a GET of ``path`` answers; None for any other answer (a 404, a
    server that is not KServe's). Reaching the server and authenticating fail as :func:`infer` does."""
    status, data, _ = _request(url, "GET", path, None, timeout, host_header, token)
    try:
        return json.loads(data).get(key) if status == 200 else None
    except (ValueError, AttributeError):
        return None


def _request(url: str, method: str, path: str, body: bytes | None, timeout: float, host_header: str | None,
             token: str | None, headers: dict | None = None) -> tuple[int, bytes, int | None]:
    """One request over this thread's connection to ``url``: (status, body, the length of a binary
    response's JSON header, from ``Inference-Header-Content-Length``; None for a JSON one). An unreachable server,
    Istio's authorization or a gateway's login is a ServingError that says what to do."""
    c = _connection(url)
    conn, path = c.conn, c.prefix + path
    try:
        if conn.sock is not None:
            if wait_for_read(conn.sock, timeout=0.0):  # readable while idle: the server closed it
                conn.close()  # the next request opens a new connection
            else:
                conn.sock.settimeout(timeout)
        conn.timeout = timeout
        headers = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
        if host_header:
            headers["Host"] = host_header  # http.client then sends this one instead of its own
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body, headers)
        r = conn.getresponse()
        data = r.read()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise ServingError(f"could not reach the model server at {c.origin}{path}: {e}",
                           "check that it runs (`kfp-pytorch serve list`) and that the URL is right") from None
    location = r.getheader("Location") or ""
    if r.status == 403 and data.startswith(b"RBAC: access denied"):  # Envoy's answer: Istio's authorization
        raise ServingError(f"Istio refused the request at {c.origin} (HTTP 403 RBAC: access denied): no "
                           "AuthorizationPolicy of the model's namespace allows this caller",
                           "allow it with an AuthorizationPolicy on the predictor, e.g. to paths /v2/models/* from "
                           "the caller's namespace; a caller outside the mesh (KFP's step pods have no sidecar) has "
                           "no identity to match, so allow it by path, or go through the ingress with --token")
    if r.status in (401, 403) or (300 <= r.status < 400 and any(k in location for k in ("oauth", "dex", "login"))):
        raise ServingError(f"the gateway at {c.origin} {'refused the token' if token else 'requires authentication'} "
                           f"(HTTP {r.status}{', to ' + location[:120] if location else ''})",
                           "pass --token (or KFP_PYTORCH_SERVE_TOKEN) with a token it accepts; on Kubeflow, e.g. "
                           "`kubectl -n NAMESPACE create token default-editor`")
    head_len = r.getheader("Inference-Header-Content-Length")
    return r.status, data, int(head_len) if head_len and head_len.isdigit() else None


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = collections.deque(path.read_text(errors="replace").splitlines(), maxlen=n)
    except FileNotFoundError:
        return ""
    return "\n".join(f"    {line}" for line in lines)


def _port_of(info: dict) -> int | None:
    try:
        return urllib.parse.urlsplit(info.get("url") or "").port
    except ValueError:
        return None


def _smoke_test(check: Callable[[Endpoint], None], ep: Endpoint, log: str) -> None:
    """Run ``check`` on a ready server; anything but our own errors becomes a ServingError that names it."""
    try:
        check(ep)
    except KfpPytorchError:
        raise
    except Exception as e:
        raise ServingError(f"the smoke test of {ep.infer_url} failed: {type(e).__name__}: {e}",
                           f"the server started but did not answer as a model server should; see {log}") from e


class LocalServeBackend:
    def start(self, spec: ServeSpec, check: Callable[[Endpoint], None] | None = None) -> Endpoint:
        """Start a server for ``spec`` and, once it is ready, run ``check`` (the smoke test) on it.

        Serving a name again replaces the running server (a redeploy, as KServe rolls out an
        update) and keeps its URL, unless ``spec.port`` names another port: clients of the
        endpoint, a notebook's or a script's, go on working after a retraining. The new model is
        first started and smoke-tested on a free port beside the old server, so a model that fails
        to load or to answer leaves the old one serving; then a successor, its model already
        loaded, takes the port over the moment the old server lets it go (see ``_take_over``).

        Deploys of one name take turns on this machine (two runs, two notebooks): each reads the
        server it replaces and writes its own record; interleaved, the first one's server was left
        running with no record, out of `serve list`'s and `serve stop`'s reach."""
        with locked(deploy_lock(spec.model_name)):
            return self._start(spec, check)

    def _start(self, spec: ServeSpec, check: Callable[[Endpoint], None] | None) -> Endpoint:
        old = read_server(spec.model_name)
        # a dead server's record stays until the new server's record replaces it: a start that
        # fails (its port taken, its model unloadable) leaves it to `serve list` and `serve start`
        live = old if old is not None and same_process(old) else None
        port = spec.port or (live and _port_of(live)) or _pick_port(spec.host)
        take_over = live is not None and _port_of(live) == port
        if not take_over and not port_is_free(spec.host, port):
            raise port_taken(port, spec.host, "choose another port (or port=0 for a free one), or stop the process "
                                              "using it")
        log = server_log(spec.model_name)
        # beside a live server, the new one logs apart until it takes over (the old one's log is open);
        # the server it replaces keeps its log as the previous one (why a server that died, died)
        new_log = log.with_suffix(".new.log") if live else log
        if not live and log.exists():
            os.replace(log, server_log(spec.model_name, previous=True))
        # taking over the live server's port: the new model is tried on a free port first
        proc, ep = self._launch(spec, _pick_port(spec.host) if take_over else port, new_log)
        try:
            self._wait_ready(proc, ep, spec.startup_timeout_s, new_log)
            if check is not None:
                _smoke_test(check, ep, f"its log {new_log}")
            if take_over:
                proc, ep, new_log = self._take_over(spec, check, live, proc, ep, new_log)
        except KfpPytorchError as e:  # the error keeps its type (a StorageError stays one) and gains a note
            _terminate(proc.pid)
            if live and alive(live["pid"]):
                e.message += f"\n  the server already serving {spec.model_name} keeps serving: {live['infer_url']}"
                e.args = (e.message,)
            raise
        except BaseException:
            _terminate(proc.pid)
            raise
        if live is not None:
            ep.replaced = live
            stop_server(spec.model_name)  # the old one goes only now (taken over: it is gone already)
            if log.exists():
                os.replace(log, server_log(spec.model_name, previous=True))
            os.replace(new_log, log)  # the file stays open in the new server: it logs on, under the usual name
        record = {k: v for k, v in asdict(ep).items() if k not in ("replaced", "note")}
        _write_record(spec.model_name, {**record, "create_time": wall_start(proc.pid),
                                        "start_ticks": start_ticks(proc.pid)})
        return ep

    @staticmethod
    def _launch(spec: ServeSpec, port: int, log: Path, wait_for_port: bool = False
                ) -> tuple[subprocess.Popen, Endpoint]:
        cmd = [sys.executable, "-m", PREDICTOR_MODULE, "--model_name", spec.model_name, "--model_uri",
               spec.model_uri, "--http_port", str(port), "--bind_host", spec.host, "--enable_grpc", "false",
               "--workers", "1",
               # No log line per request: KServe's /metrics histograms keep the latencies, and the
               # line costs about a tenth of a request's server time here.
               "--enable_latency_logging", "false"]
        if wait_for_port:
            cmd += ["--wait_for_port_s", str(spec.startup_timeout_s)]
        with open(log, "wb") as out:
            # A new session: the server must outlive this step (kfp.local runs each step as a child).
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        url = f"http://{spec.host}:{port}"
        return proc, Endpoint(spec.model_name, url, f"{url}/v2/models/{spec.model_name}/infer", proc.pid,
                              spec.model_uri, registered_model=spec.registered_model)

    def _take_over(self, spec: ServeSpec, check: Callable[[Endpoint], None] | None, live: dict,
                   trial: subprocess.Popen, trial_ep: Endpoint, trial_log: Path
                   ) -> tuple[subprocess.Popen, Endpoint, Path]:
        """The live server's port, for the model ``trial`` serves (smoke-tested) on another one.

        KServe's server binds one port, named when it starts, so the trial cannot move. A successor
        loads the model and waits; the old server is stopped once it is ready to bind, and it binds
        as the old one closes its socket: requests are refused for the successor's start (about
        0.05 s here), not for a model's load. (Both servers on the port with SO_REUSEPORT would
        close even that gap, but KServe's server does not set it, and the kernel would send part of
        the traffic to a server not yet smoke-tested.) Should the successor fail once the old server
        is gone, the trial keeps serving on its port, said in the endpoint's ``note``. Returns the
        server that serves: process, endpoint and log."""
        port = _port_of(live)
        succ_log = trial_log.with_name(trial_log.name.replace(".new.log", ".next.log"))
        succ, ep = self._launch(spec, port, succ_log, wait_for_port=True)
        try:
            deadline = time.monotonic() + spec.startup_timeout_s
            while WAITING_FOR_PORT not in succ_log.read_text(errors="replace"):
                if succ.poll() is not None or time.monotonic() > deadline:
                    raise ServingError(f"the server to take over port {port} did not load the model (it passed "
                                       f"at {trial_ep.url}); last lines of {succ_log}:\n"
                                       f"{_tail(succ_log)}", "read the log above")
                time.sleep(0.05)
            stop_server(spec.model_name)  # the successor binds the moment the port is free
            self._wait_ready(succ, ep, spec.startup_timeout_s, succ_log)
            if check is not None:
                _smoke_test(check, ep, f"its log {succ_log}")
        except KfpPytorchError as e:
            _terminate(succ.pid)
            if alive(live["pid"]):
                raise
            # the old server is gone: the trial, which passed, serves on
            trial_ep.note = (f"port {port} could not be taken over ({e.message.splitlines()[0]}): "
                             f"{spec.model_name} is served at {trial_ep.url}, clients of the old URL must change")
            succ_log.unlink(missing_ok=True)
            return trial, trial_ep, trial_log
        except BaseException:
            _terminate(succ.pid)
            raise
        _terminate(trial.pid)
        trial_log.unlink(missing_ok=True)
        return succ, ep, succ_log

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, ep: Endpoint, timeout: float, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServingError(f"the model server exited with code {proc.returncode} before it was ready; "
                                   f"last lines of {log}:\n{_tail(log)}",
                                   "check model_uri and the log above")
            try:
                if requests.get(f"{ep.url}/v2/models/{ep.name}/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise ServingError(f"the model server did not become ready within {timeout:g}s; log: {log}",
                           "raise startup_timeout_s or read the log")


class ClusterServeBackend:
    """A KServe InferenceService running the same TorchPredictor; see :mod:`.cluster_run`. KServe
    rolls an update out itself: the previous revision serves until the new one is ready."""

    def start(self, spec: ServeSpec, check: Callable[[Endpoint], None] | None = None) -> Endpoint:
        from .cluster import ClusterConfig
        from .cluster_run import ClusterServer
        from .k8s import Kube

        cfg = ClusterConfig.from_env()
        canary = spec.canary_traffic_percent if spec.canary_traffic_percent >= 0 else None
        res = ClusterServer(Kube()).run(cfg.serve_spec(spec.model_uri, spec.model_name, canary, spec.min_replicas,
                                                       spec.max_replicas, spec.registered_model),
                                        timeout_s=spec.startup_timeout_s)
        ep = Endpoint(spec.model_name, res["url"], res["infer_url"], None, spec.model_uri,
                      cluster_url=res.get("cluster_url"), registered_model=spec.registered_model)
        if check is not None:
            # In a pod (the pipeline's serve step) the external host often does not resolve (the
            # default domain is example.com): the smoke test goes to the in-cluster address.
            inside = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and ep.cluster_url
            probe = dataclasses.replace(ep, url=ep.cluster_url,
                                        infer_url=f"{ep.cluster_url}/v2/models/{ep.name}/infer") if inside else ep
            try:
                _smoke_test(check, probe, f"the predictor's log: kubectl logs -n {cfg.namespace} "
                                          f"-l serving.kserve.io/inferenceservice={spec.model_name}")
            except ServingError as e:
                if "could not reach" not in e.message:
                    raise
                if inside:
                    raise ServingError(
                        e.message + f"\n  the InferenceService is Ready; its in-cluster address {ep.cluster_url} did "
                        "not answer this step's pod",
                        "under Istio's mutual TLS in STRICT mode the predictor's sidecar resets a caller outside the "
                        "mesh, as KFP's step pods are: give the predictor a PeerAuthentication in PERMISSIVE mode "
                        f"(selector serving.kserve.io/inferenceservice: {spec.model_name}); else check the "
                        f"namespace's NetworkPolicies (`kubectl -n {cfg.namespace} get networkpolicy`)") from e
                raise ServingError(e.message + f"\n  the InferenceService is Ready; its URL {ep.url} is not reachable "
                                   "from this machine",
                                   "run this where the ingress domain resolves (KServe's config-domain), or in the "
                                   f"cluster, where its address {ep.cluster_url or '(status.address.url)'} is used") from e
            ep.smoke_test = probe.smoke_test
        return ep


BACKENDS = {"local": LocalServeBackend, "cluster": ClusterServeBackend}


def _pidfile(name: str) -> Path:
    return _servers_dir() / f"{name}.json"


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    if alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _write_record(name: str, info: dict) -> None:
    """Write a server's record whole or not at all (a half-written one would be unreadable)."""
    p = _pidfile(name)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, p)


def read_server(name: str) -> dict | None:
    """The record of server ``name``; None when there is none. An unreadable record (written by
    hand, or by a version of this tool before records were written atomically) reads as a server
    with no pid: listed as ``unreadable``, and removed by :func:`stop_server`."""
    p = _pidfile(name)
    try:
        info = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        info = None
    if isinstance(info, dict):
        return info
    return {"name": name, "pid": None, "infer_url": f"(unreadable record {p})", "unreadable": True}


def server_status(name: str) -> dict | None:
    """:func:`read_server`'s record with ``alive``: whether its process is still our server."""
    info = read_server(name)
    if info is not None:
        info["alive"] = same_process(info)
    return info


def list_servers() -> list[dict]:
    return [info for p in sorted(_servers_dir().glob("*.json"))
            if (info := server_status(p.stem)) is not None]  # None: removed since the listing


def unknown_server(names, said: str | None = None) -> str:
    """``no local model server named 'digts'; did you mean 'digits'?``: ``said`` (by default that
    sentence) of names with no record, then the near server names, or which servers there are (a
    handful), or that there are none."""
    import difflib

    names = [names] if isinstance(names, str) else list(names)
    known = [s["name"] for s in list_servers()]
    said = said or f"no local model server named {', '.join(map(repr, names))}"
    near = [hit for n in names for hit in difflib.get_close_matches(n, known, n=1, cutoff=0.6)]
    if near:
        return f"{said}; did you mean {' or '.join(map(repr, dict.fromkeys(near)))}?"
    if not known:
        return f"{said}; there are no local model servers"
    return f"{said}; the servers: {some_names(known)}"


def stop_server(name: str) -> bool:
    """Stop server ``name`` and remove its record; False when there is no such server."""
    info = read_server(name)
    if info is None or (info.get("pid") is None and not info.get("unreadable")):
        return False
    if same_process(info):
        _terminate(info["pid"])
    _pidfile(name).unlink(missing_ok=True)  # a server that died: only its record is left to remove
    return True


def revive(name: str, port: int = 0) -> tuple[Endpoint, bool]:
    """Server ``name`` up again from its record when it is down (a reboot, a crash, a kill): the
    same model, on its old port when that is free (else ``port``, 0: a free one), smoke-tested as
    the serve step does. Returns ``(endpoint, started)``: ``started`` False when it was up already.
    Raises ServingError when there is no such server, or its model is gone."""
    from .storage import Storage, join

    info = server_status(name)
    if info is None or info.get("unreadable") or not info.get("model_uri"):
        raise ServingError(unknown_server(name, f"no local model server named {name!r} to start again"),
                           "`kfp-pytorch serve list` names the servers (`serve stop` removes a server's record); "
                           f"serve a model as {name!r} with `kfp-pytorch serve start {name} --model-uri "
                           f"models:/{name}@champion` (its registered champion) or --model-uri a run's train-op.model")
    if info["alive"]:
        return Endpoint(**{k: info.get(k) for k in ("name", "url", "infer_url", "pid", "model_uri")},
                        registered_model=info.get("registered_model") or ""), False
    if not Storage().exists(join(info["model_uri"], "metadata.json")):
        raise ServingError(f"the model that {name!r} served is gone: {info['model_uri']}",
                           "serve a model again with a pipeline run (`runs --local --keep` keeps a served "
                           f"model's run; `kfp-pytorch serve stop {name}` removes the record)")
    old = _port_of(info)
    host = urllib.parse.urlsplit(info.get("url") or "").hostname or "127.0.0.1"
    keep = port == 0 and old is not None and port_is_free(host, old)
    return serve(ServeSpec(model_uri=info["model_uri"], model_name=name, host=host, port=old if keep else port,
                           registered_model=info.get("registered_model") or "")), True


def keep_champion_served(name: str) -> str:
    """For a run whose model did not beat the champion: the champion's local server up, started
    again from its record when it is down. Says what holds, to end "did not beat the champion,
    ...": the champion is no longer claimed to stay served when nothing serves it."""
    info = read_server(name)
    if info is None:
        return ("and no local server serves it here (it may serve elsewhere; `kfp-pytorch serve list` shows "
                "this machine's)")
    try:
        ep, started = revive(name)
    except KfpPytorchError as e:
        return f"whose local server is down and cannot start again: {e.message}"
    return (f"whose local server was down; it serves again at {ep.infer_url} (pid {ep.pid})" if started
            else f"which stays served at {ep.infer_url}")


def serve(spec: ServeSpec, sample_row: list[float] | None = None) -> Endpoint:
    """Start the backend and smoke-test one prediction (a row of the training mean by default)
    before the endpoint is handed over: a local redeploy whose smoke test fails leaves the server
    it was to replace serving."""
    from .predictor import read_model_metadata

    spec.validate()
    # locally, before a process starts: a wrong URI is named here, not in a server's log
    meta = read_model_metadata(spec.model_uri) if spec.backend == "local" else None

    def smoke(ep: Endpoint) -> None:
        row = sample_row
        if row is None:  # on a cluster, read once the server is up: a missing model is its error, with its log
            row = (meta or read_model_metadata(spec.model_uri))["normalization"]["mean"]
        resp = infer(ep.url, ep.name, [row])
        ep.smoke_test = {"label": resp["outputs"][1]["data"][0] if len(resp["outputs"]) > 1 else None}

    ep = BACKENDS[spec.backend]().start(spec, check=smoke)
    if ep.note:
        print(f"warning: {ep.note}", file=sys.stderr)
    return ep
