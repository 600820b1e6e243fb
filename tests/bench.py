"""kfp-pytorch benchmarks: every figure as a ratio against its named baseline, side by side.

    make bench                  # everything
    python tests/bench.py --only train,data,serve,pipeline [--json OUT]

Figures (issue #3):
- k8s:      API calls per 4-replica PyTorchJob followed to completion (one watch: O(status changes)),
            and the time from the fake moving the pods to Running until the component sees it.

Figures (issue #4):
- simulate: all six policies on cluster07 in one run (target <= 10 s; a reference implementation 3.8 s),
            in one process and in one process per policy up to the CPUs (the CLI's default).
- cycle:    one scheduling cycle (priorities + admission) at 10k pending gangs, 1000 users, 1000 nodes
            (target median <= 50 ms), and its growth from 10k to 100k pending (target <= 12x).
- fairness: every fairness goal of `fairshare` against the five baselines, per trace (protocol defaults).
- fairness-seeds: the same goals with users drawn by protocol seeds 1-11 (robustness).
- fairness-halves: the same goals on each trace's two halves (new job mixes), seeds 0-3.
  The fair baselines are judged by the same goals in all three, side by side.
- fairness-spread: the same goals at seed 0 with every policy placing small pods by `spread`.

Figures (issue #2):
- train:    local backend of `train` vs a hand-written torchrun script (tests/bench_baseline_ddp.py),
            same model, data, seed and steps; ratio of training-loop seconds (target <= 1.10).
- data:     reading a 100 MB shard through the storage module from the S3 server vs a bare
            minio get_object of the same object; ratio of throughputs (target >= 0.8). And a
            prepared train split read back: default shards vs 512-row ones. And a CSV read as
            prepare_data and serve predict read it vs a plain pandas.read_csv, and the FP32 rows
            serve predict takes from a table vs pandas' table[features].to_numpy(float32).
- serve:    p50/p99 latency and requests/s of the local model server at concurrency 1 and 16 vs
            an in-process call of the same model (target: p50 overhead <= 3 ms at concurrency 1);
            and rows/s of a table through it (serve predict), rows as binary tensors vs JSON.
- pipeline: wall time of `make demo` after setup, and of one kfp.local pipeline run.
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
ROOT = HERE.parent
TRACES = ROOT.parent / "shared" / "traces" / "itp-2021"
sys.path.insert(0, str(HERE))

from servers import start_seaweedfs  # noqa: E402

ROWS: list[dict] = []
GOAL_RUNS: list = []
"""Every run the fairness benches judged (``evaluate.GoalRun``), for the goal-grid plot."""


def row(figure, value, baseline, ratio, target, ok, unit=""):
    ROWS.append({"figure": figure, "value": value, "baseline": baseline, "ratio": ratio, "target": target,
                 "ok": ok, "unit": unit})
    mark = "ok " if ok else ("   " if ok is None else "MISS")
    r = f"{ratio:8.3f}x" if ratio is not None else "         "
    print(f"  [{mark}] {figure:<44} {value:>10.4g} {unit:<6} vs {baseline:>10.4g}  {r}  target {target}", flush=True)


def bench_train(tmp: Path) -> None:
    import pandas as pd

    from kfp_pytorch.components.prepare_data import PrepareSpec, prepare_data
    from kfp_pytorch.components.train import TrainSpec, free_port, train

    print("train: local backend vs hand-written torchrun script (2 workers, gloo, 60k x 64 rows, 3 epochs)")
    rng = np.random.default_rng(0)
    n, d, k = 60_000, 64, 10
    centers = rng.normal(size=(k, d))
    y = rng.integers(0, k, n)
    df = pd.DataFrame(centers[y] + rng.normal(scale=2.0, size=(n, d)), columns=[f"f{i}" for i in range(d)])
    df["label"] = y
    df.to_csv(tmp / "big.csv", index=False)
    data = str(tmp / "data")
    prepare_data(PrepareSpec(str(tmp / "big.csv"), data, shard_rows=8192))
    epochs, bs, lr, seed = 3, 128, 0.001, 0
    # Interleaved, so machine noise hits both alike. Each side's figure is the median of its 12 epoch
    # times, times the epochs: on this shared 2-core machine one epoch takes 0.9-1.7 s, and the best
    # run of four swung the ratio between 0.92x and 1.17x across bench runs, the median 0.88x-1.14x
    # while the baseline always ran first in each pair (0.90x-1.12x in five runs since the order alternates).
    ours, base = [], []

    def run_base():
        env = dict(os.environ, OMP_NUM_THREADS="1", PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", str(HERE / "bench_baseline_ddp.py"),
                              data, str(epochs), str(bs), str(lr), str(seed)], capture_output=True, text=True, env=env)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("BASELINE ")]
        if not line:
            raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
        base.append(json.loads(line[0][9:])["epoch_seconds"])

    def run_ours(rep):
        os.environ["OMP_NUM_THREADS"] = "1"
        r = train(TrainSpec(data, str(tmp / f"out{rep}"), epochs=epochs, batch_size=bs, lr=lr, seed=seed,
                            progress="off"))
        ours.append([h["seconds"] for h in r.history])

    # ABBA: the side that runs first alternates, so neither gets the quieter slot of each pair.
    for rep in range(4):
        if rep % 2 == 0:
            run_base()
            run_ours(rep)
        else:
            run_ours(rep)
            run_base()
    o, b = (statistics.median(t for run in runs for t in run) * epochs for runs in (ours, base))
    row("train loop seconds (kfp-pytorch / torchrun)", o, b, o / b, "<= 1.10", o / b <= 1.10, "s")
    samples = n * 0.7 * epochs  # the train split's rows, every epoch
    row("train samples/s (kfp-pytorch)", samples / o, samples / b, None, "report", None, "1/s")


def bench_data(tmp: Path) -> None:
    from minio import Minio

    from kfp_pytorch.components.storage import Storage, StorageConfig

    print("data: 100 MB shard through the storage module vs bare minio get_object")
    s3 = start_seaweedfs(tmp / "weed")
    try:
        host = s3.url.split("//")[1]
        cfg = StorageConfig(endpoint=host, access_key=s3.env["AWS_ACCESS_KEY_ID"],
                            secret_key=s3.env["AWS_SECRET_ACCESS_KEY"])
        st = Storage(cfg)
        st.ensure_bucket("s3://bench")
        blob = np.random.default_rng(0).bytes(100 * 1024 * 1024)
        st.write_bytes("s3://bench/shard.bin", blob)
        bare = Minio(host, access_key=cfg.access_key, secret_key=cfg.secret_key, secure=False)

        def bare_get() -> None:
            resp = bare.get_object("bench", "shard.bin")
            try:
                assert len(resp.read()) == len(blob)
            finally:
                resp.close()
                resp.release_conn()

        def ours_get() -> None:
            assert len(st.read_bytes("s3://bench/shard.bin")) == len(blob)

        ours_get(), bare_get()  # warm both paths (connections, the server's cache) before timing
        mb = len(blob) / 2**20
        o, b = (mb / secs for secs in _side_by_side(ours_get, bare_get))
        row("S3 read MB/s (storage module / bare minio)", o, b, o / b, ">= 0.8", o / b >= 0.8, "MB/s")
        # a prepared split read back as each training rank reads it: the default shards (about
        # 16 MiB) vs the 512-row shards that were the default before
        import pandas as pd

        from kfp_pytorch.components.prepare_data import PrepareSpec, load_split, prepare_data

        rng = np.random.default_rng(0)
        frame = pd.DataFrame(rng.normal(size=(300_000, 20)).astype(np.float32), columns=[f"f{i}" for i in range(20)])
        frame.assign(label=rng.integers(0, 5, len(frame))).to_parquet(tmp / "table.parquet")
        secs = {}
        for rows in (0, 512):
            prepare_data(PrepareSpec(str(tmp / "table.parquet"), f"s3://bench/prepared-{rows}", shard_rows=rows), st)
            load_split(f"s3://bench/prepared-{rows}", "train", st)  # warm
            secs[rows] = statistics.median(timeit.repeat(lambda: load_split(f"s3://bench/prepared-{rows}", "train", st),
                                                         number=1, repeat=3))
        row("train split load s, 210k rows (16 MiB shards / 512-row shards)", secs[0], secs[512], secs[0] / secs[512],
            "report", None, "s")
        # a CSV read as prepare_data and serve predict read one (separator and encoding found, header
        # as written, trailing separators and empty rows) vs one plain pandas.read_csv of it
        from kfp_pytorch.components.prepare_data import load_table

        csv = tmp / "table.csv"
        frame.assign(label=rng.integers(0, 5, len(frame))).iloc[:200_000].to_csv(csv, index=False)
        def ours_csv() -> None:
            assert len(load_table(str(csv))) == 200_000

        def pandas_csv() -> None:
            assert len(pd.read_csv(csv)) == 200_000

        o, b = _side_by_side(ours_csv, pandas_csv, rounds=4)
        row("CSV load s, 200k x 21 (load_table / pandas.read_csv)", o, b, o / b, "report", None, "s")
        # the rows serve predict sends, taken from a loaded table: each feature column cast into the
        # FP32 matrix vs pandas' table[features].to_numpy(float32) (a float64 copy first)
        from kfp_pytorch.components.batch_predict import feature_matrix

        features = [f"f{i}" for i in range(64)]
        table = pd.DataFrame(rng.normal(size=(300_000, 64)), columns=features).assign(label=0)
        def ours_rows() -> None:
            assert feature_matrix(table, features, "label", "bench")[0].shape == (300_000, 64)

        def pandas_rows() -> None:
            assert table[features].to_numpy(dtype=np.float32).shape == (300_000, 64)

        o, b = _side_by_side(ours_rows, pandas_rows, rounds=6)
        row("feature rows s, 300k x 64 (feature_matrix / table[features].to_numpy)", o, b, o / b, "report", None, "s")
    finally:
        s3.stop()


def _side_by_side(ours, base, rounds: int = 8) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``base()``, run in alternating order (ABBA: base first in
    rounds 0 and 3 of every 4), so neither always runs right after the other or during the
    previous benchmark's teardown. The functions check what they read themselves."""
    times = {ours: [], base: []}
    for i in range(rounds):
        for fn in ((base, ours) if i % 4 in (0, 3) else (ours, base)):
            t = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t)
    return statistics.median(times[ours]), statistics.median(times[base])


