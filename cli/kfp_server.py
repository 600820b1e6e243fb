"""``kfp-pytorch submit | follow | cancel | schedule(s) | runs``: runs and recurring runs on a KFP server (and this machine's runs)."""
import json
import sys

import click
from click.core import ParameterSource

from kfp_pytorch.components.errors import KfpPytorchError

from ._app import (
    _complete_pipeline, _echo_columns, _examples, _namespace, _PIPELINE, _PipelineParamsCommand, _RUN_ID, _said,
    _SCHEDULE_NAME, _size, cli)
from .pipelines import _before_submit, _platform_option, _resolve_params, _with_platform


def _host(ctx, param, value):
    """The KFP API's URL: refused here when it has no http(s) scheme or host, not after a failed call."""
    from urllib.parse import urlsplit

    parts = urlsplit(value or "")
    try:
        bad_port = parts.port is not None and not 1 <= parts.port <= 65535
    except ValueError:  # not a number, or above 65535: requests' InvalidURL after the call
        bad_port = True
    if parts.scheme not in ("http", "https") or not parts.hostname or bad_port:
        raise click.BadParameter(f"{value!r} is not a URL of the KFP API: give http(s)://HOST[:PORT], e.g. "
                                 "http://127.0.0.1:8080 after kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80")
    return value


class _KfpHost(click.ParamType):
    """--host's type: only so that a missing --host says what to pass, as every other error here does."""
    name = "URL"

    def __init__(self, local: str = "`run --local` needs no server"):
        self.local = local

    def convert(self, value, param, ctx):
        return value

    def get_missing_message(self, param, ctx):
        return ("Pass the KFP API's URL, or export KFP_HOST: e.g. http://127.0.0.1:8080 after kubectl -n kubeflow "
                f"port-forward svc/ml-pipeline-ui 8080:80 ({self.local})")


def _kfp_options(f=None, *, host_required: bool = True, experiment: bool = True):
    """--host, --namespace, --token, --ca-cert and, where the command reads or writes an experiment's
    runs, --experiment (a run id or a run names no experiment: an option there would do nothing)."""
    def wrap(f):
        f = click.option("--token", envvar="KF_PIPELINES_TOKEN", default=None,
                         help="Bearer token (or KF_PIPELINES_TOKEN).")(f)
        f = click.option("--ca-cert", envvar="KF_PIPELINES_CA_CERT", default=None,
                         type=click.Path(exists=True, dir_okay=False),
                         help="PEM file of the CA that signed an https KFP endpoint's certificate (or "
                              "KF_PIPELINES_CA_CERT).")(f)
        if experiment:
            f = click.option("--experiment", default="kfp-pytorch", show_default=True,
                             help="KFP experiment the runs and recurring runs belong to.")(f)
        f = click.option("--namespace", default=None, callback=_namespace,
                         help="Kubeflow profile namespace (multi-user).")(f)
        host_type = _KfpHost() if host_required else _KfpHost("--local lists this machine's runs")
        return click.option("--host", required=host_required, envvar="KFP_HOST", type=host_type,
                            callback=_host if host_required else lambda c, p, v: v if v is None else _host(c, p, v),
                            help="KFP API URL (or KFP_HOST)." + ("" if host_required else " Not with --local."))(f)

    return wrap(f) if f is not None else wrap


@cli.command("submit", cls=_PipelineParamsCommand, epilog=_examples(
    "kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80 &",
    "kfp-pytorch submit train_and_serve --host http://127.0.0.1:8080 --param dataset_uri=s3://datasets/iris.csv",
    "kfp-pytorch submit train_and_serve --host URL --platform platform.yaml --param train_backend=cluster --no-wait"))
