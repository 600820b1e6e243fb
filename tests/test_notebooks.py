"""Notebooks are valid nbformat 4 and their code runs against the current API (cheap parts executed)."""
import ast
import json
from pathlib import Path

NB = Path(__file__).resolve().parents[1] / "notebooks"


def _code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    for src in code:
        ast.parse(src)
    return code


def _run_cell(src: str, ns: dict, name: str):
    """Run a cell as Jupyter does: its statements, then the value of a final expression (or None)."""
    tree = ast.parse(src)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), ns)
    return eval(compile(ast.Expression(last.value), name, "eval"), ns) if last is not None else None


def test_every_notebook_parses():
    books = sorted(NB.glob("*.ipynb"))
    assert {p.name for p in books} >= {"train_and_serve.ipynb", "fair_share_simulator.ipynb"}
    for path in books:
        _code_cells(path)


def test_train_and_serve_notebook_runs_every_cell(tmp_path, monkeypatch, capsys):
    # only its first cell ran: a changed API (predict_table's result) broke a later one unseen
    from IPython.display import HTML

    from kfp_pytorch.components.serve import list_servers

    monkeypatch.chdir(tmp_path)  # where it compiles train_and_serve.yaml, as Jupyter's working folder
    code = _code_cells(NB / "train_and_serve.ipynb")
    ns: dict = {}
    try:
        values = [_run_cell(src, ns, f"train_and_serve[{i}]") for i, src in enumerate(code)]
    finally:
        from kfp_pytorch.components.serve import stop_server

        stop_server("digits-nb")
    assert ns["entry"].name == "train_and_serve" and ns["summary"]["status"] == "SUCCEEDED"
    metrics, endpoint = values[1]
    assert metrics["accuracy"] > 0.9 and endpoint.endswith("/v2/models/digits-nb/infer")
    out = capsys.readouterr().out
    assert "predicted [" in out and "accuracy against 'label' on all 1797 rows: " in out
    least_sure = values[3]
    assert len(least_sure) == 5 and least_sure["confidence"].is_monotonic_increasing
    assert isinstance(values[4], HTML) and "confusion" in values[4].data.lower()
    assert (tmp_path / "train_and_serve.yaml").is_file()
    assert "digits-nb" not in [s["name"] for s in list_servers()]  # its last cell stopped the server


def test_fair_share_simulator_notebook_runs_every_cell(monkeypatch, capsys):
    from matplotlib.figure import Figure

    monkeypatch.chdir(NB)  # the notebook's paths are relative to its folder, as in Jupyter
    code = _code_cells(NB / "fair_share_simulator.ipynb")
    ns: dict = {}
    values = [_run_cell(src, ns, f"fair_share_simulator[{i}]") for i, src in enumerate(code)]
    policies = values[0]
    assert policies == ["fifo", "static-priority", "drf", "slurm-fairshare", "kueue-afs", "fairshare"]
    assert list(ns["results"]) == policies
    fig = values[2]
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    out = capsys.readouterr().out
    table = out.split("against fifo")[0]
    assert all(f"\n{p} " in table for p in policies)
    # the longest waits are sorted, and the figures are those of the results
    for name in ("fifo", "slurm-fairshare", "fairshare"):
        rows = ns["longest_waits"](ns["results"][name])
        hours = [h for _, _, h in rows]
        assert len(rows) == 5 and hours == sorted(hours, reverse=True)
        assert hours[0] == round(ns["results"][name].metrics["wait_max"] / 3600, 1)
    assert ns["mine"]["fairshare"].metrics != ns["results"]["fairshare"].metrics  # the variant changed something
    assert "jain_service    default" in out and "wait_max        default" in out and "x)" in out


