"""Triton helpers vs their torch paths. On CPU the kernels run under Triton's interpreter, which
must be enabled before triton is imported, so those checks run in a subprocess."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from baton.engine.triton_ops import resolve_future_token_ids, store_kv

INTERPRETED_CHECKS = textwrap.dedent(
    """
    import torch
    from baton.engine.triton_ops.future_resolve import resolve_future_token_ids_torch, resolve_future_token_ids_triton
    from baton.engine.triton_ops.kv_store import store_kv_torch, store_kv_triton

    g = torch.Generator().manual_seed(0)

    def check_store(n, heads, dim, buf_dtype, strided):
        slots = 3 * n + 8
        loc = torch.randperm(slots, generator=g)[:n]
        if strided:  # k and v as views of a fused qkv projection, like the models produce
            qkv = torch.randn(n, 3 * heads * dim, generator=g)
            k = qkv[:, heads * dim : 2 * heads * dim].view(n, heads, dim)
            v = qkv[:, 2 * heads * dim :].view(n, heads, dim)
        else:
            k, v = torch.randn(2, n, heads, dim, generator=g).unbind(0)
        bufs = [torch.randn(slots, heads, dim, generator=g).to(buf_dtype) for _ in range(2)]
        ref = [b.clone() for b in bufs]
        store_kv_triton(bufs[0], bufs[1], loc, k, v)
        store_kv_torch(ref[0], ref[1], loc, k, v)
        assert torch.equal(bufs[0], ref[0]) and torch.equal(bufs[1], ref[1]), (n, heads, dim, buf_dtype)

    check_store(13, 2, 8, torch.float32, strided=True)
    check_store(5, 3, 40, torch.float16, strided=False)  # row of 120 elements: a masked block
    check_store(2, 4, 512, torch.float32, strided=False)  # row of 2048: two blocks per token
    check_store(0, 2, 8, torch.float32, strided=False)

    for dtype, n in ((torch.int64, 3000), (torch.int32, 17), (torch.int64, 0)):
        fmap = torch.randint(0, 1000, (64,), generator=g, dtype=dtype)
        ids = torch.randint(0, 1000, (n,), generator=g, dtype=dtype)
        future = torch.rand(n, generator=g) < 0.4
        ids[future] = -torch.randint(1, 64, (int(future.sum()),), generator=g, dtype=dtype)
        a, b = ids.clone(), ids.clone()
        resolve_future_token_ids_triton(a, fmap)
        resolve_future_token_ids_torch(b, fmap)
        assert torch.equal(a, b) and bool((a >= 0).all()), dtype

    import torch.nn.functional as F
    from baton.engine.triton_ops.fused_moe import fused_experts_torch, fused_experts_triton

    def check_moe(n, experts, top_k, hidden, inter, dtype, unused=(), tol=1e-5):
        # the grouped-GEMM experts against the per-expert loop; `unused` experts are never routed to
        x = torch.randn(n, hidden, generator=g).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
        logits = torch.randn(n, experts, generator=g)
        logits[:, list(unused)] = -1e9
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        got = fused_experts_triton(x, w13, w2, weights.to(dtype), ids, F.silu)
        want = fused_experts_torch(x, w13, w2, weights.to(dtype), ids, F.silu)
        assert got.dtype == dtype and got.shape == (n, hidden)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=str((n, experts, top_k, dtype)))

    check_moe(5, 8, 2, 32, 48, torch.float32, unused=(3, 6))   # N, K not multiples of the tiles
    check_moe(1, 4, 4, 16, 16, torch.float32)                  # one token, every expert
    check_moe(90, 4, 2, 64, 80, torch.float32)                 # 45 rows per expert: blocks of 32, several per expert
    check_moe(300, 2, 1, 32, 16, torch.float32)                # 150 rows per expert: blocks of 64
    check_moe(7, 16, 3, 32, 24, torch.float16, tol=2e-3)
    check_moe(0, 4, 2, 16, 16, torch.float32)
    print("INTERPRETED OK")
    """
)


def test_triton_kernels_match_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CHECKS], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "INTERPRETED OK" in proc.stdout


def test_cpu_dispatch_store_kv():
    k_buf, v_buf = torch.zeros(10, 2, 4), torch.zeros(10, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loc = torch.tensor([7, 1, 4])
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


def test_cpu_dispatch_resolve_future_token_ids():
    ids = torch.tensor([5, -1, 7, -3, -2, 0])
    resolve_future_token_ids(ids, torch.tensor([0, 100, 200, 300]))
    assert ids.tolist() == [5, 100, 7, 300, 200, 0]


@pytest.mark.gpu
def test_triton_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    k_buf = torch.zeros(64, 4, 64, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    k, v = torch.randn(9, 4, 64, device="cuda"), torch.randn(9, 4, 64, device="cuda")
    loc = torch.randperm(64, device="cuda")[:9]
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k.bfloat16()) and torch.equal(v_buf[loc], v.bfloat16())
    ids = torch.tensor([5, -1, 7, -3], device="cuda")
    resolve_future_token_ids(ids, torch.tensor([0, 100, 200, 300], device="cuda"))
    assert ids.tolist() == [5, 100, 7, 300]


@pytest.mark.parametrize("n,experts,top_k,block_m", [(1, 8, 2, 16), (6, 4, 4, 16), (37, 8, 3, 16), (200, 3, 2, 64),
                                                     (5, 64, 8, 16)])
def test_moe_align_groups_every_slot_by_expert(n, experts, top_k, block_m):
    """Each slot once; each block one expert; runs padded to whole blocks; the bound on the length."""
    from baton.engine.triton_ops.fused_moe import moe_align, padded_slots

    g = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
    sorted_slots, block_expert, num_padded = moe_align(ids, experts, block_m)
    slots = n * top_k
    assert sorted_slots.numel() == padded_slots(slots, experts, block_m) == block_expert.numel() * block_m
    used = int(num_padded)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()) <= sorted_slots.numel()
    assert sorted(sorted_slots[sorted_slots < slots].tolist()) == list(range(slots))
    assert bool((sorted_slots[used:] == slots).all())  # only padding past the used length
    flat = ids.flatten()
    for b in range(used // block_m):
        block = sorted_slots[b * block_m:(b + 1) * block_m]
        real = block[block < slots]
        assert real.numel() > 0, f"block {b} is all padding"
        assert bool((flat[real] == block_expert[b]).all()), f"block {b} mixes experts"
        assert real.tolist() == sorted(real.tolist())  # stable: a token's slots keep their order
