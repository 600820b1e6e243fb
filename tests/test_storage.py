"""The storage edge against a real S3 server (SeaweedFS), and its local-path twin."""
import io

import pytest

from kfp_pytorch.components.errors import StorageAuthError, StorageError, StorageNotFound, StorageUnreachable
from kfp_pytorch.components.storage import Storage, StorageConfig, join, parse_uri
from servers import free_port


@pytest.mark.parametrize("uri,expected", [
    ("s3://bkt/k/x.csv", ("s3", "bkt", "k/x.csv")),
    ("minio://bkt/k", ("s3", "bkt", "k")),
    ("/tmp/a", ("file", "", "/tmp/a")),
    ("file:///tmp/a", ("file", "", "/tmp/a")),
    ("rel/path", ("file", "", "rel/path")),
])
def test_parse_uri(uri, expected):
    loc = parse_uri(uri)
    assert (loc.scheme, loc.bucket, loc.key) == expected


@pytest.mark.parametrize("uri", ["gs://bucket/x", "s3:///nobucket", "", "s3://b/x", "s3://-bkt/x", "s3://10.0.0.1/x"])
def test_parse_uri_rejects_with_hint(uri):
    with pytest.raises(StorageError) as e:
        parse_uri(uri)
    assert e.value.hint


def test_a_web_url_says_how_to_get_the_file_in():
    with pytest.raises(StorageError) as e:
        parse_uri("https://example.com/data/iris.csv?raw=1")
    assert "a URL is not read directly" in e.value.message
    assert e.value.hint == ("download it (curl -LO https://example.com/data/iris.csv?raw=1) and give the file, or put "
                            "it in the object store for the cluster's pods: kfp-pytorch storage cp iris.csv "
                            "s3://BUCKET/iris.csv")


def test_a_bad_bucket_name_or_endpoint_scheme_is_an_error_not_a_traceback(tmp_path):
    import subprocess
    import sys

    cli = [sys.executable, "-m", "kfp_pytorch.cli", "storage", "ls"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    short = subprocess.run([*cli, "s3://b/x"], capture_output=True, text=True, env=env)
    assert short.returncode == 1 and "'b' is not a valid bucket name" in short.stderr
    assert "Traceback" not in short.stderr and "3-63 characters" in short.stderr
    ftp = subprocess.run([*cli, "s3://bkt/x"], capture_output=True, text=True,
                         env={**env, "AWS_ENDPOINT_URL": "ftp://127.0.0.1:9"})
    assert ftp.returncode == 1 and "has the scheme 'ftp'; S3 speaks http or https" in ftp.stderr
    port = subprocess.run([*cli, "s3://bkt/x"], capture_output=True, text=True,  # minio's bare ValueError once
                          env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:minio"})
    assert port.returncode == 1 and "has no valid port (a number from 1 to 65535" in port.stderr, port.stderr
    assert "Traceback" not in port.stderr
    half = subprocess.run([*cli, "s3://bkt/x"], capture_output=True, text=True,  # a bare ValueError once
                          env={**env, "AWS_ACCESS_KEY_ID": "minio"})
    assert half.returncode == 1 and "S3 credentials: an access key is set but not a secret key" in half.stderr
    assert "Traceback" not in half.stderr
    with pytest.raises(StorageError, match="a secret key is set but not an access key"):
        StorageConfig.from_env({"AWS_SECRET_ACCESS_KEY": "s", "KFP_PYTORCH_STORAGE_CONFIG": "/nope"})
    for bad in ("http://minio:0", "http://minio:65536", "http://:9000"):
        with pytest.raises(StorageError, match="no valid port|has no host"):
            StorageConfig.from_env({"AWS_ENDPOINT_URL": bad, "KFP_PYTORCH_STORAGE_CONFIG": "/nope"})
    with pytest.raises(StorageError) as e:
        StorageConfig.from_env({"AWS_ENDPOINT_URL": "http://minio:9000/models", "KFP_PYTORCH_STORAGE_CONFIG": "/nope"})
    assert "has a path; the endpoint is the server only" in str(e.value) and "s3://BUCKET/KEY" in e.value.hint
    assert StorageConfig.from_env({"AWS_ENDPOINT_URL": "http://minio:9000/", "KFP_PYTORCH_STORAGE_CONFIG": "/nope"}
                                  ).endpoint == "minio:9000"


@pytest.mark.parametrize("call", ["exists", "read_bytes", "write_bytes", "iter_chunks", "download_file", "upload_file"])
def test_a_bucket_without_a_key_is_refused_for_one_object_operations(call, tmp_path):
    st = Storage(StorageConfig(endpoint="127.0.0.1:9"))  # refused before any request: nothing listens there
    args = {"write_bytes": ("s3://bkt/", b"x"), "download_file": ("s3://bkt/", tmp_path / "f"),
            "upload_file": (tmp_path / "f", "s3://bkt")}.get(call, ("s3://bkt/",))
    with pytest.raises(StorageError) as e:
        out = getattr(st, call)(*args)
        list(out) if call == "iter_chunks" else None
    assert "the URI names a bucket, not an object" in str(e.value)
    assert e.value.hint == "write s3://bkt/KEY; `kfp-pytorch storage ls s3://bkt/` lists the keys there"  # its name


def test_join_keeps_scheme():
    assert join("s3://b/p/", "a", "/b/") == "s3://b/p/a/b"


def test_config_from_env_and_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("endpoint: minio.kubeflow:9000\naccess_key: filekey\nsecret_key: filesecret\nverify_ssl: false\n")
    cfg = StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f), "AWS_ACCESS_KEY_ID": "envkey"})
    assert cfg.endpoint == "minio.kubeflow:9000" and cfg.access_key == "envkey" and cfg.secret_key == "filesecret"
    assert cfg.secure is False and cfg.verify_ssl is False
    https = StorageConfig.from_env({"AWS_ENDPOINT_URL": "https://s3.lab:443", "KFP_PYTORCH_STORAGE_CONFIG": "/nope"})
    assert https.endpoint == "s3.lab:443" and https.secure is True
    assert "filesecret" not in repr(cfg) and "envkey" not in repr(cfg)
    f.write_text("endpoint: minio:9000\nsession_token: filetoken\n")  # temporary (STS) credentials
    assert StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f)}).session_token == "filetoken"
    cfg = StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f), "AWS_SESSION_TOKEN": "envtoken"})
    assert cfg.session_token == "envtoken" and "envtoken" not in repr(cfg)


def test_a_misspelt_storage_config_key_is_refused(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("endpoint: minio:9000\nacess_key: k\nsecret_key: s\n")  # the key was ignored: no credentials
    with pytest.raises(StorageError) as e:
        StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f)})
    assert f"storage config {f}: unknown key(s) 'acess_key'" in str(e.value) and "access_key" in e.value.hint


