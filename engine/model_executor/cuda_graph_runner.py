"""CudaGraphRunner: the decode forward captured once per batch-size bucket, replayed per step.

A decode batch of bs requests runs in the graph of the smallest captured size b >= bs. The graph
reads static input buffers; rows bs..b-1 are padding that can never touch a real request's KV:

    row        input_ids  positions  req_pool_indices  seq_lens  out_cache_loc
    0..bs-1    real       real       real              real      real slots
    bs..b-1    0          0          0                 1         0 (dummy page: writes land there)

A padded row reads one KV entry (request row 0, position 0, any valid slot) and writes only the
dummy slot; its output row is sliced away. A hybrid model's padded rows read and write the state
pool's padding slot (`state_rows`; real rows: their request row), never a request's state; a decode
step's tracked checkpoints (the radix cache's, one per tracked row at its end) are copied from the
rows after the replay, as the layers would have written them. The attention backend must give decode metadata of
static shape for a fixed b (supports_cuda_graph, and the three hooks below): FlashInfer does, the
torch backend does not (its gather width is the batch's longest sequence).

Speculative verify steps (`verify_tokens` N > 0: --speculative-num-draft-tokens) have graphs of their
own, for batches up to `verify_max_bs` (the largest batch that speculates): an extend of exactly N
tokens per request (its last token and N - 1 drafts), every request's KV before it. A step whose
requests all drafted N - 1 tokens replays one; a shorter draft runs eagerly. A padded request is N
tokens of id 0 at positions 0 .. N - 1 over request row 0's first N KV entries, writing only the dummy
slot.

A hybrid model's verify steps (`verify_states`: chains; its tree steps run eagerly) replay them too:
its linear-attention layers run the N tokens as N waves (layers/gated_delta_net.py
GatedDeltaCore._tree_waves) whose slots are static buffers loaded before each replay from the step's
tracks (`wave_read`: node 0 reads its row, node w the scratch slot after node w - 1; `wave_dest`: the
scratch slot after each node, and the row for the last one). A padded request reads and writes the
state pool's padding slot.

        wave_read[w, i]      row_i (w = 0) | after_i[w - 1]
        wave_dest[w, i, :]   after_i[w] (pad where not tracked), row_i (w = N - 1) | pad

Trees (`verify_trees`: an engine that drafts them, --speculative-eagle-topk or
--speculative-ngram-max-bfs-breadth > 1): its verify graphs attend through a mask planned before
each replay (layers/attention/masks.py: each request's tree, a chain's and a padded request's
causal), so a step of full trees replays as a step of full chains does. The tree's shape is data
the plan reads, not part of the graph; an engine of chains keeps causal verify graphs.

A draft head's steps have graphs of their own over these buffers (speculative/draft_graphs.py).

With capture disabled the runner runs the very same padding / static-buffer path eagerly, which is
how CPU tests check that padded rows change neither real rows' outputs nor their KV.
"""
from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from baton.engine.core.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from baton.engine.mem_cache.state_pool import RecurrentStatePool

logger = logging.getLogger(__name__)

PAD_SEQ_LEN = 1  # a padded row attends to one KV entry: every kernel sees a non-empty sequence
GRAPH_HOOKS = ("init_cuda_graph_state", "init_forward_metadata_capture", "init_forward_metadata_replay")
VERIFY_GRAPH_HOOKS = ("init_forward_metadata_capture_verify", "init_forward_metadata_replay_verify")


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 160, every 16 above, and max_bs itself (SGLang's bucketing,
    coarser as batches grow since a padded decode row costs little)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, min(max_bs, 161), 8)) + list(range(176, max_bs, 16))
    return sizes + [max_bs]


def supports_cuda_graph(attn_backend: Any) -> bool:
    return bool(getattr(attn_backend, "supports_cuda_graph", False)) and all(
        hasattr(attn_backend, hook) for hook in GRAPH_HOOKS)


class GraphedRunner(Protocol):
    """What the graph runner reads of the model runner whose passes it captures (model_runner.py ModelRunner)."""

    device: torch.device
    model: torch.nn.Module
    attn_backend: Any
    state_pool: Optional["RecurrentStatePool"]  # a hybrid model's recurrent-state pool, else None

    def make_forward_batch(self, mode: ForwardMode, **inputs: Any) -> ForwardBatch: ...


