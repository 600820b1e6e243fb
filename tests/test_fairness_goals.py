"""Issue #4's goals as a judge (pure), trace cuts, and `kfp-pytorch goals` over many runs."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kfp_pytorch.fairness_scheduler.evaluate import parse_seeds
from kfp_pytorch.fairness_scheduler.goals import baseline_checks, check, meets_all, miss_score, shared_misses
from kfp_pytorch.fairness_scheduler.trace import CUTS, TraceJob, cut, overlay

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "itp-2021"


def _metrics(**cand):
    """FIFO, four baselines and a candidate; the candidate sits exactly on every generic target
    unless overridden. Kueue's Jain index (0.90) is the best baseline's."""
    fifo = {"jain_service": 0.70, "light_wait_p95": 1000.0, "wait_max": 10000.0, "utilization": 0.80,
            "jct_mean": 5000.0, "min_service": 0.30}
    base = {"fifo": fifo, "static-priority": {**fifo, "jain_service": 0.60}, "drf": {**fifo, "jain_service": 0.85},
            "slurm-fairshare": {**fifo, "jain_service": 0.88}, "kueue-afs": {**fifo, "jain_service": 0.90}}
    on_target = {"jain_service": 0.895, "light_wait_p95": 350.0, "wait_max": 15000.0, "utilization": 0.784,
                 "jct_mean": 5250.0, "min_service": 0.30}
    return {**base, "fairshare": {**on_target, **cand}}


def test_the_goals_are_the_issues_targets_exactly():
    # on every target: met (the issue says >= and <=)
    assert meets_all(check("anytrace", _metrics()))
    # just past each target, and only that goal is missed
    for metric, value, goal in (("jain_service", 0.8949, "jain"), ("light_wait_p95", 350.5, "light_wait_p95"),
                                ("wait_max", 15010.0, "wait_max"), ("utilization", 0.7839, "utilization"),
                                ("jct_mean", 5251.0, "jct_mean"), ("min_service", 0.2999, "min_service")):
        checks = check("anytrace", _metrics(**{metric: value}))
        assert [g for g, c in checks.items() if not c.met] == [goal], goal
    # the ratios to FIFO are what the checks report
    checks = check("anytrace", _metrics())
    assert checks["wait_max"].value == pytest.approx(1.5) and checks["utilization"].value == pytest.approx(0.98)
    assert miss_score(checks) == 0
    # the miss score: how far each missed goal is missed, in the goal's unit
    checks = check("anytrace", _metrics(wait_max=16000.0, utilization=0.776, jain_service=0.885))
    assert checks["wait_max"].margin == pytest.approx(-2.0)  # 1.6x FIFO's against 1.5x, in 0.05
    assert checks["utilization"].margin == pytest.approx(-2.0)  # 0.97x against 0.98x, in 0.005
    assert checks["jain"].margin == pytest.approx(-1.0)  # 0.885 against 0.895, in 0.01
    assert checks["jct_mean"].margin == pytest.approx(0.0, abs=1e-9)
    assert miss_score(checks) == pytest.approx(-5.0)


def test_named_traces_have_the_stricter_targets_and_their_cuts_do_not():
    m = _metrics(jain_service=0.93, min_service=0.5)  # Jain passes the baseline test, not >= 0.95
    assert not check("cluster07", m)["jain"].met and not check("cluster09", m)["jain"].met
    assert check("cluster07a", m)["jain"].met and check("cluster02", m)["jain"].met
    assert not check("cluster07", m)["min_service"].met and check("cluster10", m)["min_service"].met  # >= 0.6
    light = _metrics(light_wait_p95=200.0)  # 0.2x FIFO's
    assert [check(n, light)["light_wait_p95"].met for n in ("cluster02", "cluster07", "cluster09", "cluster01",
                                                             "cluster02t1")] == [False, False, False, True, True]
    # an overlay of two named traces is a new job mix too
    assert check("cluster07+cluster09", m)["jain"].met and check("cluster02+cluster07", light)["light_wait_p95"].met


def test_a_baseline_is_judged_against_the_other_baselines():
    m = _metrics()
    # Kueue's own Jain (0.90) is not its target: the best of the others is Slurm's 0.88
    assert check("x", m, "kueue-afs")["jain"].target == ">= 0.8750"
    assert check("x", m, "kueue-afs")["jain"].met
    # fairshare's figures never set a baseline's target
    m["fairshare"]["jain_service"] = 0.99
    assert check("x", m, "slurm-fairshare")["jain"].target == ">= 0.8950"


def test_a_miss_that_no_fair_baseline_avoids_is_told_apart():
    m = _metrics(jain_service=0.80, wait_max=20000.0, utilization=0.70)
    for p in ("drf", "slurm-fairshare", "kueue-afs"):
        m[p]["utilization"] = 0.77  # 0.9625x FIFO's: every fair baseline misses utilization too
    checks = check("x", m)
    assert [g for g, c in checks.items() if not c.met] == ["jain", "wait_max", "utilization"]
    # Kueue reached the Jain index (its own target is the best of the others) and every baseline kept
    # the worst wait at FIFO's: only utilization is a miss that no fair baseline avoids
    assert shared_misses(checks, baseline_checks("x", m)) == ["utilization"]
    m["drf"]["utilization"] = 0.784  # one fair baseline meets it: no longer shared
    assert shared_misses(check("x", m), baseline_checks("x", m)) == []
    assert shared_misses(check("x", _metrics()), baseline_checks("x", _metrics())) == []  # nothing missed


def _jobs(submits):
    return [TraceJob(f"j{i}", float(s), 100.0, 1, i + 2) for i, s in enumerate(submits)]


def test_cuts_split_a_trace_by_submission_quantiles():
    jobs = _jobs([5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12])  # file order is not time order
    halves = [cut(jobs, lo, hi) for lo, hi, _ in CUTS["halves"]]
    assert sorted(j.job_id for h in halves for j in h) == sorted(j.job_id for j in jobs)  # a partition
    a, b = halves
    assert len(a) == len(b) == 6
    # re-based: each cut starts at 0; file order and line numbers are kept
    assert min(j.submit for j in a) == 0 and min(j.submit for j in b) == 0
    assert [j.job_id for j in a] == [j.job_id for j in jobs if j.submit < 7]
    assert [j.line for j in b] == [j.line for j in jobs if j.submit >= 7]
    thirds = [cut(jobs, lo, hi) for lo, hi, _ in CUTS["thirds"]]
    assert [len(t) for t in thirds] == [4, 4, 4]
    middle = cut(jobs, *CUTS["middle"][0][:2])
    assert sorted(j.submit + 4 for j in middle) == [4, 5, 6, 7, 8, 9]  # quartiles at 4 and 10
    assert cut(jobs, 0.0, 1.0) == [TraceJob(j.job_id, j.submit - 1, j.duration, j.gpus, j.line) for j in jobs]


def test_pairs_overlay_two_traces_on_one_clock():
    from kfp_pytorch.fairness_scheduler.evaluate import _mixes

    a = [TraceJob("x", 100.0, 10.0, 1, 2), TraceJob("y", 50.0, 20.0, 8, 3)]  # starts at 50, not in time order
    b = [TraceJob("x", 7.0, 30.0, 2, 2, "alice"), TraceJob("z", 57.0, 40.0, 4, 3)]
    both = overlay(a, b, ("c1", "c2"))
    # each re-based to its own first submission, merged by time (the first trace first at equal
    # times), ids made unique by their trace's name; lines, sizes and named users kept
    assert [(j.job_id, j.submit) for j in both] == [("c1/y", 0), ("c2/x", 0), ("c1/x", 50), ("c2/z", 50)]
    assert [j.line for j in both] == [3, 2, 2, 3] and [j.gpus for j in both] == [8, 2, 1, 4]
    assert both[1].user == "alice" and both[0].user is None
    # the set: each trace with the next one named, the last with the first; two traces, one pair
    three = {Path(f"{n}.csv"): a for n in ("p", "q", "r")}
    assert [(s, n) for s, n, _ in _mixes(three, ["pairs"])] == [("pairs", "p+q"), ("pairs", "q+r"), ("pairs", "r+p")]
    assert [n for _, n, _ in _mixes(dict(list(three.items())[:2]), ["pairs", "halves"])] == ["p+q", "pa", "pb", "qa", "qb"]


def test_goals_cli_pairs_run_the_overlay_as_simulate_would(tmp_path):
    rows = (TRACES / "cluster10.csv").read_text().splitlines()
    other = tmp_path / "late.csv"  # 120 of cluster10's jobs, submitted 5 days later: an overlay re-bases them
    other.write_text("\n".join([rows[0]] + [",".join([f"late-{i}", str(int(r.split(",")[1]) + 432000),
                                                         *r.split(",")[2:]]) for i, r in enumerate(rows[1:121])]) + "\n")
    out = _goals("--traces", str(TRACES / "cluster10.csv"), "--traces", str(other), "--sets", "pairs",
                 "--workers", "1", "--json")
    assert out.returncode == 0, out.stderr
    (run,) = json.loads(out.stdout)["runs"]
    assert (run["set"], run["trace"], run["seed"]) == ("pairs", "cluster10+late", 0)
    assert run["checks"]["light_wait_p95"]["target"] == "<= 0.35"  # the generic targets
    # the same jobs written as one trace, through simulate: the same figures for every policy
    from kfp_pytorch.fairness_scheduler.trace import read_trace

    jobs = overlay(read_trace(TRACES / "cluster10.csv"), read_trace(other), ("cluster10", "late"))
    assert len(jobs) == 260 + 120 and jobs[0].submit == 0
    merged = tmp_path / "merged.csv"
    merged.write_text("job_id,submission_time,duration,num_gpu\n"
                      + "".join(f"{j.job_id},{j.submit!r},{j.duration!r},{j.gpus}\n" for j in jobs))
    sim = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(merged), "--json"],
                         capture_output=True, text=True)
    assert sim.returncode == 0, sim.stderr
    assert run["metrics"] == json.loads(sim.stdout)
    # a trace naming its users cannot be overlaid with one whose users the protocol draws
    named = tmp_path / "named.csv"
    named.write_text("job_id,submission_time,duration,num_gpu,user\na,0,100,1,alice\n")
    out = _goals("--traces", str(named), "--traces", str(other), "--sets", "pairs")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{named} names its jobs' users and {other} does not" in out.stderr
    # one trace cannot be paired
    out = _goals("--traces", str(TRACES / "cluster10.csv"), "--sets", "full,pairs")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--sets pairs: overlays each trace with the next one, so it needs at least two traces; 1 given" in out.stderr


def test_seeds_parse_ranges_and_lists():
    assert parse_seeds("0-3,7,2") == [0, 1, 2, 3, 7]
    for bad, needle in (("a", "not a seed"), ("3-1", "is empty"), ("", "empty"), ("1-x", "not a seed")):
        with pytest.raises(ValueError, match=needle):
            parse_seeds(bad)


def _goals(*args):
    return subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "goals", *args], capture_output=True, text=True)


def test_goals_cli_judges_each_run_and_reuses_cached_baselines(tmp_path):
    cache = tmp_path / "cache"
    args = ["--traces", str(TRACES / "cluster10.csv"), "--seeds", "0-1", "--sets", "full,halves",
            "--cache", str(cache), "--workers", "2", "--json"]
    out = _goals(*args)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    runs = data["runs"]
    assert [(r["trace"], r["seed"]) for r in runs] == [("cluster10", 0), ("cluster10", 1), ("cluster10a", 0),
                                                       ("cluster10a", 1), ("cluster10b", 0), ("cluster10b", 1)]
    # every verdict re-derived here from the run's metrics, with the goals written out as the issue
    # states them (cluster10 has only the generic targets)
    for r in runs:
        m = r["metrics"]
        f, o = m["fifo"], m["fairshare"]
        best = max(m[p]["jain_service"] for p in ("fifo", "static-priority", "drf", "slurm-fairshare", "kueue-afs"))
        expect = {"jain": o["jain_service"] >= best - 0.005, "light_wait_p95": o["light_wait_p95"] <= 0.35 * f["light_wait_p95"],
                  "wait_max": o["wait_max"] <= 1.5 * f["wait_max"], "utilization": o["utilization"] >= 0.98 * f["utilization"],
                  "jct_mean": o["jct_mean"] <= 1.05 * f["jct_mean"], "min_service": o["min_service"] >= f["min_service"]}
        assert {g: c["met"] for g, c in r["checks"].items()} == expect, r["trace"]
        assert r["met"] == all(expect.values())
    s = data["summary"]
    assert s["full"]["runs"] == 2 and s["halves"]["runs"] == 4 and s["all"]["runs"] == 6
    assert s["all"]["fairshare"] == sum(r["met"] for r in runs)
    assert s["all"]["slurm-fairshare"] == sum(r["baselines_met"]["slurm-fairshare"] for r in runs)
    assert sum(s["all"]["missed"].values()) == sum(not c["met"] for r in runs for c in r["checks"].values())
    assert s["all"]["miss_score"] == pytest.approx(
        sum(c["margin"] for r in runs for c in r["checks"].values() if not c["met"]), abs=0.05)
    assert s["all"]["miss_score"] < 0
    for r in runs:  # a shared miss is one of ours that no fair baseline meets, judged the same way
        for g in r["shared_misses"]:
            assert not r["checks"][g]["met"]
            assert not any(check(r["trace"], r["metrics"], p)[g].met for p in ("drf", "slurm-fairshare", "kueue-afs"))
    assert sum(s["all"]["shared"].values()) == sum(len(r["shared_misses"]) for r in runs)
    assert 0 < s["all"]["fairshare"] < 6  # this set has both passes and misses, so the check above bites
    # the baselines come from the cache on the next run: a doctored FIFO figure changes the verdict
    files = sorted(cache.glob("cluster10-s0-*.json"))
    assert len(files) == 1 and len(list(cache.glob("*.json"))) == 6
    doctored = json.loads(files[0].read_text())
    doctored["fifo"]["wait_max"] = runs[0]["metrics"]["fairshare"]["wait_max"] / 2  # ours now 2x FIFO's
    files[0].write_text(json.dumps(doctored))
    half = sorted(cache.glob("cluster10a-s1-*.json"))[0]
    half.write_text('{"fifo": {"wait_p50": 1')  # cut short (a killed run): made again, not trusted
    again = json.loads(_goals(*args, "--traces", str(TRACES) + "/./cluster10.csv").stdout)  # named twice: run once
    assert len(again["runs"]) == 6 and json.loads(half.read_text()) == {p: runs[3]["metrics"][p] for p in
                                                                         ("fifo", "static-priority", "drf",
                                                                          "slurm-fairshare", "kueue-afs")}
    assert again["runs"][0]["checks"]["wait_max"]["met"] is False
    assert again["runs"][0]["metrics"]["fairshare"] == runs[0]["metrics"]["fairshare"]
    assert again["runs"][1:] == runs[1:]
    # a fairshare setting changes fairshare's figures only
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fairshare: {age_exponent: 1.0}\n")
    other = json.loads(_goals(*args, "--config", str(cfg)).stdout)
    assert [r["metrics"]["fairshare"] for r in other["runs"]] != [r["metrics"]["fairshare"] for r in runs]
    assert [r["metrics"]["kueue-afs"] for r in other["runs"]] == [r["metrics"]["kueue-afs"] for r in runs]
    # the table, and the grid
    table = _goals(*args[:-1], "--verbose", "--plot", str(tmp_path / "grid.png"))
    assert table.returncode == 0 and "fairshare's misses by goal" in table.stdout
    assert "halves" in table.stdout and "cluster10b/seed 0:" in table.stdout
    assert "miss score: minus the missed goals' shortfalls summed" in table.stdout  # the column is explained
    assert "-v lists each missed run" not in table.stdout  # it is -v
    brief = _goals(*args[:-1])
    assert brief.returncode == 0 and "; -v lists each missed run with its figures" in brief.stdout
    assert (tmp_path / "grid.png").stat().st_size > 10_000


def test_goal_grid_has_a_cell_per_run_labelled_with_the_goals_missed():
    from kfp_pytorch.fairness_scheduler.evaluate import GoalRun, goal_grid, summarize
    from kfp_pytorch.fairness_scheduler.goals import GOALS

    m = _metrics()
    two = _metrics(wait_max=20000.0, jct_mean=9000.0)
    runs = [GoalRun("full", "cluster01", 0, m, check("cluster01", m), {}),
            GoalRun("full", "cluster01", 1, m, check("cluster01", two), {}, shared=["jct_mean"]),
            GoalRun("halves", "cluster01a", 0, m, check("cluster01a", m), {}),
            GoalRun("halves", "cluster01a", 1, m, check("cluster01a", _metrics(jct_mean=9000.0)), {},
                    shared=["jct_mean"])]
    fig = goal_grid(runs)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["full traces: 1/2 runs meet every goal",
                                                 "half traces: 1/2 runs meet every goal"]
    # upper case: a goal some fair baseline met in that run; lower case: none did
    assert sorted(t.get_text() for t in panels[0].texts) == ["Wc", "ok"]
    s = summarize(runs)
    assert s["all"]["missed"]["jct_mean"] == 2 and s["all"]["shared"] == {**{g: 0 for g in GOALS}, "jct_mean": 2}
    assert s["full"]["shared_only"] == 0 and s["halves"]["shared_only"] == 1


def test_goals_cli_bad_input_lists_every_problem(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fairshare: {weight_age: -1}\n")
    (tmp_path / "cluster07.csv").write_text("job_id,submission_time,duration,num_gpu\n")
    out = _goals("--traces", str(empty), "--traces", str(tmp_path / "nope.csv"), "--traces", str(tmp_path / "cluster7.csv"),
                 "--seeds", "5-2",
                 "--sets", "full,quarters", "--config", str(cfg), "--workers", "0", "--plot", str(tmp_path / "g.txt"),
                 "--users", "0", "--load", "0", "--zipf", "-1", "--half-life", "soon")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    for needle in (f"--traces: no *.csv or *.csv.gz in folder {empty}", "nope.csv does not exist\n",
                   f"cluster7.csv does not exist (did you mean {tmp_path / 'cluster07.csv'}?)", "--seeds: range '5-2' is empty",
                   "--plot: ", "--users: must be from 1 to 100,000, got 0", "--load: must be a finite number > 0, got 0", "--zipf: must be >= 0",
                   "--half-life: must be a duration",
                   "--sets: unknown set 'quarters'", f"--config {cfg}: fairshare.weight_age: must be >= 0", "--workers: must be"):
        assert needle in out.stderr, needle
    out = _goals()
    assert out.returncode == 2 and "--traces: give trace CSVs" in out.stderr
    out = _goals("--traces", str(TRACES / "cluster10.csv"), "--cache", str(cfg / "sub"))  # under a file
    assert out.returncode == 2 and "--cache: cannot create folder" in out.stderr and "Traceback" not in out.stderr
    # every bad trace is named, file:line, before anything runs
    (tmp_path / "a.csv").write_text("job_id,submission_time,duration,num_gpu\na,0,x,1\n")
    (tmp_path / "b.csv").write_text("job_id,submission_time,duration,num_gpu\nb,0,10,-1\n")
    out = _goals("--traces", str(tmp_path / "a.csv"), "--traces", str(tmp_path / "b.csv"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{tmp_path / 'a.csv'}:2:" in out.stderr and f"{tmp_path / 'b.csv'}:2:" in out.stderr


def test_goals_cli_runs_the_protocol_options_it_is_given(tmp_path):
    """--users/--zipf/--load/--half-life reach every policy of every run: each run's metrics are
    those of simulate with the same options (which the judge then applies unchanged)."""
    args = ["--traces", str(TRACES / "cluster10.csv"), "--users", "10", "--zipf", "0.8", "--load", "0.7",
            "--half-life", "1d", "--workers", "1", "--json"]
    out = _goals(*args)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["protocol"] == {"users": 10, "zipf": 0.8, "load": 0.7, "half_life_s": 86400.0}
    (run,) = data["runs"]
    sim = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--users", "10", "--zipf", "0.8", "--load", "0.7", "--half-life", "1d", "--json"],
                         capture_output=True, text=True)
    assert sim.returncode == 0, sim.stderr
    assert run["metrics"] == json.loads(sim.stdout)
    default = json.loads(_goals("--traces", str(TRACES / "cluster10.csv"), "--workers", "1", "--json").stdout)
    assert default["runs"][0]["metrics"]["fifo"] != run["metrics"]["fifo"]
    # the half-life comes from the config unless --half-life is given
    cfg = tmp_path / "c.yaml"
    cfg.write_text("half_life: 1d\n")
    from_cfg = _goals("--traces", str(TRACES / "cluster10.csv"), "--users", "10", "--zipf", "0.8", "--load", "0.7",
                      "--config", str(cfg), "--workers", "1", "--json")
    assert json.loads(from_cfg.stdout)["runs"][0]["metrics"] == run["metrics"]
    text = _goals(*[a for a in args if a != "--json"])
    assert text.returncode == 0 and text.stdout.splitlines()[0] == (
        "protocol changed from the defaults the goals were set at: --users 10, --zipf 0.8, --load 0.7, --half-life 86400")


def _with_users(tmp_path, owners, name="own.csv"):
    """cluster10 with a user column: ``owners(i)`` names the i-th job's user."""
    import csv

    src = (TRACES / "cluster10.csv").read_text().splitlines()
    rows = list(csv.reader(src))
    out = tmp_path / name
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(rows[0] + ["user"])
        for i, row in enumerate(rows[1:]):
            w.writerow(row + [owners(i)])
    return out


