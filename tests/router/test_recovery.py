"""Coming back after a worker restart, and saying why no worker may take a request (issue 37, item 5)."""
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