def _lat(fn, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_serve(tmp: Path) -> None:
    import requests

    from kfp_pytorch.components.predictor import ModelRunner
    from kfp_pytorch.components.prepare_data import PrepareSpec, prepare_data
    from kfp_pytorch.components.serve import ServeSpec, infer, serve, stop_server
    from kfp_pytorch.components.train import TrainSpec, train

    print("serve: local model server (KServe ModelServer, OIP v2 REST) vs in-process call")
    os.environ["KFP_PYTORCH_HOME"] = str(tmp / "home")
    data = str(tmp / "digits")
    prepare_data(PrepareSpec("sample://digits", data))
    r = train(TrainSpec(data, str(tmp / "m"), epochs=2, progress="off"))
    runner = ModelRunner(r.model_uri)
    row_ = [[float(v) for v in runner.mean]]
    ep = serve(ServeSpec(r.model_uri, "bench"))
    body = {"inputs": [{"name": "input-0", "shape": [1, 64], "datatype": "FP32", "data": row_[0]}]}
    try:
        local = threading.local()
        x = np.asarray(row_, dtype=np.float32)

        def call():  # the shipped client: components.serve.infer, one kept-alive pool per process
            infer(ep.url, ep.name, row_)

        def call_requests():  # the same request through a requests.Session per thread, for comparison
            s = getattr(local, "s", None) or setattr(local, "s", requests.Session()) or local.s
            resp = s.post(ep.infer_url, json=body, timeout=10)
            resp.raise_for_status()
            resp.json()

        u = urllib.parse.urlparse(ep.infer_url)
        conn, payload = http.client.HTTPConnection(u.hostname, u.port, timeout=10), json.dumps(body).encode()

        def bare():  # a bare keep-alive http.client connection: the floor of what a client costs
            conn.request("POST", u.path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            json.loads(resp.read())
            assert resp.status == 200, resp.status

        def in_process():
            runner.predict(x)

        # Side by side: rounds of 50 calls of each, interleaved, so a slow phase of this shared
        # machine weighs on every client alike (blocks of 400 one after another swung the
        # overhead by 1 ms between runs).
        clients = {"inproc": in_process, "http": call, "requests": call_requests, "bare": bare}
        for f in clients.values():
            _lat(f, 50)
        lat = {k: [] for k in clients}
        for _ in range(8):
            for k, f in clients.items():
                lat[k] += _lat(f, 50)
        conn.close()
        inproc, http1 = lat["inproc"], lat["http"]
        p50_in, p50_h = np.percentile(inproc, 50) * 1e3, np.percentile(http1, 50) * 1e3
        row("serve p50 ms, concurrency 1 (HTTP / in-process)", p50_h, p50_in, p50_h / p50_in,
            "overhead <= 3 ms", p50_h - p50_in <= 3.0, "ms")
        row("serve p50 overhead ms, concurrency 1", p50_h - p50_in, 0.0, None, "<= 3", p50_h - p50_in <= 3.0, "ms")
        # What the client library costs: the same request through requests (1–1.5 ms more here, 2.5 on a
        # slow machine) and through a bare keep-alive http.client connection (the floor).
        p50_req, p50_bare = (np.percentile(lat[k], 50) * 1e3 for k in ("requests", "bare"))
        row("serve p50 overhead ms, concurrency 1, requests.Session", p50_req - p50_in, 0.0, None, "report", None, "ms")
        row("serve p50 overhead ms, concurrency 1, bare http.client", p50_bare - p50_in, 0.0, None, "report", None, "ms")
        row("serve p99 ms, concurrency 1", np.percentile(http1, 99) * 1e3, np.percentile(inproc, 99) * 1e3,
            None, "report", None, "ms")
        row("serve req/s, concurrency 1", 1 / statistics.mean(http1), 1 / statistics.mean(inproc),
            (1 / statistics.mean(http1)) / (1 / statistics.mean(inproc)), "report", None, "1/s")
        per, lat16 = 60, []
        lock = threading.Lock()

        def worker():
            mine = _lat(call, per)
            with lock:
                lat16.extend(mine)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            for f in [pool.submit(worker) for _ in range(16)]:
                f.result()
        wall = time.perf_counter() - t0
        row("serve p50 ms, concurrency 16", np.percentile(lat16, 50) * 1e3, p50_in, None, "report", None, "ms")
        row("serve p99 ms, concurrency 16", np.percentile(lat16, 99) * 1e3, np.percentile(inproc, 99) * 1e3,
            None, "report", None, "ms")
        row("serve req/s, concurrency 16", len(lat16) / wall, 1 / statistics.mean(inproc), None, "report", None, "1/s")
        # a table through the server (serve predict): rows as binary FP32 tensors vs as JSON numbers,
        # default batches (4096 rows of 64 features), interleaved rounds
        from kfp_pytorch.components.batch_predict import Target, predict_rows

        table = np.tile(np.asarray(runner.mean, dtype=np.float32), (20000, 1))
        table += np.random.default_rng(0).normal(size=table.shape).astype(np.float32)
        target, secs = Target(ep.url, ep.name), {True: [], False: []}
        for _ in range(3):
            for binary in (True, False):
                t0 = time.perf_counter()
                predict_rows(target, table, binary=binary)
                secs[binary].append(time.perf_counter() - t0)
        b, j = len(table) / statistics.median(secs[True]), len(table) / statistics.median(secs[False])
        row("serve predict rows/s, 64 features (binary tensors / JSON)", b, j, b / j, "report", None, "1/s")
    finally:
        stop_server("bench")


def bench_pipeline(tmp: Path) -> None:
    print("pipeline: wall time of `make demo` (after setup) and of one kfp.local run")
    env = dict(os.environ, KFP_PYTORCH_HOME=str(tmp / "demo-home"))
    t = time.perf_counter()
    out = subprocess.run(["make", "-s", "demo"], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "stop", "digits"], env=env, capture_output=True)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "run", "train_and_serve", "--local", "--json",
                          "--no-predict"], capture_output=True, text=True, env=env)
    total = time.perf_counter() - t
    summary = json.loads(out.stdout)  # --json: the summary alone on stdout
    subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "stop", "digits"], env=env, capture_output=True)
    row("make demo wall seconds", wall, wall, None, "report", None, "s")
    row("kfp.local pipeline run seconds (in CLI)", summary["elapsed_s"], total, summary["elapsed_s"] / total,
        "report", None, "s")


