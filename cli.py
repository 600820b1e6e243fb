"""``kfp-pytorch``: run, compile and list pipelines; manage local model servers.

Every user mistake ends in a one-paragraph error with the next step and a non-zero exit code
(2 for bad input), never a traceback; ``--debug`` shows the traceback for bug reports.
"""
import json
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path, PurePosixPath

import click
from click.core import ParameterSource

from kfp_pytorch.components.errors import KfpPytorchError
from kfp_pytorch.fairness_scheduler.model import PLACEMENTS


PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def _output_problem(path: str, option: str, suffixes: tuple[str, ...] | None = None) -> str | None:
    """Why ``path`` cannot be written, checked before any work is done (None if it can)."""
    import os
    from pathlib import Path

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if suffixes and p.suffix.lower() not in suffixes:
        return f"{option}: {path!r} must end in one of {', '.join(suffixes)}"
    if not parent.is_dir():
        return f"{option}: directory {str(parent)!r} does not exist (create it first)"
    if not os.access(parent, os.W_OK):
        return f"{option}: directory {str(parent)!r} is not writable"
    if p.is_dir():
        return f"{option}: {path!r} is a directory"
    return None


def _read_yaml(path: str, option: str):
    """A YAML file given on the command line; a syntax error names the option, file and line."""
    import yaml

    from kfp_pytorch.components.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except UnicodeDecodeError:
        raise ConfigError([f"{option} {path}: not UTF-8 text"], f"give {option} a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError([f"{option} {where}: not valid YAML ({getattr(e, 'problem', None) or e})"],
                          "fix the YAML syntax") from None


def _parse_params(pairs: tuple[str, ...]) -> dict[str, str]:
    from kfp_pytorch.components.errors import ConfigError

    out, bad = {}, []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            bad.append(f"--param {pair!r}: expected key=value")
        elif key.strip() in out and out[key.strip()] != value:  # which one was meant? not the last by luck
            bad.append(f"--param {key.strip()}: given twice ({out[key.strip()]!r} and {value!r}); give it once")
        else:
            out[key.strip()] = value
    if bad:
        raise ConfigError(bad, "write each parameter as --param key=value", title="invalid --param")
    return out


# Shell completion is click's: eval "$(_KFP_PYTORCH_COMPLETE=bash_source kfp-pytorch)" (or zsh_source,
# fish_source). The completers below read what they name when TAB is pressed, and never fail: a
# record they cannot read completes nothing rather than print a traceback into the shell.

_LOCAL_OR_URI = click.Path()
"""A local path or an s3://, minio://, sample:// URI: a plain string, completed as a file name."""


def _complete_pipeline(ctx, param, incomplete):
    from click.shell_completion import CompletionItem

    from kfp_pytorch.pipelines.registry import PIPELINES

    return [CompletionItem(name, help=entry.summary) for name, entry in PIPELINES.items()
            if name.startswith(incomplete)]


def _echo_columns(rows: list[tuple[str, ...]]) -> None:
    """``rows`` (the first: the header) in columns three spaces apart, each as wide as its widest
    cell, as kubectl get prints; the last column unpadded (a long URL or model path)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("   ".join(c.ljust(w) for c, w in zip(r, widths)) + "   " + r[-1])


def _examples(*lines: str) -> str:
    """A command's help epilog of example command lines, kept as written (click's \\b: no rewrapping)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def _said(missing, param_type: click.ParamType = click.STRING, name: str | None = None) -> click.ParamType:
    """A copy of ``param_type`` (text by default: taken as given, the command checks it) whose
    absence says what to give and where to find it, where click says only "Missing argument 'NAME'."
    ``missing``: the message, or a callable that makes it (called only then: a list of what there
    is). ``name``: the metavar's word in --help (URL rather than TEXT)."""
    import copy

    said = copy.copy(param_type)
    said.get_missing_message = lambda param, ctx: missing() if callable(missing) else missing
    if name:
        said.name = name
    return said


def _pipelines_said() -> str:
    from kfp_pytorch.pipelines.registry import PIPELINES

    return f"Name one of the pipelines: {', '.join(PIPELINES)} (kfp-pytorch pipelines lists them with their parameters)."


def _servers_said() -> str:
    from kfp_pytorch.components.serve import list_servers

    names = [s["name"] for s in list_servers()]
    if not names:
        return ("There are no local model servers here: a pipeline's serve step starts one "
                "(kfp-pytorch run train_and_serve --local).")
    return f"Name one of the local model servers: {', '.join(names)} (kfp-pytorch serve list shows them)."


_PIPELINE = _said(_pipelines_said)
_RUN_ID = _said("Give the KFP run's id: kfp-pytorch runs --host URL lists them, newest first "
                        "(the KFP UI shows it in the run's details).")
_SCHEDULE_NAME = _said("Give the recurring run's name: kfp-pytorch schedules --host URL lists them.")


def _complete_server(ctx, param, incomplete):
    """The local model servers' names (``serve start``: those that are down first), each with its state."""
    from click.shell_completion import CompletionItem

    from kfp_pytorch.components.serve import list_servers

    try:
        servers = [s for s in list_servers() if not s.get("unreadable") and s["name"].startswith(incomplete)]
    except Exception:  # noqa: BLE001 (a TAB press must not print a traceback)
        return []
    given = set(ctx.params.get("names") or ())
    servers = sorted((s for s in servers if s["name"] not in given),
                     key=lambda s: (ctx.command.name == "start" and bool(s["alive"]), s["name"]))
    return [CompletionItem(s["name"], help=f"{'up' if s['alive'] else 'down'} {s['infer_url']}") for s in servers]


def _complete_policies(ctx, param, incomplete):
    """``--policies a,b,<TAB>``: the policies not named yet, after those that are."""
    from click.shell_completion import CompletionItem

    from kfp_pytorch.fairness_scheduler.policy import POLICIES

    head, _, last = incomplete.rpartition(",")
    named = set(head.split(",")) if head else set()
    return [CompletionItem(f"{head},{p}" if head else p) for p in ["all", *POLICIES]
            if p.startswith(last) and p not in named and not (head and p == "all")]


