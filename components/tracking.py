"""The one edge to MLflow: experiment tracking and the model registry.

Default store: an embedded sqlite database under ``KFP_PYTORCH_HOME`` (no server needed); any
tracking URI (``http://mlflow:5000``) selects a server, whose artifacts then go wherever the server
says (MinIO in a cluster). MLflow and HTTP exceptions become :class:`RegistryError` with a hint.
"""
from __future__ import annotations

import os
import re
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from .errors import RegistryError, untrusted_certificate
from .paths import home, locked

CHAMPION = "champion"
EXPERIMENT = "kfp-pytorch"


def model_interface(model_dir: Path) -> tuple[str | None, str]:
    """(digest, summary) of what a model takes and gives, from its ``metadata.json``: its feature
    names in order and its classes. Two versions with another digest are not interchangeable
    behind one endpoint, and a test metric of one says nothing of the other. A folder without
    readable metadata has no digest (None): nothing to compare it by. Pure but for the read."""
    import hashlib
    import json

    try:
        meta = json.loads((Path(model_dir) / "metadata.json").read_text())
    except (OSError, ValueError):
        return None, "inputs not known (no metadata.json)"
    features, classes = list(meta.get("features") or []), list(meta.get("class_names") or meta.get("classes") or [])
    digest = hashlib.sha256(json.dumps([features, classes]).encode()).hexdigest()[:16]
    shown = ", ".join(map(str, classes[:4])) + (", ..." if len(classes) > 4 else "")
    return digest, f"{len(features)} features, {len(classes)} classes ({shown})"


def pyfunc_signature():
    """The registered model's signature: its parameters only. ``probabilities`` (off by default)
    answers each class's probability beside the class (mlflow_model.py). No input schema: a named
    one refuses the arrays callers send too, and the model reads a table's columns by name itself."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec

    return ModelSignature(inputs=None, params=ParamSchema([ParamSpec("probabilities", "boolean", False)]))


def dataset_input(meta: dict):
    """The prepared table as an MLflow dataset input (the run's "Datasets used", context
    ``training``), from prepare_data's ``metadata.json``: named after its source table, with a
    digest of its shards (the same table, columns and split give the same digest, so the runs of
    one data version are found by it), its columns as a schema and its rows per split as profile."""
    import hashlib
    import json
    import warnings

    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.exceptions import MlflowException
    from mlflow.types import ColSpec, Schema

    source_uri = str(meta.get("source", ""))
    try:
        with warnings.catch_warnings():  # a path is both a local file and a local artifact source to it
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(re.sub(r"^minio://", "s3://", source_uri))
    except MlflowException:  # sample://digits: a table made by code (scikit-learn's), not a file
        source = CodeDatasetSource(tags={"uri": source_uri})
    checksums = [sh["sha256"] for split in sorted(meta["shards"]) for sh in meta["shards"][split]]
    digest = hashlib.sha256(json.dumps([meta["features"], meta.get("label_column"), checksums]).encode()).hexdigest()
    label_type = "string" if meta.get("class_names") else "long"
    schema = Schema([ColSpec("float", f) for f in meta["features"]] + [ColSpec(label_type, meta.get("label_column", "label"))])
    name = re.sub(r"\.(csv|parquet|pq)$", "", source_uri.rstrip("/").rsplit("/", 1)[-1]) or "dataset"
    # MetaDataset: MLflow's dataset of a source it does not read; its entity then takes our profile
    fields = MetaDataset(source, name=name, digest=digest[:12], schema=schema).to_dict()
    dup = meta.get("duplicates", {})
    profile = {"num_rows": sum(meta["rows"].values()), **{f"{k}_rows": v for k, v in meta["rows"].items()},
               "num_classes": len(meta["classes"]), "repeated_rows": dup.get("rows"),
               "test_rows_in_train": dup.get("test_rows_in_train")}
    entity = Dataset(**fields, profile=json.dumps({k: v for k, v in profile.items() if v is not None}))
    return DatasetInput(entity, tags=[InputTag("mlflow.data.context", "training")])


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file")


def tracking_uri_problem(uri: str, where: str = "tracking_uri") -> str | None:
    """Why ``uri`` is no MLflow tracking URI, named by ``where``; None when it is one. Pure."""
    scheme = uri.partition("://")[0].split("+")[0] if "://" in uri else ""
    if scheme in TRACKING_SCHEMES:
        return None
    return (f"{where}: must be an MLflow server (http(s)://HOST[:PORT]) or a store URI "
            f"({', '.join(s + '://' for s in TRACKING_SCHEMES[2:])}), got {uri!r}")


def resolve_tracking_uri(uri: str | None = None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


CREDENTIALS_HINT = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic auth) or MLFLOW_TRACKING_TOKEN; "
                    "in a pipeline, put them in a Secret and name it in the platform file's mlflow_secret")


def _server_said(message: str) -> str:
    """What the server answered, without MLflow's frame ("API request to endpoint ... Response body:",
    or the error code before a JSON error's message)."""
    m = re.search(r"Response body: '(.*)'$", message, re.S)
    said = (m.group(1) if m else message).strip()
    return re.sub(r"^[A-Z_]+: ", "", said)  # the error code MLflow puts before a JSON error's message


