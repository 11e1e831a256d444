"""Every PromQL query the chart ships: dashboard panel targets (with Grafana's variables substituted)
and alert rule expressions, read from the same files the chart packages."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "baton"
DASHBOARDS = CHART / "dashboards"
RULES = CHART / "rules" / "baton-alerts.yaml"
_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)$")


class Query(NamedTuple):
    where: str  # "<dashboard> / <panel>" or "alert <name>"
    expr: str


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows keep their panels inside


def panel_queries(board: dict[str, Any]) -> list[Query]:
    return [Query(f"{board['title']} / {panel['title']}", target["expr"])
            for panel in _panels(board["panels"]) for target in panel.get("targets", [])]


def variable_queries(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(variable name, label, PromQL) for each query variable: `label_values(expr, label)` becomes
    `group by (label) (expr)`, which answers with the values Grafana would offer."""
    out = []
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["query"]["query"])
        assert m and m.group(1), f"{board['title']}: variable {var['name']} is not label_values(expr, label)"
        out.append((var["name"], m.group(2), f"group by ({m.group(2)}) ({m.group(1)})"))
    return out


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($name, ${name}, ${name:...}); every `$` must be one we know."""
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown variable ${name} in {expr}"
        return values[name]
    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, expr)
    assert "$" not in out, out
    return out
