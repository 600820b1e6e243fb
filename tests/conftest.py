"""Shared fixtures: real servers (session scope, 127.0.0.1, stopped by PID) and prepared data."""
import os
import threading
from pathlib import Path

import pytest

from servers import postgres_database, start_mlflow, start_postgres, start_seaweedfs

TESTS = Path(__file__).parent
S3_VARS = ("AWS_ENDPOINT_URL", "S3_ENDPOINT", "MLFLOW_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "MLFLOW_TRACKING_URI", "KFP_PYTORCH_STORAGE_CONFIG")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """Each test: its own KFP_PYTORCH_HOME, no S3/MLflow settings leaking in, tests/ importable
    by worker processes (test model factories live there)."""
    monkeypatch.setenv("KFP_PYTORCH_HOME", str(tmp_path / "home"))
    for k in S3_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KFP_PYTORCH_STORAGE_CONFIG", str(tmp_path / "no-storage-config.yaml"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A Storage bound to the real S3 server, with the env set for child processes too."""
    from kfp_pytorch.components.storage import Storage

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return Storage()


@pytest.fixture
def bucket(s3, request):
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-b"
    s3.ensure_bucket(f"s3://{name}")
    return name


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory):
    server = start_mlflow(tmp_path_factory.mktemp("mlflow"), s3_server)
    yield server
    server.stop()


MLFLOW_ADMIN_PASSWORD = "kfp-Pytorch-admin-1"


@pytest.fixture(scope="session")
def mlflow_auth_server(s3_server, tmp_path_factory):
    """MLflow's basic-auth app: anonymous requests get 401; user ``admin``, MLFLOW_ADMIN_PASSWORD."""
    server = start_mlflow(tmp_path_factory.mktemp("mlflow-auth"), s3_server, bucket="mlflow-auth",
                          admin_password=MLFLOW_ADMIN_PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    import shutil

    server = start_postgres(tmp_path_factory.mktemp("postgres"))
    yield server
    server.stop()
    shutil.rmtree(server.log.parent, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path):
    """Where a usage ledger lives: a sqlite file (the embedded default) or a fresh database on a
    real PostgreSQL server (the HA backend)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    import re

    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:60]
    return postgres_database(request.getfixturevalue("postgres_server"), name)


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory):
    from kfp_pytorch.components.prepare_data import PrepareSpec, prepare_data

    out = tmp_path_factory.mktemp("digits") / "data"
    prepare_data(PrepareSpec("sample://digits", str(out)))
    return str(out)


@pytest.fixture(scope="session")
def trained_model(digits_data, tmp_path_factory):
    """One 2-worker training run shared by evaluate / register / serve tests."""
    from kfp_pytorch.components.train import TrainSpec, train

    out = tmp_path_factory.mktemp("trained") / "run"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = train(TrainSpec(digits_data, str(out), epochs=6, lr=0.005, progress="off"))
    return result


@pytest.fixture(scope="session")
def _fake_k8s_server():
    from fake_k8s import FakeCluster

    fake = FakeCluster()
    url = fake.start()
    yield fake, url
    fake.stop()


@pytest.fixture
def k8s(_fake_k8s_server):
    """A clean fake API server per test and an ApiClient of the official client bound to it."""
    from kubernetes import client

    fake, url = _fake_k8s_server
    with fake.lock:
        fake.objects.clear()
        fake.logs.clear()
        fake.log_epochs.clear()
        fake.denied.clear()
        fake.stalled.clear()
        fake.missing_groups.clear()
        fake.requests.clear()
        fake.operator.isvc_ready = True
        fake.watch_faults.clear()
        fake.unstall.set()
        fake.unstall = threading.Event()
        fake.operator.kserve_storage_uris = True
        fake.operator.isvc_domain, fake.operator.isvc_address = "example.com", None
        fake.operator.kueue = False
        fake.operator.trainer_build_fails = False
        fake.operator.trainer_progress_url = None
        fake.operator.trainer_runtime_pod = {"containers": [{"name": "node"}]}
    cfg = client.Configuration()
    cfg.host = url
    api = client.ApiClient(cfg)
    yield fake, api
    api.close()


@pytest.fixture(scope="session")
def _trainer_status_server(_fake_k8s_server, tmp_path_factory):
    from fake_trainer_status import TrainerStatusServer

    server = TrainerStatusServer(_fake_k8s_server[0], tmp_path_factory.mktemp("trainer-tls"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def trainer_status(k8s, _trainer_status_server):
    """Kubeflow Trainer with its TrainJobProgress gate on: its status server (HTTPS) writes the
    progress a TrainJob's pods report into the TrainJob's status."""
    fake, api = k8s
    server = _trainer_status_server
    with server.lock:
        server.received.clear()
        server.tokens.clear()
    fake.operator.trainer_progress_url = server.url
    return fake, api, server


@pytest.fixture(scope="session")
def _fake_kfp_server():
    from fake_kfp import FakeKfp

    fake = FakeKfp()
    url = fake.start()
    yield fake, url
    fake.stop()


@pytest.fixture
def kfp_server(_fake_kfp_server):
    fake, url = _fake_kfp_server
    fake.reset()
    return fake, url
