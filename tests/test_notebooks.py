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
