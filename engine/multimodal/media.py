"""Images from the sources a request names, loaded under the server's media policy.

    source                                   allowed when                           refused with
    data:image/...;base64,...                always                                 -
    plain base64 (SGLang's image_data)       always                                 -
    /path, relative path, file:///path       under --allowed-local-media-path       403 (off by default)
    http(s)://host/...                       host in --allowed-media-domains        403 (none by default)

A server that fetches any URL a client names lets clients reach what only the server can (cloud
metadata, internal services): URLs are refused unless their host is listed, and so is a redirect to
a host not listed. Local paths are resolved (symlinks, `..`) before the check against the root.

Statuses (MediaError.status), as clients of OpenAI-compatible servers read them:
    400  malformed source (bad base64, bad data URL, unknown scheme), a truncated or undecodable
         image, a file that does not exist, a URL that fails or answers non-2xx, a fetch that runs
         past --media-fetch-timeout (OpenAI answers a download timeout with a 400 too: the URL the
         client named is at fault, and retrying the same request seldom helps), more images than
         --limit-mm-data-per-request
    403  a local path or URL the policy refuses
    413  more bytes than --max-media-bytes, more pixels than --max-image-pixels
    415  not a PNG, JPEG, WEBP, GIF (first frame) or BMP image
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import re
import struct
from dataclasses import dataclass
from typing import Mapping, Optional
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

# Pillow's format names (a JPEG with extra frames, as phone cameras write, opens as JPEG too: Pillow's
# MPO). Naming them also keeps Pillow from trying its other plugins on a client's bytes (EPS would run
# Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_REDIRECTS = 5
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_WHITESPACE = re.compile(r"\s+")


class MediaError(Exception):
    """An image a request names that cannot be loaded; `status` is the HTTP status to answer
    (the table in the module's docstring)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be: the server's flags of the same names
    (build it with `server_args.view(MediaPolicy)`; ServerArgs checks the values at start-up)."""

    allowed_local_media_path: Optional[str]  # None: local files refused
    allowed_media_domains: tuple[str, ...]  # lower-case host names; empty: every URL refused
    limit_mm_data_per_request: Optional[Mapping[str, int]]  # {"image": 4}; None: no limit
    max_image_pixels: int
    max_media_bytes: int
    media_fetch_timeout: float  # seconds for a whole fetch, redirects and body included

    def __post_init__(self) -> None:
        assert self.max_image_pixels > 0 and self.max_media_bytes > 0 and self.media_fetch_timeout > 0
        assert all(h == h.lower() for h in self.allowed_media_domains), self.allowed_media_domains

    @property
    def max_images(self) -> Optional[int]:
        """Images one request (one prompt) may carry; None: no limit."""
        return None if self.limit_mm_data_per_request is None else self.limit_mm_data_per_request.get("image")

    def check_image_count(self, count: int) -> None:
        """Raises MediaError (400) for more images than the limit: checked before any is fetched."""
        if self.max_images is not None and count > self.max_images:
            raise MediaError(f"the request has {count} images; this server takes at most {self.max_images} per "
                             "request (--limit-mm-data-per-request)", 400)


@dataclass(frozen=True, eq=False)
class LoadedImage:
    """A decoded image, RGB, and the hash of its content.

    The hash is the SHA-256 (hex) of the width, the height and the RGB pixel bytes, not of the bytes
    the client sent: the model sees pixels, so the same picture sent as a PNG file, as a data URL or
    re-encoded losslessly hashes alike, and the prefix cache and the vision embedding cache that key
    on it hit. The size is part of it so that one run of pixels in two shapes differs."""

    image: Image.Image  # mode RGB
    hash: str
    width: int
    height: int


async def load_image(source: str, policy: MediaPolicy) -> LoadedImage:
    """The image `source` names (module docstring), decoded and checked; MediaError otherwise. The
    file read and the decoding run in a worker thread, so the event loop keeps serving."""
    if not isinstance(source, str) or not source.strip():
        raise MediaError("an image source must be a non-empty string (a data: URL, base64, a URL or a path)", 400)
    source = source.strip()
    scheme = _SCHEME.match(source)
    if source.startswith("data:"):
        data = _data_url_bytes(source, policy)
    elif scheme is not None and scheme.group(1).lower() in ("http", "https"):
        data = await _fetch(source, policy)
    elif scheme is not None and scheme.group(1).lower() == "file":
        data = await asyncio.to_thread(_read_local, _file_url_path(source), source, policy)
    elif scheme is not None:
        raise MediaError(f"image URL scheme {scheme.group(1)!r} is not supported (data:, http(s): or file:)", 400)
    elif (compact := _WHITESPACE.sub("", source)) and len(compact) % 4 == 0 and _BASE64.fullmatch(compact):
        # base64's alphabet has no '.', so a path with an extension never reads as base64
        data = _base64_bytes(compact, policy)
    else:
        data = await asyncio.to_thread(_read_local, source, source, policy)
    return await asyncio.to_thread(decode_image, data, policy)


def decode_image(data: bytes, policy: MediaPolicy) -> LoadedImage:
    """Bytes to a checked RGB image: the format from the allowed ones, the pixel count from the
    header before any pixel is decoded (a small file can claim a huge image), then every pixel
    decoded (a truncated image fails here, not in the processor)."""
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # Pillow's own limit (twice its MAX_IMAGE_PIXELS), met at open
        raise MediaError(f"image of more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels, Pillow's decompression-bomb "
                         f"limit, exceeds the limit of {policy.max_image_pixels} pixels (--max-image-pixels)",
                         413) from None
    except UnidentifiedImageError:
        raise MediaError("not an image in a supported format (PNG, JPEG, WEBP, GIF, BMP)", 415) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"undecodable image: {e}", 400) from None
    width, height = im.size
    if width * height > policy.max_image_pixels:
        raise MediaError(f"image of {width}x{height} pixels exceeds the limit of {policy.max_image_pixels} pixels "
                         "(--max-image-pixels)", 413)
    if width < 1 or height < 1:
        raise MediaError(f"image of {width}x{height} pixels is empty", 400)
    try:
        im.load()  # the first frame of a GIF or an animated WEBP
        rgb = to_rgb(ImageOps.exif_transpose(im))
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt pixel data
        raise MediaError(f"undecodable image ({im.format}, {width}x{height}): {e}", 400) from None
    digest = hashlib.sha256(struct.pack("<II", *rgb.size) + rgb.tobytes()).hexdigest()
    return LoadedImage(rgb, digest, rgb.width, rgb.height)


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB as transformers' image processors make it (image_transforms.convert_to_rgb): transparency
    composited onto white, so a transparent PNG is not black where it was see-through."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


# ---- sources ----

def _data_url_bytes(source: str, policy: MediaPolicy) -> bytes:
    """data:[<media type>][;params];base64,<data>: the media type must be an image's (or absent)."""
    head, sep, payload = source[len("data:"):].partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' before the data", 400)
    params = [p.strip().lower() for p in head.split(";")]
    if "base64" not in params[1:]:
        raise MediaError("a data URL image must be base64 (data:image/png;base64,...)", 400)
    if params[0] and not params[0].startswith("image/"):
        raise MediaError(f"data URL media type {params[0]!r} is not an image", 415)
    return _base64_bytes(_WHITESPACE.sub("", payload), policy)


def _base64_bytes(text: str, policy: MediaPolicy) -> bytes:
    if len(text) // 4 * 3 - text[-2:].count("=") > policy.max_media_bytes:  # refused before decoding
        raise MediaError(f"image data exceeds the limit of {policy.max_media_bytes} bytes (--max-media-bytes)", 413)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 image data: {e}", 400) from None


def _file_url_path(source: str) -> str:
    parts = urlsplit(source)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file URL {_short(source)!r} names host {parts.netloc!r}; only local files "
                         "(file:///path) are read", 400)
    return unquote(parts.path)


