"""submit / schedule / runs through kfp.Client against a fake KFP v2beta1 server; storage check;
manifest dry runs; cron validation."""
import json
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from datetime import time as dt_time

import pytest
import yaml

from kfp_pytorch.components.errors import ConfigError
from kfp_pytorch.pipelines.schedule import validate_cron
from servers import free_port

CLI = [sys.executable, "-m", "kfp_pytorch.cli"]


def cli(*args, env=None):
    import os

    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_submit_uploads_runs_and_follows(kfp_server):
    fake, url = kfp_server
    r = cli("submit", "train_and_serve", "--host", url, "--experiment", "nightly", "--param", "epochs=3")
    assert r.returncode == 0, r.stderr
    assert "SUCCEEDED" in r.stdout and "RUNNING" in r.stderr  # the progress display shows each state
    # no MLflow server named: the runs and the registered model would stay in the pods' own sqlite files
    assert "note: tracking_uri is empty: each step's pod would keep its MLflow runs" in r.stderr
    [run] = fake.runs.values()
    assert run["runtime_config"]["parameters"]["epochs"] == 3
    assert run["experiment_id"] in fake.experiments and len(fake.pipelines) == 1
    # A second submit uploads a version of the same pipeline named by its content, in the same experiment
    r = cli("submit", "train_and_serve", "--host", url, "--experiment", "nightly", "--no-wait")
    assert r.returncode == 0, r.stderr
    assert len(fake.pipelines) == 1 and len(fake.versions) == 2 and len(fake.experiments) == 1
    # ... which the same spec reuses, whatever the parameters (time-stamped names collided within a second)
    r = cli("submit", "train_and_serve", "--host", url, "--experiment", "nightly", "--no-wait", "--param", "epochs=4")
    assert r.returncode == 0, r.stderr
    assert len(fake.versions) == 2 and len(fake.runs) == 3
    hashed = [v for v in fake.versions.values() if v["display_name"] != "train-and-serve"]
    assert len(hashed) == 1 and hashed[0]["display_name"].startswith("train-and-serve-")
    assert {r["pipeline_version_reference"]["pipeline_version_id"] for r in list(fake.runs.values())[1:]} == {
        hashed[0]["pipeline_version_id"]}


def test_following_rides_out_an_api_outage_and_says_so(kfp_server):
    # The gateway answers 503 while the API server pod restarts: following used to stop at the
    # first such answer (exit 3) although the run went on on the server.
    fake, url = kfp_server
    fake.run_states = ["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"]
    fake.gateway_down = {2, 3}
    r = cli("submit", "train_and_serve", "--host", url)
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout, r.stderr
    assert "lost the KFP API: get run failed: HTTP 503: no healthy upstream; retrying for up to 300 s" in r.stderr
    assert "the KFP API answers again after" in r.stderr and fake.run_gets == 5  # 2 refused, 3 answered


def test_following_stops_with_the_run_url_when_the_api_stays_away(kfp_server):
    import io

    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.kfp_api import KfpApi, KfpApiUnavailable

    fake, url = kfp_server
    api = KfpApi(url)
    run_id = api.submit(get_pipeline("train_and_serve"), {}, "outage")
    fake.gateway_down = set(range(1, 1000))
    out = io.StringIO()
    with pytest.raises(KfpApiUnavailable) as e:
        api.follow(run_id, interval=0.05, outage_s=0.5, out=out)
    assert f"stopped following run {run_id}: the KFP API at {url} has not answered for" in e.value.message
    assert f"the run goes on on the server: see {url}/#/runs/details/{run_id}" in e.value.hint
    assert out.getvalue().count("lost the KFP API") == 1 and 4 <= fake.run_gets <= 12  # backoff, not a busy loop
    # the API server itself gone (the port-forward died): the same, from a refused connection
    from fake_kfp import FakeKfp

    own = FakeKfp()
    api = KfpApi(own.start())
    run_id = api.submit(get_pipeline("train_and_serve"), {}, "outage")
    own.stop()
    with pytest.raises(KfpApiUnavailable, match=f"stopped following run {run_id}: .*did not answer"):
        api.follow(run_id, interval=0.05, outage_s=0.3, out=io.StringIO())


def test_following_does_not_hang_on_an_api_that_accepts_but_never_answers(kfp_server):
    # A port-forward whose tunnel died keeps the local port open and never answers. kfp.Client
    # sets no request timeout, so following hung there for ever; now a read that times out is
    # an outage like a refused one, ridden out the same way.
    import io
    import threading

    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    fake, url = kfp_server
    api = KfpApi(url)
    run_id = api.submit(get_pipeline("train_and_serve"), {}, "stall")
    fake.run_states = ["PENDING", "RUNNING", "SUCCEEDED"]
    fake.stall_s, fake.stalled = 600.0, set(range(2, 8))
    out, result = io.StringIO(), {}
    t = threading.Thread(target=lambda: result.update(state=api.follow(
        run_id, interval=0.05, request_timeout_s=0.3, outage_s=60, out=out)), daemon=True)
    t.start()
    t.join(120)
    hung = t.is_alive()
    fake.unstall.set()
    assert not hung, "following hung on an API that never answers:\n" + out.getvalue()
    assert result["state"] == "SUCCEEDED", out.getvalue()
    log = out.getvalue()
    assert "lost the KFP API: get run: the KFP API at" in log and "did not answer (ReadTimeoutError)" in log, log
    assert "the KFP API answers again after" in log and fake.run_gets >= 8


