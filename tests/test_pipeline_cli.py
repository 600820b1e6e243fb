"""The pipeline and the CLI as a user runs them: a real subprocess, real servers, real HTTP."""
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from servers import free_port

GOLDEN = Path(__file__).parent / "golden" / "train_and_serve.yaml"
CLI = [sys.executable, "-m", "kfp_pytorch.cli"]


def run_cli(*args, env=None, timeout=600):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def summary_of(stdout: str) -> dict:
    return json.loads(stdout)  # with --json, stdout is the summary alone: the steps' lines are on stderr


def _project_processes():
    home = os.environ["KFP_PYTORCH_HOME"]
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("KFP_PYTORCH_HOME") == home and p.pid != os.getpid() and p.status() != "zombie":
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def _normalised(doc: dict) -> dict:
    doc = dict(doc)
    doc.pop("sdkVersion", None)
    return doc


def test_compile_parses_back_and_matches_golden(tmp_path):
    out = tmp_path / "p.yaml"
    r = run_cli("compile", "train-and-serve", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    spec = json_format.ParseDict(doc, pipeline_spec_pb2.PipelineSpec())
    assert spec.pipeline_info.name == "train-and-serve"
    assert {"comp-prepare-data-op", "comp-train-op", "comp-evaluate-op", "comp-register-op",
            "comp-serve-op"} <= set(spec.components)
    cond = spec.root.dag.tasks["condition-1"].trigger_policy.condition
    assert "evaluate-op-Output" in cond and "true" in cond
    text = out.read_text()
    assert "AWS_SECRET_ACCESS_KEY" not in text and "secret_key" not in text  # credentials never compiled in
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(yaml.safe_dump(_normalised(doc), sort_keys=True))
    assert _normalised(doc) == yaml.safe_load(GOLDEN.read_text()), \
        "compiled pipeline changed: review it, then rerun with UPDATE_GOLDEN=1"


def test_compile_takes_parameters_as_the_compiled_pipelines_defaults(tmp_path):
    out = tmp_path / "p.yaml"
    r = run_cli("compile", "train_and_serve", "-o", str(out), "--param", "epochs=3",
                "--param", "dataset_uri=s3://datasets/iris.csv", "--param", "label_column=species")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == (f"wrote {out} (defaults: epochs=3, dataset_uri=s3://datasets/iris.csv, "
                        "label_column=species)\n")
    params = yaml.safe_load(out.read_text())["root"]["inputDefinitions"]["parameters"]
    assert params["epochs"]["defaultValue"] == 3 and params["label_column"]["defaultValue"] == "species"
    assert params["dataset_uri"]["defaultValue"] == "s3://datasets/iris.csv"
    assert params["lr"]["defaultValue"] == 0.005  # one not given keeps the pipeline's own default
    # -o -: the same YAML alone on stdout (a pipe to a file or another tool), the note on stderr
    r = run_cli("compile", "train_and_serve", "-o", "-", "--param", "epochs=3",
                "--param", "dataset_uri=s3://datasets/iris.csv", "--param", "label_column=species")
    assert r.returncode == 0 and r.stdout == out.read_text(), r.stderr
    assert r.stderr == "compiled (defaults: epochs=3, dataset_uri=s3://datasets/iris.csv, label_column=species)\n"
    assert not (Path.cwd() / "-").exists()
    table = tmp_path / "iris.csv"
    table.write_text("a,label\n1,0\n")
    for bad, needle in [("epochs=many", "epochs: expected integer, got 'many'"),
                        (f"dataset_uri={table}", "the KFP server's pods cannot read it")]:
        out.unlink(missing_ok=True)
        r = run_cli("compile", "train_and_serve", "-o", str(out), "--param", bad)
        assert r.returncode == 2 and needle in r.stderr and not out.exists(), r.stderr


def test_steps_that_read_changing_data_or_act_on_the_world_are_never_cached(tmp_path):
    # All steps were cached (KFP's default): a scheduled retraining with the same parameters
    # reused the first run's dataset, registered nothing and reported a server it did not check
    out = tmp_path / "p.yaml"
    assert run_cli("compile", "train-and-serve", "-o", str(out)).returncode == 0
    doc = yaml.safe_load(out.read_text())
    tasks = {name: t for comp in [doc["root"], *doc["components"].values()]
             for name, t in ((comp.get("dag") or {}).get("tasks") or {}).items()}
    cached = {name: t["cachingOptions"].get("enableCache", False) for name, t in tasks.items() if "cachingOptions" in t}
    assert cached == {"prepare-data-op": False, "train-op": True, "evaluate-op": True, "register-op": False,
                      "serve-op": False}


def test_every_command_and_option_says_what_it_does():
    # `--help` is the reference a user reads at the prompt: an option listed bare (`--json` and nothing
    # else) leaves them guessing what it prints or changes
    import click

    from kfp_pytorch.cli import cli

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    bare = []
    for path, cmd in walk(cli, "kfp-pytorch"):
        if not (cmd.help or "").strip():
            bare.append(path)
        bare += [f"{path} {p.opts[0]}" for p in cmd.params
                 if isinstance(p, click.Option) and not (p.help or "").strip() and p.name not in ("help", "version")]
    assert not bare, bare


def test_the_top_level_help_lists_every_command_once_by_section():
    import click
    from click.testing import CliRunner

    from kfp_pytorch.cli import cli
    from kfp_pytorch.cli._app import _SectionedGroup

    sections = _SectionedGroup.SECTIONS
    listed = [name for rows in sections.values() for name in rows]
    assert sorted(listed) == sorted(cli.commands)  # each command in one section, and only commands
    for group in ("serve", "storage"):  # a group's line names its commands, all of them
        line = sections["Serving and storage"][group]
        assert sorted(re.findall(r"\b[a-z]+\b", line.split(": ", 1)[1])) == sorted(cli.commands[group].commands)
    out = CliRunner().invoke(cli, ["--help"]).output
    commands = out.split("\nPipelines:\n", 1)[1]
    assert [t for t in sections if f"\n{t}:\n" in out] == list(sections) and "..." not in commands  # none cut off
    assert all(len(line) <= 80 for line in out.splitlines())
    rows = [line for line in commands.split("\n\n  A command's")[0].splitlines() if line.startswith("  ")]
    assert sorted(r.split()[0] for r in rows) == sorted(listed)
    assert {r.index(r.split()[1], len(r.split()[0]) + 2) for r in rows} == {19}  # one column for every section
    # a command added without a line of its own is still listed, under Other
    extra = _SectionedGroup(commands={**cli.commands, "new": click.Command("new", help="Does a new thing.")})
    assert "\nOther:\n  new" in CliRunner().invoke(extra, ["--help"]).output


def test_a_subcommand_given_without_its_group_is_named_with_it():
    from click.testing import CliRunner

    from kfp_pytorch.cli import cli

    for args, said in [(["predict", "digits", "rows.csv"], "'kfp-pytorch serve predict'"),
                       (["ls", "s3://data"], "'kfp-pytorch storage ls'"), (["compact"], "'kfp-pytorch ledger compact'")]:
        r = CliRunner().invoke(cli, args, prog_name="kfp-pytorch")
        assert r.exit_code == 2 and f"No such command '{args[0]}'. Did you mean {said}?" in r.output, r.output
    r = CliRunner().invoke(cli, ["runn"], prog_name="kfp-pytorch")  # click's own suggestion stays
    assert r.exit_code == 2 and "Did you mean one of: 'run', 'runs'?" in r.output
    assert CliRunner().invoke(cli, ["nonexist"]).exit_code == 2


@pytest.mark.parametrize("group", ["serve", "storage", "ledger"])
def test_a_command_groups_help_lists_each_subcommand_on_a_line_that_fits(group):
    # click cuts a docstring's first sentence at the width left ("Write the objects URI..."): each
    # subcommand's line is written to fit, and says what it does
    from click.testing import CliRunner

    from kfp_pytorch.cli import cli

    out = CliRunner().invoke(cli, [group, "--help"]).output
    rows = out.split("\nCommands:\n", 1)[1].splitlines()
    assert sorted(r.split()[0] for r in rows) == sorted(cli.commands[group].commands)
    assert all(len(r) <= 80 and not r.endswith("...") and len(r.split()) > 2 for r in rows), rows

def test_the_examples_in_help_parse_as_written(tmp_path, monkeypatch):
    # an example is copied as it is: one with a renamed option, or a parameter that is not the
    # pipeline's, would be the first error a user meets
    import shlex

    import click

    from kfp_pytorch.cli import cli
    from kfp_pytorch.pipelines.registry import PIPELINES

    known = {p.name for e in PIPELINES.values() for p in e.params}
    monkeypatch.chdir(tmp_path)
    def walk(cmd):
        yield cmd
        for sub in getattr(cmd, "commands", {}).values():
            yield from walk(sub)

    checked = 0
    for cmd in walk(cli):
        lines = [x.strip() for x in (cmd.epilog or "").splitlines() if x.strip().startswith(("kfp-pytorch ", "cat "))]
        for line in lines:
            words = shlex.split(re.split(r" \| | +# | &$", line.split("| ", 1)[-1] if line.startswith("cat ") else line)[0])
            words = ["http://127.0.0.1:8080" if w == "URL" else w for w in words]
            for w in words:  # the files it names, so that options that want them to exist take them
                if w.endswith((".csv", ".yaml")) and not w.startswith(("s3:", "dataset_uri=")):
                    (tmp_path / w).parent.mkdir(parents=True, exist_ok=True)
                    (tmp_path / w).write_text("")
            (tmp_path / "shared/traces/itp-2021").mkdir(parents=True, exist_ok=True)
            assert words[0] == "kfp-pytorch", line
            sub, args = cli, words[1:]
            while isinstance(sub, click.Group):  # down to the command the example runs
                sub, args = sub.commands[args[0]], args[1:]
            ctx = sub.make_context(sub.name, args)  # parses and checks, runs nothing
            for kv in ctx.params.get("params", ()):
                assert kv.split("=", 1)[0] in known, (line, kv)
            checked += 1
    assert checked >= 20  # run, submit, schedule, simulate, goals, serve predict and ledger show have examples


def test_commands_that_only_check_and_write_settings_do_not_import_torch():
    # pipelines, compile, submit, schedule and manifest validate parameters and write YAML: torch's
    # import was 1.5 of their 2.7 s. The names of the built-in models are known without it. runs
    # --local and serve list read records (torch and pandas made runs --local 1.6 s, not 0.5 s).
    code = ("import sys; import kfp_pytorch.pipelines.registry, kfp_pytorch.components.cluster, kfp_pytorch.cli\n"
            "from kfp_pytorch.pipelines.registry import get_pipeline\n"
            "get_pipeline('train_and_serve').resolve({'model_arch': 'cnn', 'train_backend': 'cluster', "
            "'storage_root': 's3://models/runs'})\n"
            "for args in (['pipelines'], ['manifest', 'pytorchjob', '--image', 'reg/kfp-pytorch:0.1.0'],\n"
            "             ['runs', '--local'], ['serve', 'list']):\n"
            "    kfp_pytorch.cli.cli.main(args, standalone_mode=False)\n"  # the commands themselves, run
            "print(sorted(m for m in ('torch', 'pandas', 'mlflow') if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "[]\n", r.stderr
    assert "train_and_serve" in r.stdout and "kind: PyTorchJob" in r.stdout
    from kfp_pytorch.components.models import ZOO
    from kfp_pytorch.components.train import BUILTIN_MODELS

    assert tuple(ZOO) == BUILTIN_MODELS


def test_tab_completes_pipelines_and_policies():
    def complete(line):
        r = run_cli(env={"_KFP_PYTORCH_COMPLETE": "bash_complete", "COMP_WORDS": line,
                         "COMP_CWORD": str(len(line.split(" ")) - 1)})
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return [line for line in r.stdout.splitlines() if line]  # nothing to complete: one empty line

    for command in ("run", "compile", "submit", "schedule"):
        assert complete(f"kfp-pytorch {command} tr") == ["plain,train_and_serve"]
    assert complete("kfp-pytorch run x") == []
    assert complete("kfp-pytorch simulate --policies ") == [
        "plain,all", "plain,fifo", "plain,static-priority", "plain,drf", "plain,slurm-fairshare", "plain,kueue-afs",
        "plain,fairshare"]
    # the comma-separated list goes on with the policies not named yet
    assert complete("kfp-pytorch simulate --policies fifo,fairshare,") == [
        "plain,fifo,fairshare,static-priority", "plain,fifo,fairshare,drf", "plain,fifo,fairshare,slurm-fairshare",
        "plain,fifo,fairshare,kueue-afs"]
    assert complete("kfp-pytorch simulate --policies fifo,k") == ["plain,fifo,kueue-afs"]
    assert complete("kfp-pytorch simulate --trace shared/tr") == ["file,shared/tr"]
    assert complete("kfp-pytorch ser") == ["plain,serve"]


def test_pipelines_lists_parameters():
    r = run_cli("pipelines", "--json")
    params = json.loads(r.stdout)["train_and_serve"]
    assert params["epochs"] == {"type": "int", "default": 8, "help": "training epochs"}
    assert params["dataset_uri"]["default"] == "sample://digits"
    # the table: every parameter's type, default and help start in the same column, however long its name
    rows = [line for line in run_cli("pipelines").stdout.splitlines() if line.startswith("  ")]
    assert len(rows) == len(params) and {row.split()[0] for row in rows} == set(params)
    def column(row, text):  # where ``text`` starts in a row, after the parameter's name
        return row.index(text, 2 + len(row.split()[0]))

    for field in ("type", "default", "help"):
        starts = {column(row, f"default={params[row.split()[0]]['default']!r}" if field == "default" else
                         params[row.split()[0]][field]) for row in rows}
        assert len(starts) == 1, (field, rows)
    # a terminal's width: each description wrapped under itself, or below its row when the columns
    # leave it too little room; a pipe (above) keeps one line per parameter
    from kfp_pytorch.cli.pipelines import _param_lines
    from kfp_pytorch.pipelines.registry import PIPELINES

    entry = PIPELINES["train_and_serve"]
    assert _param_lines(entry.params) == rows
    help_at = rows[0].index(params["dataset_uri"]["help"])
    for width, indent in ((100, help_at), (60, 6)):
        lines = _param_lines(entry.params, width)
        assert max(map(len, lines)) <= width and len(lines) > len(rows)
        heads = [i for i, line in enumerate(lines) if line[2:3] != " "]
        assert [lines[i].split()[0] for i in heads] == [p.name for p in entry.params]
        for i, p in zip(heads, entry.params):  # the description, whole, in its rows
            end = heads[heads.index(i) + 1] if i != heads[-1] else len(lines)
            text = " ".join([lines[i][help_at:]] + [line[indent:] for line in lines[i + 1:end]]).split()
            assert text == p.description.split(), (width, p.name)
            assert all(line[:indent].strip() == "" for line in lines[i + 1:end])
    # one pipeline by name, as run takes it (it was "Got unexpected extra argument")
    for name in ("train_and_serve", "train-and-serve"):
        assert run_cli("pipelines", name).stdout == run_cli("pipelines").stdout
        assert json.loads(run_cli("pipelines", name, "--json").stdout) == {"train_and_serve": params}
    r = run_cli("pipelines", "train_and_serv")
    assert r.returncode == 2 and "unknown pipeline 'train_and_serv'; did you mean 'train_and_serve'?" in r.stderr
    assert r.stdout == ""


def test_end_to_end_on_s3_and_mlflow_server(s3, bucket, mlflow_server):
    """The main job with every artifact in the S3 server and the registry on a real MLflow server."""
    r = run_cli("run", "train_and_serve", "--local", "--json", "--param", "epochs=4",
                "--param", f"storage_root=s3://{bucket}/runs", "--param", f"tracking_uri={mlflow_server.url}",
                "--param", "model_name=digits-e2e")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = summary_of(r.stdout)
    try:
        assert s["status"] == "SUCCEEDED" and s["gate_passed"] is True
        assert s["metrics"]["accuracy"] > 0.9
        assert s["model"]["registry_uri"] == "models:/digits-e2e/1" and s["model"]["champion"] is True
        assert s["endpoint"].endswith("/v2/models/digits-e2e/infer")
        assert s["prediction"]["label"] in range(10)
        assert s["artifacts"]["prepare-data-op.dataset"].startswith(f"s3://{bucket}/runs/")
        assert s["artifacts"]["train-op.model"].startswith(f"s3://{bucket}/runs/")
        stored = s3.list(f"s3://{bucket}/runs")
        assert any(u.endswith("model/model.pt2") for u in stored)
        assert any(u.endswith("checkpoints/last.pt") for u in stored)
        assert any(u.endswith("train/shard-00000.npz") for u in stored)
        # No credential leaks into what the run wrote locally.
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        for f in Path(s["run_dir"]).rglob("*.json"):
            assert secret not in f.read_text()
        assert secret not in r.stdout and secret not in r.stderr
        # kfp.local's per-step warnings about display names and our image are not printed (20 lines a run)
        assert "DockerRunner" not in r.stderr and "have no effect in the current local runner" not in r.stderr
        assert "made the bucket" not in r.stderr  # it was there
        # A nightly retraining that passes the gate but does not beat the champion: registered, not
        # served; the champion's server goes on answering, started again as it was, had it died (a reboot)
        [first] = [x for x in json.loads(run_cli("serve", "list", "--json").stdout) if x["name"] == "digits-e2e"]
        assert first["registered_model"] == "models:/digits-e2e/1"  # register's version, handed to the serve step
        psutil.Process(first["pid"]).kill()
        psutil.Process(first["pid"]).wait(10)
        r = run_cli("run", "train_and_serve", "--local", "--json", "--param", "epochs=1", "--param", "threshold=0.5",
                    "--param", f"storage_root=s3://{bucket}/runs", "--param", f"tracking_uri={mlflow_server.url}",
                    "--param", "model_name=digits-e2e", "--verbose")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        again = summary_of(r.stdout)
        assert "Got executor_input" in r.stderr  # --verbose: kfp.local's whole log as it runs (on stderr: --json)
        assert again["gate_passed"] is True and again["metrics"]["accuracy"] < s["metrics"]["accuracy"]
        assert again["model"] == {"registry_uri": "models:/digits-e2e/2", "version": 2, "champion": False}
        assert "endpoint" not in again and "prediction" not in again
        assert again["not_served"] == (f"version 2 is registered, not champion: accuracy {again['metrics']['accuracy']:.4f} "
                                       f"does not beat version 1's {s['metrics']['accuracy']:.4f} (a tie keeps the "
                                       f"champion) (only a new champion is served); the champion serves at {s['endpoint']}")
        assert "whose local server was down; it serves again at " + s["endpoint"] in r.stderr  # the serve step's log
        listed = json.loads(run_cli("serve", "list", "--json").stdout)
        assert [(x["name"], x["model_uri"], x["registered_model"], x["alive"]) for x in listed
                if x["name"] == "digits-e2e"] == [("digits-e2e", s["artifacts"]["train-op.model"],
                                                   "models:/digits-e2e/1", True)], listed  # the first run's model
    finally:
        run_cli("serve", "stop", "digits-e2e")


def test_gate_failure_skips_register_and_serve():
    # ... and parameters the local backends do not read are named, while the run goes ahead
    r = run_cli("run", "train_and_serve", "--local", "--json", "--param", "epochs=1", "--param", "threshold=0.999",
                "--param", "gpus_per_node=1", "--param", "canary_traffic_percent=20", "--param", "gate_metric=min_recall",
                "--param", "batch_size=100000")
    assert r.returncode == 0, r.stderr[-2000:]
    s = summary_of(r.stdout)
    # the training step's note, said among its lines, is said again at the end, where the failed gate is read
    batch = ("note: batch_size 100000 x 2 workers covers all 1257 training rows, so each epoch is one optimizer step "
             "and a few epochs barely train; batch_size=78 takes 9 steps an epoch")
    assert s["notes"] == [batch] and r.stderr.count(batch) == 2 and r.stderr.endswith(batch + "\n")
    assert s["gate_passed"] is False and "model" not in s and "endpoint" not in s
    assert s["gate"] == {"metric": "min_recall", "threshold": 0.999, "advice": (
        "to pass the gate: train longer: -p epochs=2 (this run trained 1); -p class_weight=balanced, so that rare "
        "classes weigh as much in the loss")} and s["metrics"]["min_recall"] < 0.999
    # the summary names the class that recall is of, read from the confusion matrix the KFP UI shows
    assert s["confusion"]["classes"] == [str(c) for c in range(10)]
    assert sum(map(sum, s["confusion"]["rows"])) == s["metrics"]["test_rows"]
    weak = s["weakest_class"]
    assert weak["recall"] == pytest.approx(s["metrics"]["min_recall"]) and weak["class"] in [str(c) for c in range(10)]
    assert weak["correct"] / weak["rows"] == pytest.approx(weak["recall"]) and 0 < weak["taken_rows"] <= weak["rows"]
    assert not _project_processes()
    # the terminal shows the steps and their own lines, not kfp.local's plumbing (400 of 500 lines);
    # the run keeps its whole log
    # (on stderr: with --json, stdout is the summary alone)
    assert "Executing task" in r.stderr and "[kfp-pytorch] starting 2 local DDP workers" in r.stderr
    assert "Got executor_input" not in r.stderr and "Wrote executor output file" not in r.stderr
    assert "outputs:" not in r.stderr and "Streamed logs" not in r.stderr and "\n\n" not in r.stderr
    # a pipe gets kfp.local's lines without their colours (its log keeps them)
    assert "\x1b[" not in r.stderr and "Task 'train-op' finished with status SUCCESS" in r.stderr
    log = Path(s["log"]).read_text()
    assert Path(s["log"]) == Path(s["run_dir"]) / "run.log" and "Got executor_input" in log
    assert "Task \x1b[96m'train-op'\x1b[0m outputs:" in log and "[kfp-pytorch] starting 2 local DDP workers" in log
    assert [p.name for p in Path(s["run_dir"]).parent.iterdir()] == [Path(s["run_dir"]).name]  # nothing left beside
    # the run is recorded where it wrote, and listed with its parameters
    [listed] = json.loads(run_cli("runs", "--local", "--json").stdout)
    assert listed["path"] == s["run_dir"] and listed["status"] == "SUCCEEDED" and listed["params"]["epochs"] == 1
    assert listed["steps"] == ["evaluate-op", "prepare-data-op", "train-op"] and listed["served_by"] == []
    assert listed["result"] == {"metrics": {k: s["metrics"][k] for k in ("accuracy", "macro_f1", "min_recall", "roc_auc")},
                                "gate_passed": False}  # what the run came to, kept with it
    header, line = run_cli("runs", "--local").stdout.splitlines()[:2]
    assert header.split() == ["RUN", "STATUS", "ENDED", "TOOK", "SIZE", "STEPS", "RESULT"]
    assert line.split()[0] == Path(s["run_dir"]).name and line.endswith(
        f"accuracy {s['metrics']['accuracy']:.4f}, gate failed: min_recall {s['metrics']['min_recall']:.4f} < 0.9990")
    assert ("note: gpus_per_node only applies with train_backend=cluster (a PyTorchJob's pods and their GPUs); "
            "this run has train_backend=local, so it changes nothing") in r.stderr
    assert "note: canary_traffic_percent only applies with serve_backend=cluster" in r.stderr


def test_only_parameters_the_backends_do_not_read_get_a_note():
    from kfp_pytorch.pipelines.train_and_serve import inert_params

    cluster = {"train_backend": "cluster", "serve_backend": "cluster"}
    assert inert_params({"nodes", "gpus_per_node", "canary_traffic_percent"}, cluster) == []
    assert inert_params({"serve_port"}, cluster) == [
        "serve_port only applies with serve_backend=local (the local model server's port); "
        "this run has serve_backend=cluster, so it changes nothing"]
    local = {"train_backend": "local", "serve_backend": "local"}
    assert inert_params({"epochs", "serve_port"}, local) == []
    assert inert_params({"nodes", "gpus_per_node"}, local) == [
        "nodes, gpus_per_node only apply with train_backend=cluster (a PyTorchJob's pods and their GPUs); "
        "this run has train_backend=local, so they change nothing"]
    assert inert_params({"serve_max_replicas"}, local) == [
        "serve_max_replicas only applies with serve_backend=cluster (the InferenceService's replicas); "
        "this run has serve_backend=local, so it changes nothing"]


def test_a_step_that_fails_is_named_and_its_partial_outputs_removed(tmp_path):
    # The factory passes the checks made before any step (it imports, its signature binds, its
    # model takes a batch) and fails in the training workers only: the summary names the step
    # (kfp.local colours its name) and quotes the workers' error.
    (tmp_path / "badfactory.py").write_text(
        "import os\nfrom torch import nn\n\n\ndef net(input_dim, num_classes, image_shape=None):\n"
        "    return 42 if 'RANK' in os.environ else nn.Linear(input_dim, num_classes)\n")
    # the factory's module is in the current folder, as a notebook's is: the console script (whose
    # sys.path, unlike python -m's, lacks that folder) imports it there as the steps and workers do
    script = Path(sys.executable).parent / "kfp-pytorch"
    r = subprocess.run([str(script), "run", "train_and_serve", "--local", "--param", "model_arch=badfactory:net",
                        "--param", "epochs=1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 1
    # the summary at the end says why, in the words of the step's own error: no scrolling up the log
    summary = r.stdout[r.stdout.index("== train_and_serve: FAILED =="):]
    assert ("failed task: train-op (its log is above, whole in the run's log; partial outputs removed)\n"
            "  TrainingError: training workers failed (torchrun exit code 1): ModelFactoryError: model factory "
            "'badfactory:net' returned int, not a torch.nn.Module\n    hint: read the worker error above") in summary
    # each worker says it as our errors do, not in a traceback of our modules (two ranks, four attempts)
    assert ("[rank0]: ModelFactoryError: model factory 'badfactory:net' returned int, not a torch.nn.Module\n"
            "    [rank0]:   hint: return an nn.Module from the factory") in r.stdout
    assert "[rank0]: Traceback" not in r.stdout and "[rank1]: Traceback" not in r.stdout
    run_dir = max((Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").iterdir(), key=lambda d: d.stat().st_mtime)
    assert (run_dir / "prepare-data-op").is_dir() and not (run_dir / "train-op").exists()
    assert "--resume" not in r.stdout  # it trained nothing to resume from
    assert not _project_processes()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "FAILED" and record["failed_task"] == "train-op"
    assert record["params"]["model_arch"] == "badfactory:net"
    # and `runs --local` says why it failed, on the run's line: no opening of its log to find out
    why = ("train-op: TrainingError: training workers failed (torchrun exit code 1): ModelFactoryError: model "
           "factory 'badfactory:net' returned int, not a torch.nn.Module")
    assert record["result"]["failed"] == why
    [line] = [ln for ln in run_cli("runs", "--local").stdout.splitlines() if ln.startswith(run_dir.name)]
    assert line.split()[1] == "FAILED" and line.endswith(f"  failed in {why[:117]}...")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_whose_training_failed_keeps_its_checkpoint_and_once_fixed_resumes_from_it(tmp_path, where, request):
    # a bug that strikes after hours of training: the failed step's outputs were all removed, its
    # checkpoint with them, and the run after the fix started over; with storage_root the checkpoint
    # stayed on S3, but the summary did not ask there, so it gave no way to train on
    (tmp_path / "flaky.py").write_text(
        "import os\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self, d, k):\n"
        "        super().__init__()\n        self.fc, self.steps = nn.Linear(d, k), 0\n\n    def forward(self, x):\n"
        "        self.steps += self.training\n        if self.steps > 25 and os.path.exists('bug'):\n"
        "            raise RuntimeError('the bug at step 26')\n        return self.fc(x)\n\n\n"
        "def net(input_dim, num_classes, image_shape=None):\n    return Net(input_dim, num_classes)\n")
    (tmp_path / "bug").touch()
    script = Path(sys.executable).parent / "kfp-pytorch"
    on_s3 = []
    if where == "s3":
        request.getfixturevalue("s3")
        on_s3 = ["--param", f"storage_root=s3://{request.getfixturevalue('bucket')}/runs"]
    r = subprocess.run([str(script), "run", "train_and_serve", "--local", "--param", "model_arch=flaky:net",
                        "--param", "epochs=12", "--param", "model_name=flaky", "--no-predict", *on_s3],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 1 and "RuntimeError: the bug at step 26" in r.stdout, r.stdout[-3000:]
    run_dir = max((Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").iterdir(), key=lambda d: d.stat().st_mtime)
    assert ("failed task: train-op (its log is above, whole in the run's log; partial outputs removed, but for its "
            "training checkpoint)") in r.stdout
    if where == "local":
        kept = str(run_dir / "train-op" / "model" / "checkpoints")
        assert sorted(p.name for p in (run_dir / "train-op").rglob("*") if p.is_file()) == ["last.json", "last.pt"]
        trained = json.loads((Path(kept) / "last.json").read_text())["epoch"]
    else:
        from kfp_pytorch.components.storage import Storage

        kept = f"{on_s3[1].removeprefix('storage_root=')}/{run_dir.name}/train-op/model/checkpoints"
        trained = json.loads(Storage().read_bytes(f"{kept}/last.json"))["epoch"]
    assert 2 <= trained < 12  # each of the four attempts trained on from the last one's checkpoint
    assert (f"its checkpoint after {trained} epoch(s) is kept at {kept}; once fixed, `kfp-pytorch run train_and_serve "
            f"--local --resume {run_dir.name}` trains on from it") in r.stdout
    [listed] = [x for x in json.loads(run_cli("runs", "--local", "--json").stdout) if x["name"] == run_dir.name]
    assert (listed["status"], listed["checkpoint_epochs"]) == ("FAILED", trained)  # on S3: from the run's record
    (tmp_path / "bug").unlink()  # the fix
    try:
        r = subprocess.run([str(script), "run", "train_and_serve", "--local", "--resume", f"{run_dir}/",  # as completed
                            "--no-predict"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:]
        assert f"training resumes from {run_dir.name}'s last checkpoint ({trained} epoch(s) trained)" in r.stdout
        assert f"resumed:   from {run_dir.name}'s last training checkpoint" in r.stdout
        assert "training:  12 epoch(s)" in r.stdout
        # the listing says which run a run went on from: the two are one model's training
        newest = json.loads(run_cli("runs", "--local", "--json").stdout)[0]
        assert (newest["status"], newest["resumed_from"]) == ("SUCCEEDED", run_dir.name)
        [line] = [ln for ln in run_cli("runs", "--local").stdout.splitlines() if ln.startswith(newest["name"])]
        assert f"resumed from {run_dir.name}" in line
    finally:
        run_cli("serve", "stop", "flaky")


def test_local_runs_are_listed_and_pruned_but_a_served_model_and_a_running_run_are_kept(trained_model):
    import shutil
    import time

    from kfp_pytorch.components.serve import ServeSpec, serve, stop_server

    root = Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs"
    now = time.time()

    def make(name, age_h, status=None, model=False):
        d = root / name
        (d / "train-op").mkdir(parents=True)
        (d / "train-op" / "executor_output.json").write_text("{}")
        (d / "prepare-data-op").mkdir()
        (d / "prepare-data-op" / "shard.npz").write_bytes(b"x" * 10_000)
        if model:
            shutil.copytree(trained_model.model_uri, d / "train-op" / "model")
        if status:
            result = ({"metrics": {"accuracy": 0.97124, "macro_f1": 0.97}, "gate_passed": True,
                       "model": {"registry_uri": f"models:/digits/{age_h}", "champion": age_h in (20, 50)}}
                      if status == "SUCCEEDED" else {})
            (d / "run.json").write_text(json.dumps({"status": status, "params": {"epochs": 3}, "result": result,
                                                    "elapsed_s": 125.0}))
        for f in [d, *d.rglob("*")]:
            os.utime(f, (now - age_h * 3600, now - age_h * 3600))
        return d

    make("train-and-serve-a", 50, "SUCCEEDED", model=True)  # its model is being served
    make("train-and-serve-b", 40, "FAILED")
    make("train-and-serve-c", 30)                           # killed long ago: no record
    make("train-and-serve-d", 20, "SUCCEEDED")
    make("train-and-serve-e", 0.1)                          # no record yet, writing: may be running
    make("train-and-serve-f", 0.05, "SUCCEEDED")
    damaged = make("train-and-serve-g", 0.2) / "run.json"  # half written (a full disk): it ended all the same
    damaged.write_text('{"status": ')
    for f in (damaged, damaged.parent):
        os.utime(f, (now - 0.2 * 3600, now - 0.2 * 3600))
    served = serve(ServeSpec(str(root / "train-and-serve-a" / "train-op" / "model"), "kept-model"))
    try:
        r = run_cli("runs", "--local")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()[1:]  # under the header
        assert [ln.split()[0] for ln in lines[:7]] == [f"train-and-serve-{x}" for x in "fegdcba"]
        assert [ln.split()[1] for ln in lines[:7]] == ["SUCCEEDED", "RUNNING?", "UNKNOWN", "SUCCEEDED", "UNKNOWN",
                                                       "FAILED", "SUCCEEDED"]
        assert lines[6].endswith("serving: kept-model") and "7 local run(s)" in lines[-1]
        assert lines[3].endswith("1 steps  accuracy 0.9712, models:/digits/20 (champion until version 50)")  # d
        assert "accuracy 0.9712, models:/digits/50 (champion)  serving: kept-model" in lines[6]  # a: the latest one
        assert lines[5].endswith("1 steps")  # b: it failed, and came to nothing
        assert " 2.1m " in lines[3] and re.search(r"\d\d:\d\d      -  ", lines[4]), lines  # how long it ran; c: no record
        [d_json] = [r for r in json.loads(run_cli("runs", "--local", "--json").stdout) if r["name"] == "train-and-serve-d"]
        assert d_json["elapsed_s"] == 125.0
        dry = run_cli("runs", "--local", "--keep", "1", "--dry-run")
        assert dry.returncode == 0 and "would remove 4 local run(s), 39.4 KB" in dry.stdout, dry.stdout
        # --json: one object on stdout, as `runs --local --json` is (it was answered in text)
        said = json.loads(run_cli("runs", "--local", "--keep", "1", "--dry-run", "--json").stdout)
        assert said["dry_run"] is True and said["keep"] == 1
        assert sorted(x["name"] for x in said["removed"]) == [f"train-and-serve-{x}" for x in "bcdg"]
        assert all(x["size_bytes"] > 0 and x["remote"] is None for x in said["removed"])
        assert {x["name"]: x["why"] for x in said["kept"]} == {
            "train-and-serve-a": "its model is served by kept-model",
            "train-and-serve-e": "no record and written within the hour: it may still be running"}
        assert said["registry_downloads"] == {"removed": [], "kept": []}
        assert len(list(root.iterdir())) == 7
        r = run_cli("runs", "--local", "--keep", "1")
        assert r.returncode == 0, r.stderr
        assert sorted(d.name for d in root.iterdir()) == [f"train-and-serve-{x}" for x in "aef"]
        assert "kept train-and-serve-a: its model is served by kept-model" in r.stdout
        assert "kept train-and-serve-e: no record and written within the hour: it may still be running" in r.stdout
        assert "removed 4 local run(s), 39.4 KB; kept the newest 1 and 2 more" in r.stdout
        # a server that died (a reboot) still keeps its model's run: `serve start` needs it
        psutil.Process(served.pid).kill()
        psutil.Process(served.pid).wait(10)
        assert run_cli("runs", "--local").stdout.splitlines()[3].endswith("serving: kept-model (down)")
        r = run_cli("runs", "--local", "--keep", "1")
        assert sorted(d.name for d in root.iterdir()) == [f"train-and-serve-{x}" for x in "aef"]
        assert ("kept train-and-serve-a: its model is served by kept-model (down); `kfp-pytorch serve start --all` "
                "starts what is down") in r.stdout
        assert run_cli("runs", "--local", "--keep", "0").returncode == 2  # a run is always kept
        r = run_cli("runs", "--local", "--host", "http://127.0.0.1:1")
        assert r.returncode == 2 and "leave out --host" in r.stderr
        r = run_cli("runs", "--local", env={"KFP_HOST": "http://127.0.0.1:1"})  # exported for submit: no matter
        assert r.returncode == 0 and "3 local run(s)" in r.stdout, r.stderr
        r = run_cli("runs", "--keep", "2", "--host", "http://127.0.0.1:1")
        assert r.returncode == 2 and "add --local" in r.stderr
    finally:
        stop_server("kept-model")
    assert served.pid and run_cli("runs", "--local", "--keep", "1").returncode == 0
    assert sorted(d.name for d in root.iterdir()) == ["train-and-serve-e", "train-and-serve-f"]


def test_pruning_a_run_that_wrote_to_s3_removes_its_artifacts_there_unless_a_server_serves_its_model(s3, bucket,
                                                                                                    trained_model):
    # `runs --local --keep` removed a run's folder and left everything its steps wrote under
    # storage_root on S3 (its shards, checkpoints and model, every night), and a local server
    # serving a run's model from S3 did not keep that run
    import time

    from kfp_pytorch.components.serve import ServeSpec, serve, stop_server

    root, now = Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs", time.time()
    runs = f"s3://{bucket}/runs"

    def make(name, age_h, storage_root=f"minio://{bucket}/runs/"):  # minio:// and a trailing slash: the same place
        d = root / name
        (d / "train-op").mkdir(parents=True)
        (d / "train-op" / "executor_output.json").write_text("{}")
        (d / "run.json").write_text(json.dumps({"status": "SUCCEEDED", "params": {"storage_root": storage_root}}))
        s3.upload_dir(trained_model.model_uri, f"{runs}/{name}/train-op/model")
        s3.write_bytes(f"{runs}/{name}/prepare-data-op/dataset/train/shard-00000.npz", b"x" * 1000)
        for f in [d, *d.rglob("*")]:
            os.utime(f, (now - age_h * 3600, now - age_h * 3600))

    make("s3run-served", 30)
    make("s3run-old", 20)
    make("s3run-new", 1)
    s3.write_bytes(f"{runs}/s3run-old-not-a-run/keep.txt", b"another prefix that starts alike")
    served = serve(ServeSpec(f"{runs}/s3run-served/train-op/model", "s3-kept"))
    try:
        listed = {x["name"]: x for x in json.loads(run_cli("runs", "--local", "--json").stdout)}
        assert listed["s3run-old"]["remote"] == f"{runs}/s3run-old"
        assert listed["s3run-served"]["served_by"] == ["s3-kept"]
        r = run_cli("runs", "--local", "--keep", "1", "--dry-run")
        assert r.returncode == 0, r.stderr
        assert "would remove s3run-old  SUCCEEDED" in r.stdout and f", and its artifacts on S3 under {runs}/s3run-old/" in r.stdout
        assert "kept s3run-served: its model is served by s3-kept" in r.stdout
        assert any(u.startswith(f"{runs}/s3run-old/") for u in s3.list(runs)) and (root / "s3run-old").is_dir()
        # the S3 server refuses the credentials: the run's folder, which says where they are, stays
        r = run_cli("runs", "--local", "--keep", "1", env={"AWS_SECRET_ACCESS_KEY": "wrong-secret"})
        assert r.returncode == 1
        assert f"kept s3run-old: its artifacts on S3 under {runs}/s3run-old/ could not be removed" in r.stderr
        assert "refused the credentials" in r.stderr and "run `kfp-pytorch runs --local --keep 1` again" in r.stderr
        assert "--leave-s3 removes their folders here only" in r.stderr
        r = run_cli("runs", "--local", "--keep", "1", "--json", env={"AWS_SECRET_ACCESS_KEY": "wrong-secret"})
        assert r.returncode == 1 and "1 run(s) kept: their artifacts on S3 could not be removed" in r.stderr
        kept = {x["name"]: x["why"] for x in json.loads(r.stdout)["kept"]}  # JSON on stdout, with why
        assert kept["s3run-old"].startswith(f"its artifacts on S3 under {runs}/s3run-old/ could not be removed")
        assert "refused the credentials" in kept["s3run-old"]
        assert (root / "s3run-old").is_dir() and any(u.startswith(f"{runs}/s3run-old/") for u in s3.list(runs))
        for flag in ("--dry-run", "--leave-s3"):  # alone, it said nothing and did nothing
            r = run_cli("runs", "--local", flag)
            assert r.returncode == 2 and f"{flag} goes with --keep N" in r.stderr
        r = run_cli("runs", "--local", "--keep", "1")
        assert r.returncode == 0, r.stderr
        assert "removed s3run-old  SUCCEEDED" in r.stdout
        left = s3.list(runs)
        assert not any(u.startswith(f"{runs}/s3run-old/") for u in left) and not (root / "s3run-old").exists()
        assert f"{runs}/s3run-old-not-a-run/keep.txt" in left  # another prefix, though its name starts alike
        assert f"{runs}/s3run-served/train-op/model/metadata.json" in left and (root / "s3run-served").is_dir()
        assert any(u.startswith(f"{runs}/s3run-new/") for u in left)
        # its S3 server is gone for good: --leave-s3 removes the folder here, and leaves the objects
        make("s3run-oldest", 40)
        r = run_cli("runs", "--local", "--keep", "1", "--leave-s3", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
        assert r.returncode == 0, r.stderr
        assert "removed s3run-oldest  SUCCEEDED" in r.stdout and f"left its artifacts on S3 under {runs}/s3run-oldest/" in r.stdout
        assert not (root / "s3run-oldest").exists() and any(u.startswith(f"{runs}/s3run-oldest/") for u in s3.list(runs))
    finally:
        stop_server(served.name)


def test_resuming_a_run_that_succeeded_with_nothing_changed_is_refused_before_any_step(tmp_path):
    # `run --resume` of a run that succeeded, with no parameter changed, trained no epoch and
    # registered the same model again as a new version (and served nothing new): a slip, said
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines import get_pipeline
    from kfp_pytorch.pipelines.local import refuse_idle_resume, run_local

    entry = get_pipeline("train_and_serve")
    params = entry.resolve({"epochs": 3})
    root = Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs"

    def make(name, status):
        (root / name / "train-op").mkdir(parents=True)
        (root / name / "train-op" / "executor_output.json").write_text("{}")
        (root / name / "run.json").write_text(json.dumps({"pipeline": "train_and_serve", "status": status,
                                                          "params": params, "elapsed_s": 30.0}, default=str))

    make("train-and-serve-done", "SUCCEEDED")
    make("train-and-serve-failed", "FAILED")
    r = run_cli("run", "train_and_serve", "--local", "--resume", "train-and-serve-done")
    assert r.returncode == 2 and "Error: nothing to resume:" in r.stderr, r.stderr
    assert ("--resume: train-and-serve-done succeeded with these parameters: resumed unchanged, it would train no "
            "epoch more and register the same model again") in r.stderr
    assert "hint: -p epochs=N, more than its 3, trains on from its last checkpoint; leave out --resume" in r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["train-and-serve-done", "train-and-serve-failed"]  # no run began
    with pytest.raises(ConfigError, match="nothing to resume"):  # the Python API too
        run_local(entry, params, root, resume="train-and-serve-done")
    # what does something is resumed: more epochs, another gate, a run that failed (its later steps again)
    refuse_idle_resume("train-and-serve-done", {**params, "epochs": 5}, root)
    refuse_idle_resume("train-and-serve-done", {**params, "threshold": 0.5}, root)
    refuse_idle_resume("train-and-serve-failed", params, root)


def test_a_run_whose_process_is_gone_is_listed_as_killed_and_pruned_and_one_whose_process_lives_is_kept():
    # a run killed outright leaves no record: listed as RUNNING? for an hour, then UNKNOWN, and a
    # run still going that wrote nothing for an hour (a long epoch) could be pruned under it
    import time

    from kfp_pytorch.components._kfp import RUN_START_FILE
    from kfp_pytorch.components.processes import identity

    root = Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs"
    now = time.time()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)

    def make(name, age_h, owner):
        d = root / name
        (d / "prepare-data-op").mkdir(parents=True)
        (d / "prepare-data-op" / "executor_output.json").write_text("{}")
        if owner is not None:
            (d / RUN_START_FILE).write_text(owner if isinstance(owner, str) else json.dumps({"owner": owner}))
        for f in [d, *d.rglob("*")]:
            os.utime(f, (now - age_h * 3600, now - age_h * 3600))

    reused = identity(live.pid) | {"start_ticks": identity(live.pid)["start_ticks"] - 1}  # its pid, given again
    try:
        make("train-and-serve-a", 3, identity(live.pid))  # running, silent for 3 hours
        make("train-and-serve-b", 0.1, identity(gone.pid))  # its process was killed minutes ago
        make("train-and-serve-c", 0.2, reused)
        make("train-and-serve-d", 0.3, "{not json")  # damaged: no claim, the clock decides
        make("train-and-serve-e", 0.4, None)  # a run from before its steps named their process
        make("train-and-serve-f", 0.01, identity(live.pid))
        lines = run_cli("runs", "--local").stdout.splitlines()[1:6]
        assert {ln.split()[0][-1]: ln.split()[1] for ln in lines} == {
            "b": "KILLED", "c": "KILLED", "d": "RUNNING?", "e": "RUNNING?", "f": "RUNNING"}
        assert lines[0].split()[2] == "-" and re.match(r"\d{4}-", lines[1].split()[2])  # f has not ended; b has
        listed = {r["name"][-1]: r for r in json.loads(run_cli("runs", "--local", "--json").stdout)}
        assert listed["a"]["status"] == "RUNNING" and listed["a"]["owner_pid"] == live.pid
        assert listed["b"]["owner_pid"] is None
        # what --resume refuses, before any step: a run that kept no parameters, another pipeline's
        r = run_cli("run", "train_and_serve", "--local", "--resume", "train-and-serve-b")
        assert r.returncode == 2 and "--resume: train-and-serve-b kept no record of its parameters" in r.stderr
        other = root / "train-and-serve-c" / RUN_START_FILE
        other.write_text(json.dumps({"owner": reused, "pipeline": "nightly_eval", "params": {"epochs": 3}}))
        for f in (other, other.parent):  # as old as it was
            os.utime(f, (now - 0.2 * 3600, now - 0.2 * 3600))
        r = run_cli("run", "train_and_serve", "--local", "--resume", "train-and-serve-c")
        assert r.returncode == 2 and "train-and-serve-c is a run of pipeline nightly_eval, not train_and_serve" in r.stderr
        assert "kfp-pytorch run nightly_eval --local --resume train-and-serve-c" in r.stderr
        r = run_cli("runs", "--local", "--keep", "1")
        assert r.returncode == 0, r.stderr
        assert sorted(d.name[-1] for d in root.iterdir()) == ["a", "d", "e", "f"], r.stdout
        assert f"kept train-and-serve-a: it is running (process {live.pid})" in r.stdout
        assert "removed train-and-serve-b  KILLED" in r.stdout and "removed 2 local run(s)" in r.stdout
    finally:
        live.kill()
        live.wait(30)
    # its process ended too, without a record: no longer kept
    assert run_cli("runs", "--local").stdout.splitlines()[1].split()[:2] == ["train-and-serve-f", "KILLED"]


def test_registered_versions_downloaded_to_serve_are_pruned_by_keep_unless_a_server_uses_them(trained_model):
    # `serve start --model-uri models:/...` downloads each version it serves into the home, where
    # they piled up unseen: `runs --local` neither counted nor pruned them
    import shutil
    import time

    from kfp_pytorch.components.serve import ServeSpec, serve, stop_server

    cache = Path(os.environ["KFP_PYTORCH_HOME"]) / "registry_models"
    now = time.time()

    def download(name, age_h):
        d = cache / name
        shutil.copytree(trained_model.model_uri, d / "artifacts" / "model")
        (d / "MLmodel").write_text("flavors: {}\n")
        os.utime(d, (now - age_h * 3600, now - age_h * 3600))
        return d

    served_dir = download("digits-v1-aaaaaaaaaa", 30)
    download("digits-v2-bbbbbbbbbb", 20)          # served once, then stopped: nothing uses it
    download("digits-v3-cccccccccc", 0.2)         # just wanted by a `serve start` or `serve predict`
    (cache / ".digits-v4-xyz").mkdir()            # a download in progress
    served = serve(ServeSpec(str(served_dir / "artifacts" / "model"), "from-registry"))
    try:
        r = run_cli("runs", "--local")
        assert r.returncode == 0, r.stderr
        size = sum(f.stat().st_size for f in served_dir.rglob("*") if f.is_file())
        assert r.stdout.splitlines()[-1] == (f"3 registered version(s) downloaded to serve, {3 * size / 1024:.1f} KB "
                                             f"under {cache}; --keep also removes the 2 that no server uses")
        dry = run_cli("runs", "--local", "--keep", "1", "--dry-run")
        assert f"would remove digits-v2-bbbbbbbbbb  (downloaded from the registry) {size / 1024:.1f} KB" in dry.stdout
        assert len(list(cache.iterdir())) == 4
        r = run_cli("runs", "--local", "--keep", "1")
        assert r.returncode == 0, r.stderr
        assert sorted(d.name for d in cache.iterdir() if not d.name.endswith(".lock")) == [
            ".digits-v4-xyz", "digits-v1-aaaaaaaaaa", "digits-v3-cccccccccc"]
        assert "kept digits-v1-aaaaaaaaaa: served by from-registry" in r.stdout
        assert "kept digits-v3-cccccccccc: wanted within the hour" in r.stdout
        assert (f"removed 1 registered version(s) downloaded to serve, {size / 1024:.1f} KB; the registry keeps them "
                "(`serve start --model-uri` downloads one again)") in r.stdout
        # a server that is down keeps its version: `serve start` starts it again from that folder
        psutil.Process(served.pid).kill()
        psutil.Process(served.pid).wait(10)
        r = run_cli("runs", "--local", "--keep", "1")
        assert "kept digits-v1-aaaaaaaaaa: served by from-registry (down)" in r.stdout and served_dir.is_dir()
    finally:
        stop_server("from-registry")
    assert run_cli("runs", "--local", "--keep", "1").returncode == 0 and not served_dir.exists()


def test_the_end_of_a_run_notes_local_runs_that_piled_up(tmp_path):
    from kfp_pytorch.pipelines.local import PILE_RUNS, pile_note

    root = tmp_path / "local_outputs"
    for i in range(PILE_RUNS):
        (root / f"train-and-serve-{i}").mkdir(parents=True)
    assert pile_note(root) is None
    (root / "train-and-serve-x").mkdir()
    assert pile_note(root) == (f"21 local runs hold 0.0 GB under {root}; `kfp-pytorch runs --local --keep 5` "
                               "removes all but the newest 5 (a served model's run is kept)")
    assert pile_note(tmp_path / "none") is None


def test_the_summary_says_how_to_use_and_stop_the_served_model(capsys):
    from kfp_pytorch.cli.pipelines import _print_summary

    s = {"pipeline": "train_and_serve", "status": "SUCCEEDED", "gate_passed": True,
         "metrics": {"accuracy": 0.97, "accuracy_ci95_low": 0.944, "accuracy_ci95_high": 0.985, "test_rows": 270},
         "endpoint": "http://127.0.0.1:8080/v2/models/digits-x/infer", "artifacts": {}}
    _print_summary(s)
    out = capsys.readouterr().out
    assert "metrics:   accuracy=0.9700 (95% 0.944-0.985 on 270 test rows)\n" in out
    assert "predict a table with:  kfp-pytorch serve predict digits-x TABLE.csv\n" in out
    assert "stop the server with:  kfp-pytorch serve stop digits-x\n" in out  # with --no-predict too
    assert "gate:      passed\n" in out  # a summary without the gate's figures (an older run's)
    assert "training:" not in out
    _print_summary({**s, "data": {"rows": {"train": 90, "val": 20, "test": 20}, "num_features": 4, "classes": [0, 1],
                                  "source_format": "semicolon-separated, decimal commas"}})
    assert ("data:      90/20/20 rows (train/val/test), 4 features, 2 classes; read as semicolon-separated, "
            "decimal commas\n") in capsys.readouterr().out
    _print_summary({**s, "data": {"rows": {"train": 90, "val": 20, "test": 20}, "num_features": 1, "classes": [0, 1]}})
    assert "data:      90/20/20 rows (train/val/test), 1 feature, 2 classes\n" in capsys.readouterr().out
    _print_summary({**s, "training": {"epochs_trained": 14, "exported_epoch": 11, "val_accuracy": 0.9}})
    assert "training:  14 epoch(s), stopped early; the model is epoch 11's, the best on validation\n" in (
        capsys.readouterr().out)
    _print_summary({**s, "training": {"epochs_trained": 8, "exported_epoch": 8, "val_accuracy": 0.9}})
    assert "training:  8 epoch(s)\n" in capsys.readouterr().out
    data = {"rows": {"train": 104, "val": 23, "test": 23}, "num_features": 4, "classes": [0, 1, 2],
            "duplicates": {"rows": 1, "test_rows_in_train": 0, "conflicting": 0}}
    _print_summary({**s, "data": data})
    out = capsys.readouterr().out
    assert "data:      104/23/23 rows (train/val/test), 4 features, 3 classes\n" in out and "warning" not in out
    _print_summary({**s, "data": {**data, "duplicates": {"rows": 1, "test_rows_in_train": 1, "conflicting": 0}}})
    assert "  warning: 1 of the 23 test rows are also training rows, so the test metrics are optimistic (1 " in (
        capsys.readouterr().out)
    assert "weakest:" not in out
    _print_summary({**s, "weakest_class": {"class": "versicolor", "recall": 0.875, "correct": 7, "rows": 8,
                                           "taken_for": "virginica", "taken_rows": 1}})
    assert ("weakest:   class 'versicolor', recall 0.8750 (7 of 8 test rows); 1 taken for 'virginica'\n"
            in capsys.readouterr().out)
    _print_summary({**s, "weakest_class": {"class": "8", "recall": 0.8846, "correct": 23, "rows": 26,
                                           "taken_for": "1", "taken_rows": 2}})
    assert "weakest:   class 8, recall 0.8846 (23 of 26 test rows); 2 taken for 1\n" in capsys.readouterr().out
    _print_summary({**s, "gate_passed": False, "endpoint": None, "gate": {"metric": "accuracy", "threshold": 0.98}})
    out = capsys.readouterr().out
    assert "serve stop" not in out
    assert ("gate:      FAILED (accuracy 0.9700 < threshold 0.9800): the model was neither registered nor served\n"
            in out)
    assert "next:" not in out  # a summary without advice (an older run's) gets no line for it
    _print_summary({**s, "gate_passed": False, "gate": {"metric": "accuracy", "threshold": 0.98, "advice": "to pass"}})
    assert ("the model was neither registered nor served\nnext:      to pass\n" in capsys.readouterr().out)


def test_a_failed_gate_is_answered_with_what_to_rerun_with():
    from kfp_pytorch.pipelines.local import gate_advice

    values = {"epochs": 8, "lr": 0.005, "gate_metric": "accuracy", "class_weight": "none"}
    assert gate_advice(values, {"gate_passed": True}) is None
    assert gate_advice(values, {}) is None  # a run that never reached the gate
    assert gate_advice({"threshold": 0.9}, {"gate_passed": False}) is None  # a pipeline without epochs
    full = {"epochs_trained": 8, "exported_epoch": 8}
    assert gate_advice(values, {"gate_passed": False, "training": full}) == (
        "to pass the gate: train longer: -p epochs=16 (this run trained 8)")
    # early stopping ended it: more epochs would stop at the same place
    early = {"epochs_trained": 5, "exported_epoch": 2}
    assert gate_advice(values, {"gate_passed": False, "training": early}) == (
        "to pass the gate: training stopped early (validation loss last fell at epoch 2), so more epochs would "
        "not help: try a lower -p lr (this run's: 0.005), another -p model_arch, or more data")
    # a gate on the rare classes, with a loss that lets the common ones outweigh them
    for metric in ("macro_f1", "min_recall"):
        assert gate_advice({**values, "gate_metric": metric}, {"gate_passed": False, "training": full}).endswith(
            "; -p class_weight=balanced, so that rare classes weigh as much in the loss")
    assert "class_weight" not in gate_advice({**values, "gate_metric": "macro_f1", "class_weight": "balanced"},
                                             {"gate_passed": False, "training": full})


def test_code_that_reads_a_runs_outputs_is_told_why_there_are_none(tmp_path):
    # the notebook read summary["metrics"] and summary["server_url"]: a failed step, a failed gate
    # or an older champion ended in a KeyError, not in what happened
    from kfp_pytorch.components.errors import PipelineFailed, ServingError
    from kfp_pytorch.pipelines.local import LocalRun, served_url

    ok = LocalRun("train_and_serve", tmp_path, True)
    assert ok.raise_for_status() is ok
    failed = LocalRun("train_and_serve", tmp_path, False, failed_task="train-op",
                      error="TrainingError: training workers failed\n  hint: see the log")
    with pytest.raises(PipelineFailed) as e:
        failed.raise_for_status()
    assert str(e.value) == ("pipeline train_and_serve failed in train-op:\n  TrainingError: training workers failed\n"
                            f"    hint: see the log\n  hint: the run's whole log: {tmp_path / 'run.log'}")

    base = {"pipeline": "train_and_serve", "status": "SUCCEEDED"}
    assert served_url({**base, "server_url": "http://127.0.0.1:8080"}) == "http://127.0.0.1:8080"
    with pytest.raises(PipelineFailed, match=r"^pipeline train_and_serve failed in evaluate-op:\n  ValueError: x\n"
                                             r"  hint: the run's whole log: /r/run.log$"):
        served_url({**base, "status": "FAILED", "failed_task": "evaluate-op", "error": "ValueError: x",
                    "log": "/r/run.log"})
    with pytest.raises(ServingError, match=r"gate failed, so the model was neither registered nor served "
                                           r"\(accuracy=0\.4200\)\n  hint: train longer"):
        served_url({**base, "gate_passed": False, "metrics": {"accuracy": 0.42, "test_rows": 90}})
    with pytest.raises(ServingError, match=r"^the run served nothing: version 3 did not beat the champion"):
        served_url({**base, "gate_passed": True,
                    "not_served": "version 3 did not beat the champion (only a new champion is served)"})
    with pytest.raises(ServingError, match="pipeline train_only serves no model"):
        served_url({"pipeline": "train_only", "status": "SUCCEEDED"})


def test_a_run_whose_champion_no_local_server_serves_names_the_command_that_serves_it(tmp_path, capsys):
    # a retraining that did not beat the champion serves nothing; where the champion's server was
    # stopped (no record), the summary said only "only a new champion is served", and `serve list`
    # (which the CLI points to) showed nothing: no endpoint, and no word on how to get one
    from kfp_pytorch.components.serve import _write_record
    from kfp_pytorch.pipelines.local import LocalRun, summarize

    note = "version 3 is registered, not champion: accuracy 0.9 does not beat version 1's 0.95"
    outputs = {"register-op": {"parameterValues": {"registry_uri": "models:/digits/3", "version": 3,
                                                   "champion": False, "note": note}}}

    def not_served(**params):
        return summarize(LocalRun("train_and_serve", tmp_path, True, outputs, params=params))["not_served"]

    said = f"{note} (only a new champion is served); no model server on this machine serves the champion "
    assert not_served(tracking_uri="", serve_backend="local") == (
        said + "(`kfp-pytorch serve start digits --model-uri models:/digits@champion` starts one)")
    assert not_served(tracking_uri="http://mlflow:5000/x y", serve_backend="local") == (  # the run's registry
        said + "(`kfp-pytorch serve start digits --model-uri models:/digits@champion "
               "--tracking-uri 'http://mlflow:5000/x y'` starts one)")
    # served by KServe, on a cluster: no local command applies
    assert not_served(tracking_uri="", serve_backend="cluster") == f"{note} (only a new champion is served)"
    # a record of a server that is down (no pid above Linux's limit lives): starting it again
    _write_record("digits", {"pid": 2 ** 22 + 7, "url": "http://127.0.0.1:1", "infer_url": "http://127.0.0.1:1/x",
                            "model_uri": "/m"})
    assert not_served(tracking_uri="", serve_backend="local") == (
        f"{note} (only a new champion is served); its local server is down (`kfp-pytorch serve start digits`)")

    # the CLI's line: the command where there is one, else where to look
    from kfp_pytorch.cli.pipelines import _print_summary

    def printed(said):
        _print_summary({"pipeline": "train_and_serve", "status": "SUCCEEDED", "not_served": said})
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("serve:")]

    assert printed(not_served()) == [f"serve:     skipped: {not_served()}"]
    assert printed("version 3 did not beat the champion") == [
        "serve:     skipped: version 3 did not beat the champion; `kfp-pytorch serve list` shows what serves"]


def test_a_steps_error_is_read_from_its_log_with_its_problems_and_hint():
    from kfp_pytorch.pipelines.local import error_of

    log = ["    Traceback (most recent call last):", '      File "x.py", line 3, in <module>',
           "    kfp_pytorch.components.errors.DatasetError: dataset /d.csv failed validation:",
           "      - column 'a': 3 NaN value(s)", "      - column 'b': must be numeric, got dtype object",
           "      hint: fix the problems above", "", "\x1b[91m07:28:37.053 - ERROR - Task 'prepare-data-op' failed\x1b[0m"]
    assert error_of(log) == ("DatasetError: dataset /d.csv failed validation:\n  - column 'a': 3 NaN value(s)\n"
                             "  - column 'b': must be numeric, got dtype object\n  hint: fix the problems above")
    ranks = ["    [rank0]: ValueError: in a worker", "    RuntimeError: the launcher's own", "    [rank1]: KeyError: x"]
    assert error_of(ranks) == "RuntimeError: the launcher's own"  # a worker's copy is not the step's error
    assert error_of(["all fine", "   "]) is None


def test_failed_task_is_read_from_kfp_locals_coloured_message():
    from kfp_pytorch.pipelines.local import failed_task_of

    coloured = ("Pipeline \x1b[95m'train-and-serve'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m. "
                "Inner task failed: \x1b[96m'train-op'\x1b[0m.")
    assert failed_task_of(coloured) == "train-op"
    assert failed_task_of("Pipeline 'p' finished with status FAILURE. Inner task failed: 'evaluate-op'.") == "evaluate-op"
    assert failed_task_of("something else") is None


@pytest.mark.parametrize("args,needle", [
    (["run", "no_such_pipeline", "--local"], "unknown pipeline 'no_such_pipeline'"),
    (["run", "train_and_serve", "--local", "--param", "epoch=3"], "did you mean 'epochs'"),
    (["run", "train_and_serve", "--local", "--param", "epochs=three"], "epochs: expected integer, got 'three'"),
    (["run", "train_and_serve", "--local", "--param", "model_name=Bad_Name", "--param", "lr=-1"], "lr: must be a finite number > 0"),
    # scikit-learn's split refused it in the prepare step, a traceback in the task's log
    (["run", "train_and_serve", "--local", "--param", "seed=-1"], "seed: must be an integer from 0 to 4294967295, got -1"),
    (["run", "train_and_serve", "--local", "--param", "dataset_uri=/nonexistent/data.csv"], "dataset not found"),
    (["run", "train_and_serve", "--local", "--param", "dataset_uri=/"], "dataset / is a directory without Parquet files"),  # a traceback once
    (["run", "train_and_serve", "--local", "--param", "model_arch=nosuchpkg_q.models:net"],
     "cannot import model factory module 'nosuchpkg_q.models'"),
    (["run", "train_and_serve", "--local", "--param", "batch_size"], "expected key=value"),
    # a sample there is not: it was found by the prepare step, with its traceback in the step's log
    (["run", "train_and_serve", "--local", "-p", "dataset_uri=sample://digit"],
     "dataset_uri: unknown sample dataset 'digit'; did you mean sample://digits?"),
    (["submit", "train_and_serve", "--host", "http://127.0.0.1:9", "-p", "dataset_uri=sample://iris"],
     "dataset_uri: unknown sample dataset 'iris'; the samples: sample://digits (or give a table"),
    (["run", "train_and_serve", "--local", "--param", "epochs=3", "--param", "epochs=30"],
     "--param epochs: given twice ('3' and '30'); give it once"),
    (["run", "train_and_serve", "--local", "--param", "model_arch=factories:three_outputs"],
     "the model of factory 'factories:three_outputs' answers [2, 3] for a batch of 2, not logits [2, 10]"),
    (["run", "train_and_serve", "--local", "--param", "model_arch=json:dumps"],
     "model factory 'json:dumps' takes dumps(obj, *, skipkeys=False"),
    (["run", "train_and_serve", "--local", "--param", "storage_root=s3://b/runs"],
     "storage_root: URI 's3://b/runs': 'b' is not a valid bucket name (bucket names are 3-63 characters"),
    (["manifest", "pytorchjob", "--image", "reg/kfp-pytorch:0.1.0", "--param", "dataset_uri=s3://-data/x.csv"],
     "dataset_uri: URI 's3://-data/x.csv': '-data' is not a valid bucket name"),
    (["run", "train_and_serve", "--local", "--param", "serve_min_replicas=4", "--param", "serve_max_replicas=2"],
     "serve_min_replicas: must be in [1, serve_max_replicas=2], got 4"),
    # found by the workers, after the data was prepared
    (["run", "train_and_serve", "--local", "--param", "model_arch=cnn", "--param",
      "feature_columns=pixel_0_0,pixel_0_1,pixel_0_2"], "model 'cnn' needs an image, and the table's 3 feature columns"),
    (["run", "train_and_serve", "--local", "--param", "weight_decay=1.5"],
     "weight_decay: must be a number in [0, 1) (0: none; 0.01 is AdamW's usual), got 1.5"),
    (["run", "train_and_serve", "--local", "--param", "lr_schedule=step"],
     "lr_schedule: must be one of constant, cosine, got 'step'"),
    (["run", "train_and_serve", "--local", "--param", "class_weight=auto"],
     "class_weight: must be one of none, balanced, got 'auto'"),
    (["run", "train_and_serve", "--local", "--param", "gate_metric=auc"],
     "gate_metric: must be one of accuracy, macro_f1, min_recall, got 'auc'"),
    (["run", "train_and_serve", "--local", "--param", "early_stopping_patience=-2"],
     "early_stopping_patience: must be an integer >= 0 (0: train every epoch), got -2"),
    (["run", "train_and_serve", "--local", "--param", "feature_columns=pixel_0_0, label"],
     "feature_columns: must not hold the label column 'label' (the model would be given the answer)"),
    # a bundled sample's columns are checked before any step too
    (["run", "train_and_serve", "--local", "--param", "feature_columns=pixel_0_0,pixel_9_9"],
     "feature column 'pixel_9_9' is missing (columns: pixel_0_0, pixel_0_1,"),
])
def test_bad_input_is_a_clear_error(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-1000:])
    assert needle in r.stderr and "Traceback" not in r.stderr and "hint:" in r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()  # nothing ran


def test_run_without_local_says_that_a_server_run_is_submit():
    # it was click's "Missing option '--local'.": a flag that must be given, with no word of why
    r = run_cli("run", "train_and_serve")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "add --local" in r.stderr and "kfp-pytorch submit train_and_serve --host URL" in r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()


@pytest.mark.parametrize("command", [["run", "--local"], ["compile", "-o", "x.yaml"], ["submit"], ["schedule"]])
def test_a_missing_pipeline_names_the_pipelines_there_are(command):
    # it was click's bare "Missing argument 'PIPELINE'.": which names it takes was in another command
    r = run_cli(*command)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert ("Missing argument 'PIPELINE'. Name one of the pipelines: train_and_serve (kfp-pytorch pipelines lists "
            "them with their parameters).") in r.stderr


def test_a_missing_name_or_id_says_where_to_find_it():
    # each was click's bare "Missing argument 'NAME'.": the list of what it takes is in another command
    from kfp_pytorch.components.serve import _pidfile

    for command in (["serve", "logs"], ["serve", "predict"]):
        r = run_cli(*command)
        assert r.returncode == 2 and ("Missing argument 'NAME'. There are no local model servers here: a pipeline's "
                                      "serve step starts one (kfp-pytorch run train_and_serve --local).") in r.stderr
    for name in ("iris", "digits"):  # records of servers that are down: still theirs to name
        _pidfile(name).write_text(json.dumps({"name": name, "url": "http://127.0.0.1:9", "pid": None,
                                              "infer_url": f"http://127.0.0.1:9/v2/models/{name}/infer"}))
    r = run_cli("serve", "logs")
    assert r.returncode == 2 and ("Missing argument 'NAME'. Name one of the local model servers: digits, iris "
                                  "(kfp-pytorch serve list shows them).") in r.stderr, r.stderr
    many = [f"m{i:02d}" for i in range(12)]
    for name in many:
        _pidfile(name).write_text(json.dumps({"name": name, "url": "http://127.0.0.1:9", "pid": None,
                                              "infer_url": f"http://127.0.0.1:9/v2/models/{name}/infer"}))
    r = run_cli("serve", "logs")  # a dozen more: the first eight, and how many else
    assert ("Name one of the local model servers: digits, iris, m00, m01, m02, m03, m04, m05 and 6 more "
            "(kfp-pytorch serve list shows them).") in r.stderr, r.stderr
    r = run_cli("serve", "logs", "zzz")  # a name there is not: the same eight
    assert r.returncode == 1 and "no log for a local model server named 'zzz' (" in r.stderr
    assert "; the servers: digits, iris, m00, m01, m02, m03, m04, m05 and 6 more\n" in r.stderr, r.stderr
    r = run_cli("serve", "stop")  # and the servers to name, when none is
    assert r.returncode == 2 and ("give the names of the servers to stop (down: digits, iris, m00, m01, m02, m03, m04, "
                                  "m05 and 6 more), or --all") in r.stderr, r.stderr
    for name in many:
        _pidfile(name).unlink()
    # serve stop|start with neither names nor --all: the servers there are, up and down
    from kfp_pytorch.components.processes import start_ticks

    up = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:  # a live process of "digits" (as the stale-record test makes one): the record reads it as up
        _pidfile("digits").write_text(json.dumps({"name": "digits", "url": "http://127.0.0.1:9", "pid": up.pid,
                                                  "infer_url": "http://127.0.0.1:9/v2/models/digits/infer",
                                                  "start_ticks": start_ticks(up.pid),
                                                  "create_time": psutil.Process(up.pid).create_time()}))
        r = run_cli("serve", "stop")
        assert r.returncode == 2 and "give the names of the servers to stop (down: iris; up: digits), or --all" in r.stderr
        r = run_cli("serve", "start")
        assert r.returncode == 2 and "give the names of the servers to start (down: iris), or --all" in r.stderr
        r = run_cli("serve", "start", "iris", "--all")
        assert r.returncode == 2 and "give the names of the servers to start, or --all, not both" in r.stderr
        assert up.poll() is None and _pidfile("iris").exists()  # nothing stopped, nothing removed
    finally:
        up.kill()
        up.wait()
    for command in (["follow"], ["cancel"]):
        r = run_cli(*command)
        assert r.returncode == 2 and "Missing argument 'RUN_ID'. Give the KFP run's id: kfp-pytorch runs --host URL" in r.stderr
    for command in (["unschedule"], ["pause-schedule"], ["resume-schedule"]):
        r = run_cli(*command)
        assert r.returncode == 2 and ("Missing argument 'NAME'. Give the recurring run's name: kfp-pytorch schedules "
                                      "--host URL lists them.") in r.stderr


def test_every_required_argument_and_option_says_what_to_give_when_missing():
    # click's bare "Missing argument 'URI'." names a slot, not what goes in it: each required one
    # says what to give (and where to find it), as the ones above do
    import click
    from click.testing import CliRunner

    from kfp_pytorch.cli import cli

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    bare = [f"{path} {p.name}" for path, cmd in walk(cli, "kfp-pytorch") for p in cmd.params
            if p.required and not p.type.get_missing_message(param=p, ctx=click.Context(cmd))]
    assert not bare, bare
    for args, said in [(["storage", "cp", "iris.csv"], "Missing argument 'DEST'. Give SOURCE and DEST: kfp-pytorch "
                                                         "storage cp iris.csv s3://BUCKET/datasets/ uploads"),
                       (["storage", "mb"], "Missing argument 'URI'. Name the bucket to make: s3://NAME"),
                       (["storage", "cat"], "Missing argument 'URI...'. Name the objects: s3://BUCKET/KEY"),
                       (["compile", "train_and_serve"], "Missing option '-o' / '--output'. Say where the KFP IR YAML goes"),
                       (["serve", "predict", "digits"], "Missing argument 'TABLE'. Give the table to predict: a CSV"),
                       (["schedule", "train_and_serve", "--host", "http://127.0.0.1:9"],
                        "Missing option '--cron'. Say when it runs: --cron \"0 0 3 * * *\"")]:
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and said in r.output, r.output


@pytest.mark.parametrize("args, option, wanted", [
    (["run", "train_and_serve", "--local", "--epochs", "3"], "--epochs", "--param epochs=3"),
    (["submit", "train_and_serve", "--batch-size=32"], "--batch-size", "--param batch_size=32"),
    (["compile", "train_and_serve", "-o", "x.yaml", "--lr"], "--lr", "--param lr=VALUE"),
    (["manifest", "pytorchjob", "--workers", "4"], "--workers", "--param workers=4"),
])
def test_a_pipeline_parameter_given_as_an_option_is_answered_with_its_param(args, option, wanted):
    # it was click's "No such option '--epochs'.": the parameter is right there in `pipelines`
    r = run_cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"No such option '{option}'. Pipeline parameters are given with --param: {wanted}" in r.stderr, r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()


def test_every_command_that_takes_pipeline_parameters_takes_them_as_p_too(tmp_path):
    # Argo's submit -p key=value (what KFP runs on): `run -p epochs=3` was "No such option '-p'"
    from kfp_pytorch.cli import cli

    takes = {name: cmd for name, cmd in cli.commands.items()
             if any(p.name == "params" for p in cmd.params)}
    assert set(takes) == {"compile", "run", "submit", "schedule", "manifest"}
    for name, cmd in takes.items():
        opts = next(p for p in cmd.params if p.name == "params").opts
        assert opts == ["-p", "--param"], (name, opts)
    out = tmp_path / "p.yaml"
    r = run_cli("compile", "train_and_serve", "-o", str(out), "-p", "epochs=3", "-plabel_column=species")
    assert r.returncode == 0 and r.stdout == f"wrote {out} (defaults: epochs=3, label_column=species)\n", r.stderr
    params = yaml.safe_load(out.read_text())["root"]["inputDefinitions"]["parameters"]
    assert params["epochs"]["defaultValue"] == 3 and params["label_column"]["defaultValue"] == "species"


def test_an_unknown_option_that_names_no_parameter_keeps_clicks_error():
    r = run_cli("run", "train_and_serve", "--local", "--predic")
    assert r.returncode == 2 and "No such option '--predic'" in r.stderr and "--param" not in r.stderr
    assert "Did you mean one of: '--no-predict', '--predict'?" in r.stderr, r.stderr


@pytest.mark.parametrize("command", [["run", "train_and_serve", "--local"], ["serve", "list"], ["runs", "--local"]])
def test_a_home_that_cannot_be_a_folder_is_named_by_its_variable(tmp_path, command):
    # it was "Error: File exists: /path": no word of KFP_PYTORCH_HOME, where the path came from
    taken = tmp_path / "a-file"
    taken.write_text("x")
    for home, why in ((taken, "is a file, not a folder"), (taken / "sub", "cannot be made (Not a directory)")):
        r = run_cli(*command, env={"KFP_PYTORCH_HOME": str(home)})
        assert r.returncode == 2 and f"KFP_PYTORCH_HOME={home} {why}" in r.stderr, r.stderr
        assert "point KFP_PYTORCH_HOME at a writable folder" in r.stderr and "Traceback" not in r.stderr


def test_a_malformed_mlflow_tracking_uri_in_the_environment_is_found_before_any_step():
    # the steps use it when tracking_uri is empty: MLflow refused it in the train step, a traceback
    r = run_cli("run", "train_and_serve", "--local", env={"MLFLOW_TRACKING_URI": "mlflow.kubeflow:5000"})
    assert r.returncode == 2 and "MLFLOW_TRACKING_URI: must be an MLflow server (http(s)://HOST[:PORT]) or a store " \
                                 "URI" in r.stderr and "got 'mlflow.kubeflow:5000'" in r.stderr, r.stderr
    assert "fix or unset MLFLOW_TRACKING_URI" in r.stderr and "Traceback" not in r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()  # nothing ran


def test_a_tracking_server_that_does_not_answer_is_found_before_any_step():
    # found by the train step, after the data was prepared and the model trained
    r = run_cli("run", "train_and_serve", "--local", "--param", f"tracking_uri=http://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "cannot reach the MLflow tracking server at http://127.0.0.1:" in r.stderr
    assert "mlflow server" in r.stderr and "Traceback" not in r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()  # nothing ran


def _training_run(model_name: str, *params: str) -> tuple[subprocess.Popen, list]:
    """`run --local` of a run that trains until stopped, once its workers run; and the processes
    it started by then. ``params``: more ``--param`` values."""
    import signal
    import time

    proc = subprocess.Popen([*CLI, "run", "train_and_serve", "--local", "--param", "epochs=100000",
                             "--param", f"model_name={model_name}", "--no-predict",
                             *(a for p in params for a in ("--param", p))], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not [p for p in _project_processes() if "train_worker" in " ".join(p.cmdline())]:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"training never started: {proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    return proc, _project_processes()


def test_a_run_stopped_by_sigterm_takes_its_workers_down(tmp_path):
    # a kill (or timeout, or a CI cancel) reaches the CLI only: kfp.local's task process and the
    # torchrun workers under it trained on, orphaned, to the last epoch
    import signal

    proc, started = _training_run("sigterm")
    try:
        proc.send_signal(signal.SIGTERM)  # the CLI alone, as kill PID does
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "stopped by signal 15; the processes it started were stopped too" in err
        _, alive = psutil.wait_procs(started, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline()[:4] for p in alive]
        # the run is recorded as canceled, not left to look as if it were still running
        [run_dir] = (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").iterdir()
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "CANCELED" and record["params"]["epochs"] == 100000
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_run_stopped_while_training_to_s3_says_how_far_it_trained_and_how_to_train_on(s3, bucket):
    # with storage_root the checkpoints are on S3: a stopped run wrote no record of them (asking the
    # server while a stop goes on could hang it), so the listing showed no checkpoint, and the stop
    # gave no `--resume` command, or, once the train step had merely started, gave one with nothing to resume
    import signal
    import time

    made = f"s3://{bucket}-made"  # a bucket the run makes: it says so, as a misspelt name would be made too
    root = f"{made}/runs"
    assert not s3.bucket_exists(made)
    proc, started = _training_run("stopped-s3", f"storage_root={root}")
    try:
        [run_dir] = [d for d in (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").iterdir() if d.is_dir()]
        checkpoints = f"{root}/{run_dir.name}/train-op/model/checkpoints"
        deadline = time.monotonic() + 120
        while not s3.exists(f"{checkpoints}/last.json"):  # an epoch trained
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        psutil.wait_procs(started, timeout=30)  # the workers' last checkpoint is written by now
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (f"kfp-pytorch: run {run_dir.name} canceled; `kfp-pytorch run train_and_serve --local --resume "
            f"{run_dir.name}` trains on from its last checkpoint") in err
    assert (f"note: made the bucket {made} for storage_root, as it was not there; if that name is misspelt, "
            f"`kfp-pytorch storage rb {made} --force` removes it with the run's outputs in it") in err
    trained = json.loads(s3.read_bytes(f"{checkpoints}/last.json"))["epoch"]
    assert trained >= 1 and not list(run_dir.rglob("last.json"))  # on S3 alone
    line = run_cli("runs", "--local").stdout.splitlines()[1]
    assert line.split()[1] == "CANCELED" and line.endswith(
        f"checkpoint after {trained} of 100000 epochs: `run --resume` trains on"), line
    [listed] = json.loads(run_cli("runs", "--local", "--json").stdout)
    assert (listed["checkpoint_epochs"], listed["remote"]) == (trained, f"{root}/{run_dir.name}")
    # killed outright, a run writes no record at all: the note in its folder is all there is
    (run_dir / "run.json").unlink()  # its steps named the CLI's process, which is gone
    [listed] = json.loads(run_cli("runs", "--local", "--json").stdout)
    assert (listed["status"], listed["checkpoint_epochs"]) == ("KILLED", trained)


def test_a_run_refused_before_its_first_step_makes_no_storage_root_bucket(s3, bucket):
    # the bucket was made first, then the MLflow server's check refused the run: a bucket left behind
    never = f"s3://{bucket}-never"
    r = run_cli("run", "train_and_serve", "--local", "--param", f"storage_root={never}/runs",
                "--param", "tracking_uri=http://127.0.0.1:9")
    assert r.returncode != 0 and "cannot reach the MLflow tracking server at http://127.0.0.1:9" in r.stderr, r.stderr
    assert not s3.bucket_exists(never) and "made the bucket" not in r.stderr


def test_the_checkpoint_training_notes_for_a_run_on_s3_is_read_back_and_kept_when_the_server_is_down(tmp_path,
                                                                                                     monkeypatch):
    import time
    from types import SimpleNamespace

    from kfp_pytorch.components._kfp import checkpoint_note_path, note_checkpoint
    from kfp_pytorch.components.processes import RUN_OWNER_ENV, run_owner_token
    from kfp_pytorch.pipelines import local

    run = tmp_path / "train-and-serve-x"
    model = SimpleNamespace(path=str(run / "train-op" / "model"))
    (run / "train-op" / "model").mkdir(parents=True)
    monkeypatch.delenv(RUN_OWNER_ENV, raising=False)
    assert checkpoint_note_path(model, "s3://b/runs/x/train-op/model") is None  # a cluster's pod
    monkeypatch.setenv(RUN_OWNER_ENV, run_owner_token())
    assert checkpoint_note_path(model, str(run / "train-op" / "model")) is None  # in the folder already
    note = checkpoint_note_path(model, "s3://b/runs/x/train-op/model")
    assert note == run / ".checkpoint.train-op.json" and local._noted_checkpoint(run) is None
    note_checkpoint(note, "s3://b/runs/x/train-op/model/checkpoints", 2)
    note_checkpoint(note, "s3://b/runs/x/train-op/model/checkpoints", 3)  # the next epoch's, over it
    note_checkpoint(tmp_path / "gone" / "note.json", "s3://b/c", 1)  # a disk that refuses: the note alone is lost
    (run / ".checkpoint.edited.json").write_text("[3]")
    (run / ".checkpoint.older.json").write_text(json.dumps({"uri": "s3://b/older", "epochs": 9}))
    os.utime(run / ".checkpoint.older.json", (time.time() - 60, time.time() - 60))
    kept = {"uri": "s3://b/runs/x/train-op/model/checkpoints", "epochs": 3}
    assert local._noted_checkpoint(run) == kept and local.trained_some(run)
    assert local._ended_early_checkpoint(run, None) == 3
    # a failed run whose S3 server does not answer now: its training's word on the checkpoint
    (run / "train-op" / "model" / "partial.bin").write_bytes(b"x")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert local._failed_checkpoint(run, "train-op", {"storage_root": "s3://b/runs"}) == kept
    assert not (run / "train-op").exists()  # the partial outputs went all the same


def test_a_run_killed_outright_is_listed_as_killed_and_resumed_from_its_checkpoint():
    # kill -9 (the OOM killer, a notebook kernel's restart) leaves no record: the run was listed as
    # RUNNING? for an hour, kept by --keep, then UNKNOWN; and its hours of training were lost, since
    # a new run trains into a new folder
    import signal
    import time

    proc, started = _training_run("sigkill")
    try:
        [listed] = json.loads(run_cli("runs", "--local", "--json").stdout)
        assert (listed["status"], listed["owner_pid"]) == ("RUNNING", proc.pid)
        name, state = listed["name"], Path(listed["path"]) / "train-op" / "model" / "checkpoints" / "last.json"
        log = Path(listed["log"])  # where to watch it from: the log its process writes
        assert "Executing task 'train-op'" in re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # kfp.local's colours
        assert run_cli("runs", "--local").stdout.splitlines()[1].endswith(f"log: {log}")
        r = run_cli("run", "train_and_serve", "--local", "--resume", name)
        assert r.returncode == 2 and f"--resume: {name} is still running" in r.stderr, r.stderr
        assert f"kill {proc.pid}" in r.stderr
        deadline = time.monotonic() + 120
        while not state.exists():  # an epoch trained
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        proc.kill()  # the CLI alone
        proc.wait(30)
        _, alive = psutil.wait_procs(started, timeout=30)  # the workers stop with it (test_train has the how)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline()[:4] for p in alive]
        trained = json.loads(state.read_text())["epoch"]  # whole epochs (and, stopped mid-epoch, some steps)
        r = run_cli("runs", "--local")
        assert r.stdout.splitlines()[1].split()[1] == "KILLED", r.stdout
        assert r.stdout.splitlines()[1].endswith(f"checkpoint after {trained} of 100000 epochs: `run --resume` trains on")
        [listed] = json.loads(run_cli("runs", "--local", "--json").stdout)
        assert listed["owner_pid"] is None and not (Path(listed["path"]) / "run.json").exists()
        assert listed["params"]["epochs"] == 100000 and listed["checkpoint_epochs"] == trained  # from its steps
        assert listed["log"] == str(log)  # left beside the runs by the kill: still its
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        r = run_cli("run", "train_and_serve", "--local", "--resume", name, "-p", f"epochs={trained + 1}",
                    "--no-predict", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        summary = summary_of(r.stdout)
        assert summary["status"] == "SUCCEEDED" and summary["resumed_from"] == name
        assert f"training resumes from {name}'s last checkpoint ({trained} epoch(s) trained)" in r.stderr
        assert "resuming from checkpoint" in r.stderr
        record = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
        assert record["resumed_from"] == name and record["params"]["epochs"] == trained + 1
        assert record["params"]["model_name"] == "sigkill"  # the killed run's, but for the one given
        assert summary["training"]["epochs_trained"] == trained + 1, summary["training"]
        statuses = {r["name"]: (r["status"], r["checkpoint_epochs"])
                    for r in json.loads(run_cli("runs", "--local", "--json").stdout)}
        assert statuses == {name: ("KILLED", trained), Path(summary["run_dir"]).name: ("SUCCEEDED", None)}
        assert run_cli("runs", "--local", "--keep", "1").returncode == 0  # the killed run goes, and its log
        assert not log.exists() and [p.name for p in log.parent.iterdir()] == [Path(summary["run_dir"]).name]
    finally:
        run_cli("serve", "stop", "sigkill")
    r = run_cli("run", "train_and_serve", "--local", "--resume", "train-and-serve-nosuch")
    assert r.returncode == 2 and "--resume: no local run 'train-and-serve-nosuch' under" in r.stderr
    assert "`kfp-pytorch runs --local` lists them" in r.stderr


def test_bad_table_is_rejected_before_any_step(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,label\n1,2,0\n3,,1\nx,4,1\n")
    r = run_cli("run", "train_and_serve", "--local", "--param", f"dataset_uri={bad}")
    assert r.returncode == 2 and "column 'b': 1 empty or NaN value(s), row 2" in r.stderr, r.stderr
    assert "column 'a': 1 value(s) are not numbers: row 3 'x'" in r.stderr
    assert "Traceback" not in r.stderr
    # a table whose label has its own name: said, with the parameter to set
    named = tmp_path / "named.csv"
    named.write_text("a,b,Outcome\n1,2,0\n3,4,1\n")
    r = run_cli("run", "train_and_serve", "--local", "--param", f"dataset_uri={named}")
    assert r.returncode == 2 and "label column 'label' is missing (columns: a, b, Outcome); label_column must " \
                                 "name one of them" in r.stderr, r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()  # nothing ran


def test_a_table_of_ones_own_with_a_named_label_and_chosen_features_end_to_end(tmp_path):
    """A data scientist's export: an id and a free-text column beside the features, the label named
    'species' and written as names. Trained, served, and predicted with the label found by itself."""
    import pandas as pd
    from sklearn.datasets import load_iris

    from kfp_pytorch.components.batch_predict import model_features

    iris = load_iris(as_frame=True)
    table = iris.frame.rename(columns=lambda c: c.replace(" (cm)", "").replace(" ", "_"))
    table["species"] = [iris.target_names[t] for t in table.pop("target")]
    table.insert(0, "sample_id", [f"s{i:03d}" for i in range(len(table))])
    table["note"] = ["checked", None, "re-measured"] * (len(table) // 3)
    path = tmp_path / "iris.csv"
    table.to_csv(path, index=False, sep=";", decimal=",")  # as a spreadsheet in a European locale exports it
    features = "petal_length,petal_width,sepal_length,sepal_width"
    r = run_cli("run", "train_and_serve", "--local", "--json", "--param", f"dataset_uri={path}",
                "--param", "label_column=species", "--param", f"feature_columns={features}",
                "--param", "model_name=iris", "--param", "epochs=30", "--param", "batch_size=16",
                "--param", "lr=0.02", "--param", "threshold=0.8", "--param", "early_stopping_patience=5")
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        s = summary_of(r.stdout)
        assert s["status"] == "SUCCEEDED" and s["gate_passed"] is True and s["metrics"]["accuracy"] >= 0.8
        assert s["prediction"]["label"] in iris.target_names and s["prediction"]["true_label"] in iris.target_names
        # iris repeats one row (rows 102 and 143 of the original), with its label: counted, not a conflict
        assert s["data"]["rows"] == {"train": 104, "val": 23, "test": 23} and s["data"]["num_features"] == 4
        assert s["data"]["duplicates"]["rows"] == 1 and s["data"]["duplicates"]["conflicting"] == 0
        assert s["data"]["source_format"] == "semicolon-separated, decimal commas"  # what was inferred, said
        assert (f"read {path} as semicolon-separated, decimal commas; features: petal_length, petal_width, "
                "sepal_length, sepal_width") in r.stderr
        model_meta = model_features(s["artifacts"]["train-op.model"])
        assert model_meta["features"] == features.split(",") and model_meta["label_column"] == "species"
        assert model_meta["training"]["early_stopping_patience"] == 5  # the pipeline's setting reached the workers
        assert s["training"]["exported_epoch"] == model_meta["training"]["exported_epoch"]
        assert s["training"]["epochs_trained"] == model_meta["training"]["epochs_trained"] <= 30
        # the served model takes the table as it is (columns by name) and scores it against 'species'
        p = run_cli("serve", "predict", "iris", str(path), "-o", str(tmp_path / "p.csv"))
        assert p.returncode == 0, p.stderr
        preds = pd.read_csv(tmp_path / "p.csv")
        accuracy = float((preds["prediction"] == table["species"]).mean())
        assert "150 rows predicted by iris at " in p.stderr and f"accuracy against 'species': {accuracy:.4f}" in p.stderr
        assert accuracy >= 0.8 and set(preds["prediction"]) <= set(iris.target_names)
        # each class's probability, by the class's name, for a score downstream
        p = run_cli("serve", "predict", "iris", str(path), "--probabilities", "-o", str(tmp_path / "pp.csv"))
        assert p.returncode == 0, p.stderr
        probs = pd.read_csv(tmp_path / "pp.csv")
        cols = [f"p_{n}" for n in sorted(iris.target_names)]
        assert list(probs.columns) == ["row", "prediction", "confidence", *cols, "label"]
        assert np.allclose(probs[cols].sum(axis=1), 1, atol=1e-4)
        assert (probs[cols].idxmax(axis=1).str[2:] == probs["prediction"]).all()
        assert np.allclose(probs[cols].max(axis=1), probs["confidence"], atol=1e-4)
    finally:
        run_cli("serve", "stop", "iris")


def test_unreachable_s3_and_wrong_credentials(s3_server, bucket):
    dead = run_cli("run", "train_and_serve", "--local", "--param", "dataset_uri=s3://data/x.csv",
                   env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "a",
                        "AWS_SECRET_ACCESS_KEY": "b"})
    assert dead.returncode == 1 and "cannot reach the S3 endpoint" in dead.stderr and "Traceback" not in dead.stderr
    wrong = run_cli("run", "train_and_serve", "--local", "--param", f"dataset_uri=s3://{bucket}/x.csv",
                    env={**s3_server.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert wrong.returncode == 1 and "refused the credentials" in wrong.stderr
    assert "not-the-secret" not in wrong.stderr and "Traceback" not in wrong.stderr


def test_more_local_workers_than_memory_holds_are_refused_before_any_step():
    # the train step refused them, after the data was prepared; the run failed in train-op
    from kfp_pytorch.components.train import WORKER_MEMORY

    many = int(psutil.virtual_memory().total // WORKER_MEMORY) + 1
    # first of the checks: a table (here one not there) is not read for workers that cannot start
    r = run_cli("run", "train_and_serve", "--local", "--param", f"workers={many}", "--param",
                f"dataset_uri={Path(os.environ['KFP_PYTORCH_HOME']) / 'no-table.csv'}")
    assert r.returncode == 1 and f"Error: workers={many}: {many} local worker processes need about" in r.stderr, r.stderr
    assert "dataset not found" not in r.stderr
    assert "train on the cluster (train_backend=cluster)" in r.stderr and "Traceback" not in r.stderr
    assert not (Path(os.environ["KFP_PYTORCH_HOME"]) / "local_outputs").exists()  # nothing ran


def test_port_in_use_is_rejected_before_any_step():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("run", "train_and_serve", "--local", "--param", f"serve_port={port}")
    assert r.returncode == 2 and f"serve_port {port} on 127.0.0.1 is already in use by pid {os.getpid()} (" in r.stderr


def test_a_stale_server_record_never_signals_the_process_that_now_has_its_pid():
    import re

    from kfp_pytorch.components.serve import _pidfile

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:  # a server that died long ago; the kernel has since given its pid to another process
        record = {"name": "ghost", "url": "http://127.0.0.1:9", "infer_url": "http://127.0.0.1:9/v2/models/ghost/infer",
                  "pid": other.pid, "model_uri": "/m", "create_time": 1.0}
        _pidfile("ghost").write_text(json.dumps(record))
        # a server's record says when it started, in ticks since boot: the same in every process
        from kfp_pytorch.components.processes import same_process, start_ticks

        started = psutil.Process(other.pid).create_time()
        ticks = start_ticks(other.pid)
        assert ticks is not None and same_process({"pid": other.pid, "start_ticks": ticks, "create_time": started})
        # a wall clock stepped since (NTP): create_time, read anew elsewhere, moved; ticks did not
        assert same_process({"pid": other.pid, "start_ticks": ticks, "create_time": started + 1.0})
        assert not same_process({"pid": other.pid, "start_ticks": ticks - 1, "create_time": started})  # another process
        r = run_cli("serve", "list")
        assert r.returncode == 0 and re.search(r"ghost\s+\d+\s+down", r.stdout), r.stdout
        r = run_cli("serve", "stop", "ghost")
        assert r.returncode == 0 and other.poll() is None  # alive: the signal went to nobody
        assert not _pidfile("ghost").exists()
    finally:
        other.kill()
        other.wait()


def test_serve_stop_unknown_name():
    r = run_cli("serve", "stop", "nobody")
    assert r.returncode == 1 and "no local model server named 'nobody'" in r.stderr


def _compile_with_platform(tmp_path, platform_yaml: str) -> tuple[dict, dict]:
    """train_and_serve compiled with a platform file: (pipeline IR, its Kubernetes platform spec)."""
    plat = tmp_path / "platform.yaml"
    plat.write_text(platform_yaml)
    out = tmp_path / "p.yaml"
    r = run_cli("compile", "train_and_serve", "-o", str(out), "--platform", str(plat))
    assert r.returncode == 0, r.stderr
    pipeline, platform = list(yaml.safe_load_all(out.read_text()))
    json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec())
    return pipeline, platform


def test_compile_with_platform_settings(tmp_path):
    pipeline, platform = _compile_with_platform(
        tmp_path, "s3_secret: minio-creds\nlabels: {kfp-pytorch.io/user: alice}\n"
                  "gpu_node_selector: {nvidia.com/gpu.present: 'true'}\n"
                  "gpu_tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n"
                  "kueue_queue: team-a-gpu\nkueue_priority_class: research\n")
    execs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(execs) == {"exec-prepare-data-op", "exec-train-op", "exec-evaluate-op", "exec-register-op",
                          "exec-serve-op"}
    for name, ex in execs.items():
        assert ex["secretAsEnv"][0]["secretName"] == "minio-creds"
        assert ex["podMetadata"]["labels"] == {"kfp-pytorch.io/user": "alice"}
    assert execs["exec-train-op"]["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}
    assert execs["exec-train-op"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nodeSelector" not in execs["exec-evaluate-op"]
    # ... and the pods the train and serve steps create get them through the step's environment
    env = {e["name"]: e["value"] for e in pipeline["deploymentSpec"]["executors"]["exec-train-op"]["container"]["env"]}
    assert env["KFP_PYTORCH_S3_SECRET"] == "minio-creds" and json.loads(env["KFP_PYTORCH_POD_LABELS"]) == {
        "kfp-pytorch.io/user": "alice"}
    assert json.loads(env["KFP_PYTORCH_GPU_TOLERATIONS"])[0]["key"] == "nvidia.com/gpu"
    assert env["KFP_PYTORCH_KUEUE_QUEUE"] == "team-a-gpu"  # for the training job; the step pods are not queued
    assert env["KFP_PYTORCH_KUEUE_PRIORITY_CLASS"] == "research"
    assert not any("retryPolicy" in t for t in _tasks(pipeline))  # no retries unless asked for


def test_a_platform_with_a_private_s3_ca_trusts_it_in_every_pod(tmp_path):
    # An on-prem MinIO behind the company's CA: the steps, the training pods and KServe's storage
    # initializer each need the CA, or every S3 read fails on the certificate
    from kfp_pytorch.components.cluster import ClusterConfig, kserve_s3_secret_and_sa, to_pytorchjob, to_trainjob
    from kfp_pytorch.components.train import TrainSpec
    from kfp_pytorch.pipelines.platform import load_platform, platform_env
    from k8s_schemas import validate_manifest

    text = "s3_endpoint: https://minio.corp:9000\ns3_ca_configmap: company-ca\n"
    pipeline, platform = _compile_with_platform(tmp_path, text)
    for name, ex in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        [volume] = ex["configMapAsVolume"]
        assert (volume["configMapName"], volume["mountPath"]) == ("company-ca", "/etc/kfp-pytorch/s3-ca"), name
        env = {e["name"]: e["value"] for e in pipeline["deploymentSpec"]["executors"][name]["container"]["env"]}
        assert env["AWS_CA_BUNDLE"] == "/etc/kfp-pytorch/s3-ca/cabundle.crt", name
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": "reg.example.com/kfp-pytorch:0.1",
                                  **platform_env(load_platform(yaml.safe_load(text)), gpu=True)})
    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    pytorchjob, trainjob = to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))
    pod = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    patched = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    for job, spec, env in ((pytorchjob, pod, pod["containers"][0]["env"]),
                           (trainjob, patched, trainjob["spec"]["trainer"]["env"])):
        validate_manifest(job)
        assert {"name": "s3-ca", "configMap": {"name": "company-ca"}} in spec["volumes"]
        assert {"name": "s3-ca", "mountPath": "/etc/kfp-pytorch/s3-ca", "readOnly": True} in spec["containers"][0][
            "volumeMounts"]
        assert {"name": "AWS_CA_BUNDLE", "value": "/etc/kfp-pytorch/s3-ca/cabundle.crt"} in env
    secret, _ = kserve_s3_secret_and_sa(cfg.s3, "team-a")
    assert secret["metadata"]["annotations"]["serving.kserve.io/s3-cabundle-configmap"] == "company-ca"
    assert secret["metadata"]["annotations"]["serving.kserve.io/s3-usehttps"] == "1"


def test_an_mlflow_with_auth_gets_its_credentials_in_the_steps_that_talk_to_it(tmp_path):
    _, platform = _compile_with_platform(tmp_path, "mlflow_tracking_uri: https://mlflow.example.com\n"
                                                   "mlflow_secret: mlflow-creds\n")
    execs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, ex in execs.items():
        secrets = {s["secretName"]: s for s in ex["secretAsEnv"]}
        if name in ("exec-train-op", "exec-register-op"):
            creds = secrets["mlflow-creds"]
            # any of them: a user and password, or a token; a missing key must not stop the pod
            assert {(k["secretKey"], k["envVar"]) for k in creds["keyToEnv"]} == {
                (k, k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")}
            assert creds["optional"] is True
        else:  # least privilege: nothing else reads them
            assert set(secrets) == {"kfp-pytorch-s3"}, name


def test_a_platforms_pod_resources_reach_the_training_pods_and_the_predictor(tmp_path):
    # without them a CPU job's pods requested nothing (BestEffort: evicted first, and nothing for
    # Kueue to count against the queue's quota), and the predictor was fixed at 1 CPU and 2Gi
    from kfp_pytorch.components.cluster import ClusterConfig, to_inference_service, to_pytorchjob
    from kfp_pytorch.components.train import TrainSpec
    from kfp_pytorch.pipelines.platform import load_platform, platform_env
    from k8s_schemas import validate_manifest

    text = "train_resources: {cpu: 8, memory: 32Gi}\nserve_resources: {memory: 4Gi}\n"
    pipeline, _ = _compile_with_platform(tmp_path, text)
    env = {e["name"]: e["value"] for e in pipeline["deploymentSpec"]["executors"]["exec-train-op"]["container"]["env"]}
    assert (env["KFP_PYTORCH_CPU_PER_NODE"], env["KFP_PYTORCH_MEMORY_PER_NODE"]) == ("8", "32Gi")
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": "reg.example.com/kfp-pytorch:0.1",
                                  **platform_env(load_platform(yaml.safe_load(text)))})
    job = to_pytorchjob(cfg.train_spec(TrainSpec("s3://data/d", "s3://models/m", workers=4, nodes=2,
                                                 backend="cluster", device="cpu")))
    validate_manifest(job)
    for role in ("Master", "Worker"):
        res = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"] == res["limits"] == {"cpu": 8, "memory": "32Gi"}
    isvc = to_inference_service(cfg.serve_spec("s3://models/m/model", "digits"))
    validate_manifest(isvc)
    res = isvc["spec"]["predictor"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"cpu": 1, "memory": "4Gi"}  # the default CPU stays: the HPA needs it


def test_a_private_registrys_pull_secret_reaches_every_pod_that_runs_the_image(tmp_path):
    # a Harbor behind auth: the step pods, the training pods and the predictor all pull the image
    from kfp_pytorch.components.cluster import ClusterConfig, to_inference_service, to_pytorchjob, to_trainjob
    from kfp_pytorch.components.train import TrainSpec
    from kfp_pytorch.pipelines.platform import load_platform, platform_env
    from k8s_schemas import validate_manifest

    text = "image_pull_secrets: [harbor-pull]\n"
    _, platform = _compile_with_platform(tmp_path, text)
    for name, ex in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        assert [s["secretName"] for s in ex["imagePullSecret"]] == ["harbor-pull"], name
    cfg = ClusterConfig.from_env({"KFP_PYTORCH_IMAGE": "harbor.example.com/ml/kfp-pytorch:0.1",
                                  **platform_env(load_platform(yaml.safe_load(text)))})
    train = TrainSpec("s3://data/d", "s3://models/m", workers=2, nodes=2, backend="cluster", device="cpu")
    pytorchjob, trainjob = to_pytorchjob(cfg.train_spec(train)), to_trainjob(cfg.train_spec(train))
    isvc = to_inference_service(cfg.serve_spec("s3://models/m/model", "digits"))
    pods = [pytorchjob["spec"]["pytorchReplicaSpecs"][r]["template"]["spec"] for r in ("Master", "Worker")] + [
        trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
            "template"]["spec"]["template"]["spec"], isvc["spec"]["predictor"]]
    for doc in (pytorchjob, trainjob, isvc):
        validate_manifest(doc)
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "harbor-pull"}]


def _tasks(pipeline: dict) -> list[dict]:
    """Every task of a compiled pipeline, inside its condition branches too."""
    return [t for comp in [pipeline["root"], *pipeline["components"].values()]
            for t in ((comp.get("dag") or {}).get("tasks") or {}).values()]


def test_a_platform_with_retries_sets_kfps_retry_policy_on_every_step(tmp_path):
    pipeline, _ = _compile_with_platform(tmp_path, "retries: 2\nretry_backoff_s: 30\n")
    policies = {t["componentRef"]["name"]: t.get("retryPolicy") for t in _tasks(pipeline)
                if t["componentRef"]["name"].endswith("-op")}
    assert set(policies) == {"comp-prepare-data-op", "comp-train-op", "comp-evaluate-op", "comp-register-op",
                             "comp-serve-op"}, policies
    for p in policies.values():
        assert p["maxRetryCount"] == 2 and p["backoffDuration"] == "30s" and p["backoffFactor"] == 2.0


def test_bad_platform_file_is_reported(tmp_path):
    plat = tmp_path / "platform.yaml"
    plat.write_text("labels: {'bad key!': x}\ngpu_tolerations: [{operator: Maybe, toleration_seconds: 3}]\n"
                    "extra: 1\nkueue_que: q\ns3: {secret: minio}\n")
    r = run_cli("compile", "train_and_serve", "-o", str(tmp_path / "p.yaml"), "--platform", str(plat))
    assert r.returncode == 2 and "labels.bad key!" in r.stderr and "gpu_tolerations[0].operator" in r.stderr
    assert f"Error: invalid platform settings in --platform {plat}:\n" in r.stderr  # which file, of several options
    # a field that matches nothing lists the known ones; a typo, or a nested form of the flat
    # s3_* fields, names what was likely meant
    assert "extra: unknown field (known: gpu_node_selector, gpu_tolerations, " in r.stderr
    assert "kueue_que: unknown field; did you mean 'kueue_queue'?\n" in r.stderr
    assert "gpu_tolerations[0].toleration_seconds: unknown field; did you mean 'tolerationSeconds'?\n" in r.stderr
    assert "s3: unknown field; did you mean 's3_ca_configmap', 's3_endpoint', 's3_keys' or 's3_secret'?\n" in r.stderr


@pytest.mark.parametrize("body,needle", [
    ("- a\n", "(top level): must be a mapping, got list"),
    ("labels: [a]\n", "labels: must be a mapping of label key -> value"),
    ("gpu_tolerations: 5\n", "gpu_tolerations: must be a list"),
    ("gpu_tolerations: [3]\n", "gpu_tolerations[0]: must be a mapping"),
    ("s3_keys: 3\ns3_secret: My_Secret\n", "s3_secret: 'My_Secret' is not a valid Secret name"),
    ("labels: {a: [\n", "platform.yaml:2: not valid YAML"),
    ("\x81\x00\xff", "platform.yaml: not UTF-8 text"),  # a binary file was a UnicodeDecodeError traceback
    ("s3_endpoint: ftp://minio:9000\n", "s3_endpoint: 'ftp://minio:9000' is not an S3 endpoint; write http(s)://HOST[:PORT]"),
    ("s3_endpoint: http://minio:9000/bucket\n", "s3_endpoint: 'http://minio:9000/bucket' is not an S3 endpoint"),
    ("retries: -1\nretry_backoff_s: soon\n", "retries: must be a whole number in [0, 10], got -1"),
    ("retry_backoff_s: 1.5\n", "retry_backoff_s: must be a whole number in [0, 3600], got 1.5"),
    ("s3_ca_configmap: Company_CA\n", "s3_ca_configmap: 'Company_CA' is not a ConfigMap name"),
    ("mlflow_secret: MLflow Creds\n", "mlflow_secret: 'MLflow Creds' is not a valid Secret name"),
    ("mlflow_secret: [a]\n", "mlflow_secret: must be a string, got ['a']"),
    ("train_resources: {gpu: 1, cpu: lots}\n", "train_resources.gpu: a training pod's GPUs are the run's gpus_per_node"),
    ("train_resources: {cpu: lots}\n", "train_resources.cpu: 'lots' is not a Kubernetes quantity"),
    ("serve_resources: {gpu: 1}\n", "serve_resources.gpu: the predictor runs on CPU; give cpu and memory"),
    ("serve_resources: 2\n", "serve_resources: must be a mapping like {cpu: 4, memory: 16Gi}, got 2"),
    ("image_pull_secrets: harbor\n", "image_pull_secrets: must be a list of Secret names, got 'harbor'"),
    ("image_pull_secrets: [Harbor_Pull]\n", "image_pull_secrets[0]: 'Harbor_Pull' is not a valid Secret name"),
    ("mlflow_tracking_uri: sqlite:///mlflow.db\n",
     "mlflow_tracking_uri: 'sqlite:///mlflow.db' is not an MLflow server; write http(s)://HOST[:PORT]"),
])
def test_malformed_platform_file_gets_an_error_not_a_traceback(tmp_path, body, needle):
    plat = tmp_path / "platform.yaml"
    plat.write_bytes(body.encode("latin-1"))
    r = run_cli("compile", "train_and_serve", "-o", str(tmp_path / "p.yaml"), "--platform", str(plat))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("toleration,needle", [
    # the API server's ValidateTolerations: each was a pod the cluster refused when the step started
    ({"key": "nvidia.com/gpu", "operator": "Exists", "value": "true"}, "[0].value: must be empty when operator is Exists"),
    ({"operator": "Equal", "value": "x"}, "[0].operator: must be Exists when key is empty"),
    ({"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30},
     "[0].effect: must be NoExecute when tolerationSeconds is set"),
    ({"key": "gpu", "effect": "NoExecute", "tolerationSeconds": "30s"}, "[0].tolerationSeconds: must be a whole number"),
    ({"key": "gpu", "toleration_seconds": 30}, "[0].toleration_seconds: unknown field"),  # was dropped without a word
    ({"key": "bad key!", "operator": "Exists"}, "[0].key: 'bad key!' is not a valid label key"),
    ({"key": "gpu", "value": True}, "[0].value: True is not a valid label value"),
])
def test_tolerations_are_checked_as_the_api_server_checks_them(toleration, needle):
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines.platform import load_platform

    with pytest.raises(ConfigError) as e:
        load_platform({"gpu_tolerations": [toleration]})
    assert any(p.startswith("gpu_tolerations" + needle) for p in e.value.problems), e.value.problems
    ok = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists"},
          {"key": "gpu", "value": "a100", "effect": "NoExecute", "tolerationSeconds": 60}]
    assert load_platform({"gpu_tolerations": ok}).gpu_tolerations == ok


@pytest.mark.parametrize("out,needle", [("missing-dir/p.yaml", "does not exist (create it first)"),
                                        ("p.json", "must end in one of .yaml, .yml")])
def test_compile_output_is_checked_before_compiling(tmp_path, out, needle):
    r = run_cli("compile", "train_and_serve", "-o", str(tmp_path / out))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_write_the_disk_refuses_is_an_error_not_a_traceback():
    # /proc takes no new files; root passes the writable-directory check, so the write itself fails
    r = run_cli("compile", "train_and_serve", "-o", "/proc/kfp-pytorch-p.yaml")
    assert r.returncode in (1, 2) and "/proc" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if r.returncode == 1:
        assert "Error: No such file or directory: /proc/kfp-pytorch-p.yaml" in r.stderr and "hint:" in r.stderr


def test_a_bad_step_image_is_refused_before_compiling_or_calling_the_server(tmp_path):
    bad = {"KFP_PYTORCH_IMAGE": "Registry.example.com/kfp pytorch:0.1"}
    r = run_cli("compile", "train_and_serve", "-o", str(tmp_path / "p.yaml"), env=bad)
    assert r.returncode == 2 and "KFP_PYTORCH_IMAGE: 'Registry.example.com/kfp pytorch:0.1' is not an image" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "p.yaml").exists()
    # submit checks it before it reaches for the server (nothing listens on this port)
    r = run_cli("submit", "train_and_serve", "--host", f"http://127.0.0.1:{free_port()}", env=bad)
    assert r.returncode == 2 and "KFP_PYTORCH_IMAGE" in r.stderr and "cannot reach" not in r.stderr, r.stderr
    # an empty variable means the default image, as an unset one does
    r = run_cli("compile", "train_and_serve", "-o", str(tmp_path / "p.yaml"), env={"KFP_PYTORCH_IMAGE": ""})
    assert r.returncode == 0, r.stderr
    assert "ghcr.io/kfp-pytorch/kfp-pytorch:0.1.0" in (tmp_path / "p.yaml").read_text()


def test_every_parameter_problem_is_listed_at_once_and_numbers_must_be_finite():
    from kfp_pytorch.components.errors import ConfigError
    from kfp_pytorch.pipelines import get_pipeline

    entry = get_pipeline("train_and_serve")
    with pytest.raises(ConfigError) as e:  # inf/NaN would reach KFP's protobuf as a traceback, after the steps began
        entry.resolve({"lr": "inf", "threshold": "nan", "epochs": "0", "tracking_uri": "mlflow.kubeflow:5000",
                       "workers": "two", "nodes": "3"})
    assert e.value.problems == [
        "lr: expected finite number, got 'inf'", "threshold: expected finite number, got 'nan'",
        "workers: expected integer, got 'two'",
        "epochs: must be >= 1, got 0",  # and no word on nodes=3 against a default workers=2 it does not divide
        "tracking_uri: must be an MLflow server (http(s)://HOST[:PORT]) or a store URI (sqlite://, postgresql://, "
        "mysql://, mssql://, file://), got 'mlflow.kubeflow:5000'"]
    # an unsupported scheme failed in MLflow after training; the ones MLflow opens pass, drivers included
    for uri in ("http://mlflow.kubeflow:5000", "postgresql+psycopg2://u@db/mlflow", "sqlite:////tmp/m.db", ""):
        assert entry.resolve({"tracking_uri": uri})["tracking_uri"] == uri
    lr = entry.resolve({"lr": 1})["lr"]  # a whole number is a number, read as one
    assert lr == 1.0 and isinstance(lr, float)
    with pytest.raises(ConfigError, match="expected finite number, got True"):
        entry.resolve({"lr": True})
    # the pipeline sets the train step's mid-epoch checkpoints (a long epoch on a preemptible queue)
    assert entry.resolve({"checkpoint_every_s": "120"})["checkpoint_every_s"] == 120.0
    with pytest.raises(ConfigError) as e:
        entry.resolve({"checkpoint_every_s": "-5"})
    assert e.value.problems == ["checkpoint_every_s: must be a finite number >= 0 (0: at epoch ends only), got -5.0"]


def test_a_runs_result_line_says_what_a_failed_gate_read_where_the_record_says():
    from kfp_pytorch.pipelines.local import result_line

    result = {"metrics": {"accuracy": 0.95, "macro_f1": 0.9}, "gate_passed": False}
    assert result_line(result, {"gate_metric": "macro_f1", "threshold": 0.92}) == (
        "accuracy 0.9500, gate failed: macro_f1 0.9000 < 0.9200")
    assert result_line(result, {"threshold": 0.96}) == "accuracy 0.9500, gate failed: accuracy 0.9500 < 0.9600"
    # an older record: no parameters, or a gate metric it did not keep
    assert result_line(result) == "accuracy 0.9500, gate failed"
    assert result_line(result, {"gate_metric": "min_recall", "threshold": 0.9}) == "accuracy 0.9500, gate failed"
    assert result_line({"metrics": {"accuracy": 0.97}, "gate_passed": True,
                        "model": {"registry_uri": "models:/d/2", "champion": False}}, {}) == "accuracy 0.9700, models:/d/2"
    assert result_line({}) == ""
    champion = {"metrics": {"accuracy": 0.97}, "gate_passed": True, "model": {"registry_uri": "models:/d/2", "champion": True}}
    assert result_line(champion, {}) == "accuracy 0.9700, models:/d/2 (champion)"
    assert result_line(champion, {}, champion_until=5) == "accuracy 0.9700, models:/d/2 (champion until version 5)"


def test_only_the_latest_champion_of_a_registry_and_name_is_listed_as_the_champion():
    # each run's record says its version became champion when it ran: every run that ever promoted
    # one was listed as "(champion)"
    from kfp_pytorch.pipelines.local import LocalRunInfo, later_champions

    def run(name, uri, champion=True, tracking=""):
        return LocalRunInfo(name, Path(name), "SUCCEEDED", 0.0, 0, [], [], {"tracking_uri": tracking},
                            {"model": {"registry_uri": uri, "champion": champion}})

    runs = [run("a", "models:/digits/1"), run("b", "models:/digits/2", champion=False), run("c", "models:/digits/3"),
            run("d", "models:/digits/10"), run("e", "models:/iris/1"),
            run("f", "models:/digits/2", tracking="http://mlflow:5000"),  # another registry: its own line
            run("g", "models:/digits/4", tracking="http://mlflow:5000"), run("h", "not a uri"), run("i", "models:/x@champion")]
    assert later_champions(runs) == {"a": 3, "c": 10, "f": 4}  # by version, not by the order listed
    assert later_champions(runs[::-1]) == {"a": 3, "c": 10, "f": 4}
    assert later_champions([]) == {}


def test_python_dash_m_kfp_pytorch_is_the_command(tmp_path):
    # a notebook kernel's PATH often lacks the environment's bin: `python -m kfp_pytorch` said
    # "'kfp_pytorch' is a package and cannot be directly executed"
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("kfp-pytorch, version "), r.stderr
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch", "run", "nope", "--local"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and "unknown pipeline 'nope'" in r.stderr and "Traceback" not in r.stderr


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, env, coloured", [(_Terminal, {}, True), (_Terminal, {"NO_COLOR": "1"}, False),
                                                   (io.StringIO, {}, False)])
@pytest.mark.parametrize("condensed", [True, False])
def test_kfp_local_colours_reach_a_terminal_only(monkeypatch, stream, env, coloured, condensed):
    from kfp_pytorch.pipelines.local import _Tee

    monkeypatch.delenv("NO_COLOR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    inner, log = stream(), io.StringIO()
    tee = _Tee(inner, log, condensed=condensed)
    line = "08:11:59.393 - INFO - Task \x1b[96m'train-op'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m"
    print(line, file=tee)
    assert inner.getvalue() == (line if coloured else "08:11:59.393 - INFO - Task 'train-op' finished with status "
                                "SUCCESS") + "\n"
    assert log.getvalue() == line + "\n" and list(tee.lines) == [line]