@click.argument("pipeline", type=_PIPELINE, shell_complete=_complete_pipeline)
@_kfp_options
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Pipeline parameter (repeatable; kfp-pytorch pipelines lists them).")
@click.option("--run-name", default=None, help="The run's display name in the KFP UI (default: PIPELINE-YYYYMMDD-HHMMSS).")
@click.option("--wait/--no-wait", default=True, help="Follow the run until it ends.")
@_platform_option
def submit_cmd(pipeline, host, namespace, experiment, token, ca_cert, params, run_name, wait, platform_file):
    """Upload PIPELINE to a KFP server, start a run and follow it."""
    from kfp_pytorch.components._kfp import check_component_image
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    entry = get_pipeline(pipeline)
    values = _resolve_params(entry, params)
    entry, platform = _with_platform(entry, platform_file)
    check_component_image()  # local problems before any call to the server
    _before_submit(values, platform)
    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    run_id = api.submit(entry, values, experiment, run_name)
    click.echo(f"run {run_id} created: {_run_url(host, run_id)}")
    if wait:
        _follow_run(api, host, run_id)
    else:
        click.echo(f"follow it with: kfp-pytorch follow {run_id} --host {host}", err=True)


def _run_url(host: str, run_id: str) -> str:
    return f"{host.rstrip('/')}/#/runs/details/{run_id}"


def _follow_run(api, host: str, run_id: str) -> None:
    """Follow the run until it ends: its states on stderr, the final one on stdout, why it failed
    and exit 1 when it did not succeed; Ctrl-C stops following, not the run."""
    try:
        state = api.follow(run_id)
    except KeyboardInterrupt:  # only the following stops: the run is the server's
        click.echo(f"\nstopped following run {run_id}; it goes on on the server: {_run_url(host, run_id)} "
                   f"(`kfp-pytorch follow {run_id}` follows it again)", err=True)
        sys.exit(130)
    click.echo(f"run {run_id}: {state}")
    if state != "SUCCEEDED":
        for line in api.failure_lines(api.last_run):
            click.echo(line, err=True)
        click.echo(f"the step logs: {_run_url(host, run_id)}", err=True)
        sys.exit(1)


@cli.command("follow")
@click.argument("run_id", type=_RUN_ID)
@_kfp_options(experiment=False)
def follow_cmd(run_id, host, namespace, token, ca_cert):
    """Follow the KFP run RUN_ID until it ends, as submit does: after --no-wait, a closed terminal or
    a dropped port-forward (`kfp-pytorch runs` lists the ids). Exits 0 when it succeeded, 1 when not."""
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    api.run_or_error(run_id)
    _follow_run(api, host, run_id)


@cli.command("cancel")
@click.argument("run_id", type=_RUN_ID)
@_kfp_options(experiment=False)
def cancel_cmd(run_id, host, namespace, token, ca_cert):
    """Stop the KFP run RUN_ID, as the KFP UI's Terminate does: its pods are stopped and it ends
    CANCELED. A run that already ended is left as it is."""
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    asked, state = KfpApi(host, namespace, token, ca_cert=ca_cert).cancel(run_id)
    if not asked:
        click.echo(f"run {run_id} already ended: {state}; nothing to cancel")
        return
    click.echo(f"run {run_id}: {state}" + (" (KFP is stopping its pods; `kfp-pytorch follow "
                                           f"{run_id}` shows it end)" if state != "CANCELED" else ""))


@cli.command("retry")
@click.argument("run_id", type=_RUN_ID)
@_kfp_options(experiment=False)
@click.option("--wait/--no-wait", default=True, help="Follow the run until it ends.")
def retry_cmd(run_id, host, namespace, token, ca_cert, wait):
    """Retry the FAILED or CANCELED KFP run RUN_ID, as the KFP UI's Retry does: its failed and stopped
    steps run again in the same run (the steps that succeeded do not), and its train step trains on
    from its last checkpoint. Then follow it, as submit does."""
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    state = api.retry(run_id)
    click.echo(f"run {run_id} retried: {state}: {_run_url(host, run_id)}")
    if wait:
        _follow_run(api, host, run_id)
    else:
        click.echo(f"follow it with: kfp-pytorch follow {run_id} --host {host}", err=True)


@cli.command("schedule", cls=_PipelineParamsCommand, epilog=_examples(
    'kfp-pytorch schedule train_and_serve --host URL --cron "0 0 3 * * *"          # 03:00 UTC daily',
    'kfp-pytorch schedule train_and_serve --host URL --cron "@every 6h" --name often',
    "kfp-pytorch schedules --host URL                                              # and how they fare"))
