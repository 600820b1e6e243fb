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

IMAGE = os.environ.get("KFP_PYTORCH_IMAGE", "ghcr.io/kfp-pytorch/kfp-pytorch:0.1.0")
COMPONENT_KW = {"base_image": IMAGE, "install_kfp_package": False}


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
