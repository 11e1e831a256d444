"""Fleet operations through the router against fake workers: control routes fanned out to every worker
with the engines' admin key, one answer naming the workers that failed, the weight-update sequence
(drain, pause, update, continue) with requests held at the router meanwhile, the router's own pause;
embeddings forwarded to colocated workers; sessions pinned to one worker."""
import asyncio

import pytest
from router_support import make_config, url_of, wait_until

from baton.router.config import CircuitBreakerConfig, WorkerRole
from baton.router.request import BadRequest, Route, parse_request
from baton.router.sessions import pinned_worker


def paths(worker) -> list[str]:
    return [path for path, _, _ in worker.controls]


async def pd_fleet(fake_workers, routers, **overrides):
    prefill, decode = await fake_workers("p"), await fake_workers("d")
    router = await routers(make_config(prefill=[prefill.url], decode=[decode.url], **overrides))
    return router, prefill, decode


async def test_control_routes_reach_every_worker_with_the_admin_key(fake_workers, routers, http):
    router, prefill, decode = await pd_fleet(fake_workers, routers, api_key="router-key",
                                             engine_admin_api_key="admin-key")
    async with http.post(url_of(router, "/flush_cache")) as resp:
        assert resp.status == 401  # the router's own key first
    auth = {"Authorization": "Bearer router-key"}
    lora = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    async with http.post(url_of(router, "/load_lora_adapter"), json=lora, headers=auth) as resp:
        answer = await resp.json()
        assert resp.status == 200 and answer["success"], answer
    assert {(w["url"], w["role"], w["status"]) for w in answer["workers"]} == {
        (prefill.url, "prefill", 200), (decode.url, "decode", 200)}
    for path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/unload_lora_adapter"):
        async with http.post(url_of(router, path), json={}, headers=auth) as resp:
            assert resp.status == 200, await resp.text()
    for worker in (prefill, decode):
        assert worker.controls[0] == ("/load_lora_adapter", lora, "Bearer admin-key")
        assert paths(worker)[1:] == ["/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
                                     "/unload_lora_adapter"]
        assert {auth for _, _, auth in worker.controls} == {"Bearer admin-key"}
    async with http.get(url_of(router, "/get_weight_version"), headers=auth) as resp:
        assert (await resp.json())["weight_version"] == "default"


async def test_the_workers_that_failed_are_named_with_status_and_message(fake_workers, routers, http):
    router, prefill, decode = await pd_fleet(fake_workers, routers)
    decode.behavior.control_status["/load_lora_adapter"] = 400
    async with http.post(url_of(router, "/load_lora_adapter"), json={"lora_name": "x"}) as resp:
        answer = await resp.json()
    assert resp.status == 400 and answer["success"] is False  # the worker's 4xx: the client's fault
    assert answer["message"] == (f"load_lora_adapter failed on 1 of 2 workers: decode {decode.url}: "
                                 "400: d refuses /load_lora_adapter")
    await prefill.stop()  # gone: no answer at all
    async with http.post(url_of(router, "/flush_cache")) as resp:
        answer = await resp.json()
    assert resp.status == 502 and f"prefill {prefill.url}: no answer" in answer["message"], answer
    assert [w["status"] for w in answer["workers"]] == [None, 200]


async def test_a_weight_update_drains_pauses_updates_and_continues_with_new_requests_held(
        fake_workers, routers, http):
    router, prefill, decode = await pd_fleet(fake_workers, routers)
    decode.behavior.delay = 0.3  # a request in flight when the update comes

    async def generate() -> dict:
        async with http.post(url_of(router, "/generate"), json={"text": "hi"}) as resp:
            assert resp.status == 200
            return await resp.json()

    before = asyncio.ensure_future(generate())
    await wait_until(lambda: "start /generate" in decode.log, what="a request in flight")
    update = asyncio.ensure_future(http.post(url_of(router, "/update_weights_from_disk"),
                                             json={"model_path": "/new", "weight_version": "v1"}))
    await wait_until(lambda: router.dispatcher.gate.closed_for, what="the gate closed")
    after = asyncio.ensure_future(generate())  # waits at the router until the update is done
    async with await update as resp:
        answer = await resp.json()
    assert resp.status == 200 and answer["success"], answer
    assert answer["weight_version"] == "v1" and answer["requests_in_flight_at_pause"] == 0
    assert answer["weight_versions"] == {prefill.url: "v1", decode.url: "v1"}
    assert answer["num_paused_requests"] == 2 and len(answer["workers"]) == 2
    assert (await before)["meta_info"]["weight_version"] == "default"
    assert (await after)["meta_info"]["weight_version"] == "v1"
    sequence = ["start /generate", "end /generate", "/pause_generation", "/update_weights_from_disk",
                "/continue_generation", "/get_weight_version", "start /generate", "end /generate"]
    assert decode.log == sequence and prefill.log == sequence
    assert decode.controls[0][1] == {"mode": "abort"}
    assert decode.controls[1][1] == {"model_path": "/new", "weight_version": "v1"}  # the client's body as sent


