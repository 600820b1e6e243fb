"""Static checks that catch real bugs (undefined names, unused imports, syntax) in code and notebooks."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_make_target_the_makefile_declares_has_a_recipe():
    # `simulate` was declared .PHONY with no rule: `make simulate` said "Nothing to be done" and ran nothing
    make = ROOT / "Makefile"
    phony = next(line for line in make.read_text().splitlines() if line.startswith(".PHONY:")).split()[1:]
    for target in phony:
        out = subprocess.run(["make", "-n", "-f", str(make), target, "VENV=/nonexistent-venv"], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0 and "Nothing to be done" not in out.stdout + out.stderr, (target, out.stdout, out.stderr)
    out = subprocess.run(["make", "-n", "-f", str(make), "simulate", "TRACE=my.csv"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert "kfp-pytorch simulate --trace my.csv" in out.stdout, out.stdout