def test_the_readmes_own_pipeline_example_compiles_and_runs(tmp_path, monkeypatch):
    # the components are the product: a user's pipeline of them must compile for the KFP UI and run
    # with kfp.local as the README shows, placeholders for the training job's name and all
    import re
    import warnings

    import yaml

    readme = (NB.parent / "README.md").read_text()
    section = readme[readme.index("### In your own pipeline"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # where it writes my_training.yaml and kfp.local its outputs
    ns: dict = {}
    with warnings.catch_warnings():  # kfp.local's, for each step: our image is no python:3.x image
        warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom or non-Python")
        exec(compile(code, "README.md:In your own pipeline", "exec"), ns)
    assert ns["passed"] is True  # cnn, 3 epochs on digits: well over the 0.9 gate
    spec = yaml.safe_load((tmp_path / "my_training.yaml").read_text())
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"prepare-data-op", "train-op", "evaluate-op"}
    params = tasks["train-op"]["inputs"]["parameters"]
    assert params["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}
    assert params["task_name"] == {"runtimeValue": {"constant": "{{$.pipeline_task_name}}"}}
    runs = list((tmp_path / "local_outputs").glob("my-training-*"))
    assert len(runs) == 1 and (runs[0] / "train-op" / "model").exists()


def _readme_commands(text: str) -> list[str]:
    """The ``kfp-pytorch ...`` lines of the bash blocks, continuations joined, comments and pipes cut;
    lines with placeholders (``...``, ``[--flag]``) left out."""
    import re

    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if "| kfp-pytorch " in line:
                line = line[line.index("kfp-pytorch "):]
            line = line.split(" | ")[0]
            if line.startswith("kfp-pytorch ") and "..." not in line and not re.search(r"\s\[", line):
                out.append(line)
    return out


def test_every_command_the_readmes_and_help_show_parses_against_the_cli(tmp_path, monkeypatch):
    # an option renamed or a command moved leaves a README line that fails for whoever copies it:
    # each line is parsed as the CLI would parse it (files it names are made empty), none is run
    import re
    import shlex

    import click

    from kfp_pytorch.cli import cli

    def parse(cmd, name, args, parent=None):
        if isinstance(cmd, click.Group):
            ctx = cmd.make_context(name, [], parent=parent, resilient_parsing=True)
            sub_name, sub, rest = cmd.resolve_command(ctx, args)
            return parse(sub, sub_name, rest, ctx)
        with cmd.make_context(name, args, parent=parent):
            return cmd.name

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    text = (NB.parent / "README.md").read_text() + (NB / "README.md").read_text()
    lines = _readme_commands(text)
    assert len(lines) >= 30

    def epilogs(cmd):  # each command's --help examples too
        yield cmd.epilog or ""
        for sub in getattr(cmd, "commands", {}).values():
            yield from epilogs(sub)

    shown = [ln.split("  #")[0].strip() for e in epilogs(cli) for ln in e.splitlines()]
    examples = [ln for ln in shown if ln.startswith("kfp-pytorch ") and "..." not in ln and " [" not in ln]
    assert len(examples) >= 10
    lines += [ln.split(" | ")[0] for ln in examples]
    seen, wrong = set(), []
    placeholders = {"URL": "http://127.0.0.1:8080"}  # the examples' names for what the user fills in
    for line in lines:
        args = [placeholders.get(a, a) for a in shlex.split(line)[1:]]
        for a in args:  # a file the example names (a config, a trace): there, empty, as the user's would be
            if re.fullmatch(r"[\w./-]+\.(yaml|csv|db)", a) and not (cwd / a).exists():
                assert (cwd / a).resolve().is_relative_to(tmp_path), a
                (cwd / a).parent.mkdir(parents=True, exist_ok=True)
                (cwd / a).touch()
        try:
            seen.add(parse(cli, "kfp-pytorch", args))
        except click.exceptions.Exit:  # --help, --version
            pass
        except click.ClickException as e:
            wrong.append(f"{line}\n  {e.format_message()}")
    assert not wrong, "\n".join(wrong)
    assert {"run", "compile", "submit", "simulate", "goals", "show", "predict", "cp"} <= seen
