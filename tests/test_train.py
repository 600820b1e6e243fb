"""Distributed training through the local backend: real torchrun, real gloo, real processes."""
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import time

import psutil
import pytest
import torch

from kfp_pytorch.components.errors import ConfigError, ModelFactoryError, TrainingError
from kfp_pytorch.components.models import build_model, resolve_factory
from kfp_pytorch.components.train import TrainSpec, train, worker_command
from kfp_pytorch.components.train_worker import CHECKPOINT


def test_trained_model_learns_and_writes_everything(trained_model):
    h = trained_model.history
    assert [e["epoch"] for e in h] == list(range(1, 7))
    assert h[-1]["loss"] < h[0]["loss"] and h[-1]["val_accuracy"] > 0.9
    assert all(e["samples_per_second"] > 0 for e in h)
    model_dir = trained_model.model_uri
    meta = json.loads(open(f"{model_dir}/metadata.json").read())
    assert meta["input_shape"] == [64] and meta["classes"] == list(range(10))
    assert meta["training"]["world_size"] == 2 and meta["training"]["backend"] == "gloo"
    program = torch.export.load(f"{model_dir}/model.pt2").module()
    assert program(torch.zeros(5, 64)).shape == (5, 10)  # dynamic batch


def test_workers_get_the_pytorchjob_environment(digits_data, tmp_path, monkeypatch, capfd):
    probe = tmp_path / "probe"
    monkeypatch.setenv("KFP_PYTORCH_TEST_PROBE_DIR", str(probe))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # one CPU for this process and the workers it starts
    try:
        train(TrainSpec(digits_data, str(tmp_path / "out"), model="factories:env_probe", epochs=1, workers=2,
                        progress="off"))
    finally:
        os.sched_setaffinity(0, mine)
    out, err = capfd.readouterr()
    # said before the workers start (they take seconds each to import torch), and 2 workers on 1 CPU noted
    assert "[kfp-pytorch] starting 2 local DDP workers (torchrun) on 1 CPU, 1 thread(s) each" in out
    assert "note: workers=2 local processes share 1 CPU, so they take turns" in err and "workers=1;" in err
    envs = [json.loads((probe / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["PET_NNODES"] == "1" and env["PET_NPROC_PER_NODE"] == "2" and env["PET_NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    # torchrun ran in a scratch temp dir of its own, removed afterwards with its torchelastic_* dir
    scratch = envs[0]["TMPDIR"]
    assert os.path.basename(scratch).startswith("kfp-pytorch-torchrun-") and not os.path.exists(scratch)


def test_local_workers_size_their_threads_by_the_cgroups_cpu_quota(tmp_path):
    # in a pod with a CPU limit os.cpu_count() is the node's: threads sized by it get throttled
    from kfp_pytorch.components.train import available_cpus

    mine = float(len(os.sched_getaffinity(0)))
    assert available_cpus(str(tmp_path / "none")) == mine  # no cgroup files: the affinity
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert available_cpus(str(v2)) == mine
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert available_cpus(str(v2)) == 1.0
    (v2 / "cpu.max").write_text(f"{int(mine * 1e5 * 4)} 100000\n")  # above the affinity: the affinity
    assert available_cpus(str(v2)) == mine
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(str(tmp_path / "v1")) == mine
    if mine >= 2:
        (v1 / "cpu.cfs_quota_us").write_text("150000\n")
        assert available_cpus(str(tmp_path / "v1")) == 1.5
    # more workers than CPUs is noted (not refused: a DDP check may want it), naming what fits
    from kfp_pytorch.components.train import local_cpu_note

    assert local_cpu_note(2, 2.0) is None and local_cpu_note(1, 1.0) is None
    assert "workers=3 local processes share 1.5 CPUs" in local_cpu_note(3, 1.5) and "workers=1;" in local_cpu_note(3, 1.5)


def test_worker_command_is_the_replica_entrypoint():
    cmd = worker_command(TrainSpec("s3://bkt/data", "s3://bkt/out", epochs=3))
    assert cmd[:5] == ["python", "-m", "torch.distributed.run", "-m", "kfp_pytorch.components.train_worker"]
    assert "--dataset-uri" in cmd and "s3://bkt/data" in cmd


def test_s3_dataset_checkpoints_and_model(s3, bucket, tmp_path):
    from kfp_pytorch.components.prepare_data import PrepareSpec, prepare_data

    data = f"s3://{bucket}/data"
    prepare_data(PrepareSpec("sample://digits", data))
    result = train(TrainSpec(data, f"s3://{bucket}/run", model="cnn", epochs=2, progress="off"))
    objects = s3.list(f"s3://{bucket}/run")
    for rel in (CHECKPOINT, "model/model.pt2", "model/weights.pt", "model/metadata.json", "history.json"):
        assert f"s3://{bucket}/run/{rel}" in objects
    assert result.model_uri == f"s3://{bucket}/run/model" and len(result.history) == 2
    # a resumed local run with storage_root: its checkpoint copied inside the server into the new
    # run's output, its table prepared again under another prefix
    from kfp_pytorch.components.train import seed_checkpoint

    s3.copy_dir(data, f"s3://{bucket}/again-data")
    spec = TrainSpec(f"s3://{bucket}/again-data", f"s3://{bucket}/again", model="cnn", epochs=3, progress="off")
    assert seed_checkpoint(spec, f"s3://{bucket}/run") == 2
    assert f"s3://{bucket}/again/{CHECKPOINT}" in s3.list(f"s3://{bucket}/again")
    more = train(spec)
    assert [h["epoch"] for h in more.history] == [1, 2, 3] and more.history[:2] == result.history


def test_a_resumed_step_finds_the_earlier_run_s_output_where_that_run_wrote_it():
    from types import SimpleNamespace

    from kfp_pytorch.components._kfp import artifact_store_uri, resumed_output_uri

    model = SimpleNamespace(path="/home/u/local_outputs/train-and-serve-2/train-op/model",
                            uri="/home/u/local_outputs/train-and-serve-2/train-op/model")
    assert resumed_output_uri(model, "", "train-and-serve-1") == "/home/u/local_outputs/train-and-serve-1/train-op/model"
    assert artifact_store_uri(model, "s3://ml/kfp") == "s3://ml/kfp/train-and-serve-2/train-op/model"
    assert resumed_output_uri(model, "s3://ml/kfp", "train-and-serve-1") == "s3://ml/kfp/train-and-serve-1/train-op/model"


def _children(want) -> list[psutil.Process]:
    """This test process's descendants whose command line ``want`` accepts."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:  # exited while we looked, or a zombie not yet reaped
            continue
        if want(cmd):
            out.append(p)
    return out


def _worker_pids() -> list[psutil.Process]:
    return _children(lambda cmd: "kfp_pytorch.components.train_worker" in cmd and "torch.distributed.run" not in cmd)


def test_killed_worker_resumes_from_checkpoint(digits_data, tmp_path):
    out = tmp_path / "out"
    spec = TrainSpec(digits_data, str(out), model="factories:slow", epochs=5, workers=2, max_restarts=2,
                     progress="off")
    box: dict = {}

    def _run():
        try:
            box["result"] = train(spec)
        except Exception as e:  # surfaced by the assertion below
            box["error"] = e

    t = threading.Thread(target=_run)
    t.start()
    ckpt = out / CHECKPOINT
    deadline = time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.exists(), "no checkpoint appeared"
    time.sleep(0.15)  # inside the next epoch
    victims = _worker_pids()
    assert victims, "no worker process found"
    os.kill(victims[-1].pid, signal.SIGKILL)
    t.join(timeout=180)
    assert "error" not in box, box.get("error")
    result = box["result"]
    epochs = [h["epoch"] for h in result.history]
    assert epochs == [1, 2, 3, 4, 5]  # every epoch exactly once: resumed, not restarted from scratch
    assert result.restarts >= 1
    first_after = next(h for h in result.history if h["attempt"] >= 1)
    assert first_after["epoch"] > 1


def test_a_worker_killed_mid_epoch_resumes_at_the_step_it_checkpointed(digits_data, tmp_path, capfd):
    out = tmp_path / "out"
    # batch 16: about 40 steps of 40 ms an epoch per worker; a checkpoint every 0.3 s within it
    spec = TrainSpec(digits_data, str(out), model="factories:slow", epochs=2, batch_size=16, workers=2,
                     max_restarts=2, progress="off", checkpoint_every_s=0.3)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=train(spec)))
    t.start()
    state_file, step = out / "checkpoints" / "last.json", 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and t.is_alive():
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):  # not there yet
            state = {}
        if state.get("epoch") == 0 and state.get("step", 0) >= 8:  # well inside epoch 1
            step = state["step"]
            break
        time.sleep(0.02)
    assert step, "no mid-epoch checkpoint appeared"
    os.kill(_worker_pids()[-1].pid, signal.SIGKILL)
    t.join(timeout=180)
    result = box["result"]
    assert [h["epoch"] for h in result.history] == [1, 2] and result.restarts >= 1
    first, second = result.history
    # epoch 1 went on from a step at or after the one seen, and trained on the rest of it only
    assert first["attempt"] >= 1 and first["resumed_at_step"] >= step
    assert first["resumed_at_step"] + first["steps"] == second["steps"]
    assert "resumed_at_step" not in second
    logs = capfd.readouterr()
    assert f"epoch 1, step {first['resumed_at_step']}/{second['steps']} (restart 1)" in logs.out + logs.err


def test_sigterm_to_torchrun_checkpoints_the_step_it_stops_at_and_the_next_run_resumes_there(
        digits_data, tmp_path, capfd):
    """What a preemption does in a pod: the kubelet signals torchrun (PID 1), which forwards it."""
    from kfp_pytorch.components.train_worker import STOP_CHECK_STEPS

    out = tmp_path / "out"
    # no timed checkpoints: only the epoch's end, and the stop, write one
    spec = TrainSpec(digits_data, str(out), model="factories:slow", epochs=2, batch_size=16, workers=2,
                     max_restarts=0, progress="off", checkpoint_every_s=0)
    box: dict = {}

    def _run():
        try:
            box["result"] = train(spec)
        except Exception as e:  # asserted below
            box["error"] = e

    t = threading.Thread(target=_run)
    t.start()
    state_file = out / "checkpoints" / "last.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not state_file.exists():
        time.sleep(0.02)
    assert json.loads(state_file.read_text())["epoch"] == 1  # epoch 1 done, none of epoch 2 saved
    time.sleep(0.5)  # about a dozen steps into epoch 2
    agents = _children(lambda cmd: "torch.distributed.run" in cmd)
    assert len(agents) == 1
    agents[0].send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert not t.is_alive() and isinstance(box.get("error"), TrainingError)
    state = json.loads(state_file.read_text())
    # stopped within epoch 2 at a step the ranks agreed on, with that step checkpointed
    assert state["epoch"] == 1 and state["step"] > 0 and state["step"] % STOP_CHECK_STEPS == 0
    assert box["error"].message.startswith(f"training stopped on SIGTERM epoch 2, step {state['step']}/")
    assert box["error"].hint == "run it again into the same output_uri: it resumes there"
    logs = capfd.readouterr()
    assert f"stopped on SIGTERM epoch 2, step {state['step']}/" in logs.out

    result = train(spec)  # the next run: on from that step, not from the epoch's start
    first, second = result.history
    assert second["resumed_at_step"] == state["step"]
    assert second["resumed_at_step"] + second["steps"] == first["steps"]
    assert f"epoch 2, step {state['step']}/{first['steps']} (restart 0)" in capfd.readouterr().out


def test_ctrl_c_on_a_local_run_checkpoints_where_the_workers_stop(digits_data, tmp_path):
    """Ctrl-C reaches only the foreground process (the workers have their own session): it stops
    them with SIGTERM, and they checkpoint the step they agree on before they go."""
    import subprocess
    import sys

    out = tmp_path / "out"
    code = ("from kfp_pytorch.components.train import TrainSpec, train\n"
            f"train(TrainSpec({digits_data!r}, {str(out)!r}, model='factories:slow', epochs=2, batch_size=16, "
            "workers=2, max_restarts=0, progress='off', checkpoint_every_s=0))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state_file = out / "checkpoints" / "last.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not state_file.exists() and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(0.5)  # inside epoch 2
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in text, text[-2000:]
    state = json.loads(state_file.read_text())
    assert state["epoch"] == 1 and state["step"] > 0, state
    assert f"stopped on SIGTERM epoch 2, step {state['step']}/" in text
    left = []  # no worker outlives the run (orphans would be reparented, not our children)
    for p in psutil.process_iter(["cmdline"]):
        if str(out) in " ".join(p.info["cmdline"] or []):
            left.append(p)
    assert not left


@pytest.mark.parametrize("killed", ["run", "launcher"])
def test_local_training_stops_when_what_started_it_is_killed_outright(digits_data, tmp_path, killed):
    """A kill -9 (a notebook kernel's restart, the OOM killer) of the local run, or of the process
    that called train(), reaches neither the workers (in their own session) nor torchrun: they
    trained on, for hours, unread. The workers watch both, and stop as on SIGTERM: at a step the
    ranks agree on, checkpointed (a log with no reader left is written nowhere, not died on)."""
    import subprocess
    import sys

    from kfp_pytorch.components.processes import RUN_OWNER_ENV, run_owner_token

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a local run
    out = tmp_path / "out"
    code = ("from kfp_pytorch.components.train import TrainSpec, train\n"
            f"train(TrainSpec({digits_data!r}, {str(out)!r}, model='factories:slow', epochs=50, batch_size=16, "
            "workers=2, max_restarts=0, progress='off', checkpoint_every_s=0))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, RUN_OWNER_ENV: run_owner_token(owner.pid)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state_file = out / "checkpoints" / "last.json"
    left: list = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not state_file.exists() and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, "training ended before it was killed"
        time.sleep(0.5)  # inside epoch 2
        victim = owner if killed == "run" else proc
        victim.kill()
        victim.wait()
        workers = lambda: [p for p in psutil.process_iter(["cmdline"])  # noqa: E731
                           if str(out) in " ".join(p.info["cmdline"] or []) and p.pid != proc.pid]
        deadline = time.monotonic() + 30
        while (left := workers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        text = proc.communicate(timeout=30)[0] if killed == "run" else ""
    finally:
        for p in (owner, proc, *left):
            try:
                p.kill()
            except (OSError, psutil.NoSuchProcess):
                pass
    assert not left, [p.info["cmdline"][:3] for p in left]
    # stopped as on SIGTERM, soon: mid-epoch, or at an epoch's end with that epoch checkpointed. A worker
    # whose log's reader was gone died at its next line, before the epoch's checkpoint: {"epoch": 1}
    state = json.loads(state_file.read_text())
    assert (state.get("step", 0) > 0 or state["epoch"] >= 2) and state["epoch"] < 5, state
    if killed == "run":  # the step, still running, says why its training stopped
        assert proc.returncode != 0 and "has ended: stopping" in text, text[-2000:]
        assert re.search(r"training stopped on SIGTERM (epoch \d, step \d+/\d+|after epoch \d), checkpointed", text), \
            text[-2000:]


def test_a_mid_epoch_resume_trains_on_the_rest_of_that_very_epoch():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from kfp_pytorch.components.train_worker import _Resumed

    ds = TensorDataset(torch.arange(100))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(4)
    whole = [b[0].tolist() for b in DataLoader(ds, batch_size=8, sampler=sampler)]
    rest = [b[0].tolist() for b in DataLoader(ds, batch_size=8, sampler=_Resumed(sampler, 3 * 8))]
    assert rest == whole[3:] and len(_Resumed(sampler, 3 * 8)) == 50 - 24


def test_a_checkpoint_is_resumed_only_by_the_run_that_wrote_it(digits_data, tmp_path):
    out = str(tmp_path / "out")
    first = train(TrainSpec(digits_data, out, epochs=1, lr=0.005, progress="off"))
    # more epochs, same settings: trains on from the checkpoint
    more = train(TrainSpec(digits_data, out, epochs=2, lr=0.005, progress="off"))
    assert [h["epoch"] for h in more.history] == [1, 2] and more.history[0] == first.history[0]
    # another learning rate and batch size: would have resumed with the old optimizer state, silently
    with pytest.raises(TrainingError) as e:
        train(TrainSpec(digits_data, out, epochs=3, lr=0.001, batch_size=32, progress="off"))
    assert (f"{out} holds the checkpoint of another training run (epoch 2: batch_size 64 there, 32 here; "
            "lr 0.005 there, 0.001 here)") in str(e.value)
    assert "give a new output_uri, or delete" in e.value.hint


def test_a_checkpoint_is_resumed_on_the_same_data_prepared_again_and_seeded_into_another_output(digits_data, tmp_path):
    # a resumed local run prepares its table again, into its own folder: the same data under another
    # URI resumes; other data (here another split) does not
    import shutil

    from kfp_pytorch.components.prepare_data import PrepareSpec, prepare_data
    from kfp_pytorch.components.train import seed_checkpoint

    first_out, out = str(tmp_path / "first"), str(tmp_path / "out")
    first = train(TrainSpec(digits_data, first_out, epochs=1, lr=0.005, progress="off"))
    again = shutil.copytree(digits_data, tmp_path / "again")
    spec = TrainSpec(str(again), out, epochs=2, lr=0.005, progress="off")
    assert seed_checkpoint(spec, str(tmp_path / "nothing-here")) is None
    with pytest.raises(TrainingError) as e:  # said before anything is copied
        seed_checkpoint(dataclasses.replace(spec, lr=0.001), first_out)
    assert f"cannot resume from the checkpoint at {first_out}: it was trained with other settings (lr 0.005 there, " \
           "0.001 here)" in str(e.value) and "run without resuming to start over" in e.value.hint
    assert seed_checkpoint(spec, first_out) == 1
    assert seed_checkpoint(spec, first_out) is None  # it holds one now: never overwritten
    more = train(spec)
    assert [h["epoch"] for h in more.history] == [1, 2] and more.history[0] == first.history[0]
    other = tmp_path / "other"
    prepare_data(PrepareSpec("sample://digits", str(other), seed=7))
    with pytest.raises(TrainingError) as e:
        train(TrainSpec(str(other), out, epochs=3, lr=0.005, progress="off"))
    assert f"holds the checkpoint of another training run (epoch 2: dataset_uri '{again}' there" in str(e.value)


def test_a_resumed_run_notes_the_checkpoint_it_starts_from_before_it_trains_an_epoch(digits_data, tmp_path,
                                                                                      monkeypatch):
    # a local run on S3 resumed from an earlier one, stopped before its own first checkpoint:
    # `runs --local` reads from the note that it holds the seeded epochs, and --resume trains on
    from kfp_pytorch.components._kfp import CHECKPOINT_NOTE_ENV

    out, note = str(tmp_path / "out"), tmp_path / "run" / ".checkpoint.train-op.json"
    note.parent.mkdir()
    train(TrainSpec(digits_data, out, epochs=1, progress="off"))
    assert not note.exists()  # the first run was not asked to note
    monkeypatch.setenv(CHECKPOINT_NOTE_ENV, str(note))
    again = train(TrainSpec(digits_data, out, epochs=1, progress="off"))  # nothing left to train: no epoch ends
    assert [h["epoch"] for h in again.history] == [1]
    assert json.loads(note.read_text()) == {"uri": os.path.join(out, "checkpoints"), "epochs": 1}


def test_a_checkpoint_that_would_run_code_is_not_loaded(digits_data, tmp_path):
    import argparse

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    # a pickle of more than tensors and plain data (here harmless; in a shared bucket, anything)
    torch.save({"epoch": 0, "model": {}, "optimizer": {}, "history": [], "args": argparse.Namespace(x=1)},
               out / CHECKPOINT)
    with pytest.raises(TrainingError) as e:
        train(TrainSpec(digits_data, str(out), epochs=1, max_restarts=0, progress="off"))
    assert (f"TrainingError: {out}/{CHECKPOINT} holds more than tensors and plain data (it pickles argparse.Namespace), "
            f"so it is not loaded, since it could run code: delete {out}/checkpoints to start over, or give a new "
            "output_uri") in str(e.value), str(e.value)


def test_failing_factory_in_workers_gives_the_worker_error(digits_data, tmp_path):
    with pytest.raises(TrainingError) as e:
        train(TrainSpec(digits_data, str(tmp_path / "o"), model="factories:broken", epochs=1, max_restarts=0,
                        progress="off"))
    assert "this factory always fails" in str(e.value)
    assert not _worker_pids()


def test_a_diverged_run_stops_at_once_and_says_to_lower_lr(digits_data, tmp_path, capfd):
    out = tmp_path / "o"
    with pytest.raises(TrainingError) as e:
        train(TrainSpec(digits_data, str(out), epochs=4, lr=1e30, max_restarts=2, progress="off"))
    assert "training diverged: the loss became nan in epoch 1 (lr 1e+30, batch size 64 x 2 workers)" in str(e.value)
    assert e.value.hint.startswith("lower lr (e.g. lr=1e+29)")
    logs = capfd.readouterr().out
    assert logs.count("diverged in epoch 1") == 1 and "resuming from checkpoint" not in logs  # no restart spent on it
    assert not (out / "model").exists() and not (out / "history.json").exists()  # nothing to evaluate or serve
    # the same output trained again, sanely: the mark of the diverged run does not outlive it
    result = train(TrainSpec(digits_data, str(out), epochs=1, progress="off"))
    assert len(result.history) == 1 and not (out / "diverged.json").exists()


def test_each_worker_process_needs_a_gpu_of_its_own(digits_data, tmp_path):
    from kfp_pytorch.components.train import cuda_problem

    assert cuda_problem("cuda", 2, True, 2) is None and cuda_problem("auto", 4, False, 0) is None
    assert cuda_problem("cpu", 8, True, 1) is None
    assert cuda_problem("auto", 4, True, 1)[0] == ("4 worker processes per node, but 1 GPU visible: each process "
                                                   "needs a GPU of its own")
    assert cuda_problem("cuda", 1, False, 0)[0] == "device=cuda, but no CUDA device is visible here"
    if not torch.cuda.is_available():  # here: refused before torchrun starts a process
        with pytest.raises(TrainingError, match="device=cuda, but no CUDA device is visible here") as e:
            train(TrainSpec(digits_data, str(tmp_path / "o"), device="cuda", epochs=1, progress="off"))
        assert "torchrun" not in str(e.value) and not (tmp_path / "o").exists()  # no worker ran


def test_more_local_workers_than_memory_holds_are_refused_before_any_starts(digits_data, tmp_path):
    from kfp_pytorch.components.train import WORKER_MEMORY, local_memory_problem

    assert local_memory_problem(4, 4 * WORKER_MEMORY) is None
    error, hint = local_memory_problem(100, 10 * WORKER_MEMORY + 1)
    assert error == ("workers=100: 100 local worker processes need about 29.3 GiB of memory (300 MiB each), "
                     "and this machine has 2.9 GiB available")
    assert hint == "run at most 10 local workers, or train on the cluster (train_backend=cluster)"
    # on this machine: far more than it holds, refused before torchrun starts any (the OOM killer
    # used to pick among them and this machine's other processes)
    many = int(psutil.virtual_memory().total // WORKER_MEMORY) + 1
    with pytest.raises(TrainingError, match=f"workers={many}: {many} local worker processes need about"):
        train(TrainSpec(digits_data, str(tmp_path / "o"), workers=many, epochs=1, progress="off"))
    assert not (tmp_path / "o").exists()


def test_timeout_kills_the_workers(digits_data, tmp_path):
    with pytest.raises(TrainingError, match="timeout"):
        train(TrainSpec(digits_data, str(tmp_path / "o"), model="factories:slow", epochs=50, timeout_s=3,
                        progress="off"))
    time.sleep(0.5)
    assert not _worker_pids()


@pytest.mark.parametrize("name,msg", [
    ("nosuchmodule_xyz:make", "cannot import model factory module 'nosuchmodule_xyz'"),
    ("factories:missing_fn", "has no callable 'missing_fn'"),
    ("resnet", "unknown model 'resnet'"),
])
def test_unimportable_factory_fails_before_any_worker(name, msg):
    with pytest.raises(ModelFactoryError) as e:
        resolve_factory(name)
    assert msg in str(e.value) and e.value.hint


def test_a_factory_defined_in_the_notebook_is_refused_with_where_to_put_it(monkeypatch):
    # "__main__:build" resolved in the notebook, and every rank then failed with "module '__main__'
    # has no callable 'build'" (a worker's __main__ is its own), under torchrun's failure report
    monkeypatch.setattr(sys.modules["__main__"], "build", lambda input_dim, num_classes: None, raising=False)
    with pytest.raises(ModelFactoryError) as e:
        resolve_factory("__main__:build")
    assert e.value.message == ("model factory '__main__:build' is defined in the notebook or script that runs this, "
                               "which the training workers (processes of their own, or a cluster's pods) cannot "
                               "import: theirs is another __main__")
    assert "pass 'mymodels:build'" in e.value.hint


def test_a_dataset_that_is_not_prepared_fails_before_any_worker(tmp_path):
    # it failed in every rank, seconds later, under torchrun's failure report; a raw table as well,
    # with NotADirectoryError
    from kfp_pytorch.components.errors import DatasetError

    table = tmp_path / "rows.csv"
    table.write_text("a,label\n1,0\n")
    for data, says, hint in ((tmp_path / "missing", f"no prepared dataset at {tmp_path / 'missing'} (metadata.json "
                              "missing)", "run prepare_data first"),
                             (table, f"{table} is a file, not a prepared dataset (prepare_data's output: a folder of "
                              "shards and metadata.json)", f"prepare_data(PrepareSpec('{table}', OUTPUT_URI))")):
        with pytest.raises(DatasetError) as e:
            train(TrainSpec(str(data), str(tmp_path / "out"), epochs=1, workers=1, progress="off"))
        assert e.value.message == says and hint in e.value.hint
        assert not (tmp_path / "out").exists() and not _worker_pids()  # no worker ever started


def test_an_output_that_cannot_be_written_fails_before_any_worker(digits_data, s3, tmp_path):
    # a file where the output folder would be, or a bucket that is not there: each rank failed
    # with NotADirectoryError (or NoSuchBucket) under torchrun's failure report
    from kfp_pytorch.components.errors import StorageError, StorageNotFound

    table = tmp_path / "rows.csv"
    table.write_text("a,label\n1,0\n")
    with pytest.raises(StorageError) as e:
        train(TrainSpec(digits_data, str(table / "out"), epochs=1, workers=1, progress="off"))
    assert e.value.message == f"write {table / 'out'}: {table} is a file, where that path needs a folder"
    with pytest.raises(StorageNotFound) as e:
        train(TrainSpec(digits_data, "s3://no-such-bucket-kfp/out", epochs=1, workers=1, progress="off"))
    assert e.value.message == "write s3://no-such-bucket-kfp/out: there is no bucket 'no-such-bucket-kfp'"
    assert "kfp-pytorch storage mb s3://no-such-bucket-kfp" in e.value.hint
    assert not _worker_pids() and table.read_text() == "a,label\n1,0\n"


def test_factory_results_are_checked():
    with pytest.raises(ModelFactoryError, match="always fails"):
        build_model("factories:broken", 4, 2)
    with pytest.raises(ModelFactoryError, match="model 'cnn' needs an image, and the table's 16 feature columns are "
                                                "not named as the pixels of one") as e:
        build_model("cnn", 16, 2)  # a square number of features is no image by itself
    assert "pixel0 ... pixel15" in e.value.hint and "'mlp'" in e.value.hint
    with pytest.raises(ModelFactoryError, match=r"image shape \[1, 8, 8\] does not hold 10 features"):
        build_model("cnn", 10, 2, (1, 8, 8))
    # what training feeds it, tried once: wrong output width, or a forward that cannot take the rows
    with pytest.raises(ModelFactoryError, match=r"answers \[2, 3\] for a batch of 2, not logits \[2, 10\]"):
        build_model("factories:three_outputs", 64, 10)
    with pytest.raises(ModelFactoryError, match=r"fails on a batch of shape \[2, 64\] \(rows of 64 features\): "
                                                r"RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        build_model("factories:wrong_width", 64, 10)
    bn = build_model("factories:with_batchnorm", 64, 10)
    assert bn.training and int(bn[1].num_batches_tracked) == 0  # the probe left no trace
    assert build_model("mlp", 64, 10).training and build_model("cnn", 64, 10, (1, 8, 8)).training


def test_invalid_settings_listed_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        train(TrainSpec("d", "o", epochs=0, workers=0, lr=-1, backend="slurm", seed=2**64))
    text = str(e.value)
    for field in ("epochs", "workers", "lr", "backend", "seed"):
        assert f"{field}:" in text
    for lr in (math.inf, math.nan):  # trained to NaN weights without a word
        with pytest.raises(ConfigError, match="lr: must be a finite number > 0"):
            train(TrainSpec("d", "o", lr=lr))
    for every in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="checkpoint_every_s: must be a finite number >= 0"):
            train(TrainSpec("d", "o", checkpoint_every_s=every))
    with pytest.raises(ConfigError, match="class_weight: must be one of none, balanced, got 'auto'"):
        train(TrainSpec("d", "o", class_weight="auto"))
    for patience in (-1, 1.5, True):
        with pytest.raises(ConfigError) as e:
            train(TrainSpec("d", "o", early_stopping_patience=patience))
        assert e.value.problems == [f"early_stopping_patience: must be an integer >= 0 (0: train every epoch), "
                                    f"got {patience!r}"]


def _trainjob_with_progress(trainer_status, tmp_path, name_run="run-progress"):
    """A TrainJob the Trainer runs with its TrainJobProgress gate on, and the status-server
    variables its node 0 pod gets (with the token the kubelet projects into it)."""
    from kfp_pytorch.components.cluster import ClusterTrainSpec, to_trainjob

    fake, _, server = trainer_status
    s = ClusterTrainSpec(TrainSpec("s3://data/x", "s3://models/x"), image="reg/kfp-pytorch:0.1.0", namespace="team-a",
                         run_id=name_run, task="train-op", user="alice", nodes=1)
    fake.create("trainjobs", "team-a", to_trainjob(s), "trainer.kubeflow.org/v1alpha1")
    [pod] = fake.list("pods", "team-a", f"jobset.sigs.k8s.io/jobset-name={s.name}")
    token = tmp_path / "token"
    token.write_text(server.token_for("team-a", pod["metadata"]["name"]))
    return s.name, server.env("team-a", s.name, token)


def test_a_trainjob_worker_reports_its_progress_to_the_trainer(trainer_status, digits_data, tmp_path, monkeypatch):
    # With the Trainer's TrainJobProgress gate on, `kubectl get trainjob` shows PROGRESS % and the
    # SDK the latest metrics, from what rank 0 POSTs to the Trainer's status server (HTTPS, its CA,
    # a projected token); before, a TrainJob of ours never reported any
    fake, _, server = trainer_status
    name, env = _trainjob_with_progress(trainer_status, tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    train(TrainSpec(digits_data, str(tmp_path / "out"), epochs=2, workers=2, progress="off"))
    status = fake.get("trainjobs", "team-a", name)["status"]["trainerStatus"]
    assert status["progressPercentage"] == 100 and status["estimatedRemainingSeconds"] == 0, status
    metrics = {m["name"]: m["value"] for m in status["metrics"]}
    assert metrics["currentEpoch"] == metrics["totalEpochs"] == "2" and float(metrics["val_accuracy"]) > 0.5, metrics
    assert {"loss", "accuracy", "val_loss", "samples_per_second"} <= set(metrics)
    assert [code for code, _, _ in server.received] == [200] * len(server.received)
    progress = [body["trainerStatus"]["progressPercentage"] for _, _, body in server.received]
    # from 0 up; rank 0 alone reports (one 100), at most one report per 5 s plus the last
    assert progress[0] == 0 and progress == sorted(progress) and progress.count(100) == 1, progress


def test_a_refused_progress_report_is_said_once_and_training_goes_on(trainer_status, tmp_path):
    import io

    from kfp_pytorch.components.trainer_status import TrainerStatusReporter

    fake, _, server = trainer_status
    name, env = _trainjob_with_progress(trainer_status, tmp_path)
    url, ca, token = (env[k] for k in ("KUBEFLOW_TRAINER_STATUS_URL", "KUBEFLOW_TRAINER_STATUS_CA_CERT",
                                       "KUBEFLOW_TRAINER_STATUS_TOKEN"))
    (tmp_path / "other").mkdir()
    other, _ = _trainjob_with_progress(trainer_status, tmp_path / "other", name_run="run-other")

    def report(url, token, ca, times=2):
        err = io.StringIO()
        r = TrainerStatusReporter(url, token, ca, min_interval_s=0, err=err)
        for i in range(times):
            r.update(10 * (i + 1), 60, {"loss": 0.5})
            time.sleep(0.2)
        r.close()
        return r.sent, err.getvalue()

    bad = tmp_path / "bad-token"
    bad.write_text("not-a-projected-token")
    # a token the Trainer did not issue; the token of another job's pod; a CA that is not its CA
    for args, why in [((url, str(bad), ca), "HTTP 401: Invalid or expired token"),
                      ((url.replace(name, other), token, ca), "HTTP 403: Forbidden"),
                      ((url, token, None), "CERTIFICATE_VERIFY_FAILED")]:
        sent, err = report(*args)
        assert sent == 0 and err.count("[kfp-pytorch] could not report progress") == 1, err
        assert why in err and "training goes on" in err, err
    assert "trainerStatus" not in fake.get("trainjobs", "team-a", name)["status"]
    sent, err = report(url, token, ca)
    assert sent == 2 and err == ""
    assert fake.get("trainjobs", "team-a", name)["status"]["trainerStatus"]["progressPercentage"] == 20


def test_early_stopping_reads_the_first_lowest_validation_loss():
    from kfp_pytorch.components.train import early_stop

    h = lambda *losses: [{"epoch": i + 1, "val_loss": v} for i, v in enumerate(losses)]  # noqa: E731
    assert early_stop([], 2) == (None, False)
    assert early_stop(h(1.0, 0.8, 0.9), 2) == (2, False)  # one epoch without improvement: not yet
    assert early_stop(h(1.0, 0.8, 0.9, 0.85), 2) == (2, True)
    assert early_stop(h(1.0, 0.8, 0.8, 0.8), 2) == (2, True)  # an equal loss is no improvement
    assert early_stop(h(1.0, 0.8, 0.9, 0.7), 2) == (4, False)  # improved: patience starts again
    assert early_stop(h(1.0, 0.8, 0.9, 0.95, 0.99), 0) == (2, False)  # 0: never stops early


def test_early_stopping_stops_an_overfitting_run_and_exports_its_best_epoch(tmp_path, capfd):
    # random labels: the model learns the train rows by heart and the validation loss climbs
    import numpy as np
    import pandas as pd

    from kfp_pytorch.components.prepare_data import PrepareSpec, load_split, prepare_data

    rng = np.random.default_rng(3)
    table = pd.DataFrame(rng.normal(size=(400, 24)), columns=[f"f{i}" for i in range(24)])
    table["label"] = rng.integers(0, 3, size=len(table))
    table.to_csv(tmp_path / "noise.csv", index=False)
    data = str(tmp_path / "data")
    prepare_data(PrepareSpec(str(tmp_path / "noise.csv"), data))
    spec = TrainSpec(data, str(tmp_path / "out"), epochs=40, lr=0.02, batch_size=16, workers=2, progress="off",
                     early_stopping_patience=3)
    result = train(spec)
    h = result.history
    best = min(h, key=lambda e: e["val_loss"])
    assert len(h) < 40 and len(h) == best["epoch"] + 3  # stopped 3 epochs after the best
    assert result.exported_epoch == best["epoch"] and result.exported is best
    assert h[-1]["val_loss"] > best["val_loss"]
    out = capfd.readouterr().out
    assert (f"early stopping after epoch {len(h)}: the validation loss has not improved for 3 epoch(s) since "
            f"epoch {best['epoch']} (val_loss {best['val_loss']:.4f}); exporting epoch {best['epoch']}'s weights") in out
    # the exported program is the best epoch's: its validation loss is that epoch's, not the last's
    module = torch.export.load(f"{result.model_uri}/model.pt2").module()
    meta = json.loads(open(f"{result.model_uri}/metadata.json").read())
    x, y = load_split(data, "val")
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert loss == pytest.approx(best["val_loss"], rel=1e-5)
    assert meta["training"]["exported_epoch"] == best["epoch"] and meta["training"]["stopped_early"] is True
    # the evaluation report says which epoch it evaluated, and marks it on the curves
    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate, render_report

    res = evaluate(EvaluateSpec(data, result.model_uri, threshold=0.0))
    assert (f"<td>model</td><td>epoch {best['epoch']} of {len(h)}: training stopped early, and the epoch with the "
            "lowest validation loss was kept</td>") in res["report_html"]
    plain = render_report(res["metrics"], h, res["classes"], res["gate"])
    curves = lambda page: page.split("src='data:image/png;base64,")[1].split("'")[0]  # noqa: E731
    assert "stopped early" not in plain and curves(plain) != curves(res["report_html"])  # the mark is drawn
    weights = torch.load(tmp_path / "out" / "model" / "weights.pt")
    # run again into the same output (a retried step): it resumes, stops at once, exports the same weights
    again = train(spec)
    assert [e["epoch"] for e in again.history] == [e["epoch"] for e in h] and again.exported_epoch == best["epoch"]
    exported = torch.load(tmp_path / "out" / "model" / "weights.pt")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)


def test_balanced_class_weights_make_a_rare_class_found(tmp_path):
    # 5% of the rows are the class that matters (a fault, a fraud): unweighted, the model mostly
    # answers the common class; balanced, the rare one weighs as much in the loss and is found
    import numpy as np
    import pandas as pd
    from sklearn.utils.class_weight import compute_class_weight

    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate
    from kfp_pytorch.components.prepare_data import PrepareSpec, load_split, prepare_data
    from kfp_pytorch.components.train_worker import class_weights

    rng = np.random.default_rng(5)
    y = (rng.random(1200) < 0.05).astype(int)
    x = rng.normal(size=(len(y), 6))
    x[:, 0] += 1.5 * y
    x[:, 1] -= 1.0 * y
    table = pd.DataFrame(x, columns=[f"f{i}" for i in range(6)]).assign(label=y)
    table.to_csv(tmp_path / "rare.csv", index=False)
    data = str(tmp_path / "data")
    prepare_data(PrepareSpec(str(tmp_path / "rare.csv"), data))
    recall = {}
    for weighting in ("none", "balanced"):
        r = train(TrainSpec(data, str(tmp_path / weighting), epochs=6, lr=0.005, batch_size=32, workers=2,
                            progress="off", class_weight=weighting))
        cm = np.asarray(evaluate(EvaluateSpec(data, r.model_uri))["metrics"]["confusion_matrix"])
        recall[weighting] = cm[1, 1] / cm[1].sum()
        meta = json.loads(open(f"{r.model_uri}/metadata.json").read())
        if weighting == "balanced":  # scikit-learn's "balanced" weights of the train split, recorded
            _, y_train = load_split(data, "train")
            expected = compute_class_weight("balanced", classes=np.array([0, 1]), y=y_train)
            assert meta["training"]["class_weight"] == pytest.approx(expected.tolist(), rel=1e-5)
        else:
            assert meta["training"]["class_weight"] is None
    assert recall["none"] < 0.5 and recall["balanced"] >= 0.8, recall
    # a class id no row has (ids with gaps) weighs nothing; the others as scikit-learn weighs them
    w = class_weights(np.array([0, 0, 0, 2]), 3)
    assert w.tolist() == pytest.approx([2 / 3, 0.0, 2.0])


def test_a_cosine_schedule_anneals_the_rate_to_zero_and_resumes_at_the_step_it_stopped(digits_data, tmp_path):
    from kfp_pytorch.components.train import scheduled_lr

    assert [scheduled_lr(0.1, "cosine", s, 4) for s in range(5)] == pytest.approx(
        [0.1, 0.1 * (1 + math.cos(math.pi / 4)) / 2, 0.05, 0.1 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.0])
    assert scheduled_lr(0.1, "constant", 3, 4) == 0.1
    # the rate each epoch ends at is the schedule's at that epoch's last step, resumed or not
    spec = TrainSpec(digits_data, str(tmp_path / "out"), epochs=2, lr=0.01, workers=1, progress="off",
                     lr_schedule="cosine")
    first = train(spec)
    steps = first.history[0]["steps"]
    assert first.history[0]["lr"] == pytest.approx(scheduled_lr(0.01, "cosine", steps - 1, 2 * steps))
    more = train(dataclasses.replace(spec, epochs=4))  # on for more epochs: the schedule spans all 4
    assert [h["lr"] for h in more.history[2:]] == pytest.approx(
        [scheduled_lr(0.01, "cosine", (e + 1) * steps - 1, 4 * steps) for e in (2, 3)])
    assert more.history[-1]["lr"] < 1e-5 < more.history[2]["lr"]
    with pytest.raises(ConfigError, match="lr_schedule: must be one of constant, cosine, got 'step'"):
        train(TrainSpec("d", "o", lr_schedule="step"))


def test_weight_decay_shrinks_the_weights_it_is_asked_to(digits_data, tmp_path):
    norms = {}
    for decay in (0.0, 0.5):
        r = train(TrainSpec(digits_data, str(tmp_path / f"wd{decay}"), epochs=2, lr=0.01, workers=1, progress="off",
                            weight_decay=decay))
        weights = torch.load(f"{r.model_uri}/weights.pt")
        norms[decay] = math.sqrt(sum(float((w ** 2).sum()) for k, w in weights.items() if k.endswith("weight")))
        assert json.loads(open(f"{r.model_uri}/metadata.json").read())["training"]["weight_decay"] == decay
        assert r.history[-1]["val_accuracy"] > 0.8  # a regulariser, not a wrecking ball
    assert norms[0.5] < 0.9 * norms[0.0], norms
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ConfigError, match="weight_decay: must be a number in \\[0, 1\\)"):
            train(TrainSpec("d", "o", weight_decay=bad))


def test_a_logged_epoch_is_one_bar_line_and_one_rounded_json_line(digits_data, tmp_path, capfd):
    # a log (kfp.local's pipe, a pod's) got each epoch's finished bar twice, and a JSON line of
    # 16-digit floats (0.3512523026458789)
    result = train(TrainSpec(digits_data, str(tmp_path / "out"), epochs=2, workers=1, progress="on"))
    out, err = capfd.readouterr()
    text = out + err
    for epoch in (1, 2):
        done = [line for line in re.split(r"[\r\n]", text) if line.startswith(f"epoch {epoch}/2: 100%")]
        assert len(done) == 1 and "loss=" in done[0] and "val_acc=" in done[0], done
    lines = [json.loads(line.split("[kfp-pytorch] ", 1)[1]) for line in out.splitlines()
             if line.startswith("[kfp-pytorch] {")]
    assert [e["epoch"] for e in lines] == [1, 2]
    for logged, kept in zip(lines, result.history):
        assert logged.keys() == kept.keys()
        for key, value in kept.items():
            if isinstance(value, float):
                assert logged[key] == float(f"{value:.4g}"), (key, value)  # 4 significant digits
            else:
                assert logged[key] == value


def test_a_batch_that_covers_the_whole_split_is_noted_once(digits_data, tmp_path, capfd):
    # batch_size 100000 on 1257 rows: one optimizer step an epoch, and the gate failed with no word of why
    from kfp_pytorch.components.train import batch_note

    assert batch_note(1257, 64, 2) is None and batch_note(1, 64, 1) is None
    assert batch_note(1257, 100000, 2) == ("note: batch_size 100000 x 2 workers covers all 1257 training rows, so "
                                           "each epoch is one optimizer step and a few epochs barely train; "
                                           "batch_size=78 takes 9 steps an epoch")
    assert batch_note(1257, 629, 2) and not batch_note(1257, 628, 2)  # a rank's share is 629 rows (padded)
    train(TrainSpec(digits_data, str(tmp_path / "out"), epochs=2, workers=2, batch_size=100000, progress="off"))
    out, _ = capfd.readouterr()
    assert out.count("[kfp-pytorch] note: batch_size 100000 x 2 workers covers all") == 1, out
