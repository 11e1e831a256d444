"""Server arguments: the head of the one configuration chain (server args -> scheduler -> model).

Flag names follow SGLang's where the meaning is the same, so users can move over.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Optional

from baton.engine.parsers import REASONING_PARSERS, TOOL_PARSERS

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


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    # The KV cache's own dtype (SGLang's and vLLM's --kv-cache-dtype): auto = the model's. A smaller
    # one holds more tokens in the same memory and halves/quarters what each decode step reads.
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | fp8_e5m2
    context_length: Optional[int] = None
    # memory
    page_size: int = 1
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.85
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    # prompt tokens one prefill step takes (-1: all at once); None: by device, default_chunked_prefill_size
    chunked_prefill_size: Optional[int] = None
    disable_radix_cache: bool = False
    # hybrid models (Qwen3-Next, Qwen3.5): the dtype of the linear-attention layers' delta-rule state
    # (SGLang's --mamba-ssm-dtype); the conv state keeps the model's dtype
    mamba_ssm_dtype: str = "float32"
    # hybrid models: recurrent-state slots (each running request holds one; None: from the ratio below)
    max_mamba_cache_size: Optional[int] = None
    # hybrid models, KV sized from free memory: state-pool bytes : KV-pool bytes (SGLang's default)
    mamba_full_memory_ratio: float = 0.9
    # hybrid models with the radix cache: a recurrent-state checkpoint every this many tokens (a
    # multiple of the page size), besides chunk ends, prompt ends and request ends; None: the smallest
    # multiple of the page size from 256 tokens on
    mamba_track_interval: Optional[int] = None
    # scheduling
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    priority_preemption_threshold: int = 10
    schedule_conservativeness: float = 1.0
    # a prefill batch also carries one decode step of every running request, so decoding does not
    # stall while prompts are prefilled (SGLang's --enable-mixed-chunk); colocated engines only
    enable_mixed_chunk: bool = False
    # chat: a Jinja template file instead of the tokenizer's; the model's tool-call and reasoning
    # formats, parsed out of chat answers (engine/parsers, entrypoints/chat_tools.py)
    chat_template: Optional[str] = None
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    # structured output (engine/constrained)
    grammar_backend: str = "xgrammar"
    constrained_json_disable_any_whitespace: bool = False
    disable_overlap_schedule: bool = False
    # Overlap is on by default on CUDA, and on CPU where the native forward serves the model on two
    # threads or more (its steps run on a C thread, cpu_forward.c, joined by the scheduler's thread
    # while it waits; measured faster than the plain loop, docs/benchmarks.md).
    # A CPU model on its own Python forward keeps the plain loop: there a worker thread holds the GIL
    # between small ops and contends with the scheduler instead of overlapping it. This forces the
    # overlap loop on (tests use it). The whole rule: event_loop() below.
    enable_overlap_schedule: bool = False
    stream_interval: int = 1
    # execution
    # auto: FlashInfer on CUDA when it is installed and the model runs in half precision (its
    # kernels, and with them CUDA-graph decode), else the torch backend
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False
    # None: sized to the GPU's memory at start-up (cuda_graph_max_bs_for, as SGLang sizes it)
    cuda_graph_max_bs: Optional[int] = None
    # FlashInfer decode on tensor cores (its prefill kernel, one query row per request): auto turns
    # it on for GQA groups of 4 or more query heads per KV head, where it reads the KV faster
    flashinfer_decode_tensor_cores: str = "auto"  # auto | on | off
    # CUDA: every layer op (norms, activation, attention input) on its torch reference path
    disable_fused_ops: bool = False
    # CUDA: linears of 1..N rows (decode batches) on the Triton GEMV (triton_ops/gemv.py); 0: cuBLAS
    small_batch_gemv_rows: int = 0
    enable_torch_compile: bool = False
    cpu_omp_threads_bind: str = "off"  # off | auto | CPU list (utils/cpu_affinity.py)
    disable_packed_linear: bool = False  # CPU bf16: keep torch's GEMM (engine/kernels/cpu_linear.py)
    disable_native_forward: bool = False  # CPU bf16: every step through the model's forward (kernels/cpu_forward.py)
    torch_compile_max_bs: int = 32
    random_seed: int = 0
    # serving
    api_key: Optional[str] = field(default=None, repr=False)  # never logged
    # a request's `model` must name this server's model (404 otherwise); off: any name is served, as SGLang does
    strict_model_name: bool = False
    # SGLang's: a prompt past the context is cut, and max_new_tokens to what the context leaves, where
    # they would be a 400
    allow_auto_truncate: bool = False
    max_request_bytes: int = 16 * 1024 * 1024
    request_read_timeout: float = 60.0  # seconds a client has to send a request's head, and again its body (0: none)
    log_level: str = "info"
    decode_log_interval: int = 40  # log a "Decode batch." line every this many decode steps
    watchdog_timeout: float = 300.0  # a scheduler step longer than this stops the engine (0: off)
    enable_metrics: bool = True
    # speculative decoding (issue 35, engine/speculative): SGLang's flags. NGRAM drafts from each
    # request's own tokens (the longest suffix match between the two window sizes); a verify step
    # runs num_draft_tokens tokens per request (its last token and up to num_draft_tokens - 1 drafts)
    speculative_algorithm: Optional[str] = None
    speculative_num_draft_tokens: Optional[int] = None  # None: NGRAM's max match window, as SGLang
    # EAGLE / EAGLE3: the draft checkpoint (models/eagle.py)
    speculative_draft_model_path: Optional[str] = None
    # EAGLE: a hot vocabulary (a .pt of token ids) the draft's LM head is cut to (SGLang's flag; FR-Spec)
    speculative_token_map: Optional[str] = None
    # NEXTN, EAGLE, EAGLE3 (a head drafts, speculative/head_drafter.py): draft steps per verify, and
    # candidates per step (1: a chain, num_draft_tokens num_steps + 1; k: a tree grown best-first, k
    # candidates per step, of num_draft_tokens - 1 nodes, by default k x num_steps)
    speculative_num_steps: Optional[int] = None  # None: 3 (SGLang's recommended chain for Qwen3-Next)
    speculative_eagle_topk: Optional[int] = None  # None: 1
    # 3, not SGLang's 1: SGLang's drafter weighs matches by frequency in a trie of recent requests, ours
    # takes the latest occurrence in one request, and after a one- or two-token match that was mostly
    # wrong (code-edit workload, SmolLM2, one request: 1.29x with 1, 1.53x with 2, 2.16x with 3)
    speculative_ngram_min_match_window_size: int = 3
    speculative_ngram_max_match_window_size: int = 12
    # NGRAM tree drafts (SGLang's flag): up to this many continuations of the matched suffix per draft,
    # merged into a tree of at most num_draft_tokens - 1 nodes; 1 drafts a chain
    speculative_ngram_max_bfs_breadth: int = 1
    # NGRAM (SGLang's flag): tokens of recently finished requests (prompt and output) whose n-grams other
    # requests draft from where their own tokens hold no match (speculative/ngram.py SharedNgrams);
    # 0: each request drafts from its own tokens only
    speculative_ngram_capacity: int = 0
    # speculation backs off under load: decode steps of this many running requests or more are plain
    # ones (at large batches a step is compute-bound and verifying drafts only costs). PD: the decode
    # engine speculates once the KV has arrived; a prefill engine, which never decodes, ignores it
    speculative_disable_by_batch_size: int = 4
    # PD disaggregation (issue 3)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_protocol: str = "tcp"
    disaggregation_ib_device: Optional[str] = None
    # None: SGLang's environment variable of the same name, else its default (see transfer_config_from)
    disaggregation_bootstrap_timeout: Optional[float] = None
    disaggregation_waiting_timeout: Optional[float] = None
    disaggregation_heartbeat_interval: Optional[float] = None
    disaggregation_heartbeat_max_failures: Optional[int] = None
    disaggregation_fault_probability: float = 0.0  # tests: fail this fraction of KV transfers
    # Tensor parallelism: each model replica split over tp_size processes (GPUs on CUDA), Megatron
    # style; the TP rank 0 process runs the scheduler and drives the others step by step.
    tp_size: int = 1
    nccl_port: Optional[int] = None  # TP rendezvous port (DP rank i: + i); None: a free port
    tp_cpu_allreduce: str = "shm"  # CPU TP: the forward's all-reduces through shared memory, or gloo
    # Data parallelism: dp_size full replicas of the model (one scheduler process each, GPU
    # base_gpu_id + rank on CUDA) behind one HTTP server, tokenizer and detokenizer.
    dp_size: int = 1
    load_balance_method: str = "round_robin"  # round_robin | shortest_queue (SGLang's flag)
    base_gpu_id: int = 0

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
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.tp_size > 1 and self.disaggregation_mode != "null" and self.disaggregation_transfer_backend == "fake":
            raise ValueError("--tp-size > 1 with --disaggregation-mode needs a transfer backend that crosses processes "
                             "(each TP rank moves its own KV shard): use --disaggregation-transfer-backend mooncake")
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
        speculative/head_drafter.py, of num_draft_tokens - 1 nodes, by default topk x num_steps, at most
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
        verifying.py, lagged verify steps): a draft head's algorithm, the overlap loop not ruled out (any
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

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.allow_abbrev = False  # `--kv-cache-dtyp` would pass the operator's managed-flags rule
        a = parser.add_argument
        a("--model-path", required=True, help="local Hugging Face directory (config.json, *.safetensors, tokenizer)")
        a("--tokenizer-path", default=None)
        a("--served-model-name", default=None)
        a("--host", default=ServerArgs.host)
        a("--port", type=int, default=ServerArgs.port)
        a("--device", default=ServerArgs.device, choices=("cpu", "cuda"))
        a("--dtype", default=ServerArgs.dtype, choices=MODEL_DTYPES)
        a("--kv-cache-dtype", default=ServerArgs.kv_cache_dtype, choices=KV_CACHE_DTYPES,
          help="dtype of the KV cache (auto: the model's); fp8_e5m2 stores a quarter of float32's bytes")
        a("--context-length", type=int, default=None)
        a("--page-size", type=int, default=ServerArgs.page_size)
        a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from --mem-fraction-static)")
        a("--mem-fraction-static", type=float, default=ServerArgs.mem_fraction_static)
        a("--max-running-requests", type=int, default=None)
        a("--max-queued-requests", type=int, default=None, help="reject with 503 beyond this many waiting requests")
        a("--max-prefill-tokens", type=int, default=ServerArgs.max_prefill_tokens)
        a("--chunked-prefill-size", type=int, default=ServerArgs.chunked_prefill_size,
          help=f"prompt tokens per prefill step; -1 disables chunking; default by device: "
               f"{CPU_CHUNKED_PREFILL_SIZE} on CPU, {GPU_CHUNKED_PREFILL_SIZE} on CUDA")
        a("--disable-radix-cache", action="store_true")
        a("--mamba-ssm-dtype", default=ServerArgs.mamba_ssm_dtype, choices=MAMBA_SSM_DTYPES,
          help="hybrid models: dtype of the linear-attention layers' recurrent (delta-rule) state")
        a("--max-mamba-cache-size", type=int, default=ServerArgs.max_mamba_cache_size,
          help="hybrid models: recurrent-state slots; running requests are capped by it (default: from "
               "--max-running-requests, else --mamba-full-memory-ratio)")
        a("--mamba-full-memory-ratio", type=float, default=ServerArgs.mamba_full_memory_ratio,
          help="hybrid models, KV pool sized from free memory: state-pool bytes to KV-pool bytes")
        a("--mamba-track-interval", type=int, default=ServerArgs.mamba_track_interval,
          help="hybrid models with the radix cache: keep a recurrent-state checkpoint every this many tokens "
               "(a multiple of --page-size; default: 256, rounded up to one)")
        a("--schedule-policy", default=ServerArgs.schedule_policy, choices=SCHEDULE_POLICIES)
        a("--enable-priority-scheduling", action="store_true")
        a("--priority-preemption-threshold", type=int, default=ServerArgs.priority_preemption_threshold)
        a("--schedule-conservativeness", type=float, default=ServerArgs.schedule_conservativeness)
        a("--chat-template", default=None, help="a Jinja chat template file, instead of the tokenizer's")
        a("--tool-call-parser", default=None, choices=TOOL_PARSERS,
          help="the model's tool-call format: chat requests with tools get tool_calls (tool_choice auto)")
        a("--reasoning-parser", default=None, choices=REASONING_PARSERS,
          help="split the model's <think> block into reasoning_content")
        a("--grammar-backend", default=ServerArgs.grammar_backend, choices=["xgrammar", "none"],
          help="structured output (json_schema, regex, ebnf, response_format); none refuses it with a 400")
        a("--constrained-json-disable-any-whitespace", action="store_true",
          help="JSON schemas allow no free whitespace (small models can loop on it)")
        a("--enable-mixed-chunk", action="store_true",
          help="run one decode step of the running requests inside each prefill batch (colocated only)")
        a("--disable-overlap-schedule", action="store_true")
        a("--enable-overlap-schedule", action="store_true",
          help="use the overlap loop on CPU even where it is not the default (default: on for CUDA, and on CPU "
               "where the native forward serves the model on two threads or more; /get_server_info's "
               "event_loop says which loop runs, event_loop_reason why)")
        a("--stream-interval", type=int, default=ServerArgs.stream_interval)
        a("--attention-backend", default=ServerArgs.attention_backend, choices=("auto",) + ATTENTION_BACKENDS,
          help="auto (default): flashinfer on CUDA for float16/bfloat16 when installed, else torch")
        a("--disable-cuda-graph", action="store_true")
        a("--cuda-graph-max-bs", type=int, default=ServerArgs.cuda_graph_max_bs,
          help="decode batches up to this size replay a CUDA graph (padded to the next captured size); "
               "default: by GPU memory, 8 under 20 GiB up to 256 from 90 GiB (capped by --max-running-requests)")
        a("--flashinfer-decode-tensor-cores", default=ServerArgs.flashinfer_decode_tensor_cores,
          choices=("auto", "on", "off"),
          help="FlashInfer decode attention on tensor cores; auto: for 4 or more query heads per KV head")
        a("--disable-fused-ops", action="store_true",
          help="CUDA: run RMSNorm, the gated activation and the attention input (q/k norm, RoPE, KV store) "
               "on their torch reference paths instead of the Triton kernels")
        a("--small-batch-gemv-rows", type=int, default=ServerArgs.small_batch_gemv_rows, metavar="N",
          help="CUDA: linear layers of 1..N rows (decode batches up to N) run one Triton GEMV kernel instead of "
               "cuBLAS (gate|up with silu*up fused in, the pre-norms folded into qkv and gate|up); 0 (default) keeps "
               "cuBLAS. On an H200 with the 8B shape (before the norms were folded in), 16 made the decode step "
               "3-4%% faster at batch 1 and 16, 64 made batch 64 5%% slower")
        a("--enable-torch-compile", action="store_true",
          help="compile the decode forward (and on CPU the extend) with torch.compile at start-up")
        a("--torch-compile-max-bs", type=int, default=ServerArgs.torch_compile_max_bs,
          help="decode batches larger than this run eagerly")
        a("--cpu-omp-threads-bind", default=ServerArgs.cpu_omp_threads_bind, metavar="off|auto|CPULIST",
          help="CPU serving: pin the forward pass to these CPUs (one torch thread each) and the HTTP server "
               "and detokenizer to the rest; auto keeps the last CPU for them")
        a("--disable-packed-linear", action="store_true",
          help="CPU, bfloat16: keep torch's GEMM for the linear layers and LM head instead of the "
               "AVX512_BF16 kernel over weights packed at load")
        a("--disable-native-forward", action="store_true",
          help="CPU, bfloat16 dense Llama-family models: run every step through the model's own (possibly "
               "compiled) forward instead of one native call per step")
        a("--random-seed", type=int, default=ServerArgs.random_seed)
        a("--api-key", default=None, help="bearer key clients must send (default: $BATON_API_KEY)")
        a("--strict-model-name", action="store_true",
          help="refuse (404) an OpenAI request whose `model` is neither --served-model-name nor --model-path "
               "(default: any name is served, as SGLang does)")
        a("--allow-auto-truncate", action="store_true",
          help="cut a prompt past the context length to its first tokens, and max_tokens / max_new_tokens to "
               "what the context leaves, instead of answering 400")
        a("--max-request-bytes", type=int, default=ServerArgs.max_request_bytes)
        a("--request-read-timeout", type=float, default=ServerArgs.request_read_timeout,
          help="seconds a client has to send a request's head (from the connection or the last response: else "
               "the connection is closed), and again its body (else 408): a client that stalls would hold its "
               "connection for good (0: no limit)")
        a("--log-level", default=ServerArgs.log_level)
        a("--decode-log-interval", type=int, default=ServerArgs.decode_log_interval,
          help="log the running batch (requests, tokens, throughput, queue) every this many decode steps")
        a("--watchdog-timeout", type=float, default=ServerArgs.watchdog_timeout,
          help="seconds one scheduler step (a forward pass, a hung GPU or transfer) may take before the "
               "engine dumps its threads' stacks and exits non-zero, so its pod is restarted (0: off)")
        a("--disable-metrics", action="store_true")
        a("--speculative-algorithm", default=None, choices=SPECULATIVE_ALGORITHMS,
          help="speculative decoding: NGRAM drafts from each request's own prompt and output (no draft model); "
               "NEXTN drafts with the checkpoint's multi-token-prediction head (Qwen3-Next, Qwen3.5); EAGLE and "
               "EAGLE3 with an EAGLE draft checkpoint (--speculative-draft-model-path)")
        a("--speculative-draft-model-path", default=None,
          help="EAGLE / EAGLE3: the draft checkpoint's directory (config.json, safetensors or pytorch_model.bin)")
        a("--speculative-token-map", default=None,
          help="EAGLE: a .pt file of token ids (a hot vocabulary, as FR-Spec's freq_*.pt); the draft's LM head "
               "scores only those, which cuts its cost where the vocabulary is large")
        a("--speculative-num-draft-tokens", type=int, default=None,
          help="tokens a verify step runs per request: its last token and up to this many - 1 drafts "
               "(default: NGRAM --speculative-ngram-max-match-window-size, NEXTN and EAGLE 1 + topk x "
               "--speculative-num-steps)")
        a("--speculative-num-steps", type=int, default=None,
          help="NEXTN, EAGLE: draft steps per verify step, the chain's length (default 3)")
        a("--speculative-eagle-topk", type=int, default=None,
          help="NEXTN, EAGLE: candidates per draft step; > 1 grows a tree best-first by the head's scores "
               "(SGLang's EAGLE trees: the k best children of the k best leaves per step, the "
               "--speculative-num-draft-tokens - 1 best nodes), verified as one tree (default 1: a chain)")
        a("--speculative-ngram-min-match-window-size", type=int,
          default=ServerArgs.speculative_ngram_min_match_window_size,
          help="NGRAM: the shortest suffix of a request's tokens looked up in its earlier tokens")
        a("--speculative-ngram-max-match-window-size", type=int,
          default=ServerArgs.speculative_ngram_max_match_window_size,
          help="NGRAM: the longest suffix looked up (the longest match found wins)")
        a("--speculative-ngram-capacity", type=int, default=ServerArgs.speculative_ngram_capacity, metavar="TOKENS",
          help="NGRAM: keep this many tokens of recently finished requests (their prompts and outputs), whose "
               "n-grams a request drafts from where its own tokens hold no match (default 0: its own only)")
        a("--speculative-ngram-max-bfs-breadth", type=int, default=ServerArgs.speculative_ngram_max_bfs_breadth,
          help="NGRAM: continuations per draft, from different earlier occurrences of the matched suffix, "
               "merged into a tree verified in one pass under a tree mask (default 1: a chain)")
        a("--speculative-disable-by-batch-size", type=int, default=ServerArgs.speculative_disable_by_batch_size,
          help="decode steps of this many running requests or more do not speculate (under load a step is "
               "compute-bound and drafts only cost)")
        a("--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES)
        a("--disaggregation-bootstrap-port", type=int, default=ServerArgs.disaggregation_bootstrap_port)
        a("--disaggregation-transfer-backend", default="mooncake", choices=("mooncake", "fake"))
        a("--disaggregation-protocol", default="tcp", choices=("tcp", "rdma"))
        a("--disaggregation-ib-device", default=None)
        a("--disaggregation-bootstrap-timeout", type=float, default=None,
          help="seconds for the prefill/decode handshake (default: $SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or 300)")
        a("--disaggregation-waiting-timeout", type=float, default=None,
          help="decode: seconds from sending the destination to the KV's arrival "
               "(default: $SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300)")
        a("--disaggregation-heartbeat-interval", type=float, default=None,
          help="decode: seconds between prefill health checks (default: $SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL or 5)")
        a("--disaggregation-heartbeat-max-failures", type=int, default=None,
          help="decode: failed health checks before a prefill's requests fail "
               "(default: $SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE or 2)")
        a("--disaggregation-fault-probability", type=float, default=0.0,
          help="testing only: report this fraction of KV transfers as failed")
        a("--tp-size", type=int, default=1,
          help="tensor parallelism: split each model replica over this many processes (GPUs on CUDA); "
               "attention heads and MLP columns are sharded, two all-reduces per layer")
        a("--nccl-port", type=int, default=None,
          help="the TP group's rendezvous port on 127.0.0.1 (DP rank i uses port + i; default: a free port)")
        a("--tp-cpu-allreduce", default="shm", choices=("shm", "gloo"),
          help="CPU tensor parallelism: the forward's all-reduces through a shared memory segment (default) or gloo")
        a("--dp-size", type=int, default=1,
          help="data parallelism: this many model replicas (scheduler processes), one GPU each on CUDA")
        a("--load-balance-method", default=ServerArgs.load_balance_method, choices=LOAD_BALANCE_METHODS,
          help="how requests without data_parallel_rank are spread over the DP ranks (shortest_queue: "
               "fewest requests in flight)")
        a("--base-gpu-id", type=int, default=ServerArgs.base_gpu_id, help="CUDA: DP rank i, TP rank t runs on GPU base + i * tp_size + t")

    def gpu_id(self, dp_rank: int, tp_rank: int) -> int:
        """The GPU of one engine process on CUDA."""
        return self.base_gpu_id + dp_rank * self.tp_size + tp_rank

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        kwargs["enable_metrics"] = not getattr(args, "disable_metrics", False)
        kwargs["api_key"] = args.api_key or os.environ.get("BATON_API_KEY") or None
        return cls(**kwargs)
