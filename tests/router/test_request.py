import orjson
import pytest

from baton.router.forward import inject
from baton.router.request import BadRequest, Route, parse_request, routing_text


def parse(route: Route, body) -> object:
    return parse_request(route, body if isinstance(body, bytes) else orjson.dumps(body))


@pytest.mark.parametrize("route,body,message", [
    (Route.CHAT, b"{not json", "not valid JSON"),
    (Route.CHAT, b"[1, 2]", "JSON object"),
    (Route.CHAT, {"model": "m"}, "'messages' is required"),
    (Route.CHAT, {"messages": []}, "'messages' is required"),
    (Route.CHAT, {"messages": ["hi"]}, "messages[0]"),
    (Route.CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "'stream'"),
    (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, "'max_tokens'"),
    (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, ">= 0"),
    (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "'temperature'"),
    (Route.COMPLETIONS, {"model": "m"}, "'prompt' is required"),
    (Route.COMPLETIONS, {"prompt": 42}, "'prompt'"),
    (Route.COMPLETIONS, {"prompt": [1, "a"]}, "mixes"),
    (Route.GENERATE, {"sampling_params": {}}, "'text', 'input_ids'"),
    (Route.GENERATE, {"text": "a", "input_ids": [1]}, "only one"),
    (Route.GENERATE, {"text": "a", "sampling_params": 3}, "'sampling_params'"),
    (Route.GENERATE, {"text": {}}, "'text'"),
])
def test_bad_input_is_a_bad_request_with_a_message(route, body, message):
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(route, body)


def test_good_requests_parse():
    chat = parse(Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert chat.stream and chat.batch_size is None and not chat.return_logprob
    gen = parse(Route.GENERATE, {"text": ["a", "b"], "return_logprob": True})
    assert gen.batch_size == 2 and gen.return_logprob and not gen.stream
    assert parse(Route.GENERATE, {"input_ids": [[1, 2], [3]]}).batch_size == 2
    assert parse(Route.GENERATE, {"input_ids": [1, 2]}).batch_size is None
    assert parse(Route.COMPLETIONS, {"prompt": "x"}).batch_size is None
    assert parse(Route.COMPLETIONS, {"prompt": ["x", "y", "z"]}).batch_size == 3
    # a whole completion with echo and logprobs carries the prompt's logprobs (a stream does not echo)
    echo = {"prompt": "x", "echo": True, "logprobs": 0}
    assert parse(Route.COMPLETIONS, echo).return_logprob
    assert not parse(Route.COMPLETIONS, {**echo, "stream": True}).return_logprob
    assert not parse(Route.COMPLETIONS, {**echo, "echo": False}).return_logprob
    assert not parse(Route.COMPLETIONS, {"prompt": "x", "echo": True}).return_logprob


def test_routing_text():
    chat = parse(Route.CHAT, {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": " hi"}]}]})
    assert routing_text(chat) == "be brief hi"
    assert routing_text(parse(Route.COMPLETIONS, {"prompt": ["first", "second"]})) == "first"
    assert routing_text(parse(Route.GENERATE, {"input_ids": [72, 105]})) == "Hi"
    assert routing_text(parse(Route.GENERATE, {"text": "plain"})) == "plain"


def test_inject_splices_fields_without_reserializing():
    raw = b'{"prompt": "x" ,"n": 1}  \n'
    out = inject(raw, orjson.loads(raw), {"rid": "r1", "bootstrap_room": 5})
    assert orjson.loads(out) == {"prompt": "x", "n": 1, "rid": "r1", "bootstrap_room": 5}
    assert out.startswith(b'{"prompt": "x" ,"n": 1')
    assert orjson.loads(inject(b"{}", {}, {"a": 1})) == {"a": 1}


def test_inject_replaces_fields_the_client_set():
    raw = b'{"bootstrap_room": 1, "text": "t"}'
    assert orjson.loads(inject(raw, orjson.loads(raw), {"bootstrap_room": 2})) == {"bootstrap_room": 2, "text": "t"}
