"""The native CPU decode attention kernel (engine/kernels/) against a float64 reference.

The kernel must build here: CI has gcc, and a kernel that silently fell back to the torch path
would leave the engine's CPU hot path untested. head_dim 32/64/128 take the AVX-512 path on
machines that have it; 48 always takes the portable loops.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from baton.engine.kernels import build, cpu_attention


def _reference(q, k_buf, v_buf, req_to_token, rows, lens, scale):
    """softmax(q k^T * scale) v per request and head, in float64, from the pool gathered by hand."""
    bs, kv_heads, group, head_dim = q.shape
    out = torch.zeros(bs, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(bs):
        slots = req_to_token[rows[b], :lens[b]]
        keys, values = k_buf[slots].double(), v_buf[slots].double()  # [len, kv_heads, head_dim]
        for h in range(kv_heads):
            scores = q[b, h].double() @ keys[:, h].T * scale  # [group, len]
            out[b, h] = torch.softmax(scores, dim=-1) @ values[:, h]
    return out


def _case(bs, kv_heads, group, head_dim, dtype, lens, num_slots=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(bs, kv_heads, group, head_dim, generator=g).to(dtype)
    rows = torch.randperm(bs + 3, generator=g)[:bs]  # rows out of order, some unused
    req_to_token = torch.zeros(bs + 3, max(lens) + 5, dtype=torch.int64)
    slots = torch.randperm(num_slots - 1, generator=g) + 1  # scattered slots, never the dummy slot 0
    start = 0
    for b, n in enumerate(lens):
        req_to_token[rows[b], :n] = slots[start:start + n]
        start += n
    return q, k_buf, v_buf, req_to_token, rows, torch.tensor(lens, dtype=torch.int64)


def test_kernel_builds_here():
    assert cpu_attention.unavailable_reason(torch.float32, "cpu") is None
    assert cpu_attention.unavailable_reason(torch.bfloat16, "cpu") is None
    assert cpu_attention.unavailable_reason(torch.float16, "cpu") is None


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48, 40])  # 40: the portable loops (not a multiple of 16)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])  # blocks of 1-8 rows; bf16: transposed scores for 7 and 8 (and 32 x 2+)
def test_matches_reference(dtype, atol, head_dim, group):
    lens = [1, 17, 16, 200, 33, 5]  # 1 key, tails shorter than a vector, a multiple of 16, long
    q, k_buf, v_buf, r2t, rows, lens_t = _case(len(lens), 2, group, head_dim, dtype, lens)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens_t, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k_buf, v_buf, r2t, rows, lens_t, scale)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", [
    (torch.float32, torch.bfloat16, 2e-5), (torch.float32, torch.float8_e5m2, 2e-5),
    (torch.bfloat16, torch.float8_e5m2, 2e-2), (torch.float16, torch.float32, 3e-3)],
    ids=["f32-q-bf16-kv", "f32-q-e5m2-kv", "bf16-q-e5m2-kv", "f16-q-f32-kv"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48, 40])  # 40: the portable loops (not a multiple of 16)
def test_kv_cache_dtype_differs_from_the_query(q_dtype, kv_dtype, atol, head_dim):
    """A KV cache in its own dtype (--kv-cache-dtype): the kernel must read the pool as stored, so
    the reference is computed from the stored (rounded) values and the bound stays q's own."""
    lens = [1, 17, 16, 200, 33, 5]
    q, k_buf, v_buf, r2t, rows, lens_t = _case(len(lens), 2, 2, head_dim, torch.float32, lens)
    q, k_buf, v_buf = q.to(q_dtype), k_buf.to(kv_dtype), v_buf.to(kv_dtype)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens_t, scale)
    assert out.dtype == q_dtype
    expected = _reference(q, k_buf, v_buf, r2t, rows, lens_t, scale)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_softmax_handles_large_and_very_negative_scores():
    """Scores far apart (exp underflows to 0 for most keys) and large ones (exp must not overflow)."""
    q, k_buf, v_buf, r2t, rows, lens = _case(3, 1, 2, 64, torch.float32, [40, 3, 100])
    q = q * 30  # scores in the hundreds
    out = cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k_buf, v_buf, r2t, rows, lens, 1.0), atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_dim", [32, 48], ids=["avx512", "portable"])
