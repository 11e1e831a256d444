"""Messages between the engine's processes. This module is the only contract between them.

    HTTP server + TokenizerManager --(TokenizedGenerateReqInput, AbortReq, ...)--> Scheduler
    Scheduler --(BatchTokenIDOut, control replies)--> Detokenizer --(BatchStrOut, replies)--> TokenizerManager

All messages are plain dataclasses sent with pickle over ZMQ inside one pod.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from baton.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.multimodal.inputs import MultimodalInputs


# ---------------------------------------------------------------- tokenizer -> scheduler
@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: Optional[str]
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs; else first prompt position to score
    top_logprobs_num: int = 0
    priority: Optional[int] = None
    # the output starts with reasoning: a grammar applies only after the reasoning's end token
    require_reasoning: bool = False
    # PD disaggregation: filled from the router's fields
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    # images: their pixels, grids and the prompt's M-RoPE positions (multimodal/inputs.py)
    mm_inputs: Optional["MultimodalInputs"] = None
    received_time: float = field(default_factory=time.time)
    # multi-LoRA serving: the name of the adapter the request runs under (SGLang's lora_path; None: the
    # base model), resolved by the scheduler (scheduler/lora.py)
    lora_name: Optional[str] = None


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    message: str = "aborted"
    status_code: int = 499  # client closed request


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetServerInfoReq:
    pass


@dataclass
class FreezeGCReq:
    """Start-up is over (the compile warm-up included): freeze what exists (utils/gc_freeze.py)."""


# ---------------------------------------------------------------- scheduler -> tokenizer (via detokenizer)
@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""
    dp_rank: int = 0  # which scheduler answered (a DP engine gathers one answer per rank)


@dataclass
class GetServerInfoOut:
    info: dict[str, Any]
    dp_rank: int = 0  # which scheduler answered


@dataclass
class FinishReason:
    """Why a request ended. `kind`: length | stop | abort. Aborts carry an HTTP status for the client."""

    kind: str
    matched: Optional[int | str] = None  # the stop token id or stop string
    message: str = ""
    status_code: int = 200

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.kind == "length":
            out["length"] = None
        if self.kind == "abort":
            out["message"] = self.message
            out["status_code"] = self.status_code
        return out

    @property
    def openai_reason(self) -> str:
        return {"length": "length", "stop": "stop"}.get(self.kind, "abort")


@dataclass
class ReqMeta:
    """Per-request counters that travel with every output (on the wire as a plain tuple)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class BatchTokenIDOut:
    """New output tokens of several requests since their last output (scheduler -> detokenizer).

    Lists are parallel, one entry per request.
    """

    rids: list[str]
    finished_reasons: list[Optional[FinishReason]]
    new_token_ids: list[list[int]]
    # position in the request's whole output where new_token_ids start
    output_offsets: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    stop_strs: list[list[str]]  # the detokenizer trims a matched stop string
    no_stop_trim: list[bool]
    # (prompt_tokens, completion_tokens, cached_tokens) per request: plain tuples, as a dataclass per
    # request was two thirds of the message's pickling (10 of 15 us for 16 requests, each way)
    meta: list[tuple[int, int, int]]
    # logprobs: None for a request that did not ask. Each entry: list of (logprob, token_id).
    output_token_logprobs: list[Optional[list[tuple[float, int]]]]
    output_top_logprobs: list[Optional[list[list[tuple[float, int]]]]]
    input_token_logprobs: list[Optional[list[tuple[Optional[float], int]]]]
    input_top_logprobs: list[Optional[list[Optional[list[tuple[float, int]]]]]]


@dataclass
class BatchStrOut:
    """Decoded text of several requests (detokenizer -> tokenizer manager). `texts` are increments."""

    rids: list[str]
    texts: list[str]
    finished_reasons: list[Optional[FinishReason]]
    new_token_ids: list[list[int]]
    meta: list[tuple[int, int, int]]  # as BatchTokenIDOut's
    output_token_logprobs: list[Optional[list[tuple[float, int]]]]
    output_top_logprobs: list[Optional[list[list[tuple[float, int]]]]]
    input_token_logprobs: list[Optional[list[tuple[Optional[float], int]]]]
    input_top_logprobs: list[Optional[list[Optional[list[tuple[float, int]]]]]]


# ---- LoRA adapters ----
@dataclass
class LoadLoRAAdapterReqInput:
    """/load_lora_adapter (SGLang's body): an adapter in PEFT's format under a name requests pick it by.
    `pinned`: it keeps a slot of the adapter pool once there (at most --max-loras-per-batch - 1 do)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterReqInput:
    """/unload_lora_adapter: the adapter stops taking requests at once and goes once none uses it;
    asked again (the HTTP route polls) until then."""

    lora_name: str
    retry: bool = False  # asked again while requests ran under it: an adapter gone by now is done


@dataclass
class LoRAUpdateOutput:
    """The answer to a load or unload (SGLang's fields), and the adapters loaded after it (name -> path)."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)
    in_use: int = 0  # an unload still waiting for this many requests that run under the adapter
    dp_rank: int = 0  # which scheduler answered
