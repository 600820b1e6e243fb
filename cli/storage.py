"""``kfp-pytorch storage ...``: MinIO / S3 (check, ls, cp, cat, mb, rb, rm)."""
import sys
from pathlib import PurePosixPath

import click

from ._app import _LOCAL_OR_URI, _said, _size, cli


@cli.group("storage")
def storage_grp():
    """Object storage (MinIO / S3) as configured by AWS_ENDPOINT_URL and credentials."""


@storage_grp.command("ls", short_help="List the buckets, or the objects under a prefix.")
@click.argument("uri", required=False, type=_LOCAL_OR_URI)
@click.option("-l", "--long", "long_", is_flag=True,
              help="Each object's last-modified time (UTC) and size too, and the count and total size at the end.")
@click.option("-r", "--recursive", is_flag=True, help="Every object below URI, in its folders too.")
def storage_ls(uri, long_, recursive):
    """The objects and folders (ending in /) right under URI (s3://BUCKET/PREFIX, minio:// or a local
    path), one per line, as `mc ls` and `aws s3 ls` list them; -r: every object below it. Without URI
    (or with s3://), the buckets."""
    from kfp_pytorch.components.storage import Storage, parse_uri

    storage = Storage()
    if uri is None or uri.rstrip("/") in ("s3:", "minio:"):
        buckets = storage.buckets()
        if not buckets:
            click.echo("no buckets (`kfp-pytorch storage mb s3://NAME` makes one)", err=True)
            sys.exit(1)
        for b in buckets:  # as `aws s3 ls`: the creation time, then the name
            click.echo(f"{b.modified:%Y-%m-%d %H:%M:%S}  {b.uri}" if long_ else b.uri)
        return
    # one level by default: a pipeline root holds every run's every file, thousands of lines at once
    found = storage.entries(uri, recursive=recursive)
    loc = parse_uri(uri)
    if not found and (loc.key if loc.is_s3 else loc.path.is_file()) and (entry := storage.stat(uri)):
        found = [entry]  # an object itself, as `aws s3 ls s3://b/file` shows it
    if not found:  # as `aws s3 ls`: an empty answer is not a success a script should read on
        click.echo(f"nothing under {uri}", err=True)
        sys.exit(1)
    if not long_:
        for e in found:
            click.echo(e.uri)
        return
    objects = [e for e in found if not e.is_folder]
    sizes = ["DIR" if e.is_folder else _size(e.size) for e in found]
    width = max(map(len, sizes))
    for e, size in zip(found, sizes):  # as `aws s3 ls`: time, size, name; the names stay last for a script's cut
        click.echo(f"{'' if e.is_folder else f'{e.modified:%Y-%m-%d %H:%M:%S}':19}  {size:>{width}}  {e.uri}")
    folders = len(found) - len(objects)
    click.echo(f"{len(objects)} object(s), {_size(sum(e.size for e in objects))}"
               + (f"; {folders} folder(s) (-r lists what is in them too)" if folders else ""), err=True)


def _ls_hint(uri: str) -> str:
    """Where to look for what a URI with nothing under it meant: the folder above it."""
    from kfp_pytorch.components.storage import parse_uri

    loc = parse_uri(uri)
    parent = loc.key.rstrip("/").rpartition("/")[0]
    return f"`kfp-pytorch storage ls s3://{loc.bucket}/{parent + '/' if parent else ''}` lists what is there"


