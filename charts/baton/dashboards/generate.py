#!/usr/bin/env python3
"""Generates the Grafana dashboards (*.json next to this file) from the panel lists below.

    python charts/baton/dashboards/generate.py          # rewrite the JSON files
    python charts/baton/dashboards/generate.py --check  # exit 1 if a JSON file differs

Labels the queries rely on (docs/observability.md): `namespace`, `pod` and `inference_service` are
target labels the operator's PodMonitor/ServiceMonitor attach; `role`, `dp_rank`, `worker`, `side`
come from the metrics themselves. The e2e test (tests/observability) runs every query here against a
real Prometheus scraping a real PD stack.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
ENGINE = 'namespace="$namespace", inference_service="$isvc", role=~"$role"'
ROUTER = 'namespace="$namespace", inference_service="$isvc"'


def rate(metric: str, sel: str, by: str = "") -> str:
    agg = f"sum by ({by}) " if by else "sum "
    return f"{agg}(rate({metric}{{{sel}}}[{RI}]))"


def quantiles(metric: str, sel: str, by: str = "", qs: tuple = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    """histogram_quantile targets (expr, legend) for a histogram's buckets."""
    keys = f"le, {by}" if by else "le"
    legend_by = "".join(f" {{{{{k.strip()}}}}}" for k in by.split(",")) if by else ""
    return [(f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
             f"p{int(q * 100)}{legend_by}") for q in qs]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          w: int = 12, h: int = 8, desc: str = "") -> dict:
    return {"type": kind, "title": title, "description": desc, "datasource": DS,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "gridPos": {"h": h, "w": w},
            "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": lg, "datasource": DS}
                        for i, (e, lg) in enumerate(targets)]}


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"h": 1, "w": 24}}


def layout(items: list[dict]) -> list[dict]:
    """Place panels left to right, wrapping at 24 columns; rows start a new line. Ids in order."""
    x = y = line_h = 0
    for i, item in enumerate(items, start=1):
        item["id"] = i
        g = item["gridPos"]
        if item["type"] == "row" or x + g["w"] > 24:
            x, y, line_h = 0, y + line_h, 0
        g["x"], g["y"] = x, y
        x, line_h = x + g["w"], max(line_h, g["h"])
        if item["type"] == "row":
            x, y, line_h = 0, y + 1, 0
    return items


def query_var(name: str, label: str, query: str, multi: bool = False) -> dict:
    var = {"name": name, "label": label, "type": "query", "datasource": DS, "refresh": 2, "sort": 1,
           "definition": query, "query": {"query": query, "refId": f"{name}-var"},
           "multi": multi, "includeAll": multi, "current": {}, "options": []}
    if multi:
        var["allValue"] = ".*"
        var["current"] = {"text": "All", "value": "$__all"}
    return var


def variables(probe: str, with_role: bool) -> list[dict]:
    out = [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "options": []},
           query_var("namespace", "Namespace", f"label_values({probe}, namespace)"),
           query_var("isvc", "InferenceService", f'label_values({probe}{{namespace="$namespace"}}, inference_service)')]
    if with_role:
        out.append(query_var("role", "Role", 'label_values(baton_max_total_tokens{namespace="$namespace", '
                                             'inference_service="$isvc"}, role)', multi=True))
    return out


def dashboard(uid: str, title: str, items: list[dict], templating: list[dict], desc: str) -> dict:
    return {"uid": uid, "title": title, "description": desc, "tags": ["baton"], "schemaVersion": 39,
            "version": 1, "editable": True, "graphTooltip": 1, "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
            "annotations": {"list": []}, "links": [{"type": "dashboards", "tags": ["baton"], "asDropdown": True,
                                                     "title": "Baton dashboards"}],
            "templating": {"list": templating}, "panels": layout(items)}


