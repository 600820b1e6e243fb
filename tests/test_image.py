"""The container image: no Docker engine runs here, so the Dockerfile's build context is laid out as
its COPY lines lay it, and the package is built from that, as its ``pip install .`` would."""
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context, destinations below the WORKDIR."""
    out = []
    for line in dockerfile.read_text().splitlines():
        words = shlex.split(line) if line.startswith("COPY ") else []
        if words and not any(w.startswith("--from") for w in words):
            *sources, dest = [w for w in words[1:] if not w.startswith("--")]
            assert not dest.startswith("/"), f"COPY to an absolute path is not laid out by this test: {line}"
            out.append((sources, dest))
    return out


def _wheel_files(src: Path, out: Path) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    [wheel] = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_the_image_installs_every_file_of_the_package(tmp_path):
    # the CLI's split into cli/ left the Dockerfile copying a cli.py that was gone: `docker build`
    # failed at that COPY (and python -m kfp_pytorch would have lacked its __main__.py)
    context = tmp_path / "image"
    context.mkdir()
    for sources, dest in _copies(ROOT / "Dockerfile"):
        for source in sources:
            assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which the repository does not have"
            target = context / dest if not dest.endswith("/") else context / dest / Path(source).name
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    repo = tmp_path / "repo"
    for name in tracked:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    expected = _wheel_files(repo, tmp_path / "repo-wheel")
    assert {"kfp_pytorch/__main__.py", "kfp_pytorch/cli/__init__.py",
            "kfp_pytorch/components/train_worker.py"} <= expected
    assert _wheel_files(context, tmp_path / "image-wheel") == expected
