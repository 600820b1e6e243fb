"""``kfp-pytorch ledger show|compact``: users' standing from a real ledger (sqlite and PostgreSQL),
computed by the policy the scheduler orders with; the half-life kept with the ledger."""
import json
import sqlite3

import pytest

from kfp_pytorch.cli import main
from kfp_pytorch.fairness_scheduler.config import load_config
from kfp_pytorch.fairness_scheduler.errors import LedgerError
from kfp_pytorch.fairness_scheduler.ledger import Interval, UsageLedger, interval_usage
from kfp_pytorch.fairness_scheduler.model import Resources, Workload
from kfp_pytorch.fairness_scheduler.policy import CycleContext, FairShare, UserState

H = 3600.0
NOW = 100_000.0
CONFIG = "users:\n  - {name: alice, shares: 2, priority: 3}\n  - {name: bob}\n  - {name: dave, priority: 2}\n"
INTERVALS = [("w1", "alice", Resources(8, 32, 256), 0, 20_000), ("w2", "alice", Resources(4, 16, 64), 50_000, 90_000),
             ("w3", "bob", Resources(1, 4, 16), 80_000, 99_000), ("w4", "carol", Resources(16, 64, 512), 60_000, 95_000)]


def _ledger(url):
    led = UsageLedger(url, half_life=H)
    for name, user, r, s, e in INTERVALS:
        led.record(Interval(name, user, r, s, e))
    led.close()


