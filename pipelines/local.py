"""Run a registered pipeline end-to-end on this machine with ``kfp.local``.

Before any step runs, :func:`preflight` checks what would otherwise fail halfway: parameters,
that the dataset exists and validates, that the S3 endpoint answers and accepts the credentials,
that the model factory imports, that an MLflow server named as the tracking URI answers, and
that a fixed serving port is free. A run that fails anyway
has its failed task's partial outputs removed, so nothing half-written is left behind, but for
its training checkpoint: a run that failed, was stopped or killed is run again from it with
``resume`` (``kfp-pytorch run --local --resume RUN``).
"""
import collections
import json
import os
import re
import shlex
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kfp_pytorch.components.errors import ConfigError, KfpPytorchError, PipelineFailed, RegistryError, ServingError
from kfp_pytorch.components.paths import home
from kfp_pytorch.components.processes import same_process
from kfp_pytorch.components.serve import port_is_free, port_taken, read_server
from kfp_pytorch.components.storage import Storage, parse_uri
from kfp_pytorch.components.tracking import resolve_tracking_uri, tracking_uri_problem

from .registry import PipelineEntry


def preflight(params: dict, storage: Storage | None = None) -> list[str]:
    """Fail fast, before any step, on bad input a step would only discover later. Returns notes on
    what it did for the run: a ``storage_root`` bucket it made."""
    # here, not at the top: torch and pandas are half a second each, and `runs --local` or
    # `serve list` import this module for what it says of runs and servers, needing neither
    from kfp_pytorch.components.models import build_model, resolve_factory
    from kfp_pytorch.components.prepare_data import (SAMPLE_SCHEME, check_table, encode_labels, feature_names,
                                                     image_shape, load_table, parse_columns)

    if params.get("train_backend", "local") == "local" and isinstance(params.get("workers"), int):
        # the train step's own check, made first (before a table is read, and data prepared) for
        # workers that cannot all start
        import psutil

        from kfp_pytorch.components.errors import TrainingError
        from kfp_pytorch.components.train import local_memory_problem

        if problem := local_memory_problem(params["workers"], psutil.virtual_memory().available):
            raise TrainingError(*problem)
    if "model_arch" in params:
        resolve_factory(params["model_arch"])
    uri = params.get("dataset_uri", "")
    needs_s3 = uri.startswith(("s3://", "minio://")) or params.get("storage_root")
    storage = storage or (Storage() if needs_s3 or not uri.startswith(SAMPLE_SCHEME) else None)
    label = params.get("label_column", "label")
    chosen = parse_columns(params.get("feature_columns", ""))
    table = None
    if uri and not uri.startswith(SAMPLE_SCHEME):
        table = load_table(uri, storage, label)  # a missing table: "dataset not found", with what to give
        check_table(uri, table, label, feature_columns=chosen)
    custom = ":" in params.get("model_arch", "")
    if uri and table is None and (custom or chosen):  # a bundled sample: its columns, for the checks below
        # (as it is, the sample fits every model of the zoo)
        table = load_table(uri, storage, label)
        check_table(uri, table, label, feature_columns=chosen)
    if table is not None and "model_arch" in params:
        # the model, built once for this table's shape as the workers would build it: a factory of
        # the user's own, or cnn on features that are no image, fails here rather than after prepare
        ids, _ = encode_labels(table[label])  # as prepare_data numbers the classes
        build_model(params["model_arch"], len(feature_names(table, label, chosen)), int(ids.max()) + 1,
                    image_shape(table, label, chosen))
    if "tracking_uri" in params:
        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not params["tracking_uri"] and env_uri and (problem := tracking_uri_problem(env_uri, "MLFLOW_TRACKING_URI")):
            # what the steps use when the parameter is empty: MLflow refused it in the train step, a traceback
            raise ConfigError([problem], hint="fix or unset MLFLOW_TRACKING_URI (unset: the embedded sqlite store), "
                                              "or pass --param tracking_uri=...")
        check_tracking_server(resolve_tracking_uri(params["tracking_uri"]))
    port = params.get("serve_port", 0)
    if port:
        mine = read_server(params.get("model_name", ""))
        if not port_is_free("127.0.0.1", port) and not (mine and mine.get("url", "").endswith(f":{port}")):
            raise port_taken(port, "127.0.0.1", "pass --param serve_port=0 for a free port, or stop the process using it",
                             what="serve_port")
    notes = []
    # last, once nothing else refuses the run: a refused one makes no bucket
    if params.get("storage_root") and storage.ensure_bucket(params["storage_root"]):
        # said, not done silently: a misspelt name would put the run's outputs where nobody looks
        bucket = f"s3://{parse_uri(params['storage_root']).bucket}"
        notes.append(f"made the bucket {bucket} for storage_root, as it was not there; if that name is misspelt, "
                     f"`kfp-pytorch storage rb {bucket} --force` removes it with the run's outputs in it")
    return notes


def check_tracking_server(uri: str, timeout: float = 5.0) -> None:
    """An MLflow server given as the tracking URI answers: the train step would find out after
    the data was prepared (and MLflow itself retries for minutes). Any HTTP answer will do (a
    proxy in front may want a login); only no answer at all is refused."""
    if not uri.startswith(("http://", "https://")):
        return  # a store URI (sqlite, postgresql...): MLflow opens it in the step
    import requests

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout)
    except requests.RequestException as e:
        raise RegistryError(f"cannot reach the MLflow tracking server at {uri} ({type(e).__name__})",
                            "check tracking_uri and that `mlflow server` is running; "
                            "leave it empty for the embedded sqlite store") from None


