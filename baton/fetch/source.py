"""`spec.model.source` URIs: `hf://org/name[@revision]`, `s3://bucket/prefix`, `pvc://claim/path` or a
plain absolute path in the image. Parsed once here for the operator (validation, pod specs) and for
`baton fetch-model` (what to download and where in the cache)."""
from __future__ import annotations

import enum
import posixpath
import re
from dataclasses import dataclass


class Scheme(str, enum.Enum):
    HF = "hf"
    S3 = "s3"
    PVC = "pvc"
    IMAGE = "image"  # a plain path: the weights are in the image (or on a volume mounted there)

    @property
    def fetched(self) -> bool:
        """Downloaded by the init container into the cache volume."""
        return self in (Scheme.HF, Scheme.S3)


class InvalidSource(ValueError):
    pass


# Hub repo ids: "org/name", each part letters, digits, '-', '_', '.' (not starting with '.' or '-', no '--'/'..')
_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_RE = re.compile(rf"^hf://(?P<repo>{_HF_PART}/{_HF_PART})(?:@(?P<rev>[A-Za-z0-9._/-]{{1,128}}))?$")
# S3 bucket names (3-63 lowercase letters, digits, '.', '-'); a prefix of safe key characters
_S3_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[A-Za-z0-9._/=+-]*))?$")
# PVC claim names are DNS-1123 subdomains; the path inside is relative
_PVC_RE = re.compile(r"^pvc://(?P<claim>[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?)(?:/(?P<path>[A-Za-z0-9._/-]*))?$")
# The CRD's CEL rule checks the same forms with these regexes (RE2 there, `re` here: both read them alike; RE2 allows no repetition count over 1000, so lengths are the schema's maxLength).
# UNCLEAN_PATTERN: a '.' or '..' segment, or an empty one ('//' other than the scheme's).
SOURCE_PATTERN = r"^(hf://|s3://|pvc://|/)"  # the CRD's OpenAPI pattern (a quick first word)
HF_PATTERN, S3_PATTERN, PVC_PATTERN = _HF_RE.pattern, _S3_RE.pattern, _PVC_RE.pattern
IMAGE_PATTERN = r"^/[A-Za-z0-9._/@+=-]*$"
UNCLEAN_PATTERN = r"(^|/|@)[.][.]?(/|$)|(^|[^:])//"
DEFAULT_REVISION = "main"

EXAMPLES = "hf://org/name@revision, s3://bucket/prefix, pvc://claim/path or /path/in/image"


@dataclass(frozen=True)
class ModelSource:
    scheme: Scheme
    location: str  # hf: the repo id; s3: the bucket; pvc: the claim; image: the absolute path
    path: str = ""  # hf: the revision; s3: the key prefix (no trailing '/'); pvc: the folder in the claim
    uri: str = ""

    @property
    def cache_key(self) -> str:
        """The folder, relative to the cache root, that holds this source's files. A revision or a
        prefix that differs is another folder, so a spec change never mixes two models' files."""
        assert self.scheme.fetched, "only fetched sources are cached"
        return posixpath.join(self.scheme.value, self.location, self.path or "_")

    @property
    def revision(self) -> str:
        assert self.scheme is Scheme.HF
        return self.path


def parse_source(uri: str) -> ModelSource:
    """Raises InvalidSource with a message that says the expected form."""
    if re.search(UNCLEAN_PATTERN, uri):
        raise InvalidSource(f"{uri!r}: no '.', '..' or empty segments in the path")
    if uri.startswith("hf://"):
        m = _HF_RE.match(uri)
        if not m:
            raise InvalidSource(f"{uri!r} is not hf://org/name[@revision] (a Hub repo id; revision a branch, "
                                "tag or commit)")
        return ModelSource(Scheme.HF, m.group("repo"), m.group("rev") or DEFAULT_REVISION, uri)
    if uri.startswith("s3://"):
        m = _S3_RE.match(uri)
        if not m:
            raise InvalidSource(f"{uri!r} is not s3://bucket/prefix (a bucket name of 3-63 lowercase letters, "
                                "digits, '.' and '-')")
        return ModelSource(Scheme.S3, m.group("bucket"), (m.group("prefix") or "").strip("/"), uri)
    if uri.startswith("pvc://"):
        m = _PVC_RE.match(uri)
        if not m:
            raise InvalidSource(f"{uri!r} is not pvc://claim/path (a PersistentVolumeClaim name, then the "
                                "folder inside it)")
        return ModelSource(Scheme.PVC, m.group("claim"), (m.group("path") or "").strip("/"), uri)
    if uri.startswith("/"):
        if not re.match(IMAGE_PATTERN, uri):
            raise InvalidSource(f"{uri!r}: an absolute path of letters, digits and ._/@+=-")
        return ModelSource(Scheme.IMAGE, uri, "", uri)
    raise InvalidSource(f"{uri!r}: a model source is one of {EXAMPLES}")


def is_valid(uri: str) -> bool:
    try:
        parse_source(uri)
    except InvalidSource:
        return False
    return True
