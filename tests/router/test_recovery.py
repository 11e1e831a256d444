"""Coming back after a worker restart, and saying why no worker may take a request."""
from router_support import url_of, wait_until

from baton.router.circuit_breaker import BreakerState
from baton.router.config import CircuitBreakerConfig, RetryConfig, WorkerRole

ONE_FAILURE_OPENS = CircuitBreakerConfig(failure_threshold=1, success_threshold=1, timeout_secs=60.0)


async def test_503_names_the_open_breakers_not_health(fake_workers, routers, http):
    prefill = await fake_workers("prefill", status=500)  # answers /health, fails its requests
    decode = await fake_workers("decode", hang=True)  # a real decode waits for the KV
    router = await routers(prefill=[prefill.url], decode=[decode.url], circuit_breaker=ONE_FAILURE_OPENS,
                           retry=RetryConfig(max_retries=1))
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 500
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
    assert message.startswith("all prefill workers have open circuit breakers") and prefill.url in message
    async with http.get(url_of(router, "/health")) as resp:
        assert resp.status == 503 and "circuit breaker" in await resp.text()
    async with http.get(url_of(router, "/workers")) as resp:
        (listed,) = [w for w in (await resp.json())["workers"] if w["role"] == "prefill"]
    assert listed["healthy"] and listed["circuit_breaker"] == "open"
    # its probes pass while its requests fail: the probes say nothing new, the breaker waits its timeout
    seen = prefill.health_checks
    await wait_until(lambda: prefill.health_checks >= seen + 3, what="three more probes")
    assert router.workers.get(prefill.url, WorkerRole.PREFILL).breaker.state is BreakerState.OPEN


async def test_a_restarted_worker_is_served_again_at_its_first_answered_probe(fake_workers, routers, http):
    """The breaker opened while the worker was down; waiting out its 60 s timeout kept a working
    worker idle (the 503 then also said "no healthy workers" while /workers said healthy)."""
    worker = await fake_workers("w1")
    router = await routers(regular=[worker.url], circuit_breaker=ONE_FAILURE_OPENS, retry=RetryConfig(max_retries=1))
    port = worker.port
    await worker.stop()
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 502
    registered = router.workers.get(worker.url, WorkerRole.REGULAR)
    assert registered.breaker.state is BreakerState.OPEN and registered.healthy
    restarted = await fake_workers("w1-restarted", port=port)
    await wait_until(lambda: router.routable()[0], what="breaker half-open after the restart")
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200 and (await resp.json())["text"] == "hello from w1-restarted"
    assert registered.breaker.state is BreakerState.CLOSED


async def test_a_draining_worker_is_out_at_its_first_refusal_and_back_when_ready(fake_workers, routers, http):
    """An engine that drains (SIGTERM, /drain) refuses with 503 + error type draining: the request goes to
    another worker, the draining one gets no other (its breaker does not count it), and it is routable
    again once its /health answers 200 (a restarted static worker)."""
    draining, other = await fake_workers("w1"), await fake_workers("w2")
    router = await routers(regular=[draining.url, other.url], policy="round_robin")
    draining.behavior.draining = True  # SIGTERM, between two health probes
    for _ in range(4):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200 and (await resp.json())["text"] == "hello from w2"
    assert len(draining.requests) == 1 and len(other.requests) == 4
    async with http.get(url_of(router, "/workers")) as resp:
        listed = {w["url"]: w for w in (await resp.json())["workers"]}
    assert listed[draining.url]["draining"] is True and listed[draining.url]["circuit_breaker"] == "closed"
    draining.behavior.draining = False
    worker = router.workers.get(draining.url, WorkerRole.REGULAR)
    await wait_until(lambda: not worker.draining, what="the worker back once /health answers 200")
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp2:
            texts = {(await resp.json())["text"], (await resp2.json())["text"]}
    assert texts == {"hello from w1", "hello from w2"}
