"""KFP schedules: cron validation. KFP parses a recurring run's cron with robfig/cron's ``Parse``:
6 fields with *seconds* first, or a descriptor (``@daily``, ``@every 1h30m``...)."""
import re
from datetime import datetime

from kfp_pytorch.components.errors import ConfigError

_FIELDS = ("second", "minute", "hour", "day of month", "month", "day of week")
# robfig/cron's bounds: the day of week is 0-6 (Sunday is 0; a 7 is refused, unlike Vixie cron's)
_RANGES = ((0, 59), (0, 59), (0, 23), (1, 31), (1, 12), (0, 6))
_MONTHS = {m: i + 1 for i, m in enumerate(("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                                            "NOV", "DEC"))}
_DAYS = {d: i for i, d in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))}


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


def _number(text: str, name: str) -> int | None:
    """A value as robfig/cron's parseIntOrName reads it: a name (months, days) or a whole number."""
    names = _MONTHS if name == "month" else _DAYS if name == "day of week" else {}
    if text.upper() in names:
        return names[text.upper()]
    return int(text) if re.fullmatch(r"\+?\d+", text) else None


def _field_problem(text: str, name: str, lo: int, hi: int) -> str | None:
    """What robfig/cron's getRange would refuse in one field (each of its comma-separated parts is
    ``*`` or ``?`` or a-b or a, with an optional /step; ``a/step`` means a to the field's end)."""
    expected = f"expected {lo}-{hi}, '*', ranges a-b, lists a,b or steps */n"
    for part in filter(None, text.split(",")):
        range_step = part.split("/")
        low_high = range_step[0].split("-")
        if len(range_step) > 2 or len(low_high) > 2:
            return f"{name} field {text!r}: {part!r} has more than one {'/' if len(range_step) > 2 else '-'}; {expected}"
        if low_high[0] in ("*", "?"):
            start, end = lo, hi
        else:
            start = _number(low_high[0], name)
            end = _number(low_high[1], name) if len(low_high) == 2 else start
            if start is None or end is None:
                return f"{name} field {text!r}: {part!r} is not a number; {expected}"
        if len(range_step) == 2:
            step = _number(range_step[1], "step")
            if not step:
                return f"{name} field {text!r}: the step in {part!r} must be a whole number above 0"
            if len(low_high) == 1:
                end = hi
        if not lo <= start <= hi or not lo <= end <= hi:
            sunday = " (Sunday is 0 or SUN)" if name == "day of week" else ""
            return f"{name} field {text!r}: {part!r} is outside {lo}-{hi}{sunday}; {expected}"
        if start > end:
            return f"{name} field {text!r}: the range {part!r} starts after it ends"
    return None


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
    problems = [p for text, name, bounds in zip(fields, _FIELDS, _RANGES)
                if (p := _field_problem(text, name, *bounds))]
    if problems:
        raise ConfigError(problems, 'example: --cron "0 0 3 * * *"', title="invalid schedule")
    expr = " ".join(fields)
    if not _ever_fires(expr):
        raise ConfigError([f"cron {expr!r} never fires: no month given has the day of month {fields[3]!r}"],
                          "February has 28 or 29 days; April, June, September and November 30. A day every month "
                          'has (1-28) fires monthly: --cron "0 0 3 28 * *"', title="invalid schedule")
    return expr


def _ever_fires(expr: str) -> bool:
    """Whether a 6-field expression matches any time in 5 years: robfig/cron's ``Next`` gives up
    after 5 years and returns the zero time, so KFP would keep a recurring run that never starts
    one (``0 0 3 31 2 *``: 31 February). croniter searches the same way."""
    from datetime import timezone

    from croniter import CroniterBadDateError

    try:
        next_runs(expr, datetime(2000, 1, 1, tzinfo=timezone.utc), 1)
    except CroniterBadDateError:
        return False
    return True


# robfig/cron's descriptors as the 6-field expressions they stand for
_DESCRIBED = {"@yearly": "0 0 0 1 1 *", "@annually": "0 0 0 1 1 *", "@monthly": "0 0 0 1 * *",
              "@weekly": "0 0 0 * * 0", "@daily": "0 0 0 * * *", "@midnight": "0 0 0 * * *", "@hourly": "0 0 * * * *"}


def next_runs(expr: str, after: datetime, n: int = 3) -> list[datetime]:
    """The next ``n`` times a validated expression fires after ``after``, as robfig/cron reads it:
    a day-of-month and a day-of-week both given match either (croniter's ``day_or``, as Vixie and
    robfig cron do); ``@every D`` fires every D from the schedule's start."""
    from datetime import timedelta

    if expr.startswith("@every "):
        step = timedelta(seconds=_go_duration_seconds(expr.split()[1]))
        return [after + step * (k + 1) for k in range(n)]
    from croniter import croniter

    it = croniter(_DESCRIBED.get(expr, expr), after, second_at_beginning=True, day_or=True,
                  max_years_between_matches=5)
    return [it.get_next(type(after)) for _ in range(n)]


def parse_window_time(text: str, option: str) -> datetime:
    """``--start`` / ``--end``: an ISO 8601 date (midnight) or date-time, UTC unless it names a zone,
    as an aware UTC datetime to the second (what KFP's RFC 3339 trigger times hold)."""
    from datetime import timezone

    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError([f"{option}: {text!r} is not an ISO 8601 date or date-time"],
                          f"example: {option} 2027-03-31 or {option} 2027-03-31T18:00:00+01:00 (UTC unless a zone "
                          "is given)", title="invalid schedule") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).astimezone(timezone.utc).replace(microsecond=0)


def window_problems(start: datetime | None, end: datetime | None, now: datetime) -> list[str]:
    """What makes a schedule's window one that never starts a run."""
    problems = []
    if end is not None and end <= now:
        problems.append(f"--end: {end:%Y-%m-%d %H:%M:%S} UTC has passed: the schedule would never start a run")
    if start is not None and end is not None and end <= start:
        problems.append(f"--end: {end:%Y-%m-%d %H:%M:%S} UTC is not after --start {start:%Y-%m-%d %H:%M:%S} UTC")
    return problems


def rfc3339(t: datetime) -> str:
    """A UTC time as KFP's API takes a trigger's start_time / end_time: ``2027-03-31T00:00:00Z``."""
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")