def _bytes_bar(total: int, label: str):
    """A bar of the bytes a copy has moved, on stderr when that is a terminal (none in a log or a pipe);
    it is gone when the copy is done, and the line that says what was copied stays."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None, leave=False, mininterval=0.2)


_CP_SAID = ("Give SOURCE and DEST: kfp-pytorch storage cp iris.csv s3://BUCKET/datasets/ uploads, "
            "kfp-pytorch storage cp s3://BUCKET/KEY . downloads.")


@storage_grp.command("cp", short_help="Copy files to, from or inside S3.")
@click.argument("source", type=_said(_CP_SAID, _LOCAL_OR_URI))
@click.argument("dest", type=_said(_CP_SAID, _LOCAL_OR_URI))
@click.option("-r", "--recursive", is_flag=True,
              help="Taken as mc cp -r and aws s3 cp --recursive take it: a directory or prefix is copied whole "
                   "with or without it.")
def storage_cp(source, dest, recursive):
    """Copy a file or a directory to S3 (SOURCE a local path, DEST s3://BUCKET/KEY or minio://), or
    from S3 (SOURCE an object or a prefix, DEST a local path): a table for a KFP run's dataset_uri,
    a model to look at; or from S3 to S3 inside the server (a dataset promoted to another bucket).
    A DEST ending in / (or an existing directory) takes the source's name. SOURCE '-' uploads stdin
    to the object DEST; DEST '-' writes the object SOURCE to stdout. A bar shows the bytes moved
    when stderr is a terminal."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, join, parse_uri

    if source == "-" and dest == "-":
        raise click.UsageError("SOURCE and DEST cannot both be '-' (stdin, stdout)")
    if dest == "-":  # as `aws s3 cp s3://b/k -`: the object to stdout
        return click.get_current_context().invoke(storage_cat, uris=(source,))
    if source == "-":  # as `aws s3 cp - s3://b/k`: stdin to one object, streamed in parts
        loc = parse_uri(dest)
        if not loc.is_s3 or not loc.key or loc.key.endswith("/"):
            raise click.UsageError(f"with SOURCE '-' (stdin), DEST must name an object: s3://BUCKET/KEY, got {dest}")
        storage = Storage()
        storage.check_writable(dest, f"copy to {dest}")
        sent = storage.upload_stream(sys.stdin.buffer, dest)
        click.echo(f"uploaded {_size(sent)} from stdin to {dest}")
        return
    src, dst = parse_uri(source), parse_uri(dest)
    if not src.is_s3 and not dst.is_s3:
        raise click.UsageError("SOURCE or DEST must be s3:// (or minio://); copy between local paths with cp")
    storage = Storage()
    if src.is_s3 and dst.is_s3:  # inside the server, as `aws s3 cp s3://a s3://b` and `mc cp` do
        storage.check_writable(dest, f"copy to {dest}")
        name = PurePosixPath(src.key.rstrip("/")).name
        if src.key and not src.key.endswith("/") and (entry := storage.stat(source)):
            target = join(dest, name) if dest.endswith("/") or not dst.key else dest
            if (tgt := parse_uri(target)).bucket == src.bucket and tgt.key == src.key:
                raise click.UsageError(f"SOURCE and DEST are the same object, {target}: nothing to copy")
            storage.copy(source, target, entry.size)
            click.echo(f"copied 1 object, {_size(entry.size)}, to {target}")
            return
        target = join(dest, name) if dest.endswith("/") and name else dest
        tgt, base = parse_uri(target), src.key.rstrip("/") + "/" if src.key.strip("/") else ""
        if tgt.bucket == src.bucket and (tgt.key.rstrip("/") + "/").startswith(base):
            # as cp -r refuses 'a' into 'a/b/a': each run would nest the copies one level deeper
            raise click.UsageError(f"cannot copy {source} into itself ({target}): give a DEST outside it")
        found = storage.copy_dir(source, target)  # listed once, there
        if not found:
            raise StorageNotFound(f"copy {source}: nothing stored there", _ls_hint(source))
        click.echo(f"copied {len(found)} object(s), {_size(sum(e.size for e in found))}, to {target}")
        return
    if not src.is_s3:
        if not src.path.exists():
            raise StorageNotFound(f"copy {source}: no such file or directory", "check the path")
        files = [src.path] if src.path.is_file() else sorted(p for p in src.path.rglob("*") if p.is_file())
        if not files:
            raise StorageNotFound(f"copy {source}: the directory holds no files", "check the path")
        storage.check_writable(dest, f"copy to {dest}")
        if dest.endswith("/") or not dst.key:
            dest = join(dest, src.path.name)
        size = sum(p.stat().st_size for p in files)
        with _bytes_bar(size, "upload") as bar:
            if src.path.is_file():
                storage.upload_file(src.path, dest, bar.update)
            else:
                storage.upload_dir(src.path, dest, bar.update)
        click.echo(f"uploaded {len(files)} file(s), {_size(size)}, to {dest}")
        return
    target = dst.path / PurePosixPath(src.key.rstrip("/")).name if dest.endswith("/") or dst.path.is_dir() else dst.path
    if src.key and not src.key.endswith("/") and (entry := storage.stat(source)):
        with _bytes_bar(entry.size, "download") as bar:
            storage.download_file(source, target, bar.update)
        click.echo(f"downloaded 1 file(s), {_size(entry.size)}, to {target}")
        return
    found = [e for e in storage.entries(source) if not e.uri.endswith("/")]  # folder markers are not files
    if not found:
        raise StorageNotFound(f"copy {source}: nothing stored there", _ls_hint(source))
    size = sum(e.size for e in found)  # these files, not others already in the folder
    with _bytes_bar(size, "download") as bar:
        storage.download_dir(source, target, bar.update)
    click.echo(f"downloaded {len(found)} file(s), {_size(size)}, to {target}")


@storage_grp.command("rm", short_help="Remove an object, or with -r every object under a prefix.")
@click.argument("uri", type=_said("Name the object: s3://BUCKET/KEY, or a prefix with -r "
                                          "(kfp-pytorch storage ls s3://BUCKET/ lists them)."))
@click.option("-r", "--recursive", is_flag=True, help="Remove every object under the prefix URI.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def storage_rm(uri, recursive, dry_run):
    """Remove the object URI (s3://BUCKET/KEY or minio://), or with -r every object under the
    prefix URI: a dataset uploaded by mistake, a run's outputs. Each removed object is listed."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3:
        raise click.UsageError("storage rm removes objects from S3 (s3://BUCKET/KEY or minio://); "
                               "remove a local file with rm")
    from kfp_pytorch.components.storage import Storage

    storage = Storage()
    one = storage.stat(uri) if loc.key and not loc.key.endswith("/") else None
    under = storage.entries(uri) if recursive or not one else []
    if not one and not under:
        if folder := storage.empty_folder(uri):  # one `ls` lists: it holds nothing, so no -r is needed
            gone = [folder] if dry_run else storage.remove_empty_folders(folder, below=True)  # and those above
            for f in gone:
                click.echo(f"{'would remove' if dry_run else 'removed'} empty folder {f}")
            return
        raise StorageNotFound(f"remove {uri}: nothing stored there", _ls_hint(uri))
    if not one and not recursive:  # as `aws s3 rm`: a prefix is removed only when asked for it
        raise click.UsageError(f"{uri} is a prefix with {len(under)} object(s) under it, not an object: "
                               "add -r to remove them all (--dry-run lists them first)")
    doomed = ([one] if one else []) + under
    for e in doomed:
        if not dry_run:
            storage.delete(e.uri)
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.uri}")
    if not dry_run:  # the folders they leave empty, which SeaweedFS would list for minutes yet
        storage.remove_empty_folders(uri, below=bool(under))  # -r on an object: its folder, as without -r
    click.echo(f"{'would remove' if dry_run else 'removed'} {len(doomed)} object(s), "
               f"{_size(sum(e.size for e in doomed))}", err=True)


@storage_grp.command("cat", short_help="Write objects to stdout.")
@click.argument("uris", nargs=-1, required=True, metavar="URI...", type=_said(
    "Name the objects: s3://BUCKET/KEY (kfp-pytorch storage ls s3://BUCKET/ lists them)."))
def storage_cat(uris):
    """Write the objects URI... (s3://BUCKET/KEY or minio://) to stdout, one after the other, streamed
    as they are read: a run's metrics.json, the head of a table (`| head`), a model card. Every URI
    is checked before anything is written."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, parse_uri

    storage = Storage()
    for uri in uris:
        loc = parse_uri(uri)
        if not loc.is_s3:
            raise click.UsageError(f"{uri} is a local path: storage cat reads objects from S3 (s3://BUCKET/KEY "
                                   "or minio://); print a local file with cat")
        if loc.key and not loc.key.endswith("/") and storage.stat(uri):
            continue
        under = storage.entries(uri)
        if under:  # as `mc cat`: a prefix is not an object
            raise click.UsageError(f"{uri} is a prefix with {len(under)} object(s) under it, not an object: "
                                   f"`kfp-pytorch storage ls {uri}` lists what is in it")
        raise StorageNotFound(f"cat {uri}: nothing stored there", _ls_hint(uri))
    out = sys.stdout.buffer
    for uri in uris:
        for chunk in storage.iter_chunks(uri):
            out.write(chunk)
        out.flush()


@storage_grp.command("mb", short_help="Make a bucket (one that exists is left as it is).")
@click.argument("uri", type=_said("Name the bucket to make: s3://NAME (3-63 characters: lower-case letters, "
                                          "digits, '.' and '-')."))
def storage_mb(uri):
    """Make the bucket URI (s3://BUCKET): where a dataset is uploaded to, or a pipeline's storage_root.
    A bucket that exists already is left as it is (exit 0), so a set-up script can run it again."""
    from kfp_pytorch.components.storage import Storage, parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3 or loc.key.strip("/"):
        raise click.UsageError(f"{uri} is not a bucket: give s3://BUCKET (or minio://BUCKET), without a key")
    made = Storage().ensure_bucket(uri)
    click.echo(f"made bucket s3://{loc.bucket}" if made else f"bucket s3://{loc.bucket} exists already")


@storage_grp.command("rb", short_help="Remove an empty bucket (--force: with what is in it).")
@click.argument("uri", type=_said("Name the bucket to remove: s3://NAME (kfp-pytorch storage ls lists them)."))
@click.option("--force", is_flag=True, help="Remove every object in the bucket first, as mc rb --force does.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def storage_rb(uri, force, dry_run):
    """Remove the bucket URI (s3://BUCKET), as mc rb does: a bucket that holds objects is refused
    unless --force, which removes them first, each listed. SeaweedFS, KFP's default store, would
    remove a bucket with objects in it without a word: this checks first."""
    from kfp_pytorch.components.errors import StorageNotFound
    from kfp_pytorch.components.storage import Storage, parse_uri

    loc = parse_uri(uri)
    if not loc.is_s3 or loc.key.strip("/"):
        raise click.UsageError(f"{uri} is not a bucket: give s3://BUCKET (or minio://BUCKET), without a key; "
                               "storage rm -r removes a prefix")
    storage = Storage()
    bucket = f"s3://{loc.bucket}"
    if not storage.bucket_exists(bucket):
        raise StorageNotFound(f"remove bucket {bucket}: there is no such bucket",
                              "`kfp-pytorch storage ls` lists the buckets")
    held = [e for e in storage.entries(bucket) if not e.uri.endswith("/")]
    if held and not force:
        raise click.UsageError(f"{bucket} holds {len(held)} object(s), {_size(sum(e.size for e in held))}: add --force "
                               "to remove them and the bucket (--dry-run lists them first)")
    for e in held:
        if not dry_run:
            storage.delete(e.uri)
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.uri}")
    if not dry_run:
        storage.remove_bucket(bucket)  # checks again: an object written since is not lost with it
    click.echo(f"{'would remove' if dry_run else 'removed'} bucket {bucket}"
               + (f" and {len(held)} object(s), {_size(sum(e.size for e in held))}" if held else ""))


@storage_grp.command("check", short_help="Check the endpoint, credentials, bucket and read/write.")
@click.argument("uri", default="")
def storage_check(uri):
    """Check the S3 endpoint, credentials, bucket, and read/write permission under URI."""
    from kfp_pytorch.components.storage import check_access

    ok = True
    for line, good in check_access(uri):
        ok &= good
        click.secho(("ok    " if good else "FAIL  ") + line, fg="green" if good else "red")
    if not ok:
        sys.exit(1)
