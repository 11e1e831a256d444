"""multimodal/media.py: every image source a request may name, every refusal with its status and message,
the pixel limit read from the header before any pixel is decoded, and the image-input flags. URLs are
fetched from a small HTTP server on 127.0.0.1 started here (allowed host, redirects, byte limit,
timeouts)."""
from __future__ import annotations

import argparse
import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

from baton.engine.multimodal.media import LoadedImage, MediaError, MediaPolicy, decode_image, load_image
from baton.engine.server_args import MAX_IMAGE_PIXELS, ServerArgs


def policy(**flags: Any) -> MediaPolicy:
    """The policy the server builds from these flags (ServerArgs checks and normalizes them)."""
    return ServerArgs(model_path="m", **flags).view(MediaPolicy)


def picture(size: tuple[int, int] = (5, 3), mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def encoded(im: Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height (8-bit RGB) and holds a few garbage bytes of pixel data: decoding
    it would fail (or allocate width * height * 3 bytes first); its size is all the header tells."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


async def refused(source: str, pol: MediaPolicy, status: int, *needles: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        await load_image(source, pol)
    assert info.value.status == status, info.value.message
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value


def same_pixels(loaded: LoadedImage, im: Image.Image) -> bool:
    return loaded.image.mode == "RGB" and np.array_equal(np.asarray(loaded.image), np.asarray(im.convert("RGB")))


# ---- decoding: formats, RGB, hash ----

@pytest.mark.parametrize("fmt,save", [("PNG", {}), ("WEBP", {"lossless": True}), ("BMP", {}), ("GIF", {})])
async def test_lossless_formats_decode_to_the_same_pixels(fmt, save):
    im = picture().convert("P").convert("RGB") if fmt == "GIF" else picture()  # GIF holds a palette
    loaded = await load_image(data_url(encoded(im, fmt, **save), f"image/{fmt.lower()}"), policy())
    assert (loaded.width, loaded.height) == im.size and same_pixels(loaded, im)


async def test_jpeg_decodes():
    loaded = await load_image(data_url(encoded(picture((16, 8)), "JPEG"), "image/jpeg"), policy())
    assert (loaded.width, loaded.height) == (16, 8) and loaded.image.mode == "RGB"


async def test_the_hash_is_of_the_pixels_not_the_container():
    im = picture()
    png, webp = encoded(im), encoded(im, "WEBP", lossless=True)
    assert png != webp
    hashes = {(await load_image(s, policy())).hash for s in
              (data_url(png), base64.b64encode(png).decode(), data_url(webp, "image/webp"))}
    assert len(hashes) == 1 and len(hashes.pop()) == 64  # sha256, hex
    other = await load_image(data_url(encoded(picture(seed=1))), policy())
    assert other.hash != (await load_image(data_url(png), policy())).hash
    # the same run of pixel bytes in two shapes
    row = bytes(range(18))
    flat, square = Image.frombytes("RGB", (6, 1), row), Image.frombytes("RGB", (3, 2), row)
    assert decode_image(encoded(flat), policy()).hash != decode_image(encoded(square), policy()).hash


async def test_transparency_is_composited_on_white_as_transformers_does():
    from transformers.image_transforms import convert_to_rgb

    im = picture((4, 4), "RGBA")
    pixels = np.asarray(im).copy()
    pixels[0, 0, 3] = 0  # see-through: white, not the colour under it
    im = Image.fromarray(pixels, "RGBA")
    loaded = await load_image(data_url(encoded(im)), policy())
    assert tuple(np.asarray(loaded.image)[0, 0]) == (255, 255, 255)
    assert np.array_equal(np.asarray(loaded.image), convert_to_rgb(im, return_numpy=True))
    gray = await load_image(data_url(encoded(picture(mode="L"))), policy())
    assert gray.image.mode == "RGB"


async def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    loaded = await load_image(data_url(out.getvalue(), "image/gif"), policy())
    assert tuple(np.asarray(loaded.image)[0, 0]) == (255, 0, 0)


# ---- bad images ----

@pytest.mark.parametrize("data", [encoded(picture(), "TIFF"), b"GIF89a not really", b"%PDF-1.4 just text",
                                  b"<svg xmlns='http://www.w3.org/2000/svg'/>"])
async def test_other_formats_and_non_images_are_415(data):
    await refused(data_url(data), policy(), 415, "PNG, JPEG, WEBP, GIF, BMP")


async def test_a_data_url_of_another_media_type_is_415():
    await refused(data_url(encoded(picture()), "text/plain"), policy(), 415, "'text/plain' is not an image")


async def test_a_truncated_png_is_400():
    data = encoded(picture((64, 64)))
    await refused(data_url(data[:len(data) // 2]), policy(), 400, "undecodable image")


async def test_the_pixel_limit_is_checked_from_the_header_before_decoding():
    # the header claims 100x100 with garbage pixel data: a 413, so the data was never decoded (it would
    # have been a 400)
    await refused(data_url(png_header_only(100, 100)), policy(max_image_pixels=1000), 413,
                  "100x100 pixels exceeds the limit of 1000 pixels (--max-image-pixels)")
    assert (await load_image(data_url(encoded(picture((40, 25)))), policy(max_image_pixels=1000))).width == 40
    # a decompression bomb: 10^10 pixels (30 GB as RGB) from a 100-byte file, refused at once
    start = time.monotonic()
    await refused(data_url(png_header_only(100_000, 100_000)), policy(), 413, "--max-image-pixels")
    assert time.monotonic() - start < 5


async def test_the_default_pixel_limit_is_pillows():
    assert MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    await refused(data_url(png_header_only(10_000, 9_000)), policy(), 413, "10000x9000")


# ---- data URLs and base64 ----

@pytest.mark.parametrize("source,needle", [
    ("data:image/png;base64,!!!!", "invalid base64"),
    ("data:image/png;base64,iVBORw0KGgo=AAAA", "invalid base64"),
    ("data:image/png,iVBORw0KGgo=", "must be base64"),
    ("data:image/png;base64", "no ','"),
    ("   ", "non-empty"),
    ("ftp://example.com/a.png", "scheme 'ftp' is not supported"),
])
async def test_malformed_sources_are_400(source, needle):
    await refused(source, policy(), 400, needle)


async def test_plain_base64_with_line_breaks():
    text = base64.encodebytes(encoded(picture())).decode()  # 76-column lines
    assert "\n" in text.strip()
    assert (await load_image(text, policy())).width == 5


async def test_the_byte_limit_applies_to_base64_before_decoding():
    data = encoded(picture((32, 32)))
    await refused(data_url(data), policy(max_media_bytes=len(data) - 1), 413, "--max-media-bytes")
    await refused(base64.b64encode(data).decode(), policy(max_media_bytes=len(data) - 1), 413, "--max-media-bytes")
    assert (await load_image(data_url(data), policy(max_media_bytes=len(data)))).width == 32


# ---- local files ----

@pytest.fixture
def media_root(tmp_path) -> Iterator[tuple[str, str]]:
    """(root, outside): a directory with a.png, and a directory beside it with secret.png."""
    root, outside = tmp_path / "media", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a.png").write_bytes(encoded(picture()))
    (root / "sub").mkdir()
    (outside / "secret.png").write_bytes(encoded(picture(seed=2)))
    yield str(root), str(outside)


async def test_local_files_are_refused_by_default(media_root):
    root, _ = media_root
    await refused(os.path.join(root, "a.png"), policy(), 403, "--allowed-local-media-path")
    await refused(f"file://{root}/a.png", policy(), 403, "--allowed-local-media-path")


async def test_local_files_under_the_root(media_root):
    root, _ = media_root
    pol = policy(allowed_local_media_path=root)
    want = await load_image(data_url(encoded(picture())), pol)
    for source in (os.path.join(root, "a.png"), "a.png", "sub/../a.png", f"file://{root}/a.png",
                   f"file://localhost{root}/a.png"):
        assert (await load_image(source, pol)).hash == want.hash, source


async def test_a_path_out_of_the_root_is_403(media_root):
    root, outside = media_root
    pol = policy(allowed_local_media_path=root)
    for source in ("../outside/secret.png", os.path.join(root, "..", "outside", "secret.png"),
                   os.path.join(outside, "secret.png"), f"file://{root}/../outside/secret.png", "/etc/passwd"):
        await refused(source, pol, 403, "outside --allowed-local-media-path")


async def test_a_symlink_out_of_the_root_is_403(media_root):
    root, outside = media_root
    os.symlink(os.path.join(outside, "secret.png"), os.path.join(root, "link.png"))
    os.symlink(outside, os.path.join(root, "linked_dir"))
    os.symlink(os.path.join(root, "a.png"), os.path.join(root, "sub", "inside.png"))
    pol = policy(allowed_local_media_path=root)
    await refused("link.png", pol, 403, "outside --allowed-local-media-path")
    await refused("linked_dir/secret.png", pol, 403, "outside --allowed-local-media-path")
    assert (await load_image("sub/inside.png", pol)).width == 5  # a link that stays inside


async def test_a_root_that_is_a_symlink_still_serves_its_files(media_root, tmp_path):
    root, _ = media_root
    os.symlink(root, tmp_path / "alias")
    assert (await load_image("a.png", policy(allowed_local_media_path=str(tmp_path / "alias")))).width == 5


async def test_local_file_errors(media_root):
    root, _ = media_root
    pol = policy(allowed_local_media_path=root)
    await refused("missing.png", pol, 400, "does not exist")
    await refused("sub", pol, 400, "cannot be read")
    await refused("file://otherhost/a.png", pol, 400, "only local files")
    size = os.path.getsize(os.path.join(root, "a.png"))
    await refused("a.png", policy(allowed_local_media_path=root, max_media_bytes=size - 1), 413, "--max-media-bytes")


# ---- URLs ----

class _Handler(BaseHTTPRequestHandler):
    png = encoded(picture())

    def do_GET(self):  # noqa: N802 - http.server's name
        route = {"/a.png": self._png, "/same": lambda: self._redirect("/a.png"),
                 "/other": lambda: self._redirect(f"http://localhost:{self.server.server_port}/a.png"),
                 "/loop": lambda: self._redirect("/loop"), "/missing": lambda: self.send_error(404),
                 "/declared": self._declared, "/endless": self._endless, "/slow": self._slow,
                 "/trickle": self._trickle}.get(self.path)
        if route is None:
            self.send_error(404)
        else:
            route()

    def _png(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def _redirect(self, where: str):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _declared(self):
        self.send_response(200)
        self.send_header("Content-Length", str(10**9))
        self.end_headers()
        self.wfile.write(self.png)

    def _endless(self):  # no length: read until closed, or until the client stops
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(10_000):
                self.wfile.write(b"\0" * 65536)
        except OSError:  # the client hung up at its limit
            self.server.cut_off.set()

    def _slow(self):
        time.sleep(3)
        self._png()

    def _trickle(self):
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(30):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def http_server() -> Iterator[tuple[str, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.cut_off = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


async def test_urls_are_refused_without_allowed_domains(http_server):
    base, _ = http_server
    await refused(f"{base}/a.png", policy(), 403, "--allowed-media-domains", "none are")


async def test_a_host_not_listed_is_403(http_server):
    base, _ = http_server
    await refused(f"{base}/a.png", policy(allowed_media_domains=["example.com"]), 403,
                  "host '127.0.0.1', which is not in --allowed-media-domains")
    # the host is what the URL's parser reads, not what its text starts with
    await refused(f"http://example.com@{base[len('http://'):]}/a.png", policy(allowed_media_domains=["example.com"]),
                  403, "'127.0.0.1'")


async def test_an_allowed_host_is_fetched(http_server):
    base, _ = http_server
    loaded = await load_image(f"{base}/a.png", policy(allowed_media_domains=["127.0.0.1"]))
    assert loaded.hash == (await load_image(data_url(_Handler.png), policy())).hash


async def test_redirects_stay_among_the_allowed_hosts(http_server):
    base, _ = http_server
    pol = policy(allowed_media_domains=["127.0.0.1"])
    assert (await load_image(f"{base}/same", pol)).width == 5
    await refused(f"{base}/other", pol, 403, "redirected to host 'localhost', which is not in --allowed-media-domains")
    await refused(f"{base}/loop", pol, 400, "redirects")
    assert (await load_image(f"{base}/other", policy(allowed_media_domains=["127.0.0.1", "localhost"]))).width == 5


async def test_a_failed_fetch_is_400(http_server):
    base, _ = http_server
    await refused(f"{base}/missing", policy(allowed_media_domains=["127.0.0.1"]), 400, "answered HTTP 404")
    await refused("http://127.0.0.1:1/a.png", policy(allowed_media_domains=["127.0.0.1"]), 400, "failed")


async def test_the_byte_limit_cuts_a_download_off(http_server):
    base, server = http_server
    pol = policy(allowed_media_domains=["127.0.0.1"], max_media_bytes=100_000)
    await refused(f"{base}/declared", pol, 413, "exceeds the limit of 100000 bytes (--max-media-bytes)")
    await refused(f"{base}/endless", pol, 413, "exceeds the limit of 100000 bytes")
    assert server.cut_off.wait(10)  # the server saw the connection close long before its 655 MB


async def test_the_timeout_covers_the_whole_fetch(http_server):
    base, _ = http_server
    pol = policy(allowed_media_domains=["127.0.0.1"], media_fetch_timeout=0.5)
    for path in ("/slow", "/trickle"):  # no answer; an answer that never ends
        start = time.monotonic()
        await refused(f"{base}{path}", pol, 400, "took longer than 0.5 s (--media-fetch-timeout)")
        assert time.monotonic() - start < 2.5


# ---- the flags ----

def _parsed(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", *argv]))


def test_the_flags_build_the_policy(tmp_path):
    args = _parsed("--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "Example.COM",
                   "cdn.example.com,[::1]", "--limit-mm-data-per-request", '{"image": 2, "video": 0}',
                   "--max-image-pixels", "1000", "--max-media-bytes", "2048", "--media-fetch-timeout", "2.5")
    assert args.view(MediaPolicy) == MediaPolicy(str(tmp_path), ("example.com", "cdn.example.com", "::1"),
                                                 {"image": 2, "video": 0}, 1000, 2048, 2.5)
    default = _parsed().view(MediaPolicy)
    assert default == MediaPolicy(None, (), None, MAX_IMAGE_PIXELS, 20 * 1024 * 1024, 10.0)
    assert default.max_images is None
    assert _parsed("--limit-mm-data-per-request", "3").limit_mm_data_per_request == {"image": 3}


@pytest.mark.parametrize("flags,needle", [
    ({"limit_mm_data_per_request": "lots"}, "--limit-mm-data-per-request"),
    ({"limit_mm_data_per_request": '{"image": -1}'}, "counts >= 0"),
    ({"limit_mm_data_per_request": '{"pictures": 1}'}, "image, video, audio"),
    ({"allowed_media_domains": ["https://example.com"]}, "host names (no scheme, port or path)"),
    ({"allowed_media_domains": ["example.com:8080"]}, "host names"),
    ({"allowed_local_media_path": "/no/such/dir"}, "no such directory"),
    ({"max_image_pixels": 0}, "--max-image-pixels"),
    ({"media_fetch_timeout": 0}, "--media-fetch-timeout"),
])
def test_bad_flag_values_fail_at_start_up(flags, needle):
    with pytest.raises(ValueError) as info:
        ServerArgs(model_path="m", **flags)
    assert needle in str(info.value)


def test_the_image_count_limit():
    pol = policy(limit_mm_data_per_request={"image": 2})
    pol.check_image_count(2)
    with pytest.raises(MediaError) as info:
        pol.check_image_count(3)
    assert info.value.status == 400 and "3 images" in info.value.message and "at most 2" in info.value.message
    policy(limit_mm_data_per_request={"video": 1}).check_image_count(100)  # no image limit given
