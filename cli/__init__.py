"""``kfp-pytorch``: run, compile and list pipelines; manage local model servers and storage;
simulate and judge fair-share scheduling.

Every user mistake ends in a one-paragraph error with the next step and a non-zero exit code
(2 for bad input), never a traceback; ``--debug`` shows the traceback for bug reports.

One module per part of the command line, each registering its commands on the one group, ``cli``
(``_app``): ``pipelines`` (pipelines, compile, run, manifest), ``kfp_server`` (submit, follow,
cancel, the recurring runs, runs), ``serve``, ``storage`` and ``fairness`` (simulate, goals,
ledger). ``_main`` is the entry point.
"""
from . import fairness, kfp_server, pipelines, serve, storage  # noqa: F401  (each registers its commands)
from ._app import cli
from ._main import main

__all__ = ["cli", "main"]
