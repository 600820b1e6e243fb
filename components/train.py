"""``train``: distributed PyTorch training shaped like a Kubeflow PyTorchJob.

The runtime function :func:`train` validates a :class:`TrainSpec`, resolves the model factory up
front, then hands the job to a backend through one seam (:data:`BACKENDS`):

- ``local``: ``torchrun`` (``torch.distributed.run``, elastic) launches ``workers`` processes of
  :mod:`.train_worker` on this machine, with the same environment the Training Operator gives a
  PyTorchJob replica (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``; torchrun adds ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``). A worker that dies makes
  torchrun restart the group (``max_restarts``) and the workers resume from the last checkpoint.
- ``cluster``: builds a PyTorchJob/TrainJob manifest and submits it (filed separately; the seam is
  :class:`Backend`, and :func:`worker_command` is what both backends run).
"""

import collections
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .errors import ConfigError, KfpPytorchError, TrainingError
from .prepare_data import read_metadata, seed_problem
from .processes import RUN_OWNER_ENV
from .storage import Storage, join

WORKER_MODULE = "kfp_pytorch.components.train_worker"
BUILTIN_MODELS = ("mlp", "cnn")
"""The names of :data:`.models.ZOO`, known here without importing torch, so that checking settings
(run, compile, submit, manifest) does not take torch's 1.5 s import (a test keeps the two equal)."""
CHECKPOINTS = "checkpoints"
"""The folder of a training's checkpoints under its output URI: what a user deletes to start over,
what a resume copies, what a local run notes."""
RESUME_STATE = f"{CHECKPOINTS}/last.json"
"""Beside each checkpoint: its epoch and the settings it was trained with (read without torch)."""
RESUME_KEYS = ("dataset_uri", "model", "batch_size", "lr", "seed")
"""Settings a checkpoint is only resumed with when they are unchanged (``epochs`` may grow)."""
DIVERGED = "diverged.json"
"""Written under the output URI by the workers when the loss stops being finite: they stop at
once (a restart from the last checkpoint would only diverge again) and no model is exported."""


def early_stop(history: list[dict], patience: int) -> tuple[int | None, bool]:
    """(the best epoch by validation loss, whether to stop). Pure: every rank reads the same
    (reduced) history, so every rank decides the same.

    The best is the first epoch with the lowest ``val_loss`` (a later equal one is no improvement,
    as in Keras's and Lightning's EarlyStopping). With ``patience`` > 0, training stops once that
    many epochs have passed without improving on it; 0 never stops early."""
    if not history:
        return None, False
    best = min(range(len(history)), key=lambda i: (history[i]["val_loss"], i))
    return history[best]["epoch"], patience > 0 and len(history) - 1 - best >= patience


def patience_problem(patience) -> str | None:
    """What is wrong with an early-stopping patience, or None (the step and the pipeline both ask)."""
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
        return f"early_stopping_patience: must be an integer >= 0 (0: train every epoch), got {patience!r}"
    return None


CLASS_WEIGHTS = ("none", "balanced")
LR_SCHEDULES = ("constant", "cosine")


def scheduled_lr(lr: float, schedule: str, step: int, total_steps: int) -> float:
    """The learning rate of global step ``step`` (0-based) of ``total_steps``. ``cosine`` anneals
    from ``lr`` to 0 over the run (Loshchilov and Hutter's SGDR without restarts, as
    ``torch.optim.lr_scheduler.CosineAnnealingLR``), so the last epochs take small steps. A pure
    function of the step, so a job resumed mid-epoch goes on from the very rate it stopped at."""
    if schedule == "constant" or total_steps <= 0:
        return lr
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))


