"""The PD flow against fake prefill and decode workers."""
import asyncio

import orjson
from router_support import make_config, url_of, wait_until

from baton.router.config import PolicyName, RetryConfig, WorkerRole
from baton.router.pd import merge_echo_logprobs

BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


async def pd_pair(fake_workers, routers, prefill_port=8998, **overrides):
    prefill = await fake_workers("prefill")
    decode = await fake_workers("decode")
    router = await routers(prefill=[(prefill.url, prefill_port)], decode=[decode.url], **overrides)
    return prefill, decode, router


async def test_both_sides_get_the_same_body_with_bootstrap_fields(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    async with http.post(url_of(router, "/v1/chat/completions"),
                         json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "hello from decode"
    (p_body,), (d_body,) = prefill.bodies(), decode.bodies()
    assert p_body == d_body
    assert p_body["bootstrap_host"] == "127.0.0.1" and p_body["bootstrap_port"] == 8998
    assert isinstance(p_body["bootstrap_room"], int) and 0 <= p_body["bootstrap_room"] < 2**63
    assert p_body["messages"] == [{"role": "user", "content": "hi"}] and p_body["rid"]


async def test_rooms_differ_per_request_and_port_may_be_null(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers, prefill_port=None)
    for _ in range(3):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    rooms = {b["bootstrap_room"] for b in prefill.bodies()}
    assert len(rooms) == 3 and all(b["bootstrap_port"] is None for b in prefill.bodies())


async def test_batches_carry_arrays(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    async with http.post(url_of(router, "/generate"), json={"text": ["a", "b", "c"]}) as resp:
        assert resp.status == 200
        assert len(await resp.json()) == 3
    body = decode.bodies()[0]
    assert body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert len(set(body["bootstrap_room"])) == 3 and len(body["rid"]) == 3


async def test_decode_stream_is_passed_through(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    decode.behavior.stream_chunks = 3
    async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x", "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    assert text.count("tok") == 3 and text.endswith("data: [DONE]\n\n")
    assert prefill.bodies()[0]["stream"] is True


async def test_generate_logprobs_are_merged_prefill_first(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    prefill.behavior.input_logprobs = [[-1.0, 1, None], [-2.0, 2, None]]
    decode.behavior.input_logprobs = [[-3.0, 3, None]]
    async with http.post(url_of(router, "/generate"), json={"text": "x", "return_logprob": True}) as resp:
        data = await resp.json()
    assert data["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None], [-2.0, 2, None], [-3.0, 3, None]]
    async with http.post(url_of(router, "/generate"), json={"text": ["x", "y"], "return_logprob": True}) as resp:
        batch = await resp.json()
    assert [len(item["meta_info"]["input_token_logprobs"]) for item in batch] == [3, 3]


async def test_streamed_generate_logprobs_are_merged_in_every_event(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    prefill.behavior.input_logprobs = [[-1.0, 1, None]]
    decode.behavior.input_logprobs = [[-3.0, 3, None]]
    body = {"text": "x", "return_logprob": True, "stream": True}
    async with http.post(url_of(router, "/generate"), json=body) as resp:
        text = (await resp.read()).decode()
    events = [orjson.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert len(events) == 3
    assert all(e["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None], [-3.0, 3, None]] for e in events)


def _completion(*choices: tuple) -> dict:
    """A /v1/completions answer; each choice (index, tokens, token_logprobs, top_logprobs)."""
    return {"object": "text_completion", "choices": [
        {"index": k, "text": "".join(tokens), "logprobs": {
            "tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": [len("".join(tokens[:i])) for i in range(len(tokens))]}}
        for k, tokens, lps, tops in choices]}


def test_echo_logprobs_fill_the_decodes_nulls_from_the_prefill():
    """A completion with echo: the decode lists the prompt's tokens with null logprobs, the prefill
    the same tokens with theirs and its first output token; each choice gets the prefill's values for
    its nulls. A decode listing only its output (as SGLang's) is left as it is."""
    prefill = _completion((0, ["a", "b", "X"], [None, -1.0, -2.0], [None, {"b": -1.0}, {"X": -2.0}]),
                          (1, ["c", "d", "Y"], [None, -3.0, -4.0], [None, {"d": -3.0}, {"Y": -4.0}]))
    decode = _completion((1, ["c", "d", "Y", "Z"], [None, None, -4.0, -5.0], [None, None, {"Y": -4.0}, {"Z": -5.0}]),
                         (0, ["a", "b", "X", "W"], [None, None, -2.0, -6.0], [None, None, {"X": -2.0}, {"W": -6.0}]))
    merged = merge_echo_logprobs(prefill, orjson.loads(orjson.dumps(decode)))
    by_index = {c["index"]: c["logprobs"] for c in merged["choices"]}
    assert by_index[0]["token_logprobs"] == [None, -1.0, -2.0, -6.0]
    assert by_index[0]["top_logprobs"] == [None, {"b": -1.0}, {"X": -2.0}, {"W": -6.0}]
    assert by_index[1]["token_logprobs"] == [None, -3.0, -4.0, -5.0]
    assert by_index[0]["text_offset"] == [0, 1, 2, 3] and by_index[0]["tokens"] == ["a", "b", "X", "W"]
    output_only = _completion((0, ["X", "W"], [-2.0, -6.0], [{"X": -2.0}, {"W": -6.0}]))
    assert merge_echo_logprobs(prefill, orjson.loads(orjson.dumps(output_only))) == output_only
    assert merge_echo_logprobs(None, decode) is decode and merge_echo_logprobs({"error": "x"}, decode) is decode


async def test_prefill_failure_gives_one_error_and_aborts_decode(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers, retry=RetryConfig(max_retries=1))
    prefill.behavior.status = 500
    decode.behavior.hang = True  # a real decode waits for KV that never comes
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 500
        assert "prefill says 500" in (await resp.json())["error"]["message"]
    rid = decode.bodies()[0]["rid"]
    await wait_until(lambda: rid in decode.aborts, what="decode aborted")
    assert prefill.aborts == []


async def test_a_streamed_prefill_refused_after_its_headers_is_a_prefill_failure(fake_workers, routers, http):
    """An engine sends a stream's headers at once; a refusal by its scheduler (queue full) then comes
    as an error event in a 200 stream. On the prefill that must count as the prefill's failure: the
    decode waiting for the KV is aborted at once, not left to its bootstrap timeout."""
    prefill, decode, router = await pd_pair(fake_workers, routers, retry=RetryConfig(max_retries=1))
    prefill.behavior.stream_error = 503
    decode.behavior.hang = True  # a real decode waits for KV that never comes
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        text = await resp.text()
    assert resp.status == 503 or '"code":503' in text.replace(" ", ""), (resp.status, text)
    assert "prefill refused it" in text
    rid = decode.bodies()[0]["rid"]
    await wait_until(lambda: rid in decode.aborts, what="decode aborted")


async def test_decode_failure_aborts_prefill(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers, retry=RetryConfig(max_retries=1))
    prefill.behavior.hang = True
    decode.behavior.status = 400
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 400
    rid = prefill.bodies()[0]["rid"]
    await wait_until(lambda: rid in prefill.aborts, what="prefill aborted")


async def test_retry_uses_a_new_pair_and_a_new_room(fake_workers, routers, http):
    bad = await fake_workers("bad-prefill", status=503)
    good = await fake_workers("good-prefill")
    decode = await fake_workers("decode", delay=0.2)  # a real decode answers after the KV arrived
    router = await routers(prefill=[bad.url, good.url], decode=[decode.url], policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.PREFILL)) == 2)
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200
    assert len(bad.requests) == 1 and len(good.requests) == 1 and len(decode.requests) == 2
    rooms = [b["bootstrap_room"] for b in decode.bodies()]
    assert rooms[0] != rooms[1]
    assert decode.bodies()[1]["bootstrap_room"] == good.bodies()[0]["bootstrap_room"]
    first, second = decode.bodies()
    assert first["rid"] in decode.aborts  # the first decode was told to stop
    assert second["rid"] != first["rid"] and second["rid"] == good.bodies()[0]["rid"]
    assert second["rid"] not in decode.aborts


async def test_client_disconnect_aborts_both_sides(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    prefill.behavior.hang = decode.behavior.hang = True
    request = asyncio.ensure_future(http.post(url_of(router, "/generate"), json={"text": "x"}))
    await wait_until(lambda: prefill.requests and decode.requests, what="both sides reached")
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    rid = decode.bodies()[0]["rid"]
    await wait_until(lambda: rid in prefill.aborts and rid in decode.aborts, what="both aborted")


async def test_pd_health_needs_both_sides(fake_workers, routers, http):
    prefill = await fake_workers("prefill")
    router = await routers(prefill=[prefill.url], decode=["http://127.0.0.1:9"], wait_ready=False,
                           retry=RetryConfig(max_retries=1))
    await wait_until(lambda: router.workers.routable(WorkerRole.PREFILL))
    async with http.get(url_of(router, "/health")) as resp:
        assert resp.status == 503 and "decode" in await resp.text()
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 503
    assert prefill.requests == []  # no pair, no half-sent request


async def test_pd_pairs_metric(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers)
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        await resp.read()
    assert f'baton_router_pd_pairs_total{{decode="{decode.url}",prefill="{prefill.url}"}} 1.0'.encode() \
        in router.metrics.render()


async def test_dp_aware_pd_pins_ranks_and_encodes_the_prefill_rank_in_the_room(fake_workers, routers, http):
    prefill = await fake_workers("prefill", dp_size=4)
    decode = await fake_workers("decode", dp_size=2)
    config = make_config(prefill=[prefill.url], decode=[decode.url], dp_aware=True, policy=PolicyName.ROUND_ROBIN)
    router = await routers(config)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.PREFILL)) == 4)
    for _ in range(8):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    p_bodies, d_bodies = prefill.bodies(), decode.bodies()
    assert [b["data_parallel_rank"] for b in p_bodies] == [0, 1, 2, 3] * 2
    assert [b["data_parallel_rank"] for b in d_bodies] == [0, 1] * 4
    assert all(b["bootstrap_room"] % 4 == b["data_parallel_rank"] for b in p_bodies)
    assert [b["bootstrap_room"] for b in p_bodies] == [b["bootstrap_room"] for b in d_bodies]
    assert b'baton_router_dp_rank_in_flight{dp_rank="3",side="prefill"' in router.metrics.render()


async def test_in_flight_counts_return_to_zero_after_success_failure_and_disconnect(fake_workers, routers, http):
    prefill, decode, router = await pd_pair(fake_workers, routers, retry=RetryConfig(max_retries=1))
    async with http.post(url_of(router, "/generate"), json={"text": "ok"}) as resp:
        assert resp.status == 200
    prefill.behavior.status = 500
    decode.behavior.delay = 0.2
    async with http.post(url_of(router, "/generate"), json={"text": "fails"}) as resp:
        assert resp.status == 500
    prefill.behavior.status, prefill.behavior.hang = 200, True
    request = asyncio.ensure_future(http.post(url_of(router, "/generate"), json={"text": "left"}))
    await wait_until(lambda: len(prefill.requests) == 3, what="third request reached the prefill")
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    targets = [t for w in router.workers.workers() for t in w.targets]
    await wait_until(lambda: all(t.in_flight == 0 for t in targets), what="in-flight back to zero")
    assert router.admission.in_flight == 0


async def test_a_prefill_that_dies_after_the_decode_took_over_leaves_the_stream_alone(fake_workers, routers, http):
    """The prefill's response was still open when it died; the decode was already streaming."""
    prefill, decode, router = await pd_pair(fake_workers, routers)
    prefill.behavior.hang = True  # its response stays open while the decode streams
    decode.behavior.stream_chunks, decode.behavior.chunk_interval = 6, 0.05
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        prefill.drop_connections()
        text = (first + await resp.read()).decode()
    assert "error" not in text and text.count("tok") == 6 and text.endswith("data: [DONE]\n\n")
    assert decode.bodies()[0]["rid"] not in decode.aborts