@click.argument("pipeline", type=_PIPELINE, shell_complete=_complete_pipeline)
@_kfp_options
@click.option("--cron", required=True, type=_said('Say when it runs: --cron "0 0 3 * * *" (03:00 UTC daily; 6 fields, '
                                                   'seconds first), or "@daily", "@every 6h".'),
              help='6 fields, seconds first: "0 0 3 * * *" is 03:00 daily; or a descriptor: "@daily", "@every 6h".')
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Pipeline parameter of every run it starts (repeatable).")
@click.option("--name", default=None, help="Recurring run name (default: PIPELINE-schedule).")
@click.option("--max-concurrency", default=1, show_default=True, type=click.IntRange(1, 10),
              help="Runs of this schedule at once (KFP allows 1-10).")
@_platform_option
@click.option("--replace", is_flag=True,
              help="Replace the experiment's recurring run of the same name (created first, the old one deleted after).")
@click.option("--start", "start", default=None, metavar="WHEN",
              help="No run before this ISO 8601 date or date-time (UTC unless it names a zone), e.g. 2027-01-04.")
@click.option("--end", "end", default=None, metavar="WHEN",
              help="No run after this ISO 8601 date or date-time, e.g. the end of a project: 2027-03-31T18:00:00Z.")
def schedule_cmd(pipeline, host, namespace, experiment, token, ca_cert, cron, params, name, max_concurrency,
                 platform_file, replace, start, end):
    """Create a recurring run of PIPELINE (e.g. nightly retraining)."""
    from datetime import datetime, timezone

    from kfp_pytorch.components._kfp import check_component_image
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.kfp_api import KfpApi
    from kfp_pytorch.pipelines.schedule import next_runs, parse_window_time, rfc3339, validate_cron, window_problems

    cron = validate_cron(cron)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    start_at = parse_window_time(start, "--start") if start else None
    end_at = parse_window_time(end, "--end") if end else None
    if problems := window_problems(start_at, end_at, now):
        raise ConfigError(problems, "give an --end in the future and after --start", title="invalid schedule")
    soon = [t for t in next_runs(cron, max(now, start_at or now)) if end_at is None or t <= end_at]
    if not soon:  # a window shorter than the cron's period: a schedule that would never start a run
        first = next_runs(cron, max(now, start_at or now), 1)[0]
        raise ConfigError([f"--end: the cron '{cron}' fires first at {first:%Y-%m-%d %H:%M:%S} UTC, after the end "
                           f"{end_at:%Y-%m-%d %H:%M:%S} UTC"],
                          "give a later --end, or a cron that fires within the window", title="invalid schedule")
    entry = get_pipeline(pipeline)
    values = _resolve_params(entry, params)
    entry, platform = _with_platform(entry, platform_file)
    check_component_image()
    _before_submit(values, platform)
    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    rr, replaced = api.schedule(entry, values, cron, experiment, name, max_concurrency, replace,
                                start_time=rfc3339(start_at) if start_at else None,
                                end_time=rfc3339(end_at) if end_at else None)
    window = "".join([f" from {start_at:%Y-%m-%d %H:%M:%S} UTC" if start_at else "",
                      f" until {end_at:%Y-%m-%d %H:%M:%S} UTC" if end_at else ""])
    click.echo(f"recurring run {rr} created: {pipeline} at '{cron}'{window}"
               + (f" (replaced {', '.join(replaced)})" if replaced else ""))
    click.echo("next runs: " + ", ".join(t.strftime("%Y-%m-%d %H:%M:%S") for t in soon)
               + " UTC (KFP reads the cron on its server's clock, UTC unless its time zone was changed)")