# -- PD overview ---------------------------------------------------------------------------------------
def pd_overview() -> dict:
    pre = 'namespace="$namespace", inference_service="$isvc", role="prefill"'
    dec = 'namespace="$namespace", inference_service="$isvc", role="decode"'
    items = [
        row("Requests"),
        panel("Request rate", [(rate("baton_router_requests_total", ROUTER, "route"), "router {{route}}"),
                               (rate("baton_requests_total", ENGINE, "role"), "finished on {{role}}")],
              "reqps", w=8),
        panel("Time to first token", quantiles("baton_time_to_first_token_seconds", ENGINE, "role"), "s", w=8,
              desc="Per engine: on decode it includes the prefill and the KV transfer."),
        panel("Inter-token latency", quantiles("baton_inter_token_latency_seconds", ENGINE, "role"), "s", w=8),
        panel("Errors", [(rate("baton_router_errors_total", ROUTER, "reason"), "router {{reason}}"),
                         (rate("baton_request_errors_total", ENGINE, "role, status"), "{{role}} HTTP {{status}}"),
                         (rate("baton_pd_failures_total", ENGINE, "role, stage"), "{{role}} {{stage}} failure")],
              "reqps", w=12),
        panel("End-to-end latency (router)", quantiles("baton_router_request_duration_seconds", ROUTER), "s", w=12),
        row("KV transfer"),
        panel("KV transfer latency", quantiles("baton_kv_transfer_latency_seconds", ENGINE, "role"), "s", w=8),
        panel("KV transfer throughput", [(rate("baton_kv_transfer_bytes_sum", ENGINE, "role"), "{{role}}")],
              "Bps", w=8, desc="Bytes moved per second, summed over pods."),
        panel("KV transfer speed per request", quantiles("baton_kv_transfer_speed_gb_per_second", ENGINE, "role",
                                                         (0.1, 0.5, 0.9)), "short", w=8,
              desc="GB/s of single transfers (low quantiles show slow links)."),
        panel("Transfers and failures", [(rate("baton_kv_transfer_latency_seconds_count", ENGINE, "role"),
                                          "{{role}} transfers"),
                                         (rate("baton_pd_failures_total", ENGINE, "role, stage"),
                                          "{{role}} {{stage}} failures")], "reqps", w=12),
        panel("PD queue lengths", [('sum by (role, queue) (baton_pd_queue_requests{%s})' % ENGINE,
                                    "{{role}} {{queue}}")], w=12),
        row("Prefill | Decode"),
        panel("Prefill: prompt throughput", [(rate("baton_prompt_tokens_total", pre), "prompt tokens/s"),
                                             (rate("baton_cached_tokens_total", pre), "cached tokens/s")], w=12),
        panel("Decode: generation throughput", [(rate("baton_generation_tokens_total", dec), "tokens/s"),
                                                ("sum (baton_gen_throughput{%s})" % dec, "scheduler estimate")],
              w=12),
        panel("Prefill: queue time", quantiles("baton_queue_time_seconds", pre), "s", w=12),
        panel("Decode: running requests and retractions",
              [("sum (baton_num_running_requests{%s})" % dec, "running"),
               (rate("baton_retracted_requests_total", dec), "retractions/s")], w=12),
        panel("Prefill: bootstrap and inflight queues",
              [("sum by (queue) (baton_pd_queue_requests{%s})" % pre, "{{queue}}"),
               ("sum (baton_num_queued_requests{%s})" % pre, "waiting")], w=12),
        panel("Decode: prealloc and transfer queues",
              [("sum by (queue) (baton_pd_queue_requests{%s})" % dec, "{{queue}}"),
               ("sum (baton_num_queued_requests{%s})" % dec, "waiting")], w=12),
        row("Memory and balance"),
        panel("KV usage per pod", [("max by (pod, role) (baton_token_usage{%s})" % ENGINE, "{{role}} {{pod}}")],
              "percentunit", w=8),
        panel("Prefix cache hit rate per pod",
              [("max by (pod, role) (baton_cache_hit_rate{%s})" % ENGINE, "{{role}} {{pod}}")], "percentunit", w=8),
        panel("DP-rank imbalance (max / mean load)",
              [("max by (role) (baton_num_running_requests{{{s}}} + baton_num_queued_requests{{{s}}}) / "
                "clamp_min(avg by (role) (baton_num_running_requests{{{s}}} + baton_num_queued_requests{{{s}}}), 1)"
                .format(s=ENGINE), "{{role}}"),
               ("max by (side) (baton_router_dp_rank_in_flight{%s}) / clamp_min(avg by (side) "
                "(baton_router_dp_rank_in_flight{%s}), 1)" % (ROUTER, ROUTER), "router {{side}}")], w=8,
              desc="1 is balanced. Engine load = running + queued per (pod, DP rank); router: in flight per "
                   "DP rank (router in --dp-aware mode)."),
    ]
    return dashboard("baton-pd-overview", "Baton / PD overview", items, variables("baton_max_total_tokens", True),
                     "Prefill/decode serving at a glance: requests, latency, KV transfer, queues, memory.")


