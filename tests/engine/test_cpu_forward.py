"""The native forward (engine/model_executor/native_forward.py, on engine/kernels/cpu_forward.py's binding
of cpu_forward.c) against the eager bfloat16 model it executes:
the same logits, greedy tokens and stored K/V, bit for bit, at extend (a cached prefix included) and
decode (it rounds where eager rounds and sums RMSNorm's squares in torch's order); where
it cannot serve a model it says why; bad indices raise before anything is written; and a bfloat16
engine runs every step through it."""
from __future__ import annotations

import pytest
import torch

from baton.engine.core.forward_batch import ForwardMode
from baton.engine.kernels import cpu_forward, cpu_linear
from baton.engine.layers.linear import pack_linear_weights
from baton.engine.model_executor import native_forward
from baton.engine.model_executor.model_loader import load_model
from baton.engine.worker.executors.native_stream import NativeStreamExecutor

from test_models import PROMPTS, LLAMA3_ROPE, PagedRunner

pytestmark = pytest.mark.skipif(cpu_linear.unavailable_reason() is not None,
                                reason=f"no packed bfloat16 kernel here: {cpu_linear.unavailable_reason()}")

CASES = {
    "llama": ("llama", {"hidden_size": 128}),  # head_dim 32
    "llama-tied-llama3rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    # SmolLM2-135M's widths: 9 heads over 3 KV heads of 64, hidden 576, where the order of the
    # RMSNorm's sum of squares decides roundings
    "llama-576": ("llama", {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                            "intermediate_size": 1536}),
}
STEPS = 6


def _load(factory, arch, **overrides):
    model, config, dtype = load_model(factory(arch, **overrides), dtype="bfloat16")
    assert dtype == torch.bfloat16 and pack_linear_weights(model, "cpu") > 0
    return model, config


class NativeRunner(PagedRunner):
    """PagedRunner whose extend and decode passes go through the native forward."""

    def __init__(self, model, config, **kw) -> None:
        super().__init__(model, config, native_decode=True, dtype=torch.bfloat16, **kw)
        self.fwd = native_forward.NativeForward.create(model, self.req_pool, self.kv_pool)
        assert self.fwd is not None, native_forward.unavailable_reason(model, self.kv_pool)

    def run(self, mode, rows, tokens, prefix_lens):
        r2t = self.req_pool.req_to_token
        if mode == ForwardMode.DECODE:
            hidden = self.fwd.decode(torch.tensor([t[0] for t in tokens]), torch.tensor(prefix_lens),
                                     torch.tensor(rows), torch.tensor([p + 1 for p in prefix_lens]),
                                     torch.stack([r2t[r, p] for r, p in zip(rows, prefix_lens)]))
        else:
            positions = torch.cat([torch.arange(p, p + len(t)) for p, t in zip(prefix_lens, tokens)])
            loc = torch.cat([r2t[r, p:p + len(t)] for r, p, t in zip(rows, prefix_lens, tokens)])
            hidden = self.fwd.extend(torch.tensor(sum(tokens, [])), positions, loc, torch.tensor(rows),
                                     torch.tensor(prefix_lens), torch.tensor([len(t) for t in tokens]))
        assert self.fwd.has_logits
        return self.fwd.logits(hidden)


def _both(model, config, fn):
    """fn(runner) on the eager model's runner, then on the native one (same slot layout)."""
    return [(fn(runner), runner.kv_pool) for runner in (
        PagedRunner(model, config, page_size=4, native_decode=True, dtype=torch.bfloat16),
        NativeRunner(model, config, page_size=4))]


def _assert_pools_match(config, eager_pool, native_pool):
    for layer in range(config.text.num_layers):
        for eager_buf, native_buf in zip(eager_pool.get_kv_buffer(layer), native_pool.get_kv_buffer(layer)):
            assert torch.equal(native_buf, eager_buf), f"layer {layer}: the stored K/V differ"


