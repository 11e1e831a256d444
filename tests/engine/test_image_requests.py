"""Images in the HTTP API, parsed (entrypoints/chat_content.py, openai_api.py, /generate): content parts keep
their order, the request carries every image's source in order (`image_data`), the chat template gets
image parts or the placeholder text, and the 400s (a text-only model, video and audio, too many images,
malformed parts). The routes run in-process on a stand-in tokenizer manager that records the requests
it is handed: no engine, no image is loaded here."""
from __future__ import annotations

import types
from typing import Any, AsyncIterator

import httpx
import pytest
import transformers as tf
from transformers import AutoTokenizer

from tiny_models import CHAT_TEMPLATE, save_tiny_tokenizer

from baton.engine.entrypoints.chat_content import ImagePart, ImageTemplate, parse_messages
from baton.engine.entrypoints.http_common import ApiContext
from baton.engine.entrypoints.http_server import create_app
from baton.engine.io_struct import FinishReason
from baton.engine.server_args import ServerArgs
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, TokenizerManager

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen3-VL's chat template, as far as content goes: parts rendered in order, an image as the placeholder
VL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
               "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
               "{% if c.type == 'image' or 'image' in c or 'image_url' in c %}" + PLACEHOLDER +
               "{% elif 'text' in c %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RED = "data:image/png;base64,iVBORw0KGgo="  # never loaded here
BLUE = "https://example.com/blue.png"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Config-only checkpoints (no weights: nothing is loaded but the config and the tokenizer): a
    vision-language one whose image token ids are the tokenizer's, and a text-only one."""
    vl, text = tmp_path_factory.mktemp("vl"), tmp_path_factory.mktemp("text")
    save_tiny_tokenizer(vl, extra_tokens=VISION_TOKENS)
    ids = AutoTokenizer.from_pretrained(vl).convert_tokens_to_ids(list(VISION_TOKENS))
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    tf.Qwen3VLConfig(text_config=small, vision_config=dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0]),
                     vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2],
                     video_token_id=ids[3]).save_pretrained(vl)
    tf.Qwen3Config(**small).save_pretrained(text)
    save_tiny_tokenizer(text)
    return {"vl": str(vl), "text": str(text)}


class StandInTokenizerManager:
    """What the routes call on the tokenizer manager; each request handed on is kept in `seen`."""

    apply_chat_template = TokenizerManager.apply_chat_template

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.context_len, self.seen = tokenizer, 512, []
        self.metrics = types.SimpleNamespace(error=lambda status: None)

    async def attach_images(self, objs: list[GenerateInput]) -> None:
        """The real one loads and processes the images (tests/engine/test_vl_server.py); here the
        requests go on with their sources, which the tests read."""

    async def generate(self, obj: GenerateInput, is_disconnected: Any = None,
                       keepalive: bool = False) -> AsyncIterator[ReqOutput]:
        self.seen.append(obj)
        yield ReqOutput(obj.rid, text="ok", finished_reason=FinishReason("length"), completion_tokens=1)


def serve(path: str, template: str = VL_TEMPLATE, **flags: Any) -> tuple[httpx.AsyncClient, StandInTokenizerManager]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tm = StandInTokenizerManager(tokenizer)
    app = create_app(ApiContext(ServerArgs(model_path=path, **flags), tm, {}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine"), tm


def chat(*messages: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"messages": list(messages), "max_tokens": 1, **body}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def ids_of(tm: StandInTokenizerManager, text: str) -> list[int]:
    return tm.tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- content parts ----

def test_parts_keep_their_order_and_the_images_theirs():
    content = parse_messages([
        {"role": "system", "content": "be brief"},
        user("what is", image(RED), "and", {"type": "image_url", "image_url": BLUE}),
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                     {"type": "input_image", "image_url": "data:image/gif;base64,R0lG"}]},
    ])
    assert content.image_data == [RED, BLUE, "data:image/gif;base64,R0lG"]
    assert content.messages[1]["content"] == ["what is", ImagePart(RED), "and", ImagePart(BLUE)]
    assert content.messages[2]["content"] == ""
    parts = ImageTemplate(PLACEHOLDER, renders_parts=True)
    rendered = content.for_template(parts)
    assert rendered[0]["content"] == "be brief"
    assert rendered[1]["content"] == [{"type": "text", "text": "what is"}, {"type": "image"},
                                      {"type": "text", "text": "and"}, {"type": "image"}]
    strings = content.for_template(ImageTemplate(PLACEHOLDER, renders_parts=False))
    assert strings[1]["content"] == f"what is\n{PLACEHOLDER}\nand\n{PLACEHOLDER}"
    assert strings[3]["content"] == f"and this?\n{PLACEHOLDER}"


def test_text_parts_alone_are_joined_as_before():
    content = parse_messages([user("one", "two")])
    assert content.image_data == [] and content.for_template(None)[0]["content"] == "one\ntwo"


