"""Trace protocol, simulator metrics (hand-computed), config validation, ledger durability, CLI."""
import csv
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kfp_pytorch.fairness_scheduler.config import FairShareConfig, load_config
from kfp_pytorch.fairness_scheduler.errors import SchedulerConfigError, TraceError
from kfp_pytorch.fairness_scheduler.ledger import Interval, UsageLedger, interval_usage
from kfp_pytorch.fairness_scheduler.model import Node, Resources, UserConfig, Workload, gang_for_gpus
from kfp_pytorch.fairness_scheduler.policy import POLICIES
from kfp_pytorch.fairness_scheduler.report import run_jobs, run_protocol, write_schedule
from kfp_pytorch.fairness_scheduler.simulator import METRICS, jain, simulate, water_fill
from kfp_pytorch.fairness_scheduler.trace import (assign_users, capacity, protocol_nodes, protocol_users,
                                                   protocol_workloads, read_trace)
from kfp_pytorch.fairness_scheduler.usage import format_duration
from servers import free_port

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "itp-2021"  # ../shared beside the checkout


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- trace and protocol --------------------------------------------------------------------------
@pytest.mark.parametrize("body,where,what", [
    ("job_id,submission_time,duration\na,0,1\n", ":1:", "missing column(s) num_gpu"),
    # columns named otherwise are named beside the ones they stand for; a long header is cut short
    ("JobID,Submitted,duration_s,num_gpu,user\na,0,1,1,u\n", ":1:", "missing column(s) job_id, submission_time, "
     "duration (header: JobID,Submitted,duration_s,num_gpu,user); did you mean 'JobID' for 'job_id', 'duration_s' for "
     "'duration'?\n  hint: the header must name job_id, submission_time, duration, num_gpu (rename those columns)"),
    (",".join(f"f{i}" for i in range(20)) + "\n" + ",".join("0" * 20) + "\n", ":1:",
     "duration, num_gpu (header: f0,f1,f2,f3,f4,f5,f6,f7,f8,f9,f10,f11,... (20 columns))\n  hint: the header must name "
     "job_id, submission_time, duration, num_gpu"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\nb,x,10,1\n", ":3:", "non-numeric"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\nb,5,-3,1\n", ":3:", "negative duration"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\nb,0,10,-2\n", ":3:", "num_gpu must be an integer >= 0, got -2"),
    ("job_id,submission_time,duration,num_gpu\na,0,10\n", ":2:", "expected 4 fields"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,0\nb,5,10,0\n", ":", "no job requests a GPU"),
    ("job_id,submission_time,duration,num_gpu,user\na,0,10,1,ann\nb,1,10,1, \n", ":3:", "empty user in b,1,10,1"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\nb,1,10,1\na,5,10,2\n", ":4:", "duplicate job_id 'a' (first on line 2)"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\n ,1,10,1\n", ":3:", "empty job_id in  ,1,10,1"),
    ("job_id,submission_time,duration,num_gpu\na,0,10,1\nb,1,10,1e12\n", ":3:",
     "num_gpu 1e12 is more than the largest cluster the simulator models (800,000 GPUs)"),
])
def test_malformed_rows_name_file_and_line(tmp_path, body, where, what):
    p = write(tmp_path, body)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert f"{p}{where}" in str(e.value) and what in str(e.value)


def test_a_user_column_is_read_and_kept_by_cuts(tmp_path):
    from kfp_pytorch.fairness_scheduler.trace import cut, trace_users

    p = write(tmp_path, "user,job_id,submission_time,duration,num_gpu\n bob ,a,0,10,1\nann,b,5,10,2\nbob,c,9,1,8\n")
    jobs = read_trace(p)
    assert [j.user for j in jobs] == ["bob", "ann", "bob"] and trace_users(jobs) == ["ann", "bob"]
    assert [(j.user, j.submit) for j in cut(jobs, 0.5, 1.0)] == [("ann", 0.0), ("bob", 4.0)]
    ws = protocol_workloads(jobs, seed=3)  # the column, not the draw
    assert [w.user for w in ws] == ["bob", "ann", "bob"]
    assert trace_users(read_trace(TRACES / "cluster10.csv")) == []


def test_a_trace_that_is_not_there_is_answered_with_the_one_meant(tmp_path):
    # it was "trace file not found" for cluster7.csv beside cluster07.csv, and for a folder
    # click's "File '...' is a directory."
    for name in ("cluster07.csv", "cluster10.csv.gz", "notes.txt"):
        (tmp_path / name).write_text("job_id,submission_time,duration,num_gpu\n")
    with pytest.raises(TraceError) as e:
        read_trace(tmp_path / "cluster7.csv")
    assert str(e.value).startswith(f"trace file not found: {tmp_path / 'cluster7.csv'}")
    assert e.value.hint == f"did you mean {tmp_path / 'cluster07.csv'}?"
    with pytest.raises(TraceError) as e:
        read_trace(tmp_path / "other.csv")  # nothing near: what a trace holds, and what is there
    assert e.value.hint == (f"give a CSV with columns job_id, submission_time, duration, num_gpu; {tmp_path} "
                            "holds cluster07.csv, cluster10.csv.gz")
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"Error: {tmp_path} is a folder: give one trace CSV in it" in out.stderr
    assert f"(`kfp-pytorch goals --traces {tmp_path}` judges them all)" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError) as e:
        read_trace(empty)
    assert e.value.hint == "give a CSV with columns job_id, submission_time, duration, num_gpu"
    with pytest.raises(TraceError) as e:
        read_trace(tmp_path / "nope" / "cluster07.csv")  # a folder that is not there either
    assert e.value.hint == "give a CSV with columns job_id, submission_time, duration, num_gpu"


def test_every_bad_row_is_named_in_one_error(tmp_path):
    rows = "".join(f"j{i},{i},-1,1\n" for i in range(25))
    p = write(tmp_path, "job_id,submission_time,duration,num_gpu\na,0,10,1\nb,x,10,1\nc,1,5,1.5\n" + rows)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    text = str(e.value)
    assert f"{p}:3: non-numeric" in text and f"{p}:4: num_gpu must be an integer >= 0, got 1.5" in text
    assert f"{p}:5: negative duration -1" in text and f"{p}:22: negative duration" in text
    assert f"{p}:23:" not in text and "... and 7 more bad rows" in text  # 27 bad rows, 20 named


def test_spreadsheet_exports_and_gzip_traces_parse_and_binary_files_are_refused(tmp_path):
    p = tmp_path / "excel.csv"  # UTF-8 BOM and CRLF line ends, as spreadsheet exports write them
    p.write_bytes(b"\xef\xbb\xbfjob_id,submission_time,duration,num_gpu\r\na,0,100,1\r\nb,5,50,16\r\n")
    assert [(j.job_id, j.gpus, j.line) for j in read_trace(p)] == [("a", 1, 2), ("b", 16, 3)]
    gz = tmp_path / "trace.csv.gz"  # as traces are published: read as it is, told by its first bytes
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert read_trace(gz) == read_trace(p)
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(gzip.compress(b"job_id,submission_time,duration,num_gpu\na,x,100,1\n"))
    with pytest.raises(TraceError, match=f"{bad}:2: non-numeric"):  # rows named by line, compressed or not
        read_trace(bad)
    cut_short = tmp_path / "download.csv.gz"
    cut_short.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(TraceError) as e:
        read_trace(cut_short)
    assert f"{cut_short}: not a readable gzip file" in str(e.value) and "download the trace again" in str(e.value)
    binary = tmp_path / "trace.xlsx"
    binary.write_bytes(b"PK\x03\x04\x14\x00\x06\x00\x08\x00\x00\x00!\x00\xff\xfe\x81")
    with pytest.raises(TraceError) as e:
        read_trace(binary)
    assert f"{binary}: not UTF-8 text" in str(e.value) and "plain or gzip-compressed" in str(e.value)


@pytest.mark.parametrize("body,load", [
    ("job_id,submission_time,duration,num_gpu\na,0,100,8\nb,10,100,4\n", "1e-9"),  # a typo'd load
    ("job_id,submission_time,duration,num_gpu\na,0,1e308,8\nb,10,1e308,8\n", "0.9"),  # demand beyond a float
])
def test_a_cluster_too_big_to_model_is_refused_not_built(tmp_path, body, load):
    # Sized by the protocol, this cluster would be billions of nodes (or inf): memory ran out
    # building them, or math.ceil(inf) raised a bare OverflowError.
    p = write(tmp_path, body)
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(p), "--load", load],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{p}: at load {float(load):g} the protocol sizes the cluster at" in out.stderr
    assert "more than the simulator models (100,000)" in out.stderr and "raise --load" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "goals", "--traces", str(p), "--load", load],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "t: at load" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(p), "--users", "1000000000"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--users: must be from 1 to 100,000, got 1000000000" in out.stderr