def weight_decay_problem(value) -> str | None:
    """What is wrong with a weight decay, or None (the step and the pipeline both ask)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:  # NaN too
        return f"weight_decay: must be a number in [0, 1) (0: none; 0.01 is AdamW's usual), got {value!r}"
    return None


def lr_schedule_problem(value) -> str | None:
    """What is wrong with a learning-rate schedule, or None (the step and the pipeline both ask)."""
    if value not in LR_SCHEDULES:
        return f"lr_schedule: must be one of {', '.join(LR_SCHEDULES)}, got {value!r}"
    return None


def class_weight_problem(value) -> str | None:
    """What is wrong with a class weighting, or None (the step and the pipeline both ask)."""
    if value not in CLASS_WEIGHTS:
        return f"class_weight: must be one of {', '.join(CLASS_WEIGHTS)}, got {value!r}"
    return None


def checkpoint_every_problem(seconds) -> str | None:
    """What is wrong with a mid-epoch checkpoint interval, or None (the step and the pipeline both ask)."""
    if not 0 <= seconds < math.inf:  # NaN too
        return f"checkpoint_every_s: must be a finite number >= 0 (0: at epoch ends only), got {seconds}"
    return None


TRAINING_SETTINGS = (("checkpoint_every_s", checkpoint_every_problem), ("early_stopping_patience", patience_problem),
                     ("class_weight", class_weight_problem), ("lr_schedule", lr_schedule_problem),
                     ("weight_decay", weight_decay_problem))
"""The training settings the pipeline passes on under the same names, with their checks: the train
step (:meth:`TrainSpec.validate`) and the pipeline, before any step, both run them."""


def training_settings_problems(values: dict) -> list[str]:
    """What is wrong with the :data:`TRAINING_SETTINGS` in ``values`` (a TrainSpec's, or the pipeline's)."""
    return [problem for name, check in TRAINING_SETTINGS if (problem := check(values[name]))]


@dataclass(frozen=True)
class TrainSpec:
    """One training job. Validated once, before anything starts."""

    dataset_uri: str
    """Output of prepare_data (local dir or s3://)."""
    output_uri: str
    """Where checkpoints, the exported model and history go (local dir or s3://)."""
    model: str = "mlp"
    """``mlp``, ``cnn`` or a factory ``package.module:function``."""
    epochs: int = 5
    batch_size: int = 64
    """Per-worker batch size (the global batch is ``batch_size * workers``)."""
    lr: float = 1e-3
    seed: int = 0
    workers: int = 2
    """Worker processes (PyTorchJob: replicas x nprocPerNode)."""
    backend: str = "local"
    max_restarts: int = 3
    """How often a failed worker group is restarted from the last checkpoint."""
    device: str = "auto"
    """``auto`` (cuda when available, nccl), ``cpu`` (gloo) or ``cuda``."""
    timeout_s: float = 3600.0
    progress: str = "auto"
    nodes: int = 1
    """Pods of the job (cluster backend); ``workers`` processes are spread over them."""
    gpus_per_node: int = 0
    """GPUs each pod requests (cluster backend)."""
    run_id: str = ""
    """KFP run id (cluster backend): with ``task`` it names the job, so a retried task adopts it."""
    task: str = "train"
    checkpoint_every_s: float = 600.0
    """Within an epoch, rank 0 checkpoints this often too (0: at the end of each epoch only), so a
    preempted or restarted job loses minutes, not a long epoch."""
    early_stopping_patience: int = 0
    """Stop once this many epochs have not lowered the validation loss, and export the best epoch's
    weights (Keras's ``EarlyStopping(restore_best_weights=True)``); 0: train every epoch, export the last."""
    class_weight: str = "none"
    """``balanced``: weigh each class's loss by ``n / (k * n_c)`` (scikit-learn's "balanced"), so a
    rare class counts as much as a common one; ``none``: every row weighs the same."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (Loshchilov and Hutter): each step shrinks the weights by
    ``lr * weight_decay``, a regulariser for a model that learns its training rows by heart; 0: Adam."""
    lr_schedule: str = "constant"
    """``cosine``: the learning rate anneals from ``lr`` to 0 over the epochs (:func:`scheduled_lr`)."""

    def validate(self) -> None:
        problems = []
        for name in ("dataset_uri", "output_uri"):
            if not getattr(self, name):
                problems.append(f"{name}: must be set")
        for name, lo in (("epochs", 1), ("batch_size", 1), ("workers", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                problems.append(f"{name}: must be an integer >= {lo}, got {v!r}")
        if not 0 < self.lr < math.inf:  # NaN too
            problems.append(f"lr: must be a finite number > 0, got {self.lr}")
        if problem := seed_problem(self.seed):
            problems.append(problem)
        if self.max_restarts < 0:
            problems.append(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.backend not in BACKENDS:
            problems.append(f"backend: must be one of {', '.join(sorted(BACKENDS))}, got {self.backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device: must be auto, cpu or cuda, got {self.device!r}")
        problems += training_settings_problems(vars(self))
        if not self.timeout_s > 0:
            problems.append(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.nodes < 1 or (self.workers % self.nodes if self.nodes >= 1 else 0):
            problems.append(f"nodes: must be >= 1 and divide workers ({self.workers}), got {self.nodes}")
        if self.gpus_per_node < 0:
            problems.append(f"gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        elif self.backend == "cluster" and self.device != "cpu" and (
                problem := gpu_share_problem(self.workers, self.nodes, self.gpus_per_node)):
            problems.append(problem)
        if self.backend == "cluster" and not self.output_uri.startswith(("s3://", "minio://")):
            problems.append("output_uri: the cluster backend needs s3:// or minio:// (pods cannot see this "
                            f"machine's disk), got {self.output_uri!r}; set storage_root")
        if self.model not in BUILTIN_MODELS and ":" not in self.model:
            problems.append(f"model: must be one of {', '.join(BUILTIN_MODELS)} or 'package.module:function', got "
                            f"{self.model!r}")
        if problems:
            raise ConfigError(problems, title="invalid train settings")


@dataclass
class TrainResult:
    model_uri: str
    history: list[dict] = field(default_factory=list)
    restarts: int = 0
    wall_seconds: float = 0.0
    train_seconds: float = 0.0
    """Sum of the epochs' training-loop time: the part compared with a bare torchrun script."""
    exported_epoch: int | None = None
    """The epoch whose weights were exported: the best by validation loss with early stopping,
    else the last."""

    @property
    def exported(self) -> dict:
        """The history entry of the exported weights."""
        return next((h for h in self.history if h["epoch"] == self.exported_epoch), self.history[-1])


def worker_args(spec: TrainSpec) -> list[str]:
    """Arguments of the worker entrypoint; identical for every backend."""
    return ["--dataset-uri", spec.dataset_uri, "--output-uri", spec.output_uri, "--model", spec.model,
            "--epochs", str(spec.epochs), "--batch-size", str(spec.batch_size), "--lr", repr(spec.lr),
            "--seed", str(spec.seed), "--device", spec.device, "--progress", spec.progress,
            "--checkpoint-every-s", f"{spec.checkpoint_every_s:g}",
            "--early-stopping-patience", str(spec.early_stopping_patience), "--class-weight", spec.class_weight,
            "--lr-schedule", spec.lr_schedule, "--weight-decay", repr(float(spec.weight_decay))]


def worker_command(spec: TrainSpec, python: str = "python") -> list[str]:
    """The replica's command: torchrun reads nnodes/nproc/node-rank/master from ``PET_*``."""
    return [python, "-m", "torch.distributed.run", "-m", WORKER_MODULE, *worker_args(spec)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_env(nnodes: int, nproc: int, node_rank: int, master_addr: str, master_port: int,
                max_restarts: int) -> dict[str, str]:
    """The environment the Training Operator sets on a PyTorchJob replica (elastic launcher form)."""
    return {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(master_port),
        "PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(node_rank),
        "PET_MAX_RESTARTS": str(max_restarts),
    }


def gpu_share_problem(workers: int, nodes: int, gpus_per_node) -> str | None:
    """Why a pod's ``workers / nodes`` processes cannot each have one of its GPUs (None: they can,
    or the pods have no GPUs). NCCL refuses two ranks on one GPU."""
    try:
        gpus = int(gpus_per_node or 0)
    except (TypeError, ValueError):  # not a count: the resource checks say so
        return None
    if gpus <= 0 or nodes < 1 or workers // nodes <= gpus:
        return None
    return (f"gpus_per_node: each of a pod's {workers // nodes} worker processes needs a GPU of its own, got {gpus} "
            "(workers = nodes x gpus_per_node)")


def cuda_problem(device: str, procs_per_node: int, available: bool, count: int) -> tuple[str, str] | None:
    """(error, hint) when ``procs_per_node`` workers cannot each have a GPU of their own: NCCL
    gives every rank one device, and a missing one fails deep in its first call."""
    if device == "cuda" and not available:
        return ("device=cuda, but no CUDA device is visible here",
                "use device=auto (GPUs when there are, else CPU), or request GPUs: gpus_per_node on the cluster backend")
    if (device == "cuda" or (device == "auto" and available)) and procs_per_node > count:
        return (f"{procs_per_node} worker processes per node, but {count} GPU{'' if count == 1 else 's'} visible: "
                "each process needs a GPU of its own",
                f"run at most {count} per node (workers = nodes x GPUs per node), or device=cpu")
    return None


WORKER_MEMORY = 300 * 2**20
"""Memory one local worker process takes, about: torch, the model and a data shard (measured
226 MiB resident for the built-in models)."""


def local_memory_problem(workers: int, available: int) -> tuple[str, str] | None:
    """(error, hint) when ``workers`` local processes would not fit in ``available`` bytes: past it
    the kernel's OOM killer picks processes, this machine's other work (a notebook) among them."""
    need = workers * WORKER_MEMORY
    if need <= available:
        return None
    fit = max(1, available // WORKER_MEMORY)
    return (f"workers={workers}: {workers} local worker processes need about {need / 2**30:.1f} GiB of memory "
            f"({WORKER_MEMORY // 2**20} MiB each), and this machine has {available / 2**30:.1f} GiB available",
            f"run at most {fit} local workers, or train on the cluster (train_backend=cluster)")


def batch_note(rows: int, batch_size: int, world: int) -> str | None:
    """A note when one batch per worker covers each worker's whole share of the ``rows`` training
    rows: then an epoch is a single optimizer step, and a run of a few epochs barely trains (the
    gate fails with no word of why). Not an error: full-batch training is a choice some make."""
    share = -(-rows // world)  # DistributedSampler pads every rank to the same share
    if share <= 1 or batch_size < share:
        return None
    smaller = max(1, share // 8)
    return (f"note: batch_size {batch_size} x {world} worker{'s' if world > 1 else ''} covers all {rows} training "
            f"rows, so each epoch is one optimizer step and a few epochs barely train; batch_size={smaller} takes "
            f"{-(-share // smaller)} steps an epoch")


def local_cpu_note(workers: int, cpus: float) -> str | None:
    """A note when ``workers`` local processes outnumber the CPUs: they take turns, so each
    imports torch and steps that much slower, and the run is slower than with one per CPU (DDP
    splits the same epochs among them). Not an error: a DDP check may want more workers than cores."""
    if workers <= cpus:
        return None
    fit = max(1, int(cpus))
    return (f"note: workers={workers} local processes share {cpus:g} CPU{'' if cpus == 1 else 's'}, so they take "
            f"turns and the run is slower than with workers={fit}; train on the cluster (train_backend=cluster) "
            "for more workers")


class Backend(Protocol):
    def run(self, spec: TrainSpec) -> None:
        """Run the job to completion, or raise TrainingError."""


STOP_WITH_ENV = "KFP_PYTORCH_STOP_WITH"
"""Set by the local backend for its torchrun workers: the processes whose end stops training (JSON
list of :func:`.processes.identity`): the process that started torchrun and, in a local run, the
run's. SIGTERM and Ctrl-C reach the workers through them, but a kill -9, the OOM killer or a
notebook kernel's restart do not, and the workers (in their own session) trained on for hours,
unread. The workers watch them (:func:`.train_worker.stop_with`)."""


def stop_with_env(owner: str | None) -> str:
    """The value of :data:`STOP_WITH_ENV`: this process, and the run ``owner``
    (:data:`.processes.RUN_OWNER_ENV`) when there is one to read."""
    from .processes import identity

    watched = [identity()]
    try:
        run = json.loads(owner) if owner else None
        if isinstance(run, dict) and isinstance(run.get("pid"), int):
            watched.append(run)
    except ValueError:
        pass
    return json.dumps(watched)


class LocalBackend:
    """torchrun on this machine: one node, ``workers`` processes."""

    def run(self, spec: TrainSpec) -> None:
        # torchrun's agent leaves a torchelastic_* directory in the temp dir on every run; a
        # scratch TMPDIR per run keeps repeated local runs from piling them up in /tmp.
        with tempfile.TemporaryDirectory(prefix="kfp-pytorch-torchrun-") as scratch:
            self._run(spec, scratch)

    def _run(self, spec: TrainSpec, scratch: str) -> None:
        if spec.device != "cpu":  # found here, before torchrun starts processes that would all fail alike
            import torch

            problem = cuda_problem(spec.device, spec.workers, torch.cuda.is_available(), torch.cuda.device_count())
            if problem:
                raise TrainingError(*problem)
        import psutil

        if problem := local_memory_problem(spec.workers, psutil.virtual_memory().available):
            raise TrainingError(*problem)
        env = dict(os.environ)
        env["TMPDIR"] = scratch
        env.update(replica_env(1, spec.workers, 0, "127.0.0.1", free_port(), spec.max_restarts))
        cpus = available_cpus()
        env.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus // spec.workers))))
        env["PYTHONUNBUFFERED"] = "1"
        env[STOP_WITH_ENV] = stop_with_env(os.environ.get(RUN_OWNER_ENV))
        # said before the workers import torch, which takes seconds each: the step is not hung
        print(f"[kfp-pytorch] starting {spec.workers} local DDP worker{'s' if spec.workers > 1 else ''} (torchrun) "
              f"on {cpus:g} CPU{'' if cpus == 1 else 's'}, {env['OMP_NUM_THREADS']} thread(s) each", flush=True)
        if note := local_cpu_note(spec.workers, cpus):
            print(f"[kfp-pytorch] {note}", file=sys.stderr, flush=True)
        cmd = worker_command(spec, sys.executable)
        tail: collections.deque[str] = collections.deque(maxlen=400)
        # Own process group: on timeout, Ctrl-C or SIGTERM the whole tree goes, no orphans.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        # A reader thread streams the workers' log into ours; the main thread owns the deadline,
        # so a silent hang still times out.
        reader = threading.Thread(target=_pump, args=(proc, tail), daemon=True)
        reader.start()
        prev = signal.getsignal(signal.SIGTERM)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:  # run terminated (KFP sends SIGTERM): take the workers down with us
            signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            rc = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise TrainingError(f"training exceeded timeout_s={spec.timeout_s:g}", "raise timeout_s or reduce epochs") from e
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            if in_main:
                signal.signal(signal.SIGTERM, prev)
            reader.join(timeout=5)
        if rc != 0:
            stopped = next((m for m in map(_STOPPED_LINE.search, reversed(tail)) if m), None)
            if stopped:  # a SIGTERM to torchrun (a kill, a terminated step): the workers checkpointed and left
                raise TrainingError(f"training stopped on SIGTERM {stopped.group(1)}, checkpointed",
                                    "run it again into the same output_uri: it resumes there")
            cause = worker_error(list(tail))
            last = "\n".join(f"    {t}" for t in list(tail)[-12:])
            raise TrainingError(f"training workers failed (torchrun exit code {rc})"
                                + (f": {cause}" if cause else "") + f"; last lines:\n{last}",
                                "read the worker error above; after fixing it, the job resumes from its checkpoint")


_STOPPED_LINE = re.compile(r"\[kfp-pytorch\] stopped on SIGTERM (.+?), checkpointed to ")
_ERROR_LINE = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")


def available_cpus(cgroup: str = "/sys/fs/cgroup") -> float:
    """The CPUs this process may use: its affinity, capped by a cgroup CPU quota. In a pod with a
    CPU limit (the KFP step pod running the local backend) ``os.cpu_count()`` is the node's
    cores, and threads sized by it are throttled by the quota. Neither the standard library nor
    psutil reads the quota; it is cgroup v2's ``cpu.max`` ("max 100000" or "400000 100000"), or
    v1's ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``."""
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    root = Path(cgroup)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return cpus
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return cpus
    return max(1.0, min(cpus, int(quota) / int(period)))


def worker_error(lines: list[str]) -> str | None:
    """The last exception line a worker printed (not torchrun's own ChildFailedError summary)."""
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m and "ChildFailedError" not in line and "elastic" not in line:
            return m.group(1).strip()
    return None


def _pump(proc: subprocess.Popen, tail: "collections.deque[str]") -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line.rstrip())


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, so the workers checkpoint the step they are at and leave (well within the 30 s a
    pod's grace period gives); SIGKILL after 25 s, or at once on a second Ctrl-C."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=25)
    except (ProcessLookupError, subprocess.TimeoutExpired, KeyboardInterrupt):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class ClusterBackend:
    """A PyTorchJob (or TrainJob) in the cluster this step runs in; see :mod:`.cluster_run`."""

    def run(self, spec: TrainSpec) -> None:
        from .cluster import ClusterConfig
        from .cluster_run import ClusterTrainer
        from .k8s import Kube

        cfg = ClusterConfig.from_env()
        ClusterTrainer(Kube(), kind=cfg.train_kind, delete_policy=cfg.delete_policy).run(
            cfg.train_spec(spec), timeout_s=spec.timeout_s)


BACKENDS: dict[str, type] = {"local": LocalBackend, "cluster": ClusterBackend}


def _check_resumable(spec: TrainSpec, storage: Storage) -> None:
    """A checkpoint under ``output_uri`` is resumed (a retried task, a restart, more epochs); one
    written with other settings would be resumed silently, old optimizer state and all."""
    uri = join(spec.output_uri, RESUME_STATE)
    if not storage.exists(uri):
        return
    state = json.loads(storage.read_bytes(uri))
    if changed := _resume_conflicts(state, spec, storage):
        raise TrainingError(f"{spec.output_uri} holds the checkpoint of another training run (epoch "
                            f"{state.get('epoch')}: {'; '.join(changed)}), which this run would resume from",
                            f"give a new output_uri, or delete {join(spec.output_uri, 'checkpoints')} to start over; "
                            "to train on for more epochs, keep the other settings")


def _resume_conflicts(state: dict, spec: TrainSpec, storage: Storage) -> list[str]:
    """The settings ``spec`` changes from those a checkpoint's resume ``state`` was trained with:
    ``lr 0.005 there, 0.001 here``. The same data prepared again elsewhere is no change."""
    saved = state.get("args", {})
    return [f"{k} {saved[k]!r} there, {getattr(spec, k)!r} here" for k in RESUME_KEYS
            if k in saved and saved[k] != getattr(spec, k)
            and not (k == "dataset_uri" and _same_data(saved[k], spec.dataset_uri, storage))]


def _same_data(a: str, b: str, storage: Storage) -> bool:
    """Two prepared datasets hold the same data (:func:`.prepare_data.dataset_fingerprint`): a
    resumed local run prepares its table again, into its own folder."""
    from .prepare_data import dataset_fingerprint

    try:
        return dataset_fingerprint(read_metadata(a, storage)) == dataset_fingerprint(read_metadata(b, storage))
    except (KfpPytorchError, ValueError):  # one is gone (pruned) or damaged: not known to be the same
        return False


def seed_checkpoint(spec: TrainSpec, source_uri: str, storage: Storage | None = None) -> int | None:
    """Copy the last checkpoint of an earlier training (``source_uri``: its output) into
    ``spec.output_uri``, where :func:`train` resumes from it as from its own; the number of whole
    epochs it had trained, or None where it has none, or the output holds one already. A
    TrainingError where ``spec`` changes what it was trained with: nothing is copied."""
    storage = storage or Storage()
    last = join(source_uri, RESUME_STATE)
    if storage.exists(join(spec.output_uri, RESUME_STATE)) or not storage.exists(last):
        return None
    state = json.loads(storage.read_bytes(last))
    if changed := _resume_conflicts(state, spec, storage):
        raise TrainingError(f"cannot resume from the checkpoint at {source_uri}: it was trained with other settings "
                            f"({'; '.join(changed)})",
                            "resume with the settings it was trained with (more epochs are fine), or run without "
                            "resuming to start over")
    base = join(source_uri, CHECKPOINTS) + "/"
    found = [e.uri for e in storage.entries(join(source_uri, CHECKPOINTS)) if not e.uri.endswith("/")]
    # the state last: a copy cut short leaves no resume state over a partial checkpoint
    for src in sorted(found, key=lambda u: u == last):
        dst = join(spec.output_uri, CHECKPOINTS, src[len(base):])
        if src.startswith("s3://") and dst.startswith("s3://"):
            storage.copy(src, dst)  # inside the server
        else:
            storage.write_bytes(dst, storage.read_bytes(src))
    return int(state.get("epoch", 0))


def train(spec: TrainSpec, storage: Storage | None = None) -> TrainResult:
    """Validate, resolve the model factory here (fail fast), run the backend, read the history."""
    from .models import resolve_factory

    spec.validate()
    resolve_factory(spec.model)
    storage = storage or Storage()
    # the dataset before the workers (or a cluster job) start: a wrong path failed in every rank,
    # seconds later, under torchrun's failure report
    read_metadata(spec.dataset_uri, storage)
    # the output too: a file in the way or a missing bucket failed in every rank as well
    storage.check_writable(spec.output_uri, f"write {spec.output_uri}")
    _check_resumable(spec, storage)
    t0 = time.perf_counter()
    BACKENDS[spec.backend]().run(spec)
    diverged = join(spec.output_uri, DIVERGED)
    if storage.exists(diverged):
        d = json.loads(storage.read_bytes(diverged))
        raise TrainingError(f"training diverged: the loss became {d['loss']} in epoch {d['epoch']} "
                            f"(lr {d['lr']:g}, batch size {spec.batch_size} x {spec.workers} workers); no model was exported",
                            f"lower lr (e.g. lr={d['lr'] / 10:g}) or check the features for extreme values")
    history = json.loads(storage.read_bytes(join(spec.output_uri, "history.json")))
    restarts = max((h.get("attempt", 0) for h in history), default=0)
    meta_uri = join(spec.output_uri, "model", "metadata.json")
    if not storage.exists(meta_uri):  # the workers write it last, before they exit 0
        raise TrainingError(f"the training job finished but exported no model ({meta_uri} is missing)",
                            "check that the image runs kfp_pytorch.components.train_worker (the workers' "
                            "logs say what they did), then run the step again")
    model_meta = json.loads(storage.read_bytes(meta_uri))
    return TrainResult(model_uri=join(spec.output_uri, "model"), history=history, restarts=restarts,
                       wall_seconds=time.perf_counter() - t0,
                       train_seconds=sum(h["seconds"] for h in history),
                       exported_epoch=model_meta["training"].get("exported_epoch", history[-1]["epoch"]))

