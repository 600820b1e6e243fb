"""Scheduler errors: typed, with every problem and its path listed together."""
from kfp_pytorch.components.errors import ConfigError, KfpPytorchError


class SchedulerConfigError(ConfigError):
    def __init__(self, problems, hint=None):
        super().__init__(problems, hint or "fix the fields above; every problem is listed",
                         title="invalid scheduler configuration")


class TraceError(KfpPytorchError):
    """A malformed trace row; the message names file:line."""

    exit_code = 2


class LedgerError(KfpPytorchError):
    """The usage ledger's database failed."""
