"""Workers that stop answering while they hold requests: fakes frozen as a
SIGSTOPped process would be (every route waits, connections stay open), and one real SIGSTOP."""
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from router_support import url_of, wait_until

from baton.router.config import PolicyName, RetryConfig, WorkerRole

STALL = 0.3  # --worker-stall-timeout of these tests


def events(text: str) -> list:
    return [e[6:] if e == "data: [DONE]" else orjson.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: ")]


async def test_a_stalled_stream_ends_with_an_error_event_and_the_worker_comes_back(fake_workers, routers, http):
    worker = await fake_workers("w1", stream_chunks=40, chunk_interval=0.05)
    router = await routers(regular=[worker.url], worker_stall_timeout_secs=STALL, retry=RetryConfig(max_retries=1))
    started = asyncio.get_running_loop().time()
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        worker.freeze()
        text = (first + await resp.read()).decode()
    assert asyncio.get_running_loop().time() - started < 5  # not the 10 s request timeout
    *tokens, error, done = events(text)
    assert tokens and "stopped answering" in error["error"]["message"] and done == "[DONE]"
    async with http.get(url_of(router, "/workers")) as resp:
        assert (await resp.json())["workers"][0]["stalled"] is True
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:  # no new work for it
        assert resp.status == 503 and "stalled" in (await resp.json())["error"]["message"]
    worker.thaw()
    await wait_until(lambda: router.routable()[0], what="the worker answers again")
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200
    await wait_until(lambda: worker.bodies()[0]["rid"] in worker.aborts, what="the stalled request aborted")


async def test_a_request_on_a_stalled_worker_is_retried_on_another(fake_workers, routers, http):
    stuck, good = await fake_workers("stuck"), await fake_workers("good")
    router = await routers(regular=[stuck.url, good.url], worker_stall_timeout_secs=STALL,
                           policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.REGULAR)) == 2)
    stuck.freeze()
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200 and (await resp.json())["text"] == "hello from good"
    assert len(stuck.requests) == 1 and router.workers.get(stuck.url, WorkerRole.REGULAR).stalled
    stuck.thaw()
    await wait_until(lambda: stuck.bodies()[0]["rid"] in stuck.aborts, what="the stalled request aborted")


async def test_a_decode_that_stalls_mid_stream_ends_the_stream_and_aborts_its_prefill(fake_workers, routers, http):
    prefill = await fake_workers("prefill", hang=True)  # its response stays open
    decode = await fake_workers("decode", stream_chunks=40, chunk_interval=0.05)
    router = await routers(prefill=[prefill.url], decode=[decode.url], worker_stall_timeout_secs=STALL)
    async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x", "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        decode.freeze()
        text = (first + await resp.read()).decode()
    *_, error, done = events(text)
    assert f"decode worker {decode.url} stopped answering" in error["error"]["message"] and done == "[DONE]"
    await wait_until(lambda: prefill.bodies()[0]["rid"] in prefill.aborts, what="the prefill aborted")
    decode.thaw()
    await wait_until(lambda: decode.bodies()[0]["rid"] in decode.aborts, what="the decode aborted")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_that_stalls_before_the_decode_took_over_is_replaced(fake_workers, routers, http, stream):
    """The decode already sent its stream's headers and keep-alives (as engines do at once), no event."""
    stuck, good = await fake_workers("stuck-prefill"), await fake_workers("good-prefill")
    decode = await fake_workers("decode", hang_first=1, headers_at_once=True)  # waits for KV that never comes
    router = await routers(prefill=[stuck.url, good.url], decode=[decode.url], worker_stall_timeout_secs=STALL,
                           policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.PREFILL)) == 2)
    stuck.freeze()
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": stream}) as resp:
        assert resp.status == 200
        body = await resp.read()
    if stream:
        assert body.startswith(b": keep-alive\n\n") and [e["text"] for e in events(body.decode())[:-1]] == \
            ["tok0", "tok1", "tok2"]
    else:
        assert orjson.loads(body)["text"] == "hello from decode"
    first, second = decode.bodies()
    assert first["rid"] in decode.aborts and second["bootstrap_room"] == good.bodies()[0]["bootstrap_room"]
    assert router.workers.get(stuck.url, WorkerRole.PREFILL).stalled
    stuck.thaw()
    await wait_until(lambda: first["rid"] in stuck.aborts, what="the stalled prefill aborted")


async def test_a_prefill_that_stalls_after_the_decode_took_over_leaves_the_stream_alone(fake_workers, routers,
                                                                                       http):
    prefill = await fake_workers("prefill", hang=True)  # its response stays open while the decode streams
    decode = await fake_workers("decode", stream_chunks=20, chunk_interval=0.05)
    router = await routers(prefill=[prefill.url], decode=[decode.url], worker_stall_timeout_secs=STALL)
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        prefill.freeze()
        await wait_until(lambda: router.workers.get(prefill.url, WorkerRole.PREFILL).stalled, what="stall seen")
        text = (first + await resp.read()).decode()
    assert "error" not in text and text.count("tok") == 20 and text.endswith("data: [DONE]\n\n")
    assert decode.bodies()[0]["rid"] not in decode.aborts
    prefill.thaw()
    await wait_until(lambda: decode.bodies()[0]["rid"] in prefill.aborts, what="the stalled prefill aborted")


async def test_a_sigstopped_worker_process(routers, http):
    """A real process stopped with SIGSTOP: its kernel keeps accepting connections, nothing answers."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("router_fake_worker.py")),
                             "--stream-chunks", "400", "--chunk-interval", "0.02"], stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), 30)
        url = line.decode().strip()
        router = await routers(regular=[url], worker_stall_timeout_secs=STALL, retry=RetryConfig(max_retries=1))
        async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
            first = await resp.content.readuntil(b"\n\n")
            os.kill(proc.pid, signal.SIGSTOP)
            text = (first + await resp.read()).decode()
        assert "stopped answering" in events(text)[-2]["error"]["message"]
        os.kill(proc.pid, signal.SIGCONT)
        await wait_until(lambda: router.routable()[0], what="the process answers again")
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)