def bench_simulate(tmp: Path) -> None:
    from kfp_pytorch.fairness_scheduler.policy import POLICIES
    from kfp_pytorch.fairness_scheduler.report import default_workers, run_protocol

    print("simulate: all six policies on cluster07 (12.7k jobs), protocol defaults")
    trace = TRACES / "cluster07.csv"
    # The same pure-Python loop as `python -m timeit 'sum(i*i for i in range(100000))'`: this
    # kind of machine has read 5.4 ms at best and up to 9.8 ms within one session, and the
    # simulator's wall time moves with it. A reading, not a goal.
    loop = min(timeit.repeat("sum(i*i for i in range(100000))", number=20, repeat=5)) / 20 * 1e3
    row("machine speed: pure-Python reference loop, ms", loop, 5.4, loop / 5.4, "report (best seen 5.4 ms)", None, "ms")
    t = time.perf_counter()
    run_protocol(trace, list(POLICIES), workers=1)
    wall = time.perf_counter() - t
    row("six policies on cluster07, one process, seconds", wall, 3.8, wall / 3.8, "<= 10 s (ref impl 3.8 s)",
        wall <= 10, "s")
    workers = default_workers(len(POLICIES))
    t = time.perf_counter()
    run_protocol(trace, list(POLICIES), workers=workers)
    wall = time.perf_counter() - t
    row(f"six policies on cluster07, {workers} processes (the CLI's default), seconds", wall, 3.8, wall / 3.8,
        "<= 10 s (ref impl 3.8 s)", wall <= 10, "s")


