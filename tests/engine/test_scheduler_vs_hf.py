"""Greedy tokens through the real scheduler must equal HF transformers `generate`, token for token,
under concurrency, shared prefixes (radix hits), chunked prefill, a KV pool so small that decode
must retract, overlap on and off, and page sizes 1 and 16."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton.engine.io_struct import AbortReq
from baton.engine.worker.executors.cuda_stream import CudaStreamExecutor
from scheduler_harness import SchedulerHarness

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
MAX_NEW = 12
_HF_CACHE: dict[tuple, list[int]] = {}


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts of 3..70 tokens; some share long prefixes, some exceed the 32-token chunk."""
    rng = random.Random(seed)
    base = [rng.randrange(6, 500) for _ in range(48)]
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (3, 9, 17, 33, 40, 70)]
    prompts += [base[:40] + [rng.randrange(6, 500) for _ in range(k)] for k in (1, 5, 9)]  # shared prefix
    prompts += [base + [7, 8], prompts[3][:20] + [9, 9, 9]]
    return prompts


def hf_greedy(model_path: str, prompt: list[int], max_new: int = MAX_NEW, ignore_eos: bool = False) -> list[int]:
    key = (model_path, tuple(prompt), max_new, ignore_eos)
    if key not in _HF_CACHE:
        model = _hf_model(model_path)
        saved = model.generation_config.eos_token_id
        if ignore_eos:  # a None passed in a GenerationConfig means "unset" and falls back to the model's
            model.generation_config.eos_token_id = None
        try:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        finally:
            model.generation_config.eos_token_id = saved
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


_MODELS: dict[str, torch.nn.Module] = {}


def _hf_model(path: str) -> torch.nn.Module:
    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


def run_workload(harness: SchedulerHarness, prompts: list[list[int]], staggered: bool = True,
                 max_new: int = MAX_NEW, **sampling) -> dict:
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        harness.submit(str(i), p, max_new_tokens=max_new, **sampling)
    if staggered:  # later arrivals join while the first ones decode
        for _ in range(3):
            harness.step()
    for i, p in enumerate(prompts[half:], start=half):
        harness.submit(str(i), p, max_new_tokens=max_new, **sampling)
    return harness.run_until_idle()


LOOPS = ["overlap", "inline", "plain"]


def assert_greedy_equals_hf(path: str, prompts: list[list[int]], results: dict) -> None:
    """Every request of a workload run got HF's greedy tokens."""
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p), f"request {i} (len {len(p)}) differs from HF"


def harness_for(path: str, loop: str, **overrides) -> SchedulerHarness:
    """`loop`: plain, overlap (CPU: the forward on a worker thread), or inline (the overlap loop's
    CUDA form, the launch in the scheduler thread, run here on the CPU)."""
    overlap = loop != "plain"
    h = SchedulerHarness(path, enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap, **overrides)
    if loop == "inline":
        s = h.scheduler
        s.executor.shutdown()
        s.executor = CudaStreamExecutor(s.worker, s.max_running_requests)
    assert (h.scheduler.overlap is not None) == overlap
    # on CUDA the overlap loop's executor is always the stream one
    cuda_form = loop == "inline" or str(overrides.get("device", "cpu")).startswith("cuda")
    assert overlap is False or isinstance(h.scheduler.overlap, CudaStreamExecutor) == cuda_form
    return h


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_hf_concurrent_chunked_radix(tiny_model_factory, arch, loop, page_size):
    path = tiny_model_factory(arch)
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096)
    prompts = workload()
    results = run_workload(h, prompts)
    assert_greedy_equals_hf(path, prompts, results)
    assert all(r.finish is not None for r in results.values())
    assert h.scheduler.stats.cache_hit_rate() > 0, "shared prefixes should hit the radix cache"
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_hf_under_retraction(tiny_model_factory, arch, loop, page_size):
    path = tiny_model_factory(arch)
    prompts = workload(seed=1)
    # Requests already running are budgeted at new_token_ratio (0.7) of their remaining tokens, so
    # a second wave is admitted into a pool that cannot hold everyone's 40 tokens: decode retracts.
    max_new = 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts))) // page_size * page_size
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=pool)
    results = run_workload(h, prompts, staggered=True, max_new=max_new, ignore_eos=True)
    assert h.scheduler.stats.retractions > 0, "the pool is meant to be too small for all requests at once"
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i} differs from HF after retraction"
    assert h.scheduler.check_memory_integrity()


