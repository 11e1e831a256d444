"""The weight-update group: a process group between a trainer and the engine's TP ranks.

A torch.distributed process group apart from the engine's own TP group (which it never touches):

    trainer rank 0 ... trainer ranks | engine TP rank 0 at rank_offset, TP rank r at rank_offset + r

The trainer broadcasts each updated tensor from its rank 0; every engine rank receives the full
tensor and loads its shard. The group is made as SGLang's (and vLLM's) init_custom_process_group
makes it, so that a trainer using that function meets the engine in the same store: a TCP
rendezvous at master_address:master_port, a store prefixed by the group's name, and a process
group built on it without the process's default group (an engine of one rank has none; a TP
engine's is its TP group).
"""
from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The rendezvous and each broadcast wait this long for the trainer: below the scheduler's watchdog
# (--watchdog-timeout, 300 s by default), so a trainer that never comes is an error answer, not a
# stopped engine.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=240)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Any:
    """A process group of `world_size` ranks met at `init_method` (tcp://host:port; rank 0 hosts the
    store), registered under `group_name` for torch.distributed's collectives. Blocks until every
    rank has joined (or the timeout)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def receive(pg: Any, shape: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """One tensor broadcast from the group's rank 0 (the trainer's)."""
    import torch.distributed as dist

    t = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(t, group=pg, group_src=0)
    return t