def test_float16_subnormals_and_signed_zeros_convert_exactly(head_dim):
    """The half -> float conversions (F16C on AVX-512, bit manipulation in the portable loops) must
    keep subnormal halves, whose exponent field is 0, and negative zeros."""
    q, k_buf, v_buf, r2t, rows, lens = _case(2, 2, 2, head_dim, torch.float16, [9, 20])
    tiny = torch.tensor([6e-8, -3e-6, 6.1e-5, -0.0], dtype=torch.float16)  # subnormals and -0
    assert bool((tiny.float().abs() < 6.2e-5).all())
    v_buf[:, :, :4] = tiny
    k_buf[:, :, -4:] = tiny
    out = cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens, 0.3)
    expected = _reference(q, k_buf, v_buf, r2t, rows, lens, 0.3)
    # each output's first four values are convex combinations of the same four values: exactly them
    torch.testing.assert_close(out[..., :4].double(), expected[..., :4], atol=0, rtol=1e-3)
    torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=0)


def test_empty_request_gives_zeros_and_empty_batch_works():
    q, k_buf, v_buf, r2t, rows, lens = _case(2, 2, 2, 32, torch.float32, [0, 7])
    out = cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens, 0.1)
    assert bool((out[0] == 0).all())
    empty = cpu_attention.paged_decode_attention(q[:0], k_buf, v_buf, r2t, rows[:0], lens[:0], 0.1)
    assert empty.shape == (0, 2, 2, 32)


@pytest.mark.parametrize("corrupt", ["slot", "negative_slot", "row", "length"])
def test_out_of_range_indices_raise_instead_of_reading_memory(corrupt):
    q, k_buf, v_buf, r2t, rows, lens = _case(2, 2, 2, 32, torch.float32, [5, 9])
    if corrupt == "slot":
        r2t[rows[1], 3] = k_buf.shape[0]
    elif corrupt == "negative_slot":
        r2t[rows[0], 0] = -1
    elif corrupt == "row":
        rows[0] = r2t.shape[0]
    else:
        lens[1] = r2t.shape[1] + 1
    with pytest.raises(IndexError, match="out of range"):
        cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows, lens, 0.1)


def test_rejects_bad_types_and_shapes():
    q, k_buf, v_buf, r2t, rows, lens = _case(2, 2, 2, 32, torch.float32, [5, 9])
    with pytest.raises(TypeError, match="share one of"):
        cpu_attention.paged_decode_attention(q.double(), k_buf.double(), v_buf.double(), r2t, rows, lens, 0.1)
    with pytest.raises(TypeError, match="share one of"):
        cpu_attention.paged_decode_attention(q, k_buf.bfloat16(), v_buf, r2t, rows, lens, 0.1)
    with pytest.raises(TypeError, match="share one of"):  # float8 is a KV cache dtype, not a query dtype
        cpu_attention.paged_decode_attention(q.to(torch.float8_e5m2), k_buf, v_buf, r2t, rows, lens, 0.1)
    with pytest.raises(TypeError, match="int64"):
        cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t.int(), rows, lens, 0.1)
    with pytest.raises(ValueError, match="does not match"):
        cpu_attention.paged_decode_attention(q, k_buf[:, :1], v_buf[:, :1], r2t, rows, lens, 0.1)
    with pytest.raises(ValueError, match="rows and lengths"):
        cpu_attention.paged_decode_attention(q, k_buf, v_buf, r2t, rows[:1], lens, 0.1)