@contextmanager
def _no_bars_in_a_log():
    """No MLflow artifact bars where stderr is not a terminal (a KFP step's log keeps every redraw as
    a line); a terminal, or MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR set by the user, keeps them."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    if key in os.environ or sys.stderr.isatty():
        yield
        return
    os.environ[key] = "false"
    try:
        yield
    finally:
        os.environ.pop(key, None)


@contextmanager
def _store_lock(uri: str):
    """An embedded sqlite store is made (and migrated) by the first process that opens it, and its
    experiment by the first that finds none: two runs at once on a fresh KFP_PYTORCH_HOME both
    found no tables, both made them, and one failed ("table experiments already exists"). One
    process at a time opens it, through a lock beside the database. A server does this itself."""
    db = Path(uri[len("sqlite:///"):].split("?", 1)[0]) if uri.startswith("sqlite:///") else None
    if db is None or not db.name or db.name == ":memory:" or not db.parent.is_dir():
        yield  # no file to share, or a folder that is not there: MLflow's own error says so
        return
    with locked(db.with_name(db.name + ".lock")):
        yield


@contextmanager
def _mapped(action: str, uri: str):
    try:
        yield
    except RegistryError:
        raise
    except Exception as e:  # MlflowException, requests errors, sqlite errors all land here
        import requests
        from mlflow.exceptions import MlflowException

        text = str(e)
        if isinstance(e, requests.exceptions.SSLError) or "CERTIFICATE_VERIFY_FAILED" in text:
            raise RegistryError(f"{action}: " + untrusted_certificate(f"the MLflow server at {uri}", e),
                                "set MLFLOW_TRACKING_SERVER_CERT_PATH to the PEM file of the CA that signed it") from e
        if isinstance(e, requests.exceptions.ConnectionError) or "Max retries exceeded" in text \
                or "Connection refused" in text:
            raise RegistryError(f"{action}: cannot reach the MLflow tracking server at {uri}",
                                "check the tracking URI and that `mlflow server` is running; "
                                "leave it empty for the embedded sqlite store") from e
        if isinstance(e, MlflowException):
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")
            said = _server_said(e.message)
            if e.error_code == "UNAUTHENTICATED":  # 401: no credentials, or wrong ones
                given = (f"the credentials of user {user!r}" if user else
                         "the token in MLFLOW_TRACKING_TOKEN" if os.environ.get("MLFLOW_TRACKING_TOKEN") else None)
                raise RegistryError(f"{action}: the MLflow server at {uri} "
                                    + (f"refused {given}" if given else "requires credentials")
                                    + f" ({said.split('.')[0]})", CREDENTIALS_HINT) from e
            if e.error_code == "PERMISSION_DENIED":  # 403: who it is may not do this
                who = f"user {user!r}" if user else "this caller"
                raise RegistryError(f"{action}: the MLflow server at {uri} denies {who} ({said})",
                                    f"ask the MLflow admin to give {who} EDIT on the experiment {EXPERIMENT!r} and on "
                                    "the registered model (or use credentials that have it)") from e
            raise RegistryError(f"{action} failed at {uri}: {e.message}") from e
        raise


_REGISTRY_URI = re.compile(r"models:/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})(?:/([1-9][0-9]*)|@([A-Za-z0-9_-]+))")


def parse_registry_uri(uri: str) -> tuple[str, int | None, str | None]:
    """``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` as (name, version, alias). Pure."""
    m = _REGISTRY_URI.fullmatch(uri)
    if not m:
        from .errors import ConfigError

        raise ConfigError([f"model URI {uri!r}: write models:/MODEL/VERSION or models:/MODEL@ALIAS "
                           f"(e.g. models:/digits/3, models:/digits@{CHAMPION})"], title="invalid model URI",
                          hint="`kfp-pytorch runs --local` shows each run's registered version")
    return m.group(1), int(m.group(2)) if m.group(2) else None, m.group(3)


def registered_version(uri: str) -> tuple[str, int] | None:
    """``models:/NAME/VERSION`` as (name, version); None for an alias or what is no model URI
    (a record's field, where a bad value makes no claim rather than an error). Pure."""
    m = _REGISTRY_URI.fullmatch(uri or "")
    return (m.group(1), int(m.group(2))) if m and m.group(2) else None


def registry_cache() -> Path:
    """Where registered versions are downloaded to be served on this machine (:meth:`Tracker.fetch_model`):
    a cache, since the registry keeps every version (`runs --local --keep` removes what no server uses)."""
    return home() / "registry_models"


class Tracker:
    """Thin facade over ``mlflow``; one instance per tracking URI."""

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = EXPERIMENT):
        """``experiment`` None: the registry only (reading a version creates no experiment there)."""
        # Fail fast on a dead server instead of MLflow's minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        import mlflow

        self.uri = resolve_tracking_uri(tracking_uri)
        cert = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
        if cert and not Path(cert).is_file():  # else requests' "invalid path" on the first call
            raise RegistryError(f"MLFLOW_TRACKING_SERVER_CERT_PATH: no such file {cert!r}",
                                "give the PEM file of the CA that signed the MLflow server's certificate")
        self.mlflow = mlflow
        mlflow.set_tracking_uri(self.uri)
        self.experiment_id = None
        with _mapped("open the tracking store", self.uri), _store_lock(self.uri):
            self.client = mlflow.MlflowClient(self.uri)
            if self.uri.startswith("sqlite:"):  # made or migrated now, in the lock (MLflow does it on first use)
                self.client.search_experiments(max_results=1)
                self.client.search_registered_models(max_results=1)
            if experiment is not None:
                with _mapped("open experiment", self.uri):
                    self.experiment_id = self._experiment(experiment)

    def _experiment(self, name: str) -> str:
        """The experiment's id, made when missing. Two runs that make it at once on a server: the
        one that loses finds the other's."""
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.uri.startswith("sqlite:") or self.uri.startswith("file:"):
            location = (home() / "mlartifacts").as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS" or (exp := self.client.get_experiment_by_name(name)) is None:
                raise
            return exp.experiment_id

    def log_training(self, run_name: str, params: dict, history: list[dict], summary: dict | None = None,
                     data: dict | None = None) -> str:
        """One run with the params, per-epoch loss / accuracy / samples per second, ``summary``
        figures (the exported epoch) as metrics of their own, and ``data`` (prepare_data's
        metadata) as the run's training dataset (:func:`dataset_input`)."""
        from mlflow.entities import Metric, Param

        with _mapped("log training run", self.uri):
            run = self.client.create_run(self.experiment_id, run_name=run_name,
                                         tags={"kfp_pytorch.component": "train"})
            rid = run.info.run_id
            if data is not None:
                self._log_dataset(rid, data)
            now_ms = int(time.time() * 1000)
            metrics = [Metric(k, float(h[k]), now_ms, h["epoch"])
                       for h in history for k in ("loss", "accuracy", "val_loss", "val_accuracy", "samples_per_second")]
            metrics += [Metric(k, float(v), now_ms, 0) for k, v in (summary or {}).items()]
            self.client.log_batch(rid, metrics=metrics,
                                  params=[Param(k, str(v)[:500]) for k, v in params.items()])
            self.client.set_terminated(rid)
        return rid

    def _log_dataset(self, run_id: str, data: dict) -> None:
        """The run's training dataset; a server that cannot take it (MLflow before 2.4 has no
        ``runs/log-inputs``) costs the record only, said on stderr, never the run's metrics."""
        import sys

        from mlflow.exceptions import MlflowException

        try:
            self.client.log_inputs(run_id, datasets=[dataset_input(data)])
        except MlflowException as e:
            print(f"warning: the MLflow server at {self.uri} did not record the training dataset "
                  f"({_server_said(str(e))[:200]}); the run's metrics are recorded without it", file=sys.stderr)

    def fetch_model(self, uri: str, dst_root: Path | None = None) -> dict:
        """The model directory of the registered version ``uri`` (``models:/NAME/VERSION`` or
        ``models:/NAME@ALIAS``), downloaded once into ``dst_root/NAME-vVERSION-KEY`` (by default
        KFP_PYTORCH_HOME/registry_models, shared by ``serve start`` and ``serve predict``) and kept
        there: a local server serves from it, and starts from it again after a reboot. Returns
        ``{name, version, alias, model_dir}``; a version that is not there is a RegistryError that names
        the versions there are."""
        import hashlib
        import shutil
        import tempfile

        import yaml
        from mlflow.exceptions import MlflowException

        name, version, alias = parse_registry_uri(uri)
        with _mapped(f"read {uri}", self.uri), _no_bars_in_a_log():
            try:
                mv = (self.client.get_model_version_by_alias(name, alias) if alias
                      else self.client.get_model_version(name, str(version)))
            except MlflowException as e:
                if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    raise
                raise RegistryError(f"{uri}: not in the MLflow registry at {self.uri}",
                                    self._registered_hint(name)) from None
            # named by the registry and the version's own artifacts too: another registry's (or a
            # recreated store's) version 1 of the same name is another model
            key = hashlib.sha256(f"{self.uri}\n{mv.source}\n{mv.run_id}".encode()).hexdigest()[:10]
            dst_root = Path(dst_root) if dst_root is not None else registry_cache()
            dst = dst_root / f"{name}-v{mv.version}-{key}"
            dst_root.mkdir(parents=True, exist_ok=True)
            # one download of a version at a time: two at once (serve start and serve predict) each
            # replaced the folder, the one a server had just started from among them
            with locked(dst_root / f".{dst.name}.lock"):
                if not (dst / "MLmodel").is_file():
                    tmp = Path(tempfile.mkdtemp(dir=dst_root, prefix=f".{name}-v{mv.version}-"))
                    try:  # whole or not at all: a download cut short is not served later as if complete
                        self.mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}",
                                                                 dst_path=str(tmp), tracking_uri=self.uri)
                        shutil.rmtree(dst, ignore_errors=True)
                        os.replace(tmp, dst)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
                os.utime(dst)  # when it was last wanted: `runs --local --keep` spares a download in use
        flavor = (yaml.safe_load((dst / "MLmodel").read_text()) or {}).get("flavors", {}).get("python_function", {})
        rel = ((flavor.get("artifacts") or {}).get("model_dir") or {}).get("path")
        if not rel or not (dst / rel / "metadata.json").is_file():
            raise RegistryError(f"{uri} is not a kfp-pytorch model (its MLflow model has no model_dir artifact)",
                                "serve a version that the pipeline's register step registered")
        return {"name": name, "version": int(mv.version), "alias": alias, "model_dir": dst / rel}

    def _registered_hint(self, name: str) -> str:
        """What the registry holds under ``name``: its versions and aliases, or the models there are."""
        try:
            model = self.client.get_registered_model(name)
        except Exception:  # noqa: BLE001 (no such model, or the registry unreadable: list what is there)
            try:
                names = sorted(m.name for m in self.client.search_registered_models(max_results=50))
            except Exception:  # noqa: BLE001
                names = []
            return (f"there is no registered model {name!r}" + (f"; registered: {', '.join(names)}" if names
                                                                  else "; nothing is registered there yet"))
        versions = sorted(int(v.version) for v in self.client.search_model_versions(f"name='{name}'"))
        aliases = ", ".join(f"@{a} = version {v}" for a, v in sorted((model.aliases or {}).items()))
        return (f"{name!r} has version(s) {', '.join(map(str, versions)) or 'none'}"
                + (f"; aliases: {aliases}" if aliases else ""))

    def champion(self, name: str) -> dict | None:
        """The version holding ``champion`` and its run's metrics; None when the model or alias is absent.

        Only absence means "no champion": any other failure (a 403 from an auth proxy, a server that
        stays at 503) raises, because reading it as "no champion" would promote a worse model.
        """
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

        try:
            model = self.client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                return None
            raise
        version = (model.aliases or {}).get(CHAMPION)
        if version is None:
            return None
        mv = self.client.get_model_version(name, str(version))
        metrics = self.client.get_run(mv.run_id).data.metrics if mv.run_id else {}
        return {"version": mv.version, "run_id": mv.run_id, "metrics": metrics, "tags": dict(mv.tags or {})}

    def register(self, name: str, model_dir: Path, metrics: dict, gate_passed: bool, metric: str = "accuracy",
                 run_id: str | None = None, pip_requirements: list[str] | None = None) -> dict:
        """Log the model as an MLflow pyfunc, register a version, and move ``champion`` if earned.

        ``champion`` moves only when the gate passed and the new model beats the current champion's
        ``test_<metric>`` strictly (a tie keeps the incumbent: no churn for equal models), and only
        between versions that take the same features and give the same classes (:func:`model_interface`,
        kept as the version's ``inputs`` tag): another table's model is registered, never promoted
        over the champion by a metric measured on other data, and never swapped in under its clients.
        """
        import torch

        mlflow = self.mlflow
        here = Path(__file__).parent
        reqs = pip_requirements or [f"torch=={torch.__version__.split('+')[0]}", "numpy"]
        with _mapped("register model", self.uri), _no_bars_in_a_log():
            previous = self.champion(name)
            with mlflow.start_run(run_id=run_id, experiment_id=None if run_id else self.experiment_id):
                mlflow.log_metrics({f"test_{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
                # models from code: the model loads with MLflow, torch and numpy alone (mlflow_model.py)
                with warnings.catch_warnings():  # its signature has parameters and no inputs: no example to give
                    # MLflow colours the message: the filter matches after the colour code
                    warnings.filterwarnings("ignore", message=r"(\x1b\[[0-9;]*m)*An input example was not provided")
                    info = mlflow.pyfunc.log_model(name="model", python_model=str(here / "mlflow_model.py"),
                                                   code_paths=[str(here / "exported_model.py")],
                                                   artifacts={"model_dir": str(model_dir)}, pip_requirements=reqs,
                                                   signature=pyfunc_signature(), registered_model_name=name)
                rid = mlflow.active_run().info.run_id
            versions = self.client.search_model_versions(f"name='{name}' and run_id='{rid}'")
            version = max(int(v.version) for v in versions) if versions else int(info.registered_model_version)
            new_value = float(metrics[metric])
            old_value = previous["metrics"].get(f"test_{metric}") if previous else None
            inputs, summary = model_interface(model_dir)
            # a champion registered before the tag was kept: nothing to tell them apart by
            theirs = previous["tags"].get("inputs") if previous else None
            differ = None not in (theirs, inputs) and theirs != inputs
            promote = gate_passed and not differ and (old_value is None or new_value > old_value)
            self.client.set_model_version_tag(name, str(version), "gate", "passed" if gate_passed else "failed")
            if inputs is not None:
                self.client.set_model_version_tag(name, str(version), "inputs", inputs)
                self.client.set_model_version_tag(name, str(version), "inputs_summary", summary)
            if promote:
                self.client.set_registered_model_alias(name, CHAMPION, str(version))
        return {"name": name, "version": version, "run_id": rid, "champion": promote,
                "previous_champion": int(previous["version"]) if previous else None,
                "previous_value": old_value, "value": new_value, "model_uri": f"models:/{name}/{version}",
                "inputs": summary,
                "previous_inputs": previous["tags"].get("inputs_summary", "other inputs") if differ else None}
