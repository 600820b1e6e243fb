"""Scheduler errors: typed, with every problem and its path listed together."""
from kfp_pytorch.components.errors import ConfigError, KfpPytorchError


class SchedulerConfigError(ConfigError):
    def __init__(self, problems, hint=None, title="invalid scheduler configuration"):
        super().__init__(problems, hint or "fix the fields above; every problem is listed", title=title)


class SchedulerOptionsError(SchedulerConfigError):
    """Bad command-line options of simulate, goals or ledger (each problem names its --option; a
    --config file's own problems are among them, named by the file)."""

    def __init__(self, problems, hint=None):
        if all(p.startswith("--config ") for p in problems):  # the config file's fields alone
            super().__init__(problems, hint)
        else:
            super().__init__(problems, hint or "fix the options above; every problem is listed", title="invalid options")


class TraceError(KfpPytorchError):
    """A malformed trace row; the message names file:line."""

    exit_code = 2


class LedgerError(KfpPytorchError):
    """The usage ledger's database failed."""
