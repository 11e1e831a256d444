"""What the worker (the model runner, its pools, attention backend, graphs and kernels; the TP worker and
the draft head beside it) reads of the server args: ServerArgs.view(WorkerConfig). tests/test_flags.py
checks each field is a flag declared as read by the worker or as the model's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class WorkerConfig:
    # the checkpoint
    model_path: str
    dtype: str
    context_length: Optional[int]
    device: str
    random_seed: int
    # pools
    page_size: int
    max_total_tokens: Optional[int]
    max_running_requests: Optional[int]
    mem_fraction_static: float
    kv_cache_dtype: str
    disable_radix_cache: bool
    # image input: the vision embeddings' cache and ViT DP (model_executor/mm_embedder.py)
    mm_embedding_cache_mb: int
    mm_enable_dp_encoder: bool
    mamba_ssm_dtype: str
    max_mamba_cache_size: Optional[int]
    mamba_full_memory_ratio: float
    # releasing memory between rollouts (memory_saver.py)
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    # execution
    attention_backend: str
    flashinfer_decode_tensor_cores: str
    disable_cuda_graph: bool
    cuda_graph_max_bs: Optional[int]
    disable_fused_ops: bool
    small_batch_gemv_rows: int
    disable_packed_linear: bool
    disable_native_forward: bool
    enable_torch_compile: bool
    torch_compile_max_bs: int
    # speculative decoding's passes beside the model's
    speculative_algorithm: Optional[str]
    speculative_draft_model_path: Optional[str]
    speculative_token_map: Optional[str]
    speculative_num_steps: Optional[int]
    speculative_eagle_topk: Optional[int]
    speculative_num_draft_tokens: Optional[int]
    speculative_ngram_max_bfs_breadth: int
    speculative_disable_by_batch_size: int
    # an embedding engine: no LM head; each extend's last tokens pooled instead of sampled (layers/pooler.py)
    is_embedding: bool
    # multi-LoRA serving: the adapter pool (model_executor/lora_manager.py)
    enable_lora: bool
    lora_paths: tuple[str, ...]
    max_loras_per_batch: int
    max_lora_rank: Optional[int]
    lora_target_modules: Optional[tuple[str, ...]]
