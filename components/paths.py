"""Where the embedded (one-machine) default keeps its state.

``KFP_PYTORCH_HOME`` (default ``~/.kfp-pytorch``) holds the embedded MLflow store, kfp.local's
pipeline root and the pid files of local model servers.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def home() -> Path:
    """The folder, made when missing; one that cannot be is a ConfigError naming KFP_PYTORCH_HOME
    (it was an OSError about a bare path, which did not say where the path came from)."""
    given = os.environ.get("KFP_PYTORCH_HOME")
    p = Path(given or "~/.kfp-pytorch").expanduser().resolve()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from .errors import ConfigError

        source = f"KFP_PYTORCH_HOME={given}" if given else f"the default KFP_PYTORCH_HOME, {p}"
        why = ("is a file, not a folder" if isinstance(e, FileExistsError) or p.is_file()
               else f"cannot be made ({e.strerror or e})")
        raise ConfigError([f"{source} {why}"], title="no folder for this machine's runs, models and servers",
                          hint="point KFP_PYTORCH_HOME at a writable folder (it is made when missing)") from None
    return p


@contextmanager
def locked(path: Path):
    """This machine's processes one at a time through the block: an advisory lock (flock) on
    ``path``, made when missing, which the OS releases when the process ends, however it ends."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def held(path: Path) -> bool:
    """Whether a process is in :func:`locked`'s block for ``path`` now (False when there is no
    such lock file): a peek, which takes the lock for an instant when it is free."""
    import fcntl

    try:
        f = open(path)
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False
