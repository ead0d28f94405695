"""Files at a URL (``s3://``, ``gs://``, ``memory://``, any filesystem fsspec knows), read and written with retries.

Both sides go through here for every remote file: the write side to publish shards and the
manifest, the read side to copy shards into its cache. ``exists``, ``glob`` and ``read_bytes``
take a local path too; otherwise the disk is left to the caller (``schemas.io`` keeps its
files safe from links), and ``is_url`` tells the two apart. fsspec, and the package of a URL's
filesystem (``s3fs`` for ``s3://``: ``pip install 'varpack[s3]'``), are imported only when a URL
is met, so a GPU box reading local shards needs neither.

Credentials and the endpoint come from the filesystem's usual settings: for ``s3://``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` and ``AWS_ENDPOINT_URL``
(an S3-compatible server: MinIO, Ceph, moto).

An operation that fails for a reason that may pass (the server unreachable, a connection cut in
the middle of a transfer) is tried again after a pause that doubles each time, ``$VARPACK_IO_ATTEMPTS``
times in all (default 5, the first pause ``$VARPACK_IO_BACKOFF_S`` seconds, default 0.5); then a
StorageError says so in one line. A store that goes silent counts as such a reason: for ``s3://``, connecting
and each read wait at most ``$VARPACK_IO_TIMEOUT_S`` seconds (default 10; ``FSSPEC_S3``'s ``config_kwargs``
override it). A reason that will not pass (a missing file or bucket, refused credentials, a request the
store refuses with an HTTP 4xx, a missing package) is one line at once, naming the fix.

>>> is_url("s3://bucket/builds"), is_url("/data/builds"), join("s3://bucket/builds/", "a", "manifest.json")
(True, False, 's3://bucket/builds/a/manifest.json')
"""

from __future__ import annotations

import contextlib
import glob as globlib
import importlib
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import IO, Any, TypeVar

from schemas.errors import VarpackError

ATTEMPTS_ENV = "VARPACK_IO_ATTEMPTS"
BACKOFF_ENV = "VARPACK_IO_BACKOFF_S"
TIMEOUT_ENV = "VARPACK_IO_TIMEOUT_S"
COPY_CHUNK = 8 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# The extra that brings a protocol's filesystem; other protocols name fsspec's own hint.
_EXTRAS = {"s3": "pip install 'varpack[s3]' (s3fs)", "s3a": "pip install 'varpack[s3]' (s3fs)", "http": "pip install aiohttp",
           "https": "pip install aiohttp"}
# Errors that will not pass on a retry: the OSErrors of a missing or refused file.
# Protocols whose first path component is a bucket, which must exist before anything is written in it.
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# Errors of the filesystems' HTTP clients that may pass on a retry (imported only when they are installed).
_TRANSIENT_NAMES = {
    "botocore.exceptions": ("ConnectionError", "HTTPClientError", "IncompleteReadError"),
    "aiohttp": ("ClientError",),
}

T = TypeVar("T")


class StorageError(VarpackError):
    """A file at a URL could not be read or written: its store is unreachable, refuses the credentials,
    lacks the bucket, or its filesystem's package is not installed."""

    kind = "storage"


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return _URL.match(os.fspath(path)) is not None


