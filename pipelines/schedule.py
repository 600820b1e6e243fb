"""KFP schedules: cron validation. KFP parses a recurring run's cron with robfig/cron's ``Parse``:
6 fields with *seconds* first, or a descriptor (``@daily``, ``@every 1h30m``...)."""
import re

from kfp_pytorch.components.errors import ConfigError

_FIELDS = ("second", "minute", "hour", "day of month", "month", "day of week")
_RANGES = ((0, 59), (0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_MONTHS = {"JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"}
_DAYS = {"SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"}


_DESCRIPTORS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _go_duration_seconds(text: str) -> float | None:
    """Seconds in a Go duration (``1h30m``, ``90s``: what ``@every`` takes), or None if it is not one."""
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _GO_UNITS[u] for n, u in parts)


def _validate_descriptor(expr: str) -> str:
    words = expr.split()
    if len(words) == 1 and words[0].lower() in _DESCRIPTORS:
        return words[0].lower()
    if words[0].lower() == "@every":
        seconds = _go_duration_seconds(words[1]) if len(words) == 2 else None
        if seconds is not None and seconds >= 1:
            return f"@every {words[1]}"
        raise ConfigError([f"cron {expr!r}: @every takes a duration of at least 1s such as 30m, 1h30m or 90s"],
                          'example: --cron "@every 6h"', title="invalid schedule")
    raise ConfigError([f"cron {expr!r}: unknown descriptor (known: {', '.join(sorted(_DESCRIPTORS))}, @every DURATION)"],
                      'example: --cron "@daily", or 6 fields: --cron "0 0 3 * * *"', title="invalid schedule")


def validate_cron(expr: str) -> str:
    """Return the normalised expression (6 fields, or a descriptor), or raise with what to write:
    the 6-field form of a 5-field one (KFP would read it with seconds first, a different schedule)."""
    if (expr or "").strip().startswith("@"):
        return _validate_descriptor(expr.strip())
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