@dataclass
class LocalRun:
    pipeline: str
    run_dir: Path
    succeeded: bool
    outputs: dict = field(default_factory=dict)
    """task name -> executor output (parameterValues and artifacts)."""
    failed_task: str | None = None
    elapsed_s: float = 0.0
    error: str | None = None
    """The failed task's own error (its last exception line, list items and hint), from its log."""
    checkpoint: dict | None = None
    """The failed task's training checkpoint, kept (the rest of its outputs went), which `run
    --resume` trains on from: ``{"uri": its folder, "epochs": the whole epochs it holds}``; None:
    it left none (:func:`_failed_checkpoint`)."""
    resumed_from: str | None = None
    """The local run whose last training checkpoint this one started from."""
    params: dict = field(default_factory=dict)
    """The parameters it ran with (what the summary's hints repeat: the registry, the serving backend)."""

    def raise_for_status(self) -> "LocalRun":
        """This run, when it succeeded; else :class:`PipelineFailed` with the failed step, its error and
        the run's log, for code (a notebook) that goes on to read the run's outputs."""
        if self.succeeded:
            return self
        raise PipelineFailed(failure_line(self.pipeline, self.failed_task, self.error),
                             f"the run's whole log: {self.run_dir / RUN_LOG}")


def failure_line(pipeline: str, failed_task: str | None, error: str | None) -> str:
    """``pipeline train_and_serve failed in train-op:`` and the step's error below it. Pure."""
    said = f"pipeline {pipeline} failed" + (f" in {failed_task}" if failed_task else "")
    return said + (":\n" + "\n".join(f"  {line}" for line in error.splitlines()) if error else "")


RUN_LOG = "run.log"
"""A local run's whole log, beside its outputs (the terminal shows it without kfp.local's plumbing)."""

_KFP_PLUMBING = re.compile(r"^\s*\[KFP Executor [^\]]* INFO\]: (Looking for component|Loading KFP component|"
                           r"Wrote executor output file|Got executor_input:)")
_KFP_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} - [A-Z]+ - ")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _Tee:
    """sys.stdout for a run: kfp.local prints each step's log with print(), line by line. Every line
    goes to ``log`` (the run's whole log) and into ``lines`` (the last ones, where a failed step's
    error is read); the terminal gets each one too, unless ``condensed``, where kfp.local's plumbing
    is left out: each step's executor input as JSON, its outputs' repr, the executor's own INFO
    lines and blank separators (about 400 of a run's 500 lines). A step's own output, warnings and
    errors, and kfp.local's task lines, still show."""

    def __init__(self, inner, log=None, condensed: bool = False, keep: int = 600):
        self.inner, self.log, self.condensed = inner, log, condensed
        self.lines, self._part, self._skip = collections.deque(maxlen=keep), "", None
        # kfp.local colours its lines whatever they go to: a file or a pipe (CI's log, nohup) gets
        # them plain, as does a terminal under NO_COLOR (no-color.org); the run's log keeps them
        self.plain = bool(os.environ.get("NO_COLOR")) or not _isatty(inner)

    def write(self, text: str) -> int:
        if self.log is not None:
            self.log.write(text)
        if not self.condensed:
            self.inner.write(_ANSI.sub("", text) if self.plain else text)
        *done, self._part = (self._part + text).split("\n")
        self.lines.extend(done)
        if self.condensed:
            shown = []
            for line in done:  # each line's colours are stripped once: to judge it, and to show it plain
                bare = _ANSI.sub("", line)
                if self._shown(bare):
                    shown.append(f"{bare if self.plain else line}\n")
            if shown:
                self.inner.write("".join(shown))
        return len(text)

    def _shown(self, line: str) -> bool:
        if self._skip == "json":  # the executor input, "    {" to "    }"
            if line.rstrip() == "    }":
                self._skip = None
            return False
        if self._skip == "outputs":  # the outputs' repr, up to kfp.local's next line
            if not (_KFP_LOG_LINE.match(line) or line.startswith("-" * 20)):
                return False
            self._skip = None
        if m := _KFP_PLUMBING.match(line):
            self._skip = "json" if m.group(1) == "Got executor_input:" else None
            return False
        if _KFP_LOG_LINE.match(line) and (" outputs:" in line or "has no outputs" in line
                                          or line.rstrip().endswith("Streamed logs:")):
            self._skip = "outputs" if line.rstrip().endswith("outputs:") else None
            return False
        return bool(line.strip()) and not line.startswith("-" * 20)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()
        self.inner.flush()

    def __getattr__(self, name):  # isatty, encoding, fileno ... as the real stream
        return getattr(self.inner, name)


_EXC_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.*)$")


def error_of(lines) -> str | None:
    """The last exception a step's log shows, without module paths, with the list items and the
    hint our errors print under it; None when the log shows none."""
    lines = [_ANSI.sub("", line) for line in lines]
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC_LINE.match(lines[i].strip())
        if m is None or lines[i].lstrip().startswith("[rank"):
            continue
        message = f"{m.group(1)}: {m.group(2)}".split("; last lines:")[0]
        out = [re.sub(r"\b(?:[a-z_]\w*\.)+(?=[A-Z]\w*Error\b)", "", message)]
        for line in lines[i + 1:]:
            text = line.strip()
            if text.startswith("- ") and len(out) < 12:
                out.append(f"  {text}")
            elif text.startswith("hint: "):
                out.append(f"  {text}")
                break
        return "\n".join(out)
    return None


def _run_dir_with_log(root: Path, before: set, log, log_path: Path) -> Path | None:
    """The folder kfp.local made for this run (the newest new one; None if it made none), with the
    run's whole log moved in as ``run.log``; the log is never left beside the runs."""
    log.close()
    new = sorted((p for p in set(root.iterdir()) - before if p != log_path and p.is_dir()),
                 key=lambda p: p.stat().st_mtime)
    if new:
        try:
            os.replace(log_path, new[-1] / RUN_LOG)
        except OSError:  # a full disk or a folder gone: the terminal had the log, the outputs stay
            pass
    log_path.unlink(missing_ok=True)
    return new[-1] if new else None


