"""Validate generated manifests against the upstream CRD schemas in ../shared/schemas/.

``jsonschema`` on the CRD's ``openAPIV3Schema``, made strict the way the API server's structural
schema pruning would surface it: an unknown field (one the schema does not declare, where the
schema neither preserves unknown fields nor allows additional properties) is an error here
rather than silently dropped.
"""
import functools
from pathlib import Path

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "crds"
FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow-training-operator/kubeflow.org_pytorchjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "kubeflow-trainer/trainer.kubeflow.org_trainjobs.yaml",
    ("serving.kserve.io/v1beta1", "InferenceService"): "kserve/serving.kserve.io_inferenceservices.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus-operator/monitoring.coreos.com_prometheusrules.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus-operator/monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "prometheus-operator/monitoring.coreos.com_podmonitors.yaml",
}


def _strict(node):
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(x) for x in node]
    return node


@functools.lru_cache(maxsize=None)
def schema_for(api_version: str, kind: str) -> dict:
    crd = yaml.load((CRDS / FILES[(api_version, kind)]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = api_version.split("/")[1]
    [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(v["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # validated below, as the API server does
    return schema


def validate_manifest(obj: dict) -> None:
    """Raise jsonschema.ValidationError (or AssertionError for metadata) if ``obj`` is invalid."""
    import re

    schema = schema_for(obj["apiVersion"], obj["kind"])
    jsonschema.Draft7Validator(schema).validate(obj)
    name = obj["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, f"bad name {name!r}"
    for k, v in obj["metadata"].get("labels", {}).items():
        assert isinstance(v, str) and len(v) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]?", v), (k, v)
