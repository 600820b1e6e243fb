"""The training worker: one process of a PyTorchJob replica, identical locally and in a pod.

It reads the environment the Kubeflow Training Operator (and ``torchrun``, which it runs) gives a
replica: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
``PET_*`` launcher settings. Nothing here knows whether it runs under the local backend or in a
cluster: the local backend reproduces that environment exactly.

Per epoch, rank 0 writes ``checkpoints/last.pt`` atomically through :mod:`.storage`, and within
an epoch too, every ``--checkpoint-every-s`` seconds. On start, every rank loads that checkpoint if
it exists, so a job restarted after a worker died resumes from the last finished epoch, or from
the step of the epoch it was in (``torchrun --max-restarts`` locally, ``backoffLimit`` in a
cluster; a Kueue preemption deletes the pods, which resume the same way).

With ``--early-stopping-patience N``, training stops once N epochs have not lowered the validation
loss, and the best epoch's weights are exported; rank 0 keeps them (on the CPU, and in the
checkpoint, so a resumed job still exports them).

SIGTERM (a preemption, a drained node, a terminated run: the kubelet signals torchrun, which
forwards it to every worker and waits 30 s before SIGKILL) stops the job at the next step the
ranks agree on, after rank 0 has checkpointed it: a preemption costs nothing trained.

At the end rank 0 writes, below ``--output-uri``::

    model/weights.pt          state_dict
    model/model.pt2           torch.export program (dynamic batch), what the predictor serves
    model/metadata.json       input shape, classes, normalisation, model name, training summary
    history.json              per-epoch loss / accuracy / samples per second
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ._kfp import CHECKPOINT_NOTE_ENV, note_checkpoint
from .errors import KfpPytorchError, TrainingError
from .exported_model import EXPORT_MAX_BATCH
from .models import build_model
from .prepare_data import load_split, read_metadata
from .storage import Storage, join
from .train import CHECKPOINTS, DIVERGED, RESUME_KEYS, RESUME_STATE, batch_note, cuda_problem, early_stop, scheduled_lr
from .trainer_status import TrainerStatusReporter

CHECKPOINT = f"{CHECKPOINTS}/last.pt"
HISTORY = "history.json"
STOP_CHECK_STEPS = 8  # the ranks agree on a stop every this many steps (one 1-element all-reduce)
EXIT_STOPPED = 128 + signal.SIGTERM  # what a process ended by SIGTERM returns, as the shell says it


class Stopped(Exception):
    """The job stopped on SIGTERM after its state was checkpointed."""


class _StopRequest:
    """SIGTERM asks for a stop; the ranks agree on the step to stop at.

    A signal reaches the ranks at different steps (or only some of them, for ``kill`` of one
    worker), and a rank that left alone would leave the others waiting in an all-reduce. So every
    ``STOP_CHECK_STEPS`` steps (the same steps on every rank) and at each epoch's end, the ranks
    take the maximum of their flags, on the CPU over gloo (no device sync), and all stop at the
    first step where any rank was asked to."""

    def __init__(self, backend: str):
        self.asked = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
        # NCCL reduces device tensors only; a CPU flag goes over a gloo group (made by every rank)
        self._group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self._flag = torch.zeros(1)

    def _on_signal(self, signum, frame) -> None:
        self.asked = True

    def agreed(self) -> bool:
        self._flag.fill_(1.0 if self.asked else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())


def stop_with(watched: list[dict], interval: float = 1.0) -> None:
    """Once a process of ``watched`` (:data:`.train.STOP_WITH_ENV`) has ended, SIGTERM torchrun,
    which forwards it to every worker: they agree on a step, checkpoint it and leave, as for any
    stop. Run in a daemon thread by local rank 0; returns when it has signalled."""
    from .processes import same_process

    while (gone := next((w for w in watched if not same_process(w)), None)) is None:
        time.sleep(interval)
    print(f"[kfp-pytorch] pid {gone['pid']}, which training stops with, has ended: stopping", file=sys.stderr,
          flush=True)
    os.kill(os.getppid(), signal.SIGTERM)


class _UnreadLog:
    """A worker's stdout or stderr under the local backend: a pipe that the process which started
    training reads. Once that process is gone (killed outright) a write raised BrokenPipeError, and
    the worker died there, before it could checkpoint; the log then goes nowhere instead."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        self._stream = open(os.devnull, "w")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):  # isatty, fileno, encoding ... as the stream's
        return getattr(self._stream, name)


