"""The tokenizer manager's per-request outputs: a step that arrives changes a request's ReqOutput only
when its consumer reads it (a streaming consumer sends a chunk between reads, and must not see a later
step's finish or text on the step it is sending); steps that queued up are merged into one read; a
silent stream is woken for a keep-alive."""
from __future__ import annotations

import asyncio

import pytest

from prometheus_client import generate_latest

from baton.engine.io_struct import BatchStrOut, FinishReason
from baton.engine.metrics import EngineMetrics
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, RequestError, StepQueue, TokenizerManager, _ReqState


def _msg(rid: str, text: str, ids: list[int], done: bool, completion: int) -> BatchStrOut:
    finish = FinishReason("length") if done else None
    return BatchStrOut([rid], [text], [finish], [ids], [(5, completion, 2)],
                       [[(-0.5 * i, t) for i, t in enumerate(ids)]], [None], [None], [None])


def _manager() -> tuple[TokenizerManager, _ReqState]:
    tm = TokenizerManager(None, "", "", EngineMetrics("m", "colocated"), vocab_size=100, context_len=64)
    state = _ReqState(ReqOutput(rid="r"), StepQueue())
    tm.states["r"] = state
    return tm, state


def test_an_arriving_step_does_not_change_the_output_being_handled():
    async def run():
        tm, state = _manager()
        tm._handle_batch(_msg("r", "ab", [1, 2], False, 2))
        out = await tm._next(state, None)
        assert (out.delta, out.new_ids, out.finished_reason, out.completion_tokens) == ("ab", [1, 2], None, 2)
        tm._handle_batch(_msg("r", "c", [3], True, 3))  # arrives while the consumer sends "ab"
        assert (out.text, out.delta, out.finished_reason, out.completion_tokens) == ("ab", "ab", None, 2)
        assert out.output_token_logprobs == [(-0.0, 1), (-0.5, 2)] and out.new_logprobs_from == 0
        out = await tm._next(state, None)
        assert (out.text, out.delta, out.new_ids, out.finished_reason.kind) == ("abc", "c", [3], "length")
        assert out.output_token_logprobs[out.new_logprobs_from:] == [(-0.0, 3)]
        assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (5, 3, 2)
        assert out.e2e_latency > 0

    asyncio.run(run())


def test_queued_steps_merge_into_one_read():
    async def run():
        tm, state = _manager()
        for text, ids, done, n in (("x", [7], False, 1), ("y", [8], False, 2), ("z", [9], True, 3)):
            tm._handle_batch(_msg("r", text, ids, done, n))
        out = await tm._next(state, None)
        assert (out.text, out.delta, out.new_ids, out.finished_reason.kind) == ("xyz", "xyz", [7, 8, 9], "length")
        assert out.new_logprobs_from == 0 and [t for _, t in out.output_token_logprobs] == [7, 8, 9]
        assert state.queue.empty()

    asyncio.run(run())


def test_metrics_observe_arrival_not_reads():
    tm, state = _manager()
    tm._handle_batch(_msg("r", "a", [1], False, 1))
    tm._handle_batch(_msg("r", "b", [2], True, 2))  # nobody read either step
    text = generate_latest(tm.metrics.registry).decode()
    assert 'baton_generation_tokens_total{model_name="m",role="colocated"} 2.0' in text
    assert 'baton_prompt_tokens_total{model_name="m",role="colocated"} 5.0' in text
    assert state.out.text == "" and state.queue.qsize() == 2


def test_a_waiting_read_wakes_on_the_next_step_and_polls_for_a_disconnect(monkeypatch):
    import baton.engine.tokenizer_manager as tm_module

    monkeypatch.setattr(tm_module, "DISCONNECT_POLL_S", 0.01)

    async def run():
        tm, state = _manager()
        polls = []

        async def connected():
            polls.append(1)
            return False

        reader = asyncio.ensure_future(tm._next(state, connected))
        await asyncio.sleep(0.05)  # several poll periods with nothing queued
        assert not reader.done() and len(polls) >= 2
        tm._handle_batch(_msg("r", "q", [4], False, 1))
        out = await asyncio.wait_for(reader, 1)
        assert (out.delta, out.new_ids) == ("q", [4]) and state.queue.empty()
        reader = asyncio.ensure_future(tm._next(state, None))  # no polling: only the step can wake it
        await asyncio.sleep(0.02)
        tm._handle_batch(_msg("r", "s", [5], False, 2))
        out = await asyncio.wait_for(reader, 1)
        assert (out.delta, out.new_ids) == ("s", [5])

        async def gone():
            return True

        with pytest.raises(tm_module.ClientDisconnected):
            await tm._next(state, gone)
        assert state.queue._waiter is None  # nothing left waiting on the queue

    asyncio.run(run())


def test_a_silent_keepalive_stream_reads_none_and_others_keep_waiting():
    """One ticker for every stream: a keepalive request with no step for keepalive_s reads a None (its
    handler sends an SSE comment); a request without keepalive is never woken by it."""
    async def run():
        tm = TokenizerManager(None, "", "", EngineMetrics("m", "colocated"), vocab_size=100, context_len=64,
                              keepalive_s=0.05)
        quiet = _ReqState(ReqOutput(rid="q"), StepQueue(), keepalive=True)
        plain = _ReqState(ReqOutput(rid="p"), StepQueue())
        tm.states.update(q=quiet, p=plain)
        ticker = asyncio.create_task(tm._keepalive_loop())
        plain_read = asyncio.ensure_future(tm._next(plain, None))
        assert await asyncio.wait_for(tm._next(quiet, None), 5) is None
        assert await asyncio.wait_for(tm._next(quiet, None), 5) is None  # and again after another silence
        tm._handle_batch(_msg("q", "a", [1], False, 1))
        assert (await tm._next(quiet, None)).delta == "a"
        assert not plain_read.done()
        tm._handle_batch(_msg("p", "b", [2], True, 1))
        assert (await asyncio.wait_for(plain_read, 5)).delta == "b"
        ticker.cancel()

    asyncio.run(run())


def test_generate_refuses_a_bad_request_when_called_not_when_read():
    tm = TokenizerManager(None, "", "", EngineMetrics("m", "colocated"), vocab_size=100, context_len=64)
    with pytest.raises(RequestError, match="context length"):
        tm.generate(GenerateInput(SamplingParams(), input_ids=list(range(1, 80))))
    tm.states["dup"] = _ReqState(ReqOutput(rid="dup"), StepQueue())
    with pytest.raises(RequestError, match="duplicate request id"):
        tm.generate(GenerateInput(SamplingParams(max_new_tokens=8), input_ids=[1, 2], rid="dup"))