class _PipelineParamsCommand(click.Command):
    """A command that takes pipeline parameters as ``--param KEY=VALUE`` (or ``-p``, as Argo's
    submit): an unknown option named as a parameter (``--epochs 3``, ``--batch-size=32``) is
    answered with the ``--param`` to write instead of click's bare "No such option"."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as e:
            if hint := _param_spelling(e.option_name, args):
                raise click.NoSuchOption(e.option_name, f"No such option '{e.option_name}'. {hint}", ctx=ctx) from None
            raise


def _param_spelling(option: str, args) -> str | None:
    """``pipeline parameters go as --param epochs=3`` when ``option`` (``--epochs``) names one."""
    from kfp_pytorch.pipelines.registry import PIPELINES

    name = option.lstrip("-").replace("-", "_")
    if not option.startswith("--") or name not in {p.name for e in PIPELINES.values() for p in e.params}:
        return None
    args = list(args)
    value = "VALUE"
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            value = arg.partition("=")[2]
            break
        if arg == option:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            break
    return (f"Pipeline parameters are given with --param: --param {name}={value} "
            "(kfp-pytorch pipelines lists them).")


class _SectionedGroup(click.Group):
    """The top-level help lists the commands by what they act on (this machine's runs, a KFP server,
    recurring runs, serving and storage, fair-share scheduling), as kubectl's and gh's do, each with
    a line that fits, rather than 18 names in alphabetical order cut off at "..."."""

    SECTIONS: dict[str, dict[str, str]] = {
        "Pipelines": {
            "pipelines": "List the pipelines and their parameters.",
            "run": "Run PIPELINE end-to-end on this machine (--local).",
            "runs": "List runs: this machine's (--local) or a KFP server's.",
        },
        "On a KFP server": {
            "compile": "Compile PIPELINE to KFP IR YAML (for the KFP UI).",
            "submit": "Upload PIPELINE, start a run and follow it.",
            "follow": "Follow a run until it ends.",
            "cancel": "Stop a run, as the KFP UI's Terminate does.",
            "manifest": "Print the Kubernetes manifest a cluster step would create.",
        },
        "Recurring runs": {
            "schedule": "Create a recurring run of PIPELINE (nightly retraining).",
            "schedules": "List them: cron, next run, the last run's state.",
            "pause-schedule": "Pause one (KFP starts no run of it).",
            "resume-schedule": "Resume a paused one.",
            "unschedule": "Delete one (the runs it started stay).",
        },
        "Serving and storage": {
            "serve": "Local model servers: list, start, stop, logs, predict.",
            "storage": "MinIO / S3: check, ls, cp, cat, mb, rb, rm.",
        },
        "Fair-share scheduling": {
            "simulate": "Replay a GPU-cluster trace under six scheduling policies.",
            "goals": "Judge the fairshare policy by issue #4's goals.",
            "ledger": "The usage ledger: each user's standing, compaction.",
        },
    }

    def resolve_command(self, ctx, args):
        """A subcommand given without its group (`kfp-pytorch predict`, `kfp-pytorch ls`) is named
        with it, where click would only say there is no such command."""
        name = args[0] if args else ""
        if name not in self.commands and not ctx.resilient_parsing:
            groups = [g for g, c in self.commands.items() if isinstance(c, click.Group) and name in c.commands]
            if groups:
                said = " or ".join(f"'{ctx.command_path} {g} {name}'" for g in groups)
                raise click.exceptions.NoSuchCommand(name, message=f"No such command {name!r}. Did you mean {said}?",
                                                     ctx=ctx)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx, formatter):
        listed = {name for section in self.SECTIONS.values() for name in section}
        sections = dict(self.SECTIONS)
        if other := {n: self.commands[n].get_short_help_str(60) for n in self.list_commands(ctx) if n not in listed}:
            sections["Other"] = other  # a command added without a line here is still listed
        width = max(len(n) for n in self.commands)  # one column for every section
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl([(name.ljust(width), line) for name, line in rows.items() if name in self.commands])


@click.group(cls=_SectionedGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="A command's options, and examples: kfp-pytorch COMMAND --help.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="kfp-pytorch")
@click.pass_context
def cli(ctx, debug):
    """PyTorch on Kubeflow Pipelines: components, pipelines, serving, fair-share scheduling."""
    ctx.obj = {"debug": debug}


@cli.command("pipelines")
@click.argument("names", nargs=-1, metavar="[PIPELINE]...", shell_complete=_complete_pipeline)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def pipelines_cmd(names, as_json):
    """List the pipelines and their parameters (those named, or all)."""
    from kfp_pytorch.pipelines import PIPELINES, get_pipeline

    chosen = {e.name: e for e in map(get_pipeline, names)} if names else PIPELINES  # an unknown name: its error
    if as_json:
        click.echo(json.dumps({n: {p.name: {"type": p.type.__name__, "default": p.default, "help": p.description}
                                   for p in e.params} for n, e in chosen.items()}, indent=1))
        return
    import shutil

    # a terminal gets the descriptions wrapped to its width; a pipe, one line per parameter for grep
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    for name, entry in chosen.items():
        click.secho(f"{name}", bold=True, nl=False)
        click.echo(f"  {entry.summary}")
        for line in _param_lines(entry.params, width):
            click.echo(line)


def _param_lines(params, width: int | None = None) -> list[str]:
    """One row per parameter: name, type, default, description; with ``width``, the description
    wrapped under itself (or, when the columns before it leave under 30 characters, on lines of
    its own below)."""
    import textwrap

    name_w = max(len(p.name) for p in params)
    default_w = max(len(repr(p.default)) for p in params)
    lines = []
    for p in params:
        head = f"  {p.name:<{name_w}} {p.type.__name__:<5} default={p.default!r:<{default_w}}  "
        if width is None or len(head) + len(p.description) <= width:
            lines.append(head + p.description)
        elif width - len(head) >= 30:
            lines += textwrap.wrap(p.description, width, initial_indent=head, subsequent_indent=" " * len(head))
        else:
            lines.append(head.rstrip())
            lines += textwrap.wrap(p.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def _platform_option(f):
    return click.option("--platform", "platform_file", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="YAML of Kubernetes settings for every step (S3 Secret and endpoint, MLflow server, "
                             "labels, GPU node selector/tolerations, Kueue queue and priority class).")(f)


def _with_platform(entry, platform_file: str | None):
    """``entry`` built with the platform file's Kubernetes settings (validated), and those settings."""
    import dataclasses

    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines.platform import load_platform

    if not platform_file:
        return entry, None
    if entry.build is None:
        raise ConfigError([f"pipeline {entry.name} takes no platform settings"])
    raw = _read_yaml(platform_file, "--platform")
    try:
        platform = load_platform(raw)
    except ConfigError as e:
        raise ConfigError(e.problems, e.hint, title=f"invalid platform settings in --platform {platform_file}") from None
    return dataclasses.replace(entry, func=entry.build(platform)), platform


@cli.command("compile", cls=_PipelineParamsCommand)
@click.argument("pipeline", type=_PIPELINE, shell_complete=_complete_pipeline)
@click.option("-o", "--output", required=True, type=_said(
              "Say where the KFP IR YAML goes: -o PIPELINE.yaml (to upload in the KFP UI), or -o - for stdout.",
              click.Path(dir_okay=False, allow_dash=True)),
              help="KFP IR YAML file to write ('-': stdout).")
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="A parameter's default in the compiled pipeline, as the KFP UI's run form shows it "
                   "(repeatable; checked as run and submit check it).")
@_platform_option
def compile_cmd(pipeline, output, params, platform_file):
    """Compile PIPELINE to KFP IR YAML (upload it in the KFP UI or with `kfp-pytorch submit`)."""
    from kfp import compiler

    from kfp_pytorch.components._kfp import check_component_image
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines import get_pipeline

    # KFP writes .json too, but deprecated and without platform (Kubernetes) settings: YAML only.
    if output != "-" and (problem := _output_problem(output, "-o/--output", (".yaml", ".yml"))):
        raise ConfigError([problem], "give a writable KFP IR file path, e.g. -o pipeline.yaml (or -o - for stdout)")
    entry = get_pipeline(pipeline)
    values = _resolve_params(entry, params)
    entry, platform = _with_platform(entry, platform_file)
    check_component_image()
    _before_submit(values, platform, notes=False)  # it runs on a KFP server, as a submitted one does
    given = {k: values[k] for k in _parse_params(params)}  # only these: the others keep the pipeline's defaults
    defaults = f" (defaults: {', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""
    if output == "-":  # KFP's compiler writes files only: through one, then the YAML alone on stdout
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "pipeline.yaml")
            compiler.Compiler().compile(entry.func, package_path=path, pipeline_parameters=given or None)
            click.echo(Path(path).read_text(), nl=False)
        if defaults:
            click.echo(f"compiled{defaults}", err=True)
        return
    compiler.Compiler().compile(entry.func, package_path=output, pipeline_parameters=given or None)
    click.echo(f"wrote {output}{defaults}")


def _before_submit(values: dict, platform, notes: bool = True) -> None:
    """Notes on a run bound for a KFP server whose results would not outlive its pods; and, before
    anything is sent, what its serve step would refuse in the platform's KServe mode. Without
    ``notes`` (compile: the values are defaults the run form can change), only the refusals."""
    uri = values.get("dataset_uri") or ""
    if uri and not uri.startswith(("s3://", "minio://", "sample://")):  # read by the prepare step's pod
        from pathlib import Path

        from kfp_pytorch.components.errors import ConfigError
        from kfp_pytorch.components.storage import parse_uri

        path = parse_uri(uri).path
        if path.exists():  # a table on this machine, which no pod of the cluster can read
            raise ConfigError([f"dataset_uri: {uri} is on this machine; the KFP server's pods cannot read it"],
                              f"upload it: `kfp-pytorch storage cp {uri} s3://BUCKET/datasets/` and pass "
                              f"--param dataset_uri=s3://BUCKET/datasets/{Path(path).name}",
                              title="invalid parameters")
        if notes:
            click.echo(f"note: dataset_uri {uri} is a path: the prepare step's pod reads it from its own file "
                       "system (the component image); a table on your machine must be uploaded first "
                       "(`kfp-pytorch storage cp`)", err=True)
    if values.get("serve_backend") == "cluster":
        from kfp_pytorch.components.cluster import serving_mode_problems
        from kfp_pytorch.components.errors import ConfigError

        raw = (platform.serving_mode if platform else "RawDeployment") == "RawDeployment"
        canary = values.get("canary_traffic_percent", -1)
        problems = serving_mode_problems(canary if canary >= 0 else None, values.get("serve_min_replicas", 1),
                                         values.get("serve_max_replicas", 1), raw,
                                         names=("serve_min_replicas", "serve_max_replicas"))
        if problems:
            raise ConfigError(problems, "the serve step would refuse these in KServe's "
                                        f"{'RawDeployment' if raw else 'Serverless'} mode", title="invalid parameters")
    from kfp_pytorch.components.cluster import S3Access, loopback_note

    mlflow, minio = "http://mlflow.kubeflow:5000", S3Access.endpoint  # the platform file's example, KFP's MinIO
    for url, what, instead in ((values.get("tracking_uri") if notes else "", "tracking_uri", mlflow),
                               (platform.mlflow_tracking_uri if platform else "", "--platform's mlflow_tracking_uri", mlflow),
                               (platform.s3_endpoint if platform else "", "--platform's s3_endpoint", minio)):
        if url and (note := loopback_note(url, what, instead)):
            click.echo(f"note: {note}", err=True)
    if notes and "tracking_uri" in values and not values["tracking_uri"] and not (platform and platform.mlflow_tracking_uri):
        click.echo("note: tracking_uri is empty: each step's pod would keep its MLflow runs and the registered model "
                   "in an embedded sqlite store that goes with the pod; pass --param tracking_uri=http://MLFLOW:5000 "
                   "or set mlflow_tracking_uri in --platform (unless the pods' environment sets MLFLOW_TRACKING_URI)",
                   err=True)


@cli.command("run", cls=_PipelineParamsCommand, epilog=_examples(
    "kfp-pytorch run train_and_serve --local",
    "kfp-pytorch run train_and_serve --local -p epochs=5 -p workers=2",
    "kfp-pytorch run train_and_serve --local --param dataset_uri=iris.csv --param label_column=species",
    "kfp-pytorch run train_and_serve --local --json | jq .metrics",
    "kfp-pytorch run train_and_serve --local --json | jq -e .gate_passed   # exit 1 when the gate failed") + (
    "\n\nExit status: 0 when every step ran, the gate passed or not (its line in the summary says which, "
    "as gate_passed in --json); 1 when a step failed, or a server the run needs (S3, MLflow) cannot be used; 2 for "
    "bad options or parameters, or a dataset that is not there or does not validate; 130 on Ctrl-C."))