@cli.command("schedules")
@_kfp_options
@click.option("--json", "as_json", is_flag=True, help="Print the recurring runs as JSON.")
def schedules_cmd(host, namespace, experiment, token, ca_cert, as_json):
    """List the experiment's recurring runs: name, status, cron, the next run time and the state of
    the last run each started."""
    from datetime import datetime, timezone

    from kfp_pytorch.pipelines.kfp_api import KfpApi

    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    found = api.recurring_runs(experiment)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    last = {}  # each schedule's newest run among the experiment's newest 200: did last night's retraining work?
    for run in (api.runs(experiment, 200) or ([], 0))[0] if found else []:
        if run.recurring_run_id and run.recurring_run_id not in last:
            last[run.recurring_run_id] = run
    rows = []
    for rr in found or []:
        cron = rr.trigger.cron_schedule.cron if rr.trigger and rr.trigger.cron_schedule else None
        every = (f"every {rr.trigger.periodic_schedule.interval_second}s"
                 if rr.trigger and rr.trigger.periodic_schedule else None)
        nxt = _next_run(rr, now) if str(rr.status) == "ENABLED" else None
        lr = last.get(rr.recurring_run_id)
        window = rr.trigger.cron_schedule if cron else None
        rows.append({"recurring_run_id": rr.recurring_run_id, "name": rr.display_name, "status": str(rr.status),
                     "schedule": cron or every or "-", "next_run": nxt, "max_concurrency": rr.max_concurrency,
                     **{k: f"{t:%Y-%m-%d %H:%M:%S} UTC" for k in ("start_time", "end_time")
                        if window and (t := getattr(window, k))},
                     "created_at": str(rr.created_at),
                     "last_run": lr and {"run_id": lr.run_id, "state": str(lr.state),
                                         "created_at": f"{lr.created_at:%Y-%m-%d %H:%M:%S} UTC"}})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if found is None:
        click.echo(f"no recurring runs: there is no experiment {experiment!r} here")
    elif not rows:
        click.echo(f"no recurring runs in experiment {experiment!r}")
    table = [("NAME", "STATUS", "SCHEDULE", "NEXT RUN", "LAST RUN", "ID")]  # NAME first: what pause-schedule takes
    for r in rows:
        lr = r["last_run"]
        ended = "end_time" in r and r["status"] == "ENABLED" and not r["next_run"]
        table.append((r["name"], r["status"], r["schedule"],
                      ("ended " + r["end_time"][:16]) if ended else r["next_run"] or "-",
                      (lr["state"] + " " + lr["created_at"][:16]) if lr else "-", r["recurring_run_id"]))
    if rows:
        _echo_columns(table)
    if any(r["last_run"] and r["last_run"]["state"] == "FAILED" for r in rows):
        click.echo("why a run failed: kfp-pytorch follow RUN_ID (its failed task and error); "
                   "--json gives each last run's id", err=True)


@cli.command("unschedule")
@click.argument("name", type=_SCHEDULE_NAME)
@_kfp_options
def unschedule_cmd(name, host, namespace, experiment, token, ca_cert):
    """Delete the recurring run NAME of the experiment (the runs it started stay)."""
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    for rid in KfpApi(host, namespace, token, ca_cert=ca_cert).unschedule(name, experiment):
        click.echo(f"deleted recurring run {rid} ({name})")


def _next_run(rr, now) -> str | None:
    """When the recurring run ``rr`` next fires after ``now``, in UTC, within its start and end
    times; None when it has no cron, when its window has ended, or for a cron KFP took that
    croniter does not read."""
    from kfp_pytorch.pipelines.schedule import next_runs

    cs = rr.trigger.cron_schedule if rr.trigger else None
    if not cs or not cs.cron:
        return None
    try:  # TypeError: a start or end time without a zone, which KFP does not send
        t = next_runs(cs.cron, max(now, cs.start_time) if cs.start_time else now, 1)[0]
        ended = bool(cs.end_time) and t > cs.end_time
    except (ValueError, TypeError, KfpPytorchError):
        return None
    return None if ended else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _set_schedule(name, host, namespace, experiment, token, ca_cert, enabled: bool) -> None:
    from datetime import datetime, timezone

    from kfp_pytorch.pipelines.kfp_api import KfpApi

    for rr in KfpApi(host, namespace, token, ca_cert=ca_cert).set_enabled(name, experiment, enabled):
        state = str(rr.status) if rr.status else ("ENABLED" if enabled else "DISABLED")
        click.echo(f"{'resumed' if enabled else 'paused'} recurring run {rr.recurring_run_id} ({name}): {state}")
        if not enabled:
            continue
        if soon := _next_run(rr, datetime.now(timezone.utc).replace(microsecond=0)):
            click.echo(f"next run: {soon}")
        if not rr.no_catchup:  # one made in the UI or by another tool: KFP backfills every slot it missed
            click.echo("note: catchup is on for this recurring run: KFP now starts a run for every slot missed while "
                       "it was paused; `kfp-pytorch schedule --replace` makes one without catchup", err=True)