def test_non_contiguous_query_is_handled():
    q, k_buf, v_buf, r2t, rows, lens = _case(3, 2, 2, 32, torch.float32, [4, 8, 12])
    wide = torch.cat([q, torch.full_like(q, 1e4)], dim=-1)[..., :32]  # a strided view, as after a qkv split
    assert not wide.is_contiguous()
    out = cpu_attention.paged_decode_attention(wide, k_buf, v_buf, r2t, rows, lens, 0.2)
    torch.testing.assert_close(out.double(), _reference(q, k_buf, v_buf, r2t, rows, lens, 0.2), atol=2e-5, rtol=0)


def test_inside_torch_compile_it_is_one_opaque_op():
    q, k_buf, v_buf, r2t, rows, lens = _case(3, 2, 2, 32, torch.float32, [4, 8, 12])

    def attend(q, k_buf, v_buf, r2t, rows, lens):
        return cpu_attention.paged_decode_attention(q * 1.0, k_buf, v_buf, r2t, rows, lens, 0.2) + 1

    compiled = torch.compile(attend, fullgraph=True)  # fullgraph: a graph break would raise
    torch.testing.assert_close(compiled(q, k_buf, v_buf, r2t, rows, lens), attend(q, k_buf, v_buf, r2t, rows, lens))


def test_disable_switch_and_unsupported_inputs_have_reasons(monkeypatch):
    assert "not supported" in cpu_attention.unavailable_reason(torch.float64, "cpu")
    assert "KV cache dtype" in cpu_attention.unavailable_reason(torch.float32, "cpu", torch.float8_e4m3fn)
    assert cpu_attention.unavailable_reason(torch.float32, "cpu", torch.float8_e5m2) is None
    assert "not the CPU" in cpu_attention.unavailable_reason(torch.float32, "cuda")
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert cpu_attention.DISABLE_ENV in cpu_attention.unavailable_reason(torch.float32, "cpu")


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-baton")
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        cpu_attention.build()


def test_build_is_cached_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path))
    first = cpu_attention.build()
    mtime = first.stat().st_mtime_ns
    assert cpu_attention.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_a_mixed_extend_batch_routes_its_requests_to_the_native_kernels():
    """--enable-mixed-chunk: the last rows of an extend batch, one new token each over a cached
    prefix (the running requests' decode step), run in one native decode call; every other request
    (a one-token row in the middle included) in one native extend call, except those over
    NATIVE_EXTEND_MAX_TOKENS new tokens, which stay on SDPA. The result equals the per-request SDPA loop."""
    from baton.engine.layers.attention.torch_backend import _build_extend_metadata, _extend_attention

    torch.manual_seed(0)
    kv_heads, group, head_dim, slots = 2, 2, 16, 512
    k_buf, v_buf = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    prefix_lens, extend_lens = [0, 5, 3, 9, 20, 1], [7, 4, 1, 6, 1, 1]  # a one-token row at 2, a tail of 2
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    req_to_token = torch.zeros(8, 64, dtype=torch.int64)
    perm = torch.randperm(slots - 1) + 1  # scattered slots, none the dummy slot 0
    used = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = perm[used:used + n]
        used += n
    rows = torch.arange(len(seq_lens))
    # the pass's own K/V are already in the pool (forward_extend saves them first)
    n_tokens = sum(extend_lens)
    new_slots = torch.cat([req_to_token[r, p:s] for r, p, s in zip(rows.tolist(), prefix_lens, seq_lens)])
    k3, v3 = k_buf[new_slots].clone(), v_buf[new_slots].clone()
    q3 = torch.randn(n_tokens, kv_heads * group, head_dim)
    plain = _build_extend_metadata(req_to_token, rows, prefix_lens, extend_lens)
    assert plain.decode_tail == 0 and plain.native == [] and all(i is not None for i in plain.kv_indices)
    looped = _extend_attention(q3, k3, v3, k_buf, v_buf, plain, 0.25)
    meta = _build_extend_metadata(req_to_token, rows, prefix_lens, extend_lens, native=True)
    assert meta.decode_tail == 2 and meta.native == [0, 1, 2, 3]
    assert all(i is None for i in meta.kv_indices) and all(m is None for m in meta.masks)
    native = _extend_attention(q3, k3, v3, k_buf, v_buf, meta, 0.25, req_to_token, rows)
    torch.testing.assert_close(native, looped, atol=1e-5, rtol=1e-5)
    assert not torch.equal(native[-2:], torch.zeros_like(native[-2:]))
    # a request over the native limit stays on SDPA (its index row and causal mask are built)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("baton.engine.layers.attention.torch_backend.NATIVE_EXTEND_MAX_TOKENS", 5)
        capped = _build_extend_metadata(req_to_token, rows, prefix_lens, extend_lens, native=True)
        assert capped.native == [1, 2] and capped.kv_indices[0] is not None and capped.masks[3] is not None
        mixed = _extend_attention(q3, k3, v3, k_buf, v_buf, capped, 0.25, req_to_token, rows)
    torch.testing.assert_close(mixed, looped, atol=1e-5, rtol=1e-5)


