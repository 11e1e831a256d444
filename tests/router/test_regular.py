"""The colocated flow against fake workers: proxying, streaming, retries, breakers, health, limits."""
import asyncio

import orjson
from baton_testing.raw_http import send_body_until_answered, talk
from router_support import make_config, url_of, wait_until

from baton.router.config import CircuitBreakerConfig, HealthCheckConfig, PolicyName, RetryConfig

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_chat_is_proxied_with_a_rid_added(fake_workers, routers, http):
    worker = await fake_workers("w1")
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/v1/chat/completions"), json=CHAT) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["choices"][0]["message"]["content"] == "hello from w1"
    (body,) = worker.bodies("/v1/chat/completions")
    assert body["messages"] == CHAT["messages"] and isinstance(body["rid"], str) and len(body["rid"]) == 32


async def test_client_rid_is_kept(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": "x", "rid": "mine"}) as resp:
        assert resp.status == 200
    assert worker.bodies()[0]["rid"] == "mine"


async def test_stream_is_passed_through_unchanged(fake_workers, routers, http):
    worker = await fake_workers(stream_chunks=4)
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x", "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 5 and events[-1] == "data: [DONE]"
    assert [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]


async def test_stream_chunks_arrive_before_the_stream_ends(fake_workers, routers, http):
    worker = await fake_workers(stream_chunks=3, chunk_interval=0.3)
    router = await routers(regular=[worker.url])
    loop = asyncio.get_running_loop()
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        started = loop.time()
        first = await resp.content.readuntil(b"\n\n")
        first_at = loop.time() - started
        await resp.read()
        total = loop.time() - started
    assert first.startswith(b"data: ") and first_at < total - 0.3  # not buffered until the end


async def test_round_robin_spreads_requests(fake_workers, routers, http):
    workers = [await fake_workers(f"w{i}") for i in range(3)]
    router = await routers(regular=[w.url for w in workers], policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(router.config.roles[0])) == 3)
    for _ in range(6):
        async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x"}) as resp:
            assert resp.status == 200
    assert [len(w.requests) for w in workers] == [2, 2, 2]


async def test_retry_goes_to_another_worker_on_503(fake_workers, routers, http):
    bad = await fake_workers("bad", status=503)
    good = await fake_workers("good")
    router = await routers(regular=[bad.url, good.url], policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(router.config.roles[0])) == 2)
    for _ in range(4):
        async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == "hello from good"
    assert len(bad.requests) >= 1 and len(good.requests) == 4
    assert router.metrics.registry.get_sample_value("baton_router_retries_total", {"route": "/v1/completions"}) >= 1


async def test_retry_on_one_worker_until_it_recovers(fake_workers, routers, http):
    worker = await fake_workers(fail_first=2, fail_status=429)
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200
    assert len(worker.requests) == 3
    rids = {b["rid"] for b in worker.bodies()}
    assert len(rids) == 3  # each attempt its own id: the worker may still hold a failed attempt's


async def test_a_clients_rid_is_kept_and_suffixed_on_retries(fake_workers, routers, http):
    worker = await fake_workers(fail_first=2, fail_status=503)
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": ["x", "y"], "rid": ["a", "b"]}) as resp:
        assert resp.status == 200
    assert [b["rid"] for b in worker.bodies()] == [["a", "b"], ["a-retry2", "b-retry2"], ["a-retry3", "b-retry3"]]


async def test_non_retryable_error_is_passed_through(fake_workers, routers, http):
    worker = await fake_workers(status=400)
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 400
        assert "says 400" in (await resp.json())["error"]["message"]
    assert len(worker.requests) == 1


async def test_retries_exhausted_gives_the_last_error(fake_workers, routers, http):
    worker = await fake_workers(status=503)
    router = await routers(regular=[worker.url], retry=RetryConfig(max_retries=3, initial_backoff_ms=1))
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 503
    assert len(worker.requests) == 3