@cli.command("pause-schedule")
@click.argument("name", type=_SCHEDULE_NAME)
@_kfp_options
def pause_schedule_cmd(name, host, namespace, experiment, token, ca_cert):
    """Pause the recurring run NAME (KFP starts no more runs of it until resume-schedule; a run it
    started goes on)."""
    _set_schedule(name, host, namespace, experiment, token, ca_cert, enabled=False)


@cli.command("resume-schedule")
@click.argument("name", type=_SCHEDULE_NAME)
@_kfp_options
def resume_schedule_cmd(name, host, namespace, experiment, token, ca_cert):
    """Resume the paused recurring run NAME. One that `schedule` made starts no runs for the slots
    missed while paused (no catchup)."""
    _set_schedule(name, host, namespace, experiment, token, ca_cert, enabled=True)


@cli.command("runs")
@_kfp_options(host_required=False)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=0),
              help="Newest runs to list; 0: all of them.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the runs as JSON (with --keep: what was removed and what was kept, and why).")
@click.option("--local", is_flag=True, help="The runs of `run --local` on this machine (KFP_PYTORCH_HOME).")
@click.option("--keep", default=None, type=click.IntRange(min=1), metavar="N",
              help="With --local: remove all but the newest N runs' outputs, on S3 too with storage_root (a served "
                   "model's run is kept), "
                   "and the registered versions downloaded to serve that no server uses.")
@click.option("--dry-run", is_flag=True, help="With --keep: say what would be removed, remove nothing.")
@click.option("--leave-s3", is_flag=True,
              help="With --keep: remove the runs' folders here only, leaving what their steps wrote on S3 (its "
                   "server is gone, say).")
def runs_cmd(host, namespace, experiment, token, ca_cert, limit, as_json, local, keep, dry_run, leave_s3):
    """List runs and their status, newest first (--local: this machine's, and prune them)."""
    if local:  # KFP_HOST exported for the other commands is no reason to refuse
        if host and click.get_current_context().get_parameter_source("host") != ParameterSource.ENVIRONMENT:
            raise click.UsageError("--local lists this machine's runs: leave out --host")
        if (dry_run or leave_s3) and keep is None:
            raise click.UsageError(f"{'--dry-run' if dry_run else '--leave-s3'} goes with --keep N: say how many "
                                   "of the newest runs to keep")
        return _local_runs(limit, as_json, keep, dry_run, leave_s3)
    if keep is not None or dry_run or leave_s3:
        raise click.UsageError("--keep, --dry-run and --leave-s3 prune local runs: add --local (a KFP server keeps its runs; "
                               "archive them in the KFP UI)")
    if not host:
        ctx = click.get_current_context()
        raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == "host"))
    from kfp_pytorch.pipelines.kfp_api import KfpApi

    api = KfpApi(host, namespace, token, ca_cert=ca_cert)
    listed = api.runs(experiment, limit)
    why_none = "no runs"
    if listed is None:  # as `kubectl get` in an empty namespace: an answer, not a failure, and nothing created
        known = api.experiment_names()
        why_none = (f"no runs: there is no experiment {experiment!r} here"
                    + (f" (experiments: {', '.join(known)})" if known else " (submit creates it)"))
        listed = ([], 0)
    runs, total = listed
    more = (f"the newest {len(runs)} of {total} runs; --limit N lists more, --limit 0 all"
            if total > len(runs) else None)
    # a failed run says why on its line (the failed task and its error), as the KFP UI's run list
    # does not: no opening of each run to find out
    rows = [{"run_id": r.run_id, "name": r.display_name, "state": str(r.state), "created_at": str(r.created_at),
             "duration_s": _run_seconds(r),
             "failure": "; ".join(KfpApi.failure_lines(r)) if str(r.state) == "FAILED" else None} for r in runs]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        if why_none != "no runs" and not rows:
            click.echo(why_none, err=True)
        if more:  # the array keeps its shape: say it beside
            click.echo(more, err=True)
        return
    from kfp_pytorch.fairness_scheduler.usage import format_duration

    if not rows:
        click.echo(why_none)
    else:  # a header, as kubectl's: TOOK is how long the run took, not its age
        click.echo(f"{'RUN ID':<{len(rows[0]['run_id'])}}  {'STATE':<10} {'CREATED':<26} {'TOOK':>8}  NAME")
    for r in rows:
        took = format_duration(r["duration_s"]) if r["duration_s"] is not None else "-"
        why = f"  ({r['failure']})" if r["failure"] else ""
        click.echo(f"{r['run_id']}  {r['state']:<10} {r['created_at']:<26} {took:>8}  {r['name']}{why}")
    if more:
        click.echo(more)


