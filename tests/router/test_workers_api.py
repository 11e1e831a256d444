"""Runtime worker management and DP-aware colocated routing."""
from router_support import make_config, url_of, wait_until

from baton.router.config import PolicyName, WorkerRole


async def test_add_list_remove_workers_at_runtime(fake_workers, routers, http):
    first = await fake_workers("first")
    second = await fake_workers("second")
    router = await routers(regular=[first.url], policy=PolicyName.ROUND_ROBIN)
    async with http.post(url_of(router, "/workers"), json={"url": second.url}) as resp:
        assert resp.status == 201
    async with http.post(url_of(router, "/workers"), json={"url": second.url}) as resp:
        assert resp.status == 409
    await wait_until(lambda: len(router.workers.routable(WorkerRole.REGULAR)) == 2, what="new worker healthy")
    async with http.get(url_of(router, "/workers")) as resp:
        listed = await resp.json()
    assert sorted(listed["urls"]) == sorted([first.url, second.url])
    assert {w["source"] for w in listed["workers"]} == {"static", "api"}
    for _ in range(4):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    assert len(second.requests) == 2
    async with http.delete(url_of(router, "/workers"), params={"url": first.url}) as resp:
        assert resp.status == 200
    async with http.delete(url_of(router, "/workers"), params={"url": first.url}) as resp:
        assert resp.status == 404
    for _ in range(2):
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert resp.status == 200
    assert len(first.requests) == 2 and len(second.requests) == 4


async def test_sglang_style_worker_routes(fake_workers, routers, http):
    worker = await fake_workers()
    router = await routers(wait_ready=False)
    async with http.post(url_of(router, "/add_worker"), params={"url": worker.url}) as resp:
        assert resp.status == 201
    await wait_until(lambda: router.routable()[0])
    async with http.get(url_of(router, "/list_workers")) as resp:
        assert (await resp.json())["urls"] == [worker.url]
    async with http.post(url_of(router, "/remove_worker"), params={"url": worker.url}) as resp:
        assert resp.status == 200
    assert router.workers.workers() == []


async def test_pd_workers_need_a_role(fake_workers, routers, http):
    prefill = await fake_workers("p")
    decode = await fake_workers("d")
    router = await routers(make_config(prefill=[prefill.url], decode=[decode.url]))
    async with http.post(url_of(router, "/workers"), json={"url": "http://127.0.0.1:1"}) as resp:
        assert resp.status == 400 and "role" in (await resp.json())["error"]["message"]
    async with http.post(url_of(router, "/workers"),
                         json={"url": "http://127.0.0.1:1", "worker_type": "prefill", "bootstrap_port": 9000}) as resp:
        assert resp.status == 201
        assert (await resp.json())["bootstrap_port"] == 9000
    async with http.post(url_of(router, "/workers"), json={"url": "http://127.0.0.1:1", "role": "regular"}) as resp:
        assert resp.status == 400
    async with http.post(url_of(router, "/workers"), data=b"[1]") as resp:
        assert resp.status == 400


async def test_dp_aware_regular_targets_every_rank(fake_workers, routers, http):
    worker = await fake_workers(dp_size=3)
    legacy = await fake_workers("legacy", dp_size=None)  # no dp_size reported: one rank
    router = await routers(regular=[worker.url, legacy.url], dp_aware=True, policy=PolicyName.ROUND_ROBIN)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.REGULAR)) == 4, what="3 + 1 ranks")
    for _ in range(8):
        async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x"}) as resp:
            assert resp.status == 200
    assert sorted(b["data_parallel_rank"] for b in worker.bodies()) == [0, 0, 1, 1, 2, 2]
    assert [b["data_parallel_rank"] for b in legacy.bodies()] == [0, 0]


async def test_removing_a_worker_drops_its_cache_aware_entries(fake_workers, routers, http):
    first = await fake_workers("first")
    second = await fake_workers("second")
    router = await routers(regular=[first.url, second.url], policy=PolicyName.CACHE_AWARE)
    await wait_until(lambda: len(router.workers.routable(WorkerRole.REGULAR)) == 2)
    for prompt in ("alpha " * 10, "bravo " * 10):
        async with http.post(url_of(router, "/v1/completions"), json={"prompt": prompt}) as resp:
            assert resp.status == 200
    tree = router.dispatcher.policies[WorkerRole.REGULAR].tree
    assert sorted(tree.tenants()) == sorted([first.url, second.url])
    async with http.delete(url_of(router, f"/workers/{first.url}")) as resp:
        assert resp.status == 200
    assert tree.tenants() == [second.url]


async def test_workers_are_routable_at_once_without_health_checks(fake_workers, routers, http):
    from baton.router.config import HealthCheckConfig
    worker = await fake_workers()
    router = await routers(regular=[worker.url], health=HealthCheckConfig(enabled=False), wait_ready=False)
    assert router.routable()[0]
    async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
        assert resp.status == 200
    assert worker.health_checks == 0