def assert_same_logprobs(got, want, label: str = "") -> None:
    """Two runs of one request (Collected): the same scored ids, prompt and output logprobs within
    float rounding (the first prompt token has none), the same top-k ids."""
    assert [t for _, t in got.input_logprobs] == [t for _, t in want.input_logprobs], label
    torch.testing.assert_close([lp for lp, _ in got.input_logprobs[1:]], [lp for lp, _ in want.input_logprobs[1:]],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close([lp for lp, _ in got.output_logprobs], [lp for lp, _ in want.output_logprobs],
                               rtol=1e-4, atol=1e-4)
    assert [[t for _, t in top] for top in got.output_top_logprobs] == \
        [[t for _, t in top] for top in want.output_top_logprobs], f"{label}: top-k ids"


def _staggered(h: SchedulerHarness, prompts: list[list[int]], max_new: int, **sampling) -> dict:
    """Requests arrive one every two steps: prompts keep being prefilled while earlier ones decode."""
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=max_new, **sampling)
        h.step()
        h.step()
    return h.run_until_idle()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_chunk_matches_hf(tiny_model_factory, arch, loop, page_size):
    """--enable-mixed-chunk: each prefill batch also runs one decode step of the running requests
    (extends of one token each, behind the prompts' chunks); greedy tokens stay HF's, with chunked
    prefill, radix hits, and a pool small enough that decode also retracts."""
    path = tiny_model_factory(arch)
    prompts = workload(seed=4)
    max_new = 24
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts))) // page_size * page_size
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=pool,
                    enable_mixed_chunk=True)
    results = _staggered(h, prompts, max_new, ignore_eos=True)
    stats = h.scheduler.stats
    assert stats.mixed_decode_tokens > 0, "prefills arrived while others decoded: some should have been mixed"
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i} differs from HF"
    assert stats.cache_hit_rate() > 0
    assert h.scheduler.check_memory_integrity()


def test_mixed_chunk_compiled_matches_hf(tiny_model_factory):
    """--enable-mixed-chunk with --enable-torch-compile: the mixed batches run the compiled extend
    graph, whose attention op sends their decode tail to the native kernel; no new graph at serve
    time, tokens equal HF's."""
    from torch._dynamo.utils import counters

    path = tiny_model_factory("qwen3")
    prompts = workload(seed=6)
    h = SchedulerHarness(path, chunked_prefill_size=32, max_total_tokens=4096, enable_mixed_chunk=True,
                         enable_torch_compile=True)
    graphs = counters["stats"]["unique_graphs"]
    results = _staggered(h, prompts, 12, ignore_eos=True)
    assert counters["stats"]["unique_graphs"] == graphs, "serving compiled a new graph"
    assert h.scheduler.stats.mixed_decode_tokens > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 12, ignore_eos=True), f"request {i} differs from HF"
    assert h.scheduler.check_memory_integrity()