def local_path(path: str) -> str:
    """The local path a ``file:`` URL names (RFC 8089: no host or ``localhost``, an absolute path); any other path as it is.

    >>> [local_path(url) for url in ("file:///data/x", "file://localhost/data/x", "file:/data/a%20b", "data/x")]
    ['/data/x', '/data/x', '/data/a b', 'data/x']

    Raises ValueError for a file URL that names another host or a relative path (``file://data/x``).
    """
    if path[:5].lower() != "file:":
        return path
    url = urllib.parse.urlsplit(path)
    if url.netloc not in ("", "localhost") or not url.path.startswith("/") or url.query or url.fragment:
        raise ValueError(f"{path}: not a local file URL; write file:///ABS/PATH (or file://localhost/ABS/PATH), or the path itself")
    return urllib.parse.unquote(url.path)


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with ``/``; a URL keeps its ``scheme://``.

    >>> join("s3://", "a"), join("/data/", "a")
    ('s3://a', '/data/a')
    """
    scheme = _URL.match(base)
    head = scheme.group(0) if scheme else ""
    rest = base[len(head):].rstrip("/")
    return head + "/".join([rest, *parts] if rest or not head else list(parts))


def check_bucket(url: str, option: str) -> None:
    """Raise StorageError naming ``option`` when ``url`` is a URL of a bucketed store (``s3://``, ``gs://``, ...)
    with no bucket in it."""
    match = _URL.match(url)
    if match is None or match.group(0)[:-3].lower() not in _BUCKETED:
        return
    if not url[match.end():].split("/", 1)[0]:
        raise StorageError(f"{option} {url}: the URL names no bucket; write {match.group(0)}BUCKET/PREFIX")


def basename(url: str) -> str:
    """The last component of ``url``."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    """The URL of the directory holding ``url``."""
    return url.rstrip("/").rsplit("/", 1)[0]


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in its terms.

    Raises StorageError naming the package to install when fsspec, or the package of ``url``'s
    protocol, is missing, and when no filesystem knows the protocol.
    """
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError as err:
        raise StorageError(f"{url}: reading or writing URLs needs fsspec, which is not installed: pip install fsspec") from err
    try:
        fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol, fsspec.config.conf.get(protocol, {})))
    except ImportError as err:
        hint = _EXTRAS.get(protocol) or str(err).splitlines()[0]
        raise StorageError(f"{url}: opening {protocol}:// URLs needs a package that is not installed; {hint}") from err
    except ValueError as err:
        raise StorageError(
            f"{url}: no installed filesystem opens {protocol}:// URLs; use a local path or a URL fsspec knows (s3://, gs://, ...)"
        ) from err
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # one try per request inside s3fs: ``retried`` tries again, with its own pauses
    return fs, path


def _storage_options(protocol: str, configured: dict[str, Any]) -> dict[str, Any]:
    """The options varpack gives ``protocol``'s filesystem: for ``s3://``, a bounded wait for a silent store
    (``$VARPACK_IO_TIMEOUT_S``); ``configured``
    (fsspec's configuration, e.g. ``FSSPEC_S3``) wins."""
    if protocol not in ("s3", "s3a"):
        return {}
    timeout = _env_number(TIMEOUT_ENV, "10", float, minimum=0.001)
    config = {"connect_timeout": timeout, "read_timeout": timeout, **configured.get("config_kwargs", {})}
    return {"config_kwargs": config}


def _env_number(name: str, default: str, kind: Callable[[str], T], minimum: float) -> T:
    """The number in the environment variable ``name`` (``default`` when unset); StorageError naming it otherwise."""
    text = os.environ.get(name, default)
    try:
        value = kind(text)
    except ValueError:
        value = None
    if not isinstance(value, (int, float)) or not minimum <= value < float("inf"):  # NaN fails too
        raise StorageError(f"{name}={text!r}: not a number of at least {minimum:g}; set it to one or unset it")
    return value


def retried(url: str, operation: Callable[[], T], what: str = "read") -> T:
    """``operation()``, tried again with a doubling pause while it fails for a reason that may pass.

    A missing file passes through as FileNotFoundError (callers say what it means); refused
    credentials, a missing bucket and a store still unreachable after the last try are a StorageError.
    """
    attempts = _env_number(ATTEMPTS_ENV, "5", int, minimum=1)
    pause = _env_number(BACKOFF_ENV, "0.5", float, minimum=0)
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except _PERMANENT as err:
            explained = _permanent_error(url, err, what)
            if explained is None:
                raise
            raise explained from err
        except _credential_errors() as err:
            raise StorageError(
                f"{url}: no credentials for the store ({_reason(err)}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE), then run again"
            ) from err
        except _transient_errors() as err:
            if isinstance(err, IndexError) and not isinstance(err.__context__, OSError):
                raise
            if (refused := _refused_request(url, err, what)) is not None:
                raise refused from err
            if attempt == attempts:
                raise StorageError(
                    f"{url}: could not be {what} after {attempts} tries ({_reason(err)}); check that the store is up and "
                    f"reachable (for s3://, AWS_ENDPOINT_URL), then run again"
                ) from err
            time.sleep(pause * 2 ** (attempt - 1) * random.uniform(1, 1.25))
    raise AssertionError("unreachable")