def test_yes_no_settings_have_one_reading_and_a_typo_is_refused(tmp_path):
    none = {"KFP_PYTORCH_STORAGE_CONFIG": "/nope"}
    for value, want in (("1", True), ("Yes", True), ("on", True), ("FALSE", False), ("no", False), ("off", False),
                        ("", True)):
        assert StorageConfig.from_env({**none, "S3_VERIFY_SSL": value}).verify_ssl is want
    with pytest.raises(StorageError) as e:  # read as 'no', it turned certificate checks off without a word
        StorageConfig.from_env({**none, "S3_VERIFY_SSL": "ture", "S3_USE_HTTPS": "si"})
    assert "S3_USE_HTTPS: must be one of 1/true/yes/on or 0/false/no/off, got 'si'" in str(e.value)
    assert "S3_VERIFY_SSL: must be one of" in str(e.value) and "got 'ture'" in str(e.value)
    f = tmp_path / "s.yaml"
    f.write_text("endpoint: minio:9000\nsecure: 'false'\n")  # a quoted 'false' was true
    assert StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f)}).secure is False
    f.write_text("endpoint: minio:9000\nverify_ssl: maybe\n")
    with pytest.raises(StorageError, match=r"s\.yaml: verify_ssl: must be one of .*got 'maybe'"):
        StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f)})


@pytest.mark.parametrize("body,needle", [("- a\n", "must be a mapping, got list"), ("endpoint: [\n", "cannot parse"),
                                         ("\x81\x00", "cannot parse")])
def test_malformed_storage_config_file_is_reported(tmp_path, body, needle):
    f = tmp_path / "s.yaml"
    f.write_bytes(body.encode("latin-1"))
    with pytest.raises(StorageError) as e:
        StorageConfig.from_env({"KFP_PYTORCH_STORAGE_CONFIG": str(f)})
    assert needle in str(e.value) and str(f) in str(e.value) and e.value.hint


def test_local_roundtrip_is_atomic(tmp_path):
    st = Storage(StorageConfig())
    target = tmp_path / "d" / "obj.bin"
    st.write_bytes(str(target), b"one")
    st.write_bytes(str(target), b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["obj.bin"]  # no temp files left
    assert st.list(str(tmp_path / "d")) == [str(target)]
    with pytest.raises(StorageNotFound):
        st.read_bytes(str(tmp_path / "missing"))


def test_s3_roundtrip(s3, bucket):
    uri = f"s3://{bucket}/dir/a.bin"
    data = bytes(range(256)) * 4096
    s3.write_bytes(uri, data)
    assert s3.exists(uri) and not s3.exists(f"s3://{bucket}/dir/nope")
    assert s3.read_bytes(uri) == data
    assert b"".join(s3.iter_chunks(uri, 10_000)) == data
    s3.write_bytes(f"minio://{bucket}/dir/sub/b.bin", b"x")
    assert s3.list(f"s3://{bucket}/dir") == [uri, f"s3://{bucket}/dir/sub/b.bin"]
    s3.delete(uri)
    s3.delete(uri)  # gone already: no error, as in S3
    assert s3.list(f"s3://{bucket}/dir") == [f"s3://{bucket}/dir/sub/b.bin"]
    s3.delete_prefix(f"s3://{bucket}/dir")
    assert s3.list(f"s3://{bucket}/dir") == []


def test_s3_dir_roundtrip(s3, bucket, tmp_path):
    src = tmp_path / "src"
    (src / "x").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "x" / "b.txt").write_text("b")
    s3.upload_dir(src, f"s3://{bucket}/tree")
    dst = s3.download_dir(f"s3://{bucket}/tree", tmp_path / "dst")
    assert (dst / "a.txt").read_text() == "a" and (dst / "x" / "b.txt").read_text() == "b"


def test_s3_missing_object_and_bucket(s3, bucket):
    with pytest.raises(StorageNotFound):
        s3.read_bytes(f"s3://{bucket}/nope.csv")
    with pytest.raises(StorageNotFound):
        s3.read_bytes("s3://no-such-bucket-kfp/x")


def test_s3_wrong_credentials(s3_server, bucket):
    bad = Storage(StorageConfig(endpoint=s3_server.url.split("//")[1], access_key="wrong", secret_key="wrong-secret"))
    with pytest.raises(StorageAuthError) as e:
        bad.read_bytes(f"s3://{bucket}/x")
    assert "AWS_ACCESS_KEY_ID" in e.value.hint and "wrong-secret" not in str(e.value)


def test_a_session_token_is_sent_with_the_keys(s3_server, s3, bucket):
    s3.write_bytes(f"s3://{bucket}/token/x", b"1")
    host = s3_server.url.split("//")[1]
    keys = {"access_key": s3.config.access_key, "secret_key": s3.config.secret_key}
    assert Storage(StorageConfig(endpoint=host, **keys)).read_bytes(f"s3://{bucket}/token/x") == b"1"
    # the server checks the token it is sent: a stale one is refused, and the hint names it
    with pytest.raises(StorageAuthError) as e:
        Storage(StorageConfig(endpoint=host, session_token="expired-token", **keys)).read_bytes(f"s3://{bucket}/token/x")
    assert "AWS_SESSION_TOKEN" in e.value.hint and "expired-token" not in str(e.value)


def test_an_endpoint_whose_certificate_a_private_ca_signed_is_trusted_with_its_bundle(s3_server, s3, bucket, tmp_path):
    # On-prem MinIO behind TLS with the company's CA: without the CA the step failed with
    # "cannot reach the S3 endpoint (MaxRetryError)", and the only way out was to turn checks off
    import ssl

    from fake_trainer_status import _self_signed
    from servers import tls_proxy

    ca, cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    listener, url = tls_proxy(int(s3_server.url.rsplit(":", 1)[1]), tls)
    try:
        s3.write_bytes(f"s3://{bucket}/tls/x", b"over TLS")
        env = {**s3_server.env, "AWS_ENDPOINT_URL": url}
        with pytest.raises(StorageUnreachable) as e:
            Storage(StorageConfig.from_env(env)).read_bytes(f"s3://{bucket}/tls/x")
        assert e.value.message == (f"read s3://{bucket}/tls/x: the S3 endpoint {url} has a TLS certificate this machine "
                                   "does not trust (certificate verify failed)"), e.value.message
        assert e.value.hint.startswith("set AWS_CA_BUNDLE to the PEM file of the CA that signed it")
        trusted = Storage(StorageConfig.from_env({**env, "AWS_CA_BUNDLE": str(ca)}))
        assert trusted.config.secure and trusted.read_bytes(f"s3://{bucket}/tls/x") == b"over TLS"
        cfg = tmp_path / "storage.yaml"
        cfg.write_text(f"ca_bundle: {ca}\n")
        from_file = Storage(StorageConfig.from_env({**env, "KFP_PYTORCH_STORAGE_CONFIG": str(cfg)}))
        assert from_file.read_bytes(f"s3://{bucket}/tls/x") == b"over TLS"
    finally:
        listener.close()
    with pytest.raises(StorageError, match="AWS_CA_BUNDLE: no such file '/nonexistent/ca.pem'"):
        StorageConfig.from_env({**env, "AWS_CA_BUNDLE": "/nonexistent/ca.pem"})