def test_mixed_chunk_logprobs_equal_unmixed(tiny_model_factory):
    """Prompt and output logprobs (top-k too) of requests whose decode steps rode in prefill batches
    equal those of the plain schedule; the mixed steps also stream every token once."""
    path = tiny_model_factory("qwen2")
    prompts = workload(seed=5)[:8]
    runs = {}
    for mixed in (False, True):
        h = SchedulerHarness(path, chunked_prefill_size=16, max_total_tokens=4096, enable_mixed_chunk=mixed)
        runs[mixed] = _staggered(h, prompts, 8, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        assert (h.scheduler.stats.mixed_decode_tokens > 0) == mixed
        assert h.scheduler.check_memory_integrity()
    for rid, want in runs[False].items():
        got = runs[True][rid]
        assert got.ids == want.ids and len(got.ids) == 8 and got.after_finish == 0, rid
        assert_same_logprobs(got, want, rid)


def test_mixed_chunk_leaves_a_chunk_room_however_many_decode():
    """The decode tokens a mixed batch carries come out of the chunk and input budgets, but never
    below one page: a long prompt still advances when more requests decode than a chunk holds."""
    from baton.engine.scheduler.schedule_policy import PrefillAdder

    class Pool:
        page_size = 16

        def available_size(self):
            return 10_000

    class Cache:
        def evictable_size(self):
            return 0

    plain = PrefillAdder(16, Cache(), Pool(), [], 0.7, 1024, 64)
    mixed = PrefillAdder(16, Cache(), Pool(), [], 0.7, 1024, 64, mixed_with_decode_tokens=40)
    crowded = PrefillAdder(16, Cache(), Pool(), [], 0.7, 1024, 64, mixed_with_decode_tokens=100)
    assert (plain.rem_chunk_tokens, plain.rem_input_tokens) == (64, 1024)
    assert (mixed.rem_chunk_tokens, mixed.rem_input_tokens) == (24, 984)
    assert (crowded.rem_chunk_tokens, crowded.rem_input_tokens) == (16, 924)
    assert PrefillAdder(16, Cache(), Pool(), [], 0.7, 1024, None, mixed_with_decode_tokens=40).rem_chunk_tokens is None


@pytest.mark.parametrize("disable_radix", [False, True], ids=["radix", "naive"])
def test_naive_cache_matches_radix(tiny_model_factory, disable_radix):
    path = tiny_model_factory("qwen3")
    h = SchedulerHarness(path, disable_radix_cache=disable_radix, chunked_prefill_size=32, max_total_tokens=2048)
    prompts = workload(seed=2)
    results = run_workload(h, prompts)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p)
    assert (h.scheduler.stats.cache_hit_rate() == 0) == disable_radix
    assert h.scheduler.check_memory_integrity()


def test_logprobs_match_hf(tiny_model_factory):
    path = tiny_model_factory("llama")
    model = _hf_model(path)
    h = SchedulerHarness(path, chunked_prefill_size=16, max_total_tokens=2048)
    prompt = workload()[4]  # 40 tokens: three chunks of 16
    h.submit("a", prompt, return_logprob=True, logprob_start_len=0, max_new_tokens=6)
    res = h.run_until_idle()["a"]
    full = prompt + res.ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    # input: token t scored by position t-1; the first has none
    assert res.input_logprobs[0] == (None, prompt[0])
    assert [t for _, t in res.input_logprobs] == prompt
    for t in range(1, len(prompt)):
        assert res.input_logprobs[t][0] == pytest.approx(float(logp[t - 1, prompt[t]]), abs=1e-4)
    assert [t for _, t in res.output_logprobs] == res.ids
    for j, (lp, tok) in enumerate(res.output_logprobs):
        assert lp == pytest.approx(float(logp[len(prompt) + j - 1, tok]), abs=1e-4)


