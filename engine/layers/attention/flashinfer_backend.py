"""Attention through FlashInfer's paged-KV wrappers (CUDA only; fp16/bf16; head_dim 64/128/256).

The pool's per-layer [slots, kv_heads, head_dim] tensors are viewed as NHD pages
[slots // P, P, kv_heads, head_dim]; page 0 is the dummy page, never handed to a request.
Per pass: the page metadata (triton_ops/paged_kv_indices.py) is built once, the wrapper is planned
once in init_forward_metadata, and every layer only calls run():

    DECODE   BatchDecodeWithPagedKVCacheWrapper   one query per request
    EXTEND   BatchPrefillWithPagedKVCacheWrapper  causal, bottom-right aligned, so new token j of a
                                                  request with a cached prefix of p tokens sees
                                                  keys 0 .. p + j (prefix pages included); a
                                                  verify step with tree drafts plans a custom
                                                  mask instead (layers/attention/masks.py)

Decode runs on tensor cores (FlashInfer's prefill kernel with one query row per request) where
--flashinfer-decode-tensor-cores says so; auto: for GQA groups of 4 or more query heads per KV head,
where the group's rows fill an MMA tile and the KV is read at a higher rate than by the CUDA-core
decode kernel (SGLang's rule; measured by `baton bench step`).

A pass's new K/V may already be in the pool when a layer calls in (layers/qkv_rope.py stores them
in its fused kernel: `reads_new_kv_from_pool`); every layer then attends from the pool alone.

CUDA graphs (model_executor/cuda_graph_runner.py): one decode wrapper per captured batch size,
created with use_cuda_graph=True over preallocated indptr / last_page_len buffers and one shared
kv_indices buffer, and planned again (outside the graph) before every replay; speculative verify
steps (N tokens per request) likewise with a prefill wrapper per captured size: causal, or, where the
engine drafts trees, over a shared packed-mask buffer and a mask indptr of its own, which every plan
fills (a graph captured with a custom mask reads one on every replay, so such a wrapper is always
planned with one: a chain's is causal).

A plan with a custom mask packs it into bits (flashinfer's segment_packbits), which reads the packed
size back from the device: a tree step's plan waits for the work queued before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from baton.engine.core.forward_batch import AttentionBackend
from baton.engine.layers.attention import use_tensor_core_decode
from baton.engine.layers.attention.masks import flat_extend_mask
from baton.engine.triton_ops.paged_kv_indices import build_paged_kv_metadata, qo_indptr_of

try:
    import flashinfer
except ImportError as e:  # the registry imports this module only when --attention-backend flashinfer
    raise ImportError("--attention-backend flashinfer needs the flashinfer-python package (and a CUDA "
                      "device); install it or use --attention-backend torch") from e

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.layers.radix_attention import RadixAttention

# FlashInfer's recommended float workspace (split-KV partial results).
WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# The FA2 decode kernel's compiled GQA group sizes (DISPATCH_GQA_GROUP_SIZE in flashinfer/utils.cuh).
SUPPORTED_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
# Pinned to one kernel family: "auto" may pick other backends per plan (and each JIT-compiles).
KERNEL_BACKEND = "fa2"


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the decode or prefill wrapper planned for this pass


@dataclass(frozen=True)
class AttnGeometry:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


def attn_geometry(model: torch.nn.Module) -> AttnGeometry:
    """Head geometry of the model's attention layers; FlashInfer plans once per pass for all layers,
    so every layer must agree."""
    from baton.engine.layers.radix_attention import RadixAttention

    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    if not layers:
        raise ValueError("the model has no RadixAttention layers")
    shapes = {(m.num_heads, m.num_kv_heads, m.head_dim, m.scaling) for m in layers}
    if len(shapes) != 1:
        raise NotImplementedError(f"FlashInfer backend needs one attention geometry for all layers, got {shapes}")
    heads, kv_heads, head_dim, scaling = shapes.pop()
    return AttnGeometry(heads, kv_heads, head_dim, scaling)


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    reads_new_kv_from_pool = True  # every run() reads the pass's K/V from the paged pool

    def __init__(self, model_runner: Any, **_unused: Any) -> None:
        pool = model_runner.token_to_kv_pool
        self._check_supported(str(model_runner.device), model_runner.dtype, pool.dtype, model_runner.head_dim)
        self.geometry = attn_geometry(model_runner.model)
        group = self.geometry.num_qo_heads // self.geometry.num_kv_heads
        setting = getattr(getattr(model_runner, "config", None), "flashinfer_decode_tensor_cores", "auto")
        self.decode_tensor_cores = use_tensor_core_decode(setting, group)
        if group not in SUPPORTED_GROUP_SIZES and not self.decode_tensor_cores:
            raise ValueError(f"--attention-backend flashinfer: GQA group size {group} is not one of "
                             f"{SUPPORTED_GROUP_SIZES}; use --flashinfer-decode-tensor-cores on or --attention-backend torch")
        self.dtype, self.kv_dtype = model_runner.dtype, pool.dtype
        self.page_size = pool.page_size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = self.req_to_token.device
        self.max_pages_per_req = -(-self.req_to_token.shape[1] // self.page_size)
        g = self.geometry
        # [slots, H, D] -> [pages, P, H, D]: a view, so run() reads the very tensors store_kv writes
        self.paged_kv = [(k.view(-1, self.page_size, g.num_kv_heads, g.head_dim),
                          v.view(-1, self.page_size, g.num_kv_heads, g.head_dim))
                         for k, v in zip(pool.k_buffer, pool.v_buffer)]
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend=KERNEL_BACKEND)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=KERNEL_BACKEND)
        self._plan_fence: Optional[torch.cuda.Event] = None
        self._graph_wrappers: dict[tuple[str, int], Any] = {}  # (decode | verify, batch size)
        self._graph_kv_indices: Optional[torch.Tensor] = None
        self._graph_mask: Optional[torch.Tensor] = None  # packed tree masks of the verify graphs (uint8)

    @staticmethod
    def _check_supported(device: str, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> None:
        if not device.startswith("cuda"):
            raise ValueError(f"--attention-backend flashinfer needs --device cuda, got {device!r}")
        if dtype not in SUPPORTED_DTYPES or kv_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"--attention-backend flashinfer needs float16 or bfloat16 (model {dtype}, KV {kv_dtype}); "
                             "pass --dtype float16/bfloat16, or use --attention-backend torch for float32")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"--attention-backend flashinfer supports head_dim {SUPPORTED_HEAD_DIMS}, "
                             f"the model has {head_dim}; use --attention-backend torch")

    # ------------------------------------------------------------------ planning
    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """plan() with a fence. plan() fills a pinned host buffer and copies it to the device
        asynchronously; the next plan() refills that buffer. The overlap loop plans batch N+1 before
        the GPU may have reached batch N's copy, so wait until the previous plan's copy ran (the GPU
        then works on batch N while the CPU launches N+1)."""
        if self._plan_fence is not None:
            self._plan_fence.synchronize()
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.geometry.scaling,
                      pos_encoding_mode="NONE", non_blocking=True)
        wrapper.plan(*args, **common, **kwargs)
        self._plan_fence = torch.cuda.Event()
        self._plan_fence.record()

    def _plan_decode(self, wrapper: Any, fb: "ForwardBatch", out: Optional[torch.Tensor] = None) -> None:
        g = self.geometry
        meta = build_paged_kv_metadata(self._table(fb), fb.req_pool_indices, fb.seq_lens_cpu, self.page_size, out)
        self._plan(wrapper, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                   g.num_qo_heads, g.num_kv_heads, g.head_dim, self.page_size)
        fb.attn_metadata = FlashInferMetadata(wrapper)

    def _plan_extend(self, fb: "ForwardBatch", wrapper: Any = None, out: Optional[torch.Tensor] = None) -> None:
        g = self.geometry
        wrapper = wrapper or self.prefill_wrapper
        meta = build_paged_kv_metadata(self._table(fb), fb.req_pool_indices, fb.seq_lens_cpu, self.page_size, out)
        mask = {"causal": True}
        if fb.tree_parents is not None:  # a verify step with tree drafts: each request's mask (masks.py)
            mask = {"custom_mask": flat_extend_mask(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                                    fb.tree_parents, self.device)}
        self._plan(wrapper, qo_indptr_of(fb.extend_seq_lens_cpu), meta.kv_indptr, meta.kv_indices,
                   meta.kv_last_page_len, g.num_qo_heads, g.num_kv_heads, g.head_dim, self.page_size, **mask)
        fb.attn_metadata = FlashInferMetadata(wrapper)

    def _table(self, fb: "ForwardBatch") -> torch.Tensor:
        """The request-to-token table the batch reads through: the runner's, or a table of its own (a
        draft head's branches, speculative/head_worker.py)."""
        pool = fb.req_to_token_pool
        return self.req_to_token if pool is None else pool.req_to_token

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if forward_batch.forward_mode.is_decode():
            self._plan_decode(self.decode_wrapper, forward_batch)
        elif forward_batch.forward_mode.is_extend():
            self._plan_extend(forward_batch)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """One kv_indices buffer for every captured batch size: its address is baked into the graphs."""
        self._graph_kv_indices = torch.zeros(max_bs * self.max_pages_per_req, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture(self, forward_batch: "ForwardBatch") -> None:
        """Before capturing batch size bs: a fixed-size wrapper over static buffers, planned once."""
        assert self._graph_kv_indices is not None, "init_cuda_graph_state first"
        bs = forward_batch.batch_size
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self._graph_kv_indices,
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=self.device),
            backend=KERNEL_BACKEND)
        self._graph_wrappers[("decode", bs)] = wrapper
        self._plan_decode(wrapper, forward_batch, out=self._graph_kv_indices)

    def init_forward_metadata_replay(self, forward_batch: "ForwardBatch") -> None:
        """Before replaying the graph of batch size bs (padded rows included)."""
        wrapper = self._graph_wrappers[("decode", forward_batch.batch_size)]
        self._plan_decode(wrapper, forward_batch, out=self._graph_kv_indices)

    def init_forward_metadata_capture_verify(self, forward_batch: "ForwardBatch") -> None:
        """Before capturing the verify graph of batch size bs (N tokens per request; causal, or masked by
        trees where the batch names them, forward_batch.tree_parents): a fixed-size prefill wrapper over
        static buffers, planned once. Captured largest first, so the shared mask buffer is sized then."""
        assert self._graph_kv_indices is not None, "init_cuda_graph_state first"
        bs = forward_batch.batch_size
        masks = {}
        if forward_batch.tree_parents is not None:
            n = forward_batch.extend_seq_lens_cpu[0]
            if self._graph_mask is None:  # every request N rows over at most a whole row of req_to_token
                per_request = -(-n * self.req_to_token.shape[1] // 8)
                self._graph_mask = torch.zeros(bs * per_request, dtype=torch.uint8, device=self.device)
            masks = dict(custom_mask_buf=self._graph_mask,
                         mask_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=self.device))
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buf=self._graph_kv_indices,
            paged_kv_last_page_len_buf=torch.zeros(bs, dtype=torch.int32, device=self.device),
            backend=KERNEL_BACKEND, **masks)
        self._graph_wrappers[("verify", bs)] = wrapper
        self._plan_extend(forward_batch, wrapper, out=self._graph_kv_indices)

    def init_forward_metadata_replay_verify(self, forward_batch: "ForwardBatch") -> None:
        """Before replaying the verify graph of batch size bs (padded requests included)."""
        wrapper = self._graph_wrappers[("verify", forward_batch.batch_size)]
        self._plan_extend(forward_batch, wrapper, out=self._graph_kv_indices)

    # ------------------------------------------------------------------ attention
    def _run(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layer: "RadixAttention",
             fb: "ForwardBatch", save_kv_cache: bool) -> torch.Tensor:
        if save_kv_cache:
            self._save_kv(k, v, layer, fb)
        n = q.shape[0]
        q3 = q.reshape(n, layer.num_heads, layer.head_dim).contiguous()  # [n, num_heads, head_dim]
        out = fb.attn_metadata.wrapper.run(q3, self.paged_kv[layer.layer_id])
        return out.view(n, layer.num_heads * layer.head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)
