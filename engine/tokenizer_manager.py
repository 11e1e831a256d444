"""TokenizerManager: the HTTP process's side of the engine. Tokenizes, sends requests to the
scheduler, and hands each request's outputs (from the detokenizer) back to its HTTP handler."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import zmq
import zmq.asyncio

from baton.engine.io_struct import (CloseSessionReqInput, CloseSessionReqOutput, OpenSessionReqInput,  # sessions
                                    OpenSessionReqOutput, SessionGenerateReqInput, SessionParams)
from baton.engine.io_struct import (AbortReq, BatchStrOut, ContinueGenerationOut, ContinueGenerationReq, FinishReason,
                                    FlushCacheOut, FlushCacheReq, FreezeGCReq, GetInternalStateOut,
                                    GetInternalStateReq, GetServerInfoOut, GetServerInfoReq, MemoryOccupationOut,
                                    PauseGenerationOut, PauseGenerationReq, ProfileOut, ProfileReq,
                                    ReleaseMemoryOccupationOut, ReleaseMemoryOccupationReq, ReqMeta,
                                    ResumeMemoryOccupationOut, ResumeMemoryOccupationReq, SetInternalStateOut,
                                    SetInternalStateReq, SlowDownOut, SlowDownReq, TokenizedGenerateReqInput)
from baton.engine.io_struct import (LoadLoRAAdapterReqInput, LoRAUpdateOutput,  # LoRA
                                    UnloadLoRAAdapterReqInput)
from baton.engine.metrics import EngineMetrics
from baton.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.multimodal.inputs import MultimodalInputs
    from baton.engine.multimodal.media import MediaPolicy
    from baton.engine.multimodal.processor import ImageProcessor

logger = logging.getLogger(__name__)

# how often a waiting non-streaming handler checks whether its client went away (s)
DISCONNECT_POLL_S = 1.0
# A stream silent this long (s) gets an SSE comment (": keep-alive"), so that proxies with an idle
# timeout keep the connection; set with BATON_SSE_KEEPALIVE_S (e.g. 15). Off (0) by default: SGLang's
# own client, sglang.bench_serving (0.4.6.post5), json-parses every non-blank line of a stream and
# fails on a comment (JSONDecodeError, on every route), and SGLang's engines send none.
SSE_KEEPALIVE_S = 0.0
# A LoRA load reads the adapter in every scheduler (s); an unload waiting for requests asks again this often (s)
LORA_LOAD_TIMEOUT_S = 300.0
LORA_UNLOAD_POLL_S = 0.02


class RequestError(Exception):
    """A request that fails before or in the scheduler; the HTTP layer answers `status`."""

    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


class ClientDisconnected(RequestError):
    """The client of a whole (non-streamed) response went away while it waited: the request is
    aborted in the scheduler, and the HTTP layer ends the call quietly (499, nobody left to read it)."""

    def __init__(self) -> None:
        super().__init__("client disconnected", 499, "client_disconnected")


@dataclass
class GenerateInput:
    """One request after HTTP parsing (a batch, or n > 1, is several of these: entrypoints/expansion.py)."""

    sampling_params: SamplingParams
    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    priority: Optional[int] = None
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    require_reasoning: bool = False  # a grammar applies after the reasoning (--reasoning-parser)
    # the client gave no max_new_tokens (max_tokens): the default is cut to what the context leaves
    # instead of refusing the request
    fit_max_new_tokens: bool = False
    # images, in the order of their placeholders in the prompt: sources as SGLang's `image_data`
    # (multimodal/media.py), and what attach_images makes of them
    image_data: Optional[list[str]] = None
    mm_inputs: Optional["MultimodalInputs"] = None
    # SGLang's session_params: the session and the request of it this one continues
    session_params: Optional[SessionParams] = None
    # the LoRA adapter the request runs under, by name (SGLang's lora_path); None: the base model
    lora_path: Optional[str] = None


@dataclass
class ReqOutput:
    """Everything a request produced so far, plus what is new in this step."""

    rid: str
    text: str = ""
    delta: str = ""
    output_ids: list[int] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: Optional[list] = None
    input_top_logprobs: Optional[list] = None
    new_logprobs_from: int = 0  # index into output_token_logprobs where this step's entries begin
    e2e_latency: float = 0.0
    embedding: Optional[list[float]] = None  # an embedding engine's vector, with the final output
    weight_version: str = ""  # the weights' version when its last step arrived


@dataclass
class _Step:
    """One request's part of one scheduler step, as it arrived; applied to the request's ReqOutput
    only when the consumer reads it."""

    text: str
    new_ids: list[int]
    finished_reason: Optional[FinishReason]
    meta: ReqMeta  # prompt, completion and cached token counts so far
    output_token_logprobs: Optional[list]
    output_top_logprobs: Optional[list]
    input_token_logprobs: Optional[list]
    input_top_logprobs: Optional[list]
    e2e_latency: float
    embedding: Optional[list[float]] = None  # an embedding engine's vector
    weight_version: str = ""  # the version the scheduler served when the step arrived


class StepQueue:
    """The steps of one request that its consumer has not read yet. The output loop puts without
    blocking; the consumer drains everything queued at once. (An asyncio.Queue's get() per step,
    under a timeout, cost a task and a timer per streamed token.)"""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, step: Any) -> None:
        self.items.append(step)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)

    def get_nowait(self) -> Any:
        return self.items.popleft()

    def wake(self) -> None:
        """Ends a wait() with nothing queued (the keep-alive ticker)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until a step is put or the queue is woken; at once when a step is queued."""
        if self.items:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_nonempty(self) -> None:
        while not self.items:
            await self.wait()


@dataclass
class _ReqState:
    out: ReqOutput
    queue: StepQueue
    created: float = field(default_factory=time.time)
    last_token_time: Optional[float] = None
    keepalive: bool = False  # the consumer takes a None after a silence (generate's keepalive)
    last_step: float = field(default_factory=time.time)  # when a step last arrived (or a keep-alive was due)


@dataclass
class _Gather:
    """A control call's answers, one per DP rank."""

    fut: asyncio.Future
    replies: dict[int, Any] = field(default_factory=dict)


