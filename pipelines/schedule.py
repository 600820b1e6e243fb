"""KFP schedules: cron validation (KFP uses robfig/cron with a *seconds* field: 6 fields)."""
from kfp_pytorch.components.errors import ConfigError

_FIELDS = ("second", "minute", "hour", "day of month", "month", "day of week")
_RANGES = ((0, 59), (0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_MONTHS = {"JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"}
_DAYS = {"SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"}


def validate_cron(expr: str) -> str:
    """Return the normalised 6-field expression, or raise with the 6-field form of a 5-field one."""
    fields = (expr or "").split()
    if len(fields) == 5:
        six = " ".join(["0", *fields])
        raise ConfigError([f"cron {expr!r} has 5 fields; KFP's cron has 6, with seconds first"],
                          f"did you mean --cron \"{six}\"? (fields: {', '.join(_FIELDS)})", title="invalid schedule")
    if len(fields) != 6:
        raise ConfigError([f"cron {expr!r} has {len(fields)} fields; KFP's cron has 6: {' '.join(_FIELDS)}"],
                          'example: --cron "0 0 3 * * *" (every day at 03:00:00)', title="invalid schedule")
    problems = []
    for text, name, (lo, hi) in zip(fields, _FIELDS, _RANGES):
        for part in text.split(","):
            base = part.split("/")[0]
            if base in ("*", "?"):
                continue
            for num in base.split("-"):
                if name in ("month", "day of week") and num.upper() in (_MONTHS if name == "month" else _DAYS):
                    continue
                if not num.isdigit() or not lo <= int(num) <= hi:
                    problems.append(f"{name} field {text!r}: expected {lo}-{hi}, '*', ranges a-b, lists a,b or steps */n")
                    break
    if problems:
        raise ConfigError(problems, 'example: --cron "0 0 3 * * *"', title="invalid schedule")
    return " ".join(fields)