def _run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_gives_each_users_standing_as_the_policy_orders_them(ledger_url, tmp_path, capsys):
    _ledger(ledger_url)
    cfg = tmp_path / "scheduler.yaml"
    cfg.write_text(CONFIG)
    rc, out, err = _run(capsys, "ledger", "show", "--ledger", ledger_url, "--at", str(NOW), "--config", str(cfg), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["half_life_s"] == H and data["open_intervals"] == 4 and data["compacted_before"] is None
    rows = {r["user"]: r for r in data["users"]}
    # config users and the ledger's unlisted user (default shares), no one else
    assert set(rows) == {"alice", "bob", "carol", "dave"}
    gpu_s = {u: sum(interval_usage(r, s, e, NOW, H).gpu for _, uu, r, s, e in INTERVALS if uu == u)
             for u in rows}
    total = sum(gpu_s.values())
    shares = {"alice": 2, "bob": 1, "carol": 1, "dave": 1}
    for u, r in rows.items():
        assert r["usage"]["gpu_s"] == pytest.approx(gpu_s[u])
        assert r["usage_share"] == pytest.approx(gpu_s[u] / total)
        assert r["share"] == pytest.approx(shares[u] / 5)
        assert r["fairshare_factor"] == pytest.approx(2 ** (-r["usage_share"] / r["share"]))  # Slurm classic
        assert r["protected"] == (r["usage_share"] < 0.75 * r["share"])
    assert rows["alice"]["tier_factor"] == 1 and rows["dave"]["tier_factor"] == 0.5 and rows["bob"]["tier_factor"] == 0
    assert rows["dave"]["fairshare_factor"] == 1 and rows["dave"]["user_priority"] == pytest.approx(1005)
    # the listed order is the order in which the scheduler ranks equally old jobs of these users
    users = {n: UserState(load_config({"users": [{"name": "alice", "shares": 2, "priority": 3}, {"name": "bob"},
                                                 {"name": "dave", "priority": 2}]}).user(n),
                          usage=Resources(gpu=gpu_s[n])) for n in rows}
    policy = FairShare()
    policy.prepare(CycleContext(NOW, users, Resources(gpu=1)))
    jobs = [Workload(f"j-{u}", u, NOW - 60, (Resources(1),), seq=i) for i, u in enumerate(sorted(rows))]
    assert [r["user"] for r in data["users"]] == [w.user for w in sorted(jobs, key=lambda w: policy.key(w, NOW))]
    assert [r["user"] for r in data["users"]][-1] == "carol"  # the heaviest, least recently decayed

    rc, text, _ = _run(capsys, "ledger", "show", "--ledger", ledger_url, "--at", str(NOW), "--config", str(cfg))
    assert rc == 0
    lines = text.splitlines()
    assert "half-life 60.0m, 4 intervals, never compacted" in lines[0] and "GPU-seconds only" in lines[1]
    body = [ln.split()[0] for ln in lines[5:]]
    assert body == [r["user"] for r in data["users"]]


def test_capacity_weighs_cpu_and_memory_as_the_scheduler_does(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = UsageLedger(url, half_life=H)
    led.record(Interval("gpu-job", "a", Resources(gpu=1), 0, 3600))
    led.record(Interval("cpu-job", "b", Resources(cpu=64), 0, 3600))
    led.close()
    _, out, _ = _run(capsys, "ledger", "show", "--ledger", url, "--at", "3600", "--json")
    rows = {r["user"]: r for r in json.loads(out)["users"]}
    assert rows["a"]["usage_share"] == 1 and rows["b"]["usage_share"] == 0  # GPU-seconds only
    _, out, _ = _run(capsys, "ledger", "show", "--ledger", url, "--at", "3600", "--capacity", "gpu=8,cpu=64", "--json")
    rows = {r["user"]: r for r in json.loads(out)["users"]}
    # 1 of 8 GPUs against 64 of 64 CPUs for the same hour: b used 8 times a's share of the cluster
    assert rows["b"]["usage_share"] == pytest.approx(8 / 9) and rows["a"]["usage_share"] == pytest.approx(1 / 9)


def test_compact_keeps_usage_and_records_the_watermark(ledger_url, capsys):
    _ledger(ledger_url)
    show = ("ledger", "show", "--ledger", ledger_url, "--at", str(NOW), "--json")
    _, before, _ = _run(capsys, *show)
    rc, out, err = _run(capsys, "ledger", "compact", "--ledger", ledger_url, "--at", str(NOW), "--older-than", "10000s",
                        "--json")
    assert rc == 0, err
    assert json.loads(out) == {"folded": 2, "before": NOW - 10_000, "remaining": 2}  # w1 and w4 ended by 90,000
    _, after, _ = _run(capsys, *show)
    b, a = json.loads(before), json.loads(after)
    assert a["open_intervals"] == 2 and a["compacted_before"] == NOW - 10_000
    for rb, ra in zip(b["users"], a["users"]):
        assert ra["user"] == rb["user"] and ra["usage"]["gpu_s"] == pytest.approx(rb["usage"]["gpu_s"], rel=1e-12)
    # an earlier cut folds nothing more and keeps the later watermark
    rc, out, _ = _run(capsys, "ledger", "compact", "--ledger", ledger_url, "--at", str(NOW), "--older-than", "1d")
    assert rc == 0 and out.startswith("folded 0 intervals")
    _, text, _ = _run(capsys, "ledger", "show", "--ledger", ledger_url, "--at", str(NOW))
    assert "2 intervals, compacted up to 1970-01-02T01:00:00Z" in text.splitlines()[0]


def test_the_half_life_stays_with_the_ledger(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = UsageLedger(url, half_life=H)
    led.record(Interval("w1", "a", Resources(1), 0, 100))
    led.close()
    assert UsageLedger(url).half_life == H  # the one it was written with, not the 7-day default
    # before compaction every interval is still there: another half-life is exact, and the next write keeps it
    other = UsageLedger(url, half_life=2 * H)
    other.record(Interval("w2", "a", Resources(1), 100, 200))
    assert other.compact(150) == 1
    other.close()
    assert UsageLedger(url).half_life == 2 * H
    with pytest.raises(LedgerError, match=r"compacted with a half-life of 7200 s[\s\S]*--half-life"):
        UsageLedger(url, half_life=H)


def test_ledger_cli_refuses_what_is_not_a_ledger_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "typo.db"
    rc, _, err = _run(capsys, "ledger", "show", "--ledger", str(missing))
    assert rc == 1 and f"no usage ledger at {missing}" in err and "hint: check --ledger" in err
    assert not missing.exists()
    # a folder (the ledger's own, its file left off): "no usage ledger at" it read as a typo
    rc, _, err = _run(capsys, "ledger", "show", "--ledger", f"sqlite:///{tmp_path}")
    assert rc == 1 and f"Error: {tmp_path} is a folder, not a usage ledger" in err
    assert f"hint: give the ledger's file in it: --ledger sqlite:///{tmp_path}/FILE.db" in err
    empty = tmp_path / "other.db"
    sqlite3.connect(empty).close()
    rc, _, err = _run(capsys, "ledger", "compact", "--ledger", f"sqlite:///{empty}", "--older-than", "30d")
    assert rc == 1 and "holds no usage ledger (missing tables: usage_intervals" in err and "Traceback" not in err
    assert sqlite3.connect(empty).execute("select count(*) from sqlite_master").fetchone() == (0,)
    # every bad option in one error, before the ledger is opened
    cfg = tmp_path / "sched.yaml"
    cfg.write_text("users: [{name: alice, shares: -1}]\n")
    rc, _, err = _run(capsys, "ledger", "show", "--ledger", str(missing), "--at", "yesterday", "--half-life", "0",
                      "--capacity", "gpu=x,disk=3", "--config", str(cfg))
    assert rc == 2 and "Traceback" not in err
    for needle in ("--at: must be now, seconds since the epoch or an ISO 8601", "--half-life: must be a duration > 0",
                   "--capacity: gpu must be a number >= 0, got 'x'", "--capacity: 'disk=3' is not one of",
                   f"--config {cfg}: users[0].shares: must be > 0, got -1"):
        assert needle in err, err
    rc, _, err = _run(capsys, "ledger", "compact", "--ledger", str(missing), "--older-than", "soon")
    assert rc == 2 and "--older-than: must be a duration >= 0" in err


def test_a_missing_or_three_slash_ledger_url_says_what_to_pass(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv("KFP_PYTORCH_LEDGER", raising=False)
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch", "ledger", "show"], capture_output=True, text=True)
    assert r.returncode == 2 and ("Missing option '--ledger'. Pass the URL of the ledger the fairness scheduler "
                                  "writes, or export KFP_PYTORCH_LEDGER: e.g. --ledger sqlite:///") in r.stderr
    # sqlite:///tmp/x.db is tmp/x.db relative to the working folder (SQLAlchemy's rule): the absolute one is named
    absolute = tmp_path / "fairshare.db"
    _ledger(f"sqlite:///{absolute}")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rel = str(absolute).lstrip("/")
    rc, _, err = _run(capsys, "ledger", "show", "--ledger", f"sqlite:///{rel}")
    assert rc == 1 and f"no usage ledger at {rel} (relative to {elsewhere})" in err
    assert f"the absolute path /{rel} takes four slashes: --ledger sqlite:////{rel}" in err
    assert not (elsewhere / rel).exists()
    rc, out, _ = _run(capsys, "ledger", "show", "--ledger", f"sqlite:////{rel}")
    assert rc == 0 and "alice" in out


def test_at_takes_iso_dates_in_utc_unless_zoned():
    from kfp_pytorch.fairness_scheduler.usage import format_time, parse_time

    assert parse_time("1970-01-02T00:00:00", 5.0) == 86400 and parse_time("1970-01-02T01:00:00+01:00", 5.0) == 86400
    assert parse_time("now", 5.0) == 5.0 and parse_time("12.5", 5.0) == 12.5
    assert format_time(86400) == "1970-01-02T00:00:00Z"
    with pytest.raises(ValueError):
        parse_time("inf", 5.0)


def test_a_password_in_the_ledger_url_is_never_shown(postgres_server, capsys):
    from servers import free_port, postgres_database

    url = postgres_database(postgres_server, "ledger_with_password").replace("://kfp@", "://kfp:s3cret@")
    _ledger(url)  # trust auth on the test server: the password is accepted, and must not be echoed
    for args in (("--json",), ()):
        rc, out, err = _run(capsys, "ledger", "show", "--ledger", url, "--at", str(NOW), *args)
        assert rc == 0 and "s3cret" not in out + err and "kfp:***@127.0.0.1" in out
    down = f"postgresql+psycopg://kfp:s3cret@127.0.0.1:{free_port()}/x?connect_timeout=2"
    rc, out, err = _run(capsys, "ledger", "compact", "--ledger", down, "--older-than", "1d")
    assert rc == 1 and "cannot open usage ledger" in err and "s3cret" not in out + err and "kfp:***@" in err
    assert "Background on this error" not in err and "sqlalche.me" not in err  # the database's words only


def test_a_file_that_is_not_a_ledger_database_is_named_as_such(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database, just words\n" * 100)
    rc, out, err = _run(capsys, "ledger", "show", "--ledger", f"sqlite:///{notes}")
    assert rc == 1 and out == "" and err.startswith(f"Error: cannot open usage ledger sqlite:///{notes}: "
                                                    "file is not a database\n")
    assert "hint: that file is not a SQLite database" in err and "database server" not in err
    assert "sqlalche.me" not in err and notes.read_text().startswith("not a database")  # left as it was
    with pytest.raises(LedgerError) as e:  # the scheduler opening it to write says the same
        UsageLedger(f"sqlite:///{notes}")
    assert e.value.message.endswith(": file is not a database") and "not a SQLite database" in e.value.hint


def test_a_ledger_url_with_a_scheme_sqlalchemy_does_not_know_says_which_ones_to_use(capsys):
    # "Can't load plugin: sqlalchemy.dialects:postgres.psycopg" left the user to guess what that means
    for url, scheme in (("postgres+psycopg://kfp:pw@db/ledger", "postgres+psycopg"), ("sqllite:///l.db", "sqllite")):
        rc, out, err = _run(capsys, "ledger", "show", "--ledger", url)
        assert rc == 1 and out == "", err
        assert err.startswith(f"Error: cannot open usage ledger '{url.replace(':pw@', ':***@')}': SQLAlchemy has no "
                              f"database dialect or driver '{scheme}'\n"), err
        assert "hint: use sqlite:///PATH, or postgresql+psycopg://USER@HOST/DB" in err and "plugin" not in err


def test_compacted_usage_is_never_shown_for_a_time_it_cannot_be_known(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = UsageLedger(url, half_life=H)
    led.record(Interval("w1", "a", Resources(1), 0, 3600))
    led.close()
    rc, out, err = _run(capsys, "ledger", "compact", "--ledger", url, "--at", "2999-01-01", "--older-than", "0")
    assert rc == 2 and "the cut, 2999-01-01T00:00:00Z, is in the future" in err
    assert UsageLedger(url).intervals_count() == 1  # nothing folded
    rc, out, err = _run(capsys, "ledger", "compact", "--ledger", url, "--at", "7200", "--older-than", "0")
    assert rc == 0 and out.startswith("folded 1 interval ")
    # before the watermark only the totals as of 7200 s are left: no made-up figures for 3600 s
    rc, out, err = _run(capsys, "ledger", "show", "--ledger", url, "--at", "3600")
    assert rc == 1 and out == "" and "--at 1970-01-01T01:00:00Z is before 1970-01-01T02:00:00Z" in err
    assert "hint: ask for --at 1970-01-01T02:00:00Z or later" in err
    rc, out, err = _run(capsys, "ledger", "show", "--ledger", url, "--at", "7200", "--json")
    assert rc == 0 and json.loads(out)["users"][0]["usage"]["gpu_s"] == pytest.approx(interval_usage(Resources(1), 0, 3600, 7200, H).gpu)


def test_a_new_ledger_shows_that_nothing_is_recorded_without_an_empty_table(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    UsageLedger(url).close()  # as the scheduler leaves it on its first start
    rc, out, err = _run(capsys, "ledger", "show", "--ledger", url, "--at", str(NOW))
    assert rc == 0 and out.rstrip().endswith("no usage recorded and no users in the config"), out
    assert "protected" not in out and "----" not in out
    rc, out, _ = _run(capsys, "ledger", "show", "--ledger", url, "--at", str(NOW), "--json")
    assert rc == 0 and json.loads(out)["users"] == []
