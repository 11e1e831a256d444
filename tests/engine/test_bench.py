"""`baton bench` against a fake OpenAI-compatible streaming server, and the HF baseline on a tiny model.

Run as a script (`python test_bench.py PORT`), this file is the fake server that the launcher tests
start as a subprocess in place of `baton serve`; torch and transformers are therefore imported
inside the tests that need them, so that the fake starts in about a second.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
from contextlib import contextmanager
from typing import Optional

import pytest
from aiohttp import web

from baton.cli import main as baton_main
from baton.engine.bench.client import run_requests
from baton.engine.bench.launcher import EngineProcess, EngineStartError, free_port
from baton.engine.bench.metrics import RequestResult, latency_stats, percentile, summarize
from baton.engine.bench.workload import WorkloadConfig, build_workload

FAKE_ANSWER = "Paris is the capital of France."


class FakeOpenAI:
    """Streams `max_tokens` one-word chunks, then a usage chunk. With `gate`, no stream starts until
    `gate` requests are in flight at once, which proves the client's concurrency deterministically."""

    def __init__(self, gate: int = 0, split: int = 0, truncate: bool = False):
        """split: write the stream in pieces of this many bytes, cutting lines and events anywhere
        and packing several events into one write. truncate: stop in the middle of the last event."""
        self.split, self.truncate = split, truncate
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate = gate
        self._gate_open: Optional[asyncio.Event] = None  # made on the server's loop

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """A streamed chat answers as completions does, in `delta.content`, after the role chunk
        (whose empty content must not end the TTFT); an unstreamed one answers FAKE_ANSWER."""
        body = await request.json()
        if body.get("stream"):
            return await self._stream(request, body, chat=True)
        self.bodies.append(body)
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": FAKE_ANSWER}}],
                                  "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, await request.json(), chat=False)

    async def _stream(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._wait_gate()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            events = [_event({"choices": [{"index": 0, **_piece(f" w{i}", chat), "finish_reason": None}]})
                      for i in range(body["max_tokens"])]
            if chat:
                events.insert(0, _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 0}
                events.append(_event({"choices": [], "usage": usage}))
            events.append(b"data: [DONE]\n\n")
            if self.truncate:
                events = events[:-2] + [events[-2][:len(events[-2]) // 2]]
            if not self.split:
                for event in events:
                    await response.write(event)
                return response
            stream = b"".join(events)
            for at in range(0, len(stream), self.split):
                await response.write(stream[at:at + self.split])
                await asyncio.sleep(0.001)  # separate socket reads on the client
            return response
        finally:
            self.in_flight -= 1

    async def _wait_gate(self) -> None:
        if not self.gate:
            return
        if self._gate_open is None:
            self._gate_open = asyncio.Event()
        if self.in_flight >= self.gate:
            self._gate_open.set()
        await asyncio.wait_for(self._gate_open.wait(), timeout=10)


def _piece(text: str, chat: bool) -> dict:
    return {"delta": {"content": text}} if chat else {"text": text}


def _event(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@contextmanager
def fake_server(fake: FakeOpenAI):
    """Serve `fake` on 127.0.0.1 (free port) from a thread; yields the base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0




def fake_engine_command(model_path: str, port: int, extra_args: list[str]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), str(port)]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def test_percentile_matches_linear_interpolation():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    stats = latency_stats([0.010, 0.020, 0.030, 0.040])  # seconds in, milliseconds out
    assert stats == pytest.approx({"mean_ms": 25.0, "p50_ms": 25.0, "p90_ms": 37.0, "p99_ms": 39.7})


def test_summarize_counts_only_successful_requests():
    ok = RequestResult(prompt_len=10, success=True, ttft=0.1, e2e=0.5, itl=[0.1, 0.2], output_tokens=3,
                       usage_reported=True)
    failed = RequestResult(prompt_len=10, error="HTTP 503: busy")
    s = summarize([ok, ok, failed], duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["HTTP 503: busy"]
    assert (s["input_tokens"], s["output_tokens"]) == (20, 6)
    assert s["output_throughput"] == pytest.approx(3.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(100.0)
    assert s["itl"]["mean_ms"] == pytest.approx(150.0)


def test_workload_is_deterministic_sized_and_shares_its_prefix(tokenizer):
    config = WorkloadConfig(num_prompts=6, input_len=40, output_len=4, shared_prefix_len=24, seed=3)
    prompts = build_workload(tokenizer, config)
    assert prompts == build_workload(tokenizer, config)
    assert prompts != build_workload(tokenizer, WorkloadConfig(6, 40, 4, 24, seed=4))
    assert all(abs(len(p.token_ids) - 40) <= 4 for p in prompts), [len(p.token_ids) for p in prompts]
    prefix = tokenizer.encode(prompts[0].text, add_special_tokens=False)[:20]
    assert all(list(p.token_ids[:20]) == prefix for p in prompts)
    assert len({p.text for p in prompts}) == 6


def test_random_range_ratio_draws_lengths_in_range(tokenizer):
    cfg = WorkloadConfig(num_prompts=40, input_len=60, output_len=20, seed=3, random_range_ratio=0.25)
    prompts = build_workload(tokenizer, cfg)
    outs = [p.output_len for p in prompts]
    assert all(5 <= n <= 20 for n in outs) and len(set(outs)) > 5
    ins = [len(p.token_ids) for p in prompts]
    assert min(ins) < 30 and max(ins) > 45  # varied, roughly within [15, 60] (tokenization settles lengths)
    assert build_workload(tokenizer, cfg) == prompts


def test_random_range_ratio_zero_is_sglang_default_one_to_len(tokenizer):
    cfg = WorkloadConfig(num_prompts=60, input_len=8, output_len=6, seed=5, random_range_ratio=0.0)
    outs = [p.output_len for p in build_workload(tokenizer, cfg)]
    assert min(outs) == 1 and max(outs) == 6
    with pytest.raises(AssertionError, match="in \\[0, 1\\]"):
        WorkloadConfig(num_prompts=1, input_len=8, output_len=6, random_range_ratio=-0.1)


def test_serving_counts_requests_tokens_and_holds_concurrency(tokenizer):
    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=8, input_len=16, output_len=5, seed=0))
    fake = FakeOpenAI(gate=4)
    with fake_server(fake) as url:
        results, duration = asyncio.run(run_requests(url, "fake-model", prompts, concurrency=4))
    assert fake.max_in_flight == 4
    assert len(fake.bodies) == 8
    assert all(b["ignore_eos"] and b["max_tokens"] == 5 and b["stream"] for b in fake.bodies)
    assert all((b["temperature"], b["top_p"]) == (0.0, 1.0) for b in fake.bodies)  # greedy by default
    assert all(b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert all(r.success and r.usage_reported and r.output_tokens == 5 for r in results)
    assert all(len(r.itl) == 4 and 0 < r.ttft <= r.e2e for r in results)
    s = summarize(results, duration)
    assert (s["completed"], s["output_tokens"]) == (8, 40)
    assert s["itl"]["p50_ms"] <= s["itl"]["p90_ms"] <= s["itl"]["p99_ms"]


@pytest.mark.parametrize("split", [7, 500], ids=["lines-cut-anywhere", "several-events-per-read"])
def test_client_reassembles_events_whatever_the_reads(tokenizer, split):
    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=3, input_len=16, output_len=6, seed=1))
    with fake_server(FakeOpenAI(split=split)) as url:
        results, _ = asyncio.run(run_requests(url, "fake-model", prompts, concurrency=3))
    assert all(r.success and r.usage_reported and r.output_tokens == 6 for r in results)
    assert all(len(r.itl) == 5 for r in results)


def test_client_reports_a_stream_cut_inside_an_event(tokenizer):
    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=1, input_len=16, output_len=4, seed=2))
    with fake_server(FakeOpenAI(split=5, truncate=True)) as url:
        (result,), _ = asyncio.run(run_requests(url, "fake-model", prompts, concurrency=1))
    assert not result.success and "inside an event" in result.error


def test_bench_serving_cli_writes_json(tiny_llama, tmp_path):
    out = tmp_path / "serving.json"
    with fake_server(FakeOpenAI()) as url:
        code = baton_main(["bench", "serving", "--base-url", url, "--tokenizer", tiny_llama, "--num-prompts", "6",
                           "--concurrency", "3", "--input-len", "12", "--output-len", "3",
                           "--json-out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert (results["model"], results["completed"], results["output_tokens"]) == ("fake-model", 6, 18)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_hf_baseline_generates_exactly_output_len_per_prompt(tiny_llama, tokenizer, sampling, monkeypatch):
    from transformers import GenerationMixin

    from baton.engine.bench.hf_baseline import run_hf_baseline

    seen = []
    generate = GenerationMixin.generate

    def spy(self, *a, **kw):
        seen.append({k: kw.get(k) for k in ("do_sample", "temperature", "top_p")})
        return generate(self, *a, **kw)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    config = WorkloadConfig(num_prompts=3, input_len=10, output_len=4, seed=1, **sampling)
    prompts = build_workload(tokenizer, config)
    for mode, batch_size in (("batched", 3), ("sequential", 1)):
        result = run_hf_baseline(tiny_llama, prompts, mode)
        assert (result["mode"], result["batch_size"]) == (mode, batch_size)
        assert result["output_tokens"] == 12 and result["output_throughput"] > 0
    want = {"do_sample": True, **sampling} if sampling else {"do_sample": False, "temperature": None, "top_p": None}
    assert seen and all(s == want for s in seen), seen


def test_sampled_workload_reaches_the_request_bodies(tokenizer):
    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=2, input_len=16, output_len=3, temperature=0.7,
                                                       top_p=0.9))
    fake = FakeOpenAI()
    with fake_server(fake) as url:
        asyncio.run(run_requests(url, "fake-model", prompts, concurrency=2))
    assert [(b["temperature"], b["top_p"]) for b in fake.bodies] == [(0.7, 0.9)] * 2
    with pytest.raises(AssertionError):
        WorkloadConfig(num_prompts=1, input_len=8, output_len=2, top_p=0.0)


def test_compare_runs_each_variant_stops_it_and_prints_ratios(tiny_llama, capsys):
    from baton.engine.bench.compare import Variant, parse_variant, run_compare

    ports: list[int] = []

    def command(model_path: str, port: int, extra_args: list[str]) -> list[str]:
        ports.append(port)
        return fake_engine_command(model_path, port, extra_args)

    variants = [parse_variant("radix:"), parse_variant("noradix:--disable-radix-cache")]
    assert variants[1] == Variant("noradix", ("--disable-radix-cache",))
    results = run_compare(tiny_llama, WorkloadConfig(4, 12, 3, shared_prefix_len=6), concurrency=2,
                          variants=variants, startup_timeout_s=60, command_factory=command)
    assert list(results["variants"]) == ["radix", "noradix"]
    assert all(v["completed"] == 4 and v["output_tokens"] == 12 for v in results["variants"].values())
    assert set(results["hf"]) == {"batched", "sequential"}
    assert len(ports) == 2 and not any(_port_open(p) for p in ports)
    table = capsys.readouterr().out.split("== comparison")[1]
    assert "noradix" in table and "HF-batched" in table and "vs HF-bat" in table


def test_compare_repeats_interleaves_rounds_on_fresh_prompts(tiny_llama, capsys):
    from baton.engine.bench.compare import parse_variant, run_compare

    ports: list[int] = []

    def command(model_path: str, port: int, extra_args: list[str]) -> list[str]:
        ports.append(port)
        return fake_engine_command(model_path, port, extra_args)

    results = run_compare(tiny_llama, WorkloadConfig(4, 12, 3), concurrency=2,
                          variants=[parse_variant("a:"), parse_variant("b:--disable-radix-cache")],
                          hf_modes=["batched"], startup_timeout_s=60, command_factory=command, repeats=3)
    assert len(ports) == 2, "each engine starts once and serves every round"
    assert not any(_port_open(p) for p in ports)
    assert len(results["rounds"]) == 3
    for round_ in results["rounds"]:
        assert all(v["completed"] == 4 for v in round_["variants"].values()) and set(round_["hf"]) == {"batched"}
    b = results["summary"]["b"]
    for i, round_ in enumerate(results["rounds"]):  # every ratio is within one round
        expected = round_["variants"]["b"]["output_throughput"] / round_["hf"]["batched"]["output_throughput"]
        assert b["ratios"]["vs HF-batched"]["rounds"][i] == pytest.approx(expected)
    assert results["summary"]["a"]["ratios"]["vs a"]["median"] == pytest.approx(1.0)
    out = capsys.readouterr().out
    assert out.count("== round ") == 3 and "== summary over rounds" in out and "vs HF-batched" in out


def test_compare_warmup_rounds_run_but_are_not_counted(tiny_llama, capsys):
    from baton.engine.bench.compare import parse_variant, run_compare

    results = run_compare(tiny_llama, WorkloadConfig(4, 12, 3), concurrency=2, variants=[parse_variant("a:")],
                          hf_modes=["batched"], startup_timeout_s=60, command_factory=fake_engine_command,
                          repeats=1, warmup_rounds=2)
    assert len(results["rounds"]) == 1 and results["summary"]["a"]["ratios"]["vs HF-batched"]["rounds"]
    out = capsys.readouterr().out
    assert out.count("== warm-up round ") == 2 and out.count("== round ") == 1
    assert out.index("== warm-up round 2/2") < out.index("== round 1/1")


def test_launcher_reports_an_engine_that_dies_while_starting():
    engine = EngineProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], free_port())
    with engine, pytest.raises(EngineStartError, match="exited with code 3(.|\n)*bad flag"):
        engine.wait_healthy(timeout_s=60)
    assert not engine.running


def test_launcher_logs_do_not_outlive_a_kill_and_restart_or_a_stop():
    engine = EngineProcess([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], free_port())
    engine.start()
    first = engine.log_path
    engine.kill()  # a crash: the log stays, to be read
    assert os.path.exists(first)
    engine.start()  # the restart's log replaces it
    assert engine.log_path != first and not os.path.exists(first)
    second = engine.log_path
    engine.stop()
    assert not os.path.exists(second)


def test_demo_serves_and_asks_with_a_converted_model(tmp_path, capsys, monkeypatch):
    from baton.engine.entrypoints import demo
    from baton.engine.utils.gguf_convert import COMPLETE_MARKER

    model_dir = tmp_path / demo.MODEL_DIR_NAME
    model_dir.mkdir()
    (model_dir / COMPLETE_MARKER).write_text("{}")  # pretend converted: the real conversion is test_gguf_convert's
    monkeypatch.setattr(demo, "shipped_smollm2_gguf", lambda: "unused.gguf")
    port = free_port()
    assert demo.run_demo(str(tmp_path), port=port, startup_timeout_s=60, command_factory=fake_engine_command) == 0
    out = capsys.readouterr().out
    assert f"A: {FAKE_ANSWER}" in out and "7 tokens" in out
    assert not _port_open(port)


if __name__ == "__main__":  # the subprocess stand-in for `baton serve`
    web.run_app(FakeOpenAI().app(), host="127.0.0.1", port=int(sys.argv[1]), print=None)


def test_code_edit_workload_copies_a_module_and_is_reproducible(tokenizer):
    """--dataset code-edit: each prompt holds its own module of whole functions, at least input_len
    tokens, and ends where the answer's code starts; the same seed gives the same prompts."""
    config = WorkloadConfig(num_prompts=3, input_len=120, output_len=16, dataset="code-edit", seed=3)
    prompts = build_workload(tokenizer, config)
    assert prompts == build_workload(tokenizer, config)
    assert len({p.text for p in prompts}) == 3 and all(len(p.token_ids) >= 120 for p in prompts)
    for p in prompts:
        assert p.text.endswith("```python\n") and ("def " in p.text or "class " in p.text)
        assert p.token_ids == tuple(tokenizer.encode(p.text, add_special_tokens=False)) and p.output_len == 16