def _run_seconds(run) -> float | None:
    """How long an ended KFP run took; None while it runs (KFP reports finished_at as 1970-01-01 then)."""
    start, end = run.created_at, getattr(run, "finished_at", None)
    if str(run.state) not in ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED") or not start or not end or end.year < 2000:
        return None
    return max((end - start).total_seconds(), 0.0)


def _local_runs(limit: int, as_json: bool, keep: int | None, dry_run: bool, leave_s3: bool = False) -> None:
    import time

    from kfp_pytorch.components.paths import home
    from kfp_pytorch.fairness_scheduler.usage import format_duration
    from kfp_pytorch.pipelines.local import (later_champions, local_runs, registry_downloads,
                                             result_line)

    root = home() / "local_outputs"
    if keep is not None:
        return _prune_local(root, keep, dry_run, leave_s3, as_json)
    runs = local_runs(root)
    shown = runs[:limit] if limit else runs
    until = later_champions(runs)
    if as_json:
        click.echo(json.dumps([{"name": r.name, "path": str(r.path), "status": r.status, "size_bytes": r.size,
                                "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.modified)),
                                "elapsed_s": r.elapsed_s, "owner_pid": r.owner_pid,
                                "checkpoint_epochs": r.checkpoint_epochs, "resumed_from": r.resumed_from,
                                "remote": r.remote,
                                "log": str(r.log) if r.log else None,
                                "steps": r.steps,
                                "served_by": r.served_by,
                                "params": r.params, "result": r.result,
                                "champion_until": until.get(r.name)}
                               for r in shown], indent=1))
        return
    if not runs:
        click.echo(f"no local runs under {root}")
    else:  # a header, as kubectl's: ENDED is when the run last wrote, TOOK how long it ran
        click.echo(f"{'RUN':<44} {'STATUS':<10} {'ENDED':<16} {'TOOK':>6}  {'SIZE':>9}  STEPS    RESULT")
    for r in shown:
        # a run still going has not ended: its newest write is no end time
        when = "-" if r.status == "RUNNING" else time.strftime("%Y-%m-%d %H:%M", time.localtime(r.modified))
        served = f"  serving: {', '.join(r.served_by)}" if r.served_by else ""
        result = f"  {line}" if (line := result_line(r.result, r.params, until.get(r.name))) else ""
        if r.resumed_from:  # its training went on from that run's: the two are one model's history
            result += f"  resumed from {r.resumed_from}"
        if r.status == "RUNNING" and r.log:  # where to watch it, from another terminal
            result += f"  log: {r.log}"
        if r.checkpoint_epochs is not None:  # what --resume would save: said where the run is read
            of = f" of {r.params['epochs']}" if isinstance(r.params.get("epochs"), int) else ""
            result += f"  checkpoint after {r.checkpoint_epochs}{of} epochs: `run --resume` trains on"
        took = format_duration(r.elapsed_s) if r.elapsed_s is not None else "-"
        click.echo(f"{r.name:<44} {r.status:<10} {when:<16} {took:>6}  {_size(r.size):>9}  {len(r.steps)} steps"
                   f"{result}{served}")
    if len(shown) < len(runs):
        click.echo(f"the newest {len(shown)} of {len(runs)} local runs; --limit 0 lists all")
    if runs:
        click.echo(f"{len(runs)} local run(s), {_size(sum(r.size for r in runs))} under {root}; "
                   "`runs --local --keep N` removes all but the newest N")
    if downloads := registry_downloads():
        unused = [d for d in downloads if not d.served_by]
        click.echo(f"{len(downloads)} registered version(s) downloaded to serve, {_size(sum(d.size for d in downloads))} "
                   f"under {downloads[0].path.parent}" + (f"; --keep also removes the {len(unused)} that no server uses"
                                                          if unused else ""))


