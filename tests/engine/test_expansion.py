"""How a request expands into copies (entrypoints/expansion.py): prompt-major order, seeds + k, and the
three shapes of a PD field (one value, one per prompt, one per choice as sglang-router sends for chat
with n > 1)."""
from __future__ import annotations

import pytest

from baton.engine.entrypoints.expansion import expand
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.tokenizer_manager import GenerateInput, RequestError


def _prompts(m: int, seed=None) -> list[GenerateInput]:
    return [GenerateInput(SamplingParams(seed=seed), input_ids=[i + 1], rid=f"r{i}") for i in range(m)]


def _fields(objs: list[GenerateInput], name: str) -> list:
    return [getattr(o, name) for o in objs]


def test_copies_are_prompt_major_with_seed_plus_k_and_their_own_ids():
    objs = expand(_prompts(2, seed=7), [3, 1], {})
    assert [o.input_ids for o in objs] == [[1], [1], [1], [2]]
    assert [o.rid for o in objs] == ["r0-0", "r0-1", "r0-2", "r1"]
    assert [o.sampling_params.seed for o in objs] == [7, 8, 9, 7]
    assert all(o.sampling_params.n == 1 for o in objs)


def test_one_room_fans_out_over_every_request():
    objs = expand(_prompts(2), [2, 2], {"bootstrap_room": 100, "bootstrap_host": "h", "bootstrap_port": 5})
    assert _fields(objs, "bootstrap_room") == [100, 101, 102, 103]
    assert _fields(objs, "bootstrap_host") == ["h"] * 4 and _fields(objs, "bootstrap_port") == [5] * 4
    assert _fields(expand(_prompts(1), [1], {"bootstrap_room": 2**63 - 1}), "bootstrap_room") == [2**63 - 1]
    assert _fields(expand(_prompts(1), [2], {"bootstrap_room": 2**63 - 1}), "bootstrap_room") == [2**63 - 1, 0]


def test_one_value_per_prompt_fans_each_prompts_room_over_its_choices():
    objs = expand(_prompts(2), [2, 2], {"bootstrap_room": [10, 50], "bootstrap_host": ["a", "b"],
                                        "data_parallel_rank": [0, 1]})
    assert _fields(objs, "bootstrap_room") == [10, 11, 50, 51]
    assert _fields(objs, "bootstrap_host") == ["a", "a", "b", "b"]
    assert _fields(objs, "data_parallel_rank") == [0, 0, 1, 1]


def test_one_value_per_choice_is_taken_as_given():
    """sglang-router's chat with n = 2: two hosts, ports and rooms for the one prompt."""
    objs = expand(_prompts(1), [2], {"bootstrap_room": [7, 3], "bootstrap_host": ["h", "h"],
                                     "bootstrap_port": [None, None]})
    assert _fields(objs, "bootstrap_room") == [7, 3]
    assert _fields(objs, "bootstrap_host") == ["h", "h"] and _fields(objs, "bootstrap_port") == [None, None]
    objs = expand(_prompts(2), [2, 1], {"bootstrap_room": [1, 2, 3]})
    assert _fields(objs, "bootstrap_room") == [1, 2, 3]


@pytest.mark.parametrize("ns,rooms,needle", [
    ([1, 1], [5], "bootstrap_room has 1 values for 2 prompt(s): send one value, 2 (one per prompt)"),
    ([2], [1, 2, 3], "or 2 (one per choice)"),
    ([2, 2], [1, 2, 3], "4 (one per choice)"),
])
def test_other_lengths_are_refused(ns, rooms, needle):
    with pytest.raises(RequestError) as e:
        expand(_prompts(len(ns)), ns, {"bootstrap_room": rooms})
    assert e.value.status == 400 and needle in e.value.message


@pytest.mark.parametrize("n", [0, 129])
def test_n_out_of_range(n):
    with pytest.raises(RequestError, match="n must be between 1 and 128"):
        expand(_prompts(1), [n], {})
