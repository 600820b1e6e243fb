"""Which process a record names: a PID, and whether it is still the process that was recorded.

A PID is given again once its process ends, so a record keeps when its process started too. Used by
the local model servers' records (:mod:`.serve`) and by local training's workers, which watch the
processes that started them (:mod:`.train_worker`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

RUN_OWNER_ENV = "KFP_PYTORCH_RUN_OWNER"
"""Set by a local pipeline run (``kfp-pytorch run --local``, a notebook's run) for its steps: the
process that runs the pipeline (:func:`run_owner_token`). Local training's workers stop when it
ends (:mod:`.train`), and the steps leave it in the run's folder (:func:`._kfp.mark_local_run`),
where `runs --local` reads whether the run is still going."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return True


def wall_start(pid: int) -> float | None:
    """psutil's create_time: seconds since the epoch."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (Linux: /proc/PID/stat, field 22).
    Unlike psutil's create_time (those ticks plus the boot time, which each process reads once
    and which moves when the wall clock is stepped), the same in every process that reads it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # fields from 3 on: state is field 3
    except (OSError, ValueError, IndexError):
        return None


def identity(pid: int | None = None) -> dict:
    """What :func:`same_process` needs to know ``pid`` (this process by default) again later."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "create_time": wall_start(pid), "start_ticks": start_ticks(pid)}


def same_process(info: dict) -> bool:
    """The process ``info`` (:func:`identity`) names is still that process: alive, and not another
    process that was given the same pid after it ended (it would be signalled, with its whole
    group)."""
    pid = info.get("pid")
    if pid is None or not alive(pid):
        return False
    if info.get("start_ticks") is not None and (ticks := start_ticks(pid)) is not None:
        return ticks == info["start_ticks"]
    # Not Linux, or a record from before start_ticks: the wall-clock start time, within the
    # second a boot-time re-read may move it by
    started, now = info.get("create_time"), wall_start(pid)
    return started is None or now is None or abs(now - started) < 1.0


def run_owner_token(pid: int | None = None) -> str:
    """The value of :data:`RUN_OWNER_ENV` for a process (this one by default): its PID and when it
    started, which tells it from a later process given the same PID."""
    return json.dumps(identity(pid))
