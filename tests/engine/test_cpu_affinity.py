"""CPU binding (--cpu-omp-threads-bind): the plan, and a served engine whose processes follow it."""
from __future__ import annotations

import os

import httpx
import pytest

from baton.engine.server_args import ServerArgs
from baton.engine.utils.cpu_affinity import CpuPlan, parse_cpu_list, plan_binding


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("2,1,2") == [1, 2]
    for bad in ("", "a", "1-", "3-1", "1;2", "-1"):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpu_list(bad)


def test_plan():
    assert plan_binding("off", [0, 1, 2, 3]) is None
    assert plan_binding("auto", [0, 1, 2, 3]) == CpuPlan((0, 1, 2), (3,))
    assert plan_binding("auto", [4]) is None  # one CPU: nothing to split
    assert plan_binding("1-2", [0, 1, 2, 3]) == CpuPlan((1, 2), (0, 3))
    assert plan_binding("0-3", [0, 1, 2, 3]) == CpuPlan((0, 1, 2, 3), ())  # frontend left unbound
    with pytest.raises(ValueError, match=r"CPUs \[7\] are not available"):
        plan_binding("0,7", [0, 1, 2, 3])


def test_server_args_validate_binding():
    with pytest.raises(ValueError, match="is for --device cpu"):
        ServerArgs(model_path="m", device="cuda", attention_backend="flashinfer", cpu_omp_threads_bind="auto")
    with pytest.raises(ValueError, match="not available"):
        ServerArgs(model_path="m", cpu_omp_threads_bind=str(max(os.sched_getaffinity(0)) + 1))


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs at least 2 CPUs; this runner has 1")
def test_served_engine_follows_the_plan(tiny_model_factory):
    from engine_server import running_engine

    cpus = sorted(os.sched_getaffinity(0))
    with running_engine(tiny_model_factory("llama"), "--cpu-omp-threads-bind", "auto") as engine:
        info = httpx.get(f"{engine.base_url}/get_server_info", timeout=10).json()
        assert info["cpu_affinity"] == cpus[:-1] and info["torch_threads"] == len(cpus) - 1
        http_pid = engine._proc.pid
        assert sorted(os.sched_getaffinity(http_pid)) == cpus[-1:]
        affinities = sorted(sorted(os.sched_getaffinity(p)) for p in _children(http_pid))
        assert cpus[:-1] in affinities and cpus[-1:] in affinities, affinities  # scheduler, detokenizer
        r = httpx.post(f"{engine.base_url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}},
                       timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