def test_a_trace_with_its_own_users_keeps_them(tmp_path):
    """A user column replaces the protocol's draw: the protocol's own draw written into the
    column, with the protocol's tiers in the config, is exactly the protocol's run; the seed and
    Zipf options no longer apply; users the config does not list get 1 share and tier 1."""
    from kfp_pytorch.fairness_scheduler.report import run_jobs
    from kfp_pytorch.fairness_scheduler.trace import assign_users, protocol_users, read_trace, user_name

    drawn = assign_users(260, 20, 1.1, 0)
    own = _with_users(tmp_path, lambda i: user_name(int(drawn[i])))
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text("users:\n" + "".join(f"  - {{name: {u.name}, priority: {u.priority}}}\n" for u in protocol_users()))
    sim = [sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--workers", "2"]
    protocol = subprocess.run(sim + ["--trace", str(TRACES / "cluster10.csv"), "--json"], capture_output=True, text=True)
    kept = subprocess.run(sim + ["--trace", str(own), "--seed", "5", "--zipf", "2", "--config", str(tiers), "--json"],
                          capture_output=True, text=True)
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout) == json.loads(protocol.stdout)
    table = subprocess.run(sim + ["--trace", str(own), "--policies", "fifo"], capture_output=True, text=True)
    assert "20 users from the trace's user column" in table.stdout.splitlines()[0]
    # no tiers in a config: every user is tier 1, so the static-priority order is FIFO's
    res, info = run_jobs(read_trace(own), ["fifo", "static-priority"])
    assert info["users_from"] == "trace" and res["static-priority"].metrics == res["fifo"].metrics
    assert sorted(res["fifo"].service) == sorted({user_name(int(u)) for u in drawn})
    # two users: the lighter half is one user, and only its jobs make light users' p95 wait
    two, _ = run_jobs(read_trace(_with_users(tmp_path, lambda i: "big" if i % 4 else "small", "two.csv")), ["fifo"])
    r = two["fifo"]
    small = [w for w in r.workloads if w.user == "small"]
    waits = [r.start[i] - w.submit_time for i, w in enumerate(r.workloads) if w.user == "small"]
    assert len(small) == 65 and r.metrics["light_wait_p95"] == pytest.approx(float(np.percentile(waits, 95)))