# -- engine detail -------------------------------------------------------------------------------------
def engine() -> dict:
    s = ENGINE
    items = [
        row("Load"),
        panel("Running requests per pod", [("sum by (pod, dp_rank) (baton_num_running_requests{%s})" % s,
                                            "{{pod}} dp{{dp_rank}}")], w=8),
        panel("Queued requests per pod", [("sum by (pod, dp_rank) (baton_num_queued_requests{%s})" % s,
                                           "{{pod}} dp{{dp_rank}}")], w=8),
        panel("PD queues per pod", [("sum by (pod, queue) (baton_pd_queue_requests{%s})" % s, "{{pod}} {{queue}}")],
              w=8),
        panel("Token throughput", [(rate("baton_prompt_tokens_total", s, "role"), "{{role}} prompt"),
                                   (rate("baton_generation_tokens_total", s, "role"), "{{role}} generated"),
                                   (rate("baton_cached_tokens_total", s, "role"), "{{role}} cached")], w=12),
        panel("Generation throughput (scheduler)", [("sum by (pod) (baton_gen_throughput{%s})" % s, "{{pod}}")],
              w=12),
        row("Latency"),
        panel("Time to first token", quantiles("baton_time_to_first_token_seconds", s, "role"), "s", w=12),
        panel("Inter-token latency", quantiles("baton_inter_token_latency_seconds", s, "role"), "s", w=12),
        panel("End-to-end latency", quantiles("baton_e2e_request_latency_seconds", s, "role"), "s", w=12),
        panel("Queue time", quantiles("baton_queue_time_seconds", s, "role"), "s", w=12),
        row("Memory"),
        panel("KV usage per pod", [("max by (pod, dp_rank) (baton_token_usage{%s})" % s, "{{pod}} dp{{dp_rank}}")],
              "percentunit", w=8),
        panel("KV pool size (tokens)", [("max by (pod) (baton_max_total_tokens{%s})" % s, "{{pod}}")], w=8),
        panel("Prefix cache hit rate", [("max by (pod) (baton_cache_hit_rate{%s})" % s, "{{pod}}")],
              "percentunit", w=8),
        panel("Retractions and preemptions", [(rate("baton_retracted_requests_total", s, "pod"), "{{pod}} retracted"),
                                              (rate("baton_preempted_requests_total", s, "pod"), "{{pod}} preempted")],
              "reqps", w=12),
        panel("Finished requests by reason", [(rate("baton_requests_total", s, "role, finish_reason"),
                                               "{{role}} {{finish_reason}}")], "reqps", w=12),
        row("KV transfer and errors"),
        panel("KV transfer latency per pod", quantiles("baton_kv_transfer_latency_seconds", s, "pod", (0.5, 0.99)),
              "s", w=12),
        panel("KV bytes per second per pod", [(rate("baton_kv_transfer_bytes_sum", s, "pod"), "{{pod}}")], "Bps", w=12),
        panel("KV bytes per request", quantiles("baton_kv_transfer_bytes", s, "role", (0.5, 0.99)), "bytes", w=8),
        panel("PD failures by stage", [(rate("baton_pd_failures_total", s, "pod, stage"), "{{pod}} {{stage}}")],
              "reqps", w=8),
        panel("HTTP errors by status", [(rate("baton_request_errors_total", s, "pod, status"), "{{pod}} {{status}}")],
              "reqps", w=8),
        row("Speculative decoding"),
        # denominators clamped: an engine that does not speculate shows 0, not NaN
        panel("Accept length (tokens per request per verify step)",
              [("sum by (pod) (rate(baton_spec_accept_length_tokens_sum{%s}[%s])) / clamp_min(sum by (pod) "
                "(rate(baton_spec_accept_length_tokens_count{%s}[%s])), 1e-12)" % (s, RI, s, RI), "{{pod}}")], w=8,
              desc="Accepted draft tokens + 1 per request and verify step (--speculative-algorithm); 1: none passed"),
        panel("Draft accept rate", [("sum by (pod) (rate(baton_spec_accepted_tokens_total{%s}[%s])) / clamp_min("
                                     "sum by (pod) (rate(baton_spec_draft_tokens_total{%s}[%s])), 1e-12)"
                                     % (s, RI, s, RI), "{{pod}}")],
              "percentunit", w=8, desc="Share of the draft tokens verified that the target model accepted"),
        panel("Draft tokens", [(rate("baton_spec_draft_tokens_total", s, "pod"), "{{pod}} drafted"),
                               (rate("baton_spec_accepted_tokens_total", s, "pod"), "{{pod}} accepted"),
                               (rate("baton_spec_tree_branch_accepts_total", s, "pod"),
                                "{{pod}} runs off a tree's first branch")],
              w=8, desc="Draft tokens verified and accepted per second; with tree drafts, the accepted runs a chain "
                        "would have missed"),
        panel("Verify steps", [(rate("baton_spec_verify_steps_total", s, "pod"), "{{pod}} verify steps"),
                               (rate("baton_spec_lagged_verify_steps_total", s, "pod"),
                                "{{pod}} lagged (built while the one before ran)")],
              w=8, desc="Verify steps per second; lagged: built while the verify step before them ran (the overlap "
                        "loop with a draft head), so the scheduler's work overlapped the forward"),
    ]
    return dashboard("baton-engine", "Baton / Engine", items, variables("baton_max_total_tokens", True),
                     "One InferenceService's engines, per pod and DP rank.")