def _extend_reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, scale):
    """Each request's causal attention in float32 SDPA over its gathered K/V."""
    outs, start = [], 0
    for row, prefix, extend in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        idx = req_to_token[row, :prefix + extend]
        ki, vi = k_buf[idx].float().transpose(0, 1)[None], v_buf[idx].float().transpose(0, 1)[None]
        qi = q[start:start + extend].float().transpose(0, 1)[None]
        mask = torch.arange(prefix + extend)[None, :] <= torch.arange(prefix, prefix + extend)[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k_buf.shape[1])
        outs.append(o[0].transpose(0, 1))
        start += extend
    return torch.cat(outs)


def _extend_inputs(dtype, kv_dtype, head_dim, prefix_lens, extend_lens, kv_heads=2, group=3, slots=4000, seed=0):
    torch.manual_seed(seed)
    k_buf = torch.randn(slots, kv_heads, head_dim).to(kv_dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim).to(kv_dtype)
    bs = len(prefix_lens)
    rows = torch.randperm(bs + 3)[:bs]
    req_to_token = torch.zeros(bs + 3, 1024, dtype=torch.int64)
    perm, used = torch.randperm(slots), 0
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        req_to_token[row, :p + e] = perm[used:used + p + e]
        used += p + e
    q = torch.randn(sum(extend_lens), kv_heads * group, head_dim).to(dtype)
    # this pass's own K/V: what forward_extend saved at the new slots (here the pool's rows, read back)
    new = torch.cat([req_to_token[r, p:p + e] for r, p, e in zip(rows.tolist(), prefix_lens, extend_lens)])
    kv_new = (k_buf[new].to(dtype), v_buf[new].to(dtype))
    return q, kv_new, k_buf, v_buf, req_to_token, rows, torch.tensor(prefix_lens), torch.tensor(extend_lens)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48, 40])  # 40: the portable loops (not a multiple of 16)
@pytest.mark.parametrize("dtype,kv_dtype,atol", [
    (torch.float32, torch.float32, 2e-5), (torch.bfloat16, torch.bfloat16, 1.6e-2),
    (torch.float16, torch.float16, 2e-3), (torch.float32, torch.float8_e5m2, 2e-5)])
def test_extend_kernel_matches_sdpa_per_request(dtype, kv_dtype, atol, head_dim):
    """Prefixes, one-token and empty extends, lengths off the 16-key, 4-row and 256-key blocks, scattered
    slots, GQA, every dtype pair: equal to causal SDPA over each request's gathered K/V."""
    prefix_lens, extend_lens = [0, 5, 100, 0, 17, 3, 600], [1, 70, 130, 33, 0, 129, 300]  # the last: 4 key tiles
    q, (k, v), k_buf, v_buf, r2t, rows, prefix, extend = _extend_inputs(dtype, kv_dtype, head_dim, prefix_lens,
                                                                         extend_lens)
    out = cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, rows, prefix, extend, 0.17)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _extend_reference(q, k_buf, v_buf, r2t, rows, prefix, extend, 0.17)
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), atol=atol, rtol=0)