@click.argument("pipeline", type=_PIPELINE, shell_complete=_complete_pipeline)
@click.option("--local", "local", is_flag=True, help="Run on this machine with kfp.local (required: a KFP server "
                                                     "runs PIPELINE through `submit --host URL`).")
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Pipeline parameter (repeatable; kfp-pytorch pipelines lists them).")
@click.option("--predict/--no-predict", default=True, help="Send one test row to the endpoint at the end.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as JSON, alone on stdout (the steps' lines go to stderr).")
@click.option("-v", "--verbose", is_flag=True,
              help="Show kfp.local's whole log as it runs: each step's executor input and outputs too (the run "
                   "keeps it as run.log either way).")
def run_cmd(pipeline, local, params, predict, as_json, verbose):
    """Run PIPELINE end-to-end (--local: kfp.local, local DDP workers, local model server)."""
    if not local:  # spelled out, so that nobody reads `run` as the way to a cluster and looks for its --host
        raise click.UsageError(f"run runs a pipeline on this machine: add --local. To run it on a KFP server: "
                               f"kfp-pytorch submit {pipeline} --host URL (or export KFP_HOST)")
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.components.evaluate import gate_note
    from kfp_pytorch.pipelines.local import gate_advice, pile_note, preflight, run_local, summarize

    entry = get_pipeline(pipeline)
    values = _resolve_params(entry, params)
    preflight(values)
    # with --json, stdout is the summary alone (`| jq` reads it); the steps' lines go to stderr
    run = run_local(entry, values, verbose=verbose, out=sys.stderr if as_json else None)
    summary = summarize(run)
    if "gate_passed" in summary:  # what the gate read, for the summary's gate line
        summary["gate"] = {"metric": values.get("gate_metric", "accuracy"), "threshold": values["threshold"]}
        if advice := gate_advice(values, summary):
            summary["gate"]["advice"] = advice
    if run.succeeded and predict and summary.get("server_url"):
        summary["prediction"] = _predict_sample(summary, values)
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        _print_summary(summary)
    for note in summary.get("notes", []):  # the steps' notes, once more where the run's outcome is read
        click.echo(note, err=True)
    confusion = summary.get("confusion", {})
    if "gate_passed" in summary and (why := gate_note({**summary["gate"], "passed": summary["gate_passed"]},
                                                      {**summary.get("metrics", {}),
                                                       **({"confusion_matrix": confusion["rows"]} if confusion else {})},
                                                      confusion.get("classes"))):
        click.echo(f"note: {why}", err=True)
    if note := pile_note():
        click.echo(f"note: {note}", err=True)
    if not run.succeeded:
        sys.exit(1)


def _resolve_params(entry, params) -> dict:
    """The pipeline's parameters from ``--param`` strings, validated; a note on stderr for each given
    parameter that the chosen backends will not read."""
    raw = _parse_params(params)
    values = entry.resolve(raw)
    for note in entry.inert_notes(raw, values):
        click.echo(f"note: {note}", err=True)
    return values


def _predict_sample(summary: dict, values: dict) -> dict:
    """One real test row, raw features, over HTTP; the true label for comparison."""
    from kfp_pytorch.components.prepare_data import load_split
    from kfp_pytorch.components.serve import infer

    data_uri = summary["artifacts"].get("prepare-data-op.dataset")
    x, y = load_split(data_uri, "test")
    from kfp_pytorch.components.prepare_data import read_metadata

    meta = read_metadata(data_uri)
    import numpy as np

    raw = x[:1] * np.asarray(meta["normalization"]["std"]) + np.asarray(meta["normalization"]["mean"])
    resp = infer(summary["server_url"], values["model_name"], raw.tolist())
    out = {o["name"]: o["data"] for o in resp["outputs"]}
    names = meta.get("class_names")
    return {"label": out["class"][0] if "class" in out else int(out["label"][0]),
            "true_label": names[int(y[0])] if names else int(y[0]), "confidence": round(max(out["probabilities"]), 4)}


def _weakest_line(w: dict, rows: str = "rows") -> str:
    """``class 8, recall 0.8846 (23 of 26 test rows); 2 taken for 1``: a class id as it is, a name quoted."""
    def shown(c):
        return c if c.isdigit() else repr(c)

    return (f"class {shown(w['class'])}, recall {w['recall']:.4f} ({w['correct']} of {w['rows']} {rows}); "
            f"{w['taken_rows']} taken for {shown(w['taken_for'])}")


def _counted_classes(classes, shown: int = 6) -> str:
    """``'cat' (12 rows), 3 (4 rows)`` of {class: rows}, or ``'cat', 'dog'`` of a list: an id as it
    is, a name quoted, as :func:`_weakest_line` shows them; the first ``shown``, then how many more."""
    def one(c):
        name = c if c.lstrip("-").isdigit() else repr(c)
        return f"{name} ({classes[c]} row{'s' if classes[c] != 1 else ''})" if isinstance(classes, dict) else name

    items = list(classes)
    return ", ".join(map(one, items[:shown])) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _print_summary(s: dict) -> None:
    ok = s["status"] == "SUCCEEDED"
    click.echo("")
    click.secho(f"== {s['pipeline']}: {s['status']} ==", bold=True, fg="green" if ok else "red")
    if s.get("failed_task"):
        click.echo(f"failed task: {s['failed_task']} (its log is above, whole in the run's log; partial outputs "
                   "removed)")
        if s.get("error"):
            click.secho("\n".join(f"  {line}" for line in s["error"].splitlines()), fg="red")
    if "data" in s:
        from kfp_pytorch.components.prepare_data import duplicates_note

        d, rows = s["data"], s["data"]["rows"]
        click.echo(f"data:      {rows['train']}/{rows['val']}/{rows['test']} rows (train/val/test), "
                   f"{d.get('num_features')} feature{'' if d.get('num_features') == 1 else 's'}, {len(d.get('classes', []))} classes"
                   + (f"; read as {d['source_format']}" if d.get("source_format") else ""))
        if note := duplicates_note(d.get("duplicates", {}), rows):
            click.secho(f"  warning: {note}", fg="yellow")
    if "training" in s:
        t = s["training"]
        click.echo(f"training:  {t['epochs_trained']} epoch(s)" + (
            f", stopped early; the model is epoch {t['exported_epoch']}'s, the best on validation"
            if t["exported_epoch"] != t["epochs_trained"] else ""))
    if "metrics" in s:
        m = s["metrics"]
        shown = []
        for k, v in m.items():
            if k in ("test_rows", "gate_passed", "accuracy_ci95_low", "accuracy_ci95_high"):
                continue
            ci = (f" (95% {m['accuracy_ci95_low']:.3f}-{m['accuracy_ci95_high']:.3f} on {int(m['test_rows'])} test rows)"
                  if k == "accuracy" and "accuracy_ci95_low" in m and "test_rows" in m else "")
            shown.append(f"{k}={v:.4f}{ci}")
        click.echo("metrics:   " + ", ".join(shown))
    if "weakest_class" in s:
        click.echo(f"weakest:   {_weakest_line(s['weakest_class'], 'test rows')}")
    if "gate_passed" in s:
        g, value = s.get("gate", {}), s.get("metrics", {}).get(s.get("gate", {}).get("metric"))
        read = (f" ({g['metric']} {value:.4f} {'>=' if s['gate_passed'] else '<'} threshold {g['threshold']:.4f})"
                if value is not None else "")
        click.echo(f"gate:      {'passed' if s['gate_passed'] else 'FAILED'}{read}"
                   + ("" if s["gate_passed"] else ": the model was neither registered nor served"))
        if g.get("advice"):
            click.echo(f"next:      {g['advice']}")
    if "model" in s:
        m = s["model"]
        click.echo(f"model:     {m['registry_uri']} (version {m['version']}, champion={m['champion']})")
    if "endpoint" in s:
        click.echo(f"endpoint:  {s['endpoint']}")
    elif "not_served" in s:
        click.echo(f"serve:     skipped: {s['not_served']}; `kfp-pytorch serve list` shows what serves")
    click.echo("artifacts:")
    for k, v in s.get("artifacts", {}).items():
        click.echo(f"  {k:<28} {v}")
    if s.get("log"):
        click.echo(f"log:       {s['log']} (every step's whole log; --verbose shows it as it runs)")
    if "prediction" in s:
        p = s["prediction"]
        click.secho(f"prediction served over HTTP: label {p['label']} (true label {p['true_label']}, "
                    f"confidence {p['confidence']:.3f})", bold=True)
    if s.get("endpoint") and "/v2/models/" in s["endpoint"]:
        name = s["endpoint"].split("/v2/models/")[1].split("/")[0]
        click.echo(f"predict a table with:  kfp-pytorch serve predict {name} TABLE.csv")
        click.echo(f"stop the server with:  kfp-pytorch serve stop {name}")


@cli.group("serve")
def serve_grp():
    """Local model servers started by the serve step."""