class CudaGraphRunner:
    def __init__(self, model_runner: GraphedRunner, max_bs: int, capture: bool = True, verify_tokens: int = 0,
                 verify_max_bs: int = 0, verify_trees: bool = False) -> None:
        """`capture=False` runs the padded static-buffer path eagerly (tests; any backend).
        `verify_tokens` > 0: verify-step graphs of that many tokens per request, up to `verify_max_bs`;
        `verify_trees`: masked by each step's trees (module docstring; not for a hybrid model)."""
        self.model_runner = model_runner
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.use_graphs = capture
        self.verify_tokens = verify_tokens if verify_max_bs > 0 else 0
        self.verify_trees = verify_trees and self.verify_tokens > 0
        self.verify_sizes = capture_batch_sizes(min(verify_max_bs, self.max_bs)) if self.verify_tokens else []
        dev, b = model_runner.device, self.max_bs
        n = max(b, self.verify_tokens * (self.verify_sizes[-1] if self.verify_sizes else 0))  # token rows
        with torch.inference_mode():  # every forward runs in inference mode; so do its inputs
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
            self.req_pool_indices = torch.zeros(b, dtype=torch.int64, device=dev)
            self.seq_lens = torch.full((b,), PAD_SEQ_LEN, dtype=torch.int64, device=dev)
            self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
            pool = model_runner.state_pool
            self.pad_state = None if pool is None else pool.pad_slot
            self.state_rows = None if pool is None else torch.full((b,), pool.pad_slot, dtype=torch.int64, device=dev)
            # a hybrid model's verify steps: their linear-attention waves' slots (module docstring)
            self.verify_states = pool is not None and self.verify_tokens > 0
            assert not (self.verify_states and self.verify_trees), "a hybrid model's tree steps run eagerly"
            if self.verify_states:
                vb, nt = self.verify_sizes[-1], self.verify_tokens
                self.wave_read = torch.full((nt, vb), pool.pad_slot, dtype=torch.int64, device=dev)
                self.wave_dest = torch.full((nt, vb, 2), pool.pad_slot, dtype=torch.int64, device=dev)
        self._wave_rows: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}  # bucket -> (token rows, pick)
        # (kind, batch size) -> torch.cuda.CUDAGraph, its static output [b or b * N, hidden] and
        # EAGLE-3's layer states (the model leaves them in forward_batch.aux_hidden); kind: decode | verify
        self.graphs: dict[tuple[str, int], Any] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.aux_outputs: dict[tuple[str, int], Optional[torch.Tensor]] = {}
        if capture:
            if not supports_cuda_graph(model_runner.attn_backend):
                raise ValueError(f"{type(model_runner.attn_backend).__name__} has no static-shape decode metadata; "
                                 "CUDA graphs need --attention-backend flashinfer")
            self._capture_all()

    # ------------------------------------------------------------------ replay
    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.forward_mode == ForwardMode.DECODE:
            return fb.batch_size <= self.max_bs
        return self._is_full_verify(fb)

    def _is_full_verify(self, fb: ForwardBatch) -> bool:
        """A verify step a verify graph serves: exactly N tokens per request (chains; trees too where the
        graphs are masked by them), no state work, small enough."""
        n = self.verify_tokens
        return (n > 0 and fb.spec_verify and (fb.tree_parents is None or self.verify_trees)
                and (not fb.state_ops or self.verify_states)
                and fb.batch_size <= self.verify_sizes[-1] and all(e == n for e in fb.extend_seq_lens_cpu))

    def bucket(self, bs: int, verify: bool = False) -> int:
        """The smallest captured batch size >= bs (of the verify graphs with `verify`)."""
        sizes = self.verify_sizes if verify else self.batch_sizes
        return sizes[bisect.bisect_left(sizes, bs)]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a decode batch or a verify step; a view of the graph's
        output, valid until the next replay (the caller computes logits from it first). EAGLE-3's
        captured layer states go to fb.aux_hidden the same way."""
        assert self.can_run(fb), "not a decode batch or full verify step within the captured sizes"
        verify = fb.forward_mode != ForwardMode.DECODE
        bs, b = fb.batch_size, self.bucket(fb.batch_size, verify)
        if verify:
            self._load_verify_inputs(fb, b)
            rows = bs * self.verify_tokens
        else:
            self.load_inputs(fb, b)
            rows = bs
        static = self.static_of(fb, b)
        key = ("verify" if verify else "decode", b)
        backend = self.model_runner.attn_backend
        if self.use_graphs:
            (backend.init_forward_metadata_replay_verify if verify else backend.init_forward_metadata_replay)(static)
            self.graphs[key].replay()
            out, aux = self.outputs[key][:rows], self.aux_outputs[key]
        else:
            backend.init_forward_metadata(static)
            out, aux = self._forward(static)[:rows], static.aux_hidden
        if aux is not None:
            fb.aux_hidden = aux[:rows]
        if not verify and fb.state_ops is not None and fb.state_ops.tracks:  # (a verify step's layers wrote its)
            fb.state_pool.copy_tracked_ends(fb.state_slots, fb.state_ops.tracks)
        return out

    def static_of(self, fb: ForwardBatch, b: int) -> ForwardBatch:
        """The static batch of bucket b standing for decode batch or verify step `fb` (its inputs loaded):
        its lengths, trees and table, padded."""
        bs = fb.batch_size
        if fb.forward_mode != ForwardMode.DECODE:
            return self.static_verify_batch(b, fb.extend_prefix_lens_cpu + [0] * (b - bs),
                                             list(fb.tree_parents or [None] * bs) + [None] * (b - bs))
        static = self.static_batch(b, fb.seq_lens_cpu + [PAD_SEQ_LEN] * (b - bs))
        static.req_to_token_pool = fb.req_to_token_pool  # a draft tree's lanes read through a table of their own
        return static

    def load_inputs(self, fb: ForwardBatch, b: int) -> None:
        """A decode batch's inputs (a draft step's too, whose head reads no state) into the buffers,
        padded to b."""
        bs = fb.batch_size
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.req_pool_indices, fb.req_pool_indices), (self.seq_lens, fb.seq_lens),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:bs].copy_(src, non_blocking=True)
        if self.state_rows is not None:
            self.state_rows[:bs].copy_(fb.state_slots, non_blocking=True)
        self.pad_rows(bs, b)

    def _load_verify_inputs(self, fb: ForwardBatch, b: int) -> None:
        bs, n = fb.batch_size, self.verify_tokens
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:bs * n].copy_(src, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        self.pad_verify_rows(bs, b)
        if self.verify_states:
            self._load_verify_states(fb, b)

    def _load_verify_states(self, fb: ForwardBatch, b: int) -> None:
        """A hybrid model's verify step: the slots its waves read and write (module docstring), from the
        step's tracks (the scratch slot after node w at offset w + 1); padded requests: the padding slot."""
        n, bs, pad = self.verify_tokens, fb.batch_size, self.pad_state
        after = [[pad] * n for _ in range(b)]  # after[i][w]: the slot that takes the state after node w
        for i, track in (fb.state_ops.tracks if fb.state_ops is not None else {}).items():
            for off, slot in track:
                after[i][off - 1] = slot
        assert all(after[i][w] != pad for i in range(bs) for w in range(n - 1)), "a verify step tracks every node"
        host = torch.tensor(after, dtype=torch.int64).T  # [n, b]
        self.wave_read[1:, :b].copy_(host[:-1])
        self.wave_dest[:, :b, 0].copy_(host)
        for buf in (self.wave_read[0], self.wave_dest[n - 1, :, 1]):
            buf[:bs].copy_(fb.state_slots, non_blocking=True)
            buf[bs:b].fill_(pad)

    def _static_waves(self, b: int) -> list:
        """The waves of a hybrid's static verify batch of bucket b over the slot buffers; their token rows
        and picks are kept for the bucket's graph (it reads them on every replay)."""
        from baton.engine.layers.gated_delta_net import TreeWave

        if b not in self._wave_rows:
            dev, n = self.wave_read.device, self.verify_tokens
            self._wave_rows[b] = ([torch.arange(b, device=dev) * n + w for w in range(n)],
                                  torch.arange(b, device=dev).repeat_interleave(2))
        rows, pick = self._wave_rows[b]
        return [TreeWave(rows[w], self.wave_read[w, :b], pick, self.wave_dest[w, :b].reshape(-1))
                for w in range(self.verify_tokens)]

    def pad_verify_rows(self, start: int, end: int) -> None:
        """Padded verify requests (module docstring): N tokens of id 0 at positions 0 .. N - 1."""
        if start == end:
            return
        n = self.verify_tokens
        self.input_ids[start * n:end * n].zero_()
        self.out_cache_loc[start * n:end * n].zero_()
        self.positions[start * n:end * n].copy_(torch.arange(n, device=self.positions.device).repeat(end - start))
        self.req_pool_indices[start:end].zero_()
        self.seq_lens[start:end].fill_(n)

    def static_verify_batch(self, b: int, prefix_lens_cpu: list[int], trees: list) -> ForwardBatch:
        """`trees`: each request's tree or None (a chain, a padded request); a list, even of Nones, for
        graphs masked by trees (the attention then plans a mask for every request), else unused."""
        n = self.verify_tokens
        fb = self.model_runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=self.input_ids[:b * n], positions=self.positions[:b * n],
            req_pool_indices=self.req_pool_indices[:b], seq_lens=self.seq_lens[:b],
            out_cache_loc=self.out_cache_loc[:b * n], seq_lens_cpu=[p + n for p in prefix_lens_cpu],
            extend_prefix_lens_cpu=prefix_lens_cpu, extend_seq_lens_cpu=[n] * b)
        fb.spec_verify = True
        fb.tree_parents = trees if self.verify_trees else None
        if self.verify_states:
            fb.tree_waves = self._static_waves(b)
        return fb

    def pad_rows(self, start: int, end: int) -> None:
        if start == end:
            return
        for buf in (self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc):
            buf[start:end].zero_()
        self.seq_lens[start:end].fill_(PAD_SEQ_LEN)
        if self.state_rows is not None:
            self.state_rows[start:end].fill_(self.pad_state)

    def static_batch(self, b: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        assert len(seq_lens_cpu) == b
        fb = self.model_runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=self.input_ids[:b], positions=self.positions[:b],
            req_pool_indices=self.req_pool_indices[:b], seq_lens=self.seq_lens[:b],
            out_cache_loc=self.out_cache_loc[:b], seq_lens_cpu=seq_lens_cpu)
        if self.state_rows is not None:
            fb.state_rows = self.state_rows[:b]
        return fb

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        # A fresh view of positions per call: RotaryEmbedding memoizes cos/sin by the positions
        # tensor's identity, and a reused object would let a capture skip computing cos/sin
        # (the graph would replay the warm-up's values) or an eager run reuse stale ones.
        return self.model_runner.model(fb.input_ids, fb.positions.view(-1), fb)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _capture_all(self) -> None:
        backend = self.model_runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs)
        if self.verify_tokens and not all(hasattr(backend, hook) for hook in VERIFY_GRAPH_HOOKS):
            logger.info("no verify-step graphs: %s has no static verify metadata", type(backend).__name__)
            self.verify_tokens, self.verify_sizes = 0, []
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory the largest one reserved.
        if self.verify_states:  # not yet run on a GPU: a capture that fails leaves these steps eager
            try:
                for b in reversed(self.verify_sizes):
                    self._capture_one("verify", b, pool)
            except Exception as e:
                logger.warning("a hybrid model's verify steps run eagerly: their CUDA graph capture failed (%s)", e)
                for b in self.verify_sizes:
                    self.graphs.pop(("verify", b), None)
                    self.outputs.pop(("verify", b), None)
                    self.aux_outputs.pop(("verify", b), None)
                self.verify_tokens, self.verify_sizes, self.verify_states = 0, [], False
        for kind, sizes in (("verify", [] if self.verify_states else self.verify_sizes), ("decode", self.batch_sizes)):
            for b in reversed(sizes):
                try:
                    self._capture_one(kind, b, pool)
                except Exception as e:
                    raise RuntimeError(f"CUDA graph capture of the {kind} forward failed at batch size {b} ({e}); "
                                       "the forward may have a data-dependent host sync (an .item() or .tolist()): "
                                       "run with --disable-cuda-graph") from e
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s%s", self.batch_sizes,
                    f", verify steps of {self.verify_tokens} tokens{' (trees)' if self.verify_trees else ''} for "
                    f"{self.verify_sizes}" if self.verify_sizes else "")

    def _capture_one(self, kind: str, b: int, pool: Optional[Any]) -> None:
        # capture on all-padding inputs: only the dummy page is written
        backend = self.model_runner.attn_backend
        if kind == "verify":
            self.pad_verify_rows(0, b)
            static = self.static_verify_batch(b, [0] * b, [None] * b)
            backend.init_forward_metadata_capture_verify(static)
        else:
            self.pad_rows(0, b)
            static = self.static_batch(b, [PAD_SEQ_LEN] * b)
            backend.init_forward_metadata_capture(static)
        self.graphs[(kind, b)], self.outputs[(kind, b)] = capture_graph(lambda: self._forward(static), pool)
        self.aux_outputs[(kind, b)] = static.aux_hidden


def capture_graph(run: Callable[[], torch.Tensor], pool: Optional[Any]) -> tuple[Any, torch.Tensor]:
    """`run` captured as a CUDA graph (in memory pool `pool`), after two warm-ups on a side stream, and
    the static output it leaves."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-ups off the capture: lazy inits, Triton JIT, allocator
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output