def bench_k8s(tmp: Path) -> None:
    """Issue #3: API calls per 4-replica job, and create -> Running latency, against the fake server."""
    import io

    from kubernetes import client

    from fake_k8s import FakeCluster
    from kfp_pytorch.components.cluster import ClusterTrainSpec
    from kfp_pytorch.components.cluster_run import ClusterTrainer
    from kfp_pytorch.components.k8s import Kube
    from kfp_pytorch.components.train import TrainSpec

    print("k8s: PyTorchJob watcher against the fake API server (4 replicas)")
    fake = FakeCluster()
    url = fake.start()
    cfg = client.Configuration()
    cfg.host = url
    calls, latency, server_reqs = [], [], []
    try:
        for run in range(5):
            spec = ClusterTrainSpec(TrainSpec("s3://data/x", "s3://models/x", workers=4), image="reg/kfp-pytorch:0.1.0",
                                    namespace="bench", run_id=f"run-{run}", task="train-op", nodes=4)
            moved = {}

            def kubelet(name=spec.name):
                while len(fake.list("pods", "bench", f"training.kubeflow.org/job-name={name}")) < 4:
                    time.sleep(0.001)
                time.sleep(0.5)  # the job runs for a while: the watcher must not poll meanwhile
                moved["t"] = time.monotonic()
                for p in fake.list("pods", "bench", f"training.kubeflow.org/job-name={name}"):
                    fake.set_pod_phase("bench", p["metadata"]["name"], "Running")
                time.sleep(1.5)
                fake.set_pod_phase("bench", f"{name}-master-0", "Succeeded")

            before = len(fake.requests)
            th = threading.Thread(target=kubelet, daemon=True)
            th.start()
            api = client.ApiClient(cfg)
            trainer = ClusterTrainer(Kube(api), out=io.StringIO())
            seen = {}
            orig = trainer._start_log_stream

            def stamp(ns, name, orig=orig):
                seen["t"] = time.monotonic()
                return orig(ns, name)

            trainer._start_log_stream = stamp
            res = trainer.run(spec, timeout_s=30)
            th.join()
            api.close()
            calls.append(res.api_calls)
            server_reqs.append(len(fake.requests) - before)
            latency.append((seen["t"] - moved["t"]) * 1e3)
    finally:
        fake.stop()
    row("API calls per 4-replica job (client side)", statistics.median(calls), 0, None,
        "O(status changes), not O(time)", max(calls) <= 8, "calls")
    row("API requests per job seen by the server", statistics.median(server_reqs), 0, None, "report", None, "req")
    row("create -> component sees Running (ms)", statistics.median(latency), 0, None, "report", None, "ms")