def test_s3_unreachable_endpoint():
    st = Storage(StorageConfig(endpoint=f"127.0.0.1:{free_port()}", access_key="a", secret_key="b"))
    with pytest.raises(StorageUnreachable) as e:
        st.read_bytes("s3://bucket/x")
    assert "AWS_ENDPOINT_URL" in e.value.hint


def test_s3_without_endpoint_says_how_to_configure():
    with pytest.raises(StorageError) as e:
        Storage(StorageConfig()).read_bytes("s3://bkt/k")
    assert "AWS_ENDPOINT_URL" in e.value.hint


def test_storage_cp_uploads_and_downloads_files_and_directories(s3, bucket, tmp_path):
    import subprocess
    import sys

    cp = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cp", *a],  # noqa: E731
                                   capture_output=True, text=True)
    (tmp_path / "iris.csv").write_text("a,label\n1,0\n")
    r = cp(str(tmp_path / "iris.csv"), f"s3://{bucket}/datasets/")  # a prefix: the file keeps its name
    assert r.returncode == 0 and r.stdout == f"uploaded 1 file(s), 12 B, to s3://{bucket}/datasets/iris.csv\n", r.stderr
    assert s3.read_bytes(f"s3://{bucket}/datasets/iris.csv") == b"a,label\n1,0\n"
    (tmp_path / "table" / "day=1").mkdir(parents=True)
    (tmp_path / "table" / "day=1" / "part-0.parquet").write_bytes(b"p" * 10)
    (tmp_path / "table" / "_SUCCESS").write_bytes(b"")
    r = cp(str(tmp_path / "table"), f"minio://{bucket}/exports/table")
    assert r.returncode == 0 and "uploaded 2 file(s), 10 B, to minio://" in r.stdout, r.stderr
    assert s3.list(f"s3://{bucket}/exports/table") == [f"s3://{bucket}/exports/table/_SUCCESS",
                                                       f"s3://{bucket}/exports/table/day=1/part-0.parquet"]
    # -r, as mc cp -r and aws s3 cp --recursive take it (it was "No such option '-r'"): the same copy
    for flag in ("-r", "--recursive"):
        r = cp(flag, str(tmp_path / "table"), f"s3://{bucket}/again{flag}/table")
        assert r.returncode == 0 and "uploaded 2 file(s), 10 B" in r.stdout, r.stderr
        assert s3.list(f"s3://{bucket}/again{flag}/table") == [f"s3://{bucket}/again{flag}/table/_SUCCESS",
                                                               f"s3://{bucket}/again{flag}/table/day=1/part-0.parquet"]
        s3.delete_prefix(f"s3://{bucket}/again{flag}")
    # and back: an object into a directory, a prefix as a directory
    (tmp_path / "back").mkdir()
    r = cp(f"s3://{bucket}/datasets/iris.csv", str(tmp_path / "back"))
    assert r.returncode == 0 and (tmp_path / "back" / "iris.csv").read_text() == "a,label\n1,0\n", r.stderr
    (tmp_path / "back" / "table").mkdir()
    (tmp_path / "back" / "table" / "mine.txt").write_text("not downloaded")  # not counted as downloaded
    r = cp(f"s3://{bucket}/exports/table/", str(tmp_path / "back") + "/")
    assert r.returncode == 0 and (tmp_path / "back" / "table" / "day=1" / "part-0.parquet").read_bytes() == b"p" * 10
    assert r.stdout == f"downloaded 2 file(s), 10 B, to {tmp_path / 'back' / 'table'}\n"
    # a whole bucket: its keys keep their names (the first character of each was cut)
    r = cp(f"s3://{bucket}", str(tmp_path / "all"))
    assert r.returncode == 0 and r.stdout.startswith("downloaded 3 file(s), 22 B, to "), r.stdout + r.stderr
    assert sorted(str(p.relative_to(tmp_path / "all")) for p in (tmp_path / "all").rglob("*") if p.is_file()) == [
        "datasets/iris.csv", "exports/table/_SUCCESS", "exports/table/day=1/part-0.parquet"]
    # what cannot be copied says why
    r = cp(str(tmp_path / "none.csv"), f"s3://{bucket}/x")
    assert r.returncode == 1 and "copy " + str(tmp_path / "none.csv") + ": no such file or directory" in r.stderr
    r = cp(f"s3://{bucket}/nothing/", str(tmp_path / "n"))
    assert r.returncode == 1 and f"copy s3://{bucket}/nothing/: nothing stored there" in r.stderr
    r = cp(str(tmp_path / "iris.csv"), str(tmp_path / "copy.csv"))
    assert r.returncode == 2 and "SOURCE or DEST must be s3:// (or minio://); copy between local paths with cp" in r.stderr


def test_copies_report_their_bytes_as_they_move(s3, bucket, tmp_path):
    import os

    data = os.urandom(6 * 1024 * 1024 + 123)  # more than one minio chunk each way
    (tmp_path / "big.bin").write_bytes(data)
    sent, received = [], []
    s3.upload_file(tmp_path / "big.bin", f"s3://{bucket}/big.bin", sent.append)
    s3.download_file(f"s3://{bucket}/big.bin", tmp_path / "back.bin", received.append)
    assert (tmp_path / "back.bin").read_bytes() == data
    assert sum(sent) == len(data) and sum(received) == len(data) and len(received) > 1, (sent, received)
    moved = []  # a folder, both ways, and a local copy, on the same callback
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a").write_bytes(b"x" * 10)
    (tmp_path / "dir" / "b").write_bytes(b"y" * 5)
    s3.upload_dir(tmp_path / "dir", f"s3://{bucket}/dir", moved.append)
    s3.download_dir(f"s3://{bucket}/dir", tmp_path / "dir-back", moved.append)
    s3.download_dir(str(tmp_path / "dir"), tmp_path / "dir-local", moved.append)
    assert sum(moved) == 3 * 15
    entry = s3.stat(f"s3://{bucket}/big.bin")
    assert entry.size == len(data) and entry.modified.tzinfo is not None
    assert s3.stat(f"s3://{bucket}/none.bin") is None and s3.stat(str(tmp_path / "none")) is None