@pytest.mark.parametrize("case", list(CASES))
def test_native_forward_matches_eager_model(tiny_model_factory, case):
    arch, overrides = CASES[case]
    model, config = _load(tiny_model_factory, arch, **overrides)
    rows, prompts = [2, 0, 1], [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    lens = [len(p) for p in prompts]

    def prefill_and_decode(runner):
        logits = runner.run(ForwardMode.EXTEND, rows, prompts, [0, 0, 0])
        tokens, step_logits = runner.decode_greedy(rows, logits[torch.tensor(lens).cumsum(0) - 1], lens, STEPS)
        return logits, tokens, step_logits

    ((eager_prefill, eager_tokens, eager_steps), eager_pool), ((prefill, tokens, steps), pool) = _both(
        model, config, prefill_and_decode)
    assert tokens == eager_tokens
    assert torch.equal(prefill, eager_prefill) and torch.equal(steps, eager_steps)
    _assert_pools_match(config, eager_pool, pool)


@pytest.mark.parametrize("case", ["llama", "llama-tied-llama3rope"])
def test_native_logits_are_the_models_head(tiny_model_factory, case):
    """The native LM head (its own weight, or the tied embedding's) gives compute_logits' values, for
    one row, a decode batch and a prefill's worth of rows (its widening runs threaded from 64k values)."""
    arch, overrides = CASES[case]
    model, config = _load(tiny_model_factory, arch, **overrides)
    fwd = NativeRunner(model, config, page_size=4).fwd
    assert fwd.has_logits and fwd.vocab == config.text.vocab_size
    g = torch.Generator().manual_seed(0)
    for rows in (1, 16, 300):
        hidden = torch.randn(rows, config.text.hidden_size, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            expected = model.compute_logits(hidden)
        native = fwd.logits(hidden)
        assert native.dtype == torch.float32 and torch.equal(native, expected)
    with pytest.raises(ValueError):
        fwd.logits(torch.zeros(2, config.text.hidden_size + 2, dtype=torch.bfloat16))


def test_native_extend_after_a_cached_prefix(tiny_model_factory):
    """A chunked prefill: the second chunk's tokens attend to the first chunk's K/V in the pool."""
    model, config = _load(tiny_model_factory, "qwen3")
    prompt = PROMPTS[1] + PROMPTS[0]  # 19 tokens: chunks of 12 and 7, beside a one-pass request

    def chunked(runner):
        runner.run(ForwardMode.EXTEND, [0], [prompt[:12]], [0])
        return runner.run(ForwardMode.EXTEND, [0, 1], [prompt[12:], PROMPTS[2]], [12, 0])

    (eager, eager_pool), (native, pool) = _both(model, config, chunked)
    assert torch.equal(native, eager)
    _assert_pools_match(config, eager_pool, pool)


def test_native_extend_of_many_tokens_runs_its_elementwise_loops_threaded(tiny_model_factory):
    """From PARALLEL_ROWS (64) tokens the norms, RoPE and KV store run over the OpenMP threads."""
    model, config = _load(tiny_model_factory, "qwen2")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.text.vocab_size, (n,), generator=g).tolist() for n in (45, 40)]  # 85 tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (eager, eager_pool), (native, pool) = _both(
            model, config, lambda runner: runner.run(ForwardMode.EXTEND, [0, 1], prompts, [0, 0]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(native, eager)
    _assert_pools_match(config, eager_pool, pool)


@pytest.mark.parametrize("n", [64, 256, 576, 960, 4096])
def test_rms_norm_is_the_eager_modules_bit_for_bit(n):
    """The variance's sum of squares is added in torch's order: at real widths another order moves
    roundings (an earlier version, one SIMD reduction, differed here at 576 and 960)."""
    from baton.engine.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
        x = (torch.randn(256, n, generator=g) * 7).to(torch.bfloat16)
        assert torch.equal(cpu_forward.rms_norm(x, norm.weight, 1e-6), norm(x))


def test_unavailable_reasons(tiny_model_factory):
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool

    def pool(config, dtype=torch.bfloat16):
        heads = config.heads
        return MHATokenToKVPool(64, 1, dtype, heads.num_kv_heads, heads.head_dim, config.text.num_layers, "cpu")

    model, config = _load(tiny_model_factory, "llama")
    assert native_forward.unavailable_reason(model, pool(config)) is None
    assert "KV cache" in native_forward.unavailable_reason(model, pool(config, torch.float8_e5m2))
    assert "tensor parallelism" in native_forward.unavailable_reason(model, pool(config), tp_size=2)
    moe, moe_config = _load(tiny_model_factory, "qwen3_moe")
    assert "MoE" in native_forward.unavailable_reason(moe, pool(moe_config))
    fp32, fp32_config, _ = load_model(tiny_model_factory("llama"))
    assert "not bfloat16" in native_forward.unavailable_reason(fp32, pool(fp32_config, torch.float32))
    unpacked, _, _ = load_model(tiny_model_factory("llama"), dtype="bfloat16")  # --disable-packed-linear
    assert "packed" in native_forward.unavailable_reason(unpacked, pool(config))


def test_bad_indices_raise_before_writing(tiny_model_factory):
    model, config = _load(tiny_model_factory, "llama")
    runner = NativeRunner(model, config, page_size=1)
    runner.run(ForwardMode.EXTEND, [0], [PROMPTS[0]], [0])
    snapshot = lambda: [t.clone() for layer in range(config.text.num_layers)  # noqa: E731
                        for t in runner.kv_pool.get_kv_buffer(layer)]
    before = snapshot()
    n, slots = len(PROMPTS[0]), runner.kv_pool.get_kv_buffer(0)[0].shape[0]
    loc = runner.req_pool.req_to_token[0, n:n + 1]
    good = dict(input_ids=torch.tensor([5]), positions=torch.tensor([n]), req_pool_indices=torch.tensor([0]),
                seq_lens=torch.tensor([n + 1]), out_cache_loc=loc)
    for name, value in [("input_ids", [config.text.vocab_size]), ("positions", [-1]), ("req_pool_indices", [99]),
                        ("seq_lens", [10_000]), ("out_cache_loc", [slots])]:
        with pytest.raises(RuntimeError, match="out of range"):
            runner.fwd.decode(**{**good, name: torch.tensor(value)})
    with pytest.raises(ValueError, match="must be"):
        runner.fwd.decode(**{**good, "positions": torch.tensor([n, n])})
    ext = dict(input_ids=torch.tensor([5, 6]), positions=torch.tensor([n, n + 1]),
               out_cache_loc=runner.req_pool.req_to_token[0, n:n + 2], req_pool_indices=torch.tensor([0]),
               prefix_lens=torch.tensor([n]), extend_lens=torch.tensor([2]))
    for name, value in [("extend_lens", [3]), ("prefix_lens", [10_000]), ("input_ids", [5, -1]),
                        ("req_pool_indices", [-1])]:
        with pytest.raises(RuntimeError, match="out of range"):
            runner.fwd.extend(**{**ext, name: torch.tensor(value)})
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    assert runner.fwd.decode(**good).shape == (1, config.text.hidden_size)  # and it still serves
    assert runner.fwd.extend(**ext).shape == (2, config.text.hidden_size)


def _step_inputs(runner, rows, tokens, prefix_lens):
    """NativeForward.step's inputs for new tokens of rows from their prefix lengths."""
    r2t = runner.req_pool.req_to_token
    return dict(input_ids=torch.tensor(sum(tokens, [])),
                positions=torch.cat([torch.arange(p, p + len(t)) for p, t in zip(prefix_lens, tokens)]),
                out_cache_loc=torch.cat([r2t[r, p:p + len(t)] for r, p, t in zip(rows, prefix_lens, tokens)]),
                req_pool_indices=torch.tensor(rows))


def test_model_step_is_forward_head_and_argmax(tiny_model_factory):
    """One model step (extend or decode) gives the logits of each request's last token, as the
    forward and the LM head give them, and a greedy one their torch.argmax; with a future map it
    reads the placeholders from it, and a greedy step stores its tokens at the slots given."""
    model, config = _load(tiny_model_factory, "llama")
    runner = NativeRunner(model, config, page_size=4)
    fwd, rows, prompts = runner.fwd, [0, 1, 2], [PROMPTS[0], PROMPTS[1], PROMPTS[2][:3]]
    ext = _step_inputs(runner, rows, prompts, [0, 0, 0])
    lens = torch.tensor([len(p) for p in prompts])
    logits = fwd.logits(fwd.extend(ext["input_ids"], ext["positions"], ext["out_cache_loc"], ext["req_pool_indices"],
                                   torch.zeros(3, dtype=torch.int64), lens))[lens.cumsum(0) - 1]
    expected = logits.argmax(-1)
    prefill = dict(prefix_lens=torch.zeros(3, dtype=torch.int64), extend_lens=lens)
    step = fwd.step(**ext, **prefill)
    step.run()
    assert step.logits is None and torch.equal(step.next_ids, expected)
    step = fwd.step(**ext, **prefill, greedy=False)
    step.run()
    assert torch.equal(step.logits, logits)

    # a decode step whose inputs are placeholders: -slot of the future map
    future = torch.zeros(10, dtype=torch.int64)
    future[[3, 5, 7]] = expected
    dec = _step_inputs(runner, rows, [[t] for t in expected.tolist()], lens.tolist())
    want = fwd.logits(fwd.decode(dec["input_ids"], dec["positions"], dec["req_pool_indices"], lens + 1,
                                 dec["out_cache_loc"]))
    placeholders = {**dec, "input_ids": torch.tensor([-3, -5, -7])}
    step = fwd.step(**placeholders, seq_lens=lens + 1, future_map=future, future_slots=torch.tensor([1, 2, 9]),
                    greedy=False)
    step.run()
    assert torch.equal(step.logits, want) and future[[1, 2, 9]].tolist() == [0, 0, 0]  # the sampler stores them
    step = fwd.step(**placeholders, seq_lens=lens + 1, future_map=future, future_slots=torch.tensor([1, 2, 9]))
    step.run()
    assert torch.equal(step.next_ids, want.argmax(-1))
    assert future[[1, 2, 9]].tolist() == want.argmax(-1).tolist() and future[[3, 5, 7]].tolist() == expected.tolist()
    # a placeholder or a slot outside the map: an error, and nothing stored
    for bad in ({"input_ids": torch.tensor([-3, -10, -7])}, {"future_slots": torch.tensor([1, 2, 10])}):
        before = future.clone()
        args = {**placeholders, "future_slots": torch.tensor([1, 2, 9]), **bad}
        with pytest.raises(RuntimeError, match="future map"):
            fwd.step(**args, seq_lens=lens + 1, future_map=future).run()
        assert torch.equal(future, before)


def test_forward_stream_runs_in_order_on_its_own_thread(tiny_model_factory):
    """Steps run in submission order (the second reads the first's tokens from the future map); a
    step's callback and a bare Python call run on the stream's thread in their turn and bring their
    result or exception back; a step's error is raised where it is waited for, its callback
    skipped, and the stream serves on; close() runs what is queued."""
    import threading

    model, config = _load(tiny_model_factory, "llama")
    runner = NativeRunner(model, config, page_size=4)
    fwd, rows = runner.fwd, [0, 1]
    prompts = [PROMPTS[0], PROMPTS[1]]
    lens = torch.tensor([len(p) for p in prompts])

    def run(step):
        step.run()
        return step.next_ids

    # the plain answer first: prefill, then two decode steps
    ext = _step_inputs(runner, rows, prompts, [0, 0])
    first = run(fwd.step(**ext, prefix_lens=torch.zeros(2, dtype=torch.int64), extend_lens=lens))
    d1 = _step_inputs(runner, rows, [[t] for t in first.tolist()], lens.tolist())
    second = run(fwd.step(**d1, seq_lens=lens + 1))
    d2 = _step_inputs(runner, rows, [[t] for t in second.tolist()], (lens + 1).tolist())
    third = run(fwd.step(**d2, seq_lens=lens + 2))

    stream = cpu_forward.ForwardStream(fwd.num_threads)
    try:
        future = torch.zeros(8, dtype=torch.int64)
        future[[1, 2]] = first
        placeholders1, placeholders2 = {**d1, "input_ids": torch.tensor([-1, -2])}, {**d2, "input_ids": torch.tensor([-3, -4])}
        # step 1 leaves its logits to a callback that stores the argmax in the map, as the sampler does
        s1 = fwd.step(**placeholders1, seq_lens=lens + 1, future_map=future, future_slots=torch.tensor([3, 4]),
                      greedy=False)
        s1.then(lambda: (future.__setitem__([3, 4], s1.logits.argmax(-1)), threading.get_ident())[1])
        s2 = fwd.step(**placeholders2, seq_lens=lens + 2, future_map=future, future_slots=torch.tensor([5, 6]))
        stream.submit(s1)
        stream.submit(s2)  # placeholders that only s1's callback fills
        stream.wait(s2)
        stream.wait(s1)
        assert torch.equal(s2.next_ids, third) and torch.equal(s1.logits.argmax(-1), second)
        assert s1.result != threading.get_ident()  # the callback ran on the stream's thread
        call = cpu_forward.StreamCall(lambda: 1 // 0)
        stream.submit(call)
        with pytest.raises(ZeroDivisionError):
            stream.wait(call)
        bad = fwd.step(**{**d2, "input_ids": torch.tensor([-3, -99])}, seq_lens=lens + 2, future_map=future,
                       future_slots=torch.tensor([5, 6]))
        bad.then(lambda: pytest.fail("a failed step's callback ran"))
        stream.submit(bad)
        with pytest.raises(RuntimeError, match="future map"):
            stream.wait(bad)
        again = fwd.step(**placeholders2, seq_lens=lens + 2, future_map=future, future_slots=torch.tensor([5, 6]))
        stream.submit(again)
        after = cpu_forward.StreamCall(lambda: again.struct.done)  # queued behind `again`
        stream.submit(after)
        stream.wait(after)
        assert after.result == 1
        stream.wait(again)
        assert torch.equal(again.next_ids, third)
        last = fwd.step(**d2, seq_lens=lens + 2)
        stream.submit(last)
    finally:
        stream.close()
    assert torch.equal(last.next_ids, third)  # close() ran it


def _selftest(num_threads, n, grain, wait_ms=0):
    """parallel.h's par_for in the native forward's library: (items run per index, slot per index,
    items run by slots other than the caller's)."""
    lib = cpu_forward.library()
    hits, slots = torch.zeros(n, dtype=torch.int32), torch.full((n,), -1, dtype=torch.int32)
    others = lib.par_selftest(num_threads, n, grain, wait_ms, hits.data_ptr(), slots.data_ptr())
    return hits, slots, others


@pytest.mark.parametrize("num_threads,n,grain", [(1, 100, 1), (2, 1, 1), (2, 1000, 1), (2, 5000, 16), (3, 37, 3),
                                                 (4, 100000, 7)])
def test_crew_runs_every_item_once(num_threads, n, grain):
    """The crew's guided claims cover every item exactly once, on slots below num_threads; a nested
    par_for (from inside a chunk of a split loop) runs whole on its thread; the items others ran are
    counted. (A loop of one chunk, (2, 1, 1), runs inline outside the crew: a par_for inside it may use
    helpers, which the check once wrongly expected not to, failing when a helper woke in time.)"""
    hits, slots, others = _selftest(num_threads, n, grain)
    assert torch.equal(hits, torch.ones(n, dtype=torch.int32))  # (a failed nested check adds 1000 to item 0)
    assert 0 <= int(slots.min()) and int(slots.max()) < num_threads
    assert others == int((slots != 0).sum())


def test_crew_helpers_join_and_a_stream_takes_its_waiter_instead():
    """Called from a plain thread, two threads' worth of work is shared with a helper thread. On a
    forward stream's thread the second thread is whoever waits on the stream: while nobody waits,
    the stream's thread runs every chunk itself (no helper joins, though one is idle); once the
    scheduler's thread waits, it runs chunks of the stream's loop before its wait returns."""
    import time

    n = 4000
    _, slots, others = _selftest(2, n, 1, wait_ms=5000)  # the first chunk holds until another thread ran one
    assert others > 0 and set(slots.unique().tolist()) == {0, 1}
    stream = cpu_forward.ForwardStream(2)
    try:
        alone = cpu_forward.StreamCall(lambda: _selftest(2, n, 1, wait_ms=300))
        stream.submit(alone)
        deadline = time.monotonic() + 60
        while not alone.struct.done and time.monotonic() < deadline:  # nobody waits on the stream meanwhile
            time.sleep(0.01)
        stream.wait(alone)
        hits, slots, others = alone.result
        assert others == 0 and torch.equal(hits, torch.ones(n, dtype=torch.int32))
        joined = cpu_forward.StreamCall(lambda: _selftest(2, n, 1, wait_ms=5000))
        stream.submit(joined)
        stream.wait(joined)  # this thread joins the call's loop
        hits, slots, others = joined.result
        assert others > 0 and torch.equal(hits, torch.ones(n, dtype=torch.int32))
    finally:
        stream.close()


def test_overlap_loop_is_the_default_where_the_native_forward_serves(tiny_model_factory):
    """On CPU without either flag the scheduler takes the overlap loop on the native forward stream
    when the native forward serves the model on two threads or more, and the plain loop when the
    model keeps its own Python forward (float32 here), when its forward has one thread (a DP
    replica's share of two cores), or when --disable-overlap-schedule says so."""
    from scheduler_harness import SchedulerHarness

    path = tiny_model_factory("llama")
    threads = torch.get_num_threads()
    for overrides, n, stream in [({"dtype": "bfloat16"}, 2, True), ({"dtype": "bfloat16"}, 1, False),
                                 ({"dtype": "float32"}, 2, False),
                                 ({"dtype": "bfloat16", "disable_overlap_schedule": True}, 2, False),
                                 ({"dtype": "bfloat16", "disable_native_forward": True}, 2, False)]:
        torch.set_num_threads(n)
        try:
            h = SchedulerHarness(path, max_total_tokens=1024, **overrides)
        finally:
            torch.set_num_threads(threads)
        try:
            overlap = h.scheduler.overlap
            assert (overlap is not None) == stream, overrides
            assert overlap is None or isinstance(overlap, NativeStreamExecutor)
            info = h.scheduler.get_server_info()
            assert info["event_loop"] == ("overlap" if stream else "plain")
            assert info["event_loop_reason"] == h.scheduler.loop_choice.reason
            h.submit("a", PROMPTS[0], max_new_tokens=4, ignore_eos=True)
            assert len(h.run_until_idle()["a"].ids) == 4 and h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()


@pytest.mark.parametrize("loop", ["plain", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["no-mix", "mixed-chunk"])
def test_engine_runs_every_step_natively(tiny_model_factory, mixed, loop):
    """Through the scheduler (chunked prefill, prefix hits, batches that change; with
    --enable-mixed-chunk, decode tokens ride in extend batches), plain loop or overlap loop (whose
    steps run on the native forward stream): every step is one native call (greedy batches to the
    argmax, sampling ones to the draw, batches with logprobs to the logits, then the sampler),
    nothing is compiled, and the tokens (greedy, seeded sampling, with logprobs) are the model's own
    forward's under the plain loop."""
    from scheduler_harness import SchedulerHarness

    path = tiny_model_factory("qwen3")
    shared = PROMPTS[1]
    prompts = [shared, shared + PROMPTS[0], PROMPTS[2], shared + PROMPTS[2]]
    # request 1 samples at temperature 1 (seeded): the native step draws for its batches (the
    # reference, Python's sampler, the same numbers); request 2 asks for logprobs: its batches take
    # the sampler over the native step's logits; the others are greedy and run on after them
    sampling = [{"max_new_tokens": 8}, {"temperature": 1.0, "seed": 7, "top_p": 0.9, "max_new_tokens": 5},
                {"return_logprob": True, "top_logprobs_num": 2, "max_new_tokens": 3}, {"max_new_tokens": 8}]
    results = {}
    for disable in (True, False):
        overlap = loop == "overlap" and not disable
        h = SchedulerHarness(path, dtype="bfloat16", disable_native_forward=disable, max_total_tokens=2048,
                             chunked_prefill_size=8, enable_mixed_chunk=mixed, enable_torch_compile=not disable,
                             enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap)
        runner = h.scheduler.worker.model_runner
        assert (runner.native_forward is None) == disable
        calls = {"argmax decode": 0, "argmax extend": 0, "draw decode": 0, "logits decode": 0}
        if not disable:
            assert runner.compiled_model is None  # nothing to compile, though asked to
            assert isinstance(h.scheduler.overlap, NativeStreamExecutor) == overlap
            fwd = runner.native_forward

            def step(*a, fn=fwd.step, **kw):
                mode = "decode" if kw.get("seq_lens") is not None else "extend"
                kind = "logits" if not kw.get("greedy", True) else "draw" if kw.get("sampling") else "argmax"
                calls[f"{kind} {mode}"] = calls.get(f"{kind} {mode}", 0) + 1
                return fn(*a, **kw)
            fwd.step = step
        for i, (p, params) in enumerate(zip(prompts, sampling)):
            h.submit(str(i), p, ignore_eos=True, **params)
            h.step()  # arrivals between steps: chunks, prefix hits, mixed batches
        done = h.run_until_idle()
        results[disable] = {rid: (c.ids, [t for _, t in c.output_logprobs]) for rid, c in done.items()}
        assert [len(results[disable][str(i)][0]) for i in range(4)] == [8, 5, 3, 8]
        assert len(done["2"].output_logprobs) == 3
        assert (min(calls.values()) > 0) != disable, calls
        assert h.scheduler.check_memory_integrity()
        if mixed:
            assert h.scheduler.stats.mixed_decode_tokens > 0
        h.scheduler.close()
    assert results[False] == results[True]


@pytest.mark.parametrize("seed", range(3))
def test_overlap_stream_under_aborts_retraction_and_sampling(tiny_model_factory, seed):
    """The overlap loop on the native forward stream with a pool small enough to retract, chunked
    prefills, arrivals and aborts at random steps, seeded sampled, logprob and prompt-logprob
    requests beside greedy ones: every request ends once; one that was not aborted gives the plain
    loop's tokens, sampled ones too (a seeded draw is a function of the seed and the draw number,
    which retraction does not change); an aborted one a prefix of them; at idle nothing is held."""
    import random

    from baton.engine.io_struct import AbortReq
    from scheduler_harness import SchedulerHarness

    path = tiny_model_factory("llama")
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(4, 60))] for _ in range(16)]
    kinds = [rng.choice(["greedy", "greedy", "sampled", "logprobs", "prompt logprobs"]) for _ in prompts]
    assert len(set(kinds)) == 4, kinds
    common = dict(dtype="bfloat16", chunked_prefill_size=32, page_size=4)

    def params(i):
        # prompt logprobs need every row's hidden state: those batches run as Python calls on the stream
        extra = {"sampled": {"temperature": 0.8, "top_k": 20, "seed": i}, "logprobs": {"return_logprob": True},
                 "prompt logprobs": {"return_logprob": True, "logprob_start_len": 0}, "greedy": {}}[kinds[i]]
        return dict(max_new_tokens=24, ignore_eos=True, **extra)

    ref = SchedulerHarness(path, **common, max_total_tokens=4096, disable_overlap_schedule=True)
    for i, p in enumerate(prompts):
        ref.submit(str(i), p, **params(i))
    want = {rid: c.ids for rid, c in ref.run_until_idle().items()}
    ref.scheduler.close()

    h = SchedulerHarness(path, **common, max_total_tokens=320, enable_overlap_schedule=True)
    assert isinstance(h.scheduler.overlap, NativeStreamExecutor)
    aborted, pending = set(), list(range(len(prompts)))
    for i in range(8):  # a first wave at once; the rest arrive at random steps
        h.submit(str(i), prompts[i], **params(i))
        pending.remove(i)
    try:
        for _ in range(400):
            if pending and rng.random() < 0.4:
                i = pending.pop(0)
                h.submit(str(i), prompts[i], **params(i))
            if rng.random() < 0.05 and h.results:
                rid = rng.choice(list(h.results))
                aborted.add(rid)
                h.scheduler.process_input_requests([AbortReq(rid=rid)])
            if not h.step() and not pending and h.scheduler.is_idle():
                break
        h.run_until_idle()
        assert h.scheduler.stats.retractions > 0, "the pool is meant to be too small for every request at once"
        assert aborted and len(aborted) < len(prompts)
        for i in range(len(prompts)):
            got = h.results[str(i)]
            assert got.finish is not None and got.after_finish == 0, i
            if str(i) in aborted:
                assert got.ids == want[str(i)][:len(got.ids)], i
            else:
                assert got.ids == want[str(i)], f"request {i} ({kinds[i]}) differs from the plain loop's"
        assert h.scheduler.is_idle() and h.scheduler.check_memory_integrity()
    finally:
        h.scheduler.close()