def _refused_request(url: str, err: BaseException, what: str) -> StorageError | None:
    """The StorageError for a request the store refused for good (an HTTP 4xx other than 408 and 429: a bad
    request, a key it refuses); None for another error."""
    cause = err.__cause__ or err.__context__
    response = getattr(cause, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if not isinstance(status, int) or not 400 <= status < 500 or status in (408, 429):
        return None
    return StorageError(f"{url}: could not be {what}: the store refused the request (HTTP {status}: {_reason(err)})")


def _credential_errors() -> tuple[type[BaseException], ...]:
    """botocore's errors for credentials missing or incomplete, when it is installed."""
    with contextlib.suppress(ImportError):
        module = importlib.import_module("botocore.exceptions")
        return (module.NoCredentialsError, module.PartialCredentialsError)
    return ()


def _transient_errors() -> tuple[type[BaseException], ...]:
    """OSError (a refused or cut connection, a timeout) and the HTTP clients' own errors of that kind; and IndexError,
    which s3fs raises for a read that timed out (it reads the args of the timeout's OSError, which has none): the
    caller keeps only one whose context is an OSError."""
    errors: list[type[BaseException]] = [OSError, IndexError]
    for module_name, names in _TRANSIENT_NAMES.items():
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            errors += [getattr(module, name) for name in names if hasattr(module, name)]
    return tuple(errors)


def _permanent_error(url: str, err: OSError, what: str) -> StorageError | None:
    """The StorageError naming the fix of a missing bucket or refused credentials behind ``err``; None for another
    error (a missing file stays a FileNotFoundError for the caller to explain)."""
    if _error_code(err) == "NoSuchBucket":
        return _missing_bucket(url)
    if isinstance(err, PermissionError):
        return StorageError(
            f"{url}: could not be {what}: the store refused the credentials ({_reason(err)}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or the profile in AWS_PROFILE) to a key allowed to use it, then run again"
        )
    return None


def _missing_bucket(url: str) -> StorageError:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    return StorageError(
        f"{url}: the bucket {bucket!r} does not exist; create it (aws s3 mb s3://{bucket}) or fix the URL, then run again"
    )


def _error_code(err: BaseException) -> str | None:
    """The S3 error code behind ``err`` (``NoSuchBucket``, ``InvalidAccessKeyId``, ...), when there is one."""
    cause = err.__cause__ or err.__context__
    response = getattr(cause, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _reason(err: BaseException) -> str:
    """``err`` in a few words on one line."""
    if isinstance(err, IndexError) or (isinstance(err, OSError) and not str(err)):
        if isinstance(err, TimeoutError) or isinstance(err.__context__, TimeoutError):  # fsspec's FSTimeoutError is one
            return f"timed out: the store sent nothing for the read timeout, {TIMEOUT_ENV}"
        err = err.__context__ or err
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def exists(url: str) -> bool:
    """Whether a file or a directory (at a URL: a prefix holding files) exists at ``url``."""
    if not is_url(url):
        return os.path.exists(url)
    fs, path = filesystem(url)
    fs.invalidate_cache()  # another process may have written it since this one last looked
    return retried(url, lambda: bool(fs.exists(path)))


def size(url: str) -> int:
    """The size of the file at ``url`` in bytes; FileNotFoundError when it is missing."""
    fs, path = filesystem(url)
    return int(retried(url, lambda: fs.size(path)))


def list_files(directory: str) -> list[str]:
    """The names (not URLs) of the files directly inside ``directory``, sorted; [] when it holds none."""
    fs, path = filesystem(directory)

    def names() -> list[str]:
        try:
            fs.invalidate_cache()
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(basename(e["name"]) for e in entries if e.get("type") == "file" and e["name"].rstrip("/") != path.rstrip("/"))

    return retried(directory, names)


def glob(pattern: str) -> list[str]:
    """The paths or URLs of the files matching ``pattern``, sorted."""
    if not is_url(pattern):
        return sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
    fs, path = filesystem(pattern)
    fs.invalidate_cache()
    found = retried(pattern, lambda: fs.glob(path, detail=True))
    return sorted(fs.unstrip_protocol(name) for name, info in found.items() if info.get("type") == "file")


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """The bytes of the file at ``url`` (with ``limit``, at most its first ``limit`` bytes, in one ranged read);
    FileNotFoundError when it is missing."""
    fs, path = filesystem(url)
    return bytes(retried(url, lambda: fs.cat_file(path) if limit is None else fs.cat_file(path, start=0, end=limit)))


def open_read(url: str) -> IO[bytes]:
    """A seekable binary file object reading ``url`` (opened with retries; reads that fail later are not retried:
    ``download`` retries a whole copy)."""
    fs, path = filesystem(url)
    return retried(url, lambda: fs.open(path, "rb"))


def download(url: str, file: IO[bytes]) -> None:
    """Copy the file at ``url`` into the open ``file`` from its start; a copy cut off is started again.

    ``file`` must be seekable: each try truncates it first, so it never holds parts of two tries.
    FileNotFoundError when ``url`` is missing.
    """
    fs, path = filesystem(url)

    def copy() -> None:
        file.seek(0)
        file.truncate()
        with fs.open(path, "rb") as source:
            while chunk := source.read(COPY_CHUNK):
                file.write(chunk)
        file.flush()

    retried(url, copy)


def upload(local_path: str, url: str, exclusive: bool = False) -> None:
    """Write the local file ``local_path`` at ``url`` (whole or not at all on an object store).

    With ``exclusive``, only where no file is there yet, in one conditional request (S3's
    ``If-None-Match: *``), else FileExistsError: of several writers, exactly one succeeds.
    """
    fs, path = filesystem(url)
    mode = "create" if exclusive else "overwrite"
    if url.split("://", 1)[0].lower() not in _BUCKETED:  # a filesystem with directories (an object store has none)
        retried(url, lambda: fs.makedirs(fs._parent(path), exist_ok=True), "written")
    retried(url, lambda: fs.put_file(local_path, path, mode=mode), "written")


def rename(source: str, dest: str) -> None:
    """Move the file at ``source`` to ``dest`` on the same filesystem."""
    fs, path = filesystem(source)
    _, dest_path = filesystem(dest)
    retried(source, lambda: fs.mv(path, dest_path), "moved")


def remove(urls: list[str]) -> None:
    """Delete the files at ``urls`` (all on one filesystem); missing ones are ignored."""
    if not urls:
        return
    fs, _ = filesystem(urls[0])
    paths = [filesystem(url)[1] for url in urls]

    def delete() -> None:
        present = [p for p in paths if fs.exists(p)]
        if present:
            fs.rm(present)

    retried(urls[0], delete, "deleted")


def check_writable(url: str) -> None:
    """Raise StorageError naming the fix when the bucket ``url`` is in does not exist or refuses the credentials."""
    fs, path = filesystem(url)
    bucket = path.split("/", 1)[0]
    if url.split("://", 1)[0].lower() not in _BUCKETED or not bucket:
        return

    try:
        retried(url, lambda: fs.ls(bucket, detail=False), "written")
    except FileNotFoundError as err:
        raise _missing_bucket(url) from err