def test_folders_move_many_objects_at_once_and_an_error_in_one_is_raised(s3_server, s3, bucket, tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    for i in range(40):
        (src / f"part-{i:03d}.parquet").write_bytes(bytes([i]) * (i + 1))
    s3.upload_dir(src, f"s3://{bucket}/table")
    s3.write_bytes(f"s3://{bucket}/table/empty-folder/", b"")  # a "folder" an S3 console made: not a file
    s3.download_dir(f"s3://{bucket}/table", tmp_path / "back")
    got = sorted(p.name for p in (tmp_path / "back").rglob("*") if p.is_file())
    assert got == [f"part-{i:03d}.parquet" for i in range(40)]
    assert all((tmp_path / "back" / n).read_bytes() == (src / n).read_bytes() for n in got)
    bad = Storage(StorageConfig(endpoint=s3_server.url.split("//")[1], access_key="wrong", secret_key="wrong-secret"))
    with pytest.raises(StorageAuthError) as e:  # raised from the transfer threads, mapped as one call's would be
        bad.upload_dir(src, f"s3://{bucket}/other")
    assert "refused the credentials" in str(e.value) and "AWS_ACCESS_KEY_ID" in e.value.hint


def test_storage_cp_shows_a_bar_on_a_terminal_and_none_in_a_log(s3, bucket, tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    (tmp_path / "t.csv").write_bytes(b"a,label\n" * 100_000)
    cmd = [sys.executable, "-m", "kfp_pytorch.cli", "storage", "cp", str(tmp_path / "t.csv")]
    piped = subprocess.run([*cmd, f"s3://{bucket}/piped.csv"], capture_output=True, text=True)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr  # a log gets no bar
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a width
    proc = subprocess.Popen([*cmd, f"s3://{bucket}/tty.csv"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.communicate()[0].decode()
    os.close(master)
    assert proc.returncode == 0 and out.startswith("uploaded 1 file(s), 781.2 KB, to s3://"), out
    assert b"upload:" in seen and b"/781k" in seen, seen  # the bar, of the file's bytes (its updates: the test above)
    assert s3.read_bytes(f"s3://{bucket}/tty.csv") == (tmp_path / "t.csv").read_bytes()


def test_storage_ls_long_gives_times_sizes_and_a_total(s3, bucket, tmp_path):
    import re
    import subprocess
    import sys

    s3.write_bytes(f"s3://{bucket}/d/a.csv", b"x" * 2048)
    s3.write_bytes(f"s3://{bucket}/d/b.csv", b"y" * 10)
    ls = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "ls", *a],  # noqa: E731
                                   capture_output=True, text=True)
    r = ls("-l", f"s3://{bucket}/d")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ", "", line) for line in lines] == [
        f"2.0 KB  s3://{bucket}/d/a.csv", f"  10 B  s3://{bucket}/d/b.csv"], lines  # sizes aligned, names last
    assert r.stderr == "2 object(s), 2.0 KB\n"
    assert ls(f"s3://{bucket}/d").stdout == f"s3://{bucket}/d/a.csv\ns3://{bucket}/d/b.csv\n"  # plain: names only
    r = ls("--long", f"s3://{bucket}/d/b.csv")  # an object itself
    assert r.returncode == 0 and r.stdout.endswith(f"  10 B  s3://{bucket}/d/b.csv\n") and r.stderr == "1 object(s), 10 B\n"
    (tmp_path / "f.txt").write_text("hello")
    r = ls("-l", str(tmp_path))
    assert r.returncode == 0 and r.stdout.endswith(f"5 B  {tmp_path / 'f.txt'}\n"), r.stdout + r.stderr


def test_storage_ls_lists_one_level_with_folders_and_r_every_object(s3, bucket, tmp_path):
    # a pipeline root holds every run's every file: ls printed them all, thousands of lines, where
    # `mc ls` and `aws s3 ls` show the level asked for and its folders
    import subprocess
    import sys

    for key in ("root/top.json", "root/run-1/train/model.pt2", "root/run-1/train/history.json", "root/run-2/x.npz"):
        s3.write_bytes(f"s3://{bucket}/{key}", b"x" * 100)
    s3.write_bytes(f"s3://{bucket}/root/", b"")  # an S3 console's folder marker of the folder listed
    ls = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "ls", *a],  # noqa: E731
                                   capture_output=True, text=True)
    r = ls(f"s3://{bucket}/root")
    assert r.returncode == 0 and r.stdout.splitlines() == [
        f"s3://{bucket}/root/run-1/", f"s3://{bucket}/root/run-2/", f"s3://{bucket}/root/top.json"], r.stdout + r.stderr
    r = ls("-l", f"s3://{bucket}/root/")
    lines = r.stdout.splitlines()
    assert lines[0] == f"{'':19}    DIR  s3://{bucket}/root/run-1/" and lines[2].endswith(f"100 B  s3://{bucket}/root/top.json")
    assert r.stderr == "1 object(s), 100 B; 2 folder(s) (-r lists what is in them too)\n"
    r = ls("-r", f"s3://{bucket}/root")
    assert r.stdout.splitlines() == [f"s3://{bucket}/root/"] + [
        f"s3://{bucket}/root/{k}" for k in ("run-1/train/history.json", "run-1/train/model.pt2", "run-2/x.npz", "top.json")]
    assert ls(f"s3://{bucket}/root/run-1/train").stdout.splitlines() == [
        f"s3://{bucket}/root/run-1/train/history.json", f"s3://{bucket}/root/run-1/train/model.pt2"]
    # a folder on this machine, the same way
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.txt").write_text("x")
    (tmp_path / "f.txt").write_text("hello")
    assert ls(str(tmp_path)).stdout.splitlines() == [str(tmp_path / "f.txt"), f"{tmp_path / 'sub'}/"]
    assert ls("-r", str(tmp_path)).stdout.splitlines() == [str(tmp_path / "f.txt"), str(tmp_path / "sub" / "deep.txt")]


def test_storage_rm_removes_an_object_or_with_r_a_prefix_and_lists_what_it_removed(s3, bucket, tmp_path):
    import subprocess
    import sys

    for key in ("d/a.csv", "d/sub/b.csv", "keep.csv"):
        s3.write_bytes(f"s3://{bucket}/{key}", b"x" * 10)
    rm = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "rm", *a],  # noqa: E731
                                   capture_output=True, text=True)
    r = rm(f"s3://{bucket}/d")  # a prefix without -r: refused, nothing removed
    assert r.returncode == 2 and f"s3://{bucket}/d is a prefix with 2 object(s) under it, not an object: add -r" in r.stderr
    r = rm("-r", "--dry-run", f"s3://{bucket}/d/")
    assert r.returncode == 0 and r.stdout == (f"would remove s3://{bucket}/d/a.csv\n"
                                              f"would remove s3://{bucket}/d/sub/b.csv\n")
    assert r.stderr == "would remove 2 object(s), 20 B\n" and len(s3.list(f"s3://{bucket}")) == 3
    r = rm("-r", f"minio://{bucket}/d")
    assert r.returncode == 0 and r.stdout.count("removed ") == 2 and r.stderr == "removed 2 object(s), 20 B\n"
    assert s3.list(f"s3://{bucket}") == [f"s3://{bucket}/keep.csv"]
    # and ls no longer lists the folders they were in (SeaweedFS kept d/ and d/sub/ for minutes)
    assert [e.uri for e in s3.entries(f"s3://{bucket}", recursive=False)] == [f"s3://{bucket}/keep.csv"]
    r = rm(f"s3://{bucket}/keep.csv")
    assert r.returncode == 0 and r.stdout == f"removed s3://{bucket}/keep.csv\n" and s3.list(f"s3://{bucket}") == []
    r = rm(f"s3://{bucket}/keep.csv")  # gone: said, not a silent success
    assert r.returncode == 1 and f"remove s3://{bucket}/keep.csv: nothing stored there" in r.stderr
    r = rm(str(tmp_path))
    assert r.returncode == 2 and "storage rm removes objects from S3" in r.stderr and tmp_path.exists()


