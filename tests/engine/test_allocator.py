"""TokenToKVPoolAllocator: page rule, out-of-pages behaviour, double free, random round trips."""
import random

import pytest
import torch

from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator


def _check_page_rule(slots: torch.Tensor, positions: range, page: int) -> None:
    assert [s % page for s in slots.tolist()] == [p % page for p in positions]


def test_page1_alloc_free_round_trip():
    a = TokenToKVPoolAllocator(size=8, page_size=1, device="cpu")
    assert a.available_size() == a.total_size == 8
    x = a.alloc(5)
    assert x.dtype == torch.int64 and sorted(x.tolist()) == [1, 2, 3, 4, 5]  # slot 0 is the dummy page
    assert a.alloc(4) is None and a.available_size() == 3
    a.free(x[:2])
    y = a.alloc(5)
    assert set(y.tolist()) == {1, 2, 6, 7, 8}
    assert a.available_size() == 0
    a.free(torch.cat([x[2:], y]))
    assert a.available_size() == 8
    a.clear()
    assert a.available_size() == 8


def test_page1_extend_and_decode_ignore_last_locs():
    a = TokenToKVPoolAllocator(size=16, page_size=1, device="cpu")
    out = a.alloc_extend([0, 3], [4, 5], [-1, 9])
    assert out.numel() == 6 and len(set(out.tolist())) == 6
    dec = a.alloc_decode([5, 6], [out[3].item(), out[5].item()])
    assert dec.numel() == 2 and not set(dec.tolist()) & set(out.tolist())
    assert a.available_size() == 8


def test_alloc_requires_page1():
    a = TokenToKVPoolAllocator(size=32, page_size=16, device="cpu")
    with pytest.raises(AssertionError):
        a.alloc(3)


def test_extend_fresh_then_continue_partial_page():
    page = 16
    a = TokenToKVPoolAllocator(size=8 * page, page_size=page, device="cpu")
    first = a.alloc_extend([0], [20], [-1])  # one whole page + 4 tokens of a second page
    _check_page_rule(first, range(0, 20), page)
    assert first[:16].tolist() == list(range(first[0].item(), first[0].item() + 16))
    assert a.available_size() == 6 * page
    cont = a.alloc_extend([20], [40], [first[-1].item()])  # 12 tokens finish the page, 8 on a new one
    _check_page_rule(cont, range(20, 40), page)
    assert cont[:12].tolist() == list(range(first[-1].item() + 1, first[-1].item() + 13))
    assert a.available_size() == 5 * page
    assert len(set(first.tolist()) | set(cont.tolist())) == 40


def test_extend_batch_mixed_requests():
    page = 4
    a = TokenToKVPoolAllocator(size=16 * page, page_size=page, device="cpu")
    r0 = a.alloc_extend([0], [6], [-1])
    # r0 continues from position 6 (partial page), r1 is fresh, r2 has an aligned prefix, r3 adds nothing
    out = a.alloc_extend([6, 0, 8, 3], [9, 5, 10, 3], [r0[-1].item(), -1, 43, 77])  # 43 ends a page
    assert out.numel() == 3 + 5 + 2
    _check_page_rule(out[:3], range(6, 9), page)
    assert out[:2].tolist() == [r0[-1].item() + 1, r0[-1].item() + 2]
    _check_page_rule(out[3:8], range(0, 5), page)
    _check_page_rule(out[8:], range(8, 10), page)
    assert len(set(out.tolist()) | set(r0.tolist())) == 16


def test_decode_page_rule():
    page = 4
    a = TokenToKVPoolAllocator(size=8 * page, page_size=page, device="cpu")
    r = a.alloc_extend([0, 0], [3, 4], [-1, -1])
    free_before = a.available_size()
    # request 0 has positions 0..2 -> position 3 continues its page; request 1 filled its page
    out = a.alloc_decode([4, 5], [r[2].item(), r[6].item()])
    assert out[0].item() == r[2].item() + 1
    assert out[1].item() % page == 0 and out[1].item() // page not in {s // page for s in r.tolist()}
    assert a.available_size() == free_before - page


@pytest.mark.parametrize("page", [1, 16])
def test_out_of_pages_returns_none_without_side_effects(page):
    a = TokenToKVPoolAllocator(size=4 * page, page_size=page, device="cpu")
    held = a.alloc_extend([0], [3 * page], [-1])
    assert a.alloc_extend([0, 0], [page, 1], [-1, -1]) is None
    assert a.available_size() == page
    if page > 1:
        full_page_ends = [held[page - 1].item(), held[2 * page - 1].item()]
        assert a.alloc_decode([page + 1, 2 * page + 1], full_page_ends) is None
        assert a.available_size() == page
    rest = a.alloc_extend([0], [page], [-1])
    assert rest is not None and not set(rest.tolist()) & set(held.tolist())
    assert a.available_size() == 0


@pytest.mark.parametrize("page", [1, 16])
def test_double_free_and_foreign_slots_raise(page):
    a = TokenToKVPoolAllocator(size=4 * page, page_size=page, device="cpu")
    x = a.alloc_extend([0], [2 * page], [-1])
    a.free(x[:page])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[:page])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x)  # half of it is still free: nothing may be freed
    assert a.available_size() == 3 * page
    with pytest.raises(ValueError):
        a.free(torch.tensor([0]))  # the dummy page
    with pytest.raises(ValueError):
        a.free(torch.tensor([5 * page]))
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 3 * page


@pytest.mark.parametrize("page", [1, 4, 16])
def test_random_requests_keep_pages_disjoint(page):
    rng = random.Random(1234 + page)
    a = TokenToKVPoolAllocator(size=32 * page, page_size=page, device="cpu")
    live: dict[int, list[int]] = {}  # request id -> slots of positions 0..len-1
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            n = rng.randint(1, 3 * page)
            out = a.alloc_extend([0], [n], [-1])
            if out is not None:
                live[step] = out.tolist()
        elif op < 0.6:
            rids = rng.sample(sorted(live), k=min(len(live), rng.randint(1, 4)))
            out = a.alloc_decode([len(live[r]) + 1 for r in rids], [live[r][-1] for r in rids])
            for r, s in zip(rids, out.tolist() if out is not None else []):
                live[r].append(s)
        elif op < 0.8:
            r = rng.choice(sorted(live))
            extra = rng.randint(0, 2 * page)
            out = a.alloc_extend([len(live[r])], [len(live[r]) + extra], [live[r][-1]])
            if out is not None:
                live[r] += out.tolist()
        else:
            a.free(torch.tensor(live.pop(rng.choice(sorted(live)))))
        used_pages = {s // page for slots in live.values() for s in slots}
        all_slots = [s for slots in live.values() for s in slots]
        assert len(all_slots) == len(set(all_slots))
        assert 0 not in used_pages
        for slots in live.values():
            _check_page_rule(torch.tensor(slots), range(len(slots)), page)
        owners = {}
        for r, slots in live.items():
            for s in slots:
                assert owners.setdefault(s // page, r) == r, "a page is shared by two requests"
        assert a.available_size() + len(used_pages) * page == a.total_size
