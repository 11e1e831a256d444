"""Images through real servers: a colocated engine and a PD pair (Mooncake TCP) behind `baton router`,
serving a tiny Qwen3.5 vision-language checkpoint. Greedy tokens equal HF's on the same pixels
(`/generate` with SGLang's image_data, chat completions with image_url parts, streaming); image sources
as the flags allow them; every bad input a clear 4xx with the engine serving on and its pools whole."""
from __future__ import annotations

import asyncio
import base64
import io
import sys

import httpx
import pytest

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from engine_server import STARTUP_TIMEOUT_S, running_engine, wait_idle_integrity
from test_pd_server import _environ, pd_router
from tiny_vl import IMAGE_PLACEHOLDER, hf_vl_greedy, make_tiny_vl_model, random_image

MAX_NEW = 8
CHUNK = ["--chunked-prefill-size", "16"]  # every image is cut by a chunk boundary


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return make_tiny_vl_model("qwen3_5", tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    random_image(24, 40, seed=7).save(d / "photo.png")
    return d


@pytest.fixture(scope="module")
def engine(vl_path, media_dir):
    with running_engine(vl_path, *CHUNK, "--max-total-tokens", "4096", "--allowed-local-media-path", str(media_dir),
                        "--limit-mm-data-per-request", '{"image": 3}', "--max-image-pixels", "40000",
                        "--mm-encoder-max-patches", "100") as e:
        yield e


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


class Expected:
    """HF's answer to a prompt with images, the prompt expanded as the engine's processor does."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from baton.engine.model_config import ModelConfig
        from baton.engine.multimodal.processor import ImageProcessor

        self.path, self.tok = path, AutoTokenizer.from_pretrained(path)
        mc = ModelConfig.from_pretrained(path)
        self.proc = ImageProcessor(path, mc.vision, mc.text.vocab_size)

    def greedy(self, ids: list[int], images: list, max_new: int = MAX_NEW) -> list[int]:
        loaded = [(f"h{i}", *reversed(self.proc.pixels(im))) for i, im in enumerate(images)]
        full, mm = self.proc.expand(ids, [(h, grid, px) for h, grid, px in loaded])
        return hf_vl_greedy(self.path, full, mm, max_new)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))


def _generate(base_url: str, text: str, images: list[str], **extra) -> httpx.Response:
    return httpx.post(f"{base_url}/generate", timeout=120, json={
        "text": text, "image_data": images, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        **extra})


def _user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else
                                        {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]}


def test_generate_with_image_data_equals_hf(engine, vl_path):
    """SGLang's /generate: a prompt with two placeholders and two images of different sizes."""
    exp = Expected(vl_path)
    a, b = random_image(30, 50, 1), random_image(64, 20, 2)
    text = f"look {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER} then say"
    r = _generate(engine.base_url, text, [data_url(a), base64.b64encode(png(b)).decode()])
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == exp.greedy(exp.tok.encode(text), [a, b])
    assert r.json()["meta_info"]["prompt_tokens"] > len(exp.tok.encode(text)) + 20  # the images' tokens


def test_chat_images_in_two_turns_stream_and_logprobs(engine, vl_path):
    """Chat completions with image_url parts in the first and second user turns: the text equals HF's
    greedy answer, streaming gives the same text, logprobs come per token."""
    exp = Expected(vl_path)
    a, b = random_image(40, 40, 3), random_image(17, 33, 4)
    messages = [_user("what is", a), {"role": "assistant", "content": "a square."}, _user("and this?", b)]
    hf_messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                    [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]} for m in messages]
    want = exp.tok.decode(exp.greedy(exp.chat_ids(hf_messages), [a, b]), skip_special_tokens=True)
    body = {"model": "any", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
    r = httpx.post(f"{engine.base_url}/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == want
    assert len(choice["logprobs"]["content"]) == MAX_NEW and len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    with httpx.stream("POST", f"{engine.base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as s:
        assert s.status_code == 200
        text = "".join(_deltas(s.iter_lines()))
    assert text == want


def _deltas(lines):
    import json

    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                yield c["delta"].get("content") or ""


def test_sources_as_the_flags_allow_and_a_repeat_hits_the_embedding_cache(engine, vl_path, media_dir):
    """A file under --allowed-local-media-path (as a path and as file://) serves; outside it, or any
    http URL with no --allowed-media-domains, is a 403. The same picture again (here as a data URL)
    skips the encoder: the embeddings' cache counts a hit."""
    text = f"{IMAGE_PLACEHOLDER} describe"
    photo = media_dir / "photo.png"
    first = _generate(engine.base_url, text, [str(photo)])
    assert first.status_code == 200, first.text
    before = httpx.get(f"{engine.base_url}/get_server_info", timeout=10).json()
    from PIL import Image

    again = _generate(engine.base_url, "other words " + text, [data_url(Image.open(photo))])
    assert again.status_code == 200, again.text
    after = httpx.get(f"{engine.base_url}/get_server_info", timeout=10).json()
    assert after["mm_cache_hits"] > before["mm_cache_hits"] and after["mm_images_encoded"] == before["mm_images_encoded"]
    assert _generate(engine.base_url, text, [f"file://{photo}"]).status_code == 200
    for source in ("/etc/hostname", f"{media_dir}/../../etc/hostname", "http://127.0.0.1:9/x.png"):
        r = _generate(engine.base_url, text, [source])
        assert r.status_code == 403, (source, r.status_code, r.text)
    metrics = httpx.get(f"{engine.base_url}/metrics", timeout=10).text
    assert "baton_mm_embedding_cache_hits_total" in metrics and "baton_mm_images_encoded_total" in metrics


@pytest.mark.parametrize("case", ["truncated", "not-an-image", "tiff", "too-many", "too-many-pixels",
                                  "over-encoder-budget", "no-placeholder", "video-part"])
def test_bad_images_are_4xx_and_the_engine_serves_on(engine, case):
    text = f"{IMAGE_PLACEHOLDER} describe"
    good = data_url(random_image(20, 20, 9))
    buf = io.BytesIO()
    random_image(20, 20, 9).save(buf, format="TIFF")
    sources, status, body_text = {
        "truncated": ([ "data:image/png;base64," + base64.b64encode(png(random_image(20, 20, 9))[:60]).decode()], 400,
                       text),
        "not-an-image": (["data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode()], 415, text),
        "tiff": (["data:image/tiff;base64," + base64.b64encode(buf.getvalue()).decode()], 415, text),
        "too-many": ([good] * 4, 400, IMAGE_PLACEHOLDER * 4),
        "too-many-pixels": ([data_url(random_image(300, 200, 9))], 413, text),
        # resized to 48x48 (the checkpoint's max pixels): 144 patches, over --mm-encoder-max-patches 100
        "over-encoder-budget": ([data_url(random_image(180, 180, 9))], 413, text),
        "no-placeholder": ([good], 400, "no placeholder here"),
        "video-part": (None, 400, None),
    }[case]
    if case == "video-part":
        r = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]})
    else:
        r = _generate(engine.base_url, body_text, sources)
    assert r.status_code == status, (case, r.status_code, r.text)
    assert r.json()["error"]["message"]
    ok = _generate(engine.base_url, text, [good])
    assert ok.status_code == 200, ok.text
    info = wait_idle_integrity(engine.base_url, timeout_s=60)
    assert info["integrity_ok"] is True, info


def test_pd_pair_behind_the_router_equals_colocated(vl_path, engine):
    """Prefill encodes, the decode gets KV and the M-RoPE delta in the transfer metadata; the router
    passes the image request through. Outputs equal the colocated engine's (and so HF's)."""
    common = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-protocol", "tcp",
              "--max-total-tokens", "4096", *CHUNK]
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = EngineProcess(engine_command(vl_path, prefill_port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *common]),
        prefill_port)
    decode = EngineProcess(engine_command(vl_path, decode_port, ["--disaggregation-mode", "decode", *common]),
                           decode_port)
    with _environ(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="15"), prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")
        with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                       bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
            images = [random_image(30, 50, 1), random_image(48, 24, 5)]
            bodies = [{"text": f"see {IMAGE_PLACEHOLDER} now", "image_data": [data_url(images[0])]},
                      {"text": f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}", "image_data": [data_url(i) for i in images]}]

            async def run(base: str) -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120) as c:
                    return await asyncio.gather(*[c.post(f"{base}/generate", json={
                        **b, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}) for b in bodies])

            via_pd, colocated = asyncio.run(run(router.base_url)), asyncio.run(run(engine.base_url))
            for pd, co in zip(via_pd, colocated):
                assert pd.status_code == 200 and co.status_code == 200, (pd.text, co.text)
                assert pd.json()["output_ids"] == co.json()["output_ids"]
            chat = {"messages": [_user("what is", images[1])], "max_tokens": MAX_NEW, "temperature": 0}
            pd_chat = httpx.post(f"{router.base_url}/v1/chat/completions", json=chat, timeout=120)
            co_chat = httpx.post(f"{engine.base_url}/v1/chat/completions", json=chat, timeout=120)
            assert pd_chat.status_code == 200, pd_chat.text
            assert pd_chat.json()["choices"][0]["message"] == co_chat.json()["choices"][0]["message"]
        for e in (prefill, decode):
            info = wait_idle_integrity(e.base_url, timeout_s=60)
            assert info["integrity_ok"] is True, info
        assert httpx.get(f"{prefill.base_url}/get_server_info", timeout=10).json()["mm_images_encoded"] >= 2
        assert httpx.get(f"{decode.base_url}/get_server_info", timeout=10).json()["mm_images_encoded"] == 0


def test_grammars_and_tools_apply_with_images(engine):
    """Structured output and tool calling work on a request with an image as on text: the answer
    matches the regex; a forced tool call comes back as a tool call with JSON arguments."""
    import json

    messages = [_user("is it red? answer yes or no", random_image(30, 30, 11))]
    r = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 8, "temperature": 0, "regex": "(yes|no)"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    tool = {"type": "function", "function": {"name": "colour", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}}}
    r = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 64, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "colour"}}})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "colour" and set(json.loads(call["arguments"])) == {"name"}
