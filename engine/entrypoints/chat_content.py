"""Chat messages' content parts as the chat template reads them, and the images they name.

OpenAI's content parts: `{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url": ...}}`
(the url also as a plain string, as some clients send it; the Responses API's `input_text` and
`input_image` alike). A message's parts keep their order. The images of a request, in order of
appearance across its messages, are its `image_data` (the sources, loaded later by the tokenizer
manager: multimodal/media.py).

How a template sees a message with images (ImageTemplate, probed once per server):
- a template that renders content parts (Qwen3-VL's, Qwen3.5's: `{"type": "image"}` becomes
  `<|vision_start|><|image_pad|><|vision_end|>`) gets the parts, each image as `{"type": "image"}`,
  as HF's processors pass them;
- a template that takes strings only gets the parts joined by newlines, each image as that
  placeholder text.
A message without images gets its text parts joined by newlines (as vLLM does), as before images
were served. Video and audio parts are a 400.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from baton.engine.model_config import VisionConfig
from baton.engine.tokenizer_manager import RequestError

TEXT_PARTS = frozenset({"text", "input_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image"})
# content parts of media this server does not take (OpenAI's, SGLang's and vLLM's names)
OTHER_MEDIA_PARTS = frozenset({"video_url", "input_audio", "audio_url", "file", "input_file", "video", "audio"})


class ImagePart(NamedTuple):
    """An image part, where it stands in its message."""

    source: str  # a data: URL, base64, a URL or a path (multimodal/media.load_image reads it)


@dataclass(frozen=True)
class ImageTemplate:
    """How the chat template of a vision-language model takes images."""

    placeholder: str  # the text of one image: <|vision_start|><|image_pad|><|vision_end|> for Qwen
    renders_parts: bool  # the template renders {"type": "image"} parts itself

    @classmethod
    def probe(cls, tokenizer: Any, vision: VisionConfig) -> "ImageTemplate":
        """The placeholder from the model's token ids; whether the template renders image parts, by
        rendering one (a template for strings fails on a list, or prints it without the placeholder)."""
        ids = [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
        placeholder = "".join(tokenizer.convert_ids_to_tokens(ids))
        image_token = tokenizer.convert_ids_to_tokens(vision.image_token_id)
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # any template error: the template does not take parts
            return cls(placeholder, renders_parts=False)
        return cls(placeholder, renders_parts=isinstance(text, str) and image_token in text)


class ChatContent(NamedTuple):
    """A chat request's messages, content parts parsed (text as str, images as ImagePart)."""

    messages: list[dict[str, Any]]  # content: a string, or a list of str | ImagePart
    image_data: list[str]  # every image's source, in order

    def for_template(self, images: Optional[ImageTemplate]) -> list[dict[str, Any]]:
        """The messages as the chat template gets them. `images`: needed when there are images."""
        return [_render(m, images) for m in self.messages]


def parse_messages(messages: list[dict[str, Any]]) -> ChatContent:
    """Each message's content parts parsed; an unknown part, or a video or audio part, is a 400. No
    content (an assistant turn that called tools: `null`, as the OpenAI SDK returns it) is the empty
    string, which every template can concatenate."""
    out, sources = [], []
    for message in messages:
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = [_parse_part(part) for part in content]
            sources.extend(p.source for p in content if isinstance(p, ImagePart))
        out.append({**message, "content": content})
    return ChatContent(out, sources)


def _parse_part(part: Any) -> str | ImagePart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind in IMAGE_PARTS:
        return ImagePart(_image_url(part, kind))
    if kind in OTHER_MEDIA_PARTS:
        raise RequestError(f"content part of type {kind!r} is not supported: this server takes text and images", 400)
    raise RequestError(f"content part of type {kind!r} is not supported (text, image_url)", 400)


def _image_url(part: dict[str, Any], kind: str) -> str:
    """The url of an image part: `image_url` as {"url": ...} (OpenAI's chat) or as the string itself."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"content part of type {kind!r} needs image_url.url (a data: URL, or a URL the server "
                           "may fetch)", 400)
    return url


def _render(message: dict[str, Any], images: Optional[ImageTemplate]) -> dict[str, Any]:
    content = message["content"]
    if not isinstance(content, list):
        return message
    if not any(isinstance(p, ImagePart) for p in content):
        return {**message, "content": "\n".join(content)}
    assert images is not None, "a message with images needs the model's ImageTemplate"
    if images.renders_parts:
        parts = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p} for p in content]
        return {**message, "content": parts}
    return {**message, "content": "\n".join(images.placeholder if isinstance(p, ImagePart) else p for p in content)}