RATIO_GOALS = ("light_wait_p95", "wait_max", "utilization", "jct_mean")


def _runs(seeds, sets=("full",), placement: str = "binpack"):
    """``fairshare`` and the baselines on every trace (or cut) and seed, judged by the issue #4
    goals: the same judge as ``kfp-pytorch goals`` (``fairness_scheduler/evaluate.py``)."""
    from kfp_pytorch.fairness_scheduler.evaluate import evaluate_goals

    return evaluate_goals([TRACES], list(seeds), list(sets), placement=placement,
                          workers=min(2, os.cpu_count() or 1))


def _label(goal: str) -> str:
    return goal + "/fifo" if goal in RATIO_GOALS else goal


def _baseline_counts(runs) -> dict[str, int]:
    from kfp_pytorch.fairness_scheduler.goals import FAIR_BASELINES

    return {p: sum(r.baselines_met[p] for r in runs) for p in FAIR_BASELINES}


def bench_fairness(tmp: Path) -> None:
    """The issue #4 goals for `fairshare` against the baselines, every trace, protocol defaults."""
    from kfp_pytorch.fairness_scheduler.trace import capacity, read_trace

    print("fairness goals: fairshare vs the baselines on every trace (ratios to FIFO unless noted)")
    runs = _runs([0])
    GOAL_RUNS.extend(runs)
    for r in runs:
        c = capacity(read_trace(TRACES / f"{r.trace}.csv"))
        print(f"  {r.trace} (C={c}): {'PASS' if r.met else 'MISS'}  " + "  ".join(
            f"{_label(k)} {v.value:.3f}{'' if v.met else '(!' + v.target + ('*' if k in r.shared else '') + ')'}"
            for k, v in r.checks.items()),
            flush=True)
        ROWS.append({"figure": f"fairness goals {r.trace}", "ok": r.met,
                     "checks": {_label(k): {"value": v.value, "target": v.target, "ok": v.met}
                                for k, v in r.checks.items()}})
    passed, baselines = sum(r.met for r in runs), _baseline_counts(runs)
    print("  (*: no fair baseline met that goal in the same run either)")
    print(f"  traces meeting every goal: {passed}/{len(runs)}; the same goals met by the fair baselines "
          "(Jain against the other baselines): " + ", ".join(f"{p} {n}/{len(runs)}" for p, n in baselines.items()))
    ROWS.append({"figure": "fairness goals, seed 0, traces meeting every goal", "fairshare": passed, **baselines,
                 "runs": len(runs)})