def test_goals_runs_a_trace_with_its_own_users_once_and_caches_by_user(tmp_path):
    cache = tmp_path / "cache"
    own = _with_users(tmp_path, lambda i: f"u{i % 3}")
    args = ["--traces", str(own), "--seeds", "0-2", "--cache", str(cache), "--workers", "1"]
    data = json.loads(_goals(*args, "--json").stdout)
    assert [(r["trace"], r["seed"], r["own_users"]) for r in data["runs"]] == [("own", 0, True)]
    assert "kept their own users (a user column), so ran once, not per seed: own" in _goals(*args).stdout
    # the same jobs with other owners: the cached baselines of the first owners are not reused
    _with_users(tmp_path, lambda i: f"u{i % 2}")
    other = json.loads(_goals(*args, "--json").stdout)["runs"][0]["metrics"]
    fresh = json.loads(_goals("--traces", str(own), "--workers", "1", "--json").stdout)["runs"][0]["metrics"]
    assert other == fresh and other["kueue-afs"] != data["runs"][0]["metrics"]["kueue-afs"]
    assert len(list(cache.glob("own-s0-*.json"))) == 2


def test_the_configs_users_apply_to_the_protocols_drawn_users_too(tmp_path):
    """A config that lists a drawn user (user-00) sets its shares, tier and quota under every
    policy, as it would for a trace's own users: it was silently ignored before. Users it lists
    that are in no run are named, since their entries applied to nothing (a misspelt name)."""
    from kfp_pytorch.fairness_scheduler.config import load_config
    from kfp_pytorch.fairness_scheduler.report import run_protocol

    cfg = load_config({"users": [{"name": "user-00", "shares": 4, "priority": 3, "gpu_quota": 1},
                                 {"name": "alice"}]})
    default, _ = run_protocol(TRACES / "cluster10.csv", ["fifo", "fairshare"])
    res, info = run_protocol(TRACES / "cluster10.csv", ["fifo", "fairshare"], user_config=cfg.user)
    gpus = {w.name: (w.user, w.gpus) for w in res["fifo"].workloads}
    over = sorted(n for n, (u, g) in gpus.items() if u == "user-00" and g > 1)
    assert over and sorted(res["fifo"].unschedulable) == over == sorted(res["fairshare"].unschedulable)
    assert res["fairshare"].metrics != default["fairshare"].metrics and not default["fifo"].unschedulable
    assert cfg.unused_users(info["user_names"]) == ["alice"] and len(info["user_names"]) == 20
    config = tmp_path / "c.yaml"
    config.write_text("users:\n  - {name: user-00, shares: 4}\n  - {name: alcie}\n")
    out = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "simulate", "--trace", str(TRACES / "cluster10.csv"),
                          "--policies", "fifo", "--config", str(config), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) == {"fifo"}
    assert ("note: --config lists users who are not in this run, so their entries were not used: alcie "
            "(the users here: user-00, user-01, user-02, ...)") in out.stderr


