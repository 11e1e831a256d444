"""`baton router` in front of real `baton serve` engines (colocated): the same greedy outputs as
talking to an engine directly, streaming passed through, the OpenAI client against the router, and the
engines' own key (`--engine-api-key`) between them."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

import httpx
import openai
import pytest

from baton.engine.bench.launcher import free_port
from engine_server import running_engine, wait_idle_integrity


@contextlib.contextmanager
def running_router(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A `baton router` process on a free port, healthy (its workers answer); its URL. Stopped on exit."""
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "baton", "router", "--host", "127.0.0.1", "--port", str(port),
                               *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert router.poll() is None, router.stdout.read().decode()
            time.sleep(0.1)
        else:
            raise AssertionError("router did not become healthy")
        yield url
    finally:
        router.terminate()
        router.wait(timeout=20)


@pytest.fixture(scope="module")
def stack(tiny_qwen3):
    with running_engine(tiny_qwen3) as e1, running_engine(tiny_qwen3) as e2:
        with running_router("--worker-urls", e1.base_url, e2.base_url, "--policy", "round_robin") as url:
            yield url, [e1, e2]


def test_same_outputs_through_router(stack):
    router_url, engines = stack
    prompts = [[(5 * i + 7 * j) % 400 + 6 for j in range(4 + 5 * i)] for i in range(8)]

    async def run(base):
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(f"{base}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) for p in prompts])
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["output_ids"] for r in rs]

    direct = asyncio.run(run(engines[0].base_url))
    routed = asyncio.run(run(router_url))
    assert routed == direct
    for e in engines:  # round robin reached both; both ended clean
        assert wait_idle_integrity(e.base_url)["integrity_ok"] is True


def test_openai_client_and_streaming_through_router(stack):
    router_url, engines = stack
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused")
    direct = openai.OpenAI(base_url=f"{engines[1].base_url}/v1", api_key="unused")
    kwargs = dict(model=direct.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                  max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == direct.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_engine_error_passes_through_router(stack):
    router_url, _ = stack
    r = httpx.post(f"{router_url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.text


def test_a_keyed_engine_admits_only_a_router_with_its_key(tiny_qwen3):
    """What the operator sets up (docs/operator.md, "Who may reach the engines"): an engine with an API key
    refuses its admin routes without it and keeps its probes open; a router given the key as
    BATON_ENGINE_API_KEY gets generations through, one without it fails at once with an error saying so."""
    request = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with running_engine(tiny_qwen3, api_key="internal-k3y") as engine:
        assert httpx.post(f"{engine.base_url}/drain", timeout=10).status_code == 401
        assert httpx.post(f"{engine.base_url}/drain", headers={"Authorization": "Bearer client-k3y"},
                          timeout=10).status_code == 401
        assert httpx.get(f"{engine.base_url}/health", timeout=10).status_code == 200
        with running_router("--worker-urls", engine.base_url, "--api-key", "client-k3y",
                            env={"BATON_ENGINE_API_KEY": "internal-k3y"}) as url:
            r = httpx.post(f"{url}/generate", json=request, headers={"Authorization": "Bearer client-k3y"},
                           timeout=120)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        with running_router("--worker-urls", engine.base_url) as url:
            started = time.monotonic()
            r = httpx.post(f"{url}/generate", json=request, timeout=60)
            assert r.status_code == 502 and "--engine-api-key" in r.json()["error"]["message"], r.text
            assert time.monotonic() - started < 10
        assert httpx.get(f"{engine.base_url}/health", timeout=10).status_code == 200  # not drained by anyone
