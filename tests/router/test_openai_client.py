"""The `openai` Python SDK against the router (fake workers behind it), colocated and PD."""
import openai
import pytest
from router_support import url_of


@pytest.fixture(params=["regular", "pd"])
async def router(request, fake_workers, routers):
    if request.param == "regular":
        worker = await fake_workers("engine", stream_chunks=3)
        return await routers(regular=[worker.url], api_key="k")
    prefill = await fake_workers("prefill")
    decode = await fake_workers("engine", stream_chunks=3)
    return await routers(prefill=[prefill.url], decode=[decode.url], api_key="k")


def client_for(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url_of(router, "/v1"), api_key="k", max_retries=0)


async def test_chat_completion(router):
    async with client_for(router) as client:
        reply = await client.chat.completions.create(model="fake-model",
                                                     messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "hello from engine"


async def test_streamed_chat_completion(router):
    async with client_for(router) as client:
        stream = await client.chat.completions.create(model="fake-model", stream=True,
                                                      messages=[{"role": "user", "content": "hi"}])
        pieces = [chunk.choices[0].delta.content async for chunk in stream]
    assert pieces == ["tok0 ", "tok1 ", "tok2 "]


async def test_completion_and_models(router):
    async with client_for(router) as client:
        reply = await client.completions.create(model="fake-model", prompt="say hi", max_tokens=4)
        models = await client.models.list()
    assert reply.choices[0].text == "hello from engine"
    assert [m.id for m in models.data] == ["fake-model"]


async def test_errors_surface_as_sdk_exceptions(router):
    async with openai.AsyncOpenAI(base_url=url_of(router, "/v1"), api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="fake-model", prompt="x")
    async with client_for(router) as client:
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model="fake-model", messages=[])
