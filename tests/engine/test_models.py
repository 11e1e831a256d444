"""Models + torch paged attention + KV pools + loader, checked against HF transformers (float32).

Every case builds a ForwardBatch by hand with a trivial slot assignment: each request owns whole
pages taken from page 1 on, in a shuffled order (page 0 is the dummy page), so gathers through
req_to_token are exercised for page_size 1 and 4.
"""
from __future__ import annotations

import math

import pytest
import torch

from baton.engine.core.forward_batch import ForwardBatch, ForwardMode
from baton.engine.layers.attention import create_attention_backend
from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from baton.engine.model_config import ModelConfig
from baton.engine.core.forward_batch import ForwardBatch, ForwardMode
from baton.engine.model_executor.model_loader import load_model, resolve_dtype
from baton.engine.models import get_model_class, supported_architectures

ATOL = 1e-4
NEW_TOKENS = 8
PROMPTS = [[5, 17, 200, 33, 41, 90, 7], [300, 12, 8, 19, 250, 77, 66, 13, 401, 99, 23, 61], [44, 45, 46]]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-dense0-unnormed": ("qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": False}),
}


class PagedRunner:
    """Drives the model the way the model runner will: pools + backend + hand-built ForwardBatch."""

    def __init__(self, model, config, page_size: int, max_reqs: int = 4, max_len: int = 48, seed: int = 0,
                 native_decode: bool = False, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.page_size = model, page_size
        pages_per_req = math.ceil(max_len / page_size)
        heads = config.heads
        self.req_pool = ReqToTokenPool(max_reqs, max_len, "cpu")
        self.kv_pool = MHATokenToKVPool(max_reqs * pages_per_req * page_size, page_size, dtype,
                                        heads.num_kv_heads, heads.head_dim, config.text.num_layers, "cpu")
        self.backend = create_attention_backend("torch", native_decode=native_decode)
        pages = torch.randperm(max_reqs * pages_per_req, generator=torch.Generator().manual_seed(seed)) + 1
        for row in self.req_pool.alloc(max_reqs):
            own = pages[row * pages_per_req:(row + 1) * pages_per_req]
            slots = (own[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()  # [pages * page_size]
            self.req_pool.req_to_token[row] = slots[:max_len]

    def run(self, mode: ForwardMode, rows: list[int], tokens: list[list[int]], prefix_lens: list[int]) -> torch.Tensor:
        """tokens[i]: new tokens of request rows[i], from position prefix_lens[i]. Returns logits [num_tokens, vocab]."""
        r2t = self.req_pool.req_to_token
        positions = torch.cat([torch.arange(p, p + len(t)) for p, t in zip(prefix_lens, tokens)])
        out_cache_loc = torch.cat([r2t[r, p:p + len(t)] for r, p, t in zip(rows, prefix_lens, tokens)])
        seq_lens = [p + len(t) for p, t in zip(prefix_lens, tokens)]
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(rows), input_ids=torch.tensor(sum(tokens, [])), positions=positions,
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens), out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens if mode.is_extend() else None,
            extend_seq_lens_cpu=[len(t) for t in tokens] if mode.is_extend() else None,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool, attn_backend=self.backend)
        self.backend.init_forward_metadata(fb)
        with torch.no_grad():
            return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))

    def decode_greedy(self, rows: list[int], last_logits: torch.Tensor, seq_lens: list[int], steps: int):
        """Greedy decode all rows together; returns (tokens [bs][steps], logits [steps, bs, vocab])."""
        out, step_logits = [[] for _ in rows], []
        next_ids = last_logits.argmax(-1).tolist()
        for _ in range(steps):
            for i, t in enumerate(next_ids):
                out[i].append(t)
            logits = self.run(ForwardMode.DECODE, rows, [[t] for t in next_ids], [s for s in seq_lens])
            step_logits.append(logits)
            seq_lens = [s + 1 for s in seq_lens]
            next_ids = logits.argmax(-1).tolist()
        return out, torch.stack(step_logits)


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tiny_model_factory):
    """(ours, config, hf) for one CASES entry, loaded from the same checkpoint."""
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[request.param]
    path = tiny_model_factory(arch, **overrides)
    ours, config, dtype = load_model(path)
    assert dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, config, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def hf_generate(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy generation with EOS disabled so every prompt yields exactly `steps` tokens."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == steps
    return tokens, torch.stack([step[0] for step in out.logits]).float()  # [steps, vocab]


@pytest.mark.parametrize("native_decode", [False, True], ids=["gather", "native"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_extend_then_decode_matches_hf(models, page_size, native_decode):
    ours, config, hf = models
    runner = PagedRunner(ours, config, page_size, native_decode=native_decode)
    rows = [2, 0, 1]  # rows out of order on purpose
    logits = runner.run(ForwardMode.EXTEND, rows, PROMPTS, [0, 0, 0])
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)

    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    tokens, step_logits = runner.decode_greedy(rows, logits[ends], [len(p) for p in PROMPTS], NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        hf_tokens, hf_step_logits = hf_generate(hf, prompt, NEW_TOKENS)
        assert tokens[i] == hf_tokens, f"request {i}"
        # our step s decodes the token HF chose at step s, giving HF's logits of step s + 1
        torch.testing.assert_close(step_logits[:-1, i], hf_step_logits[1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_with_cached_prefix_matches_hf(models, page_size):
    ours, config, hf = models
    runner = PagedRunner(ours, config, page_size)
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[0]
    prefix = 8  # page-aligned for both page sizes, as the radix cache hands out prefixes
    runner.run(ForwardMode.EXTEND, [3], [long_prompt[:prefix]], [0])
    # second pass: the rest of the long prompt on top of its cached prefix, batched with a fresh request
    logits = runner.run(ForwardMode.EXTEND, [3, 1], [long_prompt[prefix:], short_prompt], [prefix, 0])
    rest = len(long_prompt) - prefix
    torch.testing.assert_close(logits[:rest], hf_logits(hf, long_prompt)[prefix:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[rest:], hf_logits(hf, short_prompt), atol=ATOL, rtol=0)

    last = logits[[rest - 1, len(logits) - 1]]
    tokens, _ = runner.decode_greedy([3, 1], last, [len(long_prompt), len(short_prompt)], 4)
    assert tokens[0] == hf_generate(hf, long_prompt, 4)[0]
    assert tokens[1] == hf_generate(hf, short_prompt, 4)[0]


@pytest.mark.parametrize("native_decode", [False, True], ids=["gather", "native"])
def test_decode_ignores_garbage_in_padding_and_dummy_page(models, native_decode):
    """Padding in the batched decode gather must be masked, and the native kernel must read only a
    request's own slots: poison every slot no request owns."""
    ours, config, hf = models
    runner = PagedRunner(ours, config, page_size=4, native_decode=native_decode)
    rows = [0, 1]
    logits = runner.run(ForwardMode.EXTEND, rows, [PROMPTS[1], PROMPTS[2]], [0, 0])
    owned = torch.cat([runner.req_pool.req_to_token[r, :len(p) + 1] for r, p in zip(rows, [PROMPTS[1], PROMPTS[2]])])
    for layer in range(config.text.num_layers):
        for buf in runner.kv_pool.get_kv_buffer(layer):
            keep = buf[owned].clone()
            buf.fill_(1e4)
            buf[owned] = keep
    last = logits[[len(PROMPTS[1]) - 1, len(logits) - 1]]
    tokens, _ = runner.decode_greedy(rows, last, [len(PROMPTS[1]), len(PROMPTS[2])], 1)
    step = runner.run(ForwardMode.DECODE, rows, [[t[0]] for t in tokens], [len(PROMPTS[1]), len(PROMPTS[2])])
    assert torch.isfinite(step).all()
    torch.testing.assert_close(step[1], hf_logits(hf, PROMPTS[2] + tokens[1])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.125), (torch.float16, 0.02)], ids=["bf16", "f16"])
def test_half_precision_native_decode_matches_gather(tiny_model_factory, dtype, atol):
    """In bfloat16 and float16 the native CPU kernel serves decode (no silent fallback) and gives the
    gather + SDPA path's logits."""
    from baton.engine.kernels import cpu_attention

    assert cpu_attention.unavailable_reason(dtype, "cpu") is None
    path = tiny_model_factory("llama", hidden_size=128)  # head_dim 32: the AVX-512 path where there is one
    ours, config, loaded = load_model(path, dtype=str(dtype).removeprefix("torch."))
    assert loaded == dtype
    rows, lens = [1, 0], [len(PROMPTS[1]), len(PROMPTS[2])]
    steps = []
    for native in (False, True):
        runner = PagedRunner(ours, config, page_size=4, native_decode=native, dtype=dtype)
        logits = runner.run(ForwardMode.EXTEND, rows, [PROMPTS[1], PROMPTS[2]], [0, 0])
        last = logits[[lens[0] - 1, len(logits) - 1]]
        steps.append(runner.decode_greedy(rows, last, lens, 3))
    assert steps[1][0] == steps[0][0]
    # a few units in the last place of the logits (bf16 keeps 8 bits of mantissa, f16 11)
    torch.testing.assert_close(steps[1][1], steps[0][1], atol=atol, rtol=0)


# ---- pools, loader, registry, fixtures ----

def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int64
    rows = pool.alloc(2)
    assert len(set(rows)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1  # nothing taken on failure
    pool.free(rows[0])
    pool.free([rows[1]])
    assert pool.available_size() == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free(rows[0])
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3


def test_kv_pool_layout_and_writes():
    pool = MHATokenToKVPool(size=16, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                            device="cpu")
    k, v = pool.get_kv_buffer(1)
    assert k.shape == v.shape == (20, 2, 8) and k.dtype == torch.bfloat16  # size + one dummy page
    assert pool.get_key_buffer(1) is k and pool.get_value_buffer(1) is v
    loc = torch.tensor([4, 9, 19])
    cache_k, cache_v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool.set_kv_buffer(1, loc, cache_k, cache_v)
    torch.testing.assert_close(k[loc], cache_k.to(torch.bfloat16))
    torch.testing.assert_close(v[loc], cache_v.to(torch.bfloat16))
    assert not pool.get_key_buffer(0).any(), "other layers untouched"

    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    assert len(ptrs) == len(lens) == len(item_lens) == 6
    assert ptrs[:3] == [t.data_ptr() for t in pool.k_buffer] and ptrs[3:] == [t.data_ptr() for t in pool.v_buffer]
    assert lens == [20 * 2 * 8 * 2] * 6 and item_lens == [2 * 8 * 2] * 6


def test_registry_and_attention_factory_errors():
    expected = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
    assert expected <= set(supported_architectures())
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):  # the message lists what is supported
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ImportError, match="flashinfer-python"):
        create_attention_backend("flashinfer")
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope")


def test_load_model_rejects_unknown_architecture(tiny_model_factory, tmp_path):
    import shutil

    path = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_factory("llama"), path)
    config = (path / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        load_model(str(path))


def test_dtype_resolution():
    from transformers import LlamaConfig

    fp16, bf16 = ModelConfig.from_hf(LlamaConfig(dtype="float16")), ModelConfig.from_hf(LlamaConfig(dtype="bfloat16"))
    assert resolve_dtype("auto", fp16, "cpu") == torch.float32  # CPU fp16 matmul is slow
    assert resolve_dtype("auto", fp16, "cuda") == torch.float16
    assert resolve_dtype("auto", bf16, "cpu") == torch.bfloat16
    assert resolve_dtype("float16", bf16, "cpu") == torch.float16  # explicit wins
    assert resolve_dtype("auto", ModelConfig.from_hf(LlamaConfig()), "cpu") == torch.float32
    fp32 = ModelConfig.from_hf(LlamaConfig(dtype="float32"))
    assert resolve_dtype("auto", fp32, "cuda") == torch.float16  # as SGLang and vLLM: half precision on a GPU
    assert resolve_dtype("auto", bf16, "cuda:1") == torch.bfloat16
    assert resolve_dtype("float32", fp32, "cuda") == torch.float32  # explicit wins


def test_bfloat16_load_keeps_rope_in_float32(tiny_model_factory):
    model, _, dtype = load_model(tiny_model_factory("qwen3"), dtype="bfloat16")
    attn = model.model.layers[0].self_attn
    assert dtype == torch.bfloat16 and attn.qkv_proj.weight.dtype == torch.bfloat16
    assert attn.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32, "loader must restore the default dtype"


def test_tiny_tokenizer_matches_model_and_has_chat_template(tiny_model_factory):
    from transformers import AutoConfig, AutoTokenizer

    from tiny_models import BOS_ID, EOS_ID

    path = tiny_model_factory("qwen2")
    tok, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert len(tok) == config.vocab_size
    assert (tok.eos_token_id, tok.bos_token_id) == (config.eos_token_id, config.bos_token_id) == (EOS_ID, BOS_ID)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello world!"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < config.vocab_size


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    LLAMA3_ROPE,
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_matches_hf(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from baton.engine.layers.rotary_embedding import get_rope

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=dict(rope))
    ours = get_rope(ModelConfig.from_hf(config).text, head_dim=16)
    positions = torch.arange(0, 512, 7)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions, torch.float32)  # one half of HF's (its two halves repeat)
    torch.testing.assert_close(torch.cat((cos, cos), dim=-1), hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), dim=-1), hf_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotation_is_hfs_bit_for_bit(dtype):
    """The tables and the half-by-half rotation give exactly HF's apply_rotary_pos_emb, eager in
    both dtypes and compiled in float32, and reserve() extends the tables past the config's
    positions. Compiled bfloat16 computes the rotation in float32 and rounds once (Inductor drops
    intermediate roundings): within one bfloat16 rounding of HF's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from baton.engine.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    inv_freq, scaling = compute_inv_freq(ModelConfig.from_hf(config).text, 16)
    rope = RotaryEmbedding(16, inv_freq, scaling, max_positions=256)
    rope.reserve(1000, "cpu")  # a --context-length past the config's
    assert rope.cos_table.shape == (1000, 8)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 1000, (37,), generator=g)
    q = torch.randn(37, 4 * 16, generator=g).to(dtype)
    k = torch.randn(37, 2 * 16, generator=g).to(dtype)
    config.max_position_embeddings = 1000
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.view(1, 37, 4, 16), k.view(1, 37, 2, 16), cos, sin, unsqueeze_dim=2)
    for fn, exact in ((rope, True), (torch.compile(rope, dynamic=True, fullgraph=True), dtype == torch.float32)):
        our_q, our_k = fn(positions, q, k)
        tol = {"atol": 0, "rtol": 0} if exact else {"atol": 2 ** -6, "rtol": 2 ** -7}
        torch.testing.assert_close(our_q, hf_q.reshape(37, 64), **tol)
        torch.testing.assert_close(our_k, hf_k.reshape(37, 32), **tol)
