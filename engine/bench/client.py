"""Drive an OpenAI-compatible server with streaming requests at fixed concurrency.

Prompts go to `/v1/completions`; prompts with pictures to `/v1/chat/completions` (a completion cannot
carry them).

`concurrency` workers take prompts from one queue, so exactly `concurrency` requests are in flight
until the queue runs dry. Requests ask for `max_tokens` tokens with `ignore_eos` (an SGLang extra
field) and `stream_options.include_usage`, so the last chunk reports the true output token count.

The client shares the machine with the server under test, so it must be cheap: it streams with
aiohttp (as SGLang's bench_serving does). Measured against one server, alternating, 32 x 64 tokens:
httpx's streaming took 0.46-0.52 CPU-s per run, aiohttp 0.14-0.16 CPU-s. It splits what each socket
read delivered into lines itself (one await per read instead of one per line) and parses with orjson.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

import aiohttp
import httpx
import orjson

from baton.engine.bench.image_workload import warmup_like
from baton.engine.bench.metrics import RequestResult, summarize
from baton.engine.bench.workload import BenchPrompt
from baton.engine.utils.gc_freeze import gc_paused

REQUEST_TIMEOUT_S = 600.0


def completion_body(model: str, prompt: BenchPrompt) -> dict:
    """The streaming request of one prompt: a completion, or with pictures a chat completion whose one
    user message is the text and then the pictures."""
    if prompt.images:
        content = [{"type": "text", "text": prompt.text}] + [
            {"type": "image_url", "image_url": {"url": url}} for url in prompt.images]
        source = {"messages": [{"role": "user", "content": content}]}
    else:
        source = {"prompt": prompt.text}
    return {
        "model": model,
        **source,
        "max_tokens": prompt.output_len,
        "temperature": prompt.temperature,
        "top_p": prompt.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def auth_headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint(prompt: BenchPrompt) -> str:
    return "/v1/chat/completions" if prompt.images else "/v1/completions"


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict,
                            prompt_len: Optional[int]) -> RequestResult:
    """Send one streaming request and time its chunks. prompt_len None: the server's count from the
    usage chunk (a picture's tokens are known only to the server's processor)."""
    result = RequestResult(prompt_len=prompt_len or 0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            pending = b""
            # whatever the socket delivered, split into lines here: one await per read, not per line
            async for piece in response.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    event = _parse_sse(line)
                    if event is None:
                        continue
                    if _chunk_text(event):
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        chunks += 1
                        last = now
                    if event.get("usage"):
                        result.output_tokens = int(event["usage"]["completion_tokens"])
                        if prompt_len is None:
                            result.prompt_len = int(event["usage"].get("prompt_tokens") or 0)
                        result.usage_reported = True
            if pending.strip():  # an unterminated line: the stream was cut
                raise ValueError("the stream ended inside an event")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    if not result.usage_reported:
        result.output_tokens = chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "stream ended without text"
    return result


def _parse_sse(line: bytes) -> Optional[dict]:
    """The JSON of a `data:` line; None for blank lines, keep-alives, comments and `[DONE]`."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[len(b"data:"):].strip()
    if not payload or payload == b"[DONE]":
        return None
    event = orjson.loads(payload)
    if "error" in event:
        raise ValueError(f"server error in stream: {event['error']}")
    return event


def _chunk_text(event: dict) -> str:
    """A completion chunk's text, or a chat chunk's content (the role chunk that opens a chat stream
    carries none, so it does not end the TTFT)."""
    choices = event.get("choices") or []
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or
                   (c.get("delta") or {}).get("reasoning_content") or "" for c in choices)


async def run_requests(base_url: str, model: str, prompts: list[BenchPrompt], concurrency: int,
                       api_key: Optional[str] = None) -> tuple[list[RequestResult], float]:
    """All prompts through `concurrency` workers; returns results in prompt order and the wall time."""
    assert concurrency >= 1
    base_url = base_url.rstrip("/")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[Optional[RequestResult]] = [None] * len(prompts)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth_headers(api_key)) as session:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                p = prompts[i]
                results[i] = await stream_completion(session, base_url + endpoint(p), completion_body(model, p),
                                                     None if p.images else len(p.token_ids))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration


def resolve_model_name(base_url: str, api_key: Optional[str] = None) -> str:
    """The first model `/v1/models` lists (what `--model` defaults to)."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key), timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run_serving_benchmark(base_url: str, model: str, prompts: list[BenchPrompt], concurrency: int,
                          api_key: Optional[str] = None, warmup_requests: int = 1) -> dict:
    """Warm up (not measured), run the workload, and return `metrics.summarize`'s dict plus the setup
    (and for pictures, what the server's vision embeddings' cache did during the run, where it says)."""
    images = prompts[0].images if prompts else ()
    if warmup_requests:
        # A prompt of its own, so warming up does not put the workload's shared prefix (or pictures)
        # in the cache; pictures of the workload's size and number, so the vision path is warm too.
        warm = [BenchPrompt("Warm up the server, please.", (), 4, images=warmup_like(images))] * warmup_requests
        asyncio.run(run_requests(base_url, model, warm, concurrency, api_key))
    before = mm_counters(base_url, api_key) if images else None
    with gc_paused():  # the client's own collections are not the server's latency
        results, duration = asyncio.run(run_requests(base_url, model, prompts, concurrency, api_key))
    summary = summarize(results, duration)
    summary.update(base_url=base_url, model=model, concurrency=concurrency)
    if images:
        summary["images_per_request"] = len(images)
        after = mm_counters(base_url, api_key)
        if before is not None and after is not None:
            summary["mm"] = {k: after[k] - before[k] for k in MM_COUNTERS}
    return summary


MM_COUNTERS = ("mm_images_encoded", "mm_cache_hits", "mm_cache_misses")


def mm_counters(base_url: str, api_key: Optional[str] = None) -> Optional[dict[str, int]]:
    """A baton engine's vision counters from /get_server_info; None from a server without them."""
    try:
        info = httpx.get(base_url.rstrip("/") + "/get_server_info", headers=auth_headers(api_key), timeout=10).json()
        return {k: int(info[k]) for k in MM_COUNTERS}
    except Exception:  # any OpenAI server may be benchmarked; the counters are a baton extra
        return None
