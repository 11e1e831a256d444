"""Server arguments: the head of the one configuration chain (server args -> scheduler -> model).

Flag names follow SGLang's where the meaning is the same, so users can move over.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Optional, TypeVar

from baton.engine.parsers import REASONING_PARSERS, TOOL_PARSERS
from baton.flags import FlagTable, declared_flags, flag, from_args

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
ATTENTION_BACKENDS = ("torch", "flashinfer")
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e5m2")
MAMBA_SSM_DTYPES = ("float32", "bfloat16", "float16")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
# --speculative-algorithm: SGLang's names
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "NEXTN")
# the ones whose drafts come from a draft checkpoint (--speculative-draft-model-path)
DRAFT_CHECKPOINT_ALGORITHMS = ("EAGLE", "EAGLE3")
# --max-image-pixels' default: Pillow's own decompression-bomb threshold (PIL.Image.MAX_IMAGE_PIXELS),
# what SGLang and vLLM, which leave Pillow's limit as it is, accept without a warning
MAX_IMAGE_PIXELS = 1024 ** 3 // 12
# the modalities --limit-mm-data-per-request may name (SGLang's keys)
MM_MODALITIES = ("image", "video", "audio")
# How the front end picks a DP rank for a request that names none (data_parallel_rank) and has no
# bootstrap room (PD: room % dp_size, the convention the router pins ranks by).
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


# --chunked-prefill-size when not given: a step must stay short where prefill is slow, since nothing
# else runs during it (decodes too, without --enable-mixed-chunk) and the watchdog ends a step past
# --watchdog-timeout. Measured on the 2-core CI VM, an 8,000-token prompt on SmolLM2-135M (float32),
# with a stream decoding beside it: chunk 8192, one 50 s step; 2048, longest step 11 s (33 s in all);
# 1024, 5.5 s (31 s); 512, 3.1 s (31 s); 256, 3.6 s (43 s). GPUs keep SGLang's large-GPU default.
CPU_CHUNKED_PREFILL_SIZE = 512
GPU_CHUNKED_PREFILL_SIZE = 8192


# --lora-target-modules: the projections LoRA serves (SGLang's names; `all`: every one)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraPath(NamedTuple):
    """One adapter of --lora-paths."""

    name: str
    path: str
    pinned: bool = False


def parse_lora_paths(items: tuple[str, ...]) -> list[LoraPath]:
    """--lora-paths as SGLang takes them: NAME=PATH, PATH (named by itself), or a JSON object with
    lora_name, lora_path and optionally pinned. Names are unique."""
    out: list[LoraPath] = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                raw = json.loads(item)
                out.append(LoraPath(str(raw["lora_name"]), str(raw["lora_path"]), bool(raw.get("pinned", False))))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-paths {item!r}: a JSON adapter needs lora_name and lora_path") from None
        else:
            name, sep, path = item.partition("=")
            out.append(LoraPath(name, path) if sep else LoraPath(item, item))
    names = [a.name for a in out]
    if len(set(names)) != len(names) or not all(names) or not all(a.path for a in out):
        raise ValueError(f"--lora-paths: every adapter needs a path and a name of its own, got {list(items)}")
    return out


class EventLoop(Enum):
    PLAIN = "plain"  # schedule N -> run N -> process N
    OVERLAP = "overlap"  # schedule N+1 -> launch N+1 -> process N (while N+1 computes)


class EventLoopChoice(NamedTuple):
    """Which loop the scheduler runs, and why (ServerArgs.event_loop; /get_server_info)."""

    loop: EventLoop
    reason: str

    @property
    def overlap(self) -> bool:
        return self.loop is EventLoop.OVERLAP


def default_chunked_prefill_size(device: str) -> int:
    return CPU_CHUNKED_PREFILL_SIZE if device.startswith("cpu") else GPU_CHUNKED_PREFILL_SIZE


def mm_data_limits(value: Any) -> Optional[dict[str, int]]:
    """--limit-mm-data-per-request as a dict: SGLang's JSON ('{"image": 4}', modalities from
    MM_MODALITIES), or a plain number of images ("4"); None stays None."""
    if value is None or isinstance(value, dict):
        limits = value
    elif isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        limits = {"image": int(value)}
    else:
        try:
            limits = json.loads(value)
        except (TypeError, ValueError):
            limits = value
    ok = limits is None or (isinstance(limits, dict) and all(
        k in MM_MODALITIES and isinstance(n, int) and not isinstance(n, bool) and n >= 0 for k, n in limits.items()))
    if not ok:
        raise ValueError(f"--limit-mm-data-per-request {value!r}: give a number of images or a JSON object of "
                         f"counts >= 0 by modality ({', '.join(MM_MODALITIES)}), e.g. '{{\"image\": 4}}'")
    return limits


def auto_dtype_name(checkpoint_dtype: Optional[str], device: str) -> str:
    """--dtype auto: the checkpoint's dtype, except float16 on CPU -> float32 (CPU float16 matmuls are
    slow) and float32 on CUDA -> float16 (as SGLang and vLLM do: half precision is what FlashInfer
    and CUDA-graph decode run; --dtype float32 keeps it)."""
    name = checkpoint_dtype if checkpoint_dtype in ("float32", "float16", "bfloat16") else "float32"
    if name == "float16" and device.startswith("cpu"):
        return "float32"
    if name == "float32" and device.startswith("cuda"):
        return "float16"
    return name


# The components that read the flags (Flag.owner), in the order `baton serve --help` and docs/flags.md show them.
FLAG_OWNERS = {
    "model": "the checkpoint and how it is loaded (model_executor/model_loader.py, through the model runner)",
    "http": "the HTTP server and the OpenAI API (entrypoints/http_server.py, openai_api.py, http_common.py)",
    "tokenizer": "the tokenizer manager: tokenizer, chat template, DP dispatch (tokenizer_manager.py)",
    "launcher": "the engine's processes, ranks, GPUs, CPU binding and logs (entrypoints/engine.py and each "
                "scheduler process's start)",
    "scheduler": "admission, batching, the prefix cache and the event loop (scheduler/)",
    "worker": "the forward pass: KV and state pools, attention backend, CUDA graphs, kernels, TP (the model "
              "runner, model_executor/)",
    "speculative": "speculative decoding (speculative/)",
    "pd": "prefill/decode disaggregation: bootstrap and KV transfer (disaggregation/)",
}

_View = TypeVar("_View")


@dataclass(frozen=True)
class ServerArgs:
    """`baton serve`'s flags, one field each (baton/flags.py generates the parser from them)."""

    model_path: str = flag(help="local Hugging Face directory (config.json, *.safetensors, tokenizer)",
                           owner="model", also=("tokenizer", "http"))
    tokenizer_path: Optional[str] = flag(None, help="a tokenizer directory other than --model-path",
                                         owner="tokenizer", also=("scheduler",))
    served_model_name: Optional[str] = flag(
        None, help="the model name the API reports and accepts (default: --model-path's last folder)", owner="http")
    host: str = flag("127.0.0.1", help="address the HTTP server binds", owner="http", also=("pd",))
    port: int = flag(30000, help="the HTTP server's port", owner="http")
    device: str = flag("cpu", choices=("cpu", "cuda"), help="where the model runs", owner="worker",
                       also=("scheduler", "launcher"))
    dtype: str = flag("auto", choices=MODEL_DTYPES,
                      help="the weights' and activations' dtype; auto: the checkpoint's, except float16 on CPU "
                           "(float32) and float32 on CUDA (float16)", owner="model")
    # A smaller KV dtype holds more tokens in the same memory and halves/quarters what each decode step reads.
    kv_cache_dtype: str = flag("auto", choices=KV_CACHE_DTYPES,
                               help="dtype of the KV cache (auto: the model's); fp8_e5m2 stores a quarter of "
                                    "float32's bytes", owner="worker")
    context_length: Optional[int] = flag(
        None, help="the longest prompt plus output a request may have (default: the model's "
                   "max_position_embeddings)", owner="model")
    # An embedding engine ends every request after its prefill with the pooled hidden state of the
    # prompt's last token (layers/pooler.py); it serves /v1/embeddings, /encode and /classify, not generation.
    is_embedding: bool = flag(
        False, help="serve an embedding model (Qwen3-Embedding; a bare Qwen3Model / LlamaModel checkpoint) or a "
                    "sequence classifier (Qwen3ForSequenceClassification): last-token pooling, L2-normalised "
                    "(a classifier: its score head's logits), on /v1/embeddings, /encode and /classify; the "
                    "generation routes answer 400 (SGLang's flag)", owner="model", also=("scheduler", "http"))
    # memory
    page_size: int = flag(1, help="tokens per KV-cache page, the unit the prefix cache matches and the pool hands "
                                  "out", owner="worker", also=("scheduler",))
    max_total_tokens: Optional[int] = flag(
        None, help="KV pool size in tokens (default: from --mem-fraction-static)", owner="worker")
    mem_fraction_static: float = flag(
        0.85, help="without --max-total-tokens, the pools' share of memory: on CUDA of the GPU memory free after "
                   "the weights; on CPU the pools leave this share of the RAM", owner="worker")
    max_running_requests: Optional[int] = flag(
        None, help="requests decoded at once (default: from the KV pool's size; a hybrid model's state slots cap "
                   "it)", owner="scheduler", also=("worker",))
    max_queued_requests: Optional[int] = flag(None, help="reject with 503 beyond this many waiting requests",
                                              owner="scheduler")
    max_prefill_tokens: int = flag(16384, help="new (uncached) prompt tokens one prefill batch takes",
                                   owner="scheduler")
    # None: by device, default_chunked_prefill_size
    chunked_prefill_size: Optional[int] = flag(
        None, help=f"prompt tokens per prefill step; -1 disables chunking; default by device: "
                   f"{CPU_CHUNKED_PREFILL_SIZE} on CPU, {GPU_CHUNKED_PREFILL_SIZE} on CUDA", owner="scheduler")
    disable_radix_cache: bool = flag(
        False, help="no prefix cache: every prompt is prefilled whole (and the waiting queue is fcfs)",
        owner="scheduler", also=("worker",))
    # the conv state keeps the model's dtype
    mamba_ssm_dtype: str = flag(
        "float32", choices=MAMBA_SSM_DTYPES,
        help="hybrid models: dtype of the linear-attention layers' recurrent (delta-rule) state", owner="worker")
    max_mamba_cache_size: Optional[int] = flag(
        None, help="hybrid models: recurrent-state slots; running requests are capped by it (default: from "
                   "--max-running-requests, else --mamba-full-memory-ratio)", owner="worker")
    mamba_full_memory_ratio: float = flag(  # SGLang's default
        0.9, help="hybrid models, KV pool sized from free memory: state-pool bytes to KV-pool bytes", owner="worker")
    # checkpoints are also taken at chunk ends, prompt ends and request ends
    mamba_track_interval: Optional[int] = flag(
        None, help="hybrid models with the radix cache: keep a recurrent-state checkpoint every this many tokens "
                   "(a multiple of --page-size; default: 256, rounded up to one)", owner="scheduler")
    # releasing memory between rollouts (/release_memory_occupation, model_executor/memory_saver.py): SGLang's flags
    enable_memory_saver: bool = flag(
        False, help="allow /release_memory_occupation and /resume_memory_occupation: while released the KV pool (with "
                    "a hybrid model's state pool) and the weights are really freed (on CPU their pages go back to "
                    "the OS)", owner="worker")
    enable_weights_cpu_backup: bool = flag(
        False, help="with --enable-memory-saver: keep a host copy of the weights while they are released and "
                    "restore it on resume (without it they are reloaded from --model-path)", owner="worker")
    # scheduling
    schedule_policy: str = flag(
        "fcfs", choices=SCHEDULE_POLICIES,
        help="the waiting queue's order: first come, longest prefix match, prefix-tree depth first (heavier "
             "subtrees first), longest output first, or random", owner="scheduler")
    enable_priority_scheduling: bool = flag(
        False, help="order the waiting queue by each request's priority first; a request may retract running "
                    "ones of lower priority", owner="scheduler")
    priority_preemption_threshold: int = flag(
        10, help="with --enable-priority-scheduling: a request retracts running ones whose priority is lower by "
                 "at least this much", owner="scheduler")
    schedule_conservativeness: float = flag(
        1.0, help="scales the share of the running requests' remaining tokens that admission keeps free for "
                  "them (more: fewer admissions, fewer retractions)", owner="scheduler")
    # so that decoding does not stall while prompts are prefilled (SGLang's flag)
    enable_mixed_chunk: bool = flag(
        False, help="run one decode step of the running requests inside each prefill batch (colocated only)",
        owner="scheduler")
    # image input (engine/multimodal): the processor's concurrency, the vision embeddings' cache, ViT DP
    mm_max_concurrent_calls: int = flag(
        32, help="images processed at once in the tokenizer process (decoding, resizing, patches); more wait",
        owner="tokenizer")
    mm_encoder_max_patches: int = flag(
        16384, help="image patches the vision tower encodes in one step, the budget of its activations: a prefill "
                    "batch takes no further request with images past it, and a single image with more is refused "
                    "(413)", owner="scheduler", also=("tokenizer",))
    mm_embedding_cache_mb: int = flag(
        512, help="the vision tower's outputs kept per image hash (MB, least recently used out): a repeated image "
                  "skips the encoder; 0 disables it", owner="worker")
    mm_enable_dp_encoder: bool = flag(
        False, help="with --tp-size N, each rank encodes its share of a batch's images with the full vision "
                    "weights and the embeddings are gathered (ViT data parallelism); without it the first rank "
                    "encodes them all and sends the embeddings", owner="worker")
    # chat (entrypoints/chat_tools.py, engine/parsers)
    chat_template: Optional[str] = flag(None, help="a Jinja chat template file, instead of the tokenizer's",
                                        owner="tokenizer")
    tool_call_parser: Optional[str] = flag(
        None, choices=TOOL_PARSERS,
        help="the model's tool-call format: chat requests with tools get tool_calls (tool_choice auto)", owner="http")
    reasoning_parser: Optional[str] = flag(
        None, choices=REASONING_PARSERS, help="split the model's <think> block into reasoning_content",
        owner="http", also=("scheduler",))
    # structured output (engine/constrained)
    grammar_backend: str = flag(
        "xgrammar", choices=["xgrammar", "none"],
        help="structured output (json_schema, regex, ebnf, response_format); none refuses it with a 400",
        owner="scheduler")
    constrained_json_disable_any_whitespace: bool = flag(
        False, help="JSON schemas allow no free whitespace (small models can loop on it)", owner="scheduler",
        also=("http",))
    disable_overlap_schedule: bool = flag(False, help="run the plain loop: schedule, run and process each batch "
                                                      "in turn", owner="scheduler", also=("worker",))
    # Overlap is on by default on CUDA, and on CPU where the native forward serves the model on two
    # threads or more (its steps run on a C thread, cpu_forward.c, joined by the scheduler's thread
    # while it waits; measured faster than the plain loop, docs/benchmarks.md).
    # A CPU model on its own Python forward keeps the plain loop: there a worker thread holds the GIL
    # between small ops and contends with the scheduler instead of overlapping it. This forces the
    # overlap loop on (tests use it). The whole rule: event_loop() below.
    enable_overlap_schedule: bool = flag(
        False, help="use the overlap loop on CPU even where it is not the default (default: on for CUDA, and on CPU "
                    "where the native forward serves the model on two threads or more; /get_server_info's "
                    "event_loop says which loop runs, event_loop_reason why)", owner="scheduler")
    stream_interval: int = flag(1, help="a streaming request gets its new tokens every this many tokens",
                                owner="scheduler")
    # execution
    # auto: FlashInfer on CUDA when it is installed and the model runs in half precision (its
    # kernels, and with them CUDA-graph decode), else the torch backend
    attention_backend: str = flag(
        "auto", choices=("auto",) + ATTENTION_BACKENDS,
        help="auto (default): flashinfer on CUDA for float16/bfloat16 when installed, else torch", owner="worker")
    disable_cuda_graph: bool = flag(False, help="CUDA: run every decode step eagerly, without CUDA graphs",
                                    owner="worker")
    # None: sized to the GPU's memory at start-up (cuda_graph_max_bs_for, as SGLang sizes it)
    cuda_graph_max_bs: Optional[int] = flag(
        None, help="decode batches up to this size replay a CUDA graph (padded to the next captured size); "
                   "default: by GPU memory, 8 under 20 GiB up to 256 from 90 GiB (capped by --max-running-requests)",
        owner="worker")
    # tensor cores: FlashInfer's prefill kernel, one query row per request, reads the KV faster for large GQA groups
    flashinfer_decode_tensor_cores: str = flag(
        "auto", choices=("auto", "on", "off"),
        help="FlashInfer decode attention on tensor cores; auto: for 4 or more query heads per KV head",
        owner="worker")
    disable_fused_ops: bool = flag(
        False, help="CUDA: run RMSNorm, the gated activation and the attention input (q/k norm, RoPE, KV store) "
                    "on their torch reference paths instead of the Triton kernels", owner="worker")
    small_batch_gemv_rows: int = flag(  # triton_ops/gemv.py
        0, metavar="N",
        help="CUDA: linear layers of 1..N rows (decode batches up to N) run one Triton GEMV kernel instead of "
             "cuBLAS (gate|up with silu*up fused in, the pre-norms folded into qkv and gate|up); 0 (default) keeps "
             "cuBLAS. On an H200 with the 8B shape (before the norms were folded in), 16 made the decode step "
             "3-4% faster at batch 1 and 16, 64 made batch 64 5% slower", owner="worker")
    enable_torch_compile: bool = flag(
        False, help="compile the decode forward (and on CPU the extend) with torch.compile at start-up",
        owner="worker")
    cpu_omp_threads_bind: str = flag(  # utils/cpu_affinity.py
        "off", metavar="off|auto|CPULIST",
        help="CPU serving: pin the forward pass to these CPUs (one torch thread each) and the HTTP server "
             "and detokenizer to the rest; auto keeps the last CPU for them", owner="launcher")
    disable_packed_linear: bool = flag(  # engine/kernels/cpu_linear.py
        False, help="CPU, bfloat16: keep torch's GEMM for the linear layers and LM head instead of the "
                    "AVX512_BF16 kernel over weights packed at load", owner="worker")
    disable_native_forward: bool = flag(  # engine/model_executor/native_forward.py
        False, help="CPU, bfloat16 dense Llama-family models: run every step through the model's own (possibly "
                    "compiled) forward instead of one native call per step", owner="worker")
    torch_compile_max_bs: int = flag(32, help="decode batches larger than this run eagerly", owner="worker")
    random_seed: int = flag(0, help="seeds torch at start-up and the random schedule policy", owner="worker",
                            also=("scheduler",))
    weight_version: str = flag(  # core/weight_version.py
        "default", help="the weights' version at start-up, reported in every response's meta_info; each weight "
                        "update sets the next (its weight_version, else the count of updates)", owner="scheduler",
        also=("http",))
    # serving
    api_key: Optional[str] = flag(None, env="BATON_API_KEY", repr=False,  # never logged
                                  help="bearer key clients must send (default: $BATON_API_KEY)", owner="http")
    admin_api_key: Optional[str] = flag(  # never logged; entrypoints/auth.py
        None, env="BATON_ADMIN_API_KEY", repr=False,
        help="bearer key the control routes (weight updates, pause, memory release, profiling, ...) need instead "
             "of --api-key (SGLang's flag; default: $BATON_ADMIN_API_KEY)", owner="http")
    strict_model_name: bool = flag(
        False, help="refuse (404) an OpenAI request whose `model` is neither --served-model-name nor --model-path "
                    "(default: any name is served, as SGLang does)", owner="http")
    allow_auto_truncate: bool = flag(
        False, help="cut a prompt past the context length to its first tokens, and max_tokens / max_new_tokens to "
                    "what the context leaves, instead of answering 400 (SGLang's flag)", owner="tokenizer")
    max_request_bytes: int = flag(16 * 1024 * 1024, help="larger request bodies are refused with 413",
                                  owner="http")
    request_read_timeout: float = flag(
        60.0, help="seconds a client has to send a request's head (from the connection or the last response: else "
                   "the connection is closed), and again its body (else 408): a client that stalls would hold its "
                   "connection for good (0: no limit)", owner="http")
    log_level: str = flag("info", help="the engine processes' Python log level (debug, info, warning, error; an "
                                       "unknown name: info)",
                          owner="launcher")
    decode_log_interval: int = flag(
        40, help="log the running batch (requests, tokens, throughput, queue) every this many decode steps",
        owner="scheduler")
    watchdog_timeout: float = flag(
        300.0, help="seconds one scheduler step (a forward pass, a hung GPU or transfer) may take before the "
                    "engine dumps its threads' stacks and exits non-zero, so its pod is restarted (0: off)",
        owner="scheduler")
    # nothing reads it: /metrics is always served
    enable_metrics: bool = flag(True, names=("--disable-metrics",), invert=True,
                                help="accepted and ignored: /metrics is always served", owner="http")
    # speculative decoding (engine/speculative): SGLang's flags
    speculative_algorithm: Optional[str] = flag(
        None, choices=SPECULATIVE_ALGORITHMS,
        help="speculative decoding: NGRAM drafts from each request's own prompt and output (no draft model); "
             "NEXTN drafts with the checkpoint's multi-token-prediction head (Qwen3-Next, Qwen3.5); EAGLE and "
             "EAGLE3 with an EAGLE draft checkpoint (--speculative-draft-model-path)",
        owner="speculative", also=("worker",))
    # None: NGRAM's max match window, as SGLang
    speculative_num_draft_tokens: Optional[int] = flag(
        None, help="tokens a verify step runs per request: its last token and up to this many - 1 drafts "
                   "(default: NGRAM --speculative-ngram-max-match-window-size, NEXTN and EAGLE 1 + topk x "
                   "--speculative-num-steps)", owner="speculative", also=("worker",))
    speculative_draft_model_path: Optional[str] = flag(  # models/eagle.py
        None, help="EAGLE / EAGLE3: the draft checkpoint's directory (config.json, safetensors or pytorch_model.bin)",
        owner="speculative", also=("worker",))
    speculative_token_map: Optional[str] = flag(  # FR-Spec
        None, help="EAGLE: a .pt file of token ids (a hot vocabulary, as FR-Spec's freq_*.pt); the draft's LM head "
                   "scores only those, which cuts its cost where the vocabulary is large",
        owner="speculative", also=("worker",))
    # A head drafts (speculative/head_worker.py); None: 3, SGLang's recommended chain for Qwen3-Next
    speculative_num_steps: Optional[int] = flag(
        None, help="NEXTN, EAGLE: draft steps per verify step, the chain's length (default 3)",
        owner="speculative", also=("worker",))
    speculative_eagle_topk: Optional[int] = flag(
        None, help="NEXTN, EAGLE: candidates per draft step; > 1 grows a tree best-first by the head's scores "
                   "(SGLang's EAGLE trees: the k best children of the k best leaves per step, the "
                   "--speculative-num-draft-tokens - 1 best nodes), verified as one tree (default 1: a chain)",
        owner="speculative", also=("worker",))
    # 3, not SGLang's 1: SGLang's drafter weighs matches by frequency in a trie of recent requests, ours
    # takes the latest occurrence in one request, and after a one- or two-token match that was mostly
    # wrong (code-edit workload, SmolLM2, one request: 1.29x with 1, 1.53x with 2, 2.16x with 3)
    speculative_ngram_min_match_window_size: int = flag(
        3, help="NGRAM: the shortest suffix of a request's tokens looked up in its earlier tokens",
        owner="speculative")
    speculative_ngram_max_match_window_size: int = flag(
        12, help="NGRAM: the longest suffix looked up (the longest match found wins)", owner="speculative")
    speculative_ngram_max_bfs_breadth: int = flag(
        1, help="NGRAM: continuations per draft, from different earlier occurrences of the matched suffix, "
                "merged into a tree verified in one pass under a tree mask (default 1: a chain)",
        owner="speculative", also=("worker",))
    speculative_ngram_capacity: int = flag(  # speculative/ngram_index.py SharedNgrams
        0, metavar="TOKENS",
        help="NGRAM: keep this many tokens of recently finished requests (their prompts and outputs), whose "
             "n-grams a request drafts from where its own tokens hold no match (default 0: its own only)",
        owner="speculative")
    # At large batches a step is compute-bound. A prefill engine, which never decodes, ignores it; a decode
    # engine speculates once the KV has arrived.
    speculative_disable_by_batch_size: int = flag(
        4, help="decode steps of this many running requests or more do not speculate (under load a step is "
                "compute-bound and drafts only cost)", owner="speculative", also=("worker",))
    # image input (multimodal/media.py): where images may come from and how large they may be
    allowed_local_media_path: Optional[str] = flag(
        None, metavar="DIR",
        help="image input: the directory whose files requests may name (a path, or a file:// URL), symlinks and .. "
             "resolved before the check; default: none, local files are refused", owner="tokenizer")
    allowed_media_domains: tuple[str, ...] = flag(
        default_factory=tuple, cli_default=[], nargs="+", metavar="HOST",
        help="image input: the hosts whose http(s) image URLs are fetched (exact names, any port; a redirect must "
             "stay among them; space- or comma-separated); default: none, every URL is refused, since a server "
             "that fetches whatever URL a client names lets clients reach what only the server can",
        owner="tokenizer")
    limit_mm_data_per_request: Optional[dict[str, int]] = flag(
        None, metavar="JSON|N",
        help='image input: the most images one request (one prompt) may carry, as SGLang\'s JSON ({"image": 4}) or '
             "a number of images; more is a 400 before any is fetched (default: no limit)",
        owner="http", also=("tokenizer",))
    max_image_pixels: int = flag(
        MAX_IMAGE_PIXELS, help="image input: width x height above this is a 413, checked from the image's header "
                               "before its pixels are decoded (default: Pillow's decompression-bomb threshold)",
        owner="tokenizer")
    max_media_bytes: int = flag(
        20 * 1024 * 1024, help="image input: the bytes one image may have, fetched, read or decoded from base64 "
                               "(413 beyond; a download stops there)", owner="tokenizer")
    media_fetch_timeout: float = flag(
        10.0, help="image input: seconds to fetch one image URL, redirects and body included (400 beyond)",
        owner="tokenizer")
    # multi-LoRA serving (scheduler/lora.py, model_executor/lora_manager.py, docs/api.md "LoRA"): SGLang's flags
    enable_lora: bool = flag(
        False, help="serve LoRA adapters (PEFT format) beside the base model: a request picks one by name "
                    "(lora_path, or an OpenAI model of the form base:adapter), and requests under different "
                    "adapters and none share batches; on by itself with --lora-paths",
        owner="scheduler", also=("worker", "tokenizer", "http"))
    lora_paths: tuple[str, ...] = flag(
        default_factory=tuple, cli_default=[], nargs="+", metavar="NAME=PATH", parse=tuple,
        help='adapters loaded at start-up, each NAME=PATH, PATH (its own name) or SGLang\'s JSON '
             '{"lora_name": ..., "lora_path": ..., "pinned": ...}', owner="scheduler",
        also=("worker", "tokenizer", "http"))
    max_loras_per_batch: int = flag(
        8, help="distinct adapters one batch may run, the base model counting as one (SGLang's rule); also the "
                "slots of the adapter pool in device memory", owner="scheduler", also=("worker",))
    max_loaded_loras: Optional[int] = flag(
        None, help="adapters loaded (in host memory) at once; a load beyond is refused (default: no limit; at least "
                   "--max-loras-per-batch)", owner="scheduler")
    max_lora_rank: Optional[int] = flag(
        None, help="the largest adapter rank the pool holds (default: the largest of --lora-paths; give it to load "
                   "larger adapters later)", owner="worker")
    lora_target_modules: Optional[tuple[str, ...]] = flag(
        None, nargs="+", metavar="MODULE", parse=tuple,
        help="the projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
             "(default: those of --lora-paths' adapters)", owner="worker")
    # PD disaggregation
    disaggregation_mode: str = flag(
        "null", choices=DISAGGREGATION_MODES,
        help="null: a colocated engine; prefill or decode: one side of a PD pair", owner="pd",
        also=("scheduler", "http", "tokenizer", "launcher"))
    disaggregation_bootstrap_port: int = flag(
        8998, help="prefill: the port of the bootstrap server decodes register with", owner="pd")
    disaggregation_transfer_backend: str = flag(
        "mooncake", choices=("mooncake",),
        help="how the KV moves: mooncake (a process may register others: disaggregation/__init__.py)", owner="pd")
    disaggregation_protocol: str = flag("tcp", choices=("tcp", "rdma"), help="the KV transfer's transport",
                                        owner="pd")
    disaggregation_ib_device: Optional[str] = flag(None, help="RDMA: the InfiniBand devices, comma-separated "
                                                              "(e.g. mlx5_0,mlx5_1)",
                                                   owner="pd")
    # None: SGLang's environment variable of the same name, else its default (see transfer_config_from)
    disaggregation_bootstrap_timeout: Optional[float] = flag(
        None, help="seconds for the prefill/decode handshake (default: $SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or "
                   "300)", owner="pd")
    disaggregation_waiting_timeout: Optional[float] = flag(
        None, help="decode: seconds from sending the destination to the KV's arrival "
                   "(default: $SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300)", owner="pd")
    disaggregation_heartbeat_interval: Optional[float] = flag(
        None, help="decode: seconds between prefill health checks (default: "
                   "$SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL or 5)", owner="pd")
    disaggregation_heartbeat_max_failures: Optional[int] = flag(
        None, help="decode: failed health checks before a prefill's requests fail "
                   "(default: $SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE or 2)", owner="pd")
    disaggregation_fault_probability: float = flag(
        0.0, help="testing only: report this fraction of KV transfers as failed", owner="pd")
    # Tensor parallelism, Megatron style: the TP rank 0 process runs the scheduler and drives the others step by step.
    tp_size: int = flag(
        1, help="tensor parallelism: split each model replica over this many processes (GPUs on CUDA); "
                "attention heads and MLP columns are sharded, two all-reduces per layer",
        owner="worker", also=("launcher", "pd"))
    nccl_port: Optional[int] = flag(
        None, help="the TP group's rendezvous port on 127.0.0.1 (DP rank i uses port + i; default: a free port)",
        owner="launcher")
    tp_cpu_allreduce: str = flag(
        "shm", choices=("shm", "gloo"),
        help="CPU tensor parallelism: the forward's all-reduces through a shared memory segment (default) or gloo",
        owner="worker")
    # Data parallelism: one scheduler process per replica behind one HTTP server, tokenizer and detokenizer.
    dp_size: int = flag(
        1, help="data parallelism: this many model replicas (scheduler processes), one GPU each on CUDA",
        owner="launcher", also=("tokenizer", "pd"))
    load_balance_method: str = flag(  # SGLang's flag
        "round_robin", choices=LOAD_BALANCE_METHODS,
        help="how requests without data_parallel_rank are spread over the DP ranks (shortest_queue: "
             "fewest requests in flight)", owner="tokenizer")
    base_gpu_id: int = flag(0, help="CUDA: DP rank i, TP rank t runs on GPU base + i * tp_size + t",
                            owner="launcher")

    def __post_init__(self) -> None:
        assert self.page_size >= 1, "--page-size must be >= 1"
        assert self.schedule_policy in SCHEDULE_POLICIES, f"--schedule-policy must be one of {SCHEDULE_POLICIES}"
        if self.attention_backend == "auto":
            object.__setattr__(self, "attention_backend", self._auto_attention_backend())  # frozen
        assert self.attention_backend in ATTENTION_BACKENDS, f"--attention-backend must be one of {ATTENTION_BACKENDS}"
        assert self.disaggregation_mode in DISAGGREGATION_MODES
        if self.chunked_prefill_size is None:
            object.__setattr__(self, "chunked_prefill_size",  # frozen
                               max(default_chunked_prefill_size(self.device), self.page_size))
        assert self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size
        assert self.stream_interval >= 1
        if self.decode_log_interval < 1:
            raise ValueError("--decode-log-interval must be >= 1")
        if self.watchdog_timeout < 0:
            raise ValueError("--watchdog-timeout must be >= 0 (0 turns the watchdog off)")
        if self.request_read_timeout < 0:
            raise ValueError("--request-read-timeout must be >= 0 (0: no limit)")
        assert 0.0 <= self.disaggregation_fault_probability <= 1.0, "--disaggregation-fault-probability in [0, 1]"
        if self.mamba_ssm_dtype not in MAMBA_SSM_DTYPES:
            raise ValueError(f"--mamba-ssm-dtype must be one of {MAMBA_SSM_DTYPES}")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 1:
            raise ValueError("--max-mamba-cache-size must be >= 1")
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError("--mamba-full-memory-ratio must be > 0")
        if self.mamba_track_interval is None:
            object.__setattr__(self, "mamba_track_interval", -(-256 // self.page_size) * self.page_size)  # frozen
        if self.mamba_track_interval < 1 or self.mamba_track_interval % self.page_size:
            raise ValueError(f"--mamba-track-interval must be a positive multiple of --page-size ({self.page_size})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype not in ("auto", self.dtype) and self.attention_backend != "torch":
            # FlashInfer would need its KV dtype planned and verified on a GPU; the torch backend
            # reads any pool dtype (the native CPU kernel, or a gather cast to the query's dtype).
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs --attention-backend torch "
                             "(or --kv-cache-dtype auto)")
        if self.device == "cpu":
            assert self.attention_backend == "torch", "FlashInfer needs --device cuda"
        if self.cpu_omp_threads_bind != "off":
            if self.device != "cpu":
                raise ValueError("--cpu-omp-threads-bind is for --device cpu")
            from baton.engine.utils.cpu_affinity import plan_binding

            plan_binding(self.cpu_omp_threads_bind)  # a bad list fails here, at start-up
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {TOOL_PARSERS}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {REASONING_PARSERS}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.enable_mixed_chunk and self.disaggregation_mode != "null":
            raise ValueError("--enable-mixed-chunk mixes prefills with decode steps of one engine; a "
                             f"--disaggregation-mode {self.disaggregation_mode} engine runs only one of the two")
        self._check_speculative()
        self._check_media()
        self._check_embedding()
        self._check_lora()
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if self.dp_size > 1 and self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == 0:
            raise ValueError("a prefill engine with --dp-size > 1 needs a fixed --disaggregation-bootstrap-port "
                             "(its ranks register with rank 0's bootstrap server there)")
        if self.tp_cpu_allreduce not in ("shm", "gloo"):
            raise ValueError("--tp-cpu-allreduce must be shm or gloo")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}")
        if self.base_gpu_id < 0:
            raise ValueError("--base-gpu-id must be >= 0")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if not 0 <= self.small_batch_gemv_rows <= 64:
            raise ValueError("--small-batch-gemv-rows must be 0..64")
        if self.flashinfer_decode_tensor_cores not in ("auto", "on", "off"):
            raise ValueError("--flashinfer-decode-tensor-cores must be auto, on or off")

    def _check_embedding(self) -> None:
        """--is-embedding: prefills only, so nothing that decodes or hands a prefill on."""
        if not self.is_embedding:
            return
        if self.disaggregation_mode != "null":
            raise ValueError("--is-embedding serves prefills only: there is no decode to hand them to "
                             f"(--disaggregation-mode {self.disaggregation_mode})")
        if self.speculative_algorithm is not None:
            raise ValueError("--is-embedding generates no tokens: --speculative-algorithm means nothing there")

    def _check_media(self) -> None:
        """The image-input flags, normalized (host names lower-case, the image limit as a dict)."""
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: no such directory")
        # an IPv6 address as URLs parse it: without its brackets
        given = self.allowed_media_domains
        hosts = tuple(h.strip().strip("[]").lower() for item in ([given] if isinstance(given, str) else given)
                      for h in item.split(",") if h.strip())
        if bad := [h for h in hosts if "/" in h or h.count(":") == 1]:
            raise ValueError(f"--allowed-media-domains takes host names (no scheme, port or path): {' '.join(bad)}")
        object.__setattr__(self, "allowed_media_domains", hosts)  # frozen
        object.__setattr__(self, "limit_mm_data_per_request", mm_data_limits(self.limit_mm_data_per_request))
        if self.max_image_pixels < 1 or self.max_media_bytes < 1:
            raise ValueError("--max-image-pixels and --max-media-bytes must be >= 1")
        if not self.media_fetch_timeout > 0:
            raise ValueError("--media-fetch-timeout must be > 0")

    def _check_lora(self) -> None:
        """The LoRA flags: --lora-paths turn LoRA on (SGLang's rule); without it the others mean nothing;
        without adapters at start-up the pool's rank and projections must be given."""
        lora_flags = ("max_loaded_loras", "max_lora_rank", "lora_target_modules")
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)  # frozen
        if not self.enable_lora:
            given = [f"--{n.replace('_', '-')}" for n in lora_flags if getattr(self, n) is not None]
            if given or self.max_loras_per_batch != 8:
                raise ValueError(f"{' '.join(given) or '--max-loras-per-batch'} means nothing without --enable-lora")
            return
        adapters = parse_lora_paths(self.lora_paths)
        if not adapters and (self.max_lora_rank is None or self.lora_target_modules is None):
            raise ValueError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules "
                             "(the adapter pool's shape)")
        if self.max_loras_per_batch < 1 or (self.max_lora_rank is not None and self.max_lora_rank < 1):
            raise ValueError("--max-loras-per-batch and --max-lora-rank must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(self.max_loras_per_batch, len(adapters)):
            raise ValueError("--max-loaded-loras must be at least --max-loras-per-batch and the adapters of "
                             "--lora-paths")
        bad = sorted(set(self.lora_target_modules or ()) - set(LORA_TARGET_MODULES) - {"all"})
        if bad:
            raise ValueError(f"--lora-target-modules: unknown {' '.join(bad)}; choose from "
                             f"{' '.join(LORA_TARGET_MODULES)} or all")
        if sum(a.pinned for a in adapters) >= self.max_loras_per_batch:
            raise ValueError("at most --max-loras-per-batch - 1 adapters may be pinned")
        for what, clash in (("--speculative-algorithm", self.speculative_algorithm is not None),
                            ("--disaggregation-mode", self.disaggregation_mode != "null"),
                            ("--small-batch-gemv-rows", self.small_batch_gemv_rows > 0)):
            if clash:
                raise ValueError(f"--enable-lora is not supported with {what} yet")

    def _check_speculative(self) -> None:
        """--speculative-*: what runs, refused clearly otherwise; so is a flag that would mean nothing
        (it would start silently and do nothing)."""
        algo = self.speculative_algorithm
        self._refuse_idle_speculative_flags()
        if algo is None:
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}")
        if algo in DRAFT_CHECKPOINT_ALGORITHMS and not self.speculative_draft_model_path:
            raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the EAGLE draft "
                             "checkpoint's directory)")
        if algo not in DRAFT_CHECKPOINT_ALGORITHMS and self.speculative_draft_model_path:
            raise ValueError(f"--speculative-draft-model-path is for EAGLE and EAGLE3; {algo} drafts "
                             + ("with the checkpoint's own MTP head" if algo == "NEXTN" else "from each request's tokens"))
        if self.speculative_token_map and (algo != "EAGLE" or self.tp_size > 1):
            raise ValueError("--speculative-token-map cuts an EAGLE draft's LM head (the model's) to its tokens: "
                             "--speculative-algorithm EAGLE with --tp-size 1 only (EAGLE3 drafts carry their own)")
        if algo != "NGRAM":
            self._check_head_drafts()
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                             "--speculative-ngram-max-match-window-size")
        if self.speculative_num_draft_tokens is None:  # NGRAM (NEXTN's is set by then)
            object.__setattr__(self, "speculative_num_draft_tokens",  # frozen
                               self.speculative_ngram_max_match_window_size)
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens must be >= 2 (the last token and at least one draft)")
        step = self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_prefill_tokens
        if algo == "NGRAM" and self.speculative_num_draft_tokens > step:
            # a verify step runs that many tokens of each request: more than one prefill step of the
            # engine may take (which keeps a step short, as the watchdog and the other requests need)
            raise ValueError(f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens} is more tokens than "
                             f"one step of this engine runs ({step}: --chunked-prefill-size, else "
                             "--max-prefill-tokens); NGRAM drafts of that length never pay off")
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError("--speculative-disable-by-batch-size must be >= 1")
        if self.speculative_ngram_capacity < 0:
            raise ValueError("--speculative-ngram-capacity must be >= 0 (0: each request's own tokens only)")
        if self.speculative_ngram_max_bfs_breadth < 1:
            raise ValueError("--speculative-ngram-max-bfs-breadth must be >= 1 (1: chains)")

    def _refuse_idle_speculative_flags(self) -> None:
        """A --speculative-* flag changed from its default where the algorithm (or its absence) never
        reads it."""
        algo = self.speculative_algorithm
        heads_only = ("speculative_num_steps", "speculative_eagle_topk")
        for f in dataclasses.fields(self):
            if not f.name.startswith("speculative_") or f.name == "speculative_algorithm":
                continue
            if getattr(self, f.name) == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if algo is None:
                raise ValueError(f"{flag} means nothing without --speculative-algorithm")
            if algo == "NGRAM" and f.name in heads_only:
                raise ValueError(f"{flag} is for draft heads (NEXTN, EAGLE, EAGLE3); NGRAM drafts from the "
                                 "request's tokens (its trees: --speculative-ngram-max-bfs-breadth)")
            if algo != "NGRAM" and f.name.startswith("speculative_ngram_"):
                raise ValueError(f"{flag} is for --speculative-algorithm NGRAM, not {algo}")

    def _check_head_drafts(self) -> None:
        """NEXTN, EAGLE, EAGLE3: num_steps drafts deep, topk candidates per step (1: a chain, so
        num_draft_tokens is num_steps + 1, SGLang's rule for topk 1; more: a tree grown best-first,
        speculative/head_worker.py, of num_draft_tokens - 1 nodes, by default topk x num_steps, at most
        every candidate it drafts, as SGLang allows)."""
        steps = 3 if self.speculative_num_steps is None else self.speculative_num_steps
        topk = 1 if self.speculative_eagle_topk is None else self.speculative_eagle_topk
        if steps < 1:
            raise ValueError("--speculative-num-steps must be >= 1")
        if topk < 1:
            raise ValueError("--speculative-eagle-topk must be >= 1 (1: chains)")
        tokens = 1 + topk * steps if self.speculative_num_draft_tokens is None else self.speculative_num_draft_tokens
        if topk == 1 and tokens != steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({steps + 1}) with "
                             "--speculative-eagle-topk 1")
        most = 1 + topk + (steps - 1) * topk * topk  # the root and every candidate a best-first tree drafts
        if not steps + 1 <= tokens <= most:
            raise ValueError(f"--speculative-num-draft-tokens must be between --speculative-num-steps + 1 "
                             f"({steps + 1}) and 1 + topk + (steps - 1) x topk^2 ({most}, every candidate the tree "
                             "drafts)")
        for name, value in (("speculative_num_steps", steps), ("speculative_eagle_topk", topk),
                            ("speculative_num_draft_tokens", tokens)):
            object.__setattr__(self, name, value)  # frozen

    def _auto_attention_backend(self) -> str:
        if not self.device.startswith("cuda") or importlib.util.find_spec("flashinfer") is None:
            return "torch"
        dtype = self.dtype
        if dtype == "auto":  # what model_loader.resolve_dtype will pick from the checkpoint
            try:
                with open(os.path.join(self.model_path, "config.json")) as f:
                    config = json.load(f)
            except (OSError, ValueError):
                return "torch"
            dtype = auto_dtype_name(config.get("dtype") or config.get("torch_dtype"), self.device)
        if dtype not in ("float16", "bfloat16") or self.kv_cache_dtype not in ("auto", dtype):
            return "torch"
        return "flashinfer"

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_path))

    def may_lag_verify_steps(self) -> bool:
        """Whether a hybrid model's verify step may be built behind the one running (speculative/
        verify_strategy.py, lagged verify steps): a draft head's algorithm, the overlap loop not ruled out (any
        TP size: with TP the rollback is a state copy every rank makes, TpModelWorker._resolve_lagged).
        Its scratch states are sized for it (ModelRunner._init_state_pool), on every rank alike."""
        return self.speculative_algorithm not in (None, "NGRAM") and not self.disable_overlap_schedule

    def event_loop(self, native_stream_threads: Optional[int]) -> EventLoopChoice:
        """The scheduler's loop and why: the flags first, then the device, then (CPU without either
        flag) whether the native forward stream serves the model on threads to spare.
        `native_stream_threads`: the threads the native CPU forward's steps run on where it serves
        the model whole (forward and LM head; executors.native_stream_threads), None elsewhere."""
        if self.disable_overlap_schedule:
            return EventLoopChoice(EventLoop.PLAIN, "--disable-overlap-schedule")
        if self.device.startswith("cuda"):
            return EventLoopChoice(EventLoop.OVERLAP, "CUDA: a launch only enqueues work on the forward stream")
        if self.enable_overlap_schedule:
            return EventLoopChoice(EventLoop.OVERLAP, "--enable-overlap-schedule")
        if native_stream_threads is None:
            return EventLoopChoice(EventLoop.PLAIN, "CPU, the model's own forward: a worker thread would contend "
                                                    "with the scheduler for the GIL")
        if native_stream_threads < 2:
            # measured even with the plain loop there: the scheduler can only time-slice the forward
            return EventLoopChoice(EventLoop.PLAIN, "CPU, the native forward on one thread: no core to spare "
                                                    "for the scheduler's work")
        return EventLoopChoice(EventLoop.OVERLAP, f"CPU, the native forward stream on {native_stream_threads} "
                                                  "threads: the scheduler's thread works beside it, then joins it")

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    def view(self, view_cls: type[_View]) -> _View:
        """A component's config view (a frozen dataclass whose fields are flags of the same names): what
        the scheduler's parts, PD and speculation read instead of the whole ServerArgs."""
        return view_cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(view_cls)})

    @staticmethod
    def flag_table() -> FlagTable:
        """Every flag of `baton serve`, declared on the fields above."""
        return FlagTable(FLAG_OWNERS, tuple(declared_flags(ServerArgs))).check()

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        ServerArgs.flag_table().add_to(parser)

    def gpu_id(self, dp_rank: int, tp_rank: int) -> int:
        """The GPU of one engine process on CUDA."""
        return self.base_gpu_id + dp_rank * self.tp_size + tp_rank

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return from_args(cls, args)