async def test_requests_that_outlast_the_drain_are_paused_in_abort_mode(fake_workers, routers, http):
    worker = await fake_workers("w", delay=0.5)
    router = await routers(regular=[worker.url], weight_update_drain_secs=0.05)
    request = asyncio.ensure_future(http.post(url_of(router, "/generate"), json={"text": "hi"}))
    await wait_until(lambda: worker.log, what="a request in flight")
    async with http.post(url_of(router, "/update_weights_from_disk"), json={"model_path": "/new"}) as resp:
        answer = await resp.json()
    assert answer["requests_in_flight_at_pause"] == 1
    assert worker.log[:2] == ["start /generate", "/pause_generation"]
    (await request).release()


async def test_a_failed_pause_is_undone_and_nothing_is_updated(fake_workers, routers, http):
    first, second = await fake_workers("first"), await fake_workers("second")
    second.behavior.control_status["/pause_generation"] = 500
    router = await routers(regular=[first.url, second.url])
    async with http.post(url_of(router, "/update_weights_from_disk"), json={"model_path": "/new"}) as resp:
        answer = await resp.json()
    assert resp.status == 502 and not answer["success"]
    assert answer["message"].startswith("pause_generation before the update (nothing was updated) failed on 1 of 2")
    assert paths(first) == ["/pause_generation", "/continue_generation"] and paths(second) == ["/pause_generation"]
    assert not router.dispatcher.gate.closed_for
    async with http.post(url_of(router, "/generate"), json={"text": "hi"}) as resp:
        assert resp.status == 200


async def test_the_routers_pause_holds_requests_until_its_continue(fake_workers, routers, http):
    worker = await fake_workers("w")
    router = await routers(regular=[worker.url])
    async with http.post(url_of(router, "/pause_generation"), json={"mode": "retract"}) as resp:
        assert resp.status == 200 and router.fleet.paused_mode == "retract"
    held = asyncio.ensure_future(http.post(url_of(router, "/generate"), json={"text": "hi"}))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(held), 0.2)
    assert worker.requests == []
    # an update while paused only updates: the client continues
    async with http.post(url_of(router, "/update_weights_from_disk"), json={"model_path": "/new"}) as resp:
        assert resp.status == 200
    assert paths(worker) == ["/pause_generation", "/update_weights_from_disk", "/get_weight_version"]
    async with http.post(url_of(router, "/continue_generation")) as resp:
        assert resp.status == 200
    async with await held as resp:
        assert (await resp.json())["meta_info"]["weight_version"] == "updated"
    assert worker.controls[0][1] == {"mode": "retract"}


async def test_a_prefill_aborted_before_the_decode_took_over_is_retried(fake_workers, routers, http):
    """A pause in abort mode ends the prefill's request with a 200 (finish_reason abort): its KV never
    comes, so the decode waiting for it is aborted and the request goes again."""
    prefill, decode = await fake_workers("p", abort_first=1), await fake_workers("d", hang_first=1)
    # one counted failure would open the prefill's breaker: an abort it was told to do is not one
    router = await routers(make_config(prefill=[prefill.url], decode=[decode.url],
                                       circuit_breaker=CircuitBreakerConfig(failure_threshold=1)))
    async with http.post(url_of(router, "/generate"), json={"text": "hi"}) as resp:
        answer = await resp.json()
    assert resp.status == 200 and answer["meta_info"]["finish_reason"] == {"type": "stop"}
    first_rid = prefill.bodies()[0]["rid"]
    assert decode.aborts == [first_rid] and len(decode.requests) == 2