async def test_unreachable_worker_is_a_502_after_retries(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    await worker.stop()
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 502
        assert "failed" in (await resp.json())["error"]["message"]


async def test_circuit_breaker_opens_and_closes_again(fake_workers, routers, http):
    flaky = await fake_workers("flaky", status=500)
    good = await fake_workers("good")
    config = make_config(regular=[flaky.url, good.url], policy=PolicyName.ROUND_ROBIN,
                         retry=RetryConfig(max_retries=1),
                         circuit_breaker=CircuitBreakerConfig(failure_threshold=2, success_threshold=1,
                                                              timeout_secs=1.0))
    router = await routers(config)
    await wait_until(lambda: len(router.workers.routable(config.roles[0])) == 2)
    for _ in range(4):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            await resp.read()
    flaky_worker = router.workers.get(flaky.url, config.roles[0])
    assert not flaky_worker.breaker.allows()
    seen = len(flaky.requests)
    for _ in range(4):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    assert len(flaky.requests) == seen  # open: no traffic
    assert b'baton_router_circuit_breaker_state{side="regular",worker="%s"} 1.0' % flaky.url.encode() \
        in router.metrics.render()
    flaky.behavior.status = 200
    await wait_until(lambda: len(router.workers.routable(config.roles[0])) == 2, what="half-open")
    for _ in range(4):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    assert len(flaky.requests) > seen and flaky_worker.breaker.state.name == "CLOSED"


async def test_health_checks_take_a_worker_out_and_back(fake_workers, routers, http):
    sick = await fake_workers("sick")
    good = await fake_workers("good")
    health = HealthCheckConfig(interval_secs=0.05, failure_threshold=2, success_threshold=2,
                               startup_check_interval_secs=0.02)
    router = await routers(regular=[sick.url, good.url], health=health, policy=PolicyName.ROUND_ROBIN)
    role = router.config.roles[0]
    await wait_until(lambda: len(router.workers.routable(role)) == 2)
    sick.behavior.healthy = False
    await wait_until(lambda: len(router.workers.routable(role)) == 1, what="sick worker removed")
    before = len(sick.requests)
    for _ in range(3):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    assert len(sick.requests) == before
    assert b'baton_router_worker_healthy{side="regular",worker="%s"} 0.0' % sick.url.encode() in router.metrics.render()
    sick.behavior.healthy = True
    await wait_until(lambda: len(router.workers.routable(role)) == 2, what="sick worker back")


async def test_no_healthy_workers_is_503(fake_workers, routers, http):
    worker = await fake_workers(healthy=False)
    router = await routers(regular=[worker.url], wait_ready=False, retry=RetryConfig(max_retries=1))
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 503
        assert "no healthy regular workers" in (await resp.json())["error"]["message"]
    async with http.get(url_of(router, "/health")) as resp:
        assert resp.status == 503
    async with http.get(url_of(router, "/liveness")) as resp:
        assert resp.status == 200


async def test_request_timeout_is_504_and_aborts_the_worker(fake_workers, routers, http):
    worker = await fake_workers(hang=True)
    router = await routers(regular=[worker.url], request_timeout_secs=0.3)
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 504
    rid = worker.bodies()[0]["rid"]
    await wait_until(lambda: worker.aborts == [rid], what="abort sent")


async def test_client_disconnect_aborts_the_worker(fake_workers, routers, http):
    worker = await fake_workers(hang=True)
    router = await routers(regular=[worker.url])
    request = asyncio.ensure_future(http.post(url_of(router, "/v1/chat/completions"), json=CHAT))
    await wait_until(lambda: worker.requests, what="request reached the worker")
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    rid = worker.bodies()[0]["rid"]
    await wait_until(lambda: rid in worker.aborts, what="abort after disconnect")
    await wait_until(lambda: router.admission.in_flight == 0, what="slot released")


async def test_client_disconnect_mid_stream_aborts_the_worker(fake_workers, routers, http):
    worker = await fake_workers(stream_chunks=50, chunk_interval=0.05)
    router = await routers(regular=[worker.url])
    resp = await http.post(url_of(router, "/generate"), json={"text": "x", "stream": True})
    await resp.content.readuntil(b"\n\n")
    resp.close()
    rid = worker.bodies()[0]["rid"]
    await wait_until(lambda: rid in worker.aborts, what="abort after mid-stream disconnect")


async def test_worker_breaking_off_a_stream_ends_it_with_an_error_event(fake_workers, routers, http):
    worker = await fake_workers(stream_chunks=5, break_stream_after=2)
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert text.count("tok") == 2 and '"error"' in text and text.endswith("data: [DONE]\n\n")


async def test_a_stream_broken_off_before_its_first_event_is_retried_on_the_started_stream(fake_workers, routers,
                                                                                          http):
    """Engines send a stream's headers (and keep-alives) at once; until the first event the client
    has seen nothing a retry could contradict."""
    broken = await fake_workers("broken", headers_at_once=True, break_stream_after=0)
    good = await fake_workers("good", headers_at_once=True)
    router = await routers(regular=[broken.url, good.url], policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(router.config.roles[0])) == 2)
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert "error" not in text and text.count("tok") == 3 and text.endswith("data: [DONE]\n\n")
    assert len(broken.requests) == 1 and len(good.requests) == 1