def _read_local(path: str, source: str, policy: MediaPolicy) -> bytes:
    """A file under the allowed root (a relative path is relative to it): symlinks and `..` are
    resolved first, so neither leads out of it."""
    if policy.allowed_local_media_path is None:
        raise MediaError(f"image source {_short(source)!r} is not a data URL or base64, and local image files are "
                         "refused: start the server with --allowed-local-media-path DIR to allow the files under DIR",
                         403)
    root = os.path.realpath(policy.allowed_local_media_path)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise MediaError(f"image path {_short(source)!r} is outside --allowed-local-media-path", 403)
    try:
        with open(full, "rb") as f:
            data = f.read(policy.max_media_bytes + 1)  # a device or a growing file has no size to trust
    except FileNotFoundError:
        raise MediaError(f"image file {_short(source)!r} does not exist", 400) from None
    except OSError as e:  # a directory, unreadable
        raise MediaError(f"image file {_short(source)!r} cannot be read: {e.strerror}", 400) from None
    if len(data) > policy.max_media_bytes:
        raise MediaError(f"image file exceeds the limit of {policy.max_media_bytes} bytes (--max-media-bytes)", 413)
    return data


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    """GET under one deadline for the whole fetch (a server that trickles its body cannot hold the
    request), following redirects only to allowed hosts, reading at most max_media_bytes."""
    _check_host(url, policy)
    timeout = policy.media_fetch_timeout
    try:
        async with asyncio.timeout(timeout):
            async with httpx.AsyncClient(follow_redirects=False, timeout=timeout) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    # identity: images are compressed already, and a gzip body would grow past the count
                    async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
                        if not response.is_redirect:
                            return await _body(response, url, policy)
                        url = str(response.url.join(response.headers["location"]))
                        _check_host(url, policy, redirected=True)
                raise MediaError(f"fetching image URL: more than {MAX_REDIRECTS} redirects", 400)
    except (TimeoutError, httpx.TimeoutException):
        raise MediaError(f"fetching image URL {_short(url)!r} took longer than {timeout:g} s "
                         "(--media-fetch-timeout)", 400) from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching image URL {_short(url)!r} failed: {type(e).__name__}: {e}", 400) from None


def _check_host(url: str, policy: MediaPolicy, redirected: bool = False) -> None:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise MediaError(f"invalid image URL: {e}", 400) from None
    what = "redirected to" if redirected else "image URL"
    if parsed.scheme not in ("http", "https"):
        raise MediaError(f"{what} {_short(url)!r}: only http(s) URLs are fetched", 403)
    if not policy.allowed_media_domains:
        raise MediaError("image URLs are refused: this server fetches only from the hosts listed in "
                         "--allowed-media-domains, and none are (send the image as a data: URL instead)", 403)
    if parsed.host.lower() not in policy.allowed_media_domains:
        raise MediaError(f"{what} host {parsed.host!r}, which is not in --allowed-media-domains", 403)


async def _body(response: httpx.Response, url: str, policy: MediaPolicy) -> bytes:
    if not response.is_success:
        raise MediaError(f"fetching image URL {_short(url)!r} answered HTTP {response.status_code}", 400)
    limit = policy.max_media_bytes
    too_big = MediaError(f"image at {_short(url)!r} exceeds the limit of {limit} bytes (--max-media-bytes)", 413)
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:  # the rest is never read
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _short(text: str, limit: int = 120) -> str:
    """A source as an error message quotes it: a long one (base64 by mistake) cut."""
    return text if len(text) <= limit else text[:limit] + "..."
