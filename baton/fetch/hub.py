"""List a Hugging Face Hub model repository at one revision, the way `huggingface_hub` does:
`GET $HF_ENDPOINT/api/models/<repo>/revision/<revision>?blobs=true` gives the commit and each file with its
size (and its LFS sha256); files come from `$HF_ENDPOINT/<repo>/resolve/<commit>/<file>`."""
from __future__ import annotations

import fnmatch
import json
from urllib.parse import quote

import httpx

from baton.fetch.download import FetchError, RemoteFile, read_limited
from baton.fetch.source import ModelSource

DEFAULT_ENDPOINT = "https://huggingface.co"


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _listing_error(src: ModelSource, endpoint: str, code: int, has_token: bool) -> FetchError:
    where = f"{src.uri} at {endpoint}"
    if code in (401, 403):
        if has_token:
            why = "the token (HF_TOKEN) was refused or lacks access to this repository"
        else:
            why = ("the repository is private or gated and no token was given: put one with access in the "
                   "Secret named by spec.model.fetch.secretName, key HF_TOKEN")
        return FetchError(f"{where}: access denied (HTTP {code}): {why}")
    if code == 404:
        hint = "" if has_token else " (a private repository answers 404 without a token)"
        return FetchError(f"{where}: no model repository {src.location!r} with revision {src.revision!r} "
                          f"(HTTP 404){hint}")
    return FetchError(f"{where}: the Hub API answered HTTP {code}")


def list_files(client: httpx.Client, endpoint: str, src: ModelSource, token: str | None,
               include: tuple[str, ...] = ()) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of the repository at the source's revision; `include`: glob patterns to keep."""
    endpoint = endpoint.rstrip("/")
    url = f"{endpoint}/api/models/{src.location}/revision/{quote(src.revision, safe='')}"
    with client.stream("GET", url, params={"blobs": "true"}, headers=auth_headers(token)) as r:
        if r.status_code != 200:
            raise _listing_error(src, endpoint, r.status_code, bool(token))
        body = read_limited(r)
    try:
        info = json.loads(body)
        commit = info.get("sha") or src.revision
        siblings = info["siblings"]
    except (ValueError, KeyError, AttributeError) as e:
        raise FetchError(f"{src.uri}: {url} is not a Hub model listing ({e.__class__.__name__})") from None
    files = []
    for s in siblings:
        name = s["rfilename"]
        if include and not any(fnmatch.fnmatch(name, p) for p in include):
            continue
        lfs = s.get("lfs") or {}
        files.append(RemoteFile(
            name=name, size=lfs.get("size", s.get("size")), sha256=lfs.get("oid") or lfs.get("sha256"),
            url=f"{endpoint}/{src.location}/resolve/{quote(commit, safe='')}/{quote(name)}"))
    if not files:
        raise FetchError(f"{src.uri}: no file of the repository matches spec.model.fetch.include {list(include)}")
    return commit, files
