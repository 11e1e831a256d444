"""Keep start-up objects out of Python's cyclic garbage collector.

Each engine process holds hundreds of thousands of long-lived objects after start-up (torch,
transformers, the tokenizer; with --enable-torch-compile also Dynamo's and Inductor's graphs and
guards). A full (generation 2) collection walks all of them: measured in the scheduler of a served
run, one took 477 ms with ~545k objects tracked, a stall every request in flight sees as latency.
`gc.freeze()` moves what exists now into a permanent generation the collector skips (vLLM does the
same after CUDA-graph capture); objects created later are collected as usual.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Iterator

logger = logging.getLogger(__name__)


def freeze_gc(process: str) -> int:
    """Collect garbage once, then freeze every surviving object; returns the frozen count."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logger.debug("%s: %d objects frozen out of the garbage collector", process, count)
    return count


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """A timed section without full collections of what existed before it: a benchmark client that
    also holds torch, transformers and an HF model paid ~150 ms for one in the middle of a measured
    run, a stall charged to whichever engine it was timing. Everything alive is frozen for the
    section (the collector still runs on what the section creates) and unfrozen after."""
    freeze_gc("timed section")
    try:
        yield
    finally:
        gc.unfreeze()