def test_removing_objects_removes_the_folders_they_leave_empty_and_no_other(s3, bucket):
    import io
    import subprocess
    import sys

    ls = lambda key="": [e.uri.split(f"{bucket}/", 1)[1] for e in s3.entries(f"s3://{bucket}/{key}", recursive=False)]  # noqa: E731
    for key in ("runs/a/model/w.pt", "runs/a/metrics.json", "runs/b/model/w.pt", "data/x/y/t.csv", "data/keep.csv"):
        s3.write_bytes(f"s3://{bucket}/{key}", b"x")
    s3.delete(f"s3://{bucket}/data/x/y/t.csv")
    assert s3.remove_empty_folders(f"s3://{bucket}/data/x/y/t.csv") == [f"s3://{bucket}/data/x/y/", f"s3://{bucket}/data/x/"]
    assert ls() == ["data/", "runs/"] and ls("data") == ["data/keep.csv"]  # data/ holds keep.csv: it stays
    s3.delete(f"s3://{bucket}/runs/a/model/w.pt")  # runs/a/ holds metrics.json: only model/ goes
    assert s3.remove_empty_folders(f"s3://{bucket}/runs/a/model/") == [f"s3://{bucket}/runs/a/model/"]
    assert ls("runs/a") == ["runs/a/metrics.json"]
    s3.delete_prefix(f"s3://{bucket}/runs")  # every object and folder under it, and runs/ itself
    assert ls() == ["data/"] and s3.list(f"s3://{bucket}/data") == [f"s3://{bucket}/data/keep.csv"]
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "rm", f"s3://{bucket}/data/keep.csv"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and ls() == []  # the bucket itself stays
    assert s3.bucket_exists(f"s3://{bucket}")
    s3.write_bytes(f"s3://{bucket}/solo/t.csv", b"x")  # -r on an object: its folder goes as without -r
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "rm", "-r", f"s3://{bucket}/solo/t.csv"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"removed s3://{bucket}/solo/t.csv\n" and ls() == [], (r.stderr, ls())
    # a folder that is not there (as on MinIO and AWS, which drop it themselves) gets no DELETE: one
    # of a key that is not there would leave a delete marker in a versioned bucket
    sent = io.StringIO()
    s3.client.trace_on(sent)
    try:
        assert s3.remove_empty_folders(f"s3://{bucket}/never/made/x.csv") == []
    finally:
        s3.client.trace_off()
    assert "GET /" in sent.getvalue() and "DELETE" not in sent.getvalue()


def test_storage_check_leaves_the_bucket_as_it_found_it_and_rm_removes_an_empty_folder(s3, bucket):
    import subprocess
    import sys

    from kfp_pytorch.components.storage import check_access

    ls = lambda key="": [e.uri.split(f"{bucket}/", 1)[1] for e in s3.entries(f"s3://{bucket}/{key}", recursive=False)]  # noqa: E731
    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", *a],  # noqa: E731
                                    capture_output=True, text=True)
    # check's probe object made new/deep/er/ and SeaweedFS kept them: `ls` listed new/ ever after
    assert all(good for _, good in check_access(f"s3://{bucket}/new/deep/er", storage=s3))
    assert ls() == []
    s3.write_bytes(f"s3://{bucket}/keep/a.txt", b"x")
    assert all(good for _, good in check_access(f"s3://{bucket}/keep/x/y", storage=s3))
    assert ls() == ["keep/"] and ls("keep") == ["keep/a.txt"]  # the folders it found stay, and only they
    # credentials that may write and read but not list (no s3:ListBucket) are checked as before: the
    # folder check is skipped, not the check failed. The test server has one identity with every
    # right, so a Storage whose listing is refused stands in for them.
    from kfp_pytorch.components.errors import StorageAuthError

    class NoListing(type(s3)):
        def _first_keys(self, loc, prefix, n=2):
            raise StorageAuthError(f"list s3://{loc.bucket}/{prefix}: AccessDenied")

    lines = check_access(f"s3://{bucket}/keep/z", storage=NoListing(s3.config))
    assert [good for _, good in lines] == [True] * 5, lines
    assert [line for line, _ in lines][-2:] == [f"write permission under s3://{bucket}/keep/z",
                                                 f"read permission under s3://{bucket}/keep/z"]
    assert ls("keep") == ["keep/a.txt", "keep/z/"]  # the probe's folder stays: it could not tell it was new
    s3.remove_empty_folders(f"s3://{bucket}/keep/z/")
    # a folder left empty (its objects removed by another tool) is listed, so rm takes it, with no -r:
    # it was "nothing stored there"
    s3.write_bytes(f"s3://{bucket}/old/run/m.pt", b"x")
    s3.delete(f"s3://{bucket}/old/run/m.pt")
    assert ls() == ["keep/", "old/"] and ls("old") == ["old/run/"]
    r = cli("rm", "--dry-run", f"s3://{bucket}/old")
    assert r.returncode == 0 and r.stdout == f"would remove empty folder s3://{bucket}/old/\n" and ls() == ["keep/", "old/"]
    r = cli("rm", f"s3://{bucket}/old")
    assert r.returncode == 0 and r.stdout == (f"removed empty folder s3://{bucket}/old/run/\n"
                                              f"removed empty folder s3://{bucket}/old/\n"), r.stderr
    assert ls() == ["keep/"]
    r = cli("rm", f"s3://{bucket}/old")
    assert r.returncode == 1 and f"remove s3://{bucket}/old: nothing stored there" in r.stderr
    s3.write_bytes(f"s3://{bucket}/older.csv", b"x")  # a name that starts as the folder's is not it
    for args in (["--dry-run"], []):
        r = cli("rm", *args, f"s3://{bucket}/old")
        assert r.returncode == 1 and f"remove s3://{bucket}/old: nothing stored there" in r.stderr, r.stdout
    assert s3.exists(f"s3://{bucket}/older.csv")
    s3.delete(f"s3://{bucket}/older.csv")
    r = cli("rm", f"s3://{bucket}/keep")  # a folder with an object in it still needs -r
    assert r.returncode == 2 and "add -r" in r.stderr and ls("keep") == ["keep/a.txt"]