def test_goals_cache_keys_the_users_config_of_drawn_users(tmp_path):
    # The baselines' cached metrics depend on the users' shares, tiers and quotas: a config that
    # changes user-00 must not read the baselines cached without it.
    cache = tmp_path / "cache"
    args = ["--traces", str(TRACES / "cluster10.csv"), "--cache", str(cache), "--workers", "1", "--json"]
    plain = json.loads(_goals(*args).stdout)["runs"][0]["metrics"]
    config = tmp_path / "c.yaml"
    config.write_text("users:\n  - {name: user-00, gpu_quota: 1}\n")
    capped = json.loads(_goals(*args, "--config", str(config)).stdout)["runs"][0]["metrics"]
    assert capped["fifo"] != plain["fifo"] and len(list(cache.glob("cluster10-s0-*.json"))) == 2


def test_default_shares_apply_to_a_traces_own_users_and_not_to_drawn_ones(tmp_path):
    from kfp_pytorch.fairness_scheduler.config import load_config
    from kfp_pytorch.fairness_scheduler.report import trace_people
    from kfp_pytorch.fairness_scheduler.trace import read_trace

    cfg = load_config({"default_shares": 3, "users": [{"name": "u1", "shares": 1}, {"name": "user-07", "shares": 2}]})
    own = read_trace(_with_users(tmp_path, lambda i: f"u{i % 3}"))
    assert [(u.name, u.shares, u.priority) for u in trace_people(own, user_config=cfg.user)] == [
        ("u0", 3, 1), ("u1", 1, 1), ("u2", 3, 1)]
    drawn = trace_people(read_trace(TRACES / "cluster10.csv"), 20, cfg.user)  # the protocol fixes 1 share each
    assert [(u.shares, u.priority) for u in drawn[:10]] == [(1, 3)] * 5 + [(1, 2)] * 2 + [(2, 1)] + [(1, 2)] * 2


