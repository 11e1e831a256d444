"""The shipped dashboards and alert rules, without a running stack: the JSON is what generate.py
makes, promtool accepts the rules, the chart wraps exactly that rule file, the dashboards are
consistent (variables, data source, layout)."""
from __future__ import annotations

import subprocess
import sys

import helm_python as helm
import yaml

from prometheus import PROMTOOL
from queries import CHART, DASHBOARDS, RULES, alert_rules, dashboards, panel_queries


def test_committed_dashboards_are_the_generated_ones():
    r = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(dashboards()) == {"baton-pd-overview.json", "baton-engine.json", "baton-router.json",
                                 "baton-operator.json"}


def test_promtool_accepts_the_alert_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_alerts_cover_the_obvious_failures():
    names = {r["alert"] for r in alert_rules()}
    assert {"BatonKVTransferFailures", "BatonBootstrapFailures", "BatonKVCacheNearlyFull", "BatonNoReadyDecode",
            "BatonRouterErrors", "BatonEngineDown"} <= names
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def _render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name="baton", namespace="baton-system")
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def test_chart_prometheus_rule_is_the_rule_file():
    assert "PrometheusRule" not in {o["kind"] for o in _render({})}, "off by default: it needs the CRD"
    objs = _render({"prometheusRule": {"enabled": True, "labels": {"release": "prom"}, "namespace": "monitoring"}})
    [rule] = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "monitoring" and rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_chart_ships_every_dashboard_in_one_config_map():
    [cm] = [o for o in _render({}) if o["kind"] == "ConfigMap"]
    assert set(cm["data"]) == set(dashboards())


def test_dashboards_have_the_variables_and_a_sane_layout():
    for name, board in dashboards().items():
        variables = [v["name"] for v in board["templating"]["list"]]
        assert variables[:2] == ["datasource", "namespace"], name
        if "operator" not in name:
            assert "isvc" in variables, name
        panels = board["panels"]
        assert len({p["id"] for p in panels}) == len(panels), f"{name}: duplicate panel ids"
        cells = set()
        for p in panels:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, p["title"])
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not area & cells, f"{name}: {p['title']} overlaps another panel"
            cells |= area
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}" and p["targets"], (name, p["title"])
        assert panel_queries(board), name


def test_pd_overview_puts_kv_transfer_first_class():
    board = dashboards()["baton-pd-overview.json"]
    titles = [p["title"] for p in board["panels"]]
    rows = [t for p, t in zip(board["panels"], titles) if p["type"] == "row"]
    assert rows[:2] == ["Requests", "KV transfer"], rows
    exprs = " ".join(q.expr for q in panel_queries(board))
    for metric in ("baton_kv_transfer_latency_seconds_bucket", "baton_kv_transfer_bytes_sum", "baton_pd_queue_requests",
                   "baton_token_usage", "baton_router_dp_rank_in_flight", "baton_time_to_first_token_seconds_bucket",
                   "baton_inter_token_latency_seconds_bucket"):
        assert metric in exprs, metric
    by_title = {p["title"]: p["gridPos"] for p in board["panels"]}
    prefill, decode = by_title["Prefill: prompt throughput"], by_title["Decode: generation throughput"]
    assert prefill["y"] == decode["y"] and prefill["x"] < decode["x"], "prefill and decode side by side"