def test_storage_rb_removes_a_bucket_only_when_told_what_goes_with_it(s3, bucket):
    # there was mb and no rb; and SeaweedFS removes a bucket with objects in it without a word
    import subprocess
    import sys

    from kfp_pytorch.components.errors import StorageError

    rb = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "rb", *a],  # noqa: E731
                                   capture_output=True, text=True)
    for key in ("runs/a/model.pt", "data.csv"):
        s3.write_bytes(f"s3://{bucket}/{key}", b"12345")
    with pytest.raises(StorageError, match="it holds 2 object"):  # the API checks, not the server
        s3.remove_bucket(f"s3://{bucket}")
    r = rb(f"s3://{bucket}")
    assert r.returncode == 2 and f"s3://{bucket} holds 2 object(s), 10 B: add --force" in r.stderr
    r = rb("--force", "--dry-run", f"s3://{bucket}")
    assert r.returncode == 0 and r.stdout == (f"would remove s3://{bucket}/data.csv\nwould remove s3://{bucket}/runs/a/model.pt\n"
                                              f"would remove bucket s3://{bucket} and 2 object(s), 10 B\n"), r.stderr
    assert s3.bucket_exists(f"s3://{bucket}") and len(s3.list(f"s3://{bucket}")) == 2
    r = rb(f"s3://{bucket}/runs")
    assert r.returncode == 2 and "is not a bucket" in r.stderr and "storage rm -r" in r.stderr
    r = rb("--force", f"s3://{bucket}")
    assert r.returncode == 0 and r.stdout.endswith(f"removed bucket s3://{bucket} and 2 object(s), 10 B\n"), r.stderr
    assert not s3.bucket_exists(f"s3://{bucket}")
    r = rb(f"s3://{bucket}")
    assert r.returncode == 1 and f"remove bucket s3://{bucket}: there is no such bucket" in r.stderr
    # a bucket whose objects are gone, with the folders SeaweedFS keeps, is empty: no --force needed
    s3.ensure_bucket(f"s3://{bucket}")
    s3.write_bytes(f"s3://{bucket}/old/run/m.pt", b"x")
    s3.delete(f"s3://{bucket}/old/run/m.pt")
    r = rb(f"s3://{bucket}")
    assert r.returncode == 0 and r.stdout == f"removed bucket s3://{bucket}\n" and not s3.bucket_exists(f"s3://{bucket}")


def test_a_table_on_this_machine_is_refused_for_a_kfp_server_run(tmp_path):
    import subprocess
    import sys

    (tmp_path / "iris.csv").write_text("a,label\n1,0\n")
    submit = lambda uri: subprocess.run(  # noqa: E731 (a KFP address nobody answers: refused before any call)
        [sys.executable, "-m", "kfp_pytorch.cli", "submit", "train_and_serve", "--host", "http://127.0.0.1:9",
         "--param", f"dataset_uri={uri}", "--param", "tracking_uri=http://mlflow:5000"], capture_output=True, text=True)
    r = submit(str(tmp_path / "iris.csv"))
    assert r.returncode == 2 and "the KFP server's pods cannot read it" in r.stderr and "cannot reach" not in r.stderr
    assert (f"hint: upload it: `kfp-pytorch storage cp {tmp_path / 'iris.csv'} s3://BUCKET/datasets/` and pass "
            "--param dataset_uri=s3://BUCKET/datasets/iris.csv") in r.stderr
    r = submit("/data/in-the-image.csv")  # not here: maybe in the component image, so a note, and the call is made
    assert "note: dataset_uri /data/in-the-image.csv is a path: the prepare step's pod reads it" in r.stderr
    assert "cannot reach the KFP API at http://127.0.0.1:9" in r.stderr