def _pool_workers(proc, count: int = 2) -> list:
    """The CLI's pool workers, once ``count`` of them run (within a minute)."""
    import time

    import psutil

    deadline = time.monotonic() + 60
    while len(workers := psutil.Process(proc.pid).children(recursive=True)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    return workers


@pytest.mark.parametrize("command,how", [
    (["simulate", "--trace", str(TRACES / "cluster07.csv"), "--workers", "2"], "ctrl-c"),
    (["simulate", "--trace", str(TRACES / "cluster07.csv"), "--workers", "2"], "kill"),
    (["goals", "--traces", str(TRACES / "cluster07.csv"), "--seeds", "0-3", "--workers", "2"], "interrupt"),
])
def test_stopping_a_parallel_run_ends_its_workers_without_tracebacks(command, how):
    """Ctrl-C reaches the terminal's whole process group: every forked worker printed a
    KeyboardInterrupt traceback. A kill reaches the CLI alone, which stops the workers it started;
    a SIGINT to the CLI alone (kill -INT) must not wait for the runs under way (minutes)."""
    import os
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "kfp_pytorch.cli", *command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = _pool_workers(proc)
        time.sleep(0.5)  # the workers are simulating
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM if how == "kill" else signal.SIGINT)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - stopped < 10, "waited for the simulations under way"
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        if how == "kill":
            assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal 15" in err, err
        else:
            assert proc.returncode == 130 and "Aborted." in err, err
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("command", [
    ["simulate", "--trace", str(TRACES / "cluster07.csv"), "--workers", "2"],
    ["goals", "--traces", str(TRACES / "cluster10.csv"), "--seeds", "0-299", "--workers", "2"],
])
def test_workers_end_when_their_parent_is_killed_outright(command):
    """kill -9 (the OOM killer, a notebook kernel's restart) gives the CLI no chance to stop its
    workers: they waited on the pool's queue for ever, each holding the traces in memory."""
    import os
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "kfp_pytorch.cli", *command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        workers = _pool_workers(proc)
        time.sleep(0.5)  # the workers are simulating
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=20)  # the run under way is not waited for
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in workers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_kill_amid_many_short_runs_ends_the_pool_at_once():
    """Hundreds of short runs queued behind the workers: the CLI's handler reaped the stopped
    workers itself, the pool then took them for still running and its shutdown spun for ever
    (one kill in two hung, with SIGTERM ignored by then). Killed at several moments of the run."""
    import os
    import signal
    import time

    import psutil

    for delay in (0.3, 1.0, 1.7, 2.4, 3.1):
        proc = subprocess.Popen([sys.executable, "-m", "kfp_pytorch.cli", "goals", "--traces",
                                 str(TRACES / "cluster10.csv"), "--seeds", "0-299", "--workers", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            workers = _pool_workers(proc)
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                pytest.fail(f"killed {delay} s into the runs, it did not end within 15 s")
            assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal 15" in err, (delay, err)
            assert "Traceback" not in err, err
            _, alive = psutil.wait_procs(workers, timeout=5)
            assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], delay
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_stopping_a_pool_leaves_the_callers_own_processes_alone():
    # a notebook's own processes are not the pool's to end
    import multiprocessing as mp
    import time

    from kfp_pytorch.fairness_scheduler.report import stop_pool_workers

    ctx = mp.get_context("fork")
    mine = ctx.Process(target=time.sleep, args=(30,))
    mine.start()
    try:
        before = set(mp.active_children())
        pool_worker = ctx.Process(target=time.sleep, args=(30,))
        pool_worker.start()
        stop_pool_workers(before)
        pool_worker.join(5)
        assert pool_worker.exitcode is not None and mine.is_alive()
    finally:
        mine.terminate()
        mine.join()


def test_a_folder_of_gzip_traces_is_judged_by_the_traces_names(tmp_path):
    # cluster02.csv.gz is cluster02, with its stricter light-user target, not a trace named "cluster02.csv"
    import gzip

    (tmp_path / "cluster02.csv.gz").write_bytes(gzip.compress((TRACES / "cluster02.csv").read_bytes()))
    out = _goals("--traces", str(tmp_path), "--workers", "2", "--json")
    assert out.returncode == 0, out.stderr
    [run] = json.loads(out.stdout)["runs"]
    assert run["trace"] == "cluster02" and "0.15" in run["checks"]["light_wait_p95"]["target"], run["checks"]