def test_the_template_probe(checkpoints):
    from baton.engine.model_config import ModelConfig

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["vl"])
    vision = ModelConfig.from_pretrained(checkpoints["vl"]).vision
    tokenizer.chat_template = VL_TEMPLATE
    assert ImageTemplate.probe(tokenizer, vision) == ImageTemplate(PLACEHOLDER, renders_parts=True)
    tokenizer.chat_template = CHAT_TEMPLATE  # strings only: prints the list as Python
    assert ImageTemplate.probe(tokenizer, vision) == ImageTemplate(PLACEHOLDER, renders_parts=False)
    tokenizer.chat_template = "{{ messages[0].content + '!' }}"  # fails on a list
    assert not ImageTemplate.probe(tokenizer, vision).renders_parts


# ---- /v1/chat/completions ----

async def test_chat_hands_on_the_images_in_order_and_their_placeholders(checkpoints):
    client, tm = serve(checkpoints["vl"])
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(
            user("look:", image(RED), "then"), {"role": "assistant", "content": "ok"}, user(image(BLUE), "now?"), n=2))
    assert r.status_code == 200, r.text
    assert [obj.image_data for obj in tm.seen] == [[RED, BLUE]] * 2  # both choices of n = 2
    want = (f"<|im_start|>user\nlook:{PLACEHOLDER}then<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
            f"<|im_start|>user\n{PLACEHOLDER}now?<|im_end|>\n<|im_start|>assistant\n")
    assert tm.seen[0].input_ids == ids_of(tm, want)
    image_pad = tm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert tm.seen[0].input_ids.count(image_pad) == 2


async def test_a_template_for_strings_gets_the_placeholder_text(checkpoints):
    client, tm = serve(checkpoints["vl"], template=CHAT_TEMPLATE)
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(user("look:", image(RED), "then")))
    assert r.status_code == 200, r.text
    assert tm.seen[0].image_data == [RED]
    assert tm.seen[0].input_ids == ids_of(tm, f"<|im_start|>user\nlook:\n{PLACEHOLDER}\nthen<|im_end|>\n"
                                              "<|im_start|>assistant\n")


async def test_a_chat_without_images_is_as_before(checkpoints):
    client, tm = serve(checkpoints["text"], template=CHAT_TEMPLATE)
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(user("one", "two")))
    assert r.status_code == 200, r.text
    assert tm.seen[0].image_data is None
    assert tm.seen[0].input_ids == ids_of(tm, "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("model,body,needle", [
    ("text", chat(user("what is this?", image(RED))), "takes text only"),
    ("vl", chat(user({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}})),
     "'video_url' is not supported: this server takes text and images"),
    ("vl", chat(user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})),
     "'input_audio' is not supported"),
    ("vl", chat(user({"type": "image_url"})), "needs image_url.url"),
    ("vl", chat(user({"type": "image_url", "image_url": {"detail": "low"}})), "needs image_url.url"),
    ("vl", chat(user({"text": "no type"})), "content part of type None is not supported"),
    ("vl", chat(user(image(RED), image(RED), image(BLUE))), "3 images; this server takes at most 2 per request "
                                                            "(--limit-mm-data-per-request)"),
])
async def test_chat_refusals(checkpoints, model, body, needle):
    client, tm = serve(checkpoints[model], limit_mm_data_per_request='{"image": 2}')
    async with client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert tm.seen == []  # refused before anything was handed on, so before any image was fetched


async def test_a_completion_prompt_of_parts_is_refused(checkpoints):
    client, tm = serve(checkpoints["vl"])
    async with client:
        r = await client.post("/v1/completions", json={"prompt": [image(RED)]})
    assert r.status_code == 400 and "completion prompt of content parts ('image_url')" in r.json()["error"]["message"]


# ---- /generate ----

@pytest.mark.parametrize("body,want", [
    ({"text": f"{PLACEHOLDER} what?", "image_data": RED}, [[RED]]),
    ({"text": f"{PLACEHOLDER}{PLACEHOLDER}", "image_data": [RED, BLUE]}, [[RED, BLUE]]),
    ({"text": "no image"}, [None]),
    ({"text": ["a", "b", "c"], "image_data": [RED, [RED, BLUE], None]}, [[RED], [RED, BLUE], None]),
    ({"text": ["a", "b"], "image_data": RED}, [[RED], [RED]]),
    ({"input_ids": [[5, 6], [7]], "image_data": [[BLUE], []]}, [[BLUE], None]),
    ({"text": "a", "image_data": [RED], "sampling_params": {"n": 2, "max_new_tokens": 1}}, [[RED], [RED]]),
])
async def test_generate_takes_sglangs_image_data(checkpoints, body, want):
    client, tm = serve(checkpoints["vl"])
    async with client:
        r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [obj.image_data for obj in tm.seen] == want


@pytest.mark.parametrize("model,body,needle", [
    ("text", {"text": "a", "image_data": RED}, "takes text only"),
    ("vl", {"text": ["a", "b"], "image_data": [RED]}, "image_data has 1 entries for 2 prompts"),
    ("vl", {"text": "a", "image_data": [[RED]]}, "a source or a list of sources"),
    ("vl", {"text": "a", "image_data": [RED, RED, RED]}, "at most 2"),
    ("vl", {"text": "a", "video_data": "https://example.com/v.mp4"}, "video_data and audio_data are not supported"),
    ("vl", {"text": "a", "image_data": 7}, "image_data"),
])
async def test_generate_refusals(checkpoints, model, body, needle):
    client, tm = serve(checkpoints[model], limit_mm_data_per_request="2")
    async with client:
        r = await client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and tm.seen == []