def test_a_problem_with_a_local_file_is_not_taken_for_an_unreachable_server(s3, bucket, tmp_path):
    s3.write_bytes(f"s3://{bucket}/k.csv", b"a,b\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "a-file").write_text("x")
    for call, needle in [
        (lambda: s3.upload_file(tmp_path / "missing.csv", f"s3://{bucket}/z"),
         f"upload s3://{bucket}/z: No such file or directory: {tmp_path / 'missing.csv'}"),
        (lambda: s3.upload_file(tmp_path / "dir", f"s3://{bucket}/z"), f"Is a directory: {tmp_path / 'dir'}"),
        (lambda: s3.download_file(f"s3://{bucket}/k.csv", tmp_path / "a-file" / "k.csv"),
         f"File exists: {tmp_path / 'a-file'} ({tmp_path / 'a-file'} is a file, where that path needs a folder)"),
        # /proc takes no new file: the path given, not minio's NAME.<etag>.part.minio beside it
        (lambda: s3.download_file(f"s3://{bucket}/k.csv", tmp_path.root + "proc/kfp-pytorch-k.csv"),
         "No such file or directory: /proc/kfp-pytorch-k.csv"),
    ]:
        with pytest.raises(StorageError) as e:
            call()
        assert not isinstance(e.value, StorageUnreachable) and "cannot reach" not in str(e.value)
        assert needle in str(e.value) and "free disk space" in e.value.hint, str(e.value)
        assert ".part.minio" not in str(e.value)
    with pytest.raises(StorageError) as e:  # minio's bare ValueError before
        s3.download_file(f"s3://{bucket}/k.csv", tmp_path / "dir")
    assert f"{tmp_path / 'dir'} is a directory" in str(e.value) and str(tmp_path / "dir" / "k.csv") in e.value.hint
    assert s3.list(f"s3://{bucket}") == [f"s3://{bucket}/k.csv"] and (tmp_path / "a-file").read_text() == "x"
    with pytest.raises(StorageNotFound, match="no such file"):  # a bare FileNotFoundError before
        list(s3.iter_chunks(str(tmp_path / "missing.csv")))


def test_a_local_path_with_a_file_in_the_way_is_a_storage_error_that_names_the_file(tmp_path):
    # a local output under a file (a table's path given for a folder): bare NotADirectoryError and
    # FileExistsError tracebacks from every write, and from train's workers
    st = Storage()
    table = tmp_path / "rows.csv"
    table.write_text("a\n1\n")
    (tmp_path / "dir").mkdir()
    below = table / "out"
    for call, needle in [
        (lambda: st.write_bytes(str(below / "train" / "shard.npz"), b"x"),
         f"write {below / 'train' / 'shard.npz'}: Not a directory: {below / 'train'} ({table} is a file, where that "
         "path needs a folder)"),
        (lambda: st.write_bytes(str(table / "a"), b"x"), f"File exists: {table} ({table} is a file"),
        (lambda: st.upload_file(table, str(below / "k.csv")), f"upload {below / 'k.csv'}: "),
        (lambda: st.upload_stream(io.BytesIO(b"x"), str(below / "k.csv")), f"({table} is a file"),
        (lambda: st.download_dir(str(tmp_path / "dir"), below / "d"), f"({table} is a file"),
        (lambda: st.ensure_bucket(str(below)), f"create folder {below}: "),
        (lambda: st.read_bytes(str(tmp_path / "dir")), f"read {tmp_path / 'dir'}: Is a directory"),
    ]:
        with pytest.raises(StorageError) as e:
            call()
        assert needle in str(e.value) and "free disk space" in e.value.hint, str(e.value)
    st.delete(str(below / "gone.json"))  # nothing there to delete: no error, as in S3
    with pytest.raises(StorageNotFound, match="no such file"):
        st.read_bytes(str(below / "metadata.json"))
    assert table.read_text() == "a\n1\n"  # nothing was lost


def test_storage_mb_makes_the_bucket_an_upload_to_a_missing_one_asks_for(s3, tmp_path):
    import subprocess
    import sys

    import os
    import uuid

    # no AWS_REGION: minio then asks the bucket's location first, which MinIO and SeaweedFS answer
    # NoSuchBucket (with a region set, SeaweedFS makes a missing bucket on the first PUT; MinIO does not)
    env = {k: v for k, v in os.environ.items() if k != "AWS_REGION"}
    st = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", *a],  # noqa: E731
                                   capture_output=True, text=True, env=env)

    b = f"fresh-{uuid.uuid4().hex[:8]}"  # the server lives for the session: a name no other run made
    (tmp_path / "iris.csv").write_text("a,label\n1,0\n")
    r = st("cp", str(tmp_path / "iris.csv"), f"s3://{b}/iris.csv")
    assert r.returncode == 1 and f"there is no bucket '{b}'" in r.stderr, r.stderr
    assert f"create it: `kfp-pytorch storage mb s3://{b}`" in r.stderr
    # with a region set too, from a file, from stdin and from another bucket: SeaweedFS would make
    # the bucket on the first PUT, so a typo in its name would leave the data where nothing reads it
    regional = lambda *a, data=None: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "kfp_pytorch.cli", "storage", *a], capture_output=True, text=True, input=data,
        env=dict(env, AWS_REGION="us-east-1"))
    s3.ensure_bucket("s3://data-staging")
    s3.write_bytes("s3://data-staging/iris.csv", b"a,label\n1,0\n")
    for args, data in [((str(tmp_path / "iris.csv"), f"s3://{b}/iris.csv"), None), (("-", f"s3://{b}/x.csv"), "a\n"),
                       (("s3://data-staging/iris.csv", f"s3://{b}/"), None),
                       (("s3://data-staging/", f"s3://{b}/copy/"), None)]:
        r = regional("cp", *args, data=data)
        assert r.returncode == 1 and f"copy to {args[1]}: there is no bucket '{b}'" in r.stderr, r.stderr
    assert not s3.bucket_exists(f"s3://{b}")  # none was made
    r = regional("cp", str(tmp_path / "missing.csv"), f"s3://{b}/")  # the local path is checked first
    assert r.returncode == 1 and "no such file or directory" in r.stderr, r.stderr
    assert f"create it with `kfp-pytorch storage mb s3://{b}`" in st("check", f"s3://{b}/x").stdout
    r = st("mb", f"s3://{b}")
    assert r.returncode == 0 and r.stdout == f"made bucket s3://{b}\n", r.stderr
    r = st("mb", f"minio://{b}/")  # again, as a set-up script does: not an error
    assert r.returncode == 0 and r.stdout == f"bucket s3://{b} exists already\n"
    assert st("cp", str(tmp_path / "iris.csv"), f"s3://{b}/iris.csv").returncode == 0
    assert s3.read_bytes(f"s3://{b}/iris.csv") == b"a,label\n1,0\n"
    for bad, needle in [(f"s3://{b}/iris.csv", "is not a bucket: give s3://BUCKET"),
                        (str(tmp_path), "is not a bucket"),
                        ("s3://Fresh_Data", "'Fresh_Data' is not a valid bucket name")]:  # refused here, not by the server
        r = st("mb", bad)
        assert r.returncode in (1, 2) and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_storage_cat_streams_objects_to_stdout_and_checks_every_uri_first(s3, bucket, tmp_path):
    import os
    import subprocess
    import sys

    cat = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cat", *a],  # noqa: E731
                                    capture_output=True)
    blob = os.urandom(3 * 1024 * 1024 + 7)  # more than one streamed chunk, and not text
    s3.write_bytes(f"s3://{bucket}/model.bin", blob)
    s3.write_bytes(f"s3://{bucket}/run/metrics.json", b'{"accuracy": 0.97}\n')
    r = cat(f"s3://{bucket}/model.bin")
    assert r.returncode == 0 and r.stdout == blob and r.stderr == b""
    r = cat(f"s3://{bucket}/run/metrics.json", f"minio://{bucket}/run/metrics.json")  # one after the other
    assert r.returncode == 0 and r.stdout == b'{"accuracy": 0.97}\n' * 2
    r = cat(f"s3://{bucket}/run/metrics.json", f"s3://{bucket}/run/missing.json")
    assert r.returncode == 1 and r.stdout == b"" and f"cat s3://{bucket}/run/missing.json: nothing stored there".encode() in r.stderr
    for prefix in (f"s3://{bucket}/run", f"s3://{bucket}/run/"):
        r = cat(prefix)
        assert r.returncode == 2 and r.stdout == b"" and f"{prefix} is a prefix with 1 object(s) under it".encode() in r.stderr
    r = cat(str(tmp_path))
    assert r.returncode == 2 and b"is a local path: storage cat reads objects from S3" in r.stderr
    p = subprocess.Popen([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cat", f"s3://{bucket}/model.bin"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10) == blob[:10]
    p.stdout.close()  # as `| head -c 10` does: the reader went, which is no error to report
    assert p.wait(timeout=60) in (0, 1) and b"Traceback" not in p.stderr.read()


def test_storage_ls_without_a_uri_lists_the_buckets_and_a_missing_one_points_there(s3, bucket):
    import os
    import subprocess
    import sys

    st = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", *a],  # noqa: E731
                                   capture_output=True, text=True)
    for args in ((), ("s3://",), ("minio://",)):  # as `aws s3 ls` and `mc ls ALIAS`
        r = st("ls", *args)
        assert r.returncode == 0 and f"s3://{bucket}/\n" in r.stdout, r.stderr
        assert r.stdout.splitlines() == sorted(r.stdout.splitlines()) and all(
            line.startswith("s3://") and line.endswith("/") for line in r.stdout.splitlines())
    r = st("ls", "-l")
    [line] = [ln for ln in r.stdout.splitlines() if ln.endswith(f"s3://{bucket}/")]
    assert line[:2] == "20" and line[4] == "-" and line[10] == " "  # its creation time first, as `aws s3 ls`
    r = st("ls", "s3://no-such-bucket-here/x")
    assert r.returncode == 1 and "there is no bucket 'no-such-bucket-here'" in r.stderr
    assert "`kfp-pytorch storage ls` lists the buckets" in r.stderr
    s3.write_bytes(f"s3://{bucket}/run/metrics.json", b"{}")
    r = st("cat", f"s3://{bucket}/run/metric.json")  # a typo: the folder it is in is where to look
    assert r.returncode == 1 and f"`kfp-pytorch storage ls s3://{bucket}/run/` lists what is there" in r.stderr
    bad = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "ls"], capture_output=True, text=True,
                       env=bad)
    assert r.returncode == 1 and "list buckets s3://: the S3 server" in r.stderr and "refused the credentials" in r.stderr


