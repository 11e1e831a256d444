"""ModelRunner: owns the model, the memory pools and the attention backend; runs one forward pass."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from baton.engine.core.forward_batch import ForwardBatch, ForwardMode
from baton.engine.layers.custom_op import bind_layer_ops
from baton.engine.layers.gemm import SmallBatchGemv
from baton.engine.layers.linear import pack_linear_weights
from baton.engine.layers.pooler import LastTokenPooler
from baton.engine.layers.rotary_embedding import RotaryEmbedding
from baton.engine.model_executor.config import WorkerConfig
from baton.engine.model_executor.model_loader import DTYPES as MODEL_DTYPES
from baton.engine.server_args import DRAFT_CHECKPOINT_ALGORITHMS, ServerArgs

if TYPE_CHECKING:
    from baton.engine.distributed.parallel_state import TpGroup
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool
    from baton.engine.mem_cache.state_pool import LinearStateShapes, RecurrentStatePool
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner
    from baton.engine.model_executor.lora_manager import LoraManager
    from baton.engine.multimodal.inputs import MmBatch

logger = logging.getLogger(__name__)

# KV pool default on CPU when --max-total-tokens is not given: a share of RAM, capped, since the
# pool tensors are allocated eagerly.
_CPU_DEFAULT_MAX_TOKENS = 1 << 17
_MAX_RUNNING_DEFAULT = 256  # --max-running-requests unset: at most this many, and total tokens / 2


def _own_code_forward(model: torch.nn.Module) -> Callable:
    """`model(input_ids, positions, forward_batch)` through a function whose code object is new, so
    what torch.compile caches for it belongs to this model alone. (Two engines in one process, e.g.
    tests, otherwise share the graphs compiled for the model class's forward; with the guards on
    the modules filtered out, a second model of other sizes would run the first one's graph.)"""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return model(input_ids, positions, forward_batch)

    return types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, None,
                              forward.__closure__)


@dataclass(frozen=True)
class PoolConfig:
    max_total_tokens: int
    max_running_requests: int
    context_len: int


def _total_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_BATCH_TENSORS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")


