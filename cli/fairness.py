"""``kfp-pytorch simulate | goals | ledger``: the fair-share scheduler's simulator, goals and usage ledger."""
import json
import sys

import click

from kfp_pytorch.fairness_scheduler.model import PLACEMENTS

from ._app import _examples, _output_problem, _read_yaml, _said, cli


PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def _complete_policies(ctx, param, incomplete):
    """``--policies a,b,<TAB>``: the policies not named yet, after those that are."""
    from click.shell_completion import CompletionItem

    from kfp_pytorch.fairness_scheduler.policy import POLICIES

    head, _, last = incomplete.rpartition(",")
    named = set(head.split(",")) if head else set()
    return [CompletionItem(f"{head},{p}" if head else p) for p in ["all", *POLICIES]
            if p.startswith(last) and p not in named and not (head and p == "all")]


def _given_on_command_line(*params: str) -> list[str]:
    """Those of ``params`` the user gave (command line or environment), as ``--option`` names."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [f"--{p.replace('_', '-')}" for p in params if ctx.get_parameter_source(p) in given]


def _unused_users_note(cfg, names) -> list[str]:
    """A line naming the users the config lists that are not among ``names``: their entries (shares,
    tier, quota) applied to nothing, which is most often a misspelt name."""
    unused = cfg.unused_users(names) if cfg is not None else []
    if not unused:
        return []
    some = ", ".join(list(names)[:3]) + (", ..." if len(names) > 3 else "")
    return [f"note: --config lists users who are not in this run, so their entries were not used: {', '.join(unused)} "
            f"(the users here: {some})"]


def _read_scheduler_config(config: str | None):
    """``--config``'s YAML and the scheduler config built from it (the defaults without one). A bad
    field's problem names the file, as a YAML error does: several files may be in one command."""
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.fairness_scheduler.config import load_config

    raw = _read_yaml(config, "--config") if config else {}
    try:
        return raw, load_config(raw)
    except ConfigError as e:
        raise ConfigError([f"--config {config}: {p.removeprefix('(top level): ')}" for p in e.problems], e.hint,
                          title="invalid scheduler configuration") from None


def _config_and_half_life(config: str | None, half_life: str | None, problems: list[str]):
    """The scheduler config (``--config``, else the defaults) and the usage half-life in seconds:
    ``--half-life`` if given, else the config's. Problems are appended, not raised, so one error
    lists every bad option; ``(None, 1.0)`` stands in for what could not be read."""
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.fairness_scheduler.usage import parse_duration

    cfg = None
    try:
        cfg = _read_scheduler_config(config)[1]
    except ConfigError as e:
        problems += e.problems
    if half_life is None:
        return cfg, cfg.half_life if cfg else 1.0
    try:
        return cfg, parse_duration(half_life)
    except ValueError:
        problems.append(f"--half-life: must be a duration like 7d, 12h, 1d12h or seconds, got {half_life!r}")
        return cfg, 1.0


def _trace_said() -> str:
    """What a missing --trace says: what a trace holds."""
    from kfp_pytorch.fairness_scheduler.trace import COLUMNS, USER_COLUMN

    return (f"Give a trace CSV, plain or gzip-compressed, with the columns {', '.join(COLUMNS)} (and {USER_COLUMN}, "
            "optionally), as the itp-2021 traces have.")


@cli.command("simulate", epilog=_examples(
    "kfp-pytorch simulate --trace shared/traces/itp-2021/cluster07.csv",
    "kfp-pytorch simulate --trace cluster07.csv --policies fifo,fairshare --per-user --plot c07.png",
    "kfp-pytorch simulate --trace cluster07.csv --config scheduler.yaml --json | jq .fairshare"))
@click.option("--trace", "trace", required=True, type=_said(_trace_said, click.Path()),
              help="Trace CSV (itp-2021 format), plain or gzip-compressed.")
@click.option("--policies", default="all", show_default=True, shell_complete=_complete_policies,
              help="all, or a comma-separated list.")
@click.option("--users", default=20, show_default=True, type=int,
              help="Users drawn by the Zipf law; the lighter half are the light users. A trace with a user "
                   "column keeps its own users (--users, --zipf and --seed then do not apply).")
@click.option("--zipf", default=1.1, show_default=True, type=float,
              help="Exponent of the Zipf law users are drawn by: higher puts more of the jobs on the few heaviest users.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the users' draw (the protocol's).")