def test_protocol_users_and_capacity_follow_the_readme():
    jobs = read_trace(TRACES / "cluster10.csv")
    users = assign_users(len(jobs), 20, 1.1, 0)
    p = 1 / (np.arange(20) + 1.0) ** 1.1
    expected = np.random.default_rng(0).choice(20, size=len(jobs), p=p / p.sum())
    assert (users == expected).all()
    span = max(j.submit for j in jobs) - min(j.submit for j in jobs)
    demand = sum(j.gpus * j.duration for j in jobs) / span
    assert capacity(jobs) == max(math.ceil(demand / 0.9 / 8) * 8, 16)
    tiers = [u.priority for u in protocol_users()]
    assert tiers == [3] * 5 + [2] * 5 + [1] * 10
    assert all(u.shares == 1 for u in protocol_users())


def test_water_fill_and_jain():
    alloc = water_fill(np.array([1.0, 10.0, 10.0]), np.ones(3), 9.0)
    assert alloc.tolist() == [1.0, 4.0, 4.0]
    assert water_fill(np.array([1.0, 2.0]), np.ones(2), 10).tolist() == [1.0, 2.0]
    assert water_fill(np.array([10.0, 10.0]), np.array([1.0, 3.0]), 8).tolist() == [2.0, 6.0]
    assert jain(np.array([1.0, 1.0])) == 1.0 and jain(np.array([1.0, 0.0])) == 0.5


def test_fifo_metrics_on_a_hand_computed_trace():
    # One 8-GPU node. t=0: A (8 GPUs, 100 s, user a); t=10: B (4 GPUs, 50 s, user b);
    # t=20: C (4 GPUs, 30 s, user b). FIFO: A 0-100, B 100-150, C 100-130.
    mk = lambda n, u, t, g, d, s: Workload(n, u, t, gang_for_gpus(g), duration=d, seq=s)  # noqa: E731
    wl = [mk("A", "a", 0, 8, 100, 0), mk("B", "b", 10, 4, 50, 1), mk("C", "b", 20, 4, 30, 2)]
    r = simulate(wl, [UserConfig("a"), UserConfig("b")], protocol_nodes(8), "fifo", light_users=1)
    m = r.metrics
    assert r.start.tolist() == [0, 100, 100] and r.end.tolist() == [100, 150, 130]
    assert m["wait_max"] == 90 and m["wait_p50"] == 80 and m["makespan"] == 150
    assert m["jct_mean"] == pytest.approx((100 + 140 + 110) / 3)
    assert m["utilization"] == pytest.approx((800 + 200 + 120) / (8 * 150))
    # Fair allocation: 0-10 a alone (8); 10-100 a and b demand 8 each -> 4/4; 100-130 b wants 8 -> 8;
    # 130-150 b wants 4 -> 4. Held: a 8*100 = 800; b 8*30 + 4*20 = 320.
    fair_a, fair_b = 8 * 10 + 4 * 90, 4 * 90 + 8 * 30 + 4 * 20
    assert r.service["a"] == pytest.approx(800 / fair_a) and r.service["b"] == pytest.approx(320 / fair_b)
    assert m["light_wait_p95"] == pytest.approx(np.percentile([90, 80], 95))  # b submitted fewer GPU-s


def test_job_larger_than_the_cluster_is_reported_not_dropped(tmp_path):
    wl = [Workload("huge", "a", 0, gang_for_gpus(64), duration=10, seq=0),
          Workload("ok", "a", 1, gang_for_gpus(8), duration=10, seq=1)]
    r = simulate(wl, [UserConfig("a")], protocol_nodes(16), "fairshare")
    assert r.unschedulable == ["huge"] and r.end[1] == 11
    assert r.unschedulable_why["huge"] == ("needs 64 GPUs in 8 pod(s), more than the empty cluster can place "
                                           "(16 GPUs on 2 nodes)")
    # ... and keeps its row, without times, in the per-job schedule
    out = tmp_path / "s.csv"
    assert write_schedule({"fairshare": r}, out) == 2
    rows = list(csv.DictReader(out.open()))
    assert [(x["job_id"], x["status"], x["start_s"]) for x in rows] == [("huge", "unschedulable", ""),
                                                                         ("ok", "done", "1.000")]
    assert rows[1]["end_s"] == "11.000" and rows[1]["wait_s"] == "0.000" and rows[1]["gpus"] == "8"


