"""``kfp-pytorch pipelines | compile | run | manifest``: the pipelines, run on this machine or compiled for a cluster."""
import json
import os
import sys
from pathlib import Path

import click

from ._app import (
    _complete_pipeline, _complete_resumable_run, _examples, _namespace, _output_problem, _parse_params, _PIPELINE,
    _PipelineParamsCommand, _read_yaml, _said, cli)


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
@click.option("--resume", metavar="RUN", default=None, shell_complete=_complete_resumable_run,
              help="Run again a local run that failed, was stopped or killed (`runs --local` lists them): its "
                   "parameters (each --param given overrides one; epochs may grow), training from its last "
                   "checkpoint. One that succeeded: with a parameter changed (more epochs).")
def run_cmd(pipeline, local, params, predict, as_json, verbose, resume):
    """Run PIPELINE end-to-end (--local: kfp.local, local DDP workers, local model server)."""
    if not local:  # spelled out, so that nobody reads `run` as the way to a cluster and looks for its --host
        raise click.UsageError(f"run runs a pipeline on this machine: add --local. To run it on a KFP server: "
                               f"kfp-pytorch submit {pipeline} --host URL (or export KFP_HOST)")
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.components.evaluate import gate_note
    from kfp_pytorch.pipelines.local import (gate_advice, pile_note, preflight, refuse_idle_resume, resumed_params,
                                             run_local, summarize, trained_some)

    entry = get_pipeline(pipeline)
    resumed = None
    if resume:  # its name (given as its folder too) and its parameters, under those given here
        resume, resumed = resumed_params(entry, resume)
    values = _resolve_params(entry, params, resumed)
    if resume:  # before preflight, which may make a bucket
        refuse_idle_resume(resume, values)
    # kfp.local's steps (python -m kfp.dsl.executor_main) and torchrun's workers (python -m) import
    # from the current folder, as a notebook does; the console script's own sys.path lacks it, so
    # model_arch=mymodels:build beside the user failed the checks made before any step
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for note in preflight(values):
        click.echo(f"note: {note}", err=True)
    # with --json, stdout is the summary alone (`| jq` reads it); the steps' lines go to stderr
    try:
        run = run_local(entry, values, verbose=verbose, out=sys.stderr if as_json else None, resume=resume)
    except BaseException as e:  # Ctrl-C or a stop signal: how to train on, once the stop is said
        if (canceled := getattr(e, "local_run", None)) and trained_some(canceled):
            click.echo(f"kfp-pytorch: run {canceled.name} canceled; `kfp-pytorch run {pipeline} --local --resume "
                       f"{canceled.name}` trains on from its last checkpoint", err=True)
        raise
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


def _resolve_params(entry, params, base: dict | None = None) -> dict:
    """The pipeline's parameters from ``--param`` strings over ``base`` (a resumed run's), validated;
    a note on stderr for each given parameter that the chosen backends will not read."""
    raw = _parse_params(params)
    values = entry.resolve({**(base or {}), **raw})
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
    if s.get("resumed_from"):
        click.echo(f"resumed:   from {s['resumed_from']}'s last training checkpoint")
    if s.get("failed_task"):
        kept = s.get("checkpoint")
        click.echo(f"failed task: {s['failed_task']} (its log is above, whole in the run's log; partial outputs "
                   "removed" + (", but for its training checkpoint" if kept else "") + ")")
        if s.get("error"):
            click.secho("\n".join(f"  {line}" for line in s["error"].splitlines()), fg="red")
        if kept:
            after = f" after {kept['epochs']} epoch(s)" if kept.get("epochs") is not None else ""
            click.echo(f"  its checkpoint{after} is kept at {kept['uri']}; once fixed, `kfp-pytorch run "
                       f"{s['pipeline']} --local --resume {Path(s['run_dir']).name}` trains on from it")
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
        said = s["not_served"]  # where it names the command that serves the champion, that is the next step
        click.echo(f"serve:     skipped: {said}" + ("" if "`kfp-pytorch serve " in said else
                                                    "; `kfp-pytorch serve list` shows what serves"))
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