def _goal_cells(runs) -> list[str]:
    """Goals met of 6 per trace, with those missed (``*``: no fair baseline met it either)."""
    from kfp_pytorch.fairness_scheduler.goals import missed

    return [f"{r.trace[-2:]}:{sum(c.met for c in r.checks.values())}"
            + ("" if r.met else "(" + ",".join(g + ("*" if g in r.shared else "") for g in missed(r.checks)) + ")")
            for r in runs]


def bench_fairness_seeds(tmp: Path) -> None:
    """Robustness: the same goals with the users drawn by seeds 1 to 11 (a stand-in for held-back
    traces: same jobs, different owners). Seeds 0-2 were used to tune the defaults; seeds 3-5
    showed that square-root age generalises better; seeds 6-11 were run once, to confirm it.
    Prints goals met per trace and seed."""
    seeds = list(range(1, 12))
    print("fairness goals, other user draws (protocol seeds 1-11): goals met of 6 per trace")
    runs = _runs(seeds)
    GOAL_RUNS.extend(runs)
    for seed in seeds:
        mine = [r for r in runs if r.seed == seed]
        print(f"  seed {seed:2d}: " + "  ".join(_goal_cells(mine)), flush=True)
    print("  (*: no fair baseline met that goal in the same run either)")
    groups = {"seeds 1-2 (tuning)": (1, 2), "seeds 3-5": (3, 4, 5), "seeds 6-11 (confirmation)": range(6, 12)}
    totals = {name: sum(r.met for r in runs if r.seed in group) for name, group in groups.items()}
    n_traces = len(runs) // len(seeds)
    print("  trace x seed runs meeting every goal: " + ", ".join(
        f"{name} {met}/{n_traces * len(groups[name])}" for name, met in totals.items()))
    for name, met in totals.items():
        ROWS.append({"figure": f"fairness goals, {name}", "met": met, "runs": n_traces * len(groups[name])})
    base = _baseline_counts(runs)
    print(f"  seeds 1-11, runs meeting every goal: fairshare {sum(r.met for r in runs)}/{len(runs)}; the fair "
          "baselines judged by the same goals: " + ", ".join(f"{p} {n}/{len(runs)}" for p, n in base.items()))
    ROWS.append({"figure": "fairness goals, seeds 1-11, fair baselines judged by the same goals", **base,
                 "runs": len(runs)})