_KV_DTYPES = {**MODEL_DTYPES, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; use auto or one of {sorted(_KV_DTYPES)}")
    return _KV_DTYPES[kv_cache_dtype]


def cuda_graph_max_bs_for(gpu_memory_bytes: int) -> int:
    """The default --cuda-graph-max-bs by GPU memory (SGLang's steps): a card that holds more KV
    runs larger decode batches, and every captured size costs start-up time and graph memory."""
    gib = gpu_memory_bytes / (1 << 30)
    for limit, max_bs in ((20, 8), (35, 24), (60, 80), (90, 160)):
        if gib < limit:
            return max_bs
    return 256


def _inference(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_inference() else t.clone()


class ModelRunner:
    def __init__(self, server_args: ServerArgs, tp: Optional["TpGroup"] = None) -> None:
        """`tp`: the tensor-parallel group this runner's shard belongs to (one rank by default)."""
        from baton.engine.distributed.parallel_state import TpGroup
        from baton.engine.layers.attention import create_attention_backend

        self.config, self.device = server_args.view(WorkerConfig), server_args.device
        # a hybrid's verify steps may run behind one another (two sets of scratch slots)
        self.lags_verify_steps = server_args.may_lag_verify_steps()
        self.tp = tp or TpGroup()
        # seconds per start-up phase, reported in /get_server_info and the scheduler's ready line
        self.startup_s: dict[str, float] = {}
        with self._phase("load_weights"):
            self._load_model()
        with self._phase("kv_pool"):
            self._prepare_model()
            self.lora = self._init_lora()
            self._init_pools()
            self.attn_backend = create_attention_backend(server_args.attention_backend, model_runner=self)
        with self._phase("cuda_graphs"):
            self.cuda_graph_runner = self._init_cuda_graph_runner()
        with self._phase("compile"):
            self._init_native_forward()
            self._init_compiled_model()
            self._warm_up_compiled()
        cfg = self.pool_config
        logger.info("model loaded: %s layers, dtype %s, KV cache %s, KV pool %d tokens, %d max running requests",
                    self.num_layers, self.dtype, self.kv_dtype, cfg.max_total_tokens, cfg.max_running_requests)

    # ---- the model's geometry (model_config.ModelConfig) ----

    @property
    def vocab_size(self) -> int:
        return self.model_config.text.vocab_size

    @property
    def num_layers(self) -> int:
        return self.model_config.text.num_layers

    @property
    def head_dim(self) -> int:
        return self.model_config.heads.head_dim

    # ---- start-up steps, in order ----

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.startup_s[name] = round(time.perf_counter() - start, 3)

    def _load_model(self) -> None:
        """The config, the weights, and the head that drafts beside the model's passes
        (speculative/head_worker.py): NEXTN's MTP head, part of the model, or an EAGLE draft
        checkpoint's, whose KV layers come after the model's."""
        from baton.engine.model_executor.model_loader import load_model

        args = self.config
        torch.manual_seed(args.random_seed)
        algorithm = args.speculative_algorithm
        self.model, self.model_config, self.dtype = load_model(
            args.model_path, args.dtype, self.device, self.tp, mtp=algorithm == "NEXTN",
            draft_model_path=args.speculative_draft_model_path if algorithm in DRAFT_CHECKPOINT_ALGORITHMS else None,
            token_map=args.speculative_token_map, draft_algorithm=algorithm, embedding=args.is_embedding)
        self.draft_head = getattr(self.model, "mtp" if algorithm == "NEXTN" else "draft_head", None)
        # an embedding engine's: each extend's last tokens pooled instead of scored (layers/pooler.py)
        self.pooler = LastTokenPooler.for_model(self.model) if args.is_embedding else None
        self.mm_embedder = None  # a vision-language model's tower, its cache and ViT DP
        tower = getattr(self.model, "visual", None)
        if tower is not None:
            from baton.engine.model_executor.mm_embedder import MultimodalEmbedder

            self.mm_embedder = MultimodalEmbedder(tower, args.mm_embedding_cache_mb, self.device, self.dtype,
                                                  self.tp, args.mm_enable_dp_encoder)

    def _prepare_model(self) -> None:
        """Each layer op on its device's path (Triton on CUDA), or all on the torch reference; the
        small-batch GEMV switch; CPU bfloat16 linears packed for the CPU GEMM."""
        args = self.config
        self.model.eval()
        # each layer op on its device's path (Triton on CUDA), or all on the torch reference; the linears'
        # small-batch GEMV on CUDA with the fused ops only (held by this model's layers)
        self.layer_ops = bind_layer_ops(self.model, self.device, fused=not args.disable_fused_ops,
                                        gemv=SmallBatchGemv(args.small_batch_gemv_rows))
        if not args.disable_packed_linear:  # CPU bfloat16 layers only; it checks
            pack_linear_weights(self.model, self.device)

    def _init_lora(self) -> Optional["LoraManager"]:
        """--enable-lora: the adapter pool and the LoRA deltas of the layers it serves (lora_manager.py),
        before the KV pool takes its share of memory. The passes that know no adapters stay off: the
        native CPU forward, torch.compile and CUDA graphs."""
        args = self.config
        if not args.enable_lora:
            return None
        from baton.engine.model_executor.lora_adapter import LoraSettings
        from baton.engine.model_executor.lora_manager import LoraManager
        from baton.engine.server_args import parse_lora_paths

        settings = LoraSettings.resolve([a.path for a in parse_lora_paths(args.lora_paths)], args.max_loras_per_batch,
                                        args.max_lora_rank, args.lora_target_modules)
        return LoraManager(self.model, settings, self.dtype, self.device, reference=args.disable_fused_ops)

    def _init_pools(self) -> None:
        """The request table, the KV pool (this rank's KV heads only) and its allocator, and a hybrid
        model's recurrent-state pool, sized by _pool_config."""
        from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
        from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        args, page = self.config, self.config.page_size
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
        # layers with a KV cache: all of them, except in a hybrid model (its full-attention layers only)
        self.num_kv_layers = getattr(self.model, "num_kv_layers", self.num_layers)
        # NEXTN's head is part of the model and counted by it
        if args.speculative_algorithm in DRAFT_CHECKPOINT_ALGORITHMS:
            self.num_kv_layers += self.draft_head.num_kv_layers
        self.num_kv_heads = self.tp.kv_head_range(self.model_config.heads.num_kv_heads)[1]
        state_shapes = getattr(self.model, "linear_state_shapes", lambda: None)()
        self.pool_config = cfg = self._pool_config(state_shapes)
        self._reserve_rope(cfg.context_len + page)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running_requests + 1, cfg.context_len + page, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(cfg.max_total_tokens, page, self.kv_dtype, self.num_kv_heads,
                                                 self.head_dim, self.num_kv_layers, self.device)
        self.state_pool = self._init_state_pool(state_shapes)
        self.allocator = TokenToKVPoolAllocator(cfg.max_total_tokens, page, self.device)

    def _reserve_rope(self, positions: int) -> None:
        """RoPE's cos/sin tables cover every position a request can reach, before compile or capture."""
        for rope in self.model.modules():  # each module once, however many layers share it
            if isinstance(rope, RotaryEmbedding):
                rope.reserve(positions, self.device)

    # CPU bfloat16 dense Llama-family models run every step as one native call (model_executor/native_forward.py),
    # and nothing is compiled.
    def _init_native_forward(self) -> None:
        self.native_forward = None
        if self.draft_head is not None and self.draft_head.aux_layers:
            logger.info("native CPU forward off: EAGLE3's draft reads states inside the model's layers")
        elif self.lora is not None:
            logger.info("native CPU forward off: LoRA adapters (--enable-lora) run in the model's own forward")
        elif (self.device == "cpu" and self.dtype == torch.bfloat16
              and not self.config.disable_native_forward):
            from baton.engine.model_executor.native_forward import NativeForward

            self.native_forward = NativeForward.create(self.model, self.req_to_token_pool, self.token_to_kv_pool,
                                                       self.tp.size, self.device)

    # Decode: its shapes change little (batch size, KV length), so one dynamic graph serves every
    # step and removes most of the per-step Python/dispatch floor. On CPU with the torch backend
    # the extend compiles too (a second graph, dynamic in the token count): its attention loop is
    # one opaque op there, and Inductor fuses the norms, rotary and gated MLP around it.
    # The model's modules and weights never change once loaded, so the graphs skip Dynamo's
    # guards on them (as vLLM compiles without guards at all): those were about half of the
    # guard check every call pays, ~0.1-0.2 ms of a CPU decode step. Guards on the batch stay.
    # Without those guards nothing would tell this model's graphs from another model's, so
    # they live on a code object of this runner's own (Dynamo keeps graphs per code object).
    def _init_compiled_model(self) -> None:
        args = self.config
        if self.native_forward is not None and args.enable_torch_compile:
            logger.info("--enable-torch-compile: nothing to compile, the native forward serves every step")
        compile_ = args.enable_torch_compile and self.native_forward is None
        if compile_ and self.draft_head is not None:
            logger.info("--enable-torch-compile: not with a draft head yet, the model's own forward serves")
            compile_ = False
        if compile_ and self.lora is not None:
            logger.info("--enable-torch-compile: not with LoRA adapters yet, the model's own forward serves uncompiled")
            compile_ = False
        if compile_ and self.state_pool is not None:
            logger.info("--enable-torch-compile: not for a hybrid model yet, its own forward serves uncompiled")
            compile_ = False
        skip_module_guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.compiled_model = (torch.compile(_own_code_forward(self.model), dynamic=True, options=skip_module_guards)
                               if compile_ else None)
        self.compile_extend = (self.compiled_model is not None and self.device == "cpu"
                               and args.attention_backend == "torch")

    # Every shape class serving can meet: Dynamo specialises sizes 0/1 and makes the rest dynamic
    # from the second distinct size, so batch 1 and batch 2 (one token and several) cover them.
    # Inductor takes the sizes a dynamic graph was compiled on as the typical ones (its "hints"),
    # and decides from them which loops are worth running on every thread: an extend graph
    # compiled on 3 or 5 tokens ran its rotary and KV-store loops on one thread at every prefill.
    # So the extends that make the token count dynamic carry a chunk-sized count.
    _WARM_UP_DECODE = ([1], [1, 1])
    _WARM_UP_EXTEND_TOKENS = 512

    def _warm_up_extend_lens(self) -> list[list[int]]:
        n = max(3, min(self._WARM_UP_EXTEND_TOKENS, self.pool_config.context_len - 1))
        return [[1], [n], [n // 2, n - n // 2]]

    def _warm_up_compiled(self) -> None:
        """With --enable-torch-compile, compile every graph before the engine reports ready, on dummy
        batches whose KV reads and writes all land on the dummy page (slot 0). Compiling on real
        traffic instead stalled a served run by ~9 s when the first batch of two extends happened
        to arrive under load."""
        if self.compiled_model is None:
            return
        logger.info("compiling the forward passes (torch.compile)...")
        cases = [(ForwardMode.DECODE, lens) for lens in self._WARM_UP_DECODE]
        if self.compile_extend:
            cases += [(ForwardMode.EXTEND, lens) for lens in self._warm_up_extend_lens()]
        with torch.inference_mode():  # like the worker's batches: guards check inference-ness too
            for mode, lens in cases:
                self.forward(self._dummy_batch(mode, lens))
        logger.info("forward passes compiled")

    def _dummy_batch(self, mode: ForwardMode, lens: list[int]) -> ForwardBatch:
        """Requests in rows 0.. of an idle pool (their req_to_token rows still map to slot 0), no
        cached prefix; `lens` are the tokens each request runs (1 each at decode)."""
        dev, bs = self.device, len(lens)
        extend = mode == ForwardMode.EXTEND
        num_tokens = sum(lens) if extend else bs
        positions = torch.cat([torch.arange(n) for n in lens]) if extend else torch.zeros(bs, dtype=torch.int64)
        seq_lens = list(lens) if extend else [1] * bs
        return self.make_forward_batch(
            mode, input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev), positions=positions.to(dev),
            req_pool_indices=torch.arange(bs, device=dev), seq_lens=torch.tensor(seq_lens, device=dev),
            out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64, device=dev), seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=[0] * bs if extend else None, extend_seq_lens_cpu=list(lens) if extend else None)

    def _init_cuda_graph_runner(self) -> Optional["CudaGraphRunner"]:
        """Decode CUDA graphs: on CUDA, unless --disable-cuda-graph, with a backend that supports them."""
        from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner, supports_cuda_graph

        args = self.config
        if not self.device.startswith("cuda") or args.disable_cuda_graph:
            return None
        if self.lora is not None:
            logger.info("CUDA graphs off: LoRA adapters (--enable-lora) run every step eagerly")
            return None
        if not supports_cuda_graph(self.attn_backend):
            logger.info("CUDA graphs off: --attention-backend %s has no static-shape decode metadata "
                        "(use --attention-backend flashinfer)", args.attention_backend)
            return None
        max_bs = args.cuda_graph_max_bs or cuda_graph_max_bs_for(torch.cuda.get_device_properties(self.device).total_memory)
        max_bs = min(max_bs, self.pool_config.max_running_requests)
        # speculation: verify steps of full drafts get graphs of their own, for the batches that speculate,
        # masked by each step's trees where the engine drafts trees; a hybrid model's chains too, their
        # states' waves over static slot buffers (its trees run eagerly)
        trees = args.speculative_algorithm is not None and (
            (args.speculative_eagle_topk or 1) > 1 if args.speculative_algorithm != "NGRAM"
            else args.speculative_ngram_max_bfs_breadth > 1)
        verify = args.speculative_algorithm is not None and not (trees and self.state_pool is not None)
        return CudaGraphRunner(self, max_bs=max_bs, verify_tokens=args.speculative_num_draft_tokens if verify else 0,
                               verify_max_bs=args.speculative_disable_by_batch_size - 1 if verify else 0,
                               verify_trees=trees)

    def _pool_config(self, state_shapes: Optional["LinearStateShapes"]) -> PoolConfig:
        args, page = self.config, self.config.page_size
        context_len = args.context_length or self.model_config.text.context_length
        cell = self.num_kv_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize
        # a hybrid model's state slots cap its running requests (mem_cache/state_pool.py)
        slots = (args.max_mamba_cache_size or args.max_running_requests) if state_shapes is not None else None
        if args.max_total_tokens is not None:
            total = args.max_total_tokens
        else:
            budget = self._pool_budget_bytes()
            if state_shapes is not None:
                from baton.engine.mem_cache.state_pool import split_state_memory

                row_bytes = state_shapes.bytes_per_row(*self._state_dtypes())
                (rows, per_row), sets = self._state_scratch()
                budget -= sets * rows * per_row * row_bytes  # the verify steps' scratch states, first
                split = split_state_memory(budget, row_bytes, args.mamba_full_memory_ratio, slots, _MAX_RUNNING_DEFAULT,
                                           rows_per_slot=1 + self._state_checkpoints_per_slot())
                logger.info("memory for the pools: %.1f MB to the recurrent-state pool (%d slots), %.1f MB to KV",
                            split.state_bytes / 1e6, split.slots, split.kv_bytes / 1e6)
                slots, budget = split.slots, split.kv_bytes
            total = budget // cell
            if self.device == "cpu":
                total = min(total, _CPU_DEFAULT_MAX_TOKENS)
            # every shard maps the same slots: the pool is as large as the rank with the least room
            from baton.engine.distributed.parallel_state import all_reduce_min

            total = all_reduce_min(total, self.tp)
        total = max(total // page * page, page)
        running = args.max_running_requests or max(1, min(_MAX_RUNNING_DEFAULT, total // 2))
        if slots is not None:
            running = min(running, slots)
        return PoolConfig(max_total_tokens=total, max_running_requests=running, context_len=context_len)

    def _pool_budget_bytes(self) -> int:
        """What the pools may take when sized from memory: --mem-fraction-static of the free GPU memory
        (the weights are loaded); on CPU, the free RAM that fraction leaves."""
        fraction = self.config.mem_fraction_static
        return int(_total_memory_bytes(self.device) * (1 - fraction if self.device == "cpu" else fraction))

    def _state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """A hybrid model's conv-state and delta-rule-state dtypes."""
        return self.dtype, MODEL_DTYPES[self.config.mamba_ssm_dtype]

    def _state_scratch(self) -> tuple[tuple[int, int], int]:
        """A hybrid model's scratch states for verify steps (state_pool.scratch_slot): ((batch rows,
        slots per row), sets); where verify steps may lag, two sets, each with the state after the
        whole step too."""
        args = self.config
        if args.speculative_algorithm is None:
            return (0, 0), 1
        rows, per_row = max(1, args.speculative_disable_by_batch_size - 1), args.speculative_num_draft_tokens - 1
        return ((rows, per_row + 1), 2) if self.lags_verify_steps else ((rows, per_row), 1)

    def _state_checkpoints_per_slot(self) -> int:
        """The radix cache's checkpoint slots per request slot (hybrid_radix_cache.py): one, or none
        without the radix cache."""
        return 0 if self.config.disable_radix_cache else 1

    def _init_state_pool(self, shapes: Optional["LinearStateShapes"]) -> Optional["RecurrentStatePool"]:
        """A hybrid model's recurrent states: one slot per request row (slot index = req_pool_idx), so
        max running requests + 1 (the spare row a request that just ended holds in the overlap loop),
        then the radix cache's checkpoint slots, one per running request, then the verify steps' scratch."""
        if shapes is None:
            return None
        from baton.engine.mem_cache.state_pool import RecurrentStatePool

        checkpoints = self._state_checkpoints_per_slot() * self.pool_config.max_running_requests
        scratch, sets = self._state_scratch()
        pool = RecurrentStatePool(shapes, self.req_to_token_pool.size, *self._state_dtypes(), self.device,
                                  checkpoints=checkpoints, scratch=scratch, scratch_sets=sets)
        logger.info("recurrent-state pool: %s, %.1f MB", pool, pool.size_bytes() / 1e6)
        return pool

    def make_forward_batch(self, mode: ForwardMode, *, input_ids: torch.Tensor, positions: torch.Tensor,
                           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                           seq_lens_cpu: list[int], extend_prefix_lens_cpu: Optional[list[int]] = None,
                           extend_seq_lens_cpu: Optional[list[int]] = None,
                           req_to_token_pool: Optional["ReqToTokenPool"] = None) -> ForwardBatch:
        """A ForwardBatch over this runner's pools and attention backend (`req_to_token_pool`: a table
        of rows of its own in place of the runner's, a draft head's branches: speculative/head_worker.py)."""
        return ForwardBatch(
            forward_mode=mode, batch_size=len(seq_lens_cpu), input_ids=input_ids, positions=positions,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens_cpu, extend_prefix_lens_cpu=extend_prefix_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu, req_to_token_pool=req_to_token_pool or self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool, attn_backend=self.attn_backend, state_pool=self.state_pool)

    def forward_batch_from(self, mwb, extra: Optional[torch.Tensor] = None) -> tuple[ForwardBatch, Optional[torch.Tensor]]:
        """The device-side batch of a ModelWorkerBatch (host tensors), and `extra` (an int64 host
        tensor: the overlap loop's future-map slots) on the device too.

        On CUDA every host input travels in one copy, from pinned memory and without blocking: a
        blocking copy waits for the stream's earlier work, and the overlap loop enqueues a batch
        while the previous one still runs. input_ids is a fresh tensor (never the batch's own), so
        resolving its placeholders in place leaves the scheduler's copy alone."""
        host = [mwb.input_ids, mwb.positions, mwb.req_pool_indices,
                torch.tensor(mwb.seq_lens_cpu, dtype=torch.int64), mwb.out_cache_loc]
        if extra is not None:
            host.append(extra)
        if self.device == "cpu":  # nothing to copy but the token ids, which the overlap loop resolves in place
            parts = [t.to(torch.int64) for t in host]
            parts[0] = parts[0].clone() if parts[0] is mwb.input_ids else parts[0]
        else:
            sizes = [t.numel() for t in host]
            packed = torch.cat([t.to("cpu", torch.int64).view(-1) for t in host])
            parts = packed.pin_memory().to(self.device, non_blocking=True).split(sizes)
        fb = self.make_forward_batch(
            mwb.forward_mode, input_ids=parts[0], positions=parts[1], req_pool_indices=parts[2], seq_lens=parts[3],
            out_cache_loc=parts[4], seq_lens_cpu=mwb.seq_lens_cpu,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens_cpu, extend_seq_lens_cpu=mwb.extend_seq_lens_cpu)
        fb.state_ops = getattr(mwb, "state_ops", None)
        spec = getattr(mwb, "spec_info", None)
        fb.tree_parents = None if spec is None else spec.parents
        if fb.tree_parents is not None:
            fb.tree_depths = [spec.depth(i) for i in range(len(spec.drafts))]
        fb.spec_verify = spec is not None
        fb.lora = mwb.lora
        if mwb.mm is not None:
            self.attach_images(fb, mwb.mm)
        return fb, (parts[5] if extra is not None else None)

    def attach_images(self, fb: ForwardBatch, mm: "MmBatch") -> None:
        """An extend's images: its M-RoPE positions, and the vision embeddings of its image tokens."""
        fb.mrope_positions = mm.mrope_positions.to(self.device)
        if self.mm_embedder is not None:  # with TP, also when nothing is spliced: the followers wait for it
            fb.mm_embeds = self.mm_embedder.embeds(mm)
        elif mm.splices:
            raise RuntimeError("a batch with images reached a model without a vision tower")

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs the model; returns hidden states [num_tokens, hidden]."""
        if self.lora is not None:  # the pass's adapter loads and rows, before any layer
            self.lora.prepare(fb)
        if fb.state_ops is not None:  # a hybrid model's checkpoint copies come before its layers
            self.state_pool.copy_slots(fb.state_ops.copies)
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb)  # plans its own (padded) attention metadata
        if fb.tree_parents is not None:
            # a verify step of tree drafts: the backend's tree mask, through the model's own forward
            # (the native forward and the compiled extend know causal masks only)
            self.attn_backend.init_forward_metadata(fb)
            return self.model(fb.input_ids, fb.positions, fb)
        if fb.mrope_positions is not None:  # images: the model's own forward (the native and compiled ones know
            self.attn_backend.init_forward_metadata(fb)  # neither M-RoPE nor the splice)
            return self.model(fb.input_ids, fb.mrope_positions, fb)
        native = self.native_forward
        if native is not None and fb.forward_mode == ForwardMode.DECODE:
            return native.decode(fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)
        if native is not None and fb.forward_mode == ForwardMode.EXTEND:
            return native.extend(fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices,
                                 torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64),
                                 torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64))
        self.attn_backend.init_forward_metadata(fb)
        if self.compiled_model is not None and (
                (fb.forward_mode == ForwardMode.DECODE and len(fb.seq_lens_cpu) <= self.config.torch_compile_max_bs)
                or (fb.forward_mode == ForwardMode.EXTEND and self.compile_extend)):
            # Dynamo guards on each input's inference-ness: a tensor made outside inference mode (a
            # merged batch's token ids, the allocator's slots) would recompile the graph, so every
            # per-batch input becomes an inference tensor first (copies only where needed).
            fb = dataclasses.replace(fb, **{name: _inference(getattr(fb, name)) for name in _BATCH_TENSORS})
            return self.compiled_model(fb.input_ids, fb.positions, fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def planned_no_metadata(self, fb: ForwardBatch) -> bool:
        """Whether forward(fb) ran a path that planned no attention metadata for fb itself: the native
        forward, or a graph's replay (which plans its padded static batch). A draft head's pass over fb's
        geometry then plans it (speculative/head_worker.py)."""
        graphs = self.cuda_graph_runner
        return self.native_forward is not None or (graphs is not None and graphs.can_run(fb))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32: the native LM head where the native forward
        serves (one call instead of the head's op dispatch), else the model's; the same values."""
        native = self.native_forward
        if native is not None and native.has_logits and hidden.dtype == torch.bfloat16:
            return native.logits(hidden)
        return self.model.compute_logits(hidden)

    def pool(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """An embedding engine's extend [num_tokens, hidden] -> each request's vector [bs, dim] float32,
        from the last token of its chunk (layers/pooler.py)."""
        assert self.pooler is not None and fb.forward_mode == ForwardMode.EXTEND, "an embedding engine only extends"
        return self.pooler(hidden[self.last_token_rows(fb)])

    @staticmethod
    def last_token_rows(fb: ForwardBatch) -> Optional[torch.Tensor]:
        if fb.forward_mode == ForwardMode.DECODE:
            return None
        ends = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(fb.input_ids.device)