@click.option("--load", default=0.9, show_default=True, type=float,
              help="Offered load: the cluster is sized so the trace's mean GPU demand is this share of it "
                   "(and never below the largest job, whatever the load).")
@click.option("--half-life", "half_life", default=None,
              help="Usage half-life: 7d, 12h, 1d12h, seconds. Overrides the config's (default 7d).")
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Scheduler config YAML: fairshare weights; shares, tiers and GPU quotas of the users it "
                   "lists (drawn by the protocol or a trace's own).")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=None,
              help="Node for pods below a node's size: fullest that fits (binpack, the default) or "
                   "emptiest (spread, kube-scheduler's default scoring). Overrides the config's.")
@click.option("--json", "as_json", is_flag=True, help="Print {policy: {metric: value}} only.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG with per-user service ratios and wait CDFs.")
@click.option("--schedule", "schedule_path", type=click.Path(dir_okay=False), default=None,
              help="CSV with every job's submit, start and end time under each policy.")
@click.option("--workers", type=int, default=None,
              help="Policies simulated at once, one process each (default: one per policy, up to the CPUs). "
                   "Results do not depend on it.")
@click.option("--per-user", "per_user", is_flag=True,
              help="Also print each user's service ratio and p95 wait under each policy (not with --json).")
def simulate_cmd(trace, policies, users, zipf, seed, load, half_life, config, placement, as_json, plot_path,
                 schedule_path, workers, per_user):
    """Replay a GPU-cluster trace under several scheduling policies, side by side."""
    from kfp_pytorch.fairness_scheduler.errors import SchedulerOptionsError
    from kfp_pytorch.fairness_scheduler.report import (default_workers, format_per_user, format_table, option_problems,
                                                       parse_policies, plot, policy_problems, run_protocol,
                                                       unschedulable_lines, workers_problems, write_schedule)

    # Every bad option and config field in one error, so one run shows all there is to fix.
    problems = policy_problems(policies)
    cfg, hl = _config_and_half_life(config, half_life, problems)
    if plot_path and (problem := _output_problem(plot_path, "--plot", PLOT_FORMATS)):
        problems.append(problem)
    if schedule_path and (problem := _output_problem(schedule_path, "--schedule", (".csv",))):
        problems.append(problem)
    problems += option_problems(users, zipf, load, hl, placement or (cfg.placement if cfg else "binpack"), seed)
    if workers is not None:
        problems += workers_problems(workers)
    if per_user and as_json:
        problems.append("--per-user: prints tables, so not with --json (for per-job figures use --schedule FILE.csv)")
    if problems:
        raise SchedulerOptionsError(problems)
    names = parse_policies(policies)
    results, info = run_protocol(trace, names, users, zipf, seed, load, hl, cfg.fairshare,
                                 progress=not as_json and sys.stderr.isatty(), placement=placement or cfg.placement,
                                 workers=workers or default_workers(len(names)), user_config=cfg.user)
    notes = _unused_users_note(cfg, info["user_names"])
    if info.get("users_from") == "trace" and (given := _given_on_command_line("users", "zipf", "seed")):
        notes.append(f"note: {', '.join(given)} did not apply: the trace names its jobs' users (a user column)")
    if as_json:
        click.echo(json.dumps({p: r.metrics for p, r in results.items()}, indent=1))
        for line in unschedulable_lines(results) + notes:  # the object keeps the protocol's shape: say it beside
            click.echo(line, err=True)
    else:
        click.echo(format_table(results, info))  # the unschedulable jobs included
        for line in notes:
            click.echo(line)
        if per_user:
            click.echo("\n" + format_per_user(results))
    if plot_path:
        plot(results, plot_path)
        if not as_json:
            click.echo(f"plot: {plot_path}")
    if schedule_path:
        rows = write_schedule(results, schedule_path)
        if not as_json:
            click.echo(f"schedule: {schedule_path} ({rows} rows)")


@cli.command("goals", epilog=_examples(
    "kfp-pytorch goals --traces shared/traces/itp-2021 -v",
    "kfp-pytorch goals --traces shared/traces/itp-2021 --seeds 0-5 --config scheduler.yaml --cache .goals-cache"))
@click.option("--traces", "traces", multiple=True, type=click.Path(),
              help="Trace CSV (plain or .csv.gz), or a folder of them; repeat for more.  [required]")
