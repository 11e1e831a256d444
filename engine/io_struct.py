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
    # an embedding engine's vectors (--is-embedding), parallel like the rest: None for a request without
    # one (every request of a generation engine); a message that has none may leave it empty
    embeddings: list[Optional[list[float]]] = field(default_factory=list)


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
    # as BatchTokenIDOut's (the detokenizer passes them through, one per request)
    embeddings: list[Optional[list[float]]] = field(default_factory=list)


# ---- sessions ----
@dataclass
class SessionParams:
    """SGLang's `session_params` of a generate request: which session (`id`) and which earlier request of
    it (`rid`; none: a fresh start, or a streaming session's last request) it continues, where that
    request's prompt and output are cut (`offset`, as a Python slice end), whether the requests after
    `rid` are dropped first (`replace`), and whether the history leaves out `rid`'s output
    (`drop_previous_output`)."""

    id: Optional[str] = None
    rid: Optional[str] = None
    offset: Optional[int] = None
    replace: Optional[bool] = None
    drop_previous_output: Optional[bool] = None


@dataclass
class SessionGenerateReqInput:
    """A generate request in a session: the scheduler builds its prompt from the session's history
    (engine/scheduler/sessions.py)."""

    req: TokenizedGenerateReqInput
    session_params: SessionParams


@dataclass
class OpenSessionReqInput:
    capacity_of_str_len: int
    session_id: Optional[str] = None  # the tokenizer manager draws one when the client gives none
    streaming: Optional[bool] = None  # each request continues the last one; no branching
    timeout: Optional[float] = None  # seconds without a request after which the session closes itself


@dataclass
class OpenSessionReqOutput:
    session_id: Optional[str]
    success: bool
    message: str = ""
    dp_rank: int = 0  # which scheduler answered


@dataclass
class CloseSessionReqInput:
    session_id: str


@dataclass
class CloseSessionReqOutput:
    success: bool
    message: str = ""
    dp_rank: int = 0  # which scheduler answered


# ---- operations ----
# SGLang's operational requests: pause / continue, memory release / resume, the torch profiler, slow-down
# and the internal-state knobs. Every reply names the DP rank that answered (TokenizerManager._control).
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")  # SGLang's GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS


@dataclass
class PauseGenerationReq:
    """abort: every request ends (an abort, its output so far); retract: running requests go back to
    the waiting queue, their KV freed; in_place: they stay where they are, their KV held."""

    mode: str = "abort"


@dataclass
class PauseGenerationOut:
    success: bool
    message: str = ""
    dp_rank: int = 0


@dataclass
class ContinueGenerationReq:
    pass


@dataclass
class ContinueGenerationOut:
    dp_rank: int = 0


@dataclass
class ReleaseMemoryOccupationReq:
    tags: Optional[list[str]] = None  # None or empty: every tag (MEMORY_TAGS)


@dataclass
class ResumeMemoryOccupationReq:
    tags: Optional[list[str]] = None


@dataclass
class MemoryOccupationOut:
    """The answer to a release or a resume: what is released after it."""

    success: bool
    message: str = ""
    released: list[str] = field(default_factory=list)
    dp_rank: int = 0


@dataclass
class ReleaseMemoryOccupationOut(MemoryOccupationOut):
    pass


@dataclass
class ResumeMemoryOccupationOut(MemoryOccupationOut):
    pass


@dataclass
class ProfileReq:
    """start (with SGLang's ProfileReqInput fields) or stop. With num_steps the start is answered when the
    profile has stopped after that many forward steps."""

    action: str  # "start" | "stop"
    output_dir: Optional[str] = None
    start_step: Optional[int] = None
    num_steps: Optional[int] = None
    activities: Optional[list[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    profile_id: str = ""


@dataclass
class ProfileOut:
    success: bool
    message: str = ""
    dp_rank: int = 0


@dataclass
class SlowDownReq:
    forward_sleep_time: Optional[float] = None  # seconds each forward step sleeps; None: none


@dataclass
class SlowDownOut:
    dp_rank: int = 0


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateOut:
    internal_state: dict[str, Any]
    dp_rank: int = 0


@dataclass
class SetInternalStateReq:
    server_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SetInternalStateOut:
    updated: bool
    server_args: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    dp_rank: int = 0


# ---- weights ----
# The weight-update endpoints (SGLang's names and bodies; engine/scheduler/weights.py answers them).
@dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str  # a checkpoint of the served model's architecture
    load_format: Optional[str] = None  # None | "auto" | "safetensors"
    abort_all_requests: bool = False
    weight_version: Optional[str] = None  # None: the count of updates so far
    flush_cache: bool = True


@dataclass
class UpdateWeightsFromTensorReqInput:
    # per TP rank (one entry: every rank), a serialized list of (name, tensor) (utils/named_tensors.py)
    serialized_named_tensors: list[bytes]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


@dataclass
class UpdateWeightsFromDistributedReqInput:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


@dataclass
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int  # this engine's TP rank r joins as rank_offset + r
    world_size: int
    group_name: str = "weight_update_group"
    backend: Optional[str] = None  # None: gloo on CPU, nccl on CUDA


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"


@dataclass
class UpdateWeightsReqOutput:
    """The answer to any of the requests above."""

    success: bool
    message: str
    weight_version: str = ""  # the version served after the request
    num_paused_requests: int = 0  # running requests retracted to be re-prefilled under the new weights
    dp_rank: int = 0


@dataclass
class GetWeightsByNameReqInput:
    name: str  # a checkpoint tensor's name
    truncate_size: int = 100


@dataclass
class GetWeightsByNameReqOutput:
    parameter: Optional[list]  # the full tensor's first truncate_size rows, float32 values; None: see message
    message: str = ""
    dp_rank: int = 0


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
