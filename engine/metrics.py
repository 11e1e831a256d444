"""Prometheus metrics of one engine. Request-level histograms are observed in the HTTP process;
scheduler state is read from the scheduler at scrape time. docs/metrics.md lists every metric."""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_BYTES_BUCKETS = tuple(2.0 ** k for k in range(16, 36, 2))
_SPEED_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
# tokens one request emits per verify step: 1 .. --speculative-num-draft-tokens (SGLang's default 12)
_ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)

FINISH_REASONS = ("length", "stop", "abort")
ERROR_STATUSES = ("400", "401", "500", "503")  # what the engine answers with; others appear when used
PD_QUEUES = {"prefill": ("bootstrap", "inflight"), "decode": ("prealloc", "transfer")}
PD_STAGES = ("bootstrap", "transfer")


class EngineMetrics:
    """Labels: `model_name`, `role` on all; `dp_rank` on the gauges of scheduler state (one scheduler
    per DP rank). Labelled counters start at 0 for every known label value, so alerts and dashboards
    see a series before the first event."""

    def __init__(self, model_name: str, role: str) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self._lv = (model_name, role)
        self._define_request_metrics()
        self._define_scheduler_metrics()
        self._define_pd_metrics()
        self._define_spec_metrics()
        self._define_mm_metrics()
        # per DP rank: each scheduler numbers its samples and keeps its totals on its own
        self._seen: dict[tuple[str, int], int] = {}  # (kind, rank) -> highest sample sequence number observed
        self._totals_seen: dict[tuple[str, int], int] = {}  # scheduler totals already turned into increments
        self._counts_seen: dict[tuple[str, int], list[int]] = {}  # per-bucket totals already observed

    # -- definitions -----------------------------------------------------------------------
    def _hist(self, name: str, doc: str, buckets: tuple) -> Any:
        return Histogram(name, doc, ["model_name", "role"], buckets=buckets, registry=self.registry).labels(*self._lv)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, ["model_name", "role", *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, ["model_name", "role", "dp_rank", *extra], registry=self.registry)

    def _define_request_metrics(self) -> None:
        self.ttft = self._hist("baton_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = self._hist("baton_inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = self._hist("baton_e2e_request_latency_seconds", "Request latency, arrival to last token",
                              _LATENCY_BUCKETS)
        self.prompt_tokens = self._counter("baton_prompt_tokens", "Prompt tokens processed").labels(*self._lv)
        self.generation_tokens = self._counter("baton_generation_tokens", "Output tokens generated").labels(*self._lv)
        self.cached_tokens = self._counter("baton_cached_tokens",
                                           "Prompt tokens served from the prefix cache").labels(*self._lv)
        self.requests = self._counter("baton_requests", "Finished requests by finish reason", ("finish_reason",))
        self.errors = self._counter("baton_request_errors", "Requests answered with an error, by HTTP status",
                                    ("status",))
        for reason in FINISH_REASONS:
            self.requests.labels(*self._lv, reason)
        for status in ERROR_STATUSES:
            self.errors.labels(*self._lv, status)

    def _define_scheduler_metrics(self) -> None:
        self.queue_time = self._hist("baton_queue_time_seconds",
                                     "Time in the waiting queue before the prefill forward", _LATENCY_BUCKETS)
        self.num_running = self._gauge("baton_num_running_requests", "Requests in the running (decode) batch")
        self.num_queued = self._gauge("baton_num_queued_requests", "Requests in the waiting queue")
        self.num_queued_tokens = self._gauge(
            "baton_num_queued_tokens", "Prompt tokens of the requests in the waiting queue (prefill work queued)")
        self.num_grammar_queued = self._gauge("baton_num_grammar_queue_requests",
                                              "Structured-output requests waiting for their grammar to compile")
        self.token_usage = self._gauge("baton_token_usage", "Fraction of KV pool slots in use (not free or evictable)")
        self.cache_hit_rate = self._gauge("baton_cache_hit_rate", "Prefix cache hit rate over prompt tokens since start")
        self.max_total_tokens = self._gauge("baton_max_total_tokens", "KV pool size in tokens")
        self.gen_throughput = self._gauge("baton_gen_throughput", "Output tokens per second over the last ~1 s of work")
        # hybrid models (linear-attention layers): the recurrent-state pool
        self.state_slots_used = self._gauge("baton_recurrent_state_slots_used",
                                            "Recurrent-state slots held by requests (hybrid models)")
        self.state_slots_total = self._gauge("baton_recurrent_state_slots_capacity",
                                             "Recurrent-state slots, one per request row (hybrid models)")
        self.state_checkpoints_cached = self._gauge(
            "baton_recurrent_state_checkpoints_cached", "State checkpoints on radix-cache nodes (hybrid models)")
        self.state_checkpoints_total = self._gauge(
            "baton_recurrent_state_checkpoints_capacity", "State checkpoint slots of the radix cache (hybrid models)")
        self.retractions = self._counter("baton_retracted_requests",
                                         "Requests retracted for lack of KV memory").labels(*self._lv)
        self.preemptions = self._counter("baton_preempted_requests",
                                         "Requests preempted by higher-priority ones").labels(*self._lv)
        self.mixed_decode_tokens = self._counter(
            "baton_mixed_decode_tokens", "Decode tokens computed inside prefill batches (--enable-mixed-chunk)"
        ).labels(*self._lv)

    def _define_pd_metrics(self) -> None:
        self.pd_queue = self._gauge("baton_pd_queue_requests", "Requests in a PD queue", ("queue",))
        self.kv_transfer_latency = self._hist("baton_kv_transfer_latency_seconds", "KV transfer time per request",
                                              _LATENCY_BUCKETS)
        self.kv_transfer_bytes = self._hist("baton_kv_transfer_bytes", "KV bytes moved per request", _BYTES_BUCKETS)
        self.kv_transfer_speed = self._hist("baton_kv_transfer_speed_gb_per_second",
                                            "KV transfer speed per request (GB/s)", _SPEED_BUCKETS)
        self.pd_failures = self._counter("baton_pd_failures", "PD requests that failed, by stage (bootstrap, transfer)",
                                         ("stage",))
        if self.role in PD_QUEUES:
            for stage in PD_STAGES:
                self.pd_failures.labels(*self._lv, stage)

    def _define_spec_metrics(self) -> None:
        self.spec_accept_length = self._hist(
            "baton_spec_accept_length_tokens", "Tokens a request emitted per speculative verify step (accepted drafts + 1)",
            _ACCEPT_LENGTH_BUCKETS)
        self.spec_accept_rate = self._gauge("baton_spec_accept_rate",
                                            "Share of speculative draft tokens accepted since start")
        self.spec_draft_tokens = self._counter("baton_spec_draft_tokens",
                                               "Speculative draft tokens verified").labels(*self._lv)
        self.spec_accepted_tokens = self._counter("baton_spec_accepted_tokens",
                                                  "Speculative draft tokens accepted").labels(*self._lv)
        self.spec_tree_branch_accepts = self._counter(
            "baton_spec_tree_branch_accepts", "Speculative verify runs accepted off a draft tree's first branch"
        ).labels(*self._lv)
        self.spec_verify_steps = self._counter("baton_spec_verify_steps",
                                               "Speculative verify steps run").labels(*self._lv)
        self.spec_lagged_verify_steps = self._counter(
            "baton_spec_lagged_verify_steps", "Speculative verify steps built while the one before them ran (overlap)"
        ).labels(*self._lv)

    def _define_mm_metrics(self) -> None:
        """A vision-language model's image work (model_executor/mm_embedder.py)."""
        self.mm_images_encoded = self._counter("baton_mm_images_encoded",
                                               "Images the vision tower encoded").labels(*self._lv)
        self.mm_cache_hits = self._counter("baton_mm_embedding_cache_hits",
                                           "Images whose vision embeddings came from the cache").labels(*self._lv)
        self.mm_cache_misses = self._counter("baton_mm_embedding_cache_misses",
                                             "Images looked up in the vision embeddings' cache and not found"
                                             ).labels(*self._lv)
        self.mm_cache_bytes = self._gauge("baton_mm_embedding_cache_bytes", "Bytes the vision embeddings' cache holds")

    # -- updates ---------------------------------------------------------------------------
    def finished(self, reason: str) -> None:
        self.requests.labels(*self._lv, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(*self._lv, str(status)).inc()

    def update_from_server_infos(self, infos: list[dict[str, Any]]) -> None:
        """One scrape: each DP rank's scheduler info."""
        for info in infos:
            self.update_from_server_info(info)

    def update_from_server_info(self, info: Optional[dict[str, Any]]) -> None:
        if not info:
            return
        rank = (*self._lv, str(info.get("dp_rank", 0)))
        self.num_running.labels(*rank).set(info.get("num_running_reqs", 0))
        self.num_queued.labels(*rank).set(info.get("num_waiting_reqs", 0))
        self.num_queued_tokens.labels(*rank).set(info.get("num_waiting_tokens", 0))
        self.num_grammar_queued.labels(*rank).set(info.get("num_grammar_queue_reqs", 0))
        self.token_usage.labels(*rank).set(info.get("token_usage", 0.0))
        self.cache_hit_rate.labels(*rank).set(info.get("cache_hit_rate", 0.0))
        self.max_total_tokens.labels(*rank).set(info.get("max_total_num_tokens", 0))
        self.gen_throughput.labels(*rank).set(info.get("gen_throughput", 0.0))
        if info.get("recurrent_state_slots_total"):  # a hybrid model
            self.state_slots_used.labels(*rank).set(info["recurrent_state_slots_used"])
            self.state_slots_total.labels(*rank).set(info["recurrent_state_slots_total"])
            self.state_checkpoints_cached.labels(*rank).set(info.get("recurrent_state_checkpoints_cached", 0))
            self.state_checkpoints_total.labels(*rank).set(info.get("recurrent_state_checkpoints_total", 0))
        self._add_total("retractions", info, self.retractions)
        self._add_total("preemptions", info, self.preemptions)
        self._add_total("mixed_decode_tokens", info, self.mixed_decode_tokens)
        for seconds in self._new_samples("queue", info, "queue_time_samples"):
            self.queue_time.observe(seconds)
        if info.get("disaggregation_mode") in PD_QUEUES:
            self._update_pd(info, rank)
        if info.get("speculative_algorithm"):
            self._update_spec(info, rank)
        if "mm_images_encoded" in info:
            self._add_total("mm_images_encoded", info, self.mm_images_encoded)
            self._add_total("mm_cache_hits", info, self.mm_cache_hits)
            self._add_total("mm_cache_misses", info, self.mm_cache_misses)
            self.mm_cache_bytes.labels(*rank).set(info.get("mm_cache_bytes", 0))

    def _update_spec(self, info: dict[str, Any], rank: tuple[str, ...]) -> None:
        self.spec_accept_rate.labels(*rank).set(info.get("spec_accept_rate", 0.0))
        self._add_total("spec_draft_tokens", info, self.spec_draft_tokens)
        self._add_total("spec_accepted_tokens", info, self.spec_accepted_tokens)
        self._add_total("spec_tree_branch_accepts", info, self.spec_tree_branch_accepts)
        self._add_total("spec_verify_steps", info, self.spec_verify_steps)
        self._add_total("spec_lagged_verify_steps", info, self.spec_lagged_verify_steps)
        # the scheduler keeps a running count per accept length: each new one is one observation
        mark = ("spec_accept_length_counts", info.get("dp_rank", 0))
        seen = self._counts_seen.get(mark, [])
        counts = info.get("spec_accept_length_counts", [])
        for length, total in enumerate(counts):
            for _ in range(total - (seen[length] if length < len(seen) else 0)):
                self.spec_accept_length.observe(length)
        self._counts_seen[mark] = list(counts)

    def _update_pd(self, info: dict[str, Any], rank: tuple[str, ...]) -> None:
        for queue in ("bootstrap", "inflight", "prealloc", "transfer"):
            if f"num_{queue}_reqs" in info:
                self.pd_queue.labels(*rank, queue).set(info[f"num_{queue}_reqs"])
        for nbytes, seconds in self._new_samples("transfer", info, "transfer_samples"):
            self.kv_transfer_latency.observe(seconds)
            self.kv_transfer_bytes.observe(nbytes)
            if seconds > 0:
                self.kv_transfer_speed.observe(nbytes / seconds / 1e9)
        for stage in PD_STAGES:
            self._add_total(f"{stage}_failures", info, self.pd_failures.labels(*self._lv, stage))

    def _add_total(self, key: str, info: dict[str, Any], counter: Any) -> None:
        """Turn a scheduler's running total into counter increments (totals only grow)."""
        mark = (key, info.get("dp_rank", 0))
        total, seen = info.get(key, 0), self._totals_seen.get(mark, 0)
        if total > seen:
            counter.inc(total - seen)
            self._totals_seen[mark] = total

    def _new_samples(self, kind: str, info: dict[str, Any], field: str) -> list:
        """The payloads of the samples (seq, *payload) in info[field] newer than the last seen from
        that rank; each is observed once even when several scrapes return it."""
        mark = (kind, info.get("dp_rank", 0))
        fresh = [s for s in info.get(field, []) if s[0] > self._seen.get(mark, 0)]
        if fresh:
            self._seen[mark] = fresh[-1][0]
        return [s[1] if len(s) == 2 else tuple(s[1:]) for s in fresh]
