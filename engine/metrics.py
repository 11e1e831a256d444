"""Prometheus metrics of one engine. Request-level histograms are observed in the HTTP process;
scheduler gauges are read from the scheduler at scrape time. docs/metrics.md lists every metric."""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "role"]
        self._lv = (model_name, role)
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("baton_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS).labels(*self._lv)
        self.itl = hist("baton_inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS).labels(*self._lv)
        self.e2e = hist("baton_e2e_request_latency_seconds", "Request latency, arrival to last token", _LATENCY_BUCKETS).labels(*self._lv)
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens processed", labels, registry=r).labels(*self._lv)
        self.generation_tokens = Counter("baton_generation_tokens", "Output tokens generated", labels, registry=r).labels(*self._lv)
        self.cached_tokens = Counter("baton_cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=r).labels(*self._lv)
        self.requests = Counter("baton_requests", "Finished requests by finish reason", labels + ["finish_reason"], registry=r)
        self.errors = Counter("baton_request_errors", "Requests answered with an error, by HTTP status", labels + ["status"], registry=r)
        gauge = lambda name, doc: Gauge(name, doc, labels, registry=r).labels(*self._lv)  # noqa: E731
        self.num_running = gauge("baton_num_running_requests", "Requests in the running (decode) batch")
        self.num_queued = gauge("baton_num_queued_requests", "Requests in the waiting queue")
        self.token_usage = gauge("baton_token_usage", "Fraction of KV pool slots in use (not free or evictable)")
        self.cache_hit_rate = gauge("baton_cache_hit_rate", "Prefix cache hit rate over prompt tokens since start")
        self.max_total_tokens = gauge("baton_max_total_tokens", "KV pool size in tokens")
        self.retractions = gauge("baton_retracted_requests", "Requests retracted for lack of KV memory since start")
        self.preemptions = gauge("baton_preempted_requests", "Requests preempted by higher-priority ones since start")
        self.gen_throughput = gauge("baton_gen_throughput", "Output tokens per second over the last ~1 s of work")
        # PD disaggregation (prefill: bootstrap/inflight queues; decode: prealloc/transfer queues)
        self.pd_queue = Gauge("baton_pd_queue_requests", "Requests in a PD queue", labels + ["queue"], registry=r)
        self.kv_transfer_latency = hist("baton_kv_transfer_latency_seconds", "KV transfer time per request",
                                        _LATENCY_BUCKETS).labels(*self._lv)
        self.kv_transfer_bytes = Histogram("baton_kv_transfer_bytes", "KV bytes moved per request", labels,
                                           buckets=tuple(2.0 ** k for k in range(16, 36, 2)), registry=r).labels(*self._lv)
        self.kv_transfer_speed = Histogram("baton_kv_transfer_speed_gb_per_second", "KV transfer speed per request (GB/s)",
                                           labels, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
                                           registry=r).labels(*self._lv)
        self.pd_failures = Counter("baton_pd_failures", "PD requests that failed, by stage (bootstrap, transfer)",
                                   labels + ["stage"], registry=r)
        self._seen_seq = 0
        self._failures_seen = {"bootstrap": 0, "transfer": 0}

    def finished(self, reason: str) -> None:
        self.requests.labels(*self._lv, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(*self._lv, str(status)).inc()

    def update_from_server_info(self, info: Optional[dict[str, Any]]) -> None:
        if not info:
            return
        self.num_running.set(info.get("num_running_reqs", 0))
        self.num_queued.set(info.get("num_waiting_reqs", 0))
        self.token_usage.set(info.get("token_usage", 0.0))
        self.cache_hit_rate.set(info.get("cache_hit_rate", 0.0))
        self.max_total_tokens.set(info.get("max_total_num_tokens", 0))
        self.retractions.set(info.get("retractions", 0))
        self.preemptions.set(info.get("preemptions", 0))
        self.gen_throughput.set(info.get("gen_throughput", 0.0))
        if info.get("disaggregation_mode") in ("prefill", "decode"):
            self._update_pd(info)

    def _update_pd(self, info: dict[str, Any]) -> None:
        for queue in ("bootstrap", "inflight", "prealloc", "transfer"):
            if f"num_{queue}_reqs" in info:
                self.pd_queue.labels(*self._lv, queue).set(info[f"num_{queue}_reqs"])
        for seq, nbytes, seconds in info.get("transfer_samples", []):
            if seq <= self._seen_seq:
                continue
            self._seen_seq = seq
            self.kv_transfer_latency.observe(seconds)
            self.kv_transfer_bytes.observe(nbytes)
            if seconds > 0:
                self.kv_transfer_speed.observe(nbytes / seconds / 1e9)
        for stage in ("bootstrap", "transfer"):
            total = info.get(f"{stage}_failures", 0)
            if total > self._failures_seen[stage]:
                self.pd_failures.labels(*self._lv, stage).inc(total - self._failures_seen[stage])
                self._failures_seen[stage] = total
