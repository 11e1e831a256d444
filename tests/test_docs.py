"""The docs that describe the code stay true: structure.md lists every module; metrics.md lists every
metric of the engine, the router and the operator with its type and labels, and nothing else; flags.md
is generated from the flag declarations and lists every option of `baton serve` and `baton router`."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_ROW = re.compile(r"^\| `(baton_[a-z0-9_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|", re.M)


def test_structure_md_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_structure.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def exported(registry) -> dict[str, tuple[str, frozenset[str]]]:
    """name on the wire (counters with `_total`) -> (type, label names), from a live registry."""
    out = {}
    for family in registry.collect():
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        if not family.samples:  # a labelled metric no child of which exists yet: its declared labels
            labels = set(registry._names_to_collectors[family.name]._labelnames)
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, frozenset(labels))
    return out


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    rows = {}
    for name, kind, labels in _ROW.findall(doc):
        assert name not in rows, f"docs/metrics.md lists {name} twice"
        rows[name] = (kind, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def engine_registry():
    from baton.engine.metrics import EngineMetrics

    m = EngineMetrics("m", "prefill")
    m.update_from_server_info({"disaggregation_mode": "prefill", "num_bootstrap_reqs": 1, "num_inflight_reqs": 0,
                               "num_running_reqs": 1, "transfer_samples": [(1, 4096, 0.01)],
                               "queue_time_samples": [(1, 0.1)]})
    return m.registry


def router_registry():
    from baton.router.config import RouterConfig, WorkerRole, WorkerSpec
    from baton.router.server import Router

    router = Router(RouterConfig(pd_disaggregation=True, dp_aware=True, workers=(
        WorkerSpec("http://p:1", WorkerRole.PREFILL, 8998), WorkerSpec("http://d:1", WorkerRole.DECODE))))
    for worker in router.workers.workers():
        router.workers.set_dp_size(worker, 2)
    return router.metrics.registry


def operator_registry():
    from baton.operator.metrics import OperatorMetrics

    return OperatorMetrics().registry


def test_metrics_md_is_the_catalogue_of_every_metric():
    code = {**exported(engine_registry()), **exported(router_registry()), **exported(operator_registry())}
    doc = documented()
    assert sorted(set(code) - set(doc)) == [], "metrics missing from docs/metrics.md"
    assert sorted(set(doc) - set(code)) == [], "docs/metrics.md lists metrics the code does not export"
    wrong = {n: {"code": code[n], "doc": doc[n]} for n in code if code[n] != doc[n]}
    assert not wrong, f"type or labels differ: {wrong}"


def test_metric_names_follow_prometheus_conventions():
    for name, (kind, _) in documented().items():
        assert name.startswith("baton_"), name
        assert name.endswith("_total") == (kind == "counter"), f"{name}: only counters end in _total"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_bytes", "_per_second", "_tokens")), f"{name}: histogram without a unit"


def test_flags_md_and_known_flags_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_flags.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("command, module", [("baton serve", "baton.engine.entrypoints.cli"),
                                             ("baton router", "baton.router.cli")])
def test_flags_md_lists_every_option_of_the_parser(command, module):
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_cli_args(parser)
    options = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    section = (ROOT / "docs" / "flags.md").read_text().split(f"## `{command}`\n")[1].split("\n## ")[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `-")]
    listed = [name for row in rows for name in re.findall(r"`(-[^`]+)`", row)]
    assert len(listed) == len(set(listed)), f"docs/flags.md lists an option of {command} twice"
    assert sorted(options - set(listed)) == [], f"options of {command} missing from docs/flags.md"
    assert sorted(set(listed) - options) == [], f"docs/flags.md lists options {command} does not have"
