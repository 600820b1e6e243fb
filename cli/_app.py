"""The ``kfp-pytorch`` command group and the helpers its commands share (parameters, messages, output)."""

import click


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


def _complete_resumable_run(ctx, param, incomplete):
    """`run --resume` completes the local runs that ended early, newest first, with how far they got."""
    from click.shell_completion import CompletionItem

    from kfp_pytorch.pipelines.local import local_runs

    return [CompletionItem(r.name, help=r.status + (f", {r.checkpoint_epochs} epochs trained"
                                                     if r.checkpoint_epochs is not None else ""))
            for r in local_runs() if r.name.startswith(incomplete) and r.status not in ("RUNNING", "RUNNING?")]


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


_PIPELINE = _said(_pipelines_said)
_RUN_ID = _said("Give the KFP run's id: kfp-pytorch runs --host URL lists them, newest first "
                        "(the KFP UI shows it in the run's details).")
_SCHEDULE_NAME = _said("Give the recurring run's name: kfp-pytorch schedules --host URL lists them.")


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
            "retry": "Run a failed or canceled run's failed steps again.",
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


def _namespace(ctx, param, value):
    """A Kubernetes namespace is a DNS-1123 label: refused here, not after a round trip to KFP."""
    from kfp_pytorch.components.cluster import is_dns1123_label

    if value is not None and not is_dns1123_label(value):
        raise click.BadParameter(f"{value!r} is not a Kubernetes namespace (lowercase letters, digits and '-', "
                                 "at most 63, e.g. kubeflow-user-example-com)")
    return value


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
