"""HybridRadixCache: the radix cache of a hybrid model (Qwen3-Next, Qwen3.5), whose linear-attention
layers carry a recurrent state instead of KV (SGLang's MambaRadixCache, with our own slot plumbing).

A cached prefix is only reusable where the recurrent state at its end is known, so nodes may hold a
state checkpoint: a slot of the recurrent-state pool (mem_cache/state_pool.py) with the state after
exactly the tokens from the root to the node's end. A match walks the KV as the plain radix cache
does, then backs off to the deepest node on the path that has a checkpoint; a node whose checkpoint
was evicted keeps its KV but ends no match (a "tombstone"), until the KV's own LRU evicts it.

    root ── [0, 256) ckpt ── [256, 512) ckpt ── [512, 600) ── [600, 731) ckpt     request A's path
                                                    └──── [600, 640) ckpt           request B's path

Where checkpoints come from (all page-aligned positions; --mamba-track-interval is a multiple of
the page size):
- an extend tracks the state at every multiple of the interval inside it, at the end of a chunk
  that more chunks follow, and at the prompt's last page boundary before its final token (the most
  that a request with the same prompt can match: a match leaves at least one token to compute);
- a decode step tracks the state when the sequence reaches a multiple of the interval;
- a finished (or retracted, or aborted) request leaves the state at its end, when that is aligned
  (always with page size 1), so a conversation's next turn prefills only its new tokens.

The scheduler never touches state tensors: it decides which slot goes where (StateOps) and the next
forward pass does it, copies first, so no decision can race a pass in flight (the overlap loop).
A hit becomes a copy of the checkpoint into the request's row before its first extend; a tracked
position is a slot the layers write during the pass. A tracked slot belongs to the request until
its KV reaches the tree (cache_unfinished_req / cache_finished_req), which hangs it on the node
ending at that position (splitting the edge there), or frees it if that node has one already.

Checkpoint slots are few and large, so they have their own LRU (least recently matched first) over
every node that holds one, locked or not: once a hit's copy is queued, later passes run after it,
so the source may be reused at once. Between a request's match and that copy nothing allocates a
checkpoint (admission only locks), which keeps the source alive. Taking a checkpoint is best
effort: with no slot free, the position is simply not tracked.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from baton.engine.mem_cache.base import CacheReq, MatchResult, cache_key
from baton.engine.mem_cache.radix_cache import RadixCache, TreeNode


class StateTreeNode(TreeNode):
    __slots__ = ("state",)

    def __init__(self, node_id: int, key: list[int], value: torch.Tensor, parent: Optional[TreeNode]) -> None:
        super().__init__(node_id, key, value, parent)
        self.state: Optional[int] = None  # checkpoint slot with the state at this node's end


class HybridRadixCache(RadixCache):
    tracks_state = True

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int,
                 checkpoint_slots: list[int], track_interval: int) -> None:
        assert track_interval > 0 and track_interval % page_size == 0, "the track interval must be page-aligned"
        self.num_checkpoints = len(checkpoint_slots)
        self.track_interval = track_interval
        self._free_states: list[int] = list(checkpoint_slots)
        self._state_nodes: dict[int, StateTreeNode] = {}  # node id -> node holding a checkpoint
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # ---- tree bookkeeping ----

    def _new_node(self, key: list[int], value: torch.Tensor, parent: Optional[TreeNode]) -> StateTreeNode:
        return StateTreeNode(next(self._ids), key, value, parent)

    def reset_tree(self) -> None:
        for node in getattr(self, "_state_nodes", {}).values():
            self._free_states.append(node.state)
        self._state_nodes = {}
        self._state_copies = None
        super().reset_tree()

    def _on_evicted(self, node: StateTreeNode) -> None:
        self._drop_state(node)

    def _drop_state(self, node: StateTreeNode) -> None:
        if node.state is not None:
            self._free_states.append(node.state)
            del self._state_nodes[node.id]
            node.state = None

    def _alloc_state(self) -> Optional[int]:
        """A free checkpoint slot, evicting the least recently matched checkpoint if need be."""
        if not self._free_states and self._state_nodes:
            victim = min(self._state_nodes.values(), key=lambda n: (n.last_access_time, n.id))
            self._drop_state(victim)
        return self._free_states.pop() if self._free_states else None

    def _node_ending_at(self, key: list[int]) -> StateTreeNode:
        """The node whose end is exactly len(key) along `key` (cached already), splitting an edge."""
        node, path = self._descend(list(key), next(self._clock))
        assert sum(len(n.key) for n in path) == len(key), "a tracked position beyond the cached KV"
        return node

    # ---- matching ----

    def match_prefix(self, key: list[int]) -> MatchResult:
        path = self._matched_path(key)
        while path and path[-1].state is None:
            path.pop()
        return self._result(path)

    # ---- state operations, planned by the scheduler and run by the next pass ----

    def restore_state(self, req: CacheReq) -> None:
        """A request that matched a prefix just got its row: its first pass starts from the
        checkpoint (a copy into the row, before the layers)."""
        state = req.last_node.state
        assert state is not None, "a matched node lost its checkpoint before the request's first pass"
        self.queue_state_copy(state, req.req_pool_idx)

    def plan_extend_tracks(self, req: CacheReq, start: int, end: int, more_chunks: bool) -> list[tuple[int, int]]:
        """Checkpoints this extend of tokens [start, end) takes, as (offset into the extend, slot)."""
        interval, page = self.track_interval, self.page_size
        positions = set(range((start // interval + 1) * interval, end + 1, interval))
        if more_chunks and end % page == 0:
            positions.add(end)
        prompt_end = (len(req.origin_input_ids) + len(req.output_ids) - 1) // page * page
        if start < prompt_end <= end:
            positions.add(prompt_end)
        return self._track(req, sorted(positions), start)

    def plan_decode_track(self, req: CacheReq, new_len: int) -> list[tuple[int, int]]:
        """A decode step that brings the sequence to `new_len` tokens: a checkpoint every interval."""
        return self._track(req, [new_len], new_len - 1) if new_len % self.track_interval == 0 else []

    def _track(self, req: CacheReq, positions: list[int], start: int) -> list[tuple[int, int]]:
        tracks = []
        for pos in positions:
            slot = self._alloc_state()
            if slot is None:
                break
            req.state_checkpoints.append((pos, slot))
            tracks.append((pos - start, slot))
        return tracks

    # ---- requests' KV (and their tracked states) into the tree ----

    def cache_finished_req(self, req: CacheReq) -> None:
        committed, row = req.kv_committed_len, req.req_pool_idx
        if committed and committed % self.page_size == 0 and all(p != committed for p, _ in req.state_checkpoints):
            slot = self._alloc_state()  # the state at the request's end: the row, before it is reused
            if slot is not None:
                self.queue_state_copy(row, slot)
                req.state_checkpoints.append((committed, slot))
        super().cache_finished_req(req)
        self._hang_states(req, committed // self.page_size * self.page_size)
        for _, slot in req.state_checkpoints:  # beyond the cached KV
            self._free_states.append(slot)
        req.state_checkpoints = []

    def cache_unfinished_req(self, req: CacheReq) -> None:
        super().cache_unfinished_req(req)
        self._hang_states(req, req.kv_committed_len // self.page_size * self.page_size)

    def _hang_states(self, req: CacheReq, cached_len: int) -> None:
        """The request's tracked slots at positions now in the tree go onto their nodes."""
        keep = []
        for pos, slot in req.state_checkpoints:
            if pos > cached_len:
                keep.append((pos, slot))
                continue
            node = self._node_ending_at(cache_key(req.fill_ids[:pos], req.lora_uid))
            if node.state is None:
                node.state = slot
                self._state_nodes[node.id] = node
            else:  # another request's checkpoint of the same tokens is there already
                self._free_states.append(slot)
        req.state_checkpoints = keep

    # ---- accounting ----

    def checkpoints_cached(self) -> int:
        return len(self._state_nodes)

    def checkpoints_free(self) -> int:
        return len(self._free_states)

    def check_state_slots(self) -> bool:
        """At idle every checkpoint slot is free or on exactly one node."""
        held = [n.state for n in self._state_nodes.values()]
        every = sorted(held + self._free_states)
        return len(every) == self.num_checkpoints and len(set(every)) == len(every)

    def pretty_print(self) -> str:
        return super().pretty_print() + f" checkpoints={len(self._state_nodes)}/{self.num_checkpoints}"