def test_a_kfp_api_that_never_answers_fails_a_one_shot_call_not_hangs_it(kfp_server):
    # kfp.Client sets no timeout on any request: `runs`, `schedule` or an upload against an API
    # that accepts the connection and never answers (a dead port-forward tunnel) hung for ever.
    import threading

    from kfp_pytorch.pipelines.kfp_api import KfpApi, KfpApiUnavailable

    fake, url = kfp_server
    api = KfpApi(url, request_timeout_s=0.3)
    fake.stall_s, fake.stalls = 600.0, [("GET", r"/apis/v2beta1/runs"), ("POST", r"/apis/v2beta1/experiments")]
    result = {}

    def call(what, fn):
        try:
            fn()
        except KfpApiUnavailable as e:
            result[what] = e
    threads = [threading.Thread(target=call, args=a, daemon=True) for a in
               (("list", lambda: api.runs()), ("create", lambda: api.experiment_id("new-one")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    hung = any(t.is_alive() for t in threads)
    fake.unstall.set()
    assert not hung, "a call hung on an API that never answers"
    assert set(result) == {"list", "create"}, result
    assert result["list"].message == f"list runs: the KFP API at {url} did not answer (ReadTimeoutError)"
    assert result["create"].message.startswith("create experiment: the KFP API at")
    assert "a port-forward to it still runs" in result["list"].hint
    fake.stalls = []
    assert api.runs() == ([], 0)  # the same client answers again once the API does


def test_ctrl_c_stops_following_not_the_run(kfp_server):
    import signal

    fake, url = kfp_server
    fake.run_states = ["PENDING"] + ["RUNNING"] * 500
    proc = subprocess.Popen([*CLI, "submit", "train_and_serve", "--host", url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if ": RUNNING" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    [run_id] = fake.runs
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert f"stopped following run {run_id}; it goes on on the server: {url}/#/runs/details/{run_id}" in err
    assert f"(`kfp-pytorch follow {run_id}` follows it again)" in err
    assert fake.runs[run_id]["state"] == "RUNNING" and ("POST", f"/apis/v2beta1/runs/{run_id}:terminate") \
        not in fake.requests


def test_a_failed_experiment_lookup_is_not_taken_for_no_experiment(kfp_server):
    # A lookup that failed read as "no such experiment": submit then created another one of the
    # same name (or failed on the create with a misleading error).
    fake, url = kfp_server
    fake.faults = [("GET", "/apis/v2beta1/experiments", 500, "Internal error: failed to list experiments: "
                                                             "database is locked")]
    r = cli("submit", "train_and_serve", "--host", url, "--experiment", "nightly", "--no-wait")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "look up experiment failed: HTTP 500: " in r.stderr and "database is locked" in r.stderr
    assert not fake.experiments and not fake.runs
    assert ("POST", "/apis/v2beta1/experiments") not in fake.requests


def test_a_failed_run_says_which_task_failed_and_why(kfp_server):
    fake, url = kfp_server
    fake.run_states = ["PENDING", "RUNNING", "FAILED"]
    fake.failure = ("train-op", "training diverged: the loss became nan in epoch 1")
    r = cli("submit", "train_and_serve", "--host", url)
    assert r.returncode == 1 and "FAILED" in r.stdout
    [run_id] = fake.runs
    assert "error: task train-op failed" in r.stderr
    assert "failed task: train-op: training diverged: the loss became nan in epoch 1" in r.stderr
    assert "prepare-data-op" not in r.stderr and f"the step logs: {url}/#/runs/details/{run_id}" in r.stderr


def test_a_run_submitted_without_waiting_is_followed_later_by_its_id(kfp_server):
    fake, url = kfp_server
    fake.run_states = ["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"]
    r = cli("submit", "train_and_serve", "--host", url, "--no-wait")
    [run_id] = fake.runs
    assert r.returncode == 0 and f"follow it with: kfp-pytorch follow {run_id} --host {url}" in r.stderr
    # stdout is ours alone, for a script to read the id from; kfp.Client's own links go to stderr
    assert r.stdout == f"run {run_id} created: {url}/#/runs/details/{run_id}\n", r.stdout
    assert f"Experiment details: {url}/#/experiments/details/" in r.stderr
    r = cli("follow", run_id, "--host", url)
    assert r.returncode == 0 and r.stdout == f"run {run_id}: SUCCEEDED\n", r.stdout + r.stderr
    assert f"run {run_id}: RUNNING" in r.stderr  # its states as they change, as submit shows them
    fake.run_states = ["PENDING", "RUNNING", "FAILED"]
    fake.failure = ("train-op", "training diverged: the loss became nan in epoch 1")
    assert cli("submit", "train_and_serve", "--host", url, "--no-wait").returncode == 0
    [failed] = set(fake.runs) - {run_id}
    r = cli("follow", failed, "--host", url)
    assert r.returncode == 1 and r.stdout == f"run {failed}: FAILED\n"
    assert "failed task: train-op: training diverged" in r.stderr and f"{url}/#/runs/details/{failed}" in r.stderr
    # the run list says why it failed, on its line and in --json; a run that did not fail says nothing
    rows = {x["run_id"]: x for x in json.loads(cli("runs", "--host", url, "--json").stdout)}
    assert rows[failed]["failure"] == ("error: task train-op failed; failed task: train-op: training diverged: the "
                                       "loss became nan in epoch 1") and rows[run_id]["failure"] is None
    [line] = [ln for ln in cli("runs", "--host", url).stdout.splitlines() if ln.startswith(failed)]
    assert line.split()[1] == "FAILED" and line.endswith(
        "  (error: task train-op failed; failed task: train-op: training diverged: the loss became nan in epoch 1)")
    gets = fake.run_gets
    r = cli("follow", "0b5c8c4e-0000-4000-8000-000000000000", "--host", url)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert f"the KFP API at {url} has no run '0b5c8c4e-0000-4000-8000-000000000000'" in r.stderr
    assert f"`kfp-pytorch runs --host {url}` lists the runs" in r.stderr and fake.run_gets == gets + 1  # asked once


def test_a_run_is_cancelled_by_its_id_and_one_that_ended_is_left_alone(kfp_server):
    fake, url = kfp_server
    fake.run_states = ["PENDING"] + ["RUNNING"] * 50
    assert cli("submit", "train_and_serve", "--host", url, "--no-wait").returncode == 0
    [run_id] = fake.runs
    r = cli("cancel", run_id, "--host", url)
    assert r.returncode == 0 and r.stdout == (f"run {run_id}: CANCELING (KFP is stopping its pods; "
                                              f"`kfp-pytorch follow {run_id}` shows it end)\n"), r.stdout + r.stderr
    assert ("POST", f"/apis/v2beta1/runs/{run_id}:terminate") in fake.requests
    r = cli("follow", run_id, "--host", url)
    assert r.returncode == 1 and r.stdout == f"run {run_id}: CANCELED\n"  # not a success: it did not finish
    terminates = fake.requests.count(("POST", f"/apis/v2beta1/runs/{run_id}:terminate"))
    r = cli("cancel", run_id, "--host", url)
    assert r.returncode == 0 and r.stdout == f"run {run_id} already ended: CANCELED; nothing to cancel\n"
    assert fake.requests.count(("POST", f"/apis/v2beta1/runs/{run_id}:terminate")) == terminates  # not asked again
    r = cli("cancel", "no-such-run", "--host", url)
    assert r.returncode == 3 and f"the KFP API at {url} has no run 'no-such-run'" in r.stderr
    for cmd in ("cancel", "follow"):  # a run id names no experiment: an --experiment would do nothing
        r = cli(cmd, run_id, "--host", url, "--experiment", "nightly")
        assert r.returncode == 2 and "No such option '--experiment'" in r.stderr, r.stderr
        assert "--experiment" not in cli(cmd, "--help").stdout


def test_a_failed_or_canceled_run_is_retried_in_place_and_followed_and_others_are_refused(kfp_server):
    # the KFP UI's Retry, from the CLI: after hours of training and a failure, the run's failed steps
    # run again with the same outputs (the train step trains on from its checkpoint)
    fake, url = kfp_server
    fake.run_states = ["PENDING", "RUNNING", "FAILED"]
    fake.failure = ("train-op", "training workers failed (torchrun exit code 1)")
    assert cli("submit", "train_and_serve", "--host", url).returncode == 1
    [run_id] = fake.runs
    fake.run_states, fake.failure = ["PENDING", "RUNNING", "SUCCEEDED"], None
    r = cli("retry", run_id, "--host", url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.match(rf"run {run_id} retried: (PENDING|RUNNING): {url}/#/runs/details/{run_id}\n", r.stdout), r.stdout
    assert r.stdout.endswith(f"run {run_id}: SUCCEEDED\n")  # followed to its end, as submit does
    assert ("POST", f"/apis/v2beta1/runs/{run_id}:retry") in fake.requests and len(fake.runs) == 1  # no new run
    r = cli("retry", run_id, "--host", url)
    assert r.returncode == 3 and f"run {run_id} is SUCCEEDED: only a FAILED or CANCELED run is retried" in r.stderr
    assert "`kfp-pytorch submit` starts a new run" in r.stderr
    assert fake.requests.count(("POST", f"/apis/v2beta1/runs/{run_id}:retry")) == 1  # not asked: it would refuse
    # one that runs: follow or cancel it; once canceled, it is retried
    fake.run_states = ["PENDING"] + ["RUNNING"] * 50
    assert cli("submit", "train_and_serve", "--host", url, "--no-wait").returncode == 0
    [running] = set(fake.runs) - {run_id}
    r = cli("retry", running, "--host", url)
    assert r.returncode == 3 and f"`kfp-pytorch cancel {running}` stops it" in r.stderr, r.stderr
    assert cli("cancel", running, "--host", url).returncode == 0
    assert cli("follow", running, "--host", url).returncode == 1  # CANCELED
    r = cli("retry", running, "--host", url, "--no-wait")
    assert r.returncode == 0 and re.fullmatch(rf"run {running} retried: (PENDING|RUNNING): {url}/#/runs/details/{running}\n",
                                              r.stdout), r.stdout
    assert f"follow it with: kfp-pytorch follow {running} --host {url}" in r.stderr
    # archived: the API server would refuse it
    fake.runs[run_id].update(state="FAILED", storage_state="ARCHIVED")
    r = cli("retry", run_id, "--host", url)
    assert r.returncode == 3 and f"run {run_id} is archived: KFP retries no archived run" in r.stderr
    assert "restore it in the KFP UI" in r.stderr and "Traceback" not in r.stderr
    r = cli("retry", "no-such-run", "--host", url)
    assert r.returncode == 3 and f"the KFP API at {url} has no run 'no-such-run'" in r.stderr


def test_submit_and_schedule_take_the_platform_file_that_compile_takes(kfp_server, tmp_path):
    fake, url = kfp_server
    plat = tmp_path / "platform.yaml"
    plat.write_text("s3_secret: minio-creds\ns3_endpoint: http://minio-service.kubeflow:9000\n"
                    "mlflow_tracking_uri: http://mlflow.kubeflow:5000\nlabels: {kfp-pytorch.io/user: alice}\n")
    r = cli("submit", "train_and_serve", "--host", url, "--no-wait", "--platform", str(plat))
    assert r.returncode == 0, r.stderr
    assert "tracking_uri is empty" not in r.stderr  # the platform names the MLflow server
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "@daily", "--platform", str(plat))
    assert r.returncode == 0, r.stderr
    assert len(fake.versions) == 2
    for v in fake.versions.values():  # what the API server keeps: the pipeline spec and its kubernetes platform spec
        execs = v["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        assert {e["secretAsEnv"][0]["secretName"] for e in execs.values()} == {"minio-creds"}
        assert execs["exec-train-op"]["podMetadata"]["labels"] == {"kfp-pytorch.io/user": "alice"}
        env = {e["name"]: e["value"] for e in
               v["pipeline_spec"]["deploymentSpec"]["executors"]["exec-register-op"]["container"]["env"]}
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.kubeflow:5000"
        assert env["AWS_ENDPOINT_URL"] == "http://minio-service.kubeflow:9000"
    plat.write_text("s3_secret: Not_A_Name\n")
    before = len(fake.requests)
    r = cli("submit", "train_and_serve", "--host", url, "--platform", str(plat))
    assert r.returncode == 2 and "s3_secret: 'Not_A_Name' is not a valid Secret name" in r.stderr
    assert len(fake.requests) == before  # refused before any call to the server


def test_a_canary_is_refused_before_submit_unless_the_platform_serves_with_knative(kfp_server, tmp_path):
    fake, url = kfp_server
    canary = ["--param", "serve_backend=cluster", "--param", "storage_root=s3://kfp-pytorch/runs",
              "--param", "canary_traffic_percent=10", "--param", "serve_min_replicas=0", "--param", "serve_max_replicas=3"]
    before = len(fake.requests)
    r = cli("submit", "train_and_serve", "--host", url, "--no-wait", *canary)
    assert r.returncode == 2, r.stderr
    assert "canary_traffic_percent: a canary rollout needs KServe's Serverless mode (Knative)" in r.stderr
    assert "serve_min_replicas: 0 (scale to zero) needs KServe's Serverless mode" in r.stderr
    assert len(fake.requests) == before  # nothing sent: the serve step would have refused it after training
    plat = tmp_path / "platform.yaml"
    plat.write_text("serving_mode: Serverless\n")
    r = cli("submit", "train_and_serve", "--host", url, "--no-wait", "--platform", str(plat), *canary)
    assert r.returncode == 0, r.stderr
    [v] = fake.versions.values()
    env = {e["name"]: e["value"] for e in v["pipeline_spec"]["deploymentSpec"]["executors"]["exec-serve-op"]["container"]["env"]}
    assert env["KFP_PYTORCH_SERVING_MODE"] == "Serverless"  # what the serve step's InferenceService is made with
    r = cli("manifest", "inferenceservice", "--image", "reg/kfp-pytorch:0.1.0", "--platform", str(plat), *canary)
    assert r.returncode == 0, r.stderr
    [isvc] = yaml.safe_load_all(r.stdout)
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 10 and isvc["spec"]["predictor"]["minReplicas"] == 0
    plat.write_text("serving_mode: Knative\n")
    r = cli("submit", "train_and_serve", "--host", url, "--platform", str(plat))
    assert r.returncode == 2 and "serving_mode: must be RawDeployment or Serverless, got 'Knative'" in r.stderr


def test_schedule_with_six_field_cron(kfp_server):
    fake, url = kfp_server
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *", "--param", "threshold=0.95")
    assert r.returncode == 0, r.stderr
    [rr] = fake.recurring.values()
    assert rr["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *" and int(rr["max_concurrency"]) == 1
    assert rr["runtime_config"]["parameters"]["threshold"] == 0.95
    line = next(x for x in r.stdout.splitlines() if x.startswith("next runs: "))
    times = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S") for t in line[len("next runs: "):].split(" UTC")[0].split(", ")]
    assert len(times) == 3 and all(t.time() == dt_time(3) for t in times)
    assert [(b - a).days for a, b in zip(times, times[1:])] == [1, 1]


@pytest.mark.parametrize("cron,expected", [
    ("0 0 3 * * *", ["2026-12-04 03:00:00", "2026-12-05 03:00:00", "2026-12-06 03:00:00"]),
    ("0 30 * * * *", ["2026-12-03 14:30:00", "2026-12-03 15:30:00", "2026-12-03 16:30:00"]),
    # day of month and day of week both given: either matches (robfig/cron, as Vixie cron)
    ("0 0 3 15 * MON", ["2026-12-07 03:00:00", "2026-12-14 03:00:00", "2026-12-15 03:00:00"]),
    ("0 0 0 * * 0", ["2026-12-06 00:00:00", "2026-12-13 00:00:00", "2026-12-20 00:00:00"]),
    ("@weekly", ["2026-12-06 00:00:00", "2026-12-13 00:00:00", "2026-12-20 00:00:00"]),
    ("@monthly", ["2027-01-01 00:00:00", "2027-02-01 00:00:00", "2027-03-01 00:00:00"]),
    ("@every 1h30m", ["2026-12-03 15:40:05", "2026-12-03 17:10:05", "2026-12-03 18:40:05"]),
])
def test_next_runs_read_the_cron_as_kfp_does(cron, expected):
    from kfp_pytorch.pipelines.schedule import next_runs

    after = datetime(2026, 12, 3, 14, 10, 5, tzinfo=timezone.utc)  # a Thursday
    assert [t.strftime("%Y-%m-%d %H:%M:%S") for t in next_runs(validate_cron(cron), after)] == expected


def test_a_schedule_runs_within_a_window_from_start_until_end(kfp_server):
    fake, url = kfp_server
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *", "--name", "q1",
            "--start", "2099-01-04", "--end", "2099-03-31T18:00:00+01:00")
    assert r.returncode == 0, r.stderr
    [rr] = [x for x in fake.recurring.values() if x["display_name"] == "q1"]
    assert rr["trigger"]["cron_schedule"]["start_time"] == "2099-01-04T00:00:00Z"  # a date is its midnight, UTC
    assert rr["trigger"]["cron_schedule"]["end_time"] == "2099-03-31T17:00:00Z"  # a zone given is read, sent as UTC
    assert "at '0 0 3 * * *' from 2099-01-04 00:00:00 UTC until 2099-03-31 17:00:00 UTC" in r.stdout
    assert "next runs: 2099-01-04 03:00:00, 2099-01-05 03:00:00, 2099-01-06 03:00:00 UTC" in r.stdout  # from the start
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "@hourly", "--name", "last-hours",
            "--end", (datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
                      + timedelta(hours=2, minutes=30)).isoformat())
    assert r.returncode == 0 and r.stdout.count(":00:00") == 2, r.stdout  # the two runs before the end
    created = len(fake.recurring)
    for args, needle in [
        (("--end", "2020-01-01"), "--end: 2020-01-01 00:00:00 UTC has passed: the schedule would never start a run"),
        (("--start", "2099-02-01", "--end", "2099-01-01"), "--end: 2099-01-01 00:00:00 UTC is not after --start"),
        (("--start", "next monday"), "--start: 'next monday' is not an ISO 8601 date or date-time"),
        (("--start", "2099-01-04T01:00:00Z", "--end", "2099-01-04T02:00:00Z"),
         "--end: the cron '0 0 3 * * *' fires first at 2099-01-04 03:00:00 UTC, after the end 2099-01-04 02:00:00 UTC"),
    ]:
        r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *", "--name", "bad", *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(fake.recurring) == created  # nothing created for a window that never runs
    r = cli("schedules", "--host", url, "--json")
    [q1] = [x for x in json.loads(r.stdout) if x["name"] == "q1"]
    assert (q1["start_time"], q1["end_time"]) == ("2099-01-04 00:00:00 UTC", "2099-03-31 17:00:00 UTC")
    assert q1["next_run"] == "2099-01-04 03:00:00 UTC"  # not before its start
    rr["trigger"]["cron_schedule"]["end_time"] = "2020-01-01T00:00:00Z"  # as a window that has passed reads
    [line] = [x for x in cli("schedules", "--host", url).stdout.splitlines() if x.startswith("q1 ")]
    assert re.search(r"\s{3}ended 2020-01-01 00:00\s{3}", line), line


def test_schedule_with_a_descriptor(kfp_server):
    fake, url = kfp_server
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "@every 6h", "--name", "every-6h")
    assert r.returncode == 0, r.stderr
    assert [rr["trigger"]["cron_schedule"]["cron"] for rr in fake.recurring.values()
            if rr["display_name"] == "every-6h"] == ["@every 6h"]


def test_scheduling_again_under_the_same_name_is_refused_unless_replace(kfp_server):
    fake, url = kfp_server
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "@daily").returncode == 0
    [first] = fake.recurring
    versions = len(fake.versions)
    # re-running schedule after a change would start the pipeline twice a day (kubeflow/pipelines#7435)
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 4 * * *")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert (f"experiment 'kfp-pytorch' already has a recurring run named 'train_and_serve-schedule': {first} "
            f"(ENABLED, '@daily')") in r.stderr and "pass --replace" in r.stderr
    assert list(fake.recurring) == [first] and len(fake.versions) == versions  # nothing uploaded
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 4 * * *", "--replace")
    assert r.returncode == 0, r.stderr
    [(new, rr)] = fake.recurring.items()
    assert new != first and f"(replaced {first})" in r.stdout and rr["trigger"]["cron_schedule"]["cron"] == "0 0 4 * * *"
    # another name, or the same name in another experiment, is another schedule
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "@hourly", "--name", "hourly").returncode == 0
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "@daily", "--experiment", "other").returncode == 0
    assert len(fake.recurring) == 3