def _remove_partial_outputs(task_dir: Path) -> list[Path]:
    """Remove a failed step's partial outputs, all but its training checkpoints (a folder
    ``checkpoints`` with the resume state in it), which `run --resume` trains on from; returns
    those kept."""
    from kfp_pytorch.components.train import RESUME_STATE

    state = Path(RESUME_STATE)
    kept = [f.parent for f in task_dir.rglob(state.name) if f.parent.name == state.parent.name]
    if not kept:
        shutil.rmtree(task_dir, ignore_errors=True)
        return []
    for path in sorted(task_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # deepest first
        if any(path == k or k in path.parents or path in k.parents for k in kept):
            continue  # a checkpoint, in one, or a folder that holds one
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return kept


def _failed_checkpoint(run_dir: Path, failed: str, params: dict) -> dict | None:
    """Remove the failed task's partial outputs, but for its training checkpoint; where that is
    (``{"uri", "epochs"}``, :attr:`LocalRun.checkpoint`): in its folder, or with ``storage_root``
    where the step wrote it, on S3 (None: it left none; where the S3 server cannot say, the one its
    training noted, :func:`_noted_checkpoint`)."""
    from kfp_pytorch.components.storage import join
    from kfp_pytorch.components.train import RESUME_STATE

    kept = _remove_partial_outputs(run_dir / failed) if (run_dir / failed).exists() else []
    if kept:
        return {"uri": str(kept[0]), "epochs": _state_epochs(kept[0].parent / RESUME_STATE)}
    if not params.get("storage_root"):
        return None
    storage = Storage()
    try:  # where the step wrote (:func:`.._kfp.artifact_store_uri`): ROOT/RUN/TASK/OUTPUT/checkpoints
        states = [e.uri for e in storage.entries(join(params["storage_root"], run_dir.name, failed))
                  if e.uri.endswith("/" + RESUME_STATE)]
        epochs = _state_epochs(states[0], storage) if states else None
    except KfpPytorchError:  # the server is down or refuses now (what failed the step, may be): as training noted it
        return _noted_checkpoint(run_dir)
    return {"uri": states[0].rsplit("/", 1)[0], "epochs": epochs} if epochs is not None else None


def _state_epochs(uri, storage: Storage | None = None) -> int | None:
    """The whole epochs a training checkpoint's resume state (:data:`..train.RESUME_STATE`, a
    path or URI) says it holds; None where it is gone or damaged."""
    try:
        epoch = json.loads(Path(uri).read_text() if storage is None else storage.read_bytes(str(uri))).get("epoch")
    except (OSError, ValueError, AttributeError, KfpPytorchError):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _read_outputs(run_dir: Path) -> dict:
    out = {}
    for f in sorted(run_dir.glob("*/executor_output.json")):
        out[f.parent.name] = json.loads(f.read_text())
    return out


def trained_some(run_dir: Path) -> bool:
    """Whether a local run that ended early got as far as a training checkpoint, which `run
    --resume` starts from: one in its folder, or one on S3 (``storage_root``) its training noted."""
    return _checkpoint_epochs(run_dir) is not None or _noted_checkpoint(run_dir) is not None


def resumed_params(entry: PipelineEntry, name: str, root: Path | None = None) -> tuple[str, dict]:
    """The local run ``name`` of ``entry`` (its name, or its folder as a shell completes it) and the
    parameters it was given, to run it again from its last training checkpoint (:func:`run_local`'s
    ``resume`` takes the name); a ConfigError that says what to do where it cannot be: no such run,
    one still running, another pipeline's, or one that kept no parameters."""
    root = Path(root or home() / "local_outputs")
    given = Path(name.rstrip("/")) if name else None
    if given and given.name and (given.parent == Path(".") or given.resolve().parent == root.resolve()):
        name = given.name
    if not given or given.name != name or not (root / name).is_dir():
        raise ConfigError([f"--resume: no local run {name!r} under {root}"], "`kfp-pytorch runs --local` lists them",
                          title="cannot resume")
    [run] = local_runs(root, only=name)
    if run.status in ("RUNNING", "RUNNING?"):
        how = (f"stop it first (kill {run.owner_pid}, or Ctrl-C where it runs)" if run.owner_pid
               else "wait for it to end, or stop it first")
        raise ConfigError([f"--resume: {name} is still running"], how, title="cannot resume")
    if run.pipeline and run.pipeline != entry.name:
        raise ConfigError([f"--resume: {name} is a run of pipeline {run.pipeline}, not {entry.name}"],
                          f"kfp-pytorch run {run.pipeline} --local --resume {name}", title="cannot resume")
    if not run.params:
        raise ConfigError([f"--resume: {name} kept no record of its parameters (it ran before runs did, or its "
                           "record is damaged)"], "run the pipeline again with its -p parameters", title="cannot resume")
    return name, dict(run.params)


def refuse_idle_resume(name: str, params: dict, root: Path | None = None) -> None:
    """A ConfigError where resuming the local run ``name`` with ``params`` would do nothing new:
    it succeeded with these very parameters, so its checkpoint holds every epoch asked for, and the
    rest would only register the same model again. One that failed or was stopped is resumed as it
    is (its later steps run again); with a parameter changed (more epochs) too."""
    found = local_runs(Path(root or home() / "local_outputs"), only=name)
    if not found or found[0].status != "SUCCEEDED" or not found[0].params:
        return
    if json.loads(json.dumps(params, default=str)) != found[0].params:  # as the record keeps them
        return
    epochs = found[0].params.get("epochs")
    raise ConfigError([f"--resume: {name} succeeded with these parameters: resumed unchanged, it would train no "
                       "epoch more and register the same model again"],
                      (f"-p epochs=N, more than its {epochs}, trains on from its last checkpoint; "
                       if isinstance(epochs, int) else "")
                      + "leave out --resume to train anew", title="nothing to resume")


def run_local(entry: PipelineEntry, params: dict, pipeline_root: Path | None = None,
              verbose: bool = False, out=None, resume: str | None = None) -> LocalRun:
    """Run ``entry`` with validated ``params`` through kfp.local's SubprocessRunner. Its whole log is
    kept as the run's ``run.log``; ``out`` (default stdout; stderr where stdout is for JSON) shows it
    without kfp.local's plumbing unless ``verbose``. ``resume``: the name of an earlier local run
    (under the same root) whose last training checkpoint the train step starts from, as a retried
    KFP run's does from its own; :func:`resumed_params` gives its parameters."""
    import kfp.local

    from kfp_pytorch.components._kfp import RESUME_ENV, RUN_PARAMS_ENV
    from kfp_pytorch.components.processes import RUN_OWNER_ENV, run_owner_token

    root = Path(pipeline_root or home() / "local_outputs")
    if resume and (Path(resume).name != resume or not (root / resume).is_dir()):
        raise ConfigError([f"resume: no local run {resume!r} under {root}"],
                          "give a run's name, as resumed_params returns it", title="cannot resume")
    if resume:
        refuse_idle_resume(resume, params, root)
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.iterdir())
    # use_venv=False: steps run in this environment, where kfp_pytorch is installed (as in the image).
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    error: Exception | None = None
    import time

    t0 = time.perf_counter()
    # the run's folder is kfp.local's to make: the log is written beside it, and moved in at the end
    log_path = root / f".{entry.name}-{os.getpid()}-{time.time_ns()}.log"
    log = open(log_path, "w", encoding="utf-8", errors="replace")
    # kfp.local prints to sys.stdout (its logger's handler is made on it too): the tee stands in
    real_stdout = sys.stdout
    tee = sys.stdout = _Tee(out or sys.stdout, log, condensed=not verbose)
    # the steps' environment names this process (training stops if it is killed outright), the
    # pipeline and its parameters (left in the run's folder: `runs --local`, `run --resume`)
    env_before = {k: os.environ.get(k) for k in (RUN_OWNER_ENV, RUN_PARAMS_ENV, RESUME_ENV)}
    os.environ[RUN_OWNER_ENV] = run_owner_token()
    os.environ[RUN_PARAMS_ENV] = json.dumps({"pipeline": entry.name, "params": params}, default=str)
    os.environ.pop(RESUME_ENV, None)
    if resume:
        os.environ[RESUME_ENV] = resume
    try:
        with warnings.catch_warnings():
            # kfp.local warns, for every step, that display names do nothing locally and that a
            # non-Python image may lack dependencies: the image is ours, and its package is the one
            # installed here (use_venv=False), so 20 lines of noise would bury the run's own log
            warnings.filterwarnings("ignore", message=r"Task '.*': settings \['display_name'\] have no effect")
            warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom or non-Python")
            entry.func(**params)
    except RuntimeError as e:  # kfp.local: "Pipeline ... FAILURE. Inner task failed: 'x'"
        error = e
    except BaseException as e:  # Ctrl-C or a stop signal: the run is recorded as canceled, then the stop goes on
        sys.stdout = real_stdout
        if canceled := _run_dir_with_log(root, before, log, log_path):
            _write_run_record(LocalRun(entry.name, canceled, False, elapsed_s=time.perf_counter() - t0,
                                       resumed_from=resume), params, status="CANCELED")
            e.local_run = canceled  # for the caller's word on it: which run, and how to train on
        raise
    finally:
        sys.stdout = real_stdout
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    run_dir = _run_dir_with_log(root, before, log, log_path) or root
    outputs = _read_outputs(run_dir)
    elapsed = time.perf_counter() - t0
    if error is None:
        run = LocalRun(entry.name, run_dir, True, outputs, elapsed_s=elapsed)
    else:
        failed = failed_task_of(str(error))
        run = LocalRun(entry.name, run_dir, False, outputs, failed, elapsed, error_of(tee.lines),
                       checkpoint=_failed_checkpoint(run_dir, failed, params) if failed and run_dir != root else None)
    run.resumed_from, run.params = resume, dict(params)
    if run_dir != root:
        _write_run_record(run, params)
    return run