def bench_fairness_halves(tmp: Path) -> None:
    """Robustness to new job mixes: every trace's two halves (cut at the median submission time),
    user draws 0-3, the issue's goals with the generic targets (the named traces' stricter ones do
    not apply to halves); the fair baselines are judged by the same goals."""
    runs = _runs(range(4), ["halves"])
    GOAL_RUNS.extend(runs)
    print("fairness goals on half traces (each trace cut at its median submission; seeds 0-3): "
          "draws meeting every goal per half")
    per: dict[str, int] = {}
    for r in runs:
        per[r.trace] = per.get(r.trace, 0) + r.met
    print("  " + "  ".join(f"{n[-3:]}:{k}" for n, k in per.items()))
    ours, base = sum(r.met for r in runs), _baseline_counts(runs)
    print(f"  runs meeting every goal: fairshare {ours}/{len(runs)}; the fair baselines judged by the same goals: "
          + ", ".join(f"{p} {n}/{len(runs)}" for p, n in base.items()))
    ROWS.append({"figure": "fairness goals, half traces, seeds 0-3", "fairshare": ours, **base, "runs": len(runs)})


def bench_fairness_spread(tmp: Path) -> None:
    """Robustness to the placement convention: every policy with ``spread`` (kube-scheduler's
    default scoring) instead of ``binpack``; FIFO's own figures move with it on cluster02/03/07."""
    print("fairness goals, seed 0, every policy with --placement spread: goals met of 6 per trace")
    runs = _runs([0], placement="spread")
    met = sum(r.met for r in runs)
    print("  " + "  ".join(_goal_cells(runs)), flush=True)
    print(f"  traces meeting every goal: {met}/{len(runs)}")
    ROWS.append({"figure": "fairness goals, spread placement", "met": met, "runs": len(runs)})


