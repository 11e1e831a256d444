"""A real HTTP server (127.0.0.1, a free port, a thread) that serves model repositories in the Hugging Face
Hub's layout: `GET /api/models/<repo>/revision/<rev>?blobs=true` (the listing `huggingface_hub`'s
`model_info(files_metadata=True)` reads) and `GET /<repo>/resolve/<rev>/<file>` with HTTP Range. Private
repositories want `Authorization: Bearer <token>`. It records each request, and can cut a file's first
answer short to exercise a resume. Also serves an S3 bucket (ListObjectsV2 + GetObject) whose requests must
carry a SigV4 signature that `baton.fetch.s3.sign` recomputes from the request as received."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
import xml.sax.saxutils as xs
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # private: this bearer token is required
    lfs: tuple[str, ...] = ()  # files listed with an LFS sha256
    extra_listing: list[dict] = field(default_factory=list)  # hostile entries to list as well


@dataclass
class Bucket:
    objects: dict[str, bytes]
    access_key: str
    secret_key: str
    region: str = "us-east-1"


class ModelHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.buckets: dict[str, Bucket] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path with query, headers)
        self.cut_once: set[str] = set()  # file names whose next answer stops halfway
        self.bytes_served = 0
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                with hub._lock:
                    hub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                hub._get(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "ModelHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def resolves(self) -> list[tuple[str, dict[str, str]]]:
        return [(p, h) for p, h in self.requests if "/resolve/" in p]

    # --- answers
    def _send(self, h: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def _authorized(self, h: BaseHTTPRequestHandler, repo: Repo) -> bool:
        if repo.token is None:
            return True
        given = h.headers.get("Authorization")
        if given is None:
            self._send(h, 401, b'{"error":"Unauthorized"}')
            return False
        if given != f"Bearer {repo.token}":
            self._send(h, 403, b'{"error":"Forbidden"}')
            return False
        return True

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        host_bucket = path.strip("/").split("/", 1)[0]
        if host_bucket in self.buckets:
            return self._s3(h, self.buckets[host_bucket], parts)
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            repo_id, _, rev = rest.partition("/revision/")
            repo = self.repos.get(repo_id)
            if repo is None or rev not in ("main", repo.commit):
                return self._send(h, 404, b'{"error":"Repository not found"}')
            if not self._authorized(h, repo):
                return
            siblings = []
            for name, data in repo.files.items():
                s = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                if name in repo.lfs:
                    s["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                siblings.append(s)
            siblings += repo.extra_listing
            return self._send(h, 200, json.dumps({"id": repo_id, "sha": repo.commit, "siblings": siblings}).encode())
        for repo_id, repo in self.repos.items():
            prefix = f"/{repo_id}/resolve/"
            if path.startswith(prefix):
                rev, _, name = path[len(prefix):].partition("/")
                if rev not in ("main", repo.commit) or name not in repo.files:
                    return self._send(h, 404, b'{"error":"Entry not found"}')
                if not self._authorized(h, repo):
                    return
                return self._file(h, name, repo.files[name])
        self._send(h, 404, b'{"error":"Repository not found"}')

    def _file(self, h: BaseHTTPRequestHandler, name: str, data: bytes) -> None:
        start, code = 0, 200
        rng = h.headers.get("Range")
        if rng:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                return self._send(h, 416, b"", "text/plain", {"Content-Range": f"bytes */{len(data)}"})
            code = 206
        body = data[start:]
        headers = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if code == 206 else {}
        h.send_response(code)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if name in self.cut_once:  # half, then the connection drops: the client must resume
            self.cut_once.discard(name)
            half = body[:len(body) // 2]
            h.wfile.write(half)
            h.wfile.flush()
            self.bytes_served += len(half)
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(body)
        self.bytes_served += len(body)

    # --- S3
    def _s3(self, h: BaseHTTPRequestHandler, bucket: Bucket, parts) -> None:
        from baton.fetch.s3 import Credentials, sign

        auth = h.headers.get("Authorization", "")
        names = auth.partition("SignedHeaders=")[2].partition(",")[0].split(";") if auth else []
        given = {n: h.headers.get(n, "") for n in names if n not in ("host", "x-amz-date", "x-amz-content-sha256")}
        when = dt.datetime.strptime(h.headers.get("x-amz-date", "19700101T000000Z"), "%Y%m%dT%H%M%SZ").replace(
            tzinfo=dt.timezone.utc)
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        url = f"http://{h.headers.get('Host')}{unquote(parts.path)}"
        want = sign("GET", url, params, given, Credentials(bucket.access_key, bucket.secret_key), bucket.region,
                    when)["Authorization"]
        if auth != want:
            return self._send(h, 403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>", "application/xml")
        key = unquote(parts.path).strip("/").split("/", 1)[1] if "/" in unquote(parts.path).strip("/") else ""
        if not key:
            prefix = params.get("prefix", "")
            items = "".join(f"<Contents><Key>{xs.escape(k)}</Key><Size>{len(v)}</Size></Contents>"
                            for k, v in sorted(bucket.objects.items()) if k.startswith(prefix))
            body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
                    'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<IsTruncated>false</IsTruncated>{items}</ListBucketResult>").encode()
            return self._send(h, 200, body, "application/xml")
        if key not in bucket.objects:
            return self._send(h, 404, b"<Error><Code>NoSuchKey</Code></Error>", "application/xml")
        self._file(h, key, bucket.objects[key])