def _watch_launcher() -> None:
    """Under the local backend (not in a PyTorchJob): a log that may lose its reader, and local rank
    0 watching the processes training stops with (:func:`stop_with`)."""
    import json

    from .train import STOP_WITH_ENV

    if not (text := os.environ.get(STOP_WITH_ENV)):
        return
    sys.stdout, sys.stderr = _UnreadLog(sys.stdout), _UnreadLog(sys.stderr)
    try:
        watched = [w for w in json.loads(text) if isinstance(w, dict) and "pid" in w]
    except ValueError:
        return
    if watched and os.environ.get("LOCAL_RANK", "0") == "0":
        threading.Thread(target=stop_with, args=(watched,), name="stop-with", daemon=True).start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kfp_pytorch.components.train_worker")
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--output-uri", required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--progress", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--checkpoint-every-s", type=float, default=600.0)
    p.add_argument("--early-stopping-patience", type=int, default=0)
    p.add_argument("--class-weight", default="none", choices=["none", "balanced"])
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
    p.add_argument("--weight-decay", type=float, default=0.0)
    return p.parse_args(argv)


def _rounded(entry: dict) -> dict:
    """``entry`` with each float to 4 significant digits (0.3513, 3.522e+04): an epoch's log line."""
    return {k: float(f"{v:.4g}") if isinstance(v, float) and math.isfinite(v) else v for k, v in entry.items()}