def test_extend_kernel_subset_and_bad_input():
    """q_starts lets one call serve some of q's requests (the others' rows of the result mean
    nothing); out-of-range rows, slots, lengths and offsets raise instead of reading outside."""
    q, (k, v), k_buf, v_buf, r2t, rows, prefix, extend = _extend_inputs(torch.float32, torch.float32, 32, [4, 0, 9],
                                                                         [6, 8, 3])
    full = cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, rows, prefix, extend, 0.2)
    pick = torch.tensor([0, 2])
    part = cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, rows[pick], prefix[pick], extend[pick], 0.2,
                                                q_starts=torch.tensor([0, 14]))
    torch.testing.assert_close(part[:6], full[:6], atol=0, rtol=0)
    torch.testing.assert_close(part[14:], full[14:], atol=0, rtol=0)
    bad_slot = r2t.clone()
    bad_slot[rows[0], 3] = k_buf.shape[0]  # a cached prefix slot
    with pytest.raises(IndexError):
        cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, bad_slot, rows, prefix, extend, 0.2)
    with pytest.raises(IndexError):
        cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, torch.tensor([0, 1, r2t.shape[0]]), prefix, extend, 0.2)
    with pytest.raises(IndexError):
        cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, rows, prefix + 2000, extend, 0.2)
    with pytest.raises(ValueError):
        cpu_attention.paged_extend_attention(q[:-1], k[:-1], v[:-1], k_buf, v_buf, r2t, rows, prefix, extend, 0.2)
    with pytest.raises(IndexError):
        cpu_attention.paged_extend_attention(q, k, v, k_buf, v_buf, r2t, rows[pick], prefix[pick], extend[pick], 0.2,
                                             q_starts=torch.tensor([0, 15]))
    with pytest.raises(ValueError):
        wide = torch.randn(17, 2, 256)
        cpu_attention.paged_extend_attention(torch.randn(17, 6, 256), wide, wide, torch.randn(100, 2, 256),
                                             torch.randn(100, 2, 256), r2t, rows, prefix, extend, 0.2)


def test_a_kernel_is_rebuilt_when_a_header_beside_it_changes(tmp_path, monkeypatch):
    """The cache key covers the headers a source may include, so editing vec_math.h rebuilds the
    kernels that use it instead of loading a stale library."""
    from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library

    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text('#include "h.h"\nint value(void) { return VALUE; }\n')
    (tmp_path / "h.h").write_text("#define VALUE 1\n")
    first = build_library(src, DEFAULT_CFLAGS)
    assert build_library(src, DEFAULT_CFLAGS) == first  # cached
    (tmp_path / "h.h").write_text("#define VALUE 2\n")
    second = build_library(src, DEFAULT_CFLAGS)
    assert second != first
    import ctypes
    assert ctypes.CDLL(str(second)).value() == 2


def test_a_kernel_is_rebuilt_when_a_source_it_includes_changes(tmp_path, monkeypatch):
    """cpu_forward.c includes cpu_linear.c and paged_attention.c whole: editing either rebuilds it."""
    from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library

    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "sub").mkdir()
    src = tmp_path / "outer.c"
    src.write_text('#include "inner.c"\nint value(void) { return inner(); }\n')
    (tmp_path / "inner.c").write_text('#include "sub/leaf.c"\nstatic int inner(void) { return LEAF; }\n')
    (tmp_path / "sub" / "leaf.c").write_text("#define LEAF 1\n")
    first = build_library(src, DEFAULT_CFLAGS)
    assert build_library(src, DEFAULT_CFLAGS) == first  # cached
    (tmp_path / "sub" / "leaf.c").write_text("#define LEAF 2\n")  # two levels down
    second = build_library(src, DEFAULT_CFLAGS)
    assert second != first
    import ctypes
    assert ctypes.CDLL(str(second)).value() == 2
