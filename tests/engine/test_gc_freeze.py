"""Start-up objects are frozen out of the garbage collector: the scheduler does it on FreezeGCReq
(which the HTTP server sends once its warm-up is over), and keeps serving correctly after."""
from __future__ import annotations

import gc

import pytest

from baton.engine.io_struct import FreezeGCReq
from baton.engine.utils.gc_freeze import freeze_gc, gc_paused
from scheduler_harness import SchedulerHarness


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()  # do not leave the test process's objects uncollectable


def test_freeze_gc_moves_live_objects_to_the_permanent_generation(unfrozen):
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(1000)]
    frozen = freeze_gc("test")
    # the count as of the freeze: threads other tests left in this process may free frozen objects
    # since (it fell by 2 once in CI), never add to them
    assert frozen >= gc.get_freeze_count() > len(kept)
    _make_cycles(10)  # cycles created after the freeze are collected as usual
    assert gc.collect() >= 10


def test_gc_paused_freezes_for_the_section_only(unfrozen):
    kept = [object() for _ in range(1000)]
    with gc_paused():
        assert gc.get_freeze_count() > len(kept)  # what lived before: out of the collector's walk
        _make_cycles(10)
        assert gc.collect() >= 10  # what the section creates is still collected
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyError):  # unfrozen on the way out of a failure too
        with gc_paused():
            raise KeyError("x")
    assert gc.get_freeze_count() == 0


def _make_cycles(n: int) -> None:
    for _ in range(n):
        node: list = []
        node.append(node)


def test_scheduler_freezes_on_request_and_keeps_serving(unfrozen, tiny_model_factory):
    h = SchedulerHarness(tiny_model_factory("llama"), max_total_tokens=4096)
    h.submit("before", [5, 6, 7, 8], max_new_tokens=4)
    h.run_until_idle()
    assert gc.get_freeze_count() == 0
    h.scheduler.process_input_requests([FreezeGCReq()])
    assert gc.get_freeze_count() > 10_000  # torch, transformers and the model are in there
    h.submit("after", [5, 6, 7, 8], max_new_tokens=4)
    out = h.run_until_idle()
    assert out["after"].ids == out["before"].ids and len(out["after"].ids) == 4
    assert h.scheduler.check_memory_integrity()