def test_storage_cp_copies_from_s3_to_s3_inside_the_server(s3, bucket, monkeypatch):
    import os
    import subprocess
    import sys

    from kfp_pytorch.components import storage as storage_mod

    cp = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cp", *a],  # noqa: E731
                                   capture_output=True, text=True)
    s3.write_bytes(f"s3://{bucket}/staging/iris.csv", b"a,label\n1,0\n")
    s3.write_bytes(f"s3://{bucket}/staging/table/part-0.parquet", b"p" * 10)
    s3.write_bytes(f"s3://{bucket}/staging/table/part-1.parquet", b"q" * 20)
    r = cp(f"s3://{bucket}/staging/iris.csv", f"s3://{bucket}/prod/")  # a prefix: the object keeps its name
    assert r.returncode == 0 and r.stdout == f"copied 1 object, 12 B, to s3://{bucket}/prod/iris.csv\n", r.stderr
    r = cp(f"s3://{bucket}/staging/table", f"minio://{bucket}/prod/table-v2")
    assert r.returncode == 0 and r.stdout == f"copied 2 object(s), 30 B, to minio://{bucket}/prod/table-v2\n"
    assert s3.list(f"s3://{bucket}/prod") == [f"s3://{bucket}/prod/iris.csv", f"s3://{bucket}/prod/table-v2/part-0.parquet",
                                               f"s3://{bucket}/prod/table-v2/part-1.parquet"]
    assert s3.read_bytes(f"s3://{bucket}/prod/table-v2/part-1.parquet") == b"q" * 20
    assert len(s3.list(f"s3://{bucket}/staging")) == 3  # a copy: the source stays
    # onto itself, or a prefix into itself (each run would nest one level deeper): refused, nothing copied
    r = cp(f"s3://{bucket}/staging/iris.csv", f"s3://{bucket}/staging/")
    assert r.returncode == 2 and f"SOURCE and DEST are the same object, s3://{bucket}/staging/iris.csv" in r.stderr
    for src, dst in ((f"s3://{bucket}/staging/", f"s3://{bucket}/staging/"), (f"s3://{bucket}/staging", f"s3://{bucket}/staging/old/"),
                     (f"s3://{bucket}/", f"s3://{bucket}/backup/")):
        r = cp(src, dst)
        assert r.returncode == 2 and f"cannot copy {src} into itself" in r.stderr, (src, dst, r.stderr)
    assert len(s3.list(f"s3://{bucket}/staging")) == 3 and len(s3.list(f"s3://{bucket}/")) == 6
    r = cp(f"s3://{bucket}/staging", f"s3://{bucket}/staging-copy/")  # a sibling that shares the name's start
    assert r.returncode == 0 and r.stdout.startswith("copied 3 object(s)") and s3.list(f"s3://{bucket}/staging/") == \
        [f"s3://{bucket}/staging/iris.csv", f"s3://{bucket}/staging/table/part-0.parquet",
         f"s3://{bucket}/staging/table/part-1.parquet"]
    s3.delete_prefix(f"s3://{bucket}/staging-copy/")
    r = cp(f"s3://{bucket}/staging/nothing/", f"s3://{bucket}/prod/")
    assert r.returncode == 1 and f"copy s3://{bucket}/staging/nothing/: nothing stored there" in r.stderr
    assert f"`kfp-pytorch storage ls s3://{bucket}/staging/` lists what is there" in r.stderr
    # no AWS_REGION: minio asks the bucket's location first, answered NoSuchBucket as MinIO answers the
    # copy itself (with a region set, SeaweedFS answers a copy into a missing bucket with HTTP 500s)
    env = {k: v for k, v in os.environ.items() if k != "AWS_REGION"}
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cp", f"s3://{bucket}/staging/iris.csv",
                        "s3://no-such-bucket-cp/x.csv"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "copy to s3://no-such-bucket-cp/x.csv: there is no bucket" in r.stderr, r.stderr
    assert "`kfp-pytorch storage mb s3://no-such-bucket-cp`" in r.stderr
    r = cp(f"s3://{bucket}/staging/iris.csv", "s3://no-such-bucket-cp/x.csv")  # with a region: asked first, too
    assert r.returncode == 1 and "copy to s3://no-such-bucket-cp/x.csv: there is no bucket" in r.stderr, r.stderr
    with pytest.raises(StorageError) as e:  # SeaweedFS's 500s, had the copy been sent: reached, not unreachable
        s3.copy(f"s3://{bucket}/staging/iris.csv", "s3://no-such-bucket-cp/x.csv", 12)
    assert "answered every retry with an error (too many 500 error responses)" in str(e.value)
    assert "cannot reach" not in str(e.value)
    monkeypatch.setattr(storage_mod, "_COPY_LIMIT", 5)  # above S3's one-request limit: copied in parts
    assert s3.copy(f"s3://{bucket}/staging/iris.csv", f"s3://{bucket}/big/iris.csv") == 12
    assert s3.read_bytes(f"s3://{bucket}/big/iris.csv") == b"a,label\n1,0\n"


def test_storage_cp_streams_stdin_to_an_object_and_an_object_to_stdout(s3, bucket, tmp_path):
    """`cp - URI` uploads what it is piped (its length unknown: in 16 MiB parts), `cp URI -` prints
    the object, as `aws s3 cp` does."""
    import io
    import os
    import subprocess
    import sys

    cp = lambda *a, data=b"": subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "storage", "cp", *a],  # noqa: E731
                                             input=data, capture_output=True)
    data = os.urandom(17 * 1024 * 1024 + 5)  # two parts, the second short
    uri = f"s3://{bucket}/piped/export.bin"
    r = cp("-", uri, data=data)
    assert r.returncode == 0 and r.stdout.decode() == f"uploaded 17.0 MB from stdin to {uri}\n", r.stderr
    assert s3.read_bytes(uri) == data
    r = cp(uri, "-")
    assert r.returncode == 0 and r.stdout == data
    r = cp("-", f"s3://{bucket}/piped/empty.csv")  # nothing piped: an empty object, as aws s3 cp makes
    assert r.returncode == 0 and s3.stat(f"s3://{bucket}/piped/empty.csv").size == 0
    for dest in (f"s3://{bucket}/piped/", f"s3://{bucket}", str(tmp_path / "x")):
        r = cp("-", dest, data=b"x")
        assert r.returncode == 2 and "DEST must name an object: s3://BUCKET/KEY" in r.stderr.decode(), dest
    r = cp(f"s3://{bucket}/piped/", "-")
    assert r.returncode == 2 and r.stdout == b"" and "is a prefix with 2 object(s)" in r.stderr.decode()
    assert s3.list(f"s3://{bucket}/piped/") == [f"s3://{bucket}/piped/empty.csv", uri]
    # a local destination through the same method: written whole, then moved into place
    target = tmp_path / "out" / "copy.bin"
    assert s3.upload_stream(io.BytesIO(b"abc" * 1000), str(target)) == 3000 and target.read_bytes() == b"abc" * 1000
    assert [p.name for p in target.parent.iterdir()] == ["copy.bin"]
