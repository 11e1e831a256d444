"""The scheduler's own CPU per decode step, the model's forward stubbed out (it returns token 11 for
every row), at the batch sizes given: process result, finish checks, streaming output, batch
preparation. Run from the repository root; compare code versions in turn, not across hours.

    .venv/bin/python scripts/sched_cpu.py 64,256
"""
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "engine"))

import torch  # noqa: E402
from scheduler_harness import SchedulerHarness  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from baton.engine.core.batch_result import GenerationBatchResult  # noqa: E402
from baton.engine.utils.gc_freeze import freeze_gc  # noqa: E402


def fake_forward(mwb, async_copy=False, future_map=None):
    ids = torch.full((len(mwb.seq_lens_cpu),), 11, dtype=torch.int64)
    return GenerationBatchResult(next_token_ids=ids.tolist(), next_token_ids_tensor=ids, next_token_ids_device=ids)


def main() -> None:
    torch.set_num_threads(1)
    path = make_tiny_model("llama", tempfile.mkdtemp(), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    for bs in map(int, (sys.argv[1] if len(sys.argv) > 1 else "64,256").split(",")):
        h = SchedulerHarness(path, disable_overlap_schedule=True, max_total_tokens=bs * 700, max_running_requests=bs)
        h.scheduler.worker.forward_batch_generation = fake_forward
        for i in range(bs):
            h.submit(str(i), [7 + (i * 13 + j) % 400 for j in range(64)], max_new_tokens=600, ignore_eos=True)
        for _ in range(10):  # every request prefilled and decoding
            h.step()
        # as a server's scheduler before it reports ready (and after start-up): otherwise the first
        # batch size measured shares the GIL with the grammar backend's preparation (264-500 us per
        # step instead of ~65)
        h.scheduler.grammar_backend.wait_prepared()
        freeze_gc("sched_cpu")
        per_step = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(50):
                h.step()
            per_step.append((time.perf_counter() - start) / 50 * 1e6)
        print(f"batch {bs}: {statistics.median(per_step):.0f} us per decode step (median of 7 x 50 steps)")


if __name__ == "__main__":
    main()