@pytest.mark.parametrize("trace,placement", [(p.stem, "binpack") for p in sorted(TRACES.glob("*.csv"))]
                         + [("cluster02", "spread"), ("cluster07", "spread")])
def test_fifo_matches_an_independent_naive_run_of_the_protocol(trace, placement):
    # tests/reference_protocol.py re-implements the protocol from the README alone (brute-force
    # scans, progressive-filling fair shares). Every FIFO metric must agree on every whole trace:
    # it checks the node index, the skipped cycles and the incremental integrals of the real one.
    from reference_protocol import protocol, read, run_fifo

    path = TRACES / f"{trace}.csv"
    jobs = read(str(path))
    users, cap = protocol(jobs)
    expected = run_fifo(jobs, users, cap, placement=placement)
    tj = read_trace(path)
    assert capacity(tj) == cap
    got = simulate(protocol_workloads(tj), protocol_users(), protocol_nodes(cap), "fifo", placement=placement)
    assert got.metrics == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_cpu_only_jobs_start_when_submitted_under_every_policy(tmp_path):
    # A row of 0 GPUs is a job that needs none: it keeps its place in the user draw and starts at
    # once, even while whole-cluster gangs hold every GPU (cluster01) and a scan would stop early.
    from reference_protocol import protocol, read, run_fifo

    rows = list(csv.reader((TRACES / "cluster01.csv").open()))
    for i, r in enumerate(rows[1:]):
        if i % 7 == 3:
            r[3] = "0"
    path = tmp_path / "cpu_jobs.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    jobs = read(str(path))
    users, cap = protocol(jobs)
    tj = read_trace(path)
    assert capacity(tj) == cap and sum(j.gpus == 0 for j in tj) == 228
    for policy in POLICIES:
        wl = protocol_workloads(tj)
        r = simulate(wl, protocol_users(), protocol_nodes(cap), policy)
        cpu = np.array([w.gpus == 0 for w in wl])
        assert not np.isnan(r.start).any()
        assert (r.start[cpu] == np.array([w.submit_time for w in wl])[cpu]).all(), policy
        if policy == "fifo":
            assert r.metrics == pytest.approx(run_fifo(jobs, users, cap), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("policy", ["fifo", "static-priority", "drf", "slurm-fairshare", "kueue-afs", "fairshare"])
def test_every_policy_runs_every_job_of_a_real_trace(policy):
    jobs = read_trace(TRACES / "cluster10.csv")
    wl = protocol_workloads(jobs)
    r = simulate(wl, protocol_users(), protocol_nodes(capacity(jobs)), policy)
    assert not np.isnan(r.start).any() and (r.start >= [w.submit_time for w in wl]).all()
    assert 0 < r.metrics["utilization"] <= 1 and 0 < r.metrics["jain_service"] <= 1


def test_random_traces_keep_the_simulators_invariants_under_every_policy(tmp_path):
    """Traces unlike the published ones (bursts at one instant, 0-second and 0-GPU jobs, gangs of
    3, 12 or 24 GPUs, 1-24 users, load 0.5-1.5), as traces held back or a cluster's own may be:
    every job starts no earlier than its submission or is reported unschedulable, the GPUs held
    never exceed the cluster's, every metric is finite, and a run repeats exactly."""
    sizes = [0, 1, 1, 1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 64]
    full = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(5, 300))
        submit = rng.exponential(rng.uniform(10, 5000), n).cumsum().round()
        if seed % 3 == 0:
            submit[: n // 2] = submit[0]
        duration = rng.lognormal(8, 2, n).round()
        duration[rng.random(n) < 0.05] = 0
        gpus = rng.choice(sizes, n)
        gpus[0] = 1  # at least one GPU job: the cluster's size comes from GPU demand
        path = write(tmp_path, "job_id,submission_time,duration,num_gpu\n" + "".join(
            f"j{i},{submit[i]:g},{duration[i]:g},{gpus[i]}\n" for i in range(n)))
        jobs = read_trace(path)
        c = capacity(jobs, load=float(rng.uniform(0.5, 1.5)))
        n_users = int(rng.integers(1, 25))
        for policy in POLICIES:
            wl = protocol_workloads(jobs, n_users=n_users, seed=seed)
            r = simulate(wl, protocol_users(n_users), protocol_nodes(c), policy, light_users=max(1, n_users // 2))
            ran = ~np.isnan(r.start)
            where = (seed, policy)
            assert ran.sum() + len(r.unschedulable) == n, where
            assert set(r.unschedulable) == {w.name for w, g in zip(wl, gpus) if g > c}, where
            assert (r.start[ran] >= np.array([w.submit_time for w in wl])[ran]).all(), where
            events = sorted([(e, -g) for e, g, ok in zip(r.end, gpus, ran) if ok]
                            + [(t, g) for t, g, ok in zip(r.start, gpus, ran) if ok])  # ends first at a tie
            assert max(np.cumsum([g for _, g in events])) <= c, where
            full += max(np.cumsum([g for _, g in events])) == c
            assert all(math.isfinite(v) for v in r.metrics.values()), where
            if seed % 10 == 0:
                again = simulate(protocol_workloads(jobs, n_users=n_users, seed=seed), protocol_users(n_users),
                                 protocol_nodes(c), policy, light_users=max(1, n_users // 2))
                assert np.array_equal(again.start, r.start, equal_nan=True), where
    assert full > 90  # runs that fill the cluster: the capacity bound is tested where it binds


def test_one_workload_set_serves_every_policy_of_a_run():
    """run_protocol hands the same Workload objects to each policy: the simulator must leave them
    as it found them, so a policy's results do not depend on which ran before it."""
    jobs = read_trace(TRACES / "cluster10.csv")
    wl = protocol_workloads(jobs)
    before = [(w.name, w.user, w.submit_time, w.pods, w.duration, w.seq, w.total, w.shape) for w in wl]
    cap = capacity(jobs)
    first = simulate(wl, protocol_users(), protocol_nodes(cap), "fairshare").metrics
    simulate(wl, protocol_users(), protocol_nodes(cap), "drf")
    assert [(w.name, w.user, w.submit_time, w.pods, w.duration, w.seq, w.total, w.shape) for w in wl] == before
    assert simulate(wl, protocol_users(), protocol_nodes(cap), "fairshare").metrics == first
    fresh = simulate(protocol_workloads(jobs), protocol_users(), protocol_nodes(cap), "fairshare").metrics
    assert fresh == first


def test_fairshare_protects_light_users_against_fifo():
    jobs = read_trace(TRACES / "cluster09.csv")[:4000]
    c = capacity(jobs)
    res = {p: simulate(protocol_workloads(jobs), protocol_users(), protocol_nodes(c), p).metrics
           for p in ("fifo", "fairshare")}
    assert res["fairshare"]["light_wait_p95"] < 0.5 * res["fifo"]["light_wait_p95"]
    assert res["fairshare"]["jain_service"] > res["fifo"]["jain_service"]


# ---- config --------------------------------------------------------------------------------------
def test_config_reports_every_bad_field_with_its_path():
    with pytest.raises(SchedulerConfigError) as e:
        load_config({"half_life": "soon", "policy": "lottery", "bogus": 1, "placement": "random", "halflife": 3,
                     "fairshare": {"weight_age": -1, "current_weight": 2, "fairshare_mode": "x", "age_exponent": 0,
                                   "typical_wait_half_life": 0, "large_gang_wait_ceiling": "a fortnight",
                                   "starvation_slowdown": -2, "starvation_slowdown_ceiling": "later"},
                     "users": [{"name": "a"}, {"name": "b", "shares": 0}, {"name": "c", "shares": 1},
                               {"name": "d", "shares": -1, "priority": "high"}, {"name": "a", "share": 2}]})
    text = str(e.value)
    for needle in ("half_life: must be a duration", "policy: must be one of", "bogus: unknown field (known: ",
                   "halflife: unknown field; did you mean 'half_life'?", "users[4].share: unknown field; did you mean 'shares'?",
                   "fairshare.weight_age: must be >= 0", "fairshare.current_weight: must be in [0, 1]",
                   "fairshare.fairshare_mode: must be one of classic, ratio, fairtree, got 'x'", "users[1].shares: must be > 0, got 0",
                   "users[3].shares: must be > 0, got -1", "users[3].priority: must be an integer",
                   "users[4].name: duplicate user 'a'", "placement: must be one of binpack, spread",
                   "fairshare.age_exponent: must be > 0, got 0", "fairshare.typical_wait_half_life: must be > 0, got 0",
                   "fairshare.large_gang_wait_ceiling: must be a duration like 7d",
                   "fairshare.starvation_slowdown: must be >= 0, got -2",
                   "fairshare.starvation_slowdown_ceiling: must be a duration like 7d"):
        assert needle in text, needle


def test_config_loads_good_values():
    cfg = load_config({"half_life": "3d", "placement": "spread",
                       "fairshare": {"age_cap": "12h", "weight_size": 10, "oversize_reserve_after": "14d"},
                       "users": [{"name": "alice", "shares": 2, "priority": 3, "gpu_quota": 16}]})
    assert cfg.half_life == 3 * 86400 and cfg.fairshare.age_cap == 43200 and cfg.fairshare.weight_size == 10
    assert cfg.placement == "spread" and load_config({}).placement == "binpack"
    assert cfg.fairshare.oversize_reserve_after == 14 * 86400
    assert load_config({"fairshare": {"large_gang_wait_ceiling": "10d"}}).fairshare.large_gang_wait_ceiling == 10 * 86400
    slow = load_config({"fairshare": {"starvation_slowdown": 3, "starvation_slowdown_ceiling": "2d"}}).fairshare
    assert slow.starvation_slowdown == 3 and slow.starvation_slowdown_ceiling == 2 * 86400
    assert load_config({"fairshare": {"oversize_reserve_after": "never"}}).fairshare.oversize_reserve_after == math.inf
    assert load_config({"fairshare": {"fairshare_mode": "fairtree"}}).fairshare.fairshare_mode == "fairtree"
    assert cfg.user("alice").gpu_quota == 16 and cfg.user("nobody").shares == 1.0


def test_readme_scheduler_config_example_loads():
    import yaml

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("Scheduler config (YAML")[1].split("```yaml")[1].split("```")[0]
    cfg = load_config(yaml.safe_load(example))
    assert cfg.fairshare.oversize_reserve_after == math.inf and cfg.user("alice").shares == 2
    assert cfg.fairshare.large_gang_wait_ceiling == 7 * 86400 and cfg.fairshare.large_gang_wait_factor == 3


# ---- ledger --------------------------------------------------------------------------------------
def test_ledger_decay_and_compaction_preserve_usage(ledger_url):
    led = UsageLedger(ledger_url, half_life=3600)
    led.record(Interval("w1", "a", Resources(2, 8, 32), 0, 1800))
    led.record(Interval("w2", "b", Resources(1), 100, 7200))
    before = led.usage(10_000)
    assert before["a"].gpu == pytest.approx(interval_usage(Resources(2), 0, 1800, 10_000, 3600).gpu)
    assert before["a"].cpu == pytest.approx(4 * before["a"].gpu)
    assert led.compact(5000) == 1 and led.intervals_count() == 1
    after = led.usage(10_000)
    assert after["a"].gpu == pytest.approx(before["a"].gpu) and after["b"].gpu == pytest.approx(before["b"].gpu)
    led.close()
    reopened = UsageLedger(ledger_url, half_life=3600)
    assert reopened.usage(10_000)["a"].gpu == pytest.approx(before["a"].gpu)
    reopened.close()


def test_ledger_rebuilds_runtime_estimates_after_a_restart(ledger_url):
    led = UsageLedger(ledger_url)
    led.record(Interval("w1", "a", Resources(8), 0, 3000))
    led.record(Interval("w2", "a", Resources(8), 100, 5100))
    led.record(Interval("w3", "b", Resources(1), 0, 60))
    led.close()
    again = UsageLedger(ledger_url)
    h = again.runtime_history()
    again.close()
    assert h.estimate("a", 8) == 4000 and h.estimate("b", 8) == 4000 and h.estimate("b", 1) == 60


def test_ledger_errors_say_what_to_do():
    from kfp_pytorch.fairness_scheduler.errors import LedgerError

    with pytest.raises(LedgerError, match=r"No module named 'pg8000'[\s\S]*pip install 'kfp-pytorch\[postgres\]'"):
        UsageLedger("postgresql+pg8000://kfp@127.0.0.1:1/ledger")
    with pytest.raises(LedgerError, match=r"cannot create the ledger tables[\s\S]*and that the database server is up, and that the URL's user may create tables"):
        UsageLedger(f"postgresql+psycopg://kfp@127.0.0.1:{free_port()}/ledger?connect_timeout=2")



def test_ledger_refuses_intervals_that_would_corrupt_usage(tmp_path):
    from kfp_pytorch.fairness_scheduler.errors import LedgerError

    with pytest.raises(LedgerError, match="half_life: must be > 0"):
        UsageLedger(f"sqlite:///{tmp_path / 'x.db'}", half_life=0)
    led = UsageLedger(f"sqlite:///{tmp_path / 'l.db'}", half_life=3600)
    led.record(Interval("ok", "a", Resources(2, 4, 8), 0, 100))
    for bad, msg in ((Interval("neg", "a", Resources(-1), 0, 10), "resources must be >= 0"),
                     (Interval("nan", "a", Resources(float("nan")), 0, 10), "must be finite"),
                     (Interval("inf", "a", Resources(1), 0, math.inf), "must be finite"),
                     (Interval("back", "a", Resources(1), 10, 5), "ends before it starts")):
        with pytest.raises(LedgerError, match=msg):
            led.record(bad)
    # nothing of the refused intervals reached the ledger, on disk or in memory
    again = UsageLedger(f"sqlite:///{tmp_path / 'l.db'}", half_life=3600)
    assert again.intervals_count() == 1 and again.usage(100) == led.usage(100)
    assert led.usage(100)["a"].gpu == pytest.approx(2 * 3600 / math.log(2) * (1 - 2 ** (-100 / 3600)))


def test_a_retried_record_counts_once(ledger_url):
    from kfp_pytorch.fairness_scheduler.errors import LedgerError

    led = UsageLedger(ledger_url, half_life=3600)
    iv = Interval("w1", "a", Resources(2, 8, 32), 0, 1800)
    assert led.record(iv) is True
    usage = led.usage(3600)
    # the writer died before it learnt its commit landed, and records again on restart
    again = UsageLedger(ledger_url)
    assert again.record(iv) is False and led.record(iv) is False
    assert again.intervals_count() == 1 and again.usage(3600) == usage == led.usage(3600)
    with pytest.raises(LedgerError, match=r"interval of w1 starting at 0 is already recorded, as user a.*ending at "
                                          r"1800[\s\S]*hint: an interval is recorded once"):
        led.record(Interval("w1", "a", Resources(2, 8, 32), 0, 3600))
    assert led.record(Interval("w1", "a", Resources(2, 8, 32), 1800, 3600)) is True  # what followed: a new interval
    assert UsageLedger(ledger_url).usage(3600) == led.usage(3600)
    led.close()
    again.close()


def test_a_ledger_from_before_the_index_gets_it(tmp_path):
    import sqlite3

    from kfp_pytorch.fairness_scheduler.errors import LedgerError

    url = f"sqlite:///{tmp_path / 'old.db'}"
    UsageLedger(url, half_life=3600).record(Interval("w1", "a", Resources(1), 0, 10))
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("DROP INDEX uq_usage_intervals_workload_start")  # as an older ledger was written
    db.execute("INSERT INTO usage_intervals (workload, user, gpu, cpu, memory_gb, start, \"end\") "
               "VALUES ('w1', 'a', 1, 0, 0, 0, 10)")
    db.commit()
    with pytest.raises(LedgerError, match="two intervals with the same start: remove the duplicate row"):
        UsageLedger(url)
    db.execute("DELETE FROM usage_intervals WHERE id = 2")
    db.commit()
    led = UsageLedger(url)
    assert led.record(Interval("w1", "a", Resources(1), 0, 10)) is False and led.intervals_count() == 1


WRITER = r"""
import sys
from kfp_pytorch.fairness_scheduler.ledger import Interval, UsageLedger
from kfp_pytorch.fairness_scheduler.model import Resources
led = UsageLedger(sys.argv[1], half_life=3600)
i = 0
while True:
    led.record(Interval(f"w{i}", f"u{i % 3}", Resources(1), i, i + 10))
    print(i, flush=True)  # printed only after the commit returned
    i += 1
    if i % 50 == 0:
        led.compact(i - 20)
"""


def test_kill_9_loses_no_committed_interval(ledger_url):
    db = ledger_url
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    committed = -1
    deadline = time.monotonic() + 60
    while committed < 180 and time.monotonic() < deadline:
        committed = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Lines the writer printed before it died but we had not read yet: those commits returned too.
    committed = max([committed] + [int(line) for line in proc.stdout.read().split()])
    led = UsageLedger(db, half_life=3600)  # recovery rebuilds the aggregates from the tables
    assert led.intervals_count() > 0
    # Every committed interval is either still an interval or folded into an aggregate: the
    # recovered usage equals a from-scratch computation over all committed intervals, plus at
    # most the one interval that may have committed after the last line was printed.
    now = committed + 100.0
    expected = {}
    for i in range(committed + 1):
        expected[f"u{i % 3}"] = expected.get(f"u{i % 3}", 0) + interval_usage(Resources(1), i, i + 10, now, 3600).gpu
    got = led.usage(now)
    one_more = interval_usage(Resources(1), committed + 1, committed + 11, now, 3600).gpu
    led.close()
    for u, v in expected.items():
        assert v - 1e-6 <= got[u].gpu <= v + one_more + 1e-6


# ---- CLI -----------------------------------------------------------------------------------------
def test_simulate_cli_json_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--json", "--plot", str(tmp_path / "p.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert list(data) == ["fifo", "static-priority", "drf", "slurm-fairshare", "kueue-afs", "fairshare"]
    assert set(data["fifo"]) == {"wait_p50", "wait_p95", "wait_max", "jct_mean", "makespan", "utilization",
                                 "jain_service", "min_service", "light_wait_p95"}
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.parametrize("users,ticks", [(12, 12), (300, 20)])
def test_the_plot_names_users_in_order_and_a_crowd_by_sample(users, ticks):
    from kfp_pytorch.fairness_scheduler.report import figure

    results, _ = run_protocol(TRACES / "cluster10.csv", ["fifo"], users=users)
    ax = figure(results).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) == ticks  # 300 users' labels ran together into one black line
    numbers = [int(t.lstrip("u")) for t in labels]
    assert numbers == sorted(numbers)


def test_simulate_cli_schedule_has_every_job_and_agrees_with_the_metrics(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--policies", "fifo,fairshare", "--json", "--schedule", str(tmp_path / "s.csv")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout)
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    trace_ids = [j.job_id for j in read_trace(TRACES / "cluster10.csv")]
    for policy in ("fifo", "fairshare"):
        mine = [r for r in rows if r["policy"] == policy]
        assert [r["job_id"] for r in mine] == trace_ids and {r["status"] for r in mine} == {"done"}
        waits = [float(r["wait_s"]) for r in mine]
        jct = [float(r["end_s"]) - float(r["submit_s"]) for r in mine]
        assert max(waits) == pytest.approx(metrics[policy]["wait_max"], abs=1e-3)
        assert np.mean(jct) == pytest.approx(metrics[policy]["jct_mean"], abs=1e-3)
    # the two policies' schedules differ (else the export would not tell them apart)
    assert [r["start_s"] for r in rows if r["policy"] == "fifo"] != [r["start_s"] for r in rows
                                                                      if r["policy"] == "fairshare"]


def test_policies_in_parallel_give_the_serial_results():
    """run_protocol with workers runs each policy in its own process: same metrics, same schedule,
    the caller's order and the caller's workloads. A progress callable (what the workers feed the
    shared bar with) is told of every arrival."""
    trace = TRACES / "cluster10.csv"
    serial, info = run_protocol(trace, list(POLICIES), workers=1)
    parallel, info2 = run_protocol(trace, list(POLICIES), workers=2)
    assert list(parallel) == list(POLICIES) and info2 == info
    for p in POLICIES:
        assert parallel[p].metrics == serial[p].metrics, p
        assert np.array_equal(parallel[p].start, serial[p].start, equal_nan=True), p
        assert [w.name for w in parallel[p].workloads] == [w.name for w in serial[p].workloads]
    counted = []
    r = simulate(serial["fifo"].workloads, protocol_users(), protocol_nodes(info["capacity_gpus"]), "fifo",
                 progress=counted.append)
    assert sum(counted) == info["jobs"] and r.metrics == serial["fifo"].metrics
    with pytest.raises(SchedulerConfigError, match=r"--workers: must be an integer >= 1, got 0"):
        run_protocol(trace, ["fifo"], workers=0)


def test_simulate_table_reads_in_hours_and_days_and_compares_with_fifo():
    assert [format_duration(x) for x in (0, 89, 90, 3600, 5399, 5400, 172799, 172800, 2963065)] == [
        "0s", "89s", "1.5m", "60.0m", "90.0m", "1.5h", "48.0h", "2.00d", "34.29d"]
    args = [sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
            "--policies", "fifo,fairshare"]
    table = subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()
    metrics = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, check=True).stdout)
    fifo_row = next(line for line in table if line.startswith("fifo")).split()
    assert fifo_row[METRICS.index("wait_max") + 1] == format_duration(metrics["fifo"]["wait_max"])
    head = table.index(next(line for line in table if line.startswith("against fifo")))
    names = table[head].split()[2:]
    row = table[head + 1].split()
    assert row[0] == "fairshare" and len(row) == len(names) + 1
    for name, cell in zip(names, row[1:]):
        assert float(cell.rstrip("x")) == pytest.approx(metrics["fairshare"][name] / metrics["fifo"][name], abs=6e-4)


def test_per_user_tables_give_each_users_service_and_p95_wait():
    from kfp_pytorch.fairness_scheduler.report import format_per_user

    res, _ = run_protocol(TRACES / "cluster10.csv", ["fifo", "kueue-afs"])
    fifo = res["fifo"]
    submitted = {}
    for w in fifo.workloads:
        submitted[w.user] = submitted.get(w.user, 0.0) + w.gpus * w.duration
    # the light users are the lighter half by submitted GPU-time, the users light_wait_p95 is taken over
    assert sorted(fifo.light_users) == sorted(sorted(submitted, key=submitted.get)[:10])
    light_waits = [fifo.start[i] - w.submit_time for i, w in enumerate(fifo.workloads) if w.user in fifo.light_users]
    assert fifo.metrics["light_wait_p95"] == pytest.approx(float(np.percentile(light_waits, 95)))
    text = format_per_user(res).splitlines()
    split = text.index("")
    service = [ln.split() for ln in text[2:split]]
    assert [r[0] for r in service] == sorted(submitted, key=lambda u: (-submitted[u], u))  # heaviest first
    for r in service:
        u = r[0]
        assert r[1] == str(sum(w.user == u for w in fifo.workloads)) and ("yes" in r) == (u in fifo.light_users)
        assert [float(x) for x in r[-2:]] == pytest.approx([res["fifo"].service[u], res["kueue-afs"].service[u]], abs=6e-4)
    heaviest = text[split + 3].split()
    waits = [res["kueue-afs"].start[i] - w.submit_time for i, w in enumerate(res["kueue-afs"].workloads)
             if w.user == heaviest[0]]
    assert heaviest[-1] == format_duration(float(np.percentile(waits, 95)))
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--per-user", "--json"], capture_output=True, text=True)
    assert out.returncode == 2 and "--per-user: prints tables, so not with --json" in out.stderr


def test_simulate_takes_the_half_life_from_the_config_unless_given(tmp_path):
    """The config's half_life is the usage half-life of every policy; --half-life overrides it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("half_life: 1d\n")

    def jain_of(*extra):
        out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace",
                              str(TRACES / "cluster10.csv"), "--policies", "slurm-fairshare,fairshare", "--json",
                              *extra], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return {p: m["jain_service"] for p, m in json.loads(out.stdout).items()}

    default, one_day = jain_of(), jain_of("--half-life", "1d")
    assert one_day != default
    assert jain_of("--config", str(cfg)) == one_day
    assert jain_of("--config", str(cfg), "--half-life", "7d") == default


def test_light_users_are_the_lighter_half_of_any_user_count():
    """The protocol's light users are 10 of its 20; other user counts take their lighter half."""
    jobs = read_trace(TRACES / "cluster10.csv")
    cap = capacity(jobs)
    for users in (20, 10):
        res, _ = run_jobs(jobs, ["fifo"], users=users)
        got = res["fifo"]
        wl = protocol_workloads(jobs, users)
        half = simulate(wl, protocol_users(users), protocol_nodes(cap), "fifo", light_users=users // 2)
        assert got.metrics == half.metrics
    ten_of_ten = simulate(protocol_workloads(jobs, 10), protocol_users(10), protocol_nodes(cap), "fifo", light_users=10)
    assert ten_of_ten.metrics["light_wait_p95"] != got.metrics["light_wait_p95"]

def test_simulate_cli_bad_input(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate"], capture_output=True, text=True)
    assert out.returncode == 2 and ("Missing option '--trace'. Give a trace CSV, plain or gzip-compressed, with the "
                                    "columns job_id, submission_time, duration, num_gpu (and user, optionally)") in out.stderr
    bad = write(tmp_path, "job_id,submission_time,duration,num_gpu\na,0,10,1\nb,1,oops,1\n")
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and f"{bad}:3: non-numeric" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(bad), "--policies", "x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "unknown policy 'x'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(bad), "--placement", "x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "'x' is not one of 'binpack', 'spread'" in out.stderr
    # every bad option and config field in one error, before any simulation
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fairshare:\n  weight_age: -1\nusers: [{name: a, shares: 0}]\n")
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(bad), "--policies",
                          "fifo,x", "--users", "0", "--half-life", "soon", "--load", "inf", "--config", str(cfg),
                          "--workers", "0", "--seed", "-1"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    for needle in ("--policies: unknown policy 'x'", "--half-life: must be a duration", "--users: must be from 1 to 100,000, got 0",
                   "--load: must be a finite number > 0", f"--config {cfg}: fairshare.weight_age: must be >= 0",
                   f"--config {cfg}: users[0].shares: must be > 0",  # the file named: --config is one of many options
                   "--workers: must be an integer >= 1, got 0", "--seed: must be >= 0, got -1"):
        assert needle in out.stderr, needle
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--plot", str(tmp_path / "nope" / "p.png")], capture_output=True, text=True)
    assert out.returncode == 2 and "--plot: directory" in out.stderr and "does not exist" in out.stderr
    # bad options are called that (it said "invalid scheduler configuration" of a --plot path); a bad
    # --config alone keeps the config's title
    assert "Error: invalid options:" in out.stderr and "hint: fix the options above" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--plot", str(tmp_path / "p.txt")], capture_output=True, text=True)
    assert out.returncode == 2 and "must end in one of .png" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--schedule", str(tmp_path / "nope" / "s.csv"), "--plot", str(tmp_path / "p.txt")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--schedule: directory" in out.stderr and "--plot:" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--schedule", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert out.returncode == 2 and "--schedule: " in out.stderr and "must end in one of .csv" in out.stderr
    for text, needle in (("- a\n- b\n", f"--config {cfg}: must be a mapping of fields, got list"),
                         ("a: [\n", "not valid YAML"), ("\x81\x00\xff", "not UTF-8 text")):  # was a traceback
        cfg.write_bytes(text.encode("latin-1"))
        out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(bad), "--config",
                              str(cfg)], capture_output=True, text=True)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "invalid options" not in out.stderr


def test_protection_keeps_light_users_out_of_starving_gangs_drains():
    """cluster01: a quarter of its jobs need the whole cluster. Without protection, light users wait
    behind every drain; with it they do not, and the large gangs keep their wait bound."""
    jobs = read_trace(TRACES / "cluster01.csv")
    c = capacity(jobs)

    def run(policy, cfg=None):
        return simulate(protocol_workloads(jobs), protocol_users(), protocol_nodes(c), policy, fairshare=cfg).metrics

    fifo, ours, unprotected = run("fifo"), run("fairshare"), run("fairshare", FairShareConfig(protect_below_share=0))
    assert ours["light_wait_p95"] < 0.5 * unprotected["light_wait_p95"]
    assert ours["light_wait_p95"] <= 0.35 * fifo["light_wait_p95"]
    assert ours["wait_max"] <= 1.5 * fifo["wait_max"]


def test_gang_above_the_reservation_cap_has_a_bounded_wait_only_when_asked():
    """A 16-GPU gang on two 8-GPU nodes is above the default reservation cap (half the GPUs). A
    stream of overlapping 4-GPU jobs never leaves the cluster empty, so by default the gang waits
    for the stream to end, as under every baseline; ``oversize_reserve_after`` bounds its wait."""
    nodes = [Node(f"n{i}", Resources(8)) for i in range(2)]
    users = [UserConfig("heavy"), UserConfig("light")]
    hour, day = 3600.0, 86400.0
    jobs = [Workload("big", "heavy", 2 * hour + 0.5, gang_for_gpus(16), duration=hour, seq=0)]
    jobs += [Workload(f"s{i}", "light", i * hour + 1, gang_for_gpus(4), duration=3 * hour, seq=i + 1)
             for i in range(24 * 10)]

    def wait_of_big(cfg=None):
        r = simulate(jobs, users, nodes, "fairshare", fairshare=cfg)
        assert not np.isnan(r.start).any()  # every job runs in the end
        return r.start[0] - jobs[0].submit_time

    assert wait_of_big() > 9 * day  # no reservation: it starts only once the stream is over
    bounded = wait_of_big(FairShareConfig(oversize_reserve_after=day))
    assert day <= bounded <= day + 3 * hour  # reserves at 1 day, then drains for at most one run time


def test_water_fill_is_skipped_only_when_the_allocation_cannot_change():
    """The simulator recomputes the max-min fair allocation only when a changed user is not capped
    at the water level before and after; whenever it skips, a full recompute gives the same."""
    from kfp_pytorch.fairness_scheduler.simulator import _still_capped, _water_fill_level

    rng = np.random.default_rng(0)
    skipped = recomputed = 0
    for _ in range(2000):
        n = int(rng.integers(2, 8))
        w = rng.choice([1.0, 2.0, 3.0], n).tolist()
        d = rng.choice([0.0, 1.0, 2.0, 4.0, 8.0, 16.0], n).tolist()
        cap = float(rng.choice([8.0, 16.0, 32.0]))
        alloc, level = _water_fill_level(d, w, cap)
        assert sum(alloc) == pytest.approx(min(sum(d), cap)) and all(a <= x + 1e-9 for a, x in zip(alloc, d))
        new = list(d)
        was = {}
        for u in rng.choice(n, int(rng.integers(1, 3)), replace=False).tolist():
            was[u] = d[u]
            new[u] = max(0.0, d[u] + float(rng.choice([-8.0, -1.0, 1.0, 8.0])))
        if _still_capped(was, new, w, level):
            skipped += 1
            assert _water_fill_level(new, w, cap) == (alloc, level)
        else:
            recomputed += 1
    assert skipped > 100 and recomputed > 100  # both branches are exercised


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpu_quota_holds_in_the_simulator_under_every_policy(policy):
    # u may hold 4 GPUs at once: its six 2-GPU jobs run at most two at a time although 16 GPUs are
    # free, and its 300 s job holds 2 of the 4 across three cycles; v, with no quota, runs all of
    # its jobs at once. Every policy, even those that read no usage (fifo), must see u's current
    # allocation in every cycle.
    users = [UserConfig("u", gpu_quota=4), UserConfig("v")]
    nodes = [Node(f"n{i}", Resources(8)) for i in range(2)]
    jobs = [Workload(f"u{i}", "u", 0.0, (Resources(2),), duration=d, seq=i)
            for i, d in enumerate([100.0, 300.0, 100.0, 100.0, 100.0, 100.0])]
    jobs += [Workload(f"v{i}", "v", 0.0, (Resources(2),), duration=100.0, seq=6 + i) for i in range(3)]
    r = simulate(jobs, users, nodes, policy)
    assert r.start[:6].tolist() == [0.0, 0.0, 100.0, 200.0, 300.0, 300.0]
    assert r.start[6:].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_job_above_its_users_gpu_quota_is_reported_not_left_queued(policy):
    # u's 16-GPU job can never start under u's 8-GPU quota. It is reported at submission, like a job
    # larger than the cluster, rather than left queued until the run ends: it does not run, and its
    # demand does not count into the max-min fair shares (u's service and Jain's index), while u's
    # other jobs run as if it had never been submitted.
    users = [UserConfig("u", gpu_quota=8), UserConfig("v")]
    nodes = [Node(f"n{i}", Resources(8)) for i in range(4)]
    jobs = [Workload("u1", "u", 0.0, (Resources(8),), duration=100.0, seq=0),
            Workload("big", "u", 5.0, gang_for_gpus(16), duration=100.0, seq=1),
            Workload("v1", "v", 20.0, (Resources(8),), duration=50.0, seq=2)]
    r = simulate(jobs, users, nodes, policy)
    assert r.unschedulable == ["big"]
    assert r.unschedulable_why["big"] == "needs 16 GPUs, more than user u's GPU quota of 8"
    assert np.isnan(r.start[1]) and r.start[[0, 2]].tolist() == [0.0, 20.0]
    without = simulate([jobs[0], jobs[2]], users, nodes, policy)
    assert r.metrics == without.metrics and r.service == without.service
    assert r.service == {"u": pytest.approx(1.0), "v": pytest.approx(1.0)}


def test_simulate_cli_names_the_jobs_that_can_never_start(tmp_path):
    trace = write(tmp_path, "job_id,submission_time,duration,num_gpu,user\nbig,0,100,16,ann\n"
                            "small,10,100,1,ann\nother,20,50,2,bob\n")
    config = tmp_path / "c.yaml"
    config.write_text("users:\n  - {name: ann, gpu_quota: 8}\n")
    cmd = [sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(trace), "--config", str(config),
           "--policies", "fifo,fairshare"]
    table = subprocess.run(cmd, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr
    assert ("unschedulable, reported and not run under any policy: 1 job(s)\n"
            "  big: needs 16 GPUs, more than user ann's GPU quota of 8") in table.stdout
    assert table.stdout.count("big: needs") == 1 and "did not apply" not in table.stdout
    seeded = subprocess.run(cmd + ["--seed", "3", "--zipf", "2"], capture_output=True, text=True)
    assert "note: --zipf, --seed did not apply: the trace names its jobs' users (a user column)" in seeded.stdout
    as_json = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
    assert as_json.returncode == 0, as_json.stderr
    assert set(json.loads(as_json.stdout)) == {"fifo", "fairshare"}  # the protocol's shape, unchanged
    assert as_json.stderr.count("big: needs 16 GPUs, more than user ann's GPU quota of 8") == 1


def test_simulate_cli_says_when_the_largest_job_sizes_the_cluster_and_not_the_load(tmp_path):
    # 1.8 GPUs of mean demand: 8 GPUs at load 0.9, but a 16-GPU job needs 2 nodes, so a --load of
    # 0.9 or 2 gives one table; the header says why. At load 0.1 the demand needs 24: no note.
    trace = write(tmp_path, "job_id,submission_time,duration,num_gpu\nbig,0,100,16\nsmall,10,100,1\nother,1000,50,2\n")
    cmd = [sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(trace), "--policies", "fifo"]
    for load, head in (("0.9", "C = 16 GPUs (2 nodes of 8; the largest job's size: at load 0.9 the mean demand needs 8)"),
                       ("2", "C = 16 GPUs (2 nodes of 8; the largest job's size: at load 2.0 the mean demand needs 8)"),
                       ("0.1", "C = 24 GPUs (3 nodes of 8), ")):
        out = subprocess.run(cmd + ["--load", load], capture_output=True, text=True)
        assert out.returncode == 0 and head in out.stdout.splitlines()[0], out.stdout + out.stderr


@pytest.mark.parametrize("policy", [p for p, cls in POLICIES.items()
                                    if not (cls.reads_usage and cls.reads_held and cls.reads_history)])
def test_a_policy_that_says_it_reads_less_is_not_fed_less_than_it_reads(policy, monkeypatch):
    # The simulator skips keeping usage, held GPUs or history for a policy that declares it does
    # not read them. Fed everything anyway, the policy must schedule exactly the same.
    declared, _ = run_protocol(TRACES / "cluster10.csv", [policy])
    cls = POLICIES[policy]
    for flag in ("reads_usage", "reads_held", "reads_history"):
        monkeypatch.setattr(cls, flag, True)
    fed, _ = run_protocol(TRACES / "cluster10.csv", [policy])
    assert np.array_equal(declared[policy].start, fed[policy].start, equal_nan=True)
    assert declared[policy].metrics == fed[policy].metrics
