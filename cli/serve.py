"""``kfp-pytorch serve ...``: the local model servers (list, start, stop, logs, predict)."""
import json
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import click
from click.core import ParameterSource

from kfp_pytorch.components.errors import KfpPytorchError

from ._app import _echo_columns, _examples, _LOCAL_OR_URI, _output_problem, _said, cli
from .pipelines import _counted_classes, _weakest_line


def _servers_said() -> str:
    from kfp_pytorch.components.serve import list_servers, some_names

    names = [s["name"] for s in list_servers()]
    if not names:
        return ("There are no local model servers here: a pipeline's serve step starts one "
                "(kfp-pytorch run train_and_serve --local).")
    return f"Name one of the local model servers: {some_names(names)} (kfp-pytorch serve list shows them)."


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
    from kfp_pytorch.components.serve import list_servers, some_names

    if both:
        return f"give the names of the servers to {verb}, or --all, not both"
    servers = [s for s in list_servers() if not s.get("unreadable")]
    up = [s["name"] for s in servers if s["alive"]]
    down = [s["name"] for s in servers if not s["alive"]]
    if not servers:
        return f"give the names of the servers to {verb}, or --all; there are no local model servers here"
    if verb == "start" and not down:
        return f"give the names of the servers to {verb}, or --all; every local model server is up ({some_names(up)})"
    listed = "; ".join(f"{state}: {some_names(names)}" for state, names in (("down", down), ("up", up))
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


@contextmanager
def _model_flag_hint():
    """A URI with no trained model, hinted in the words of the command line (--model-uri), not of
    the Python API (model_uri)."""
    from kfp_pytorch.components.errors import ModelNotFound

    try:
        yield
    except ModelNotFound as e:
        e.hint = ("give --model-uri a run's train-op.model directory (`kfp-pytorch runs --local` lists the runs), "
                  "or a registered version: models:/MODEL/VERSION")
        raise


def _serve_model_as(names, start_all, port, model_uri, tracking_uri) -> None:
    """``serve start NAME --model-uri URI``: a registered version (downloaded once under
    KFP_PYTORCH_HOME/registry_models) or a model directory, served as NAME and smoke-tested."""
    from kfp_pytorch.components.serve import ServeSpec, serve

    if start_all or len(names) != 1:
        given = "not --all" if start_all else (f"not {len(names)}: {' '.join(names)}" if names else "none was given")
        raise click.UsageError(f"--model-uri serves one model: give one NAME (the endpoint's name), {given}")
    [name] = names
    ServeSpec(model_uri, name, port=port).validate()  # a bad name before any download
    what = model_uri
    if model_uri.startswith("models:"):
        from kfp_pytorch.components.tracking import Tracker

        got = Tracker(tracking_uri, experiment=None).fetch_model(model_uri)
        what = f"models:/{got['name']}/{got['version']}" + (f" (@{got['alias']})" if got["alias"] else "")
        model_dir = str(got["model_dir"])
    else:
        from kfp_pytorch.components.predictor import read_model_metadata

        model_dir = model_uri
        with _model_flag_hint():  # nothing, a file or a dataset there
            read_model_metadata(model_dir)
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
@click.option("--batch-size", default=None, type=click.IntRange(1, 65536),
              help="Rows sent in each inference request (default: about 4 MiB of features, at most 4096 rows: "
                   "4096 for 64 features, 1337 for 784).")
@click.option("--encoding", type=click.Choice(["binary", "json"]), default="binary", show_default=True,
              help="How rows and answers travel: binary tensors (the Open Inference Protocol's extension, which "
                   "KServe and Triton read; JSON for a server that refuses them), or JSON numbers.")
@click.option("--probabilities", is_flag=True,
              help="Add each class's probability as a column p_<class> (its name where the model's metadata is "
                   "known: a local server, or --model-uri; else its id).")
@click.option("-o", "--output", metavar="FILE|URI", default=None, type=_LOCAL_OR_URI,
              help="Write the predictions here: a file, or s3://BUCKET/KEY, as CSV or, by the name's suffix, "
                   "Parquet, JSON Lines (.jsonl), JSON or Feather (default, or '-': CSV on stdout).")
def serve_predict(name, table, url, model_uri, host_header, token, label_column, batch_size, encoding, probabilities,
                  output):
    """Predict every row of TABLE (CSV, Parquet, JSON Lines or Feather: a path, s3://..., sample://digits, or '-' for a
    CSV on stdin) with the
    model server NAME, and write row, prediction, confidence (and the row's label) as CSV (or, by
    -o's suffix, Parquet, JSON Lines, JSON or Feather)."""
    from kfp_pytorch.components.batch_predict import (default_batch_rows, predict_table, resolve_target, table_bytes,
                                                      weakest_label)
    from kfp_pytorch.components.prepare_data import load_table

    output = None if output == "-" else output  # '-': stdout, as click's File type and most tools read it
    to_s3 = output is not None and _check_predictions_output(output)  # before any row is sent
    target = resolve_target(name, url, model_uri, host_header, token)
    frame = _stdin_table() if table == "-" else load_table(table, label_column=label_column or "label", what="TABLE")
    show = sys.stderr.isatty() and len(frame) > (batch_size or default_batch_rows(frame.shape[1]))
    with (click.progressbar(length=len(frame), label="predicting", file=sys.stderr) if show else nullcontext() as bar,
          _model_flag_hint()):
        result = predict_table(target, frame, label_column, source="stdin" if table == "-" else table,
                               batch_size=batch_size,
                               on_batch=bar.update if bar is not None else None, probabilities=probabilities,
                               binary=encoding == "binary")
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
    Storage().check_writable(output, "-o/--output")
    return True