RUN_RECORD = "run.json"
"""Written into a local run's directory when the run ends: pipeline, status, failed task, parameters."""
ACTIVE_WINDOW_S = 3600.0
"""A run with no record (still running, or stopped by a kill) that wrote within this long is left alone."""


def _write_run_record(run: LocalRun, params: dict, status: str | None = None) -> None:
    import time

    record = {"pipeline": run.pipeline, "status": status or ("SUCCEEDED" if run.succeeded else "FAILED"),
              "failed_task": run.failed_task, "elapsed_s": round(run.elapsed_s, 2),
              **({"resumed_from": run.resumed_from} if run.resumed_from else {}),
              **({"checkpoint": run.checkpoint} if run.checkpoint else {}),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "params": params,
              "result": run_result(summarize(run))}
    tmp = run.run_dir / f".{RUN_RECORD}.tmp"  # whole or not at all: a reader never sees half a record
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(run.run_dir / RUN_RECORD)


def run_result(summary: dict) -> dict:
    """What a run came to, kept in its record for `runs --local`: the test metrics worth comparing
    across runs, the gate's verdict and the registered version. Pure."""
    out: dict = {}
    metrics = {k: summary["metrics"][k] for k in ("accuracy", "macro_f1", "min_recall", "roc_auc")
               if k in summary.get("metrics", {})}
    if metrics:
        out["metrics"] = metrics
    if "gate_passed" in summary:
        out["gate_passed"] = summary["gate_passed"]
    if summary.get("model"):
        out["model"] = {k: summary["model"].get(k) for k in ("registry_uri", "champion")}
    if summary.get("failed_task"):  # why it failed, at a glance: the error's own line (its log has the rest)
        error = (summary.get("error") or "").strip().splitlines()
        out["failed"] = summary["failed_task"] + (f": {error[0].strip()}" if error else "")
    return out


