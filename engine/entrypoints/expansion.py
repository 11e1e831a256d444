"""How one HTTP request expands into the requests the scheduler runs: the prompts of a batch, `n`
copies of each (parallel sampling: seeds, ids), and the PD fields each copy carries (rooms).

Requests are prompt-major: copy k of prompt i is request j = n_0 + ... + n_(i-1) + k, the order of
OpenAI's choices. A PD field (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`,
`data_parallel_rank`) comes in one of three shapes:

    shape                         request j (copy k of prompt i) gets   who sends it
    one value                     value  (a room: room + j)             routers, single requests
    a list, one per prompt        value[i]  (a room: value[i] + k)      routers, batches
    a list, one per request       value[j]                              sglang-router, chat with n > 1

One room names one KV transfer, so a room given for several requests fans out (room + j). The
prefill and the decode engine get the same body and derive the same rooms, so request j of one meets
request j of the other. Any other list length is a 400.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from baton.engine.tokenizer_manager import GenerateInput, RequestError

MAX_PARALLEL_SAMPLES = 128  # OpenAI's bound on n
PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank")
# the values a client may send (a room as sent: fanned out, room + j wraps)
_RANGES = {"bootstrap_room": (0, 2**63, "in [0, 2^63)"), "bootstrap_port": (1, 2**16, "a TCP port (1-65535)")}


def expand(prompts: list[GenerateInput], ns: list[int], pd: dict[str, Any]) -> list[GenerateInput]:
    """The requests of `prompts` (one input per prompt, PD fields unset) with `ns[i]` copies of
    prompt i, each carrying its PD fields from `pd` (field name -> value as the body gave it)."""
    assert len(prompts) == len(ns)
    copies = [c for obj, n in zip(prompts, ns) for c in _copies(obj, n)]
    for name in PD_FIELDS:
        for obj, value in zip(copies, _per_request(name, pd.get(name), ns)):
            setattr(obj, name, value)
    return copies


def pd_fields(req: Any) -> dict[str, Any]:
    """The PD fields of a parsed request body."""
    return {name: getattr(req, name) for name in PD_FIELDS}


def fanned_room(room: Optional[int], j: int) -> Optional[int]:
    """The bootstrap room of the j-th request one room was given for: room + j."""
    return None if room is None else (room + j) % 2**63  # rooms are non-negative int64


def _copies(obj: GenerateInput, n: int) -> list[GenerateInput]:
    """The n requests of parallel sampling (OpenAI's and SGLang's `n`). They share the prompt, so all
    but the first take it from the radix cache. A seed becomes seed + k for copy k: reproducible,
    yet the choices differ."""
    if not 1 <= n <= MAX_PARALLEL_SAMPLES:
        raise RequestError(f"n must be between 1 and {MAX_PARALLEL_SAMPLES}", 400)
    if n == 1:
        return [obj]
    copies = []
    for k in range(n):
        params = dataclasses.replace(obj.sampling_params, n=1)
        if params.seed is not None:
            params.seed += k
        copies.append(dataclasses.replace(obj, sampling_params=params, rid=f"{obj.rid}-{k}"))
    return copies


def _per_request(name: str, value: Any, ns: list[int]) -> list[Any]:
    """One value of field `name` per request (the table in the module's docstring)."""
    total, room = sum(ns), name == "bootstrap_room"
    if name in _RANGES:
        low, high, what = _RANGES[name]
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not low <= v < high:
                raise RequestError(f"{name} must be {what}, got {v}", 400)
    if not isinstance(value, list):
        return [fanned_room(value, j) for j in range(total)] if room else [value] * total
    if len(value) == total:
        return list(value)
    if len(value) == len(ns):
        return [fanned_room(v, k) if room else v for v, n in zip(value, ns) for k in range(n)]
    choices = f" or {total} (one per choice)" if total != len(ns) else ""
    raise RequestError(f"{name} has {len(value)} values for {len(ns)} prompt(s): send one value, "
                       f"{len(ns)} (one per prompt){choices}", 400)