@serve_grp.command("list", short_help="Each local model server: name, pid, status, URL, model.")
@click.option("--json", "as_json", is_flag=True, help="Print the servers' records as JSON.")
def serve_list(as_json):
    """Each local model server: name, pid, up (for how long) or down, its inference URL and the model it serves."""
    import time

    from kfp_pytorch.components.serve import list_servers
    from kfp_pytorch.fairness_scheduler.usage import format_duration

    servers = list_servers()
    now = time.time()
    for s in servers:  # how long it has served, as kubectl's AGE (the record keeps its process's start)
        s["uptime_s"] = round(now - s["create_time"], 1) if s.get("alive") and s.get("create_time") else None
    if as_json:
        click.echo(json.dumps(servers, indent=1, default=str))
        return
    if not servers:
        click.echo("no local model servers")
        return
    rows = [("NAME", "PID", "STATUS", "URL", "MODEL")]  # a header over the columns, as kubectl get's
    for s in servers:
        state = ("?" if s.get("unreadable") else "down" if not s["alive"]
                 else f"up {format_duration(s['uptime_s'])}" if s["uptime_s"] is not None else "up")
        model = s.get("model_uri") or "-"
        if s.get("registered_model"):  # which registered version serves, and where its files are
            model = f"{s['registered_model']} ({s['model_uri']})"
        rows.append((s["name"], str(s["pid"] or "-"), state, s["infer_url"], model))
    _echo_columns(rows)
    if down := [s["name"] for s in servers if not s.get("alive") and not s.get("unreadable")]:
        click.echo(f"{len(down)} down: `kfp-pytorch serve start {' '.join(down)}` starts "
                   f"{'it' if len(down) == 1 else 'them'} again with {'its' if len(down) == 1 else 'their'} model; "
                   "`serve stop` removes the record")


def _names_or_all(verb: str, both: bool) -> str:
    """``serve stop|start`` with neither names nor --all (or both): which servers there are to name."""
    from kfp_pytorch.components.serve import list_servers

    if both:
        return f"give the names of the servers to {verb}, or --all, not both"
    servers = [s for s in list_servers() if not s.get("unreadable")]
    up = [s["name"] for s in servers if s["alive"]]
    down = [s["name"] for s in servers if not s["alive"]]
    if not servers:
        return f"give the names of the servers to {verb}, or --all; there are no local model servers here"
    if verb == "start" and not down:
        return f"give the names of the servers to {verb}, or --all; every local model server is up ({', '.join(up)})"
    listed = "; ".join(f"{state}: {', '.join(names)}" for state, names in (("down", down), ("up", up))
                       if names and (verb == "stop" or state == "down"))
    return f"give the names of the servers to {verb} ({listed}), or --all"


@serve_grp.command("stop", short_help="Stop local model servers (NAMES, or --all).")
@click.argument("names", nargs=-1, shell_complete=_complete_server)
@click.option("--all", "stop_all", is_flag=True, help="Stop every local model server.")
def serve_stop(names, stop_all):
    """Stop the local model servers NAMES (see serve list), or --all; a server that is down has its
    record removed."""
    from kfp_pytorch.components.errors import ServingError
    from kfp_pytorch.components.serve import list_servers, stop_server, unknown_server

    if stop_all == bool(names):
        raise click.UsageError(_names_or_all("stop", both=stop_all))
    names = names or [s["name"] for s in list_servers()]
    if not names:
        click.echo("no local model servers")
    missing = []
    for name in names:
        if stop_server(name):
            click.echo(f"stopped {name}")
        else:
            missing.append(name)
    if missing:
        raise ServingError(unknown_server(missing), "`kfp-pytorch serve list` names the servers")


@serve_grp.command("start", short_help="Start local model servers again (down after a reboot).")
@click.argument("names", nargs=-1, shell_complete=_complete_server)
@click.option("--all", "start_all", is_flag=True, help="Every local model server that is down.")
@click.option("--port", type=click.IntRange(0, 65535), default=0,
              help="Port for a server whose old port is taken (0: a free one).  [default: its old port]")
@click.option("--model-uri", default=None, metavar="URI",
              help="Serve this model as NAME instead: a version from the MLflow registry (models:/MODEL/VERSION, "
                   "models:/MODEL@champion), or a model directory (a path or s3://, as a run's train-op.model). "
                   "A server already up under NAME keeps serving until the new one has passed its smoke test "
                   "(a rollback), which then takes over its URL (unless --port names another port).")
@click.option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", default=None,
              help="With a models:/ URI: the MLflow registry (or MLFLOW_TRACKING_URI; default: the embedded "
                   "sqlite store that run --local registers into).")
def serve_start(names, start_all, port, model_uri, tracking_uri):
    """Start the local model servers NAMES again (down after a reboot or a crash; see serve list):
    the model each served, on its old port when that is free, smoke-tested before it is listed up.
    With --model-uri, serve that model as NAME: a registered version, or an older run's model."""
    from urllib.parse import urlsplit

    from kfp_pytorch.components.errors import ServingError
    from kfp_pytorch.components.serve import list_servers, revive, server_status

    if model_uri is not None:
        return _serve_model_as(names, start_all, port, model_uri, tracking_uri)
    if tracking_uri is not None and click.get_current_context().get_parameter_source(
            "tracking_uri") != ParameterSource.ENVIRONMENT:
        raise click.UsageError("--tracking-uri reads a models:/ URI: give it with --model-uri")
    if start_all == bool(names):
        raise click.UsageError(_names_or_all("start", both=start_all))
    if start_all:
        names = [s["name"] for s in list_servers() if not s.get("alive") and not s.get("unreadable")]
        if not names:
            click.echo("every local model server is up" if list_servers() else "no local model servers")
    failed = []
    for name in names:
        old_port = urlsplit((server_status(name) or {}).get("url") or "").port
        try:
            with _port_flag_hint():
                ep, started = revive(name, port)
        except KfpPytorchError as e:  # (a model gone, a port taken) the others still start; each failure is told
            click.secho(f"{name}: {e}", fg="red", err=True)
            failed.append(name)
            continue
        moved = (f" (its old port {old_port} is taken by another process: clients of the old URL must change)"
                 if started and not port and old_port and urlsplit(ep.url).port != old_port else "")
        click.echo(f"{name}: {'started' if started else 'already up'} at {ep.infer_url} (pid {ep.pid}){moved}")
    if failed:
        raise ServingError(f"could not start {', '.join(map(repr, failed))}", "see each server's error above")


@contextmanager
def _port_flag_hint():
    """A taken port's hint in the words of the command line (--port 0), not of the Python API (port=0)."""
    from kfp_pytorch.components.errors import PortInUseError

    try:
        yield
    except PortInUseError as e:
        e.hint = "give another --port (--port 0: a free one), or stop the process using it"
        raise


def _serve_model_as(names, start_all, port, model_uri, tracking_uri) -> None:
    """``serve start NAME --model-uri URI``: a registered version (downloaded once under
    KFP_PYTORCH_HOME/registry_models) or a model directory, served as NAME and smoke-tested."""
    from kfp_pytorch.components.serve import ServeSpec, serve
    from kfp_pytorch.components.storage import Storage, join

    if start_all or len(names) != 1:
        raise click.UsageError("--model-uri serves one model: give one NAME (the endpoint's name), not --all")
    [name] = names
    ServeSpec(model_uri, name, port=port).validate()  # a bad name before any download
    what = model_uri
    if model_uri.startswith("models:"):
        from kfp_pytorch.components.tracking import Tracker

        got = Tracker(tracking_uri, experiment=None).fetch_model(model_uri)
        what = f"models:/{got['name']}/{got['version']}" + (f" (@{got['alias']})" if got["alias"] else "")
        model_dir = str(got["model_dir"])
    else:
        model_dir = model_uri
        if not Storage().exists(join(model_dir, "metadata.json")):
            from kfp_pytorch.components.errors import ServingError

            raise ServingError(f"{model_uri} is not a model directory (it has no metadata.json)",
                               "give a run's train-op.model directory (`kfp-pytorch runs --local` lists the runs), "
                               "or a registered version: models:/MODEL/VERSION")
    with _port_flag_hint():
        ep = serve(ServeSpec(model_dir, name, port=port, registered_model=(
            f"models:/{got['name']}/{got['version']}" if model_uri.startswith("models:") else "")))
    before = ep.replaced  # read under the deploy's lock: a deploy of NAME beside this one came first
    replaced = (f"; it replaced the server of {before.get('registered_model') or before['model_uri']} at "
                f"{before['infer_url']}" if before and before.get("model_uri") else "")
    click.echo(f"{name}: serving {what} at {ep.infer_url} (pid {ep.pid}){replaced}")


@serve_grp.command("logs", short_help="Print a local model server's log (-f follows it).")
@click.argument("name", type=_said(_servers_said), shell_complete=_complete_server)
@click.option("--tail", type=click.IntRange(0), default=None, help="Only the last N lines.")
@click.option("-p", "--previous", is_flag=True,
              help="The log of the server it replaced: the one that died, or the model served before.")
@click.option("-f", "--follow", is_flag=True,
              help="Go on printing as the log grows, through a redeploy, until the server stops (or Ctrl-C).")