@click.option("--seeds", default="0", show_default=True, help="User draws: 0-5, 0,3,7 or a mix.")
@click.option("--sets", default="full", show_default=True,
              help="Job mixes, comma-separated: full (the traces), halves, thirds, middle (cut by submission "
                   "time), pairs (each trace overlaid with the next: two clusters' work on one).")
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Scheduler config YAML: the fairshare setting to judge (default: the built-in one).")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=None, help="Overrides the config's.")
@click.option("--users", default=20, show_default=True, type=int,
              help="Protocol options, as simulate's: the goals' targets are set at their defaults; other "
                   "values stress-test the setting beyond them.")
@click.option("--zipf", default=1.1, show_default=True, type=float,
              help="Exponent of the Zipf law users are drawn by: higher puts more of the jobs on the few heaviest users.")
@click.option("--load", default=0.9, show_default=True, type=float,
              help="Offered load: the cluster is sized so the trace's mean GPU demand is this share of it "
                   "(and never below the largest job, whatever the load).")
@click.option("--half-life", "half_life", default=None,
              help="Usage half-life of every policy: 7d, 12h, 1d12h, seconds. Overrides the config's (default 7d).")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Folder keeping the baselines' metrics, so the next setting re-runs fairshare only.")
@click.option("--workers", type=int, default=None, help="Runs at once, one process each (default: the CPUs).")
@click.option("-v", "--verbose", is_flag=True, help="Also list every run that misses a goal, with its figures.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and every run's metrics and checks as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG grid: one cell per trace and seed, coloured by the goals missed.")
def goals_cmd(traces, seeds, sets, config, placement, users, zipf, load, half_life, cache_dir, workers, verbose,
              as_json, plot_path):
    """Judge the fairshare policy by issue #4's goals over many runs, against the baselines of each run.

    fairness_scheduler/TUNING.md counts runs with this judge. Its 112-run set for comparing
    settings: --sets full --seeds 0-5, then --sets halves --seeds 0-3."""
    from kfp_pytorch.fairness_scheduler.errors import SchedulerOptionsError
    from kfp_pytorch.fairness_scheduler.evaluate import (evaluate_goals, format_goals, goal_grid, parse_seeds,
                                                         set_problems, to_json, trace_files)
    from kfp_pytorch.fairness_scheduler.report import PROTOCOL_DEFAULTS, option_problems, usable_cpus, workers_problems
    from kfp_pytorch.fairness_scheduler.trace import protocol_users, read_trace, trace_users

    problems = []
    try:
        seed_list = parse_seeds(seeds)
    except ValueError as e:
        problems.append(str(e))
    set_list = [x.strip() for x in sets.split(",") if x.strip()]
    files, trace_problems = trace_files(list(traces))
    problems += set_problems(set_list, None if trace_problems else len(files))
    problems += trace_problems
    cfg, hl = _config_and_half_life(config, half_life, problems)
    problems += option_problems(users, zipf, load, hl, placement or (cfg.placement if cfg else "binpack"))
    if workers is not None:
        problems += workers_problems(workers)
    if plot_path and (problem := _output_problem(plot_path, "--plot", PLOT_FORMATS)):
        problems.append(problem)
    if problems:
        raise SchedulerOptionsError(problems)
    runs = evaluate_goals(list(traces), seed_list, set_list, cfg.fairshare, placement or cfg.placement,
                          workers or usable_cpus(), cache_dir, progress=not as_json and sys.stderr.isatty(),
                          users=users, zipf=zipf, load=load, half_life=hl, user_config=cfg.user)
    protocol = {"users": users, "zipf": zipf, "load": load, "half_life_s": hl}
    changed = [f"--{k.removesuffix('_s').replace('_', '-')} {v:g}" for k, v in protocol.items()
               if v != PROTOCOL_DEFAULTS[k]]
    if as_json:
        click.echo(json.dumps({"protocol": protocol, **to_json(runs)}, indent=1))
    else:
        if changed:  # the goals' targets were set at the protocol defaults: say these runs are not there
            click.echo(f"protocol changed from the defaults the goals were set at: {', '.join(changed)}")
        click.echo(format_goals(runs, verbose))
    if cfg.users:  # which of the config's users appear in any run (a trace's own, or the protocol's draw)
        drawn = [u.name for u in protocol_users(users)]
        names = [n for f in files for n in (trace_users(read_trace(f)) or drawn)]
        for line in _unused_users_note(cfg, list(dict.fromkeys(names))):
            click.echo(line, err=as_json)
    if plot_path:
        goal_grid(runs).savefig(plot_path, dpi=110)
        if not as_json:
            click.echo(f"plot: {plot_path}")


