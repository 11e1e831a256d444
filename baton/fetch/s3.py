"""List and sign S3 requests (ListObjectsV2 and GetObject, path-style, so AWS, MinIO and Ceph all work)
with AWS Signature Version 4, from the standard environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL. No credentials: anonymous requests (public buckets)."""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

from baton.fetch.download import FetchError, RemoteFile, read_limited
from baton.fetch.source import ModelSource

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = ""
    session_token: str | None = None

    def __repr__(self) -> str:  # never print a key
        return "Credentials(***)"


def default_endpoint(region: str) -> str:
    return f"https://s3.{region}.amazonaws.com"


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _query(params: Mapping[str, str]) -> str:
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


def sign(method: str, url: str, params: Mapping[str, str], headers: Mapping[str, str], creds: Credentials,
         region: str, now: dt.datetime) -> dict[str, str]:
    """`headers` plus x-amz-date, x-amz-content-sha256, the session token and Authorization: every header
    given (and host) is signed. The body is empty (GET)."""
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    out = {**headers, "x-amz-date": amz_date, "x-amz-content-sha256": EMPTY_SHA256}
    if creds.session_token:
        out["x-amz-security-token"] = creds.session_token
    parts = urlsplit(url)
    signed = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
    signed["host"] = parts.netloc
    names = sorted(signed)
    canonical = "\n".join([method, quote(parts.path or "/", safe="/-_.~"), _query(params),
                           "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names), EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds.secret_key).encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out


class S3Signer:
    """Signs each request of a client (an httpx auth flow, so the Range of a resumed download is signed too)."""

    def __init__(self, creds: Credentials | None, region: str):
        self.creds, self.region = creds, region

    def __call__(self, request: httpx.Request) -> httpx.Request:
        if self.creds is None:
            return request
        params = dict(request.url.params)
        base = f"{request.url.scheme}://{request.url.netloc.decode()}{request.url.path}"  # path decoded: sign() quotes
        keep = {k: v for k, v in request.headers.items() if k.lower() == "range"}
        signed = sign(request.method, base, params, keep, self.creds, self.region, dt.datetime.now(dt.timezone.utc))
        request.headers.update(signed)
        return request


def _error(src: ModelSource, endpoint: str, r: httpx.Response, has_creds: bool) -> FetchError:
    code = r.status_code
    if code in (401, 403):
        why = ("the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the Secret named by "
               "spec.model.fetch.secretName) were refused or lack s3:ListBucket/s3:GetObject"
               if has_creds else "the bucket is not public and no credentials were given "
               "(spec.model.fetch.secretName, keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
        return FetchError(f"{src.uri} at {endpoint}: access denied (HTTP {code}): {why}")
    if code == 404:
        return FetchError(f"{src.uri} at {endpoint}: no bucket {src.location!r} (HTTP 404)")
    return FetchError(f"{src.uri} at {endpoint}: S3 answered HTTP {code}")


def list_files(client: httpx.Client, endpoint: str, src: ModelSource, has_creds: bool) -> list[RemoteFile]:
    """Every object under the prefix (ListObjectsV2 pages), named relative to it."""
    endpoint = endpoint.rstrip("/")
    prefix = f"{src.path}/" if src.path else ""
    files: list[RemoteFile] = []
    params = {"list-type": "2", "prefix": prefix}
    while True:
        with client.stream("GET", f"{endpoint}/{src.location}", params=params) as r:
            if r.status_code != 200:
                raise _error(src, endpoint, r, has_creds)
            body = read_limited(r)
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            raise FetchError(f"{src.uri}: {endpoint} did not answer an S3 object listing") from None
        for item in root.iter(f"{_NS}Contents"):
            key, size = item.findtext(f"{_NS}Key", ""), int(item.findtext(f"{_NS}Size", "0"))
            if key.endswith("/"):  # a "folder" placeholder object
                continue
            url = f"{endpoint}/{src.location}/{quote(key, safe='/-_.~')}"
            files.append(RemoteFile(name=key[len(prefix):], size=size, url=url))
        token = root.findtext(f"{_NS}NextContinuationToken")
        if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
            break
        params = {**params, "continuation-token": token}
    if not files:
        raise FetchError(f"{src.uri}: no object under the prefix {prefix!r} in bucket {src.location!r}")
    return files