def serve_logs(name, tail, previous, follow):
    """Print the log of the local model server NAME (see serve list), as kubectl logs does a pod's."""
    import collections

    from kfp_pytorch.components.errors import ServingError
    from kfp_pytorch.components.serve import follow_log, server_log, server_status, unknown_server

    if follow and previous:
        raise click.UsageError("--previous is the log of a server that is gone: it does not grow; leave out --follow")
    path = server_log(name, previous)
    if not path.exists():
        what = "log of an earlier server" if previous else "log"
        known = server_status(name) is not None
        raise ServingError(f"no {what} for the local model server {name!r} ({path})" if known
                           else unknown_server(name, f"no {what} for a local model server named {name!r} ({path})"),
                           "`kfp-pytorch serve list` names the servers" + (
                               "; --previous is kept once a server was started again or replaced" if previous
                               and known else ""))
    if follow:
        try:
            for kind, text in follow_log(name, tail):
                if kind == "log":
                    click.echo(text, nl=False)
                    sys.stdout.flush()
                else:
                    click.echo(f"kfp-pytorch: {text}", err=True)
        except KeyboardInterrupt:  # how one stops following: no "Aborted."
            pass
        return
    with open(path, errors="replace") as f:
        lines = collections.deque(f, maxlen=tail) if tail is not None else f.readlines()
    text = "".join(lines)
    click.echo(text, nl=bool(text) and not text.endswith("\n"))


@serve_grp.command("predict", short_help="Predict each row of a table with a local model server.", epilog=_examples(
    "kfp-pytorch serve predict digits rows.csv -o predictions.csv",
    "kfp-pytorch serve predict digits s3://datasets/new.parquet --probabilities -o s3://results/new.parquet",
    "kfp-pytorch serve predict digits rows.csv --url http://digits.kubeflow-user.example.com --token TOKEN",
    "cat rows.csv | kfp-pytorch serve predict digits -"))
@click.argument("name", type=_said(_servers_said), shell_complete=_complete_server)
@click.argument("table", type=_said("Give the table to predict: a CSV, Parquet, JSON Lines or Feather file, "
                                     "s3://BUCKET/KEY, or '-' for a CSV on stdin.", _LOCAL_OR_URI))
@click.option("--url", default=None,
              help="The server's base URL, for one not started here (a KServe InferenceService's status.url; a model's .../v2/models/NAME/infer endpoint is taken too).")
@click.option("--model-uri", default=None,
              help="The model directory, for its feature names and label column, or a registered version "
                   "(models:/MODEL/VERSION, models:/MODEL@champion, from MLFLOW_TRACKING_URI's registry, else the "
                   "embedded one) (default: a local server's record; with --url, the features the server's model "
                   "metadata declares).")
@click.option("--host-header", default=None,
              help="With --url pointing at the ingress gateway: the InferenceService's host (its status.url's).")
@click.option("--token", envvar="KFP_PYTORCH_SERVE_TOKEN", default=None,
              help="With --url: a bearer token for a gateway that authenticates (or KFP_PYTORCH_SERVE_TOKEN).")
@click.option("--label-column", default=None,
              help="Compared with the predictions when present; never sent. Default: the column the model "
                   "was trained to predict (its metadata's), else 'label'.")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(1, 65536),
              help="Rows sent in each inference request.")
@click.option("--probabilities", is_flag=True,
              help="Add each class's probability as a column p_<class> (its name where the model's metadata is "
                   "known: a local server, or --model-uri; else its id).")
@click.option("-o", "--output", metavar="FILE|URI", default=None, type=_LOCAL_OR_URI,
              help="Write the predictions here: a file, or s3://BUCKET/KEY, as CSV or, by the name's suffix, "
                   "Parquet, JSON Lines (.jsonl), JSON or Feather (default, or '-': CSV on stdout).")
def serve_predict(name, table, url, model_uri, host_header, token, label_column, batch_size, probabilities, output):
    """Predict every row of TABLE (CSV, Parquet, JSON Lines or Feather: a path, s3://..., sample://digits, or '-' for a
    CSV on stdin) with the
    model server NAME, and write row, prediction, confidence (and the row's label) as CSV (or, by
    -o's suffix, Parquet, JSON Lines, JSON or Feather)."""
    from kfp_pytorch.components.batch_predict import predict_table, resolve_target, table_bytes, weakest_label
    from kfp_pytorch.components.prepare_data import load_table

    output = None if output == "-" else output  # '-': stdout, as click's File type and most tools read it
    to_s3 = output is not None and _check_predictions_output(output)  # before any row is sent
    target = resolve_target(name, url, model_uri, host_header, token)
    frame = _stdin_table() if table == "-" else load_table(table, label_column=label_column or "label", what="TABLE")
    show = sys.stderr.isatty() and len(frame) > batch_size
    with click.progressbar(length=len(frame), label="predicting", file=sys.stderr) if show else nullcontext() as bar:
        result = predict_table(target, frame, label_column, source="stdin" if table == "-" else table,
                               batch_size=batch_size,
                               on_batch=bar.update if bar is not None else None, probabilities=probabilities)
    preds, accuracy, label_column = result.frame, result.accuracy, result.label_column
    if to_s3:
        from kfp_pytorch.components.storage import Storage

        Storage().write_bytes(output, *table_bytes(preds, output))
    elif output:
        Path(output).write_bytes(table_bytes(preds, output)[0])
    else:
        click.echo(preds.to_csv(index=False), nl=False)
    note = f"{len(preds)} rows predicted by {target.name} at {target.url}"
    unknown = result.unknown_labels
    if accuracy is not None:
        unlabelled = int(preds["label"].isna().sum())
        note += f"; accuracy against {label_column!r}: {accuracy:.4f}" + (
            f" on the {len(preds) - unlabelled} labelled rows ({unlabelled} without a label)" if unlabelled else "")
        if w := weakest_label(preds):
            note += f"; weakest: {_weakest_line(w)}"
        if unknown:
            note += (f"; {sum(unknown.values())} row(s) have a label that is no class of the model, which no "
                     f"prediction can match: {_counted_classes(unknown)}")
    elif unknown:  # 0 would be a score of the names, not of the model
        note += (f"; not scored: no {label_column!r} in the table is a class of the model (the table's: "
                 f"{_counted_classes(unknown)}; the model's: {_counted_classes(result.model_classes)}); "
                 "write the labels as the model names its classes")
    elif "label" in preds:
        note += f"; no row has a {label_column!r} to score against"
    click.echo(note + (f"; written to {output}" if output else ""), err=True)


def _stdin_table():
    """TABLE '-': a CSV piped in (`export_rows | kfp-pytorch serve predict NAME -`), as storage cp reads '-'."""
    import pandas as pd

    from kfp_pytorch.components.errors import DatasetError

    hint = "pipe a CSV with a header row (another format: give its file's path as TABLE)"
    if sys.stdin.isatty():  # nothing piped in: it would wait for typed rows
        raise click.UsageError("TABLE '-' reads a CSV from stdin: pipe one in, e.g. "
                               "`cat rows.csv | kfp-pytorch serve predict NAME -`, or give the file's path")
    try:
        return pd.read_csv(sys.stdin.buffer).rename(columns=str)
    except pd.errors.EmptyDataError:
        raise DatasetError("stdin holds no table (nothing was piped in)", hint) from None
    except Exception as e:  # pandas raises many types for unparsable input
        raise DatasetError(f"cannot parse stdin as CSV: {str(e).strip()}", hint) from e


def _check_predictions_output(output: str) -> bool:
    """Refuse an -o that cannot take the predictions, before the server is asked for any; True if
    it is an S3 object."""
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.components.storage import Storage, parse_uri

    loc = parse_uri(output)
    if not loc.is_s3:
        if problem := _output_problem(output, "-o/--output"):
            raise ConfigError([problem], "give a file path in a folder that exists, s3://BUCKET/KEY, or leave -o "
                                         "out for stdout")
        return False
    if not loc.key or loc.key.endswith("/"):
        raise ConfigError([f"-o/--output: {output!r} names no object"], f"give the object's key, e.g. "
                                                                          f"s3://{loc.bucket}/predictions.csv")
    _need_bucket(Storage(), output, "-o/--output")
    return True