async def test_tensor_and_group_updates_are_refused_with_the_reason(fake_workers, routers, http):
    worker = await fake_workers("w")
    router = await routers(regular=[worker.url])
    for path in ("/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed"):
        async with http.post(url_of(router, path), json={}) as resp:
            assert resp.status == 400 and "post it to each engine" in (await resp.json())["error"]["message"]
    async with http.post(url_of(router, "/update_weights_from_disk"), data=b"[1]") as resp:
        assert resp.status == 400 and worker.controls == []


async def test_embeddings_go_to_colocated_workers_and_pd_refuses_them(fake_workers, routers, http):
    worker = await fake_workers("w")
    router = await routers(regular=[worker.url])
    for path in ("/v1/embeddings", "/encode", "/classify"):
        body = {"input": ["a", "b"]} if path == "/v1/embeddings" else {"text": "a"}
        async with http.post(url_of(router, path), json=body) as resp:
            answer = await resp.json()
        assert resp.status == 200 and answer["worker"] == "w"
    assert len(worker.bodies("/v1/embeddings")[0]["rid"]) == 2  # one id per input, for aborts
    async with http.post(url_of(router, "/encode"), json={"input": "a"}) as resp:
        assert resp.status == 400
    pd_router, _, _ = await pd_fleet(fake_workers, routers)
    async with http.post(url_of(pd_router, "/v1/embeddings"), json={"input": "a"}) as resp:
        assert resp.status == 400 and "colocated" in (await resp.json())["error"]["message"]


async def test_a_sessions_calls_all_reach_the_worker_that_holds_it(fake_workers, routers, http):
    workers = [await fake_workers(f"w{i}") for i in range(3)]
    router = await routers(regular=[w.url for w in workers])
    await wait_until(lambda: len(router.workers.routable(WorkerRole.REGULAR)) == 3, what="all healthy")
    async with http.post(url_of(router, "/open_session"), json={"capacity_of_str_len": 100}) as resp:
        session = await resp.json()
    assert resp.status == 200 and isinstance(session, str)
    (holder,) = [w for w in workers if w.controls]
    for turn in range(4):
        params = {"id": session, "rid": f"turn{turn - 1}"} if turn else {"id": session}
        async with http.post(url_of(router, "/generate"), json={"text": "hi", "session_params": params}) as resp:
            assert (await resp.json())["meta_info"]["worker"] == holder.name
    async with http.post(url_of(router, "/close_session"), json={"session_id": session}) as resp:
        assert resp.status == 200
    assert paths(holder) == ["/open_session", "/close_session"]
    assert sum(len(w.requests) for w in workers) == len(holder.requests) == 4
    pd_router, _, _ = await pd_fleet(fake_workers, routers)
    async with http.post(url_of(pd_router, "/open_session"), json={}) as resp:
        assert resp.status == 400 and "PD engine" in (await resp.json())["error"]["message"]
    async with http.post(url_of(pd_router, "/generate"), json={"text": "hi", "session_params": {"id": "s"}}) as resp:
        assert resp.status == 400


def test_pinned_workers_spread_and_stay_put():
    class W:
        def __init__(self, url):
            self.url = url
    workers = [W(f"http://w{i}") for i in range(4)]
    picks = {sid: pinned_worker(sid, workers) for sid in map(str, range(400))}
    assert all(pinned_worker(sid, list(reversed(workers))) is w for sid, w in picks.items())  # order-free
    assert min(list(picks.values()).count(w) for w in workers) > 60  # each gets a share
    # one worker more: only the sessions that now hash to it move
    moved = [sid for sid, w in picks.items() if pinned_worker(sid, workers + [W("http://new")]) is not w]
    assert all(pinned_worker(sid, workers + [W("http://new")]).url == "http://new" for sid in moved)
    assert pinned_worker("s", []) is None


def test_session_and_embedding_bodies_parse():
    body = b'{"text": ["a", "b"], "session_params": [{"id": "s"}, {"id": "s", "rid": "r"}]}'
    assert parse_request(Route.GENERATE, body).session_id == "s"
    with pytest.raises(BadRequest, match="one session"):
        parse_request(Route.GENERATE, b'{"text": ["a", "b"], "session_params": [{"id": "s"}, {"id": "t"}]}')
    assert parse_request(Route.EMBEDDINGS, b'{"input": [[1, 2], [3]]}').batch_size == 2
    with pytest.raises(BadRequest, match="'input' is required"):
        parse_request(Route.EMBEDDINGS, b'{"text": "a"}')