def test_stop_conditions(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompt = workload()[2]
    ref = hf_greedy(path, prompt)
    h = SchedulerHarness(path, max_total_tokens=2048)
    h.submit("len", prompt, max_new_tokens=3)
    h.submit("stop_id", prompt, max_new_tokens=MAX_NEW, stop_token_ids=[ref[4]])
    stop_text = h.tokenizer.decode(ref[2:4])
    h.submit("stop_str", prompt, max_new_tokens=MAX_NEW, stop=[stop_text])
    res = h.run_until_idle()
    assert res["len"].ids == ref[:3] and res["len"].finish.kind == "length"
    first = ref.index(ref[4])
    assert res["stop_id"].ids == ref[:first + 1] and res["stop_id"].finish.matched == ref[4]
    assert res["stop_str"].finish.kind == "stop" and res["stop_str"].finish.matched == stop_text
    assert len(res["stop_str"].ids) <= 4
    assert h.scheduler.check_memory_integrity()


def finish_order(h: SchedulerHarness, max_steps: int = 500) -> list[str]:
    """Run until idle; the request ids in the order they finished."""
    order: list[str] = []
    for _ in range(max_steps):
        ran = h.step()
        order += [rid for rid, c in h.results.items() if c.finish is not None and rid not in order]
        if not ran and h.scheduler.is_idle():
            return order
    raise AssertionError(f"scheduler not idle after {max_steps} steps")


@pytest.mark.parametrize("arch,overlap", [("llama", True), ("llama", False), ("qwen3_5", True)],
                         ids=["overlap", "plain", "hybrid-overlap"])
def test_priority_preemption(tiny_model_factory, arch, overlap):
    """A high-priority arrival preempts low-priority running requests when the pool is full; the
    preempted ones resume later (a hybrid from a cached state checkpoint) and still produce HF's tokens."""
    path = tiny_model_factory(arch)
    prompts = workload(seed=3)[:6]
    h = SchedulerHarness(path, enable_priority_scheduling=True, priority_preemption_threshold=5,
                         max_running_requests=4, enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap, max_total_tokens=2048)
    for i, p in enumerate(prompts[:4]):
        h.submit(f"low{i}", p, max_new_tokens=30, ignore_eos=True, priority=0)
    for _ in range(4):
        h.step()
    h.submit("high", prompts[4], max_new_tokens=5, ignore_eos=True, priority=10)
    order = finish_order(h)
    assert h.scheduler.stats.preemptions >= 1
    assert order[0] == "high", f"the high-priority request should finish first, got {order}"
    for i, p in enumerate(prompts[:4]):
        assert h.results[f"low{i}"].ids == hf_greedy(path, p, 30, ignore_eos=True)
    assert h.results["high"].ids == hf_greedy(path, prompts[4], 5, ignore_eos=True)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_torch_compile_matches_hf(tiny_model_factory, overlap):
    """--enable-torch-compile: decode batches of changing size (requests join and finish) and, on
    CPU, extends (chunked, with and without a cached prefix) run the graphs compiled at start-up:
    no graph break, no compile while serving; greedy tokens are still HF's."""
    import torch._dynamo.utils

    path = tiny_model_factory("llama")
    h = SchedulerHarness(path, enable_torch_compile=True, enable_overlap_schedule=overlap,
                         disable_overlap_schedule=not overlap, chunked_prefill_size=32, max_total_tokens=4096)
    calls = []
    compiled = h.scheduler.worker.model_runner.compiled_model
    h.scheduler.worker.model_runner.compiled_model = lambda *a: calls.append((a[2].forward_mode.name, len(a[0]))) or compiled(*a)
    torch._dynamo.utils.counters.clear()
    prompts = workload()
    for i, p in enumerate(prompts):  # different lengths: the batch shrinks as requests finish
        h.submit(str(i), p, max_new_tokens=4 + 2 * i)
    results = h.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 4 + 2 * i), f"request {i} (len {len(p)}) differs from HF"
    sizes = {mode: {n for m, n in calls if m == mode} for mode in ("DECODE", "EXTEND")}
    assert len(sizes["DECODE"]) > 2, f"decode batches of several sizes should run compiled: {sizes}"
    assert len(sizes["EXTEND"]) > 1, f"extends of several token counts should run compiled: {sizes}"
    assert h.scheduler.stats.cache_hit_rate() > 0, "some extends should start from a cached prefix"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], "compiled while serving, not at start-up"
    assert h.scheduler.check_memory_integrity()