# -- router detail -------------------------------------------------------------------------------------
def router() -> dict:
    s = ROUTER
    items = [
        row("Clients"),
        panel("Requests by route", [(rate("baton_router_requests_total", s, "route"), "{{route}}")], "reqps", w=8),
        panel("Errors by reason", [(rate("baton_router_errors_total", s, "reason"), "{{reason}}")], "reqps", w=8),
        panel("Retries", [(rate("baton_router_retries_total", s, "route"), "{{route}}")], "reqps", w=8),
        panel("Request duration", quantiles("baton_router_request_duration_seconds", s, "route"), "s", w=8),
        panel("Time to first byte (streaming)", quantiles("baton_router_ttft_seconds", s, "route"), "s", w=8),
        panel("In flight and queued", [("sum (baton_router_in_flight_requests{%s})" % s, "in flight"),
                                       ("sum (baton_router_queue_depth{%s})" % s, "queued")], w=8),
        row("Workers"),
        panel("In flight per worker", [("sum by (side, worker) (baton_router_worker_in_flight{%s})" % s,
                                        "{{side}} {{worker}}")], w=12),
        panel("In flight per DP rank", [("sum by (side, worker, dp_rank) (baton_router_dp_rank_in_flight{%s})" % s,
                                         "{{side}} {{worker}} dp{{dp_rank}}")], w=12,
              desc="Present in --dp-aware mode."),
        panel("Requests per worker", [(rate("baton_router_worker_requests_total", s, "side, worker"),
                                       "{{side}} {{worker}}")], "reqps", w=12),
        panel("Worker errors", [(rate("baton_router_worker_errors_total", s, "side, worker, reason"),
                                 "{{side}} {{worker}} {{reason}}")], "reqps", w=12),
        panel("Healthy workers", [("sum by (side) (baton_router_worker_healthy{%s})" % s, "{{side}}")], w=8),
        panel("Circuit breaker state", [("max by (side, worker) (baton_router_circuit_breaker_state{%s})" % s,
                                         "{{side}} {{worker}}")], w=8, desc="0 closed, 1 open, 2 half-open."),
        panel("Aborts sent", [(rate("baton_router_aborts_total", s, "side"), "{{side}}")], "reqps", w=8),
        row("Decisions"),
        panel("PD pairs chosen", [(rate("baton_router_pd_pairs_total", s, "prefill, decode"),
                                   "{{prefill}} -> {{decode}}")], "reqps", w=8),
        panel("Policy decisions", [(rate("baton_router_policy_decisions_total", s, "side, policy, reason"),
                                    "{{side}} {{policy}} {{reason}}")], "reqps", w=8),
        panel("Discovery events", [(f"sum by (side, event) (increase(baton_router_discovery_events_total{{{s}}}"
                                    f"[$__range]))", "{{side}} {{event}}")], w=8),
    ]
    return dashboard("baton-router", "Baton / Router", items, variables("baton_router_requests_total", False),
                     "One InferenceService's router: clients, workers, policy and PD pair decisions.")


# -- operator ------------------------------------------------------------------------------------------
def operator() -> dict:
    s = 'namespace="$namespace"'
    items = [
        panel("Reconciles by result", [(rate("baton_operator_reconciles_total", s, "result"), "{{result}}")],
              "ops", w=8),
        panel("Reconciles by trigger", [(rate("baton_operator_reconciles_total", s, "trigger"), "{{trigger}}")],
              "ops", w=8),
        panel("Errors by kind", [(rate("baton_operator_errors_total", s, "kind"), "{{kind}}")], "ops", w=8),
        panel("Reconcile duration", quantiles("baton_operator_reconcile_duration_seconds", s, "", (0.5, 0.99)),
              "s", w=8),
        panel("Managed objects by kind", [("sum by (kind) (baton_operator_managed_objects{%s})" % s, "{{kind}}")],
              w=8),
        panel("InferenceServices by Ready", [("sum by (ready) (baton_operator_inference_services{%s})" % s,
                                              "Ready={{ready}}")], w=8),
    ]
    templating = [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                   "current": {}, "options": []},
                  query_var("namespace", "Operator namespace", "label_values(baton_operator_managed_objects, namespace)")]
    return dashboard("baton-operator", "Baton / Operator", items, templating,
                     "The operator: reconciles, errors, objects it keeps in shape.")


BOARDS = {"baton-pd-overview.json": pd_overview, "baton-engine.json": engine, "baton-router.json": router,
          "baton-operator.json": operator}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=1) + "\n" for name, build in BOARDS.items()}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in render().items():
        path = HERE / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run {Path(__file__).name}): {', '.join(stale)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