def _prune_local(root, keep: int, dry_run: bool, leave_s3: bool, as_json: bool) -> None:
    """`runs --local --keep N`: all but the newest N runs' outputs go (on S3 too, unless
    ``leave_s3``), then the registered versions downloaded to serve that no server uses. Said line
    by line, or with ``as_json`` as one object on stdout (a script's --json is not answered in text)."""
    from kfp_pytorch.pipelines.local import prune_local_runs, prune_registry_downloads

    removed, spared, failed = prune_local_runs(keep, root, dry_run=dry_run, remote=not leave_s3)
    gone, left = prune_registry_downloads(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"

    def why_spared(r) -> str:
        if r.status == "RUNNING" and not r.served_by:
            return f"it is running (process {r.owner_pid})"
        if not r.served_by:
            return "no record and written within the hour: it may still be running"
        return f"its model is served by {', '.join(r.served_by)}" + (
            "; `kfp-pytorch serve start --all` starts what is down" if any(n.endswith(" (down)") for n in r.served_by)
            else "")

    def why_left(d) -> str:
        return (f"served by {', '.join(d.served_by)}" if d.served_by
                else "wanted within the hour: a `serve start` or `serve predict` may be using it")

    if as_json:
        click.echo(json.dumps({
            "dry_run": dry_run, "keep": keep,
            "removed": [{"name": r.name, "path": str(r.path), "status": r.status, "size_bytes": r.size,
                         "remote": r.remote, "remote_removed": bool(r.remote) and not leave_s3} for r in removed],
            "kept": [{"name": r.name, "why": why_spared(r)} for r in spared]
            + [{"name": r.name, "why": f"its artifacts on S3 under {r.remote}/ could not be removed: {error}"}
               for r, error in failed],
            "registry_downloads": {"removed": [{"name": d.name, "size_bytes": d.size} for d in gone],
                                   "kept": [{"name": d.name, "why": why_left(d)} for d in left]}}, indent=1))
    else:
        for r in removed:
            click.echo(f"{verb} {r.name}  {r.status:<10} {_size(r.size)}" + (
                "" if not r.remote else f"; left its artifacts on S3 under {r.remote}/" if leave_s3 else
                f", and its artifacts on S3 under {r.remote}/"))
        for r, error in failed:  # its folder says where they are: it stays until they go
            click.echo(f"kept {r.name}: its artifacts on S3 under {r.remote}/ could not be removed: {error}", err=True)
        for r in spared:
            click.echo(f"kept {r.name}: {why_spared(r)}")
        click.echo(f"{verb} {len(removed)} local run(s), {_size(sum(r.size for r in removed))}; "
                   f"kept the newest {keep}" + (f" and {len(spared) + len(failed)} more" if spared or failed else "")
                   + ("" if not removed or dry_run else
                      "; the MLflow registry keeps its own copy of each registered model"))
        for d in gone:
            click.echo(f"{verb} {d.name}  (downloaded from the registry) {_size(d.size)}")
        for d in left:
            click.echo(f"kept {d.name}: {why_left(d)}")
        if gone:
            click.echo(f"{verb} {len(gone)} registered version(s) downloaded to serve, "
                       f"{_size(sum(d.size for d in gone))}; the registry keeps them (`serve start --model-uri` "
                       "downloads one again)")
    if failed:  # after what was done is said (or printed as JSON): the exit status says some were kept
        from kfp_pytorch.components.errors import StorageError

        raise StorageError(f"{len(failed)} run(s) kept: their artifacts on S3 could not be removed",
                           f"once the S3 server answers (`kfp-pytorch storage check`), run `kfp-pytorch runs "
                           f"--local --keep {keep}` again; --leave-s3 removes their folders here only")