def test_compiled_models_of_other_sizes_in_one_process_keep_their_own_graphs(tiny_model_factory):
    """The compiled graphs skip Dynamo's guards on the model's modules, so nothing in the guards
    tells two models apart: each runner compiles through a code object of its own. Two models whose
    KV pools have the same shapes but whose MLPs differ, compiled one after the other in one
    process, each serve HF's greedy tokens (sharing graphs, the second ran the first's)."""
    import torch._dynamo.utils

    prompt = workload()[3]
    for intermediate in (96, 160):
        path = tiny_model_factory("llama", intermediate_size=intermediate)
        h = SchedulerHarness(path, enable_torch_compile=True, disable_overlap_schedule=True, max_total_tokens=2048)
        torch._dynamo.utils.counters.clear()
        h.submit("x", prompt, max_new_tokens=8)
        assert h.run_until_idle()["x"].ids == hf_greedy(path, prompt, 8), f"intermediate_size {intermediate}"
        assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], "compiled while serving"


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_logit_bias_matches_hf_sequence_bias(tiny_model_factory, loop):
    """OpenAI's logit_bias: greedy tokens equal HF `generate` with the same single-token
    `sequence_bias`, while a request without a bias in the same batch keeps HF's plain tokens."""
    path = tiny_model_factory("llama")
    prompts = workload()[:4]
    refs = [hf_greedy(path, p) for p in prompts]
    boost = next(t for t in range(6, 500) if all(t not in r for r in refs))  # a token greedy never picks
    bias = {boost: 8.0, refs[0][2]: -100.0}  # ... pushed up; one it picks, banned
    model = _hf_model(path)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                               sequence_bias={(t,): b for t, b in bias.items()})[0, len(p):].tolist()
                for p in prompts]
    assert expected[0] != refs[0]  # the bias changes what greedy picks, or this shows nothing
    h = harness_for(path, loop, max_total_tokens=2048)
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=MAX_NEW, logit_bias=bias)
    h.submit("unbiased", prompts[0], max_new_tokens=MAX_NEW)
    res = h.run_until_idle()
    assert [res[str(i)].ids for i in range(len(prompts))] == expected
    assert res["unbiased"].ids == refs[0]
    assert h.scheduler.check_memory_integrity()


# structured output: grammars whose every sentence is short, so a random model finishes each one
GRAMMARS = {
    "json_schema": json.dumps({"type": "object", "additionalProperties": False, "required": ["ok", "tag", "pair"],
                               "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                                              "pair": {"type": "array", "items": {"type": "boolean"},
                                                       "minItems": 2, "maxItems": 2}}}),
    "regex": r"(yes|no)-[0-9]{2,4}",
    "ebnf": 'root ::= "(" letter letter? ")"\nletter ::= "a" | "b" | "c"',
}

