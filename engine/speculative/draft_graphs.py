"""A draft head's CUDA graphs, over the target's graph runner (model_executor/cuda_graph_runner.py).

A draft head's decode-shaped steps (head_worker.py: a chain's next draft, or every leaf of a growing
tree, one token per row of the step's table) replay graphs of their own, for the decode sizes up to
the most rows a draft step has: the head's pass over the decode graphs' input buffers plus one of the
head's input states, planned through the decode graph's attention wrapper of the same size (the
step's own table: a tree's lanes read through one). Padded rows are decode padding with a zero state.

So does the head's pass after a replayed decode or verify step (`head-decode`, `head-verify`: the
step's positions, the ids that follow them): it reads that graph's own output (or EAGLE-3's layer
states) as its input states and the attention its replay planned.

With the target's capture disabled the same padded static path runs eagerly (the CPU tests' path).
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch

from baton.engine.core.forward_batch import ForwardBatch, ForwardMode
from baton.engine.model_executor.cuda_graph_runner import PAD_SEQ_LEN, CudaGraphRunner, capture_graph

logger = logging.getLogger(__name__)

HeadPass = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]  # (batch, input states [rows, width]) -> out


class DraftGraphs:
    def __init__(self, target: CudaGraphRunner, forward: HeadPass, width: int, dtype: torch.dtype, most: int,
                 aux_states: bool = False) -> None:
        """Graphs of the head's pass `forward` for draft steps of up to `most` rows and after each of
        `target`'s decode and verify graphs; `aux_states`: after a target pass the head reads the captured
        layer states (EAGLE-3), else the final hidden states."""
        self.target, self.forward, self.head_aux = target, forward, aux_states
        self.sizes = [b for b in target.batch_sizes if b <= target.bucket(min(most, target.max_bs))]
        with torch.inference_mode():
            self.states = torch.zeros(self.sizes[-1], width, dtype=dtype, device=target.input_ids.device)
        # the head's pass after each decode and verify graph (EAGLE-3: only where they kept their layer states)
        self.head_after = not aux_states or not target.use_graphs or all(
            aux is not None for aux in target.aux_outputs.values())
        self.graphs: dict[tuple[str, int], Any] = {}  # ("draft" | "head-decode" | "head-verify", b) -> graph
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        if target.use_graphs:
            self._capture_all()

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _capture_all(self) -> None:
        target, pool = self.target, torch.cuda.graph_pool_handle()
        backend = target.model_runner.attn_backend
        for b in reversed(self.sizes):
            target.pad_rows(0, b)
            self.states[:b].zero_()
            static = target.static_batch(b, [PAD_SEQ_LEN] * b)
            backend.init_forward_metadata_replay(static)  # the decode graph's wrapper
            self._capture(("draft", b), lambda fb=static, b=b: self.forward(fb, self.states[:b]), pool)
        for kind, sizes in (("verify", target.verify_sizes), ("decode", target.batch_sizes)):
            for b in reversed(sizes if self.head_after else []):
                static = self._padded_target_batch(kind, b)
                states = (target.aux_outputs if self.head_aux else target.outputs)[(kind, b)]
                self._capture((f"head-{kind}", b), lambda fb=static, x=states: self.forward(fb, x), pool)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for the draft head's steps, batch sizes %s%s", self.sizes,
                    ", and its pass after each decode and verify graph" if self.head_after else "")

    def _padded_target_batch(self, kind: str, b: int) -> ForwardBatch:
        """The target's all-padding static batch of graph (kind, b), planned as its replay plans it."""
        target = self.target
        backend = target.model_runner.attn_backend
        if kind == "verify":
            target.pad_verify_rows(0, b)
            static = target.static_verify_batch(b, [0] * b, [None] * b)
            backend.init_forward_metadata_replay_verify(static)  # the verify graph's wrapper
        else:
            target.pad_rows(0, b)
            static = target.static_batch(b, [PAD_SEQ_LEN] * b)
            backend.init_forward_metadata_replay(static)  # the decode graph's wrapper
        return static

    def _capture(self, key: tuple[str, int], run: Callable[[], torch.Tensor], pool: Any) -> None:
        try:
            self.graphs[key], self.outputs[key] = capture_graph(run, pool)
        except Exception as e:
            raise RuntimeError(f"CUDA graph capture of the draft head's {key[0]} pass failed at batch size {key[1]} "
                               f"({e}); run with --disable-cuda-graph") from e

    # ------------------------------------------------------------------ replay
    def can_run_head_after(self, fb: ForwardBatch, states: torch.Tensor) -> bool:
        """Whether the head's pass after target pass `fb` replays its graph: `fb` replayed a decode or
        verify graph, whose output (or layer states) `states` is, as the head's graph reads them there."""
        target = self.target
        if not (self.head_after and target.can_run(fb)):
            return False
        if not target.use_graphs:
            return True
        verify = fb.forward_mode != ForwardMode.DECODE
        key = ("verify" if verify else "decode", target.bucket(fb.batch_size, verify))
        return states.data_ptr() == (target.aux_outputs if self.head_aux else target.outputs)[key].data_ptr()

    def replay_head_after(self, fb: ForwardBatch, ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The head's outputs [rows, hidden] over target pass `fb` just replayed (a decode step, or a
        verify step of N tokens per request), its rows reading `ids` [rows] and `states` (that graph's
        own, can_run_head_after); a view valid until the next such replay. The pass's inputs and
        attention plan are still in place."""
        target = self.target
        verify = fb.forward_mode != ForwardMode.DECODE
        bs, n = fb.batch_size, target.verify_tokens if verify else 1
        b = target.bucket(bs, verify)
        target.input_ids[:bs * n].copy_(ids, non_blocking=True)
        if target.use_graphs:
            key = ("head-verify" if verify else "head-decode", b)
            self.graphs[key].replay()
            return self.outputs[key][:bs * n]
        static = target.static_of(fb, b)
        target.model_runner.attn_backend.init_forward_metadata(static)
        padded = torch.cat([states, states.new_zeros((b - bs) * n, states.shape[1])])
        return self.forward(static, padded)[:bs * n]

    def can_run_draft(self, fb: ForwardBatch) -> bool:
        return fb.batch_size <= self.sizes[-1]

    def replay_draft(self, fb: ForwardBatch, states: torch.Tensor) -> torch.Tensor:
        """The head's outputs [bs, hidden] for a draft step `fb` (decode-shaped, through its own table)
        and its input states [bs, width]; a view valid until the next draft replay of that size."""
        target, bs = self.target, fb.batch_size
        b = self.sizes[bisect.bisect_left(self.sizes, bs)]
        target.load_inputs(fb, b)
        self.states[:bs].copy_(states, non_blocking=True)
        self.states[bs:b].zero_()
        static = target.static_of(fb, b)
        backend = target.model_runner.attn_backend
        if target.use_graphs:
            backend.init_forward_metadata_replay(static)
            self.graphs[("draft", b)].replay()
            return self.outputs[("draft", b)][:bs]
        backend.init_forward_metadata(static)
        return self.forward(static, self.states[:b])[:bs]