def _need_bucket(storage, uri: str, what: str) -> None:
    """Refuse to write where there is no bucket. MinIO and AWS say NoSuchBucket only after the data
    was sent, and SeaweedFS (KFP's default store) makes the bucket on the first PUT, so a typo in the
    bucket's name would leave the data in a new bucket that nothing reads (mc cp refuses, too)."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import parse_uri

    if not storage.bucket_exists(uri):
        bucket = parse_uri(uri).bucket
        raise StorageNotFound(f"{what}: there is no bucket {bucket!r}",
                              f"create it: `kfp-pytorch storage mb s3://{bucket}` (or check the name: "
                              "`kfp-pytorch storage ls` lists the buckets)")


@cli.group("storage")
def storage_grp():
    """Object storage (MinIO / S3) as configured by AWS_ENDPOINT_URL and credentials."""


@storage_grp.command("ls", short_help="List the buckets, or the objects under a prefix.")
@click.argument("uri", required=False, type=_LOCAL_OR_URI)
@click.option("-l", "--long", "long_", is_flag=True,
              help="Each object's last-modified time (UTC) and size too, and the count and total size at the end.")
@click.option("-r", "--recursive", is_flag=True, help="Every object below URI, in its folders too.")
def storage_ls(uri, long_, recursive):
    """The objects and folders (ending in /) right under URI (s3://BUCKET/PREFIX, minio:// or a local
    path), one per line, as `mc ls` and `aws s3 ls` list them; -r: every object below it. Without URI
    (or with s3://), the buckets."""
    from kfp_pytorch.components.storage import Storage, parse_uri

    storage = Storage()
    if uri is None or uri.rstrip("/") in ("s3:", "minio:"):
        buckets = storage.buckets()
        if not buckets:
            click.echo("no buckets (`kfp-pytorch storage mb s3://NAME` makes one)", err=True)
            sys.exit(1)
        for b in buckets:  # as `aws s3 ls`: the creation time, then the name
            click.echo(f"{b.modified:%Y-%m-%d %H:%M:%S}  {b.uri}" if long_ else b.uri)
        return
    # one level by default: a pipeline root holds every run's every file, thousands of lines at once
    found = storage.entries(uri, recursive=recursive)
    loc = parse_uri(uri)
    if not found and (loc.key if loc.is_s3 else loc.path.is_file()) and (entry := storage.stat(uri)):
        found = [entry]  # an object itself, as `aws s3 ls s3://b/file` shows it
    if not found:  # as `aws s3 ls`: an empty answer is not a success a script should read on
        click.echo(f"nothing under {uri}", err=True)
        sys.exit(1)
    if not long_:
        for e in found:
            click.echo(e.uri)
        return
    objects = [e for e in found if not e.is_folder]
    sizes = ["DIR" if e.is_folder else _size(e.size) for e in found]
    width = max(map(len, sizes))
    for e, size in zip(found, sizes):  # as `aws s3 ls`: time, size, name; the names stay last for a script's cut
        click.echo(f"{'' if e.is_folder else f'{e.modified:%Y-%m-%d %H:%M:%S}':19}  {size:>{width}}  {e.uri}")
    folders = len(found) - len(objects)
    click.echo(f"{len(objects)} object(s), {_size(sum(e.size for e in objects))}"
               + (f"; {folders} folder(s) (-r lists what is in them too)" if folders else ""), err=True)


def _ls_hint(uri: str) -> str:
    """Where to look for what a URI with nothing under it meant: the folder above it."""
    from kfp_pytorch.components.storage import parse_uri

    loc = parse_uri(uri)
    parent = loc.key.rstrip("/").rpartition("/")[0]
    return f"`kfp-pytorch storage ls s3://{loc.bucket}/{parent + '/' if parent else ''}` lists what is there"


def _bytes_bar(total: int, label: str):
    """A bar of the bytes a copy has moved, on stderr when that is a terminal (none in a log or a pipe);
    it is gone when the copy is done, and the line that says what was copied stays."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None, leave=False, mininterval=0.2)


_CP_SAID = ("Give SOURCE and DEST: kfp-pytorch storage cp iris.csv s3://BUCKET/datasets/ uploads, "
            "kfp-pytorch storage cp s3://BUCKET/KEY . downloads.")


@storage_grp.command("cp", short_help="Copy files to, from or inside S3.")
@click.argument("source", type=_said(_CP_SAID, _LOCAL_OR_URI))
@click.argument("dest", type=_said(_CP_SAID, _LOCAL_OR_URI))
@click.option("-r", "--recursive", is_flag=True,
              help="Taken as mc cp -r and aws s3 cp --recursive take it: a directory or prefix is copied whole "
                   "with or without it.")
def storage_cp(source, dest, recursive):
    """Copy a file or a directory to S3 (SOURCE a local path, DEST s3://BUCKET/KEY or minio://), or
    from S3 (SOURCE an object or a prefix, DEST a local path): a table for a KFP run's dataset_uri,
    a model to look at; or from S3 to S3 inside the server (a dataset promoted to another bucket).
    A DEST ending in / (or an existing directory) takes the source's name. SOURCE '-' uploads stdin
    to the object DEST; DEST '-' writes the object SOURCE to stdout. A bar shows the bytes moved
    when stderr is a terminal."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, join, parse_uri

    if source == "-" and dest == "-":
        raise click.UsageError("SOURCE and DEST cannot both be '-' (stdin, stdout)")
    if dest == "-":  # as `aws s3 cp s3://b/k -`: the object to stdout
        return click.get_current_context().invoke(storage_cat, uris=(source,))
    if source == "-":  # as `aws s3 cp - s3://b/k`: stdin to one object, streamed in parts
        loc = parse_uri(dest)
        if not loc.is_s3 or not loc.key or loc.key.endswith("/"):
            raise click.UsageError(f"with SOURCE '-' (stdin), DEST must name an object: s3://BUCKET/KEY, got {dest}")
        storage = Storage()
        _need_bucket(storage, dest, f"copy to {dest}")
        sent = storage.upload_stream(sys.stdin.buffer, dest)
        click.echo(f"uploaded {_size(sent)} from stdin to {dest}")
        return
    src, dst = parse_uri(source), parse_uri(dest)
    if not src.is_s3 and not dst.is_s3:
        raise click.UsageError("SOURCE or DEST must be s3:// (or minio://); copy between local paths with cp")
    storage = Storage()
    if src.is_s3 and dst.is_s3:  # inside the server, as `aws s3 cp s3://a s3://b` and `mc cp` do
        _need_bucket(storage, dest, f"copy to {dest}")
        name = PurePosixPath(src.key.rstrip("/")).name
        if src.key and not src.key.endswith("/") and (entry := storage.stat(source)):
            target = join(dest, name) if dest.endswith("/") or not dst.key else dest
            if (tgt := parse_uri(target)).bucket == src.bucket and tgt.key == src.key:
                raise click.UsageError(f"SOURCE and DEST are the same object, {target}: nothing to copy")
            storage.copy(source, target, entry.size)
            click.echo(f"copied 1 object, {_size(entry.size)}, to {target}")
            return
        target = join(dest, name) if dest.endswith("/") and name else dest
        tgt, base = parse_uri(target), src.key.rstrip("/") + "/" if src.key.strip("/") else ""
        if tgt.bucket == src.bucket and (tgt.key.rstrip("/") + "/").startswith(base):
            # as cp -r refuses 'a' into 'a/b/a': each run would nest the copies one level deeper
            raise click.UsageError(f"cannot copy {source} into itself ({target}): give a DEST outside it")
        found = storage.copy_dir(source, target)  # listed once, there
        if not found:
            raise StorageNotFound(f"copy {source}: nothing stored there", _ls_hint(source))
        click.echo(f"copied {len(found)} object(s), {_size(sum(e.size for e in found))}, to {target}")
        return
    if not src.is_s3:
        if not src.path.exists():
            raise StorageNotFound(f"copy {source}: no such file or directory", "check the path")
        files = [src.path] if src.path.is_file() else sorted(p for p in src.path.rglob("*") if p.is_file())
        if not files:
            raise StorageNotFound(f"copy {source}: the directory holds no files", "check the path")
        _need_bucket(storage, dest, f"copy to {dest}")
        if dest.endswith("/") or not dst.key:
            dest = join(dest, src.path.name)
        size = sum(p.stat().st_size for p in files)
        with _bytes_bar(size, "upload") as bar:
            if src.path.is_file():
                storage.upload_file(src.path, dest, bar.update)
            else:
                storage.upload_dir(src.path, dest, bar.update)
        click.echo(f"uploaded {len(files)} file(s), {_size(size)}, to {dest}")
        return
    target = dst.path / PurePosixPath(src.key.rstrip("/")).name if dest.endswith("/") or dst.path.is_dir() else dst.path
    if src.key and not src.key.endswith("/") and (entry := storage.stat(source)):
        with _bytes_bar(entry.size, "download") as bar:
            storage.download_file(source, target, bar.update)
        click.echo(f"downloaded 1 file(s), {_size(entry.size)}, to {target}")
        return
    found = [e for e in storage.entries(source) if not e.uri.endswith("/")]  # folder markers are not files
    if not found:
        raise StorageNotFound(f"copy {source}: nothing stored there", _ls_hint(source))
    size = sum(e.size for e in found)  # these files, not others already in the folder
    with _bytes_bar(size, "download") as bar:
        storage.download_dir(source, target, bar.update)
    click.echo(f"downloaded {len(found)} file(s), {_size(size)}, to {target}")


@storage_grp.command("rm", short_help="Remove an object, or with -r every object under a prefix.")
@click.argument("uri", type=_said("Name the object: s3://BUCKET/KEY, or a prefix with -r "
                                          "(kfp-pytorch storage ls s3://BUCKET/ lists them)."))
@click.option("-r", "--recursive", is_flag=True, help="Remove every object under the prefix URI.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def storage_rm(uri, recursive, dry_run):
    """Remove the object URI (s3://BUCKET/KEY or minio://), or with -r every object under the
    prefix URI: a dataset uploaded by mistake, a run's outputs. Each removed object is listed."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3:
        raise click.UsageError("storage rm removes objects from S3 (s3://BUCKET/KEY or minio://); "
                               "remove a local file with rm")
    from kfp_pytorch.components.storage import Storage

    storage = Storage()
    one = storage.stat(uri) if loc.key and not loc.key.endswith("/") else None
    under = storage.entries(uri) if recursive or not one else []
    if not one and not under:
        if folder := storage.empty_folder(uri):  # one `ls` lists: it holds nothing, so no -r is needed
            gone = [folder] if dry_run else storage.remove_empty_folders(folder, below=True)  # and those above
            for f in gone:
                click.echo(f"{'would remove' if dry_run else 'removed'} empty folder {f}")
            return
        raise StorageNotFound(f"remove {uri}: nothing stored there", _ls_hint(uri))
    if not one and not recursive:  # as `aws s3 rm`: a prefix is removed only when asked for it
        raise click.UsageError(f"{uri} is a prefix with {len(under)} object(s) under it, not an object: "
                               "add -r to remove them all (--dry-run lists them first)")
    doomed = ([one] if one else []) + under
    for e in doomed:
        if not dry_run:
            storage.delete(e.uri)
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.uri}")
    if not dry_run:  # the folders they leave empty, which SeaweedFS would list for minutes yet
        storage.remove_empty_folders(uri, below=bool(under))  # -r on an object: its folder, as without -r
    click.echo(f"{'would remove' if dry_run else 'removed'} {len(doomed)} object(s), "
               f"{_size(sum(e.size for e in doomed))}", err=True)


@storage_grp.command("cat", short_help="Write objects to stdout.")
@click.argument("uris", nargs=-1, required=True, metavar="URI...", type=_said(
    "Name the objects: s3://BUCKET/KEY (kfp-pytorch storage ls s3://BUCKET/ lists them)."))
def storage_cat(uris):
    """Write the objects URI... (s3://BUCKET/KEY or minio://) to stdout, one after the other, streamed
    as they are read: a run's metrics.json, the head of a table (`| head`), a model card. Every URI
    is checked before anything is written."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, parse_uri

    storage = Storage()
    for uri in uris:
        loc = parse_uri(uri)
        if not loc.is_s3:
            raise click.UsageError(f"{uri} is a local path: storage cat reads objects from S3 (s3://BUCKET/KEY "
                                   "or minio://); print a local file with cat")
        if loc.key and not loc.key.endswith("/") and storage.stat(uri):
            continue
        under = storage.entries(uri)
        if under:  # as `mc cat`: a prefix is not an object
            raise click.UsageError(f"{uri} is a prefix with {len(under)} object(s) under it, not an object: "
                                   f"`kfp-pytorch storage ls {uri}` lists what is in it")
        raise StorageNotFound(f"cat {uri}: nothing stored there", _ls_hint(uri))
    out = sys.stdout.buffer
    for uri in uris:
        for chunk in storage.iter_chunks(uri):
            out.write(chunk)
        out.flush()


@storage_grp.command("mb", short_help="Make a bucket (one that exists is left as it is).")
@click.argument("uri", type=_said("Name the bucket to make: s3://NAME (3-63 characters: lower-case letters, "
                                          "digits, '.' and '-')."))
def storage_mb(uri):
    """Make the bucket URI (s3://BUCKET): where a dataset is uploaded to, or a pipeline's storage_root.
    A bucket that exists already is left as it is (exit 0), so a set-up script can run it again."""
    from kfp_pytorch.components.storage import Storage, parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3 or loc.key.strip("/"):
        raise click.UsageError(f"{uri} is not a bucket: give s3://BUCKET (or minio://BUCKET), without a key")
    made = Storage().ensure_bucket(uri)
    click.echo(f"made bucket s3://{loc.bucket}" if made else f"bucket s3://{loc.bucket} exists already")


@storage_grp.command("rb", short_help="Remove an empty bucket (--force: with what is in it).")
@click.argument("uri", type=_said("Name the bucket to remove: s3://NAME (kfp-pytorch storage ls lists them)."))
@click.option("--force", is_flag=True, help="Remove every object in the bucket first, as mc rb --force does.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def storage_rb(uri, force, dry_run):
    """Remove the bucket URI (s3://BUCKET), as mc rb does: a bucket that holds objects is refused
    unless --force, which removes them first, each listed. SeaweedFS, KFP's default store, would
    remove a bucket with objects in it without a word: this checks first."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3 or loc.key.strip("/"):
        raise click.UsageError(f"{uri} is not a bucket: give s3://BUCKET (or minio://BUCKET), without a key; "
                               "storage rm -r removes a prefix")
    storage = Storage()
    bucket = f"s3://{loc.bucket}"
    if not storage.bucket_exists(bucket):
        raise StorageNotFound(f"remove bucket {bucket}: there is no such bucket",
                              "`kfp-pytorch storage ls` lists the buckets")
    held = [e for e in storage.entries(bucket) if not e.uri.endswith("/")]
    if held and not force:
        raise click.UsageError(f"{bucket} holds {len(held)} object(s), {_size(sum(e.size for e in held))}: add --force "
                               "to remove them and the bucket (--dry-run lists them first)")
    for e in held:
        if not dry_run:
            storage.delete(e.uri)
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.uri}")
    if not dry_run:
        storage.remove_bucket(bucket)  # checks again: an object written since is not lost with it
    click.echo(f"{'would remove' if dry_run else 'removed'} bucket {bucket}"
               + (f" and {len(held)} object(s), {_size(sum(e.size for e in held))}" if held else ""))


def _namespace(ctx, param, value):
    """A Kubernetes namespace is a DNS-1123 label: refused here, not after a round trip to KFP."""
    from kfp_pytorch.components.cluster import is_dns1123_label

    if value is not None and not is_dns1123_label(value):
        raise click.BadParameter(f"{value!r} is not a Kubernetes namespace (lowercase letters, digits and '-', "
                                 "at most 63, e.g. kubeflow-user-example-com)")
    return value


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
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
@click.option("--local", is_flag=True, help="The runs of `run --local` on this machine (KFP_PYTORCH_HOME).")
@click.option("--keep", default=None, type=click.IntRange(min=1), metavar="N",
              help="With --local: remove all but the newest N runs' outputs (a served model's run is kept), "
                   "and the registered versions downloaded to serve that no server uses.")
@click.option("--dry-run", is_flag=True, help="With --keep: say what would be removed, remove nothing.")
def runs_cmd(host, namespace, experiment, token, ca_cert, limit, as_json, local, keep, dry_run):
    """List runs and their status, newest first (--local: this machine's, and prune them)."""
    if local:  # KFP_HOST exported for the other commands is no reason to refuse
        if host and click.get_current_context().get_parameter_source("host") != ParameterSource.ENVIRONMENT:
            raise click.UsageError("--local lists this machine's runs: leave out --host")
        return _local_runs(limit, as_json, keep, dry_run)
    if keep is not None or dry_run:
        raise click.UsageError("--keep and --dry-run prune local runs: add --local (a KFP server keeps its runs; "
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
    rows = [{"run_id": r.run_id, "name": r.display_name, "state": str(r.state), "created_at": str(r.created_at),
             "duration_s": _run_seconds(r)} for r in runs]
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
        click.echo(f"{r['run_id']}  {r['state']:<10} {r['created_at']:<26} {took:>8}  {r['name']}")
    if more:
        click.echo(more)


def _run_seconds(run) -> float | None:
    """How long an ended KFP run took; None while it runs (KFP reports finished_at as 1970-01-01 then)."""
    start, end = run.created_at, getattr(run, "finished_at", None)
    if str(run.state) not in ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED") or not start or not end or end.year < 2000:
        return None
    return max((end - start).total_seconds(), 0.0)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _local_runs(limit: int, as_json: bool, keep: int | None, dry_run: bool) -> None:
    import time

    from kfp_pytorch.components.paths import home
    from kfp_pytorch.fairness_scheduler.usage import format_duration
    from kfp_pytorch.pipelines.local import (later_champions, local_runs, prune_local_runs, registry_downloads,
                                             result_line)

    root = home() / "local_outputs"
    if keep is not None:
        removed, spared = prune_local_runs(keep, root, dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        for r in removed:
            click.echo(f"{verb} {r.name}  {r.status:<10} {_size(r.size)}")
        for r in spared:
            if not r.served_by:
                why = "no record and written within the hour: it may still be running"
            else:
                why = f"its model is served by {', '.join(r.served_by)}" + (
                    "; `kfp-pytorch serve start --all` starts what is down" if any(n.endswith(" (down)") for n in r.served_by)
                    else "")
            click.echo(f"kept {r.name}: {why}")
        click.echo(f"{verb} {len(removed)} local run(s), {_size(sum(r.size for r in removed))}; "
                   f"kept the newest {keep}" + (f" and {len(spared)} more" if spared else "")
                   + ("" if not removed or dry_run else
                      "; the MLflow registry keeps its own copy of each registered model"))
        _prune_downloads(verb, dry_run)
        return
    runs = local_runs(root)
    shown = runs[:limit] if limit else runs
    until = later_champions(runs)
    if as_json:
        click.echo(json.dumps([{"name": r.name, "path": str(r.path), "status": r.status, "size_bytes": r.size,
                                "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.modified)),
                                "elapsed_s": r.elapsed_s, "steps": r.steps, "served_by": r.served_by,
                                "params": r.params, "result": r.result,
                                "champion_until": until.get(r.name)}
                               for r in shown], indent=1))
        return
    if not runs:
        click.echo(f"no local runs under {root}")
    else:  # a header, as kubectl's: ENDED is when the run last wrote, TOOK how long it ran
        click.echo(f"{'RUN':<44} {'STATUS':<10} {'ENDED':<16} {'TOOK':>6}  {'SIZE':>9}  STEPS    RESULT")
    for r in shown:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.modified))
        served = f"  serving: {', '.join(r.served_by)}" if r.served_by else ""
        result = f"  {line}" if (line := result_line(r.result, r.params, until.get(r.name))) else ""
        took = format_duration(r.elapsed_s) if r.elapsed_s is not None else "-"
        click.echo(f"{r.name:<44} {r.status:<10} {when} {took:>6}  {_size(r.size):>9}  {len(r.steps)} steps"
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


def _prune_downloads(verb: str, dry_run: bool) -> None:
    """`runs --local --keep`'s second half: the registered versions downloaded to serve that no server uses."""
    from kfp_pytorch.pipelines.local import prune_registry_downloads

    removed, spared = prune_registry_downloads(dry_run=dry_run)
    for d in removed:
        click.echo(f"{verb} {d.name}  (downloaded from the registry) {_size(d.size)}")
    for d in spared:
        why = (f"served by {', '.join(d.served_by)}" if d.served_by
               else "wanted within the hour: a `serve start` or `serve predict` may be using it")
        click.echo(f"kept {d.name}: {why}")
    if removed:
        click.echo(f"{verb} {len(removed)} registered version(s) downloaded to serve, "
                   f"{_size(sum(d.size for d in removed))}; the registry keeps them (`serve start --model-uri` "
                   "downloads one again)")


@cli.command("manifest", cls=_PipelineParamsCommand)
@click.argument("kind", type=click.Choice(["pytorchjob", "trainjob", "inferenceservice", "launcher-config", "s3-secret"]))
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="train_and_serve parameters (epochs, workers, nodes, gpus_per_node, storage_root, model_name...).")
@click.option("--namespace", default="kubeflow-user", show_default=True, callback=_namespace,
              help="Namespace of the resources (the Kubeflow profile's).")
@click.option("--image", envvar="KFP_PYTORCH_IMAGE", default="", help="The kfp-pytorch image (or KFP_PYTORCH_IMAGE).")
@click.option("--run-id", default="dry-run", show_default=True,
              help="KFP run id: names the resources and their storage_root/RUN_ID/ paths.")
@click.option("--fairness/--no-fairness", default=False, help="Add the fairness scheduler's gate.")
@_platform_option
def manifest_cmd(kind, params, namespace, image, run_id, fairness, platform_file):
    """Dry run: print the Kubernetes manifest a cluster step would create (nothing is submitted)."""
    import dataclasses

    from kfp_pytorch.components.cluster import (ClusterConfig, S3Access, dump_yaml, kfp_launcher_configmap,
                                                kserve_s3_secret_and_sa, loopback_note, to_inference_service,
                                                to_pytorchjob, to_trainjob)
    from kfp_pytorch.components.storage import join
    from kfp_pytorch.components.train import TrainSpec
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.train_and_serve import TRAIN_SPEC_PARAMS

    env, platform = dict(os.environ), None
    if platform_file:  # what the pipeline's steps would pass on to the pods they create
        from kfp_pytorch.pipelines.platform import load_platform, platform_env

        platform = load_platform(_read_yaml(platform_file, "--platform"))
        env.update(platform_env(platform, gpu=True))
    cfg = dataclasses.replace(ClusterConfig.from_env(env), image=image, namespace=namespace, fairness=fairness)
    if kind == "launcher-config":
        docs = [kfp_launcher_configmap(namespace, s3=None)]
    elif kind == "s3-secret":
        docs = kserve_s3_secret_and_sa(cfg.s3 or S3Access(), namespace)
    else:
        from kfp_pytorch.components.errors import ConfigError

        try:
            v = get_pipeline("train_and_serve").resolve(_parse_params(params))
            root = v["storage_root"] or "s3://kfp-pytorch/runs"
            if kind == "inferenceservice":
                canary = None if v["canary_traffic_percent"] < 0 else v["canary_traffic_percent"]
                docs = [to_inference_service(cfg.serve_spec(join(root, run_id, "model"), v["model_name"], canary,
                                                            v["serve_min_replicas"], v["serve_max_replicas"]))]
            else:
                ts = TrainSpec(join(root, run_id, "dataset"), join(root, run_id, "train"), run_id=run_id, task="train-op",
                               **{field: v[param] for field, param in TRAIN_SPEC_PARAMS.items()})
                cs = cfg.train_spec(ts)
                docs = [to_pytorchjob(cs) if kind == "pytorchjob" else to_trainjob(cs)]
        except ConfigError as e:  # the settings' own error, with where the image comes from in this command
            if any(p.startswith("image: required") for p in e.problems) and not e.hint:
                e.hint = ("pass --image REGISTRY/kfp-pytorch:TAG, or export KFP_PYTORCH_IMAGE: the image built from "
                          "this repository's Dockerfile, pushed where the cluster pulls from")
            raise
    click.echo(dump_yaml(docs), nl=False)
    where = "--platform's s3_endpoint" if platform and platform.s3_endpoint else "AWS_ENDPOINT_URL"
    if kind != "launcher-config" and (note := loopback_note((cfg.s3 or S3Access()).endpoint, where,
                                                            f"{S3Access.endpoint} (s3_endpoint in --platform)")):
        click.echo(f"note: {note}", err=True)


@storage_grp.command("check", short_help="Check the endpoint, credentials, bucket and read/write.")
@click.argument("uri", default="")
def storage_check(uri):
    """Check the S3 endpoint, credentials, bucket, and read/write permission under URI."""
    from kfp_pytorch.components.storage import check_access

    ok = True
    for line, good in check_access(uri):
        ok &= good
        click.secho(("ok    " if good else "FAIL  ") + line, fg="green" if good else "red")
    if not ok:
        sys.exit(1)


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
        problems.append(f"--half-life: must be a duration like 7d, 12h or seconds, got {half_life!r}")
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
              help="Usage half-life: 7d, 12h, seconds. Overrides the config's (default 7d).")
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
              help="Usage half-life of every policy: 7d, 12h, seconds. Overrides the config's (default 7d).")
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
                     help="Usage half-life: 7d, 12h, seconds (default: the ledger's own).")(f)
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
            problems.append(f"--half-life: must be a duration > 0 like 7d, 12h or seconds, got {half_life!r}")
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
              help="Fold intervals that ended at least this long before --at (30d, 12h, seconds).")
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
        problems.append(f"--older-than: must be a duration >= 0 like 30d, 12h or seconds, got {older_than!r}")
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


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: the run is being stopped from outside (kill, timeout, a CI cancel)."""


_HANDLER_PID: int | None = None
"""The process that installed :func:`_stop_descendants`: a forked child (a simulation worker)
inherits the handler, and must not run it."""


def _stop_descendants(signum: int, frame) -> None:
    """Pass the signal on to every process this command started, then end it: kfp.local's task
    processes, and through them the torchrun workers, would otherwise run on, orphaned (Ctrl-C
    reaches the whole terminal group; a kill reaches this process only)."""
    import signal

    signal.signal(signum, signal.SIG_IGN)  # first: a second signal (timeout sends two) does not interrupt the clean-up
    if os.getpid() != _HANDLER_PID:  # a forked child: end as the signal's default would, without a traceback
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    import multiprocessing
    import time

    import psutil  # imported by main() already: an import here could be one the signal interrupted

    # multiprocessing's own children (a simulation pool's workers) are left for it to reap: one
    # reaped here is "still running" to it for ever (its poll() reads ECHILD so), and the pool's
    # shutdown then spins waiting for it
    pooled = {p.pid: p for p in multiprocessing.active_children()}
    kids = psutil.Process().children(recursive=True)
    for kid in kids:
        try:
            kid.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.monotonic() + 15  # the train step takes its workers down first
    _, alive = psutil.wait_procs([k for k in kids if k.pid not in pooled], timeout=15)
    for kid in alive:
        try:
            kid.kill()
        except psutil.Error:
            pass
    for p in pooled.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:  # noqa: D103
    import signal

    import multiprocessing  # noqa: F401  (for the handler, as psutil)

    import psutil  # noqa: F401  (for the handler: importing it in the handler could meet a half-done import)

    global _HANDLER_PID
    _HANDLER_PID = os.getpid()
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, _stop_descendants)
    try:
        return _main(argv, debug)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None, debug: bool) -> int:
    try:
        cli.main(args=argv, prog_name="kfp-pytorch", standalone_mode=False)
        return 0
    except _Terminated as e:
        click.echo(f"kfp-pytorch: stopped by signal {e.args[0]}; the processes it started were stopped too",
                   err=True)
        return 128 + e.args[0]
    except KfpPytorchError as e:
        if debug:
            raise
        click.secho(f"Error: {e}", fg="red", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # the machine, not the input: a full disk, a vanished path, a refused connection
        if debug:
            raise
        where = " ".join(f"{f}" for f in (e.filename, e.filename2) if f)
        click.secho(f"Error: {e.strerror or e}" + (f": {where}" if where else ""), fg="red", err=True)
        hint = ("check that the server is up and reachable" if isinstance(e, ConnectionError)
                else "check that path, its permissions and the free disk space")
        click.echo(f"  hint: {hint} (--debug shows the traceback)", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