_HF_GRAMMAR_CACHE: dict[tuple, list[int]] = {}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("pool", [4096, 160], ids=["roomy", "retracting"])
def test_structured_output_matches_hf_under_the_same_grammar(tiny_model_factory, loop, pool):
    """json_schema / regex / ebnf: greedy tokens equal HF `generate` with xgrammar's logits processor
    on the same compiled grammar, every output is a whole sentence of its grammar ending in EOS, and
    a request without a grammar in the same batches keeps HF's plain tokens; also in a pool so small
    that decode retracts requests (their matchers keep the tokens already accepted)."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    path = tiny_model_factory("llama")
    prompts = workload()[:3]
    # retracting: admission budgets almost nothing for the tokens still to come, so decode runs out
    h = harness_for(path, loop, max_total_tokens=pool, constrained_json_disable_any_whitespace=True,
                    schedule_conservativeness=1.0 if pool >= 4096 else 0.05)
    s = h.scheduler
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        h.tokenizer, vocab_size=s.vocab_size, stop_token_ids=sorted(s.eos_token_ids)))
    compile_ = {"json_schema": lambda g: compiler.compile_json_schema(g, any_whitespace=False),
                "regex": compiler.compile_regex, "ebnf": compiler.compile_grammar}
    model = _hf_model(path)
    for i, p in enumerate(prompts):  # long requests without a grammar: they fill a small pool
        h.submit(f"free{i}", p, max_new_tokens=60, ignore_eos=True)
    expected = {}
    for kind, grammar in GRAMMARS.items():
        for i, p in enumerate(prompts):
            key = (path, kind, i)
            if key not in _HF_GRAMMAR_CACHE:  # the same for every loop
                out = model.generate(torch.tensor([p]), max_new_tokens=80, do_sample=False, pad_token_id=0,
                                     logits_processor=[LogitsProcessor(compile_[kind](grammar))])
                _HF_GRAMMAR_CACHE[key] = out[0, len(p):].tolist()
            expected[f"{kind}{i}"] = _HF_GRAMMAR_CACHE[key]
            h.submit(f"{kind}{i}", p, max_new_tokens=80, **{kind: grammar})
        for _ in range(3):  # later arrivals join while the first ones decode
            h.step()
    res = h.run_until_idle()
    assert (s.stats.retractions > 0) == (pool < 4096), s.stats.retractions
    for rid, ids in expected.items():
        assert res[rid].ids == ids, rid
        assert ids[-1] in s.eos_token_ids and res[rid].finish.kind == "stop", (rid, res[rid].finish)
        text = h.tokenizer.decode(ids[:-1])
        if rid.startswith("json_schema"):
            obj = json.loads(text)
            assert set(obj) == {"ok", "tag", "pair"} and obj["tag"] in ("red", "green", "blue"), text
        elif rid.startswith("regex"):
            assert re.fullmatch(GRAMMARS["regex"], text), text
        else:
            assert re.fullmatch(r"\([abc]{1,2}\)", text), text
    for i, p in enumerate(prompts):
        assert res[f"free{i}"].ids == hf_greedy(path, p, 60, ignore_eos=True)
    assert s.check_memory_integrity()


class _HeldCompiles:
    """The grammar backend's submit with each compile held until the test releases it (a slow
    compile, made deterministic): the real compile runs, its future is handed over later."""

    def __init__(self, backend) -> None:
        self.backend, self.held = backend, []
        self.real_submit, backend.submit = backend.submit, self.submit

    def submit(self, kind, spec):
        from concurrent.futures import Future

        held = Future()
        self.held.append((self.real_submit(kind, spec), held))
        return held

    def release(self) -> None:
        for real, held in self.held:
            try:
                held.set_result(real.result())
            except Exception as e:  # noqa: BLE001 - a bad grammar's error travels on
                held.set_exception(e)
        self.held.clear()


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_compiling_grammar_does_not_hold_up_running_requests(tiny_model_factory, loop):
    """While a grammar compiles, its request waits in the grammar queue with no memory and the
    running requests go on decoding; then it runs and equals HF under its grammar. An abort and a
    bad grammar end requests that are still waiting there, and nothing leaks."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    path = tiny_model_factory("llama")
    prompts = workload()[:2]
    h = harness_for(path, loop, max_total_tokens=4096)
    s = h.scheduler
    compiles = _HeldCompiles(s.grammar_backend)
    h.submit("free", prompts[0], max_new_tokens=30, ignore_eos=True)
    h.step()
    h.submit("regex", prompts[1], max_new_tokens=40, regex=GRAMMARS["regex"])
    h.submit("gone", prompts[1], max_new_tokens=40, regex="[a-c]{3}")
    h.submit("bad", prompts[1], max_new_tokens=40, regex="(unclosed")
    live = s.running_batch.reqs + (s.last_batch.reqs if s.last_batch is not None else [])
    free = next(r for r in live if r.rid == "free")
    before = len(free.output_ids)
    for _ in range(6):
        h.step()
    assert len(free.output_ids) >= before + 5 and "regex" not in h.results, (free.output_ids, h.results.keys())
    assert len(s.grammar_queue) == 3 and s.get_server_info()["num_grammar_queue_reqs"] == 3
    assert not s.is_idle()
    s.process_input_requests([AbortReq(rid="gone")])
    h.step()  # collects the outputs
    assert h.results["gone"].finish.kind == "abort" and len(s.grammar_queue) == 2
    compiles.release()
    res = h.run_until_idle()
    assert res["bad"].finish.kind == "abort" and res["bad"].finish.status_code == 400, res["bad"].finish
    assert "invalid regex" in res["bad"].finish.message
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        h.tokenizer, vocab_size=s.vocab_size, stop_token_ids=sorted(s.eos_token_ids)))
    want = _hf_model(path).generate(torch.tensor([prompts[1]]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                                    logits_processor=[LogitsProcessor(compiler.compile_regex(GRAMMARS["regex"]))])
    assert res["regex"].ids == want[0, len(prompts[1]):].tolist()
    assert res["free"].ids == hf_greedy(path, prompts[0], 30, ignore_eos=True)
    assert all(c.after_finish == 0 for c in res.values())
    assert s.check_memory_integrity()


def test_the_grammar_backend_is_prepared_before_ready_and_a_failed_preparation_stays_a_request_error(
        tiny_model_factory):
    """The scheduler waits for the vocabulary's indexing before it reports ready (it holds the GIL);
    a preparation that fails does not stop start-up: the first structured request reports it."""
    from transformers import AutoTokenizer

    from baton.engine.constrained.grammar import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, [0])
    backend.wait_prepared()
    assert backend._compiler is not None
    broken = GrammarBackend(object(), 512, [0])  # not a tokenizer: TokenizerInfo cannot be built
    broken.wait_prepared()  # returns; does not raise
    with pytest.raises(Exception):
        broken.submit("regex", "[a-c]{3}").result(timeout=60)
    backend.close()
    broken.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_grammar_waits_for_the_end_of_the_reasoning(tiny_model_factory, loop):
    """--reasoning-parser: a request that reasons samples freely until </think>, then under its
    grammar; equal to HF with xgrammar's processor started after that token (a bias on </think>
    makes the random model close the block after a few tokens). A request beside it that does not
    reason is constrained from its first token."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    path = tiny_model_factory("llama", extra_tokens=("<think>", "</think>"))
    h = harness_for(path, loop, reasoning_parser="qwen3")
    s = h.scheduler
    think_end = h.tokenizer.convert_tokens_to_ids("</think>")
    assert s.intake.think_end_id == think_end
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        h.tokenizer, vocab_size=s.vocab_size, stop_token_ids=sorted(s.eos_token_ids)))
    regex = GRAMMARS["regex"]
    model = _hf_model(path)

    def hf_after_think(prompt: list[int], bias: float) -> list[int]:
        state = {"inner": None}

        def proc(input_ids, scores):
            scores[:, think_end] += bias
            if state["inner"] is None and think_end in input_ids[0, len(prompt):].tolist():
                state["inner"] = LogitsProcessor(compiler.compile_regex(regex))
            return scores if state["inner"] is None else state["inner"](input_ids, scores)

        out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                             logits_processor=[proc])
        return out[0, len(prompt):].tolist()

    prompts = workload()[:4]
    expected = {}
    for i, p in enumerate(prompts):
        for bias in (2.0, 3.0, 4.0):  # the smallest that closes the block within the budget
            ids = hf_after_think(p, bias)
            if think_end in ids[:30]:
                break
        expected[f"think{i}"] = ids
        h.submit(f"think{i}", p, max_new_tokens=40, regex=regex, logit_bias={think_end: bias},
                 require_reasoning=True)
        h.submit(f"plain{i}", p, max_new_tokens=40, regex=regex)
        h.step()
    res = h.run_until_idle()
    assert any(ids.index(think_end) > 0 for ids in expected.values() if think_end in ids), expected
    for i, p in enumerate(prompts):
        assert res[f"think{i}"].ids == expected[f"think{i}"], i
        want = model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                              logits_processor=[LogitsProcessor(compiler.compile_regex(regex))])
        assert res[f"plain{i}"].ids == want[0, len(p):].tolist(), i
    assert s.check_memory_integrity()
