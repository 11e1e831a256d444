"""`baton operator` command line, and what the operator package must never import."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from baton.operator.cli import add_cli_args, config_from_args, kopf_kwargs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def test_all_namespaces_standalone_by_default():
    args = parse(["--all-namespaces"])
    kw = kopf_kwargs(args)
    assert kw["clusterwide"] is True and kw["namespaces"] == [] and kw["standalone"] is True
    assert kw["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    config = config_from_args(args)
    assert config.metrics_port == 9090 and config.resync_seconds == 60 and config.prometheus_url is None
    url = "http://prometheus-operated.monitoring:9090"
    assert config_from_args(parse(["-A", "--prometheus-url", url])).prometheus_url == url


def test_the_operators_namespace_comes_from_its_pod(monkeypatch):
    """$POD_NAMESPACE (the downward API, in manifests/ and the chart): the engines' NetworkPolicies let the
    operator's pods of that namespace scrape them for the planner."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert config_from_args(parse(["-A"])).operator_namespace is None
    monkeypatch.setenv("POD_NAMESPACE", "baton-system")
    assert config_from_args(parse(["-A"])).operator_namespace == "baton-system"


def test_namespaces_peering_and_switches():
    args = parse(["-n", "team-a", "--namespace", "team-*", "--peering", "baton", "--priority", "7",
                  "--metrics-port", "0", "--liveness", "", "--no-events", "--resync-seconds", "5"])
    kw = kopf_kwargs(args)
    assert kw["clusterwide"] is False and kw["namespaces"] == ["team-a", "team-*"]
    assert kw["standalone"] is False and kw["peering_name"] == "baton" and kw["priority"] == 7
    assert kw["liveness_endpoint"] is None
    config = config_from_args(args)
    assert config.metrics_port is None and config.post_events is False and config.resync_seconds == 5


def test_a_scope_is_required_and_scopes_exclude_each_other():
    with pytest.raises(SystemExit):
        kopf_kwargs(parse([]))
    with pytest.raises(SystemExit):
        parse(["-A", "-n", "x"])


def test_baton_operator_help_runs_through_the_baton_command():
    out = subprocess.run([sys.executable, "-m", "baton", "operator", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--all-namespaces" in out.stdout and "--peering" in out.stdout


def test_the_operator_imports_neither_torch_nor_the_engine_nor_the_router():
    code = ("import sys, operator, baton.operator.handlers, baton.operator.cli, baton.operator.install;"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('baton.engine', 'baton.router'))];"
            "assert not bad, bad;"
            "assert operator.__file__.endswith('/operator.py') and 'site-packages' not in operator.__file__ "
            "and '/lib/python' in operator.__file__, operator.__file__")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_log_lines_name_the_object_they_are_about():
    import logging

    from baton.operator.cli import configure_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        configure_logging(verbose=False)
        [handler] = [h for h in root.handlers if h not in handlers]
        record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, "applied nothing", None, None)
        record.k8s_ref = {"kind": "InferenceService", "namespace": "team-a", "name": "demo"}
        assert "[team-a/demo] applied nothing" in handler.format(record)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
