"""Shared settings of the thin ``@dsl.component`` wrappers.

Every wrapper runs in the project's one container image (which has ``kfp_pytorch`` and ``kfp``
installed), so ``install_kfp_package=False`` and no ``packages_to_install``: steps start in
seconds and never reach PyPI at run time. kfp.local's SubprocessRunner runs the same wrappers in
this Python environment.
"""
from __future__ import annotations

import os
from pathlib import PurePosixPath
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