@cli.group("ledger")
def ledger_grp():
    """The fairness scheduler's usage ledger: where each user stands, and compaction."""


_LEDGER_URL = _said("Pass the URL of the ledger the fairness scheduler writes, or export KFP_PYTORCH_LEDGER: "
                    "e.g. --ledger sqlite:///fairshare-ledger.db, or postgresql+psycopg://USER@HOST/DB for a shared one",
                    name="URL")
"""--ledger's type: a missing --ledger says what to pass, as a missing --host does."""


def _ledger_options(f):
    f = click.option("--at", "at", default="now", show_default=True,
                     help="When: now, seconds since the epoch, or an ISO 8601 date-time (UTC unless it names a zone).")(f)
    f = click.option("--half-life", "half_life", default=None,
                     help="Usage half-life: 7d, 12h, 1d12h, seconds (default: the ledger's own).")(f)
    f = click.option("--ledger", "ledger_url", envvar="KFP_PYTORCH_LEDGER", required=True, type=_LEDGER_URL,
                     help="The scheduler's ledger: sqlite:///PATH or a SQLAlchemy URL (or KFP_PYTORCH_LEDGER).")(f)
    return f


def _ledger_time_and_half_life(at: str, half_life: str | None, problems: list[str]) -> tuple[float, float | None]:
    import time

    from kfp_pytorch.fairness_scheduler.usage import parse_duration, parse_time

    t = hl = None
    try:
        t = parse_time(at, time.time())
    except ValueError:
        problems.append(f"--at: must be now, seconds since the epoch or an ISO 8601 date-time, got {at!r}")
    if half_life is not None:
        try:
            hl = parse_duration(half_life)
            if not hl > 0:
                raise ValueError
        except ValueError:
            problems.append(f"--half-life: must be a duration > 0 like 7d, 12h, 1d12h or seconds, got {half_life!r}")
    return t, hl


@ledger_grp.command("show", short_help="Each user's decayed usage, share and fair-share factor.", epilog=_examples(
    "kfp-pytorch ledger show --ledger sqlite:///fairshare-ledger.db --config scheduler.yaml",
    "kfp-pytorch ledger show --ledger sqlite:///fairshare-ledger.db --at 2026-12-01 --capacity gpu=64,cpu=512,memory=4096"))
@_ledger_options
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Scheduler config YAML: users' shares and tiers, fairshare weights (and half_life).")
@click.option("--capacity", "capacity", default="gpu=1", show_default=True,
              help="The cluster's gpu=N,cpu=N,memory=N (GB): how usage share weighs the resource kinds, "
                   "as the scheduler does. The default counts GPU-seconds only.")