async def test_bad_input_is_400_and_never_reaches_workers(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    for path, body in [("/v1/chat/completions", b"{oops"), ("/v1/chat/completions", b'{"model": "m"}'),
                       ("/v1/completions", b'{"prompt": {"a": 1}}'), ("/generate", b"[]"), ("/generate", b"")]:
        async with http.post(url_of(router, path), data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, (path, body)
            assert (await r.json())["error"]["message"]
    assert worker.requests == []
    async with http.post(url_of(router, "/generate"), json={"text": "still fine"}) as resp:
        assert resp.status == 200


async def test_body_size_limit_is_413(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url], max_payload_size=1000)
    async with http.post(url_of(router, "/generate"), json={"text": "x" * 2000}) as resp:
        assert resp.status == 413
    async with http.post(url_of(router, "/generate"), json={"text": "x" * 100}) as resp:
        assert resp.status == 200


async def test_full_queue_is_429(fake_workers, routers, http):
    worker = await fake_workers(delay=1.0)  # long enough for all three to arrive on a busy machine
    router = await routers(regular=[worker.url], max_concurrent_requests=1, queue_size=1)
    calls = [asyncio.ensure_future(http.post(url_of(router, "/generate"), json={"text": str(i)})) for i in range(3)]
    responses = await asyncio.gather(*calls)
    statuses = sorted(r.status for r in responses)
    for r in responses:
        r.release()
    assert statuses == [200, 200, 429]


async def _raw_post(router, path: str, header: bytes, body: bytes) -> bytes:
    """POST with a header line as raw bytes (no client library sends bytes that are not UTF-8); the
    response's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), header, len(body), body))
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


async def test_a_body_is_read_within_its_limits(fake_workers, routers, http):
    """A chunked body past --max-payload-size is a 413 as it arrives (it never ends here), one that
    stalls mid-body a 408 after --request-read-timeout-secs (on the worker API too); the router serves
    on and no worker saw any of them."""
    worker = await fake_workers()
    router = await routers(regular=[worker.url], max_payload_size=1 << 20, request_read_timeout_secs=1.0)
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    status, sent = await asyncio.to_thread(send_body_until_answered, router.port, chunked, [chunk] * 64, 10)
    assert status == b"HTTP/1.1 413 Request Entity Too Large", (status, sent)  # the body never ends
    for path in ("/v1/chat/completions", "/workers"):
        head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" % path.encode()
        status, _ = await asyncio.to_thread(send_body_until_answered, router.port, head, [b'{"a'], 10)
        assert status == b"HTTP/1.1 408 Request Timeout", (path, status)
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200
    assert len(worker.requests) == 1


async def test_a_connection_that_does_not_send_its_first_head_in_time_is_closed(fake_workers, routers, http):
    """aiohttp waits for a connection's first head as long as the client likes (slowloris); the router
    closes a connection whose first head has not all come within --request-read-timeout-secs (1 s here):
    nothing sent, half a head, a head split across writes; one that comes in time is served, and so
    is the next request on that connection (its later heads are aiohttp's keep-alive timeout's)."""
    worker = await fake_workers()
    router = await routers(regular=[worker.url], request_read_timeout_secs=1.0)

    stalls = ([], [b"GET /health HTTP/1.1\r\nHost: x\r\n"], [b"GET /health HTTP/1.1\r\n", b"Host: x\r\n\r"])
    for parts in stalls:
        took, got = await asyncio.to_thread(talk, router.port, parts, 0.1)
        assert 0.9 < took < 10 and got == b"", (parts, took, got)
    ask = b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /liveness HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    took, got = await asyncio.to_thread(talk, router.port, [ask[:10], ask[10:], ask, ask + last], 0.7)
    assert got.count(b"HTTP/1.1 200") == 4 and took > 2, got  # one connection, past the deadline: served
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200


async def test_api_key_is_required_when_set(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url], api_key="s3cret")
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 401
    async with http.post(url_of(router, "/generate"), json={"text": "x"},
                         headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
    async with http.get(url_of(router, "/workers")) as resp:
        assert resp.status == 401
    async with http.post(url_of(router, "/generate"), json={"text": "x"},
                         headers={"Authorization": "Bearer s3cret"}) as resp:
        assert resp.status == 200
    async with http.get(url_of(router, "/health")) as resp:  # probes stay open
        assert resp.status == 200
    assert worker.requests[0][1]["text"] == "x"
    # a key that is not UTF-8 (a client library's raw bytes) is a wrong key: 401, not a 500
    status_line = await _raw_post(router, "/generate", b"Authorization: Bearer \xff\xfes3cret", b'{"text":"x"}')
    assert status_line.split()[1] == b"401", status_line
    assert len(worker.requests) == 1


async def test_a_forwarded_header_that_is_not_ascii_stays_behind(fake_workers, routers):
    """X-Request-Id, traceparent, tracestate and a client's key go on to the worker when they are printable
    ASCII; raw bytes in one (an id some client made up) are dropped, the request served (it was a 500)."""
    from types import SimpleNamespace

    from baton.router.forward import forward_headers

    sent = SimpleNamespace(headers={"x-request-id": "r\udcff", "traceparent": "00-ab-cd-01"})  # as aiohttp keeps them
    assert forward_headers(sent) == {"traceparent": "00-ab-cd-01"}
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    status_line = await _raw_post(router, "/v1/completions", b"X-Request-Id: \xff\xfe",
                                  b'{"prompt": "x", "max_tokens": 1}')
    assert status_line.split()[1] == b"200", status_line
    assert worker.bodies("/v1/completions")[0]["prompt"] == "x"


async def test_the_engines_key_replaces_the_clients_on_every_call_to_a_worker(fake_workers, routers, http):
    """--engine-api-key: relays, info routes, /health_generate, the DP-size probe (dp-aware) and aborts all
    carry the engines' key; the client's own key never reaches a worker."""
    worker = await fake_workers(api_key="engine-s3cret")
    router = await routers(regular=[worker.url], api_key="client-s3cret", engine_api_key="engine-s3cret", dp_aware=True,
                           request_timeout_secs=0.5)
    auth = {"Authorization": "Bearer client-s3cret"}
    async with http.post(url_of(router, "/generate"), json={"text": "x"}, headers=auth) as resp:
        assert resp.status == 200
    for path in ("/v1/models", "/get_server_info", "/health_generate"):
        async with http.get(url_of(router, path), headers=auth) as resp:
            assert resp.status == 200, path
    worker.behavior.hang = True
    async with http.post(url_of(router, "/generate"), json={"text": "y"}, headers=auth) as resp:
        assert resp.status == 504
    await wait_until(lambda: worker.aborts == [worker.bodies()[1]["rid"]], what="abort sent")
    assert worker.refused == []
    assert "s3cret" not in repr(router.config)  # never logged


async def test_a_worker_refusing_the_routers_credentials_is_a_clear_error_at_once(fake_workers, routers, http):
    """A router without the engines' key: a 502 that says which flag is missing (an engine's 401 passed on
    would read as a refusal of the client's key), not retried, and the worker is not counted as failing."""
    worker = await fake_workers(api_key="internal")
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/v1/chat/completions"), json=CHAT) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert worker.url in error["message"] and "--engine-api-key" in error["message"], error
    assert "invalid or missing API key" in error["message"]
    assert worker.refused == ["/v1/chat/completions"]
    assert router.routable()[0]


async def test_info_routes_and_health_generate(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    async with http.get(url_of(router, "/v1/models")) as resp:
        assert (await resp.json())["data"][0]["id"] == "fake-model"
    async with http.get(url_of(router, "/get_model_info")) as resp:
        assert (await resp.json())["is_generation"] is True
    async with http.get(url_of(router, "/health_generate")) as resp:
        assert resp.status == 200
    worker.behavior.healthy = False
    async with http.get(url_of(router, "/health_generate")) as resp:
        assert resp.status == 503


async def test_metrics_cover_requests_latency_and_workers(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        await resp.read()
    async with http.post(url_of(router, "/generate"), data=b"nope") as resp:
        assert resp.status == 400
    async with http.get(url_of(router, "/metrics")) as resp:
        text = await resp.text()
    for needle in ['baton_router_requests_total{route="/generate"} 2.0',
                   'baton_router_errors_total{reason="bad_request",route="/generate"} 1.0',
                   'baton_router_ttft_seconds_count{route="/generate"} 1.0',
                   'baton_router_request_duration_seconds_count{route="/generate"} 2.0',
                   f'baton_router_worker_requests_total{{route="/generate",side="regular",worker="{worker.url}"}} 1.0',
                   f'baton_router_worker_in_flight{{side="regular",worker="{worker.url}"}} 0.0',
                   'baton_router_policy_decisions_total{policy="cache_aware",reason="cache_hit",side="regular"} 1.0',
                   "baton_router_in_flight_requests 0.0", "baton_router_queue_depth 0.0",
                   # reasons known in advance start at 0, so an alert on increase() sees the first one
                   'baton_router_errors_total{reason="stalled",route="/generate"} 0.0',
                   f'baton_router_worker_errors_total{{reason="stalled",side="regular",worker="{worker.url}"}} 0.0']:
        assert needle in text, needle
