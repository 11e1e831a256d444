"""How a test run treats skips (a pytest plugin, loaded by tests/conftest.py; docs/testing.md).

Under CI (`CI` set and not "0"/"false", as .ci/run sets it) or with `--fail-on-skip`, a skipped test
fails the session unless it carries the `gpu` marker: a machine without Triton, Mooncake or the native
kernels must not stay green by dropping whole areas. A local run without either still skips.

At the end of a run that collected GPU-only tests (or ran strict) the summary lists them by name and
says when they last ran on a GPU, read from tests/gpu_last_run.json (scripts/gpu_check.sh writes it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest

GPU_MARKER = "gpu"
GPU_RECORD = Path(__file__).resolve().parents[2] / "gpu_last_run.json"
RECORD_ENV = "BATON_GPU_RECORD"  # read another record instead (the plugin's own tests do)
OFF = ("", "0", "false", "no")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fail-on-skip", action="store_true", default=False,
                     help="fail the session on any skipped test that is not GPU-only (`gpu` marker); "
                          "on whenever the CI environment variable is set")


def strict(config: pytest.Config) -> bool:
    return bool(config.getoption("--fail-on-skip")) or os.environ.get("CI", "").strip().lower() not in OFF


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipPolicy(strict(config)), "baton-skip-policy")


def last_gpu_run(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The record of the last GPU test run: date, card, commit, passed, failed (None if unreadable)."""
    path = path or Path(os.environ.get(RECORD_ENV) or GPU_RECORD)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def describe_gpu_run(record: Optional[dict[str, Any]]) -> str:
    if not record:
        return "never recorded (no tests/gpu_last_run.json; scripts/gpu_check.sh writes it)"
    commit = str(record.get("commit", "unknown"))[:12]
    counts = f"{record.get('passed', '?')} passed, {record.get('failed', '?')} failed"
    return f"{record.get('date', '?')} on {record.get('card', '?')}, commit {commit} ({counts})"


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class SkipPolicy:
    """Watches every report; under a strict run, a skip that is not GPU-only fails the session."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.gpu_tests: list[str] = []  # node ids of every collected gpu-marked test
        self.gpu_outcomes: dict[str, str] = {}  # node id -> passed | failed | skipped
        self.bad_skips: list[tuple[str, str]] = []  # (node id, reason) of each skip that is not GPU-only

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Counted before `-m` or `-k` deselect any: the summary names every GPU-only test collected."""
        self.gpu_tests = [i.nodeid for i in items if i.get_closest_marker(GPU_MARKER)]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped while collected (`pytest.importorskip` at its top) drops all its tests."""
        if report.skipped:
            self.bad_skips.append((report.nodeid, _reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        gpu = GPU_MARKER in report.keywords
        if gpu and (report.when == "call" or not report.passed):
            self.gpu_outcomes[report.nodeid] = report.outcome
        if report.skipped and not gpu and not hasattr(report, "wasxfail"):
            self.bad_skips.append((report.nodeid, _reason(report)))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.strict and self.bad_skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        if self.strict and self.bad_skips:
            tr.write_sep("=", f"{len(self.bad_skips)} skip(s) fail this run (CI or --fail-on-skip)", red=True)
            for nodeid, reason in self.bad_skips:
                tr.write_line(f"SKIP NOT ALLOWED {nodeid}: {reason}")
            tr.write_line("Only GPU-only tests (`gpu` marker) may skip here: install what the reason names "
                          "(scripts/setup.sh), or mark the test `gpu` if it needs a GPU.")
        if not (self.gpu_tests or self.strict):
            return
        ran = sum(1 for outcome in self.gpu_outcomes.values() if outcome != "skipped")
        tr.write_sep("=", f"GPU-only tests: {len(self.gpu_tests)} collected, {ran} ran here")
        for nodeid in self.gpu_tests:
            tr.write_line(f"  {nodeid} [{self.gpu_outcomes.get(nodeid, 'not run')}]")
        tr.write_line(f"GPU tests last ran on a GPU: {describe_gpu_run(last_gpu_run())}")