def result_line(result: dict, params: dict | None = None, champion_until: int | None = None) -> str:
    """``accuracy 0.9333, models:/digits/3 (champion)``: a run's result on one line ('' for none);
    a failed gate with what it read, where the run's ``params`` say (``gate failed: min_recall
    0.8500 < 0.9000``); ``champion_until``: the version of a later run that took the alias over
    (``(champion until version 5)``, see :func:`later_champions`)."""
    parts, metrics, params = [], result.get("metrics", {}), params or {}
    if "accuracy" in metrics:
        parts.append(f"accuracy {metrics['accuracy']:.4f}")
    if result.get("gate_passed") is False:
        metric, threshold = params.get("gate_metric", "accuracy"), params.get("threshold")
        parts.append(f"gate failed: {metric} {metrics[metric]:.4f} < {float(threshold):.4f}"
                     if metric in metrics and isinstance(threshold, (int, float)) else "gate failed")
    if result.get("model"):
        m = result["model"]
        until = "" if champion_until is None else f" until version {champion_until}"
        parts.append(m["registry_uri"] + (f" (champion{until})" if m.get("champion") else ""))
    if isinstance(failed := result.get("failed"), str):
        parts.append(f"failed in {failed if len(failed) <= 120 else failed[:117] + '...'}")
    return ", ".join(parts)


def later_champions(runs: list) -> dict[str, int]:
    """Run name -> the version that took the ``champion`` alias from its model later, among these
    local runs (each run's record says only that its version became champion when it ran: without
    this, every run that ever promoted one was listed as the champion). Versions of one registry
    and name only grow, so the next higher champion version is the one that followed. Pure."""
    from kfp_pytorch.components.tracking import registered_version

    lines: dict[tuple, list[tuple[int, str]]] = {}
    for r in runs:
        model = (r.result or {}).get("model") or {}
        # a damaged record makes no claim either way
        if model.get("champion") and (got := registered_version(model.get("registry_uri"))):
            name, version = got  # one registry: the run's tracking_uri ('' is this home's embedded store)
            lines.setdefault(((r.params or {}).get("tracking_uri") or "", name), []).append((version, r.name))
    out = {}
    for promoted in lines.values():
        promoted.sort()
        out.update({run: later for (_, run), (later, _) in zip(promoted, promoted[1:])})
    return out


@dataclass
class LocalRunInfo:
    """One directory under the local pipeline root, as `runs --local` lists it."""

    name: str
    path: Path
    status: str
    """SUCCEEDED, FAILED or CANCELED from its record. Without one: RUNNING while the process running it
    lives, KILLED once that process ended without recording the end (a kill -9, the OOM killer, a
    notebook kernel's restart); for a run whose steps did not say which process that was (a run
    from before they did): RUNNING? when it wrote within the hour, else UNKNOWN."""
    modified: float
    """The newest write under it (seconds since the epoch)."""
    size: int
    steps: list[str]
    """Tasks that finished (they left an executor output)."""
    served_by: list[str] = field(default_factory=list)
    """Local model servers whose model is in this run, ``NAME (down)`` for one that is down (`serve
    start` starts it again): never pruned."""
    params: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    """:func:`run_result` of its record: metrics, the gate's verdict, the registered version."""
    elapsed_s: float | None = None
    """How long it ran, from its record (None without one)."""
    owner_pid: int | None = None
    """The process running it, while it runs (status RUNNING)."""
    checkpoint_epochs: int | None = None
    """A run that ended early (CANCELED, KILLED, FAILED): the whole epochs its last training
    checkpoint holds, which `run --resume` trains on from (None: it has none here)."""
    log: Path | None = None
    """Its whole log: ``run.log`` in it once it ended; while it runs, the one its process writes
    beside the runs (moved in at the end), for ``tail -f``."""
    pipeline: str | None = None
    """The pipeline it ran, from its record or its steps (None: neither says)."""
    resumed_from: str | None = None
    """The local run whose last training checkpoint it started from (`run --resume`), from its record."""
    remote: str | None = None
    """Where its steps wrote their artifacts on S3, a run with ``storage_root``: ``s3://BUCKET/ROOT/RUN``
    (:func:`.._kfp.artifact_store_uri`), which pruning the run removes too."""


def _seconds(value) -> float | None:
    """A record's duration, or None for what is not one (a record edited by hand)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _served_models() -> list[tuple[str, str]]:
    """(server, :func:`_place` of its model) of every local server record; ``NAME (down)`` for one
    that is down: it keeps its model too, since `serve start` starts it again with that model."""
    from kfp_pytorch.components.serve import list_servers

    return [(s["name"] if s.get("alive") else f"{s['name']} (down)", place)
            for s in list_servers() if s.get("model_uri") and (place := _place(s["model_uri"]))]


def _place(uri: str) -> str | None:
    """A model's or a run's place, comparable with another's: the resolved path of a local one,
    ``s3://BUCKET/KEY`` for one on S3 (``minio://`` too); None for any other (``models:/``)."""
    if "://" not in uri:
        return str(Path(uri).resolve())
    try:
        loc = parse_uri(uri)
    except KfpPytorchError:  # a record edited by hand
        return None
    return f"s3://{loc.bucket}/{loc.key.strip('/')}" if loc.is_s3 else str(Path(loc.key).resolve())


def _tree_stat(d: Path) -> tuple[int, float]:
    """The bytes of the files under ``d``, and its newest write (seconds since the epoch)."""
    size, modified = 0, d.stat().st_mtime
    for f in d.rglob("*"):
        try:
            st = f.lstat()
        except FileNotFoundError:  # removed while listed
            continue
        modified = max(modified, st.st_mtime)
        size += st.st_size if f.is_file() else 0
    return size, modified


def _served_by(served: list[tuple[str, str]], *places: str | None) -> list[str]:
    """The servers whose model is in one of ``places`` (:func:`_place`s) or below it."""
    return [n for n, m in served if any(p and (m == p or m.startswith(p.rstrip("/") + "/")) for p in places)]