def _cycle_setup(n_pending: int, n_users: int = 1000, n_nodes: int = 1000, seed: int = 0):
    """A busy cluster (about 95% of GPUs held) and ``n_pending`` gangs with trace-like sizes."""
    from kfp_pytorch.fairness_scheduler.model import Node, Resources, UserConfig, Workload, gang_for_gpus

    rng = np.random.default_rng(seed)
    nodes = [Node(f"n{i:04d}", Resources(8, 64, 512)) for i in range(n_nodes)]
    users = [UserConfig(f"u{k:04d}", 1.0, 3 if k < n_users // 4 else 2 if k < n_users // 2 else 1)
             for k in range(n_users)]
    p = 1 / (np.arange(n_users) + 1.0) ** 1.1
    owners = rng.choice(n_users, size=n_pending, p=p / p.sum())
    sizes = rng.choice([1, 2, 4, 8, 16, 32, 64], size=n_pending, p=[0.7, 0.1, 0.08, 0.09, 0.015, 0.01, 0.005])
    pending = [Workload(f"w{i}", users[owners[i]].name, float(rng.integers(0, 86400)),
                        gang_for_gpus(int(sizes[i])), seq=i) for i in range(n_pending)]
    used = rng.choice([8, 8, 8, 7, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8, 4, 8, 8, 8, 8, 8], size=n_nodes)
    usage = rng.gamma(0.5, 1e5, size=n_users)
    return nodes, users, pending, used, usage


def _snapshot(nodes, users, pending, used, usage, now=90000.0):
    """What a cycle starts from: the pending queue, the node pool with its running work and the
    users' state, built from scratch (a restarted controller's first cycle does this)."""
    from kfp_pytorch.fairness_scheduler.admission import NodePool, PendingQueue
    from kfp_pytorch.fairness_scheduler.model import Resources, Workload, gang_for_gpus
    from kfp_pytorch.fairness_scheduler.policy import CycleContext, UserState

    pool = NodePool(nodes)
    for i, u in enumerate(used):
        if u:
            pool.allocate(Workload("r", "x", 0, gang_for_gpus(int(u))), [i])
    queue = PendingQueue(pending)
    states = {}
    for k, u in enumerate(users):
        s = UserState(u)
        s.usage = Resources(float(usage[k]))
        states[u.name] = s
    ctx = CycleContext(now, states, pool.total)
    ctx.typical_wait = 3600.0
    return queue, pool, ctx


def _one_cycle(queue, pool, ctx):
    """One scheduling cycle as the controller runs it: priorities, admission, and a reason for
    every head that stays pending (``explain``), with the defaults: reservations, defrag."""
    from kfp_pytorch.fairness_scheduler.admission import admit
    from kfp_pytorch.fairness_scheduler.config import FairShareConfig
    from kfp_pytorch.fairness_scheduler.policy import make_policy

    cfg = FairShareConfig()
    return admit(queue, pool, make_policy("fairshare", cfg), ctx, cfg.reserve_cap, explain=True,
                 max_reservations=cfg.max_reservations, defrag_reservations=cfg.defrag_reservations)


def bench_cycle(tmp: Path) -> None:
    print("cycle: priorities + admission, 1000 users on 1000 nodes (8 GPUs each), busy cluster")
    med, build = {}, {}
    for n in (10_000, 100_000):
        setup = _cycle_setup(n)
        times, builds = [], []
        for _ in range(9 if n == 10_000 else 3):
            t = time.perf_counter()
            snapshot = _snapshot(*setup)  # admit() mutates its queue and pool: a fresh one each time
            builds.append(time.perf_counter() - t)
            t = time.perf_counter()
            res = _one_cycle(*snapshot)
            times.append(time.perf_counter() - t)
        med[n], build[n] = statistics.median(times) * 1e3, statistics.median(builds) * 1e3
        print(f"    {n} pending: cycle median {med[n]:.1f} ms (started {len(res.started)}, "
              f"{len(res.pending_reasons)} reasons); building the snapshot from scratch {build[n]:.1f} ms", flush=True)
    row("cycle median ms at 10k pending", med[10_000], 50.0, med[10_000] / 50.0, "<= 50 ms", med[10_000] <= 50, "ms")
    row("snapshot built from scratch at 10k pending (not part of a cycle)", build[10_000], 50.0,
        build[10_000] / 50.0, "report", None, "ms")
    g = med[100_000] / med[10_000]
    # Baseline: linear growth (10x the pending gangs -> 10x the time).
    row("cycle growth 10k -> 100k pending, vs linear", g, 10.0, g / 10.0, "<= 12x", g <= 12, "x")


BENCHES = {"train": bench_train, "data": bench_data, "serve": bench_serve, "pipeline": bench_pipeline,
           "simulate": bench_simulate, "cycle": bench_cycle, "fairness": bench_fairness,
           "fairness-seeds": bench_fairness_seeds, "fairness-halves": bench_fairness_halves,
           "fairness-spread": bench_fairness_spread, "k8s": bench_k8s}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated benches: " + ", ".join(BENCHES))
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    p.add_argument("--plot", default=str(ROOT / "bench_results" / "fairness_goals.png"),
                   help="where the fairness benches draw their goal grid (PNG)")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in BENCHES]:
        p.error(f"--only: unknown bench {', '.join(map(repr, unknown))}; known: {', '.join(BENCHES)}")
    with tempfile.TemporaryDirectory(prefix="kfp-pytorch-bench-") as tmp:
        for name in names:
            BENCHES[name](Path(tmp))
    if GOAL_RUNS:
        from kfp_pytorch.fairness_scheduler.evaluate import goal_grid

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        goal_grid(GOAL_RUNS).savefig(args.plot, dpi=110)
        print(f"goal grid: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
