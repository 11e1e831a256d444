"""Request bodies of the HTTP API (OpenAI and SGLang-native), validated with pydantic.

Unknown fields are ignored (clients send many); wrong types fail validation -> 400. The
SGLang extras (top_k, min_p, ignore_eos, ...) and the PD fields the router adds are accepted.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingExtras(_Body):
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # PD disaggregation, added by the router: one value, or one per prompt of a batched completion
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    data_parallel_rank: Optional[Union[int, list[int]]] = None
    rid: Optional[str] = None
    priority: Optional[int] = None
    logit_bias: Optional[dict[str, Any]] = None  # checked with the other sampling values (SamplingParams)
    # structured output: OpenAI's response_format, or SGLang's extras (at most one grammar)
    response_format: Optional[dict[str, Any]] = None
    json_schema: Optional[Any] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[Any] = None
    # OpenAI features this server does not implement (tools: on completions; chat has its own),
    # a request for one gets a 400, never a silent answer without it (openai_api.reject_unsupported)
    tools: Optional[list[Any]] = None
    functions: Optional[list[Any]] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    lora_path: Optional[str] = None  # SGLang's: the LoRA adapter by name (a model of "base:adapter" wins)


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionRequest(SamplingExtras):
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: StrictBool = False  # "yes" is a 400, as the router answers, not a stream
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = None
    echo: bool = False
    rid: Optional[Union[str, list[str]]] = None  # a batch's: one per prompt (as routers send them)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool's answer
    reasoning_content: Optional[str] = None  # an earlier turn's reasoning, for templates that show it


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: no arguments
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingExtras):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: StrictBool = False  # "yes" is a 400, as the router answers, not a stream
    stream_options: Optional[StreamOptions] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: Optional[str] = None
    # tool calling (entrypoints/chat_tools.py) and reasoning (--reasoning-parser)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class GenerateRequest(_Body):
    """SGLang-native /generate. One of text / input_ids; lists make a batch."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: StrictBool = False  # "yes" is a 400, as the router answers, not a stream
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    rid: Optional[Union[str, list[str]]] = None
    priority: Optional[Union[int, list[int]]] = None
    require_reasoning: bool = False  # SGLang's: a grammar applies after the reasoning's end token
    # SGLang's: a prompt's images (a source or a list of them; the text holds their placeholders),
    # for a batch one entry per prompt (a source, a list, or null)
    image_data: Optional[Union[str, list[Optional[Union[str, list[str]]]]]] = None
    video_data: Optional[Any] = None  # SGLang's; refused: images only
    audio_data: Optional[Any] = None
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    data_parallel_rank: Optional[Union[int, list[int]]] = None
    # SGLang's: the session the request continues (id, rid, offset, replace, drop_previous_output); for
    # a batch one per prompt. Checked in session_routes.py
    session_params: Optional[Union[dict[str, Any], list[Optional[dict[str, Any]]]]] = None
    # SGLang's: the LoRA adapter by name (null: the base model), or one per prompt of a batch
    lora_path: Optional[Union[str, list[Optional[str]]]] = None


# ---- embeddings ----
class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings. `input`: a string, strings, token ids or lists of token ids (checked by
    the route, which names what is wrong)."""

    input: Any = None
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None  # the first this many values, L2-normalised again
    user: Optional[str] = None
    rid: Optional[Union[str, list[str]]] = None  # SGLang's: a batch's, one per input


class EncodeRequest(_Body):
    """SGLang-native /encode and /classify (SGLang's EmbeddingReqInput). One of text / input_ids;
    lists make a batch."""

    text: Any = None
    input_ids: Any = None
    rid: Optional[Union[str, list[str]]] = None
    dimensions: Optional[int] = None
    image_data: Optional[Any] = None  # SGLang's multimodal embeddings; refused: text only
