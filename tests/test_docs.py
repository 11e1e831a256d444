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


# ---------------------------------------------------------------- the README, links, and no history labels

README_MAX_LINES = 150
# Where the code and the docs must not carry issue numbers or development-history labels: they describe
# the present code (figures carry a date; history lives in docs/benchmarks-history.md, dated).
LABEL_SCAN = ("engine", "router", "operator", "baton", "docs", "scripts", "charts", "manifests", "images", "e2e",
              "tests", ".ci", "README.md")
LABEL_SUFFIXES = {".py", ".md", ".sh", ".c", ".h", ".yaml", ".yml", ".json", ".toml", ".tpl", ".txt", ".Dockerfile", ""}
_LABELS = re.compile(r"\b[Ii]ssues?[\s#]*\d+|\b[Ss]essions?[\s#-]*\d+|\(was [^)]|[Bb]efore this change"
                     r"|(?<![\w&/#])#\d{2,}\b")
# another project's issue may explain a magic number or a workaround: "SGLang #18721"
_OTHER_PROJECT = re.compile(r"(SGLang|sglang|vLLM|vllm|PyTorch|pytorch|torch|Triton|triton|FlashInfer|flashinfer"
                            r"|transformers|Mooncake|mooncake|xgrammar|kopf|CPython|cpython)[\w/-]*\s*$")
# pages linked from the docs but written by their own generator, which may land separately
GENERATED_ELSEWHERE: set[str] = set()


def _scanned_files() -> list[Path]:
    out = []
    for name in LABEL_SCAN:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out += [p for p in files if "__pycache__" not in p.parts and
                (p.suffix in LABEL_SUFFIXES or p.name.endswith(".Dockerfile"))]
    return out


def history_labels(text: str) -> list[tuple[int, str]]:
    """(offset, label) of each issue number and development-history label in a file's text ("issue 35",
    "#35", "session 24", "(was ...)", "before this change"), an other project's issue reference excepted."""
    found = []
    for m in _LABELS.finditer(text):
        if m.group(0).startswith("#") and _OTHER_PROJECT.search(text[max(0, m.start() - 40):m.start()]):
            continue
        found.append((m.start(), m.group(0)))
    return found


def test_history_labels_are_recognised():
    def labels(text: str) -> list[str]:
        return [label for _, label in history_labels(text)]

    assert labels("the NGRAM drafter (issue 35): and #35, session 24, Session\n 7") == \
        ["issue 35", "#35", "session 24", "Session\n 7"]
    assert labels("a workaround (SGLang #18721), color #7EB26D, &#39;, page 35, run #1") == []
    assert labels("16 (was 8) before this change") == ["(was 8", "before this change"]


def test_no_issue_numbers_or_history_labels_in_code_comments_or_docs():
    hits = []
    for path in _scanned_files():
        if path == Path(__file__).resolve():
            continue  # its own examples
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for offset, label in history_labels(text):
            line = text.count("\n", 0, offset) + 1
            hits.append(f"{path.relative_to(ROOT)}:{line}: {label!r}")
    assert hits == [], "describe the present code (a figure gets a date):\n" + "\n".join(hits)


def test_readme_is_a_map_of_at_most_150_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details into docs/"
    text = "\n".join(lines)
    for command in ("./scripts/demo.sh", "./scripts/test.sh"):
        assert command in text


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in doc_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if rel in GENERATED_ELSEWHERE:
                continue
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == [], "\n".join(broken)


def test_the_request_path_names_modules_that_exist():
    """structure.md's request lifecycle and the README name modules by path: a move must update them."""
    structure = (ROOT / "docs" / "structure.md").read_text()
    lifecycle = structure[structure.index("## A request's path"):structure.index("## Import rules")]
    text = lifecycle + (ROOT / "README.md").read_text()
    paths = set(re.findall(r"`((?:engine|router|operator|baton)/[\w/.]+)`", text))
    assert len(paths) > 20, paths
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