@click.option("--json", "as_json", is_flag=True, help="Print the standings as JSON.")
def ledger_show(ledger_url, at, half_life, config, capacity, as_json):
    """Each user's decayed usage, share and fair-share factor, highest priority first (Slurm's sshare).

    Usage counts once a workload's interval is recorded in the ledger."""
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.fairness_scheduler.errors import LedgerError, SchedulerOptionsError
    from kfp_pytorch.fairness_scheduler.ledger import UsageLedger
    from kfp_pytorch.fairness_scheduler.standing import (describe_half_life, format_standings, parse_capacity,
                                                         user_standings)
    from kfp_pytorch.fairness_scheduler.usage import format_time

    problems: list[str] = []
    t, hl = _ledger_time_and_half_life(at, half_life, problems)
    cfg = None
    try:
        raw, cfg = _read_scheduler_config(config)
        if hl is None and isinstance(raw, dict) and "half_life" in raw:
            hl = cfg.half_life  # the scheduler opens its ledger with the config's half-life
    except ConfigError as e:  # bad YAML or a bad field: listed with the other problems
        problems += e.problems
    cap, cap_problems = parse_capacity(capacity)
    problems += cap_problems
    if problems:
        raise SchedulerOptionsError(problems)
    led = UsageLedger(ledger_url, hl, must_exist=True)
    try:
        if led.compacted_before is not None and t < led.compacted_before:
            # the folded intervals survive only as aggregates as of the watermark: earlier usage is not
            # recorded any more, and showing the watermark's figures as if they were --at's would mislead
            wm = format_time(led.compacted_before)
            raise LedgerError(f"--at {format_time(t)} is before {wm}, up to which the ledger is compacted: the "
                              "intervals that ended by then survive only as usage totals as of that time",
                              f"ask for --at {wm} or later")
        rows = user_standings(led.usage(t), cfg, cap, t)
        n_open = led.intervals_count()
    finally:
        led.close()
    fs = cfg.fairshare
    if as_json:
        click.echo(json.dumps({"ledger": led.display_url, "at": t, "at_utc": format_time(t), "half_life_s": led.half_life,
                               "open_intervals": n_open, "compacted_before": led.compacted_before,
                               "capacity": {"gpu": cap.gpu, "cpu": cap.cpu, "memory_gb": cap.memory_gb},
                               "users": [r.to_json() for r in rows]}, indent=1))
        return
    compacted = (f"compacted up to {format_time(led.compacted_before)}" if led.compacted_before is not None
                 else "never compacted")
    header = [f"usage ledger {led.display_url} at {format_time(t)}: half-life {describe_half_life(led.half_life)}, "
              f"{n_open} interval{'' if n_open == 1 else 's'}, {compacted}",
              "usage share U counts GPU-seconds only (--capacity gpu=N,cpu=N,memory=N weighs CPU and memory too)"
              if not (cap.cpu or cap.memory_gb) else
              f"usage share U weighs each resource by the cluster's capacity: {cap.gpu:g} GPUs, {cap.cpu:g} CPUs, "
              f"{cap.memory_gb:g} GB",
              f"user prio = {fs.weight_fairshare:g}·F + {fs.weight_priority:g}·T; each job adds its age "
              f"(up to {fs.weight_age:g})"]
    if fs.current_weight:
        header.append(f"current_weight {fs.current_weight:g}: the scheduler also counts what users hold now; "
                      "the ledger has only recorded intervals, so F here counts that as 0")
    if not rows:
        header.append("no usage recorded and no users in the config")
    click.echo(format_standings(rows, header))


@ledger_grp.command("compact", short_help="Fold old usage intervals into decayed aggregates.")
@_ledger_options
@click.option("--older-than", "older_than", required=True, type=_said(
    "Say how old an interval must be to be folded: --older-than 30d (or 12h, or seconds)."),
              help="Fold intervals that ended at least this long before --at (30d, 12h, 1d12h, seconds).")
@click.option("--json", "as_json", is_flag=True, help="Print {folded, before, remaining} as JSON.")
def ledger_compact(ledger_url, at, half_life, older_than, as_json):
    """Fold old usage intervals into per-user decayed aggregates (one transaction).

    Usage stays exact; run-time estimates for backfilling come from the intervals that remain."""
    import time

    from kfp_pytorch.fairness_scheduler.errors import SchedulerOptionsError
    from kfp_pytorch.fairness_scheduler.ledger import UsageLedger
    from kfp_pytorch.fairness_scheduler.usage import format_time, parse_duration

    problems: list[str] = []
    t, hl = _ledger_time_and_half_life(at, half_life, problems)
    try:
        age = parse_duration(older_than)
        if not age >= 0:
            raise ValueError
    except ValueError:
        problems.append(f"--older-than: must be a duration >= 0 like 30d, 12h, 1d12h or seconds, got {older_than!r}")
    else:
        if t is not None and t - age > time.time():
            # compaction decays what it folds to its cut: a cut in the future would make the scheduler
            # under-count that usage until then
            problems.append(f"--at and --older-than: the cut, {format_time(t - age)}, is in the future; "
                            "compaction folds only intervals that have ended (leave --at at now)")
    if problems:
        raise SchedulerOptionsError(problems)
    led = UsageLedger(ledger_url, hl, must_exist=True)
    try:
        before = t - age
        folded = led.compact(before)
        left = led.intervals_count()
    finally:
        led.close()
    if as_json:
        click.echo(json.dumps({"folded": folded, "before": before, "remaining": left}))
    else:
        click.echo(f"folded {folded} interval{'' if folded == 1 else 's'} that ended by {format_time(before)} into per-user aggregates; "
                   f"{left} remain")
