"""Download a listed set of files into one cache folder: each file to `<name>.part`, resumed with an HTTP
Range where a part exists, size (and sha256 where the source gives one) verified, then renamed into
place; a marker file written last says the folder is complete, so a restarted or second pod skips it.
Pods sharing the cache take an exclusive lock on the folder first: one downloads, the others wait."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx

logger = logging.getLogger(__name__)

MARKER = ".baton-complete.json"
LOCK = ".baton-fetch.lock"
CHUNK = 1 << 20
MAX_LISTING_BYTES = 64 << 20  # an API answer (file listing) larger than this is refused


class FetchError(RuntimeError):
    """Says what failed and what to change; never carries a credential."""


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative path inside the model folder, '/'-separated
    size: int | None  # None: the source does not say (then the download's own length is trusted)
    url: str
    sha256: str | None = None


def safe_name(name: str) -> str:
    """A listed file name as a relative path that stays inside the folder (a hostile endpoint could list
    '../../etc/x' or '/etc/x')."""
    p = PurePosixPath(name)
    if not name or "\\" in name or p.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        raise FetchError(f"the source lists a file named {name!r}, which is not a relative path inside the "
                         "model folder; refusing it")
    if p.name in (MARKER, LOCK) or p.name.endswith(".part"):
        raise FetchError(f"the source lists a file named {name!r}, a name the cache uses itself")
    return name


def read_limited(response: httpx.Response, limit: int = MAX_LISTING_BYTES) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise FetchError(f"{response.request.url}: the answer is larger than {limit >> 20} MiB; refusing it")
    return bytes(body)


def completed(folder: Path, uri: str) -> dict | None:
    """The marker of a complete folder fetched from `uri` whose files are all there at their sizes."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("source") != uri:
        return None
    for name, size in marker.get("files", {}).items():
        path = folder / name
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            return None
    return marker


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Exclusive lock on the folder (flock; NFS clients map it to a POSIX lock), waited for."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another pod is fetching into %s; waiting for it", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _hash_of(path: Path) -> "hashlib._Hash":
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def _http_error(file: RemoteFile, response: httpx.Response) -> FetchError:
    code = response.status_code
    if code in (401, 403):
        why = "access denied: the credentials are missing, wrong or lack access to it"
    elif code == 404:
        why = "not found"
    else:
        why = f"the server answered {code} {response.reason_phrase}"
    return FetchError(f"{file.name}: {why} (HTTP {code} from {response.request.url.copy_with(query=None)})")


def download(client: httpx.Client, file: RemoteFile, folder: Path, headers: Mapping[str, str]) -> int:
    """Fetch one file into `folder`, resuming its `.part`; returns the bytes transferred now."""
    target = folder / file.name
    part = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if file.size is not None and have > file.size:  # a part longer than the file: start over
        have = 0
    h = _hash_of(part) if file.sha256 and have else hashlib.sha256()
    got = 0
    if file.size is None or have < file.size:
        req_headers = dict(headers)
        if have:
            req_headers["Range"] = f"bytes={have}-"
        with client.stream("GET", file.url, headers=req_headers) as r:
            if r.status_code == 416 and have == file.size:
                pass  # nothing left to send
            elif r.status_code not in (200, 206):
                raise _http_error(file, r)
            else:
                if r.status_code == 200 and have:  # the server ignored the Range: from the start
                    logger.info("%s: the server does not resume; downloading it again", file.name)
                    have, h = 0, hashlib.sha256()
                with open(part, "r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    for chunk in r.iter_bytes():  # as received: a dropped connection keeps what came
                        got += len(chunk)
                        if file.size is not None and have + got > file.size:
                            raise FetchError(f"{file.name}: the server sent more than the {file.size} bytes "
                                             "the listing says; refusing it")
                        f.write(chunk)
                        if file.sha256:
                            h.update(chunk)
                    f.flush()
                    os.fsync(f.fileno())
    size = part.stat().st_size
    if file.size is not None and size != file.size:
        raise FetchError(f"{file.name}: got {size} bytes, the listing says {file.size}; the download was cut "
                         "short (it resumes on the next try)")
    if file.sha256 and h.hexdigest() != file.sha256:
        part.unlink()
        raise FetchError(f"{file.name}: sha256 {h.hexdigest()} differs from the listing's {file.sha256}; "
                         "the partial file is deleted")
    os.replace(part, target)
    return got


def fetch_files(client: httpx.Client, folder: Path, files: list[RemoteFile], headers: Mapping[str, str],
                uri: str, revision: str | None) -> None:
    """Download every file, then write the marker (atomically): the folder is complete only then."""
    names = [safe_name(f.name) for f in files]
    if len(set(names)) != len(names):
        raise FetchError("the source lists a file twice")
    total = sum(f.size or 0 for f in files)
    done, moved, start = 0, 0, time.monotonic()
    for i, file in enumerate(files, 1):
        target = folder / file.name
        if target.is_file() and file.size is not None and target.stat().st_size == file.size:
            done += file.size
            continue  # finished by an earlier try (renamed into place only once verified)
        got = download(client, file, folder, headers)
        done, moved = done + (file.size or got), moved + got
        rate = moved / max(time.monotonic() - start, 1e-6) / 1e6
        logger.info("[%d/%d] %s (%.1f/%.1f MB, %.1f MB/s)", i, len(files), file.name, done / 1e6, total / 1e6, rate)
    marker = {"source": uri, "revision": revision, "files": {f.name: (folder / f.name).stat().st_size for f in files}}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    os.replace(tmp, folder / MARKER)
