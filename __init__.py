"""kfp-pytorch: PyTorch as a first-class citizen of Kubeflow Pipelines on self-hosted clusters.

The repository's top-level folders are mapped into this one namespace (see ``pyproject.toml``):

- ``kfp_pytorch.components``: reusable KFP v2 components and the runtime functions behind them;
- ``kfp_pytorch.pipelines``: pipelines built from them, and the registry the CLI uses;
- ``kfp_pytorch.fairness_scheduler``: fair-share policy, admission, usage ledger and simulator;
- ``kfp_pytorch.monitoring``: metrics exporters, rules and dashboards.
"""

__version__ = "0.1.0"