def _save_torch(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Resumed(torch.utils.data.Sampler):
    """The epoch's order, less the first ``skip`` samples: the steps a mid-epoch checkpoint has
    trained on. DistributedSampler's order is a function of (seed, epoch, rank, world), so the
    restarted ranks see the rest of the very epoch they were in."""

    def __init__(self, sampler: DistributedSampler, skip: int):
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def _all_mean(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024,
              weight: torch.Tensor | None = None) -> tuple[float, float]:
    """(loss, accuracy) over ``x``; with class ``weight``, the loss is the weighted mean that
    training minimises (``cross_entropy(weight=...)``), so early stopping watches that objective."""
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch])
            loss_sum += nn.functional.cross_entropy(logits, y[i:i + batch], weight=weight, reduction="sum").item()
            correct += (logits.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    total = float(weight[y].sum()) if weight is not None else len(x)
    return loss_sum / max(1e-12, total) if len(x) else 0.0, correct / max(1, len(x))


def class_weights(y, num_classes: int) -> torch.Tensor:
    """scikit-learn's ``compute_class_weight("balanced")``: ``n / (k * n_c)`` for each of the k
    classes present, so every class weighs as much in the loss as if the classes were even; an id
    no row has (class ids with gaps) weighs 0."""
    counts = torch.bincount(torch.as_tensor(y), minlength=num_classes).double()
    present = counts > 0
    w = torch.zeros(num_classes, dtype=torch.float64)
    w[present] = counts.sum() / (present.sum() * counts[present])
    return w.float()


def export_program(model: nn.Module, num_features: int) -> bytes:
    """``torch.export`` with a dynamic batch dimension, serialised to bytes."""
    model = model.eval()
    example = (torch.randn(2, num_features),)
    batch = torch.export.Dim("batch", min=1, max=EXPORT_MAX_BATCH)
    program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _init_process_group(backend: str, attempt: int) -> None:
    """``env://`` initialisation, with the store keys namespaced by restart attempt.

    After torchrun restarts a worker group, the launcher's TCPStore still holds the previous
    attempt's gloo addresses; a rank reading a stale one fails with "connectFullMesh failed".
    A per-attempt PrefixStore gives every attempt a clean namespace. Without torchrun (plain
    ``RANK``/``WORLD_SIZE``, as the operator sets for non-elastic replicas) rank 0 hosts the store.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_store), timeout=timedelta(minutes=10))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"kfp-pytorch/attempt-{attempt}", store),
                            rank=rank, world_size=world, timeout=timedelta(minutes=10))


class _Progress:
    """Rank 0's progress for the Trainer (:mod:`.trainer_status`): the share of epochs done,
    the time left at this attempt's pace, and the last epoch's metrics."""

    every_s = 5.0
    """How often, within an epoch, the progress is updated (the reporter sends at most as often)."""

    def __init__(self, reporter: TrainerStatusReporter, start_epoch: int, epochs: int, within: float = 0.0):
        """``within``: the share of epoch ``start_epoch + 1`` a mid-epoch checkpoint had done."""
        self.reporter, self.start_epoch, self.epochs = reporter, start_epoch + within, max(1, epochs)
        self.t0 = self.next = time.monotonic()
        self.metrics: dict = {"currentEpoch": start_epoch, "totalEpochs": epochs}
        self._update(self.start_epoch)

    @classmethod
    def from_env(cls, start_epoch: int, epochs: int, within: float = 0.0) -> "_Progress | None":
        reporter = TrainerStatusReporter.from_env()
        return cls(reporter, start_epoch, epochs, within) if reporter is not None else None

    def _update(self, done: float) -> None:
        now = time.monotonic()
        ran = done - self.start_epoch
        left = (now - self.t0) / ran * (self.epochs - done) if ran > 0 else None
        self.reporter.update(100.0 * done / self.epochs, left, self.metrics)
        self.next = now + self.every_s

    def step(self, done: float) -> None:
        """Within an epoch: ``done`` epochs (a fraction) are done."""
        if time.monotonic() >= self.next:
            self._update(done)

    def epoch_done(self, entry: dict) -> None:
        self.metrics = {"currentEpoch": entry["epoch"], "totalEpochs": self.epochs, "loss": entry["loss"],
                        "accuracy": entry["accuracy"], "val_loss": entry["val_loss"],
                        "val_accuracy": entry["val_accuracy"], "samples_per_second": entry["samples_per_second"]}
        self._update(entry["epoch"])

    def close(self) -> None:
        self.reporter.close()


def run(args: argparse.Namespace) -> dict:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:  # a pod given fewer GPUs than processes (or none) fails here, not inside NCCL
        problem = cuda_problem(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.is_available(),
                               torch.cuda.device_count())
        if problem:
            raise TrainingError(*problem)
    backend = "nccl" if use_cuda else "gloo"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init_process_group(backend, attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    storage = Storage()

    meta = read_metadata(args.dataset_uri, storage)
    x_train, y_train = load_split(args.dataset_uri, "train", storage, meta)
    x_val, y_val = load_split(args.dataset_uri, "val", storage, meta)
    torch.manual_seed(args.seed)
    model = build_model(args.model, meta["num_features"], meta["num_classes"], meta.get("image_shape")).to(device)
    # AdamW: Adam with the decay decoupled from the gradient; with weight_decay 0 it is Adam exactly
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # every rank holds the whole train split, so every rank computes the same weights
    weight = class_weights(y_train, meta["num_classes"]).to(device) if args.class_weight == "balanced" else None

    train_ds = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, pin_memory=use_cuda)
    steps = len(loader)
    if rank == 0 and attempt == 0 and (note := batch_note(len(train_ds), args.batch_size, world)):
        print(f"[kfp-pytorch] {note}", flush=True)
    start_epoch, history, skip = 0, [], 0
    patience = args.early_stopping_patience
    best: dict | None = None  # rank 0, with patience: {"epoch", "model": CPU state_dict} of the best epoch
    diverged_uri = join(args.output_uri, DIVERGED)
    if rank == 0:
        storage.delete(diverged_uri)  # a mark from an earlier run into this output
    ckpt_uri = join(args.output_uri, CHECKPOINT)
    ckpt_dir = join(args.output_uri, CHECKPOINTS)
    if storage.exists(ckpt_uri):
        # weights_only: tensors and plain data, never code. The bucket is shared, and a pickle
        # there that runs code on load would run it in every rank of the next job.
        try:
            state = torch.load(io.BytesIO(storage.read_bytes(ckpt_uri)), map_location=device, weights_only=True)
        except pickle.UnpicklingError as e:
            # the remedy goes in the message: the step reads a worker's error from its last line
            what = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            fix = f"delete {ckpt_dir} to start over, or give a new output_uri"
            raise TrainingError(f"{ckpt_uri} holds more than tensors and plain data"
                                + (f" (it pickles {what.group(1)})" if what else "")
                                + f", so it is not loaded, since it could run code: {fix}", fix) from e
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # the saved rate is the schedule's at that step: set anew,
            group["lr"] = args.lr  # and the decay this run asks for (a checkpoint of Adam's has its own)
            group.update(weight_decay=args.weight_decay, decoupled_weight_decay=True)
        start_epoch, history = state["epoch"] + 1, state["history"]
        best = state.get("best") if rank == 0 else None
        within = state.get("within")  # a mid-epoch checkpoint: {"epoch", "step", "world"}
        where = f"after epoch {start_epoch}"
        if within and within["epoch"] == start_epoch and within["world"] == world and within["step"] < steps:
            skip = within["step"]
            where = f"epoch {start_epoch + 1}, step {skip}/{steps}"
        elif within and within["world"] != world:  # another world orders the epoch otherwise: from its start
            where += (f" (epoch {start_epoch + 1} starts again: its mid-epoch checkpoint was taken with "
                      f"{within['world']} workers, this run has {world})")
        if rank == 0:
            print(f"[kfp-pytorch] resuming from checkpoint {ckpt_uri}: {where} (restart {attempt})", flush=True)
            if note := os.environ.get(CHECKPOINT_NOTE_ENV):  # one seeded from an earlier run is this run's too:
                note_checkpoint(note, ckpt_dir, start_epoch)  # noted before any epoch

    def checkpoint(epoch: int, step: int | None = None) -> None:
        """Rank 0 only. ``step`` (mid-epoch): ``step`` steps of ``epoch`` (0-based) are trained on.
        ``epoch`` stays the last whole epoch, so the resume state reads as before."""
        done = epoch if step is None else epoch - 1
        state = {"epoch": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "history": history, "args": vars(args)}
        if best is not None:
            state["best"] = best
        if step is not None:
            state["within"] = {"epoch": epoch, "step": step, "world": world}
        storage.write_bytes(ckpt_uri, _save_torch(state))
        storage.write_bytes(join(args.output_uri, RESUME_STATE), json.dumps(
            {"epoch": done + 1, **({"step": step} if step is not None else {}),
             "args": {k: getattr(args, k) for k in RESUME_KEYS}}).encode())
        if note := os.environ.get(CHECKPOINT_NOTE_ENV):  # a local run's, on S3: for `runs --local`
            note_checkpoint(note, ckpt_dir, done + 1)

    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    stop = _StopRequest(backend)
    xv, yv = torch.from_numpy(x_val).to(device), torch.from_numpy(y_val).to(device)
    show = rank == 0 and (args.progress == "on" or (args.progress == "auto"))
    # A TrainJob's progress for `kubectl get trainjob`, when the Trainer asks for it (its daemon
    # thread goes with the process if training fails)
    progress = _Progress.from_env(start_epoch, args.epochs, skip / max(1, steps)) if rank == 0 else None
    # Within an epoch, rank 0 alone decides by its clock: between two steps every rank's weights
    # are the same (DDP), so its state is the job's. The others wait at the next all-reduce.
    every = args.checkpoint_every_s
    next_ckpt = time.monotonic() + every
    cosine = args.lr_schedule != "constant"
    for epoch in range(start_epoch, args.epochs):
        best_epoch, stop_early = early_stop(history, patience)
        if stop_early:  # after the last epoch that counted, or at once on resuming a job that had stopped
            if rank == 0:
                print(f"[kfp-pytorch] early stopping after epoch {epoch}: the validation loss has not improved "
                      f"for {epoch - best_epoch} epoch(s) since epoch {best_epoch} "
                      f"(val_loss {history[best_epoch - 1]['val_loss']:.4f}); exporting epoch {best_epoch}'s weights",
                      flush=True)
            break
        sampler.set_epoch(epoch)
        first = skip if epoch == start_epoch else 0
        epoch_loader = loader if not first else DataLoader(
            train_ds, batch_size=args.batch_size, sampler=_Resumed(sampler, first * args.batch_size),
            pin_memory=use_cuda)
        t0 = time.perf_counter()
        # Running sums stay on the device: a .item() per step would make every step wait for the
        # GPU (a host sync); they are read once, at the epoch's end.
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        seen = 0
        bar = None
        if show:
            from tqdm import tqdm

            # a terminal redraws one line each second; a log (a pod's, kfp.local's pipe) gets a line
            # per redraw, so there the bar moves every 30 s: 30 lines for a 15-minute epoch, not 900
            bar = tqdm(total=steps, initial=first, desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr,
                       mininterval=1.0 if sys.stderr.isatty() else 30.0, leave=True, dynamic_ncols=False, ncols=100)
        for i, (xb, yb) in enumerate(epoch_loader, start=first):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            if cosine:
                for group in optimizer.param_groups:
                    group["lr"] = scheduled_lr(args.lr, args.lr_schedule, epoch * steps + i, args.epochs * steps)
            optimizer.zero_grad(set_to_none=True)
            logits = ddp(xb)
            loss = nn.functional.cross_entropy(logits, yb, weight=weight)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(yb)
            correct += (logits.detach().argmax(1) == yb).sum()
            seen += len(yb)
            if bar is not None:
                bar.update(1)
            if progress is not None:
                progress.step(epoch + (i + 1) / steps)
            if rank == 0 and every > 0 and i + 1 < steps and time.monotonic() >= next_ckpt:
                checkpoint(epoch, i + 1)
                next_ckpt = time.monotonic() + every
            if (i + 1) % STOP_CHECK_STEPS == 0 and i + 1 < steps and stop.agreed():
                if bar is not None:
                    bar.close()
                if rank == 0:
                    checkpoint(epoch, i + 1)
                _stop(progress, f"epoch {epoch + 1}, step {i + 1}/{steps}", rank, ckpt_uri)
        loss_total, n_correct = loss_sum.item(), correct.item()  # waits for the epoch's last step
        elapsed = time.perf_counter() - t0
        val_loss, val_acc = _evaluate(model, xv, yv, weight=weight)
        # the validation figures too: every rank's are the same up to rounding, and early stopping
        # must decide the same on every rank (one that left would hang the others in an all-reduce)
        g_loss, g_acc, g_rate, val_loss, val_acc = _all_mean(
            [loss_total / max(1, seen), n_correct / max(1, seen), seen / elapsed, val_loss, val_acc], device)
        if not (math.isfinite(g_loss) and math.isfinite(val_loss)):  # all ranks read the same reduced loss
            if bar is not None:
                bar.close()
            if rank == 0:
                storage.write_bytes(diverged_uri, json.dumps({"epoch": epoch + 1, "loss": str(g_loss if not
                                    math.isfinite(g_loss) else val_loss), "lr": args.lr}).encode())
                print(f"[kfp-pytorch] diverged in epoch {epoch + 1}: loss {g_loss}, val_loss {val_loss}", flush=True)
            if progress is not None:
                progress.close()
            dist.barrier()
            dist.destroy_process_group()
            return {"epochs": epoch + 1, "world_size": world, "backend": backend, "final": None, "diverged": True}
        entry = {"epoch": epoch + 1, "loss": g_loss, "accuracy": g_acc, "val_loss": val_loss,
                 "val_accuracy": val_acc, "samples_per_second": g_rate * world, "seconds": elapsed,
                 "attempt": attempt, "steps": steps - first, "lr": optimizer.param_groups[0]["lr"]}
        if first:  # loss and accuracy are of the steps after the resume (the others' sums were lost)
            entry["resumed_at_step"] = first
        history.append(entry)
        if rank == 0 and patience and early_stop(history, patience)[0] == entry["epoch"]:
            best = {"epoch": entry["epoch"], "model": {k: v.detach().to("cpu", copy=True)
                                                       for k, v in model.state_dict().items()}}
        if bar is not None:
            # no redraw here: close() draws the final line once, with these (a log got it twice)
            bar.set_postfix(loss=f"{g_loss:.4f}", val_acc=f"{val_acc:.3f}", refresh=False)
            bar.close()
        if progress is not None:
            progress.epoch_done(entry)
        if rank == 0:
            # a JSON line a log search can parse, its figures rounded for the eye (metrics.json and
            # the history keep them whole)
            print("[kfp-pytorch] " + json.dumps(_rounded(entry)), flush=True)
            checkpoint(epoch)
            next_ckpt = time.monotonic() + every
        dist.barrier()
        if epoch + 1 < args.epochs and stop.agreed():
            _stop(progress, f"after epoch {epoch + 1}", rank, ckpt_uri)

    best_epoch, stopped_early = early_stop(history, patience)
    summary = {"epochs": args.epochs, "world_size": world, "backend": backend,
               "final": history[-1] if history else None, "epochs_trained": len(history),
               "early_stopping_patience": patience, "stopped_early": stopped_early,
               "class_weight": None if weight is None else [round(float(w), 6) for w in weight],
               "lr_schedule": args.lr_schedule, "weight_decay": args.weight_decay,
               "exported_epoch": history[-1]["epoch"] if history else None}
    if rank == 0:
        cpu_model = model.to("cpu").eval()
        if patience and best is not None and best["epoch"] == best_epoch:
            cpu_model.load_state_dict(best["model"])
            summary["exported_epoch"] = best_epoch
        elif patience and best_epoch != summary["exported_epoch"]:
            # resumed from a checkpoint written without early stopping: the best weights were not kept
            print(f"[kfp-pytorch] epoch {best_epoch} had the lowest validation loss, but its weights were not kept "
                  "(the checkpoint resumed from was written without early stopping); exporting the last epoch's",
                  flush=True)
        storage.write_bytes(join(args.output_uri, "model/weights.pt"), _save_torch(cpu_model.state_dict()))
        storage.write_bytes(join(args.output_uri, "model/model.pt2"), export_program(cpu_model, meta["num_features"]))
        model_meta = {
            "format": "kfp-pytorch-model/v1", "model": args.model, "input_shape": [meta["num_features"]],
            "image_shape": meta.get("image_shape"), "classes": meta["classes"],
            "num_classes": meta["num_classes"], "class_names": meta.get("class_names"), "features": meta["features"],
            "label_column": meta.get("label_column", "label"),
            "normalization": meta["normalization"], "dataset_uri": args.dataset_uri,
            "program": "model.pt2", "weights": "weights.pt", "training": summary,
        }
        storage.write_bytes(join(args.output_uri, "model/metadata.json"), json.dumps(model_meta, indent=1).encode())
        storage.write_bytes(join(args.output_uri, HISTORY), json.dumps(history, indent=1).encode())
    if progress is not None:
        progress.close()
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _stop(progress: "_Progress | None", where: str, rank: int, ckpt_uri: str) -> None:
    """Every rank, once rank 0 has checkpointed: leave together."""
    if progress is not None:
        progress.close()
    if rank == 0:
        print(f"[kfp-pytorch] stopped on SIGTERM {where}, checkpointed to {ckpt_uri}; "
              "the next run into this output resumes there", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise Stopped(where)


def main(argv: list[str] | None = None) -> int:
    _watch_launcher()
    try:
        run(parse_args(argv))
    except Stopped:
        return EXIT_STOPPED
    except KfpPytorchError as e:  # a mistake to fix (a model factory, a table): what and what to do, no traceback
        lines = f"{type(e).__name__}: {e}".splitlines()  # as torch's own handler marks a rank's lines
        print("\n".join(f"[rank{os.environ.get('RANK', '0')}]: {line}" for line in lines), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