def test_a_replace_whose_delete_fails_says_both_schedules_run(kfp_server):
    fake, url = kfp_server
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "@daily").returncode == 0
    [first] = fake.recurring
    fake.faults = [("DELETE", f"/apis/v2beta1/recurringruns/{first}", 500, "Internal error: database is locked")]
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 4 * * *", "--replace")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    [new] = set(fake.recurring) - {first}
    assert f"delete the replaced recurring run {first} failed: HTTP 500" in r.stderr
    assert f"the new recurring run {new} was created and is enabled; 1 replaced one(s) still run beside it: {first}" \
        in r.stderr and "with --replace again" in r.stderr
    # run again once the API answers, --replace leaves one schedule
    fake.faults = []
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 4 * * *", "--replace")
    assert r.returncode == 0 and len(fake.recurring) == 1, r.stderr


def test_schedules_are_listed_and_unscheduled_by_name(kfp_server):
    fake, url = kfp_server
    r = cli("schedules", "--host", url)
    assert r.returncode == 0 and "no recurring runs: there is no experiment 'kfp-pytorch' here" in r.stdout
    assert not fake.experiments  # listing creates nothing
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *").returncode == 0
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "@every 6h", "--name", "often").returncode == 0
    nightly, often = fake.recurring
    fake.recurring[often]["status"] = "DISABLED"  # paused in the UI
    # the runs the nightly schedule started, as KFP records them (the last one failed), and one by hand
    fake.run_states = ["PENDING", "RUNNING", "FAILED"]
    for day, state in ((3, "SUCCEEDED"), (4, "FAILED")):
        cli("submit", "train_and_serve", "--host", url, "--no-wait")
        run = fake.runs[list(fake.runs)[-1]]
        run.update(recurring_run_id=nightly, state=state, created_at=f"2026-12-0{day}T03:00:01Z")
    assert cli("submit", "train_and_serve", "--host", url, "--no-wait").returncode == 0
    failed = list(fake.runs)[1]
    r = cli("schedules", "--host", url, "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["train_and_serve-schedule"]["schedule"] == "0 0 3 * * *"
    assert rows["train_and_serve-schedule"]["next_run"].endswith("03:00:00 UTC")
    assert rows["train_and_serve-schedule"]["last_run"] == {"run_id": failed, "state": "FAILED",
                                                            "created_at": "2026-12-04 03:00:01 UTC"}
    assert rows["often"]["status"] == "DISABLED" and rows["often"]["next_run"] is None
    assert rows["often"]["last_run"] is None  # the run by hand is no schedule's
    r = cli("schedules", "--host", url)
    header, *lines = r.stdout.splitlines()
    assert re.split(r"\s{3,}", header) == ["NAME", "STATUS", "SCHEDULE", "NEXT RUN", "LAST RUN", "ID"]
    cells = {line.split()[0]: [c.strip() for c in re.split(r"\s{3,}", line)] for line in lines}
    assert cells["train_and_serve-schedule"][1:3] == ["ENABLED", "0 0 3 * * *"]
    assert cells["train_and_serve-schedule"][3].endswith("03:00:00 UTC")
    assert cells["train_and_serve-schedule"][4:] == ["FAILED 2026-12-04 03:00", nightly]
    assert cells["often"][1:] == ["DISABLED", "@every 6h", "-", "-", often]
    assert {line.index(nightly if "train" in line else often) for line in lines} == {header.index("ID")}  # aligned
    assert "why a run failed: kfp-pytorch follow RUN_ID" in r.stderr
    r = cli("unschedule", "nope", "--host", url)
    assert r.returncode == 3 and ("experiment 'kfp-pytorch' has no recurring run named 'nope' "
                                  "(it has: often, train_and_serve-schedule)") in r.stderr
    r = cli("unschedule", "often", "--host", url)
    assert r.returncode == 0 and r.stdout == f"deleted recurring run {often} (often)\n"
    assert list(fake.recurring) == [nightly]


def test_a_schedule_is_paused_and_resumed_by_name(kfp_server):
    fake, url = kfp_server
    assert cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *").returncode == 0
    [nightly] = fake.recurring
    r = cli("pause-schedule", "train_and_serve-schedule", "--host", url)
    assert r.returncode == 0 and r.stdout == f"paused recurring run {nightly} (train_and_serve-schedule): DISABLED\n", \
        r.stdout + r.stderr
    assert fake.recurring[nightly]["status"] == "DISABLED" and fake.recurring[nightly]["mode"] == "DISABLE"
    [row] = json.loads(cli("schedules", "--host", url, "--json").stdout)
    assert row["status"] == "DISABLED" and row["next_run"] is None  # a paused schedule has no next run
    r = cli("resume-schedule", "train_and_serve-schedule", "--host", url)
    assert r.returncode == 0 and r.stdout.startswith(f"resumed recurring run {nightly} (train_and_serve-schedule): "
                                                     "ENABLED\nnext run: "), r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("03:00:00 UTC") and r.stderr == ""  # made without catchup: no backfill note
    assert fake.recurring[nightly]["status"] == "ENABLED"
    fake.recurring[nightly]["no_catchup"] = False  # as one made in the KFP UI with catchup on
    r = cli("resume-schedule", "train_and_serve-schedule", "--host", url)
    assert r.returncode == 0 and "catchup is on for this recurring run: KFP now starts a run for every slot" in r.stderr
    r = cli("pause-schedule", "nightly", "--host", url)
    assert r.returncode == 3 and ("experiment 'kfp-pytorch' has no recurring run named 'nightly' "
                                  "(it has: train_and_serve-schedule)") in r.stderr and "Traceback" not in r.stderr
    assert fake.recurring[nightly]["status"] == "ENABLED"


def test_five_field_cron_shows_the_six_field_form(kfp_server):
    _, url = kfp_server
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 3 * * *")
    assert r.returncode == 2 and 'did you mean --cron "0 0 3 * * *"' in r.stderr and "Traceback" not in r.stderr


def test_options_kfp_would_refuse_are_refused_before_any_call(kfp_server):
    fake, url = kfp_server
    before = len(fake.requests)
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 31 2 *")  # 31 February
    assert r.returncode == 2 and "cron '0 0 3 31 2 *' never fires" in r.stderr and "Traceback" not in r.stderr
    r = cli("schedule", "train_and_serve", "--host", url, "--cron", "0 0 3 * * *", "--max-concurrency", "11")
    assert r.returncode == 2 and "'--max-concurrency': 11 is not in the range 1<=x<=10" in r.stderr
    r = cli("runs", "--host", url, "--namespace", "Team_A")
    assert r.returncode == 2 and "'Team_A' is not a Kubernetes namespace" in r.stderr
    r = cli("manifest", "s3-secret", "--namespace", "Team_A")  # a manifest the API server would refuse
    assert r.returncode == 2 and "'Team_A' is not a Kubernetes namespace" in r.stderr and r.stdout == ""
    r = cli("submit", "train_and_serve", "--host", url.split("://", 1)[1])  # the scheme left out
    assert r.returncode == 2 and "is not a URL of the KFP API: give http(s)://HOST[:PORT]" in r.stderr
    for port in ("99999", "ui"):  # requests' InvalidURL, "cannot reach the KFP API", once
        r = cli("runs", "--host", f"http://127.0.0.1:{port}")
        assert r.returncode == 2 and "is not a URL of the KFP API" in r.stderr and "cannot reach" not in r.stderr
    no_host = {"KFP_HOST": ""}  # a missing --host says what to pass, on every command that needs one
    for args, hint in ((("follow", "run-1"), "`run --local` needs no server"), (("schedules",), "needs no server"),
                       (("runs",), "--local lists this machine's runs")):
        r = cli(*args, env=no_host)
        assert r.returncode == 2 and "Missing option '--host'. Pass the KFP API's URL, or export KFP_HOST" in r.stderr
        assert hint in r.stderr and "port-forward svc/ml-pipeline-ui" in r.stderr
    assert len(fake.requests) == before and not fake.recurring


@pytest.mark.parametrize("expr,ok", [("0 0 3 * * *", True), ("*/30 * * * * ?", True), ("0 0 3 * * MON-FRI", True),
                                     ("@daily", True), ("@hourly", True), ("@every 1h30m", True), ("@every 90s", True),
                                     ("0 61 * * * *", False), ("0 0 3 * *", False), ("daily", False), ("@fortnightly", False),
                                     ("@every 500ms", False), ("@every 1 hour", False), ("@every", False),
                                     # robfig/cron's getRange: day of week 0-6, steps > 0, a-b with a <= b
                                     ("0 0 3 * * SUN", True), ("0 0 3/2 * * *", True), ("0 0 3 * JAN-MAR 1-5", True),
                                     ("0 0 3 * * 7", False), ("*/0 * * * * *", False), ("0 */x * * * *", False),
                                     ("0 0 5-3 * * *", False), ("0 0 1-2-3 * * *", False), ("0 0 3 0 * *", False),
                                     # a date no month given has: robfig/cron's Next finds none, the run never starts
                                     ("0 0 3 31 2 *", False), ("0 0 3 31 4,6,9,11 *", False), ("0 0 3 30 2 *", False),
                                     ("0 0 3 29 2 *", True), ("0 0 3 31 * *", True), ("0 0 3 31 4,5 *", True),
                                     ("0 0 3 31 2 MON", True)])  # day of month and of week both given: either
def test_validate_cron(expr, ok):
    # KFP reads a recurring run's cron with robfig/cron's Parse: 6 fields or a descriptor
    if ok:
        assert validate_cron(expr) == expr
    else:
        with pytest.raises(ConfigError):
            validate_cron(expr)


def test_cron_day_7_is_refused_with_sundays_number():
    # Vixie cron takes 7 for Sunday; robfig/cron (KFP) refuses it after the pipeline was uploaded
    with pytest.raises(ConfigError) as e:
        validate_cron("0 0 3 * * 5-7")
    assert e.value.problems == ["day of week field '5-7': '5-7' is outside 0-6 (Sunday is 0 or SUN); "
                                "expected 0-6, '*', ranges a-b, lists a,b or steps */n"]


def test_runs_lists_status(kfp_server):
    fake, url = kfp_server
    cli("submit", "train_and_serve", "--host", url, "--no-wait")
    r = cli("runs", "--host", url, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["state"] == "PENDING" and rows[0]["duration_s"] is None  # not ended
    # an ended run: how long it took (a running one's finished_at is 1970-01-01, not a length)
    cli("submit", "train_and_serve", "--host", url, "--no-wait")
    ended = fake.runs[list(fake.runs)[-1]]
    ended.update(state="SUCCEEDED", created_at="2026-12-04T03:00:00Z", finished_at="2026-12-04T03:12:30Z")
    rows = {x["run_id"]: x for x in json.loads(cli("runs", "--host", url, "--json").stdout)}
    assert rows[ended["run_id"]]["duration_s"] == 750.0
    lines = cli("runs", "--host", url).stdout.splitlines()
    assert "SUCCEEDED  2026-12-04 03:00:00+00:00     12.5m  train_and_serve" in lines[-1], lines
    assert lines[0].split() == ["RUN", "ID", "STATE", "CREATED", "TOOK", "NAME"], lines
    assert "       -  train_and_serve" in lines[1], lines
    # a mistyped experiment is answered, and not created by the listing
    r = cli("runs", "--host", url, "--experiment", "kfp-pytorh")
    assert r.returncode == 0 and r.stdout == "no runs: there is no experiment 'kfp-pytorh' here (experiments: kfp-pytorch)\n"
    assert sorted(e["display_name"] for e in fake.experiments.values()) == ["kfp-pytorch"]


def test_runs_pages_through_the_api_and_says_when_it_lists_only_the_newest(kfp_server):
    # the API answers a page at a time (20 by default, 200 at most): one page was all there was
    fake, url = kfp_server
    assert cli("submit", "train_and_serve", "--host", url, "--no-wait").returncode == 0
    [first] = fake.runs.values()
    first["created_at"] = "2026-12-03T09:00:00Z"
    body = {k: v for k, v in first.items() if k in ("display_name", "pipeline_version_reference", "runtime_config",
                                                    "experiment_id")}
    for i in range(1, 230):
        fake.create_run(dict(body, display_name=f"run-{i:03d}"))
        fake.runs[list(fake.runs)[-1]]["created_at"] = f"2026-12-03T10:{i // 60:02d}:{i % 60:02d}Z"
    r = cli("runs", "--host", url, "--json")
    rows = json.loads(r.stdout)
    assert r.returncode == 0 and [x["name"] for x in rows[:2]] == ["run-229", "run-228"] and len(rows) == 50
    assert r.stderr == "the newest 50 of 230 runs; --limit N lists more, --limit 0 all\n"  # and no kfp.Client warning
    r = cli("runs", "--host", url, "--limit", "0")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 1 + 230 and lines[1].endswith(" run-229") and lines[-2].endswith(" run-001")
    assert "train_and_serve" in lines[-1]
    pages = [q for q in fake.requests if q == ("GET", "/apis/v2beta1/runs")]
    assert len(pages) == 1 + 3  # the first listing one page of 50, then 100 + 100 + 30
    r = cli("runs", "--host", url, "--limit", "-1")
    assert r.returncode == 2 and "--limit" in r.stderr


def test_unreachable_host_and_auth(kfp_server):
    fake, url = kfp_server
    r = cli("runs", "--host", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 3 and "cannot reach the KFP API" in r.stderr and "port-forward" in r.stderr
    fake.require_token = "s3cr3t-token"
    r = cli("runs", "--host", url)
    assert r.returncode == 3 and "requires authentication" in r.stderr
    r = cli("runs", "--host", url, "--token", "s3cr3t-token", "--json")
    assert r.returncode == 0, r.stderr
    assert "s3cr3t-token" not in r.stdout + r.stderr


def test_an_https_kfp_behind_a_private_ca_is_trusted_with_its_ca_cert(kfp_server, tmp_path):
    # an on-prem Kubeflow behind the company's CA: refused as untrusted (not "cannot reach ... port-forward")
    import ssl

    from fake_trainer_status import _self_signed
    from servers import tls_proxy

    fake, url = kfp_server
    ca, cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    listener, https = tls_proxy(int(url.rsplit(":", 1)[1]), tls)
    try:
        r = cli("runs", "--host", https)
        assert r.returncode == 3, r.stderr
        assert (f"the KFP API at {https} has a TLS certificate this machine does not trust (unable to get local "
                "issuer certificate)") in r.stderr and "pass --ca-cert (or set KF_PIPELINES_CA_CERT)" in r.stderr
        fake.require_token = "s3cr3t-token"
        for how in (["--ca-cert", str(ca)], []):  # the option, or the environment
            r = cli("runs", "--host", https, "--token", "s3cr3t-token", "--json", *how,
                    env={} if how else {"KF_PIPELINES_CA_CERT": str(ca)})
            assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
        r = cli("runs", "--host", https, "--ca-cert", str(tmp_path / "missing.pem"))
        assert r.returncode == 2 and "'--ca-cert': File" in r.stderr and "does not exist" in r.stderr
    finally:
        listener.close()


def test_a_kubeflow_notebook_authenticates_with_its_projected_service_account_token(kfp_server, tmp_path, monkeypatch):
    # In a Kubeflow notebook (PodDefault "access-ml-pipeline") the token is a projected file that
    # kfp.Client reads by itself; our reachability check did not, and refused with "requires
    # authentication" before kfp.Client could use it.
    fake, url = kfp_server
    fake.require_token = "projected-sa-token"
    token = tmp_path / "token"
    token.write_text("projected-sa-token\n")
    r = cli("runs", "--host", url, "--json", env={"KF_PIPELINES_SA_TOKEN_PATH": str(token)})
    assert r.returncode == 0, r.stderr
    assert "projected-sa-token" not in r.stdout + r.stderr
    # the kubelet rotates the file about hourly: a run followed for hours reads the new one
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    token.write_text("projected-sa-token")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token))
    api = KfpApi(url)
    token.write_text("rotated-token")
    fake.require_token = "rotated-token"
    assert api.experiment_names() == []
    token.write_text("expired-token")
    r = cli("runs", "--host", url, env={"KF_PIPELINES_SA_TOKEN_PATH": str(token)})
    assert r.returncode == 3 and "requires authentication" in r.stderr and str(token) in r.stderr, r.stderr


def test_bad_parameters_are_rejected_before_any_request(kfp_server):
    fake, url = kfp_server
    r = cli("submit", "train_and_serve", "--host", url, "--param", "epochz=3")
    assert r.returncode == 2 and "did you mean 'epochs'" in r.stderr
    assert not fake.requests


def test_storage_check(s3_server, bucket):
    ok = cli("storage", "check", f"s3://{bucket}/runs", env=s3_server.env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "credentials accepted" in ok.stdout and "write permission" in ok.stdout and "read permission" in ok.stdout
    bad = cli("storage", "check", env={**s3_server.env, "AWS_SECRET_ACCESS_KEY": "nope-nope"})
    assert bad.returncode == 1 and "refused the credentials" in bad.stdout and "nope-nope" not in bad.stdout
    missing = cli("storage", "check", "s3://no-such-bucket-x/p", env=s3_server.env)
    assert missing.returncode == 1 and "does not exist" in missing.stdout
    dead = cli("storage", "check", env={**s3_server.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    assert dead.returncode == 1 and "cannot reach the S3 endpoint" in dead.stdout
    # a URI that could never work is named first, whatever the endpoint
    for uri, needle in (("ftp://x/y", "unsupported URI scheme 'ftp'"), ("/tmp/runs", "is not an s3:// or minio:// URI")):
        r = cli("storage", "check", uri, env={**s3_server.env, "AWS_ENDPOINT_URL": ""})
        assert r.returncode == 1 and r.stdout.count("FAIL") == 1 and needle in r.stdout, r.stdout
    # ls: an empty answer says so and fails, as `aws s3 ls` does
    r = cli("storage", "ls", f"s3://{bucket}/no-such-prefix", env=s3_server.env)
    assert r.returncode == 1 and r.stdout == "" and f"nothing under s3://{bucket}/no-such-prefix" in r.stderr
    r = cli("storage", "ls", f"s3://{bucket}/runs", env=s3_server.env)
    assert r.returncode == 1 and r.stdout == "", r.stdout  # the check's probe object is gone: nothing left behind
    from kfp_pytorch.components.storage import Storage, StorageConfig

    Storage(StorageConfig.from_env(s3_server.env)).write_bytes(f"s3://{bucket}/runs/a/model.pt2", b"x")
    for args in (["-r", f"s3://{bucket}/runs"], [f"s3://{bucket}/runs/a/model.pt2"]):  # a prefix, an object itself
        r = cli("storage", "ls", *args, env=s3_server.env)
        assert r.returncode == 0 and r.stdout == f"s3://{bucket}/runs/a/model.pt2\n", r.stdout + r.stderr
    r = cli("storage", "ls", f"s3://{bucket}/runs", env=s3_server.env)  # one level: the folder
    assert r.returncode == 0 and r.stdout == f"s3://{bucket}/runs/a/\n", r.stdout + r.stderr


def test_a_pod_with_fewer_gpus_than_worker_processes_is_refused():
    # two ranks on one GPU: NCCL refuses it once the pods are up; found here, before anything is created
    r = cli("manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0", "--param", "nodes=2", "--param", "workers=4",
            "--param", "gpus_per_node=1")
    assert r.returncode == 2 and r.stdout == ""
    assert ("gpus_per_node: each of a pod's 2 worker processes needs a GPU of its own, got 1 "
            "(workers = nodes x gpus_per_node)") in r.stderr


def test_manifest_dry_runs_are_valid():
    from k8s_schemas import validate_manifest

    for kind in ("pytorchjob", "trainjob", "inferenceservice"):
        r = cli("manifest", kind, "--image", "reg/kfp-pytorch:0.1.0", "--param", "nodes=2", "--param", "workers=4",
                "--param", "gpus_per_node=2", "--fairness")
        assert r.returncode == 0, r.stderr
        for doc in yaml.safe_load_all(r.stdout):
            validate_manifest(doc)
    for kind in ("pytorchjob", "trainjob", "inferenceservice"):  # where the image comes from, in this command
        r = cli("manifest", kind)
        assert r.returncode == 2 and "image: required" in r.stderr and "Traceback" not in r.stderr
        assert "hint: pass --image REGISTRY/kfp-pytorch:TAG, or export KFP_PYTORCH_IMAGE" in r.stderr, r.stderr
    # the serving replicas reach the InferenceService; scale to zero is refused in RawDeployment
    r = cli("manifest", "inferenceservice", "--image", "reg/kfp-pytorch:0.1.0", "--param", "serve_min_replicas=2",
            "--param", "serve_max_replicas=6")
    assert r.returncode == 0, r.stderr
    [isvc] = yaml.safe_load_all(r.stdout)
    assert (isvc["spec"]["predictor"]["minReplicas"], isvc["spec"]["predictor"]["maxReplicas"]) == (2, 6)
    r = cli("manifest", "inferenceservice", "--image", "reg/kfp-pytorch:0.1.0", "--param", "serve_min_replicas=0")
    assert r.returncode == 2 and "min_replicas: 0 (scale to zero) needs KServe's Serverless mode" in r.stderr


def test_a_loopback_address_bound_for_the_clusters_pods_gets_a_note(kfp_server, tmp_path):
    # a port-forward's http://127.0.0.1:9000 went into the pods' settings without a word: there it is the pod
    from kfp_pytorch.components.cluster import loopback_note

    for url in ("http://127.0.0.1:9000", "http://localhost:5000", "127.0.0.5:9000", "http://[::1]:9000",
                "https://minio.localhost"):
        assert loopback_note(url, "s3_endpoint", "X") == (
            f"s3_endpoint {url} is this machine's loopback address; in the cluster's pods it is the pod itself, so "
            "they would not reach it: give the Service's address in the cluster, e.g. X"), url
    for url in ("http://minio-service.kubeflow:9000", "10.0.0.7:9000", "https://s3.example.com", "http://[fd00::1]:80"):
        assert loopback_note(url, "s3_endpoint", "X") is None, url
    r = cli("manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"})
    assert r.returncode == 0 and next(yaml.safe_load_all(r.stdout))["kind"] == "PyTorchJob"
    assert r.stderr == ("note: AWS_ENDPOINT_URL http://127.0.0.1:9000 is this machine's loopback address; in the "
                        "cluster's pods it is the pod itself, so they would not reach it: give the Service's address in "
                        "the cluster, e.g. http://minio-service.kubeflow:9000 (s3_endpoint in --platform)\n"), r.stderr
    r = cli("manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0",
            env={"AWS_ENDPOINT_URL": "http://minio-service.kubeflow:9000"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    plat = tmp_path / "platform.yaml"
    plat.write_text("s3_endpoint: http://localhost:9000\nmlflow_tracking_uri: http://127.0.0.1:5000\n")
    r = cli("compile", "train_and_serve", "-o", str(tmp_path / "p.yaml"), "--platform", str(plat),
            "-p", "tracking_uri=http://127.0.0.1:5000")  # a run form's default: not noted; the platform's: compiled in
    assert r.returncode == 0, r.stderr
    assert "note: --platform's mlflow_tracking_uri http://127.0.0.1:5000 is this machine's loopback" in r.stderr
    assert "note: --platform's s3_endpoint http://localhost:9000 is this machine's loopback" in r.stderr
    assert "note: tracking_uri" not in r.stderr
    fake, url = kfp_server
    r = cli("submit", "train_and_serve", "--host", url, "--no-wait", "-p", "tracking_uri=http://localhost:5000")
    assert r.returncode == 0, r.stderr
    assert ("note: tracking_uri http://localhost:5000 is this machine's loopback address; in the cluster's pods it is "
            "the pod itself, so they would not reach it: give the Service's address in the cluster, e.g. "
            "http://mlflow.kubeflow:5000") in r.stderr


def test_a_manifest_dry_run_builds_the_job_the_train_step_would_from_every_training_parameter():
    # the dry run left out checkpoint_every_s: it showed the default 600 s for a pipeline that set 60
    from kfp_pytorch.components.ops.train import train_op
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.train_and_serve import TRAIN_SPEC_PARAMS

    r = cli("manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0", "--param", "checkpoint_every_s=60",
            "--param", "early_stopping_patience=3", "--param", "class_weight=balanced", "--param", "lr=0.01",
            "--param", "model_arch=cnn")
    assert r.returncode == 0, r.stderr
    [job] = yaml.safe_load_all(r.stdout)
    args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    given = dict(zip(args[::2], args[1::2]))
    assert (given["--checkpoint-every-s"], given["--early-stopping-patience"], given["--class-weight"],
            given["--lr"], given["--model"]) == ("60", "3", "balanced", "0.01", "cnn")
    # every pipeline parameter the train step reads, beside where the data and the outputs go
    pipeline = get_pipeline("train_and_serve").func.pipeline_spec
    bound = {k: v.component_input_parameter for k, v in
             pipeline.root.dag.tasks["train-op"].inputs.parameters.items() if v.component_input_parameter}
    assert set(bound.values()) - {"train_backend", "storage_root", "tracking_uri"} == set(TRAIN_SPEC_PARAMS.values())
    assert set(bound) <= set(train_op.component_spec.inputs)


def test_a_manifest_dry_run_shows_the_platform_settings_the_pods_would_get(tmp_path):
    plat = tmp_path / "platform.yaml"
    plat.write_text("s3_secret: minio-creds\nlabels: {team: vision}\n"
                    "gpu_tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n")
    r = cli("manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0", "--param", "gpus_per_node=2",
            "--param", "workers=2", "--platform", str(plat))
    assert r.returncode == 0, r.stderr
    [job] = yaml.safe_load_all(r.stdout)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert pod["metadata"]["labels"]["team"] == "vision" and pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e} == {
        "minio-creds"}
