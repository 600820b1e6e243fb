"""Shared settings of the thin ``@dsl.component`` wrappers.

Every wrapper runs in the project's one container image (which has ``kfp_pytorch`` and ``kfp``
installed), so ``install_kfp_package=False`` and no ``packages_to_install``: steps start in
seconds and never reach PyPI at run time. kfp.local's SubprocessRunner runs the same wrappers in
this Python environment.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

IMAGE = os.environ.get("KFP_PYTORCH_IMAGE") or "ghcr.io/kfp-pytorch/kfp-pytorch:0.1.0"
COMPONENT_KW = {"base_image": IMAGE, "install_kfp_package": False}


def check_component_image() -> None:
    """Raise a ConfigError before compiling if the steps' image (``KFP_PYTORCH_IMAGE``) is not an
    image reference: KFP writes any string into the IR, and the run would fail on its first pod."""
    from .cluster import image_problem
    from .errors import ConfigError

    if problem := image_problem(IMAGE, "the kfp-pytorch image every step runs in"):
        raise ConfigError(["KFP_PYTORCH_IMAGE" + problem.removeprefix("image")],
                          "set KFP_PYTORCH_IMAGE to the image built from the Dockerfile, or unset it",
                          title="invalid step image")


def artifact_store_uri(artifact, storage_root: str) -> str:
    """Where a step writes the bytes behind an artifact.

    With ``storage_root`` empty: the artifact's own local path (kfp.local, or the launcher's mount
    in a cluster, which uploads it to the pipeline root afterwards). With ``storage_root`` set
    (``s3://bucket/prefix``): a prefix below it named after the artifact's URI, so each run and
    task writes to its own place, and training pods read it straight from MinIO.
    """
    if not storage_root:
        return artifact.path
    from .storage import join

    parts = PurePosixPath(urlparse(artifact.uri).path).parts[-3:]
    return join(storage_root, *parts)


RUN_START_FILE = ".run_start.json"
"""Left in a local run's folder by its steps (:func:`mark_local_run`): the process running the run,
the pipeline and its parameters."""
RUN_PARAMS_ENV = "KFP_PYTORCH_RUN_PARAMS"
"""Set by a local pipeline run for its steps, beside :data:`.processes.RUN_OWNER_ENV`: JSON
``{"pipeline": NAME, "params": {...}}``, which the steps leave in the run's folder."""
RESUME_ENV = "KFP_PYTORCH_RESUME_FROM"
"""Set by a local pipeline run that resumes another (``run --local --resume RUN``): that run's
name. Its train step starts from that run's last checkpoint (:func:`resumed_output_uri`)."""


def mark_local_run(artifact) -> None:
    """In a local run, leave what the steps know of the run in its folder, once: the run's process
    (:data:`.processes.RUN_OWNER_ENV`), its pipeline and parameters (:data:`RUN_PARAMS_ENV`). With
    them, `runs --local` tells a run still going from one killed outright (the run's record is
    written when it ends: a kill -9 leaves none), and `run --resume` knows what such a run was
    asked. The step, not the run, writes it: kfp.local names the folder, and only the step knows
    which one is its run's (two runs may start together). Nothing happens where the variable is
    unset (a cluster's pods) or the artifact is not a local file under ``RUN/TASK/OUTPUT``."""
    from .processes import RUN_OWNER_ENV

    owner = os.environ.get(RUN_OWNER_ENV)
    path = getattr(artifact, "path", None)
    if not owner or not path or "://" in str(path):
        return
    run_dir = Path(path).parent.parent
    if not run_dir.is_dir() or (run_dir / RUN_START_FILE).exists():
        return
    try:
        start = {"owner": json.loads(owner), **json.loads(os.environ.get(RUN_PARAMS_ENV) or "{}")}
    except ValueError:  # set by hand to something else: nothing said beats something wrong
        return
    tmp = run_dir / f".{RUN_START_FILE}.{os.getpid()}.tmp"
    try:  # whole or not at all, and the first step's stays: a reader never sees half of it
        tmp.write_text(json.dumps(start, default=str))
        os.link(tmp, run_dir / RUN_START_FILE)
    except OSError:  # written by another step meanwhile, or a read-only or full disk: the listing guesses
        pass
    finally:
        tmp.unlink(missing_ok=True)


CHECKPOINT_NOTE_ENV = "KFP_PYTORCH_CHECKPOINT_NOTE"
"""Set by the train step of a local run whose checkpoints go to S3 (``storage_root``): a file in the
run's folder (:func:`checkpoint_note_path`) in which training notes each checkpoint it writes
(:func:`note_checkpoint`). `runs --local` reads it to say what a canceled or killed run has trained;
it asks no server, and a killed run writes no record."""
CHECKPOINT_NOTE_GLOB = ".checkpoint.*.json"


def checkpoint_note_path(artifact, output_uri: str) -> Path | None:
    """The file ``RUN/.checkpoint.TASK.json`` in which the training of a local run's step notes the
    checkpoints it writes under ``output_uri`` on S3. None where nothing is to be noted: a cluster's
    pods, or a local output, whose checkpoints are in the run's folder already."""
    from .processes import RUN_OWNER_ENV

    path = getattr(artifact, "path", None)
    if not os.environ.get(RUN_OWNER_ENV) or not path or "://" in str(path) or "://" not in output_uri:
        return None
    task = Path(path).parent
    return task.parent / CHECKPOINT_NOTE_GLOB.replace("*", task.name)


def note_checkpoint(note: str | Path, uri: str, epochs: int) -> None:
    """Write ``{"uri", "epochs"}`` of the checkpoint just written at ``uri`` to ``note``, whole or
    not at all. A disk that is full or read-only loses the note only, never the training."""
    note = Path(note)
    tmp = note.with_name(f".{note.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"uri": uri, "epochs": epochs}))
        tmp.replace(note)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def resumed_output_uri(artifact, storage_root: str, run_name: str) -> str:
    """Where the local run ``run_name`` wrote what this step writes to :func:`artifact_store_uri`:
    the same task and output, under that run."""
    if not storage_root:
        path = Path(artifact.path)
        return str(path.parents[2] / run_name / path.parent.name / path.name)
    from .storage import join

    task, output = PurePosixPath(urlparse(artifact.uri).path).parts[-2:]
    return join(storage_root, run_name, task, output)