class TokenizerManager:
    """`scheduler_addrs`: one scheduler per DP rank. A request goes to the rank it names
    (`data_parallel_rank`), else under PD to bootstrap_room % dp_size, else by `load_balance_method`.
    A prefill engine always takes room % dp_size: that is where a decode looks for the room's KV
    (the router pins a prefill rank by drawing such a room, and the copies of `n` > 1, rooms
    room + k, spread over the ranks the same way on both sides). Control calls (flush, server info)
    go to every rank and gather one answer from each."""

    def __init__(self, tokenizer: Any, scheduler_addrs: "str | list[str]", detokenizer_out_addr: str,
                 metrics: EngineMetrics, vocab_size: int, context_len: int,
                 load_balance_method: str = "round_robin", disaggregation_mode: str = "null",
                 keepalive_s: float = SSE_KEEPALIVE_S, allow_auto_truncate: bool = False) -> None:
        self.tokenizer, self.metrics = tokenizer, metrics
        self.keepalive_s = keepalive_s
        self.allow_auto_truncate = allow_auto_truncate  # --allow-auto-truncate (_fit_context)
        self._scheduler_addrs = [scheduler_addrs] if isinstance(scheduler_addrs, str) else list(scheduler_addrs)
        self.vocab_size, self.context_len, self.dp_size = vocab_size, context_len, len(self._scheduler_addrs)
        self.load_balance_method, self.disaggregation_mode = load_balance_method, disaggregation_mode
        self._detok_addr = detokenizer_out_addr
        self.states: dict[str, _ReqState] = {}
        self._rank_of: dict[str, int] = {}  # rid -> DP rank, while in flight
        self.in_flight = [0] * self.dp_size  # requests in flight per DP rank
        self._next_rank = 0
        self._control_waiters: dict[type, list[_Gather]] = {}
        self._loop_task: Optional[asyncio.Task] = None
        self._keepalive_task: Optional[asyncio.Task] = None
        self.stopped: Optional[str] = None  # why the engine behind this front end is gone (fail_all)
        # /pause_generation: the mode while paused (new requests wait); /release_memory_occupation: what is released
        self.paused: Optional[str] = None
        self.memory_released: list[str] = []
        self._unpaused = asyncio.Event()

    async def start(self) -> None:
        ctx = zmq.asyncio.Context(1)
        self.sends = []
        for addr in self._scheduler_addrs:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.sends.append(sock)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(self._detok_addr)
        self._loop_task = asyncio.create_task(self._handle_loop())
        if self.keepalive_s > 0:
            self._keepalive_task = asyncio.create_task(self._keepalive_loop())

    def pick_rank(self, obj: "GenerateInput") -> int:
        """The DP rank a new request goes to."""
        dp = self.dp_size
        if dp == 1:
            return 0
        if obj.bootstrap_room is not None and (self.disaggregation_mode == "prefill" or obj.data_parallel_rank is None):
            return obj.bootstrap_room % dp
        if obj.data_parallel_rank is not None:
            return obj.data_parallel_rank
        start, self._next_rank = self._next_rank, (self._next_rank + 1) % dp
        if self.load_balance_method == "shortest_queue":  # ties rotate, so an idle engine still spreads
            return min(range(dp), key=lambda r: (self.in_flight[r], (r - start) % dp))
        return start

    async def _broadcast(self, msg: Any) -> None:
        for sock in self.sends:
            await sock.send_pyobj(msg)

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions", 400)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as e:  # template errors are the client's messages not fitting the template
            raise RequestError(f"messages do not fit the chat template: {e}", 400) from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------ images
    def enable_images(self, processor: "ImageProcessor", policy: "MediaPolicy", max_concurrent: int,
                      max_patches: int) -> None:
        """A vision-language model: requests may carry images (each of at most `max_patches` patches)."""
        self.image_processor, self.media_policy = processor, policy
        self._mm_limit, self._mm_max_patches = max_concurrent, max_patches
        self._mm_sem: Optional[asyncio.Semaphore] = None

    async def attach_images(self, objs: list[GenerateInput]) -> None:
        """Each request's images loaded and processed, its prompt expanded (multimodal/processor.py):
        before generate(), so that a bad image is a status code. The same source in several requests
        (n > 1 copies) is processed once."""
        if not any(o.image_data for o in objs):
            return
        if getattr(self, "image_processor", None) is None:
            raise RequestError("this model takes text only: image input needs a vision-language model", 400)
        from baton.engine.multimodal.media import MediaError
        from baton.engine.multimodal.processor import ProcessorError

        done: dict[str, asyncio.Future] = {}
        try:
            for obj in objs:
                if not obj.image_data:
                    continue
                self.media_policy.check_image_count(len(obj.image_data))
                for src in obj.image_data:
                    if src not in done:
                        done[src] = asyncio.ensure_future(self._image(src))
                images = await asyncio.gather(*(done[src] for src in obj.image_data))
                ids = obj.input_ids if obj.input_ids is not None else self.tokenize(obj.text or "")
                obj.input_ids, obj.mm_inputs = self.image_processor.expand(ids, images)
        except (MediaError, ProcessorError) as e:
            raise RequestError(getattr(e, "message", str(e)), getattr(e, "status", 400)) from e
        finally:
            for f in done.values():
                f.cancel()

    async def _image(self, source: str) -> tuple:
        """(hash, grid, pixel_values) of one image source, at most --mm-max-concurrent-calls at once."""
        from baton.engine.multimodal.media import load_image

        if self._mm_sem is None:
            self._mm_sem = asyncio.Semaphore(self._mm_limit)
        async with self._mm_sem:
            loaded = await load_image(source, self.media_policy)
            proc = self.image_processor
            t, h, w = proc.grid(loaded.width, loaded.height)
            if t * h * w > self._mm_max_patches:  # before the pixel work: the encoder could not take it
                raise RequestError(f"an image of {loaded.width}x{loaded.height} becomes {t * h * w} patches; the vision "
                                   f"encoder takes at most {self._mm_max_patches} per step (--mm-encoder-max-patches)",
                                   413)
            pixels, grid = await asyncio.to_thread(proc.pixels, loaded.image)
            return loaded.hash, grid, pixels

    # ------------------------------------------------------------------ generation
    def _tokenized(self, obj: GenerateInput) -> TokenizedGenerateReqInput:
        ids = obj.input_ids if obj.input_ids is not None else self.tokenize(obj.text or "")
        if not ids:
            raise RequestError("the prompt is empty", 400)
        obj.sampling_params.verify(self.vocab_size)
        self._check_lora(obj)
        ids = self._fit_context(obj, ids)
        if obj.data_parallel_rank is not None and not 0 <= obj.data_parallel_rank < self.dp_size:
            raise RequestError(f"data_parallel_rank {obj.data_parallel_rank} is out of range: this engine has "
                               f"{self.dp_size} data-parallel rank(s)", 400)
        return TokenizedGenerateReqInput(
            rid=obj.rid, input_text=obj.text, input_ids=list(ids), sampling_params=obj.sampling_params,
            stream=obj.stream, return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len,
            top_logprobs_num=obj.top_logprobs_num, priority=obj.priority, bootstrap_host=obj.bootstrap_host,
            bootstrap_port=obj.bootstrap_port, bootstrap_room=obj.bootstrap_room,
            data_parallel_rank=obj.data_parallel_rank, require_reasoning=obj.require_reasoning,
            mm_inputs=obj.mm_inputs, lora_name=obj.lora_path)

    def _fit_context(self, obj: GenerateInput, ids: list[int]) -> list[int]:
        """The prompt and max_new_tokens within the context length, as OpenAI and SGLang check them: a
        prompt that leaves no room, or a total past the context, is a 400. With --allow-auto-truncate
        (SGLang's flag) the prompt is cut to its first context - 1 tokens and max_new_tokens to what
        is left instead; a max_new_tokens the client did not give is always cut."""
        limit, params = self.context_len, obj.sampling_params
        if len(ids) >= limit:
            if not self.allow_auto_truncate:
                raise RequestError(f"the prompt has {len(ids)} tokens; this model's context length is {limit}", 400)
            logger.warning("request %s: prompt of %d tokens cut to %d (--allow-auto-truncate)", obj.rid, len(ids),
                           limit - 1)
            ids = ids[:limit - 1]
        room = limit - len(ids)
        if params.max_new_tokens > room:
            if not (obj.fit_max_new_tokens or self.allow_auto_truncate):
                raise RequestError(
                    f"this model's context length is {limit} tokens, and the request asks for "
                    f"{len(ids) + params.max_new_tokens}: {len(ids)} in the prompt and {params.max_new_tokens} to "
                    f"generate; ask for at most {room} (max_tokens / max_new_tokens)", 400)
            params.max_new_tokens, params.min_new_tokens = room, min(params.min_new_tokens, room)
        return ids

    def generate(self, obj: GenerateInput, is_disconnected=None,
                 keepalive: bool = False) -> AsyncIterator[Optional[ReqOutput]]:
        """Checks the request now (a RequestError here comes before any response is sent), and
        returns its outputs: a ReqOutput per step (streaming) or once at the end. The request goes to
        the scheduler at the first read; it is aborted there when the consumer stops early or the
        client disconnects. `keepalive` (a stream): a None after each silence of keepalive_s."""
        if self.stopped is not None:
            raise RequestError(self.stopped, 503, "server_error")
        if self.memory_released:
            raise RequestError(f"the engine's memory is released ({', '.join(self.memory_released)}): no generation "
                               "until POST /resume_memory_occupation", 503, "server_error")
        tokenized = self._in_session(obj, self._tokenized(obj))
        self._check_new_rid(obj.rid)
        return self._generate(obj, tokenized, is_disconnected, keepalive)

    def _check_new_rid(self, rid: str) -> None:
        if rid in self.states:
            raise RequestError(f"duplicate request id {rid!r}", 400)

    async def _generate(self, obj: GenerateInput, tokenized: Any, is_disconnected,
                        keepalive: bool) -> AsyncIterator[Optional[ReqOutput]]:
        if self.paused is not None:
            await self._wait_unpaused(is_disconnected)
        self._check_new_rid(obj.rid)  # again: another request may have taken the id since generate()
        state = _ReqState(ReqOutput(rid=obj.rid), StepQueue(), keepalive=keepalive)
        self.states[obj.rid] = state
        rank = self.pick_rank(obj)
        self._rank_of[obj.rid] = rank
        self.in_flight[rank] += 1
        finished = False
        try:
            await self.sends[rank].send_pyobj(tokenized)
            while True:
                out = await self._next(state, is_disconnected)
                if out is None:  # a silence (keepalive)
                    yield None
                    continue
                finished = out.finished_reason is not None
                if finished or obj.stream:
                    yield out
                if finished:
                    return
        finally:
            self.states.pop(obj.rid, None)
            if not finished:
                await self.abort(obj.rid, "client disconnected")
            self._rank_of.pop(obj.rid, None)
            self.in_flight[rank] -= 1

    async def _next(self, state: _ReqState, is_disconnected) -> Optional[ReqOutput]:
        """Waits for the next step(s) of a request; steps that queued up meanwhile are merged, so a
        slow consumer gets one larger delta instead of falling behind. None: the keep-alive ticker
        woke a keepalive request that had nothing new."""
        while state.queue.empty():
            if is_disconnected is None:  # a stream: a disconnect ends its send instead (no timer per step)
                await state.queue.wait()
                if state.queue.empty() and state.keepalive:
                    return None
                continue
            try:
                # asyncio.timeout, not wait_for: wait_for wraps the get in a task of its own, once
                # per step (Python 3.11)
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    await state.queue.wait_nonempty()
            except TimeoutError:
                if await is_disconnected():
                    raise ClientDisconnected()
        first = state.queue.get_nowait()
        steps = [first]
        while not state.queue.empty():
            steps.append(state.queue.get_nowait())
        # The output changes here only, when its consumer reads: a consumer that yields between reads
        # (to send a chunk) never sees a later step's finish or text on the step it is handling.
        out = state.out
        out.new_logprobs_from = len(out.output_token_logprobs)
        for step in steps:
            out.text += step.text
            out.output_ids.extend(step.new_ids)
            out.finished_reason = step.finished_reason
            out.prompt_tokens, out.completion_tokens = step.meta.prompt_tokens, step.meta.completion_tokens
            out.cached_tokens, out.e2e_latency = step.meta.cached_tokens, step.e2e_latency
            out.weight_version = step.weight_version
            if step.output_token_logprobs is not None:
                out.output_token_logprobs.extend(step.output_token_logprobs)
            if step.output_top_logprobs is not None:
                out.output_top_logprobs.extend(step.output_top_logprobs)
            if step.input_token_logprobs is not None:
                out.input_token_logprobs, out.input_top_logprobs = step.input_token_logprobs, step.input_top_logprobs
            if step.embedding is not None:
                out.embedding = step.embedding
        out.delta = "".join(step.text for step in steps)
        out.new_ids = [t for step in steps for t in step.new_ids]
        return out

    def rids_of(self, rid: str) -> list[str]:
        """`rid` and the running copies it was expanded into by n > 1 (rid-0, rid-1, ...)."""
        prefix = rid + "-"
        return [rid] + [r for r in self.states if r.startswith(prefix) and r[len(prefix):].isdigit()]

    async def abort(self, rid: str, message: str = "aborted by request") -> None:
        """To the rank that has the request; to every rank when it is not known here."""
        msg = AbortReq(rid=rid, message=message)
        rank = self._rank_of.get(rid)
        await (self._broadcast(msg) if rank is None else self.sends[rank].send_pyobj(msg))

    def fail_all(self, message: str) -> None:
        """The scheduler or detokenizer is gone: every request in flight ends now with a 503 abort
        (streams get an error event), control calls fail, and new requests are refused."""
        self.stopped = message
        now = time.time()
        reason = FinishReason("abort", message=message, status_code=503)
        for state in self.states.values():
            out = state.out
            state.queue.put_nowait(_Step("", [], reason, ReqMeta(out.prompt_tokens, out.completion_tokens,
                                                                 out.cached_tokens),
                                         None, None, None, None, now - state.created))
        for waiters in self._control_waiters.values():
            for gather in waiters:
                if not gather.fut.done():
                    gather.fut.set_exception(RequestError(message, 503, "server_error"))
            waiters.clear()

    # ---- sessions ----
    async def open_session(self, obj: OpenSessionReqInput) -> str:
        """Opened on every DP rank (a session's requests then go to one: session_rank). Its id; a
        RequestError (400) when the id is open already."""
        if self.disaggregation_mode != "null":
            raise RequestError("sessions need a colocated engine: a PD engine's KV leaves it with each request", 400)
        if obj.session_id is None:
            obj.session_id = uuid.uuid4().hex
        failed = [o for o in await self._control(obj, OpenSessionReqOutput) if not o.success]
        if failed:
            raise RequestError(f"failed to open the session: {failed[0].message}", 400)
        return obj.session_id

    async def close_session(self, obj: CloseSessionReqInput) -> None:
        outs = await self._control(obj, CloseSessionReqOutput)
        if not any(o.success for o in outs):
            raise RequestError(outs[0].message, 404)

    def session_rank(self, session_id: str) -> int:
        """The DP rank whose scheduler holds a session's requests (a stable hash of its id)."""
        return zlib.crc32(session_id.encode()) % self.dp_size

    def _in_session(self, obj: GenerateInput, tokenized: TokenizedGenerateReqInput) -> Any:
        """A request with session_params goes to its session's DP rank, wrapped so that the scheduler
        builds its prompt from the session's history."""
        params = obj.session_params
        if params is None:
            return tokenized
        if self.disaggregation_mode != "null":
            raise RequestError("sessions need a colocated engine: a PD engine's KV leaves it with each request", 400)
        if params.id is None:
            raise RequestError("session_params needs the session's id", 400)
        if obj.lora_path is not None:  # a session holds its history by the base model's cache keys
            raise RequestError("a session with a LoRA adapter is not supported yet", 400)
        rank = self.session_rank(params.id)
        if obj.data_parallel_rank not in (None, rank):
            raise RequestError(f"session {params.id!r} runs on data-parallel rank {rank}, not "
                               f"{obj.data_parallel_rank}", 400)
        obj.data_parallel_rank = rank
        return SessionGenerateReqInput(tokenized, params)
    # ---- operations ----
    async def _wait_unpaused(self, is_disconnected) -> None:
        """A new request while generation is paused: it waits here, not sent yet, until the continue."""
        while self.paused is not None:
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    await self._unpaused.wait()
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    raise ClientDisconnected() from None

    async def pause_generation(self, mode: str) -> PauseGenerationOut:
        """New requests wait from now on; every DP rank pauses (scheduler/pause.py). In abort mode this
        returns once the requests that were in flight have all been answered."""
        in_flight, was_paused = set(self.states), self.paused is not None
        self.paused = mode
        self._unpaused.clear()
        outs = await self._control(PauseGenerationReq(mode), PauseGenerationOut)
        failed = [o for o in outs if not o.success]
        if failed:
            if not was_paused:
                self._set_unpaused()
            return failed[0]
        if mode == "abort":
            deadline = time.monotonic() + 30.0
            while in_flight & self.states.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # their last outputs are on the way to their handlers
        return outs[0]

    async def continue_generation(self) -> None:
        await self._control(ContinueGenerationReq(), ContinueGenerationOut)
        self._set_unpaused()

    def _set_unpaused(self) -> None:
        self.paused = None
        self._unpaused.set()

    async def release_memory_occupation(self, tags: Optional[list[str]]) -> MemoryOccupationOut:
        return await self._memory_call(ReleaseMemoryOccupationReq(tags), ReleaseMemoryOccupationOut)

    async def resume_memory_occupation(self, tags: Optional[list[str]]) -> MemoryOccupationOut:
        return await self._memory_call(ResumeMemoryOccupationReq(tags), ResumeMemoryOccupationOut)

    async def _memory_call(self, req: Any, reply_type: type) -> MemoryOccupationOut:
        """The first rank's refusal, or rank 0's answer; what is released is what any rank released.
        (A weight reload from disk may take a while: a long timeout.)"""
        outs = await self._control(req, reply_type, timeout=600.0)
        self.memory_released = [t for t in ("kv_cache", "weights") if any(t in o.released for o in outs)]
        failed = [o for o in outs if not o.success]
        return failed[0] if failed else outs[0]

    async def start_profile(self, **fields: Any) -> ProfileOut:
        """SGLang's ProfileReqInput fields; with num_steps, answered once the steps have run."""
        req = ProfileReq("start", profile_id=str(time.time()), **fields)
        outs = await self._control(req, ProfileOut, timeout=600.0 if req.num_steps else 30.0)
        failed = [o for o in outs if not o.success]
        return failed[0] if failed else outs[0]

    async def stop_profile(self) -> ProfileOut:
        outs = await self._control(ProfileReq("stop"), ProfileOut)
        failed = [o for o in outs if not o.success]
        return failed[0] if failed else outs[0]

    async def slow_down(self, forward_sleep_time: Optional[float]) -> None:
        await self._control(SlowDownReq(forward_sleep_time), SlowDownOut)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [o.internal_state for o in await self._control(GetInternalStateReq(), GetInternalStateOut)]

    async def set_internal_state(self, server_args: dict[str, Any]) -> list[SetInternalStateOut]:
        return await self._control(SetInternalStateReq(server_args), SetInternalStateOut)
    # ---- weights ----
    # The weights' version the scheduler serves, stamped on each output step as it arrives (a step of
    # the old weights arrives before the update's answer): --weight-version at start, then each
    # update's (entrypoints/weights_routes.py).
    weight_version = "default"

    # ---- LoRA adapters ----
    # the adapters loaded (name -> path) as the schedulers last said; None while LoRA is off (enable_lora)
    lora_adapters: Optional[dict[str, str]] = None

    def enable_lora(self, adapters: dict[str, str]) -> None:
        """--enable-lora: requests may name adapters; `adapters`: those of --lora-paths."""
        self.lora_adapters = dict(adapters)

    def _check_lora(self, obj: GenerateInput) -> None:
        """An adapter that is not loaded: a 400 before the request is sent (the scheduler checks again)."""
        name = obj.lora_path
        if name is None:
            return
        if self.lora_adapters is None:
            raise RequestError(f"LoRA adapter {name!r} requested, but LoRA is not enabled on this server "
                               "(--enable-lora)", 400)
        if name not in self.lora_adapters:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{', '.join(sorted(self.lora_adapters)) or 'none'})", 400)

    async def load_lora_adapter(self, req: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        return self._lora_outcome(await self._control(req, LoRAUpdateOutput, timeout=LORA_LOAD_TIMEOUT_S))

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """Done once no request runs under the adapter on any rank (SGLang waits for them): until then
        every rank is asked again, every LORA_UNLOAD_POLL_S; new requests naming it are refused at once."""
        while True:
            outs = await self._control(req, LoRAUpdateOutput)
            if not any(o.in_use for o in outs):
                return self._lora_outcome(outs)
            self._lora_outcome(outs)
            req = UnloadLoRAAdapterReqInput(req.lora_name, retry=True)
            await asyncio.sleep(LORA_UNLOAD_POLL_S)

    def _lora_outcome(self, outs: list[LoRAUpdateOutput]) -> LoRAUpdateOutput:
        """One answer for the DP ranks (the first refusal, else rank 0's); the adapters loaded, as rank 0 has them."""
        if self.lora_adapters is not None:
            self.lora_adapters = dict(outs[0].loaded_adapters)
        failed = [o for o in outs if not o.success]
        return failed[0] if failed else outs[0]

    # ------------------------------------------------------------------ control
    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> list[Any]:
        """Sends `req` to every DP rank; the answers, in rank order."""
        if self.stopped is not None:
            raise RequestError(self.stopped, 503, "server_error")
        gather = _Gather(asyncio.get_running_loop().create_future())
        self._control_waiters.setdefault(reply_type, []).append(gather)
        await self._broadcast(req)
        return await asyncio.wait_for(gather.fut, timeout)

    def _deliver(self, msg: Any) -> None:
        """A control answer goes to the oldest call still waiting for its rank's answer: each rank
        answers in the order it was asked, so concurrent calls each get one answer per rank."""
        rank, waiters = msg.dp_rank, self._control_waiters.get(type(msg), [])
        for gather in list(waiters):
            if gather.fut.done():  # timed out or failed
                waiters.remove(gather)
            elif rank not in gather.replies:
                gather.replies[rank] = msg
                if len(gather.replies) == self.dp_size:
                    waiters.remove(gather)
                    gather.fut.set_result([gather.replies[r] for r in range(self.dp_size)])
                return

    async def flush_cache(self) -> FlushCacheOut:
        """Flushed only where every rank was idle; the first refusal's message otherwise."""
        outs = await self._control(FlushCacheReq(), FlushCacheOut)
        failed = [o for o in outs if not o.success]
        return failed[0] if failed else outs[0]

    async def freeze_gc(self) -> None:
        """After start-up: the scheduler(s) freeze their long-lived objects (no reply), and so does this process."""
        from baton.engine.utils.gc_freeze import freeze_gc

        await self._broadcast(FreezeGCReq())
        freeze_gc("tokenizer manager")

    async def get_server_infos(self) -> list[dict[str, Any]]:
        """Each DP rank's scheduler state, in rank order."""
        return [out.info for out in await self._control(GetServerInfoReq(), GetServerInfoOut)]

    async def get_server_info(self) -> dict[str, Any]:
        return merge_server_infos(await self.get_server_infos())

    # ------------------------------------------------------------------ outputs
    async def _keepalive_loop(self) -> None:
        """One timer for every stream (none per step): wakes the keepalive requests that have had no
        step for keepalive_s, so their handlers send a keep-alive (between 1 and 1.5 x keepalive_s)."""
        while True:
            await asyncio.sleep(self.keepalive_s / 2)
            now = time.time()
            for state in self.states.values():
                if state.keepalive and now - state.last_step >= self.keepalive_s:
                    state.last_step = now
                    state.queue.wake()

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv.recv_pyobj()
            try:
                if isinstance(msg, BatchStrOut):
                    self._handle_batch(msg)
                else:
                    self._deliver(msg)
            except Exception:
                logger.exception("failed to dispatch an output message")

    def _handle_batch(self, msg: BatchStrOut) -> None:
        now, generated = time.time(), 0
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:  # the client went away; the abort is on its way
                continue
            finished, meta = msg.finished_reasons[i], ReqMeta(*msg.meta[i])
            state.last_step = now
            generated += len(msg.new_token_ids[i])
            self._observe(state, now, len(msg.new_token_ids[i]), finished, meta)  # on arrival, for TTFT/ITL
            state.queue.put_nowait(_Step(
                msg.texts[i], msg.new_token_ids[i], finished, meta, msg.output_token_logprobs[i],
                msg.output_top_logprobs[i], msg.input_token_logprobs[i], msg.input_top_logprobs[i],
                now - state.created, msg.embeddings[i] if msg.embeddings else None, self.weight_version))
        if generated:
            self.metrics.generation_tokens.inc(generated)  # once per batch: the counter takes a lock

    def _observe(self, state: _ReqState, now: float, new_tokens: int, finished: Optional[FinishReason],
                 meta: Any) -> None:
        m = self.metrics
        if new_tokens:
            if state.last_token_time is None:
                m.ttft.observe(now - state.created)
            else:
                m.itl.observe((now - state.last_token_time) / new_tokens)
            state.last_token_time = now
        if finished is not None:
            m.e2e.observe(now - state.created)
            m.prompt_tokens.inc(meta.prompt_tokens)
            m.cached_tokens.inc(meta.cached_tokens)
            m.finished(finished.kind)


# Per-rank counts that add up over DP ranks in the merged server info (the rest is rank 0's).
_SUMMED_INFO = ("num_running_reqs", "num_waiting_reqs", "num_waiting_tokens", "num_grammar_queue_reqs", "retractions", "preemptions",
                "gen_throughput", "max_total_num_tokens", "num_bootstrap_reqs", "num_inflight_reqs",
                "num_prealloc_reqs", "num_transfer_reqs", "mm_images_encoded", "mm_cache_hits", "mm_cache_misses",
                "mm_cache_bytes")


def merge_server_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's view of its DP ranks (/get_server_info): rank 0's fields, counts summed over the
    ranks, token usage and cache hit rate averaged, integrity_ok true only when every rank checked and
    held, and each rank's own info under `internal_states` (SGLang's name; always there, one rank
    too: sglang.bench_serving reads internal_states[0]). The `*_samples` lists (up to thousands of
    numbers each) are for /metrics only and stay out."""
    infos = [{k: v for k, v in info.items() if not k.endswith("_samples")} for info in infos]
    merged = dict(infos[0])
    if len(infos) > 1:
        for key in _SUMMED_INFO:
            if all(key in info for info in infos):
                merged[key] = sum(info[key] for info in infos)
        for key in ("token_usage", "cache_hit_rate"):
            if all(key in info for info in infos):
                merged[key] = sum(info[key] for info in infos) / len(infos)
        checks = [info.get("integrity_ok") for info in infos]
        merged["integrity_ok"] = None if None in checks else all(checks)
    merged["internal_states"] = infos
    return merged