def _run_start(run_dir: Path) -> dict:
    """What a local run's steps left of it when they started (:func:`.._kfp.mark_local_run`): its
    process, pipeline and parameters; {} where they left nothing (a run from before they did) or
    what is there cannot be read."""
    from kfp_pytorch.components._kfp import RUN_START_FILE

    try:
        start = json.loads((run_dir / RUN_START_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return start if isinstance(start, dict) else {}


def _run_owner(start: dict) -> dict | None:
    """The process running a local run, from :func:`_run_start`; None where its steps left none,
    or what is there names no process (a file edited by hand)."""
    owner = start.get("owner")
    pid = owner.get("pid") if isinstance(owner, dict) else None
    return owner if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _live_log(root: Path, pid: int) -> Path | None:
    """The log a local run's process writes beside the runs until it ends (:func:`run_local` names
    it after the pipeline, its pid and when it started; the newest where a pid was given again), or
    None where there is none. A run killed outright leaves it there."""
    logs = sorted(root.glob(f".*-{pid}-*.log"), key=lambda p: p.name.rsplit("-", 1)[-1].zfill(24))
    return logs[-1] if logs else None


def _checkpoint_epochs(run_dir: Path) -> int | None:
    """The whole epochs of a local run's last training checkpoint in its folder (None: none there)."""
    from kfp_pytorch.components.train import RESUME_STATE

    return next((e for state in run_dir.glob(f"*/*/{RESUME_STATE}") if (e := _state_epochs(state)) is not None), None)


def _noted_checkpoint(run_dir: Path) -> dict | None:
    """The last training checkpoint a local run's train step wrote to S3 (``storage_root``), as its
    training noted it in the run's folder (:func:`.._kfp.note_checkpoint`): ``{"uri", "epochs"}``,
    the newest where several steps trained; None where none was noted (or the note is damaged)."""
    from kfp_pytorch.components._kfp import CHECKPOINT_NOTE_GLOB

    notes = []
    for f in run_dir.glob(CHECKPOINT_NOTE_GLOB):
        try:
            note, written = json.loads(f.read_text()), f.stat().st_mtime
        except (OSError, ValueError):
            continue
        if not isinstance(note, dict):  # a file edited by hand
            continue
        epochs = note.get("epochs")
        if isinstance(note.get("uri"), str) and isinstance(epochs, int) and not isinstance(epochs, bool):
            notes.append((written, f.name, {"uri": note["uri"], "epochs": epochs}))
    return max(notes)[2] if notes else None


def _ended_early_checkpoint(run_dir: Path, record: dict | None) -> int | None:
    """The whole epochs of the last training checkpoint of a local run that ended early: the one in
    its folder, else (a run with ``storage_root``) the one on S3 its training noted, or its record
    names. The listing asks no server."""
    if (epochs := _checkpoint_epochs(run_dir)) is not None:
        return epochs
    if noted := _noted_checkpoint(run_dir):  # as training left it: a canceled or killed run has no word on it else
        return noted["epochs"]
    kept = (record or {}).get("checkpoint")
    epochs = kept.get("epochs") if isinstance(kept, dict) and "://" in str(kept.get("uri")) else None
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None


def local_runs(root: Path | None = None, now: float | None = None, only: str | None = None) -> list[LocalRunInfo]:
    """The local runs under ``root`` (default ``KFP_PYTORCH_HOME/local_outputs``), newest first;
    ``only``: the run of that name alone (none: no such run)."""
    import time

    root = Path(root or home() / "local_outputs")
    now = time.time() if now is None else now
    served = _served_models()
    out = []
    for d in (root.iterdir() if root.is_dir() else []):
        if not d.is_dir() or (only is not None and d.name != only):
            continue
        size, modified = _tree_stat(d)
        ended = (d / RUN_RECORD).exists()  # the record is written when the run ends
        try:
            record = json.loads((d / RUN_RECORD).read_text())
        except (OSError, ValueError):  # damaged (a disk filled up): the run has ended all the same
            record = None
        if not isinstance(record, dict):
            record = None
        start = _run_start(d)
        owner = None if ended else _run_owner(start)
        if record is not None:
            status = record.get("status", "UNKNOWN")
        elif owner is not None:  # its steps said which process runs it: no guessing from the clock
            status = "RUNNING" if same_process(owner) else "KILLED"
        else:
            status = "RUNNING?" if not ended and now - modified < ACTIVE_WINDOW_S else "UNKNOWN"
        def known(key: str):  # what the run's record says, else what its steps said when it started
            return (record or {}).get(key) or start.get(key)

        params = known("params") or {}
        root_uri = params.get("storage_root") if isinstance(params, dict) else None
        remote = _place(f"{root_uri.rstrip('/')}/{d.name}") if isinstance(root_uri, str) and "://" in root_uri else None
        remote = remote if remote and remote.startswith("s3://") else None
        log = (d / RUN_LOG if (d / RUN_LOG).is_file()
               else _live_log(root, owner["pid"]) if status in ("RUNNING", "KILLED") else None)
        out.append(LocalRunInfo(
            d.name, d, status, modified, size, steps=sorted(f.parent.name for f in d.glob("*/executor_output.json")),
            served_by=_served_by(served, _place(str(d)), remote), params=params, remote=remote,
            result=(record or {}).get("result", {}), elapsed_s=_seconds((record or {}).get("elapsed_s")),
            owner_pid=owner["pid"] if status == "RUNNING" else None,
            checkpoint_epochs=_ended_early_checkpoint(d, record) if status in ("CANCELED", "KILLED", "FAILED") else None,
            log=log, pipeline=known("pipeline"),
            resumed_from=resumed if isinstance(resumed := (record or {}).get("resumed_from"), str) else None))
    return sorted(out, key=lambda r: (r.modified, r.name), reverse=True)


@dataclass
class RegistryDownload:
    """A registered version downloaded to be served here (``serve start --model-uri models:/...``)."""

    name: str
    """``NAME-vVERSION-KEY``, as :meth:`~kfp_pytorch.components.tracking.Tracker.fetch_model` names it."""
    path: Path
    size: int
    used: float
    """When it was last downloaded or wanted (seconds since the epoch)."""
    served_by: list[str] = field(default_factory=list)


def registry_downloads(root: Path | None = None) -> list[RegistryDownload]:
    """The registered versions downloaded under ``root`` (default :func:`registry_cache`), most recently
    used first. Dot entries are left out: a download in progress and the locks."""
    from kfp_pytorch.components.tracking import registry_cache

    root = Path(root or registry_cache())
    served = _served_models()
    out = []
    for d in (root.iterdir() if root.is_dir() else []):
        if d.name.startswith(".") or not d.is_dir():
            continue
        out.append(RegistryDownload(d.name, d, _tree_stat(d)[0], d.stat().st_mtime, _served_by(served, _place(str(d)))))
    return sorted(out, key=lambda r: (r.used, r.name), reverse=True)


def prune_registry_downloads(root: Path | None = None, now: float | None = None,
                             dry_run: bool = False) -> tuple[list[RegistryDownload], list[RegistryDownload]]:
    """Remove the downloaded versions no local server record uses (the registry keeps them: `serve
    start --model-uri` downloads one again); returns (removed, spared). Spared: one a server serves (or
    served, and is down), and one wanted within the hour (a `serve start` or `serve predict` may be
    about to use it). Each is removed under its download lock, so none goes while it downloads."""
    import time

    from kfp_pytorch.components.paths import locked
    from kfp_pytorch.components.tracking import registry_cache

    root = Path(root or registry_cache())
    now = time.time() if now is None else now
    removed, spared = [], []
    for r in registry_downloads(root):
        if r.served_by or now - r.used < ACTIVE_WINDOW_S:
            spared.append(r)
            continue
        if not dry_run:
            with locked(root / f".{r.name}.lock"):
                try:  # wanted again since it was listed: kept
                    if r.path.stat().st_mtime > r.used:
                        spared.append(r)
                        continue
                except FileNotFoundError:  # another prune took it
                    continue
                shutil.rmtree(r.path)
        removed.append(r)
    return removed, spared


PILE_RUNS, PILE_BYTES = 20, 5 * 1024**3
"""Past either, the end of a local run says how much older runs hold and how to remove them."""


def pile_note(root: Path | None = None) -> str | None:
    """A note when the local runs have piled up (more than 20, or more than 5 GB); None otherwise."""
    runs = local_runs(root)
    size = sum(r.size for r in runs)
    if len(runs) <= PILE_RUNS and size <= PILE_BYTES:
        return None
    return (f"{len(runs)} local runs hold {size / 1024**3:.1f} GB under {Path(root or home() / 'local_outputs')}; "
            "`kfp-pytorch runs --local --keep 5` removes all but the newest 5 (a served model's run is kept)")


class Pruned(NamedTuple):
    """What :func:`prune_local_runs` did."""

    removed: list[LocalRunInfo]
    spared: list[LocalRunInfo]
    """Kept, whatever their age: served, or still running."""
    failed: list[tuple[LocalRunInfo, str]]
    """Kept because their artifacts on S3 could not be removed (the error, with what to do): its
    folder is what says where they are, so it goes only once they have."""


def prune_local_runs(keep: int, root: Path | None = None, now: float | None = None,
                     dry_run: bool = False, storage: Storage | None = None, remote: bool = True) -> Pruned:
    """Remove all but the newest ``keep`` local runs, and for a run with ``storage_root`` its
    artifacts on S3 (:attr:`LocalRunInfo.remote`) first (not ``remote``: they stay). Spared,
    whatever their age: a run whose model a local server serves (or served, and is down: `serve
    start` needs it), and a run still running: its process lives, or, for a run whose steps did
    not name its process, it has no record and wrote within the last hour."""
    if keep < 0:
        raise ValueError("keep must be >= 0")
    runs = local_runs(root, now)
    out = Pruned([], [], [])
    for r in runs[keep:]:
        if r.served_by or r.status in ("RUNNING", "RUNNING?"):
            out.spared.append(r)
            continue
        if not dry_run:
            if r.remote and remote:
                storage = storage or Storage()
                try:
                    storage.delete_prefix(r.remote)
                except KfpPytorchError as e:  # unreachable, or refused: the next prune tries again
                    out.failed.append((r, str(e)))
                    continue
            shutil.rmtree(r.path)
            if r.log and r.log.parent == r.path.parent:  # a killed run's log, left beside the runs
                r.log.unlink(missing_ok=True)
        out.removed.append(r)
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failed_task_of(message: str) -> str | None:
    """The failed task's name in kfp.local's error (``... Inner task failed: 'train-op'.``, with
    terminal colour codes around the name), or None."""
    m = re.search(r"Inner task failed: '([\w.-]+)'", _ANSI.sub("", message))
    return m.group(1) if m else None


_STEP_NOTE = re.compile(r"\[kfp-pytorch\] (note: .*)")


def step_notes(log: Path) -> list[str]:
    """The notes the steps printed as ``[kfp-pytorch] note: ...`` (a batch that makes one step an
    epoch, more workers than CPUs), each once, in order: the summary repeats them below its lines,
    where a failed gate is read, not among hundreds of lines of the steps' logs."""
    notes: dict[str, None] = {}
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            if m := _STEP_NOTE.search(_ANSI.sub("", line)):
                notes[m.group(1).rstrip()] = None
    return list(notes)


def summarize(run: LocalRun) -> dict:
    """The facts a user wants at the end: metrics, model version, endpoint, artifact locations."""
    o = run.outputs
    s: dict = {"pipeline": run.pipeline, "status": "SUCCEEDED" if run.succeeded else "FAILED", "run_dir": str(run.run_dir),
                "elapsed_s": round(run.elapsed_s, 2)}
    if (run.run_dir / RUN_LOG).is_file():
        s["log"] = str(run.run_dir / RUN_LOG)
        if notes := step_notes(run.run_dir / RUN_LOG):
            s["notes"] = notes
    if run.failed_task:
        s["failed_task"] = run.failed_task
    if run.error:
        s["error"] = run.error
    if run.checkpoint:
        s["checkpoint"] = run.checkpoint
    if run.resumed_from:
        s["resumed_from"] = run.resumed_from
    arts = {}
    for task, ex in o.items():
        for name, a in ex.get("artifacts", {}).items():
            art = a["artifacts"][0]
            arts[f"{task}.{name}"] = art.get("metadata", {}).get("uri") or art.get("uri")
    s["artifacts"] = arts
    data = o.get("prepare-data-op", {}).get("artifacts", {}).get("dataset", {}).get("artifacts", [{}])[0].get(
        "metadata", {})
    if "rows" in data:
        s["data"] = {k: data[k] for k in ("rows", "num_features", "classes", "duplicates", "source_format") if k in data}
    ev = o.get("evaluate-op", {})
    for name, a in ev.get("artifacts", {}).items():
        if name == "metrics":
            s["metrics"] = a["artifacts"][0].get("metadata", {})
    cm = ev.get("artifacts", {}).get("confusion", {}).get("artifacts", [{}])[0].get("metadata", {}).get(
        "confusionMatrix")
    if cm:  # as the KFP UI has it: the classes' names and the matrix's rows
        from kfp_pytorch.components.evaluate import weakest_class

        s["confusion"] = {"classes": [a["displayName"] for a in cm["annotationSpecs"]], "rows": [r["row"] for r in cm["rows"]]}
        if weak := weakest_class(s["confusion"]["classes"], s["confusion"]["rows"]):
            s["weakest_class"] = weak
    tm = o.get("train-op", {}).get("artifacts", {}).get("metrics", {}).get("artifacts", [{}])[0].get("metadata", {})
    if "epochs_trained" in tm:  # which epoch's model went on: the last, or the best before an early stop
        s["training"] = {"epochs_trained": int(tm["epochs_trained"]), "exported_epoch": int(tm["exported_epoch"]),
                         "val_accuracy": tm.get("final_val_accuracy")}
    if "evaluate-op" in o:
        s["gate_passed"] = bool(ev.get("parameterValues", {}).get("Output"))
    reg = o.get("register-op", {}).get("parameterValues", {})
    if reg:
        s["model"] = {"registry_uri": reg.get("registry_uri"), "version": reg.get("version"),
                      "champion": reg.get("champion")}
    sv = o.get("serve-op", {}).get("parameterValues", {})
    if sv.get("endpoint"):
        s["endpoint"] = sv.get("endpoint")
        s["server_url"] = sv.get("url")
    elif reg and reg.get("champion") is False:
        s["not_served"] = (f"{reg['note']} (only a new champion is served)" if reg.get("note") else
                           f"version {reg.get('version')} did not beat the champion (only a new champion is served)")
        name = (reg.get("registry_uri") or "").removeprefix("models:/").split("/")[0]
        from kfp_pytorch.components.serve import server_status

        # what serves the champion on this machine now, read, not claimed
        if name and (server := server_status(name)) is not None:
            s["not_served"] += (f"; the champion serves at {server['infer_url']}" if server["alive"] else
                                f"; its local server is down (`kfp-pytorch serve start {name}`)")
        elif name and run.params.get("serve_backend", "local") == "local":
            # no record: stopped (`serve stop`), or it was never served here (another machine's run into
            # a shared registry). Either way, nothing here answers for it: the command that serves it
            registry = run.params.get("tracking_uri") or ""
            s["not_served"] += (f"; no model server on this machine serves the champion (`kfp-pytorch serve start "
                                f"{name} --model-uri models:/{name}@champion"
                                + (f" --tracking-uri {shlex.quote(registry)}" if registry else "") + "` starts one)")
    return s


def served_url(summary: dict) -> str:
    """The base URL of the model server a run's :func:`summarize` names; else a
    :class:`ServingError` that says why the run served nothing (a failed step, the gate, an older
    champion) instead of a KeyError."""
    if summary.get("server_url"):
        return summary["server_url"]
    if summary["status"] != "SUCCEEDED":
        raise PipelineFailed(failure_line(summary["pipeline"], summary.get("failed_task"), summary.get("error")),
                             f"the run's whole log: {summary['log']}" if summary.get("log") else None)
    if summary.get("gate_passed") is False:
        from kfp_pytorch.components.evaluate import GATE_METRICS

        read = ", ".join(f"{k}={v:.4f}" for k, v in summary.get("metrics", {}).items() if k in GATE_METRICS)
        raise ServingError("the run's gate failed, so the model was neither registered nor served"
                           + (f" ({read})" if read else ""),
                           "train longer (epochs), or lower the pipeline's threshold parameter; "
                           "`kfp-pytorch run ... --local` says which parameters most often lift the gate metric")
    if "not_served" in summary:
        raise ServingError(f"the run served nothing: {summary['not_served']}",
                           "`kfp-pytorch serve list` shows the local model servers")
    raise ServingError(f"pipeline {summary['pipeline']} serves no model",
                       "train_and_serve serves the model it trains; `kfp-pytorch serve start` serves a model directory")


def gate_advice(values: dict, summary: dict) -> str | None:
    """What to rerun with when the gate failed: the parameters that most often lift the gate metric,
    given what this run did. None when the gate passed (or the pipeline has no such parameters)."""
    if summary.get("gate_passed", True) or "epochs" not in values:
        return None
    epochs, t = values["epochs"], summary.get("training", {})
    if t and t["epochs_trained"] < epochs:  # early stopping ended it: more epochs would end the same way
        tips = [f"training stopped early (validation loss last fell at epoch {t['exported_epoch']}), so more "
                f"epochs would not help: try a lower -p lr (this run's: {values['lr']:g}), another -p model_arch, "
                "or more data"]
    else:
        tips = [f"train longer: -p epochs={2 * epochs} (this run trained {epochs})"]
    if values.get("gate_metric") in ("macro_f1", "min_recall") and values.get("class_weight") == "none":
        tips.append("-p class_weight=balanced, so that rare classes weigh as much in the loss")
    return "to pass the gate: " + "; ".join(tips)


__all__ = ["preflight", "run_local", "summarize", "served_url", "gate_advice", "error_of", "LocalRun", "KfpPytorchError", "local_runs",
           "prune_local_runs", "LocalRunInfo"]
