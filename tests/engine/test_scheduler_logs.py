"""The scheduler's batch log lines, in SGLang's format (operators grep and graph these): one line per
prefill batch, one per --decode-log-interval decode steps, with the PD queues added on PD engines."""
from __future__ import annotations

import logging
import re

import pytest

from baton.engine.server_args import ServerArgs
from scheduler_harness import SchedulerHarness
from test_pd_scheduler import pair_factory  # noqa: F401 (fixture)

LOGGER = "baton.engine.scheduler.scheduler"
PREFILL = re.compile(r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
                     r"token usage: ([\d.]+), #running-req: (\d+), #queue-req: (\d+)(.*)$")
DECODE = re.compile(r"^Decode batch\. #running-req: (\d+), #token: (\d+), token usage: ([\d.]+), "
                    r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)(.*)$")


def _lines(caplog, pattern: re.Pattern) -> list[re.Match]:
    found = [pattern.match(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    return [m for m in found if m]


def test_prefill_and_decode_lines(tiny_model_factory, caplog):
    path = tiny_model_factory("llama")
    h = SchedulerHarness(path, device="cpu", max_total_tokens=2048, decode_log_interval=4)
    prompts = [[5 + i] * 20 + list(range(30, 30 + 7 * (i + 1))) for i in range(3)]
    caplog.set_level(logging.INFO, logger=LOGGER)
    for i, p in enumerate(prompts):
        h.submit(f"a{i}", p, max_new_tokens=13, ignore_eos=True)
    h.run_until_idle()

    (first,) = _lines(caplog, PREFILL)
    seqs, new, cached, usage, running, queued, pd = first.groups()
    assert (int(seqs), int(new), int(cached)) == (3, sum(map(len, prompts)), 0)
    assert (int(running), int(queued), pd) == (0, 0, "")
    assert 0 < float(usage) <= 1
    # 13 new tokens each: the prefill samples the first, 12 decode steps the rest -> lines at steps 4, 8, 12
    decodes = _lines(caplog, DECODE)
    assert len(decodes) == 3, [m.group(0) for m in decodes]
    for m in decodes:
        running, tokens, usage, throughput, queued, pd = m.groups()
        assert (int(running), int(queued), pd) == (3, 0, "")
        # every prompt and output token so far is in use (none is evictable while its request runs)
        assert sum(map(len, prompts)) < int(tokens) <= sum(map(len, prompts)) + 3 * 13
        assert float(usage) == pytest.approx(int(tokens) / 2048, abs=0.005)
        assert float(throughput) > 0
    assert [int(m.group(2)) for m in decodes] == sorted(int(m.group(2)) for m in decodes)

    caplog.clear()  # the same prompts again: the radix cache serves all but the last token of each
    for i, p in enumerate(prompts):
        h.submit(f"b{i}", p, max_new_tokens=2, ignore_eos=True)
    h.run_until_idle()
    (again,) = _lines(caplog, PREFILL)
    assert int(again.group(3)) == sum(len(p) - 1 for p in prompts)
    assert int(again.group(2)) == 3
    assert _lines(caplog, DECODE) == []  # one decode step each: under the interval
    assert h.scheduler.check_memory_integrity()


def test_no_batch_lines_above_info(tiny_model_factory, caplog):
    h = SchedulerHarness(tiny_model_factory("llama"), device="cpu", max_total_tokens=1024, decode_log_interval=1)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    h.submit("r", [7] * 12, max_new_tokens=5, ignore_eos=True)
    h.run_until_idle()
    assert len(h.results["r"].ids) == 5
    assert not _lines(caplog, PREFILL) and not _lines(caplog, DECODE)


def test_pd_lines_name_the_pd_queues(tiny_model_factory, pair_factory, caplog):  # noqa: F811
    pair = pair_factory(tiny_model_factory("llama"), max_total_tokens=1024, decode_log_interval=2)
    caplog.set_level(logging.INFO, logger=LOGGER)
    pair.submit("r", [9] * 16, max_new_tokens=6, ignore_eos=True)
    pair.run_until_idle()
    tails = [m.groups()[-1] for m in _lines(caplog, PREFILL) + _lines(caplog, DECODE)]
    assert any(re.fullmatch(r", #bootstrap-req: \d+, #inflight-req: \d+", t) for t in tails), tails
    assert any(re.fullmatch(r", #prealloc-req: \d+, #transfer-req: \d+", t) for t in tails), tails
    assert all(t for t in tails), "a PD engine's line without its queues"
    pair.assert_settled()


def test_decode_log_interval_must_be_positive():
    with pytest.raises(ValueError, match="--decode-log-interval"):
        ServerArgs(model_path="unused", decode_log_interval=0)


def test_a_mixed_prefill_line_counts_its_decode_steps(tiny_model_factory, caplog):
    """--enable-mixed-chunk: a prefill batch that carried the running requests' decode step says so
    (`#mixed-decode: N`, N = the running requests); the others keep the plain line."""
    path = tiny_model_factory("llama")
    h = SchedulerHarness(path, device="cpu", max_total_tokens=2048, enable_mixed_chunk=True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    h.submit("first", list(range(10, 40)), max_new_tokens=8, ignore_eos=True)
    h.step()
    h.step()  # "first" decodes
    h.submit("second", list(range(50, 70)), max_new_tokens=4, ignore_eos=True)
    h.run_until_idle()
    first, second = _lines(caplog, PREFILL)
    assert first.group(7) == ""
    assert (int(second.group(5)), second.group(7)) == (1, ", #mixed-decode: 1")
    assert h.scheduler.stats.mixed_decode_tokens == 1 and h.scheduler.check_memory_integrity()
    assert len(h.results["first"].ids) == 8 and len(h.results["second"].ids) == 4


def test_mixed_chunk_is_for_colocated_engines():
    for mode in ("prefill", "decode"):
        with pytest.raises(ValueError, match=f"--enable-mixed-chunk .* --disaggregation-mode {mode} engine"):
            ServerArgs(model_path="unused", enable_mixed_chunk=True, disaggregation_mode=mode)
