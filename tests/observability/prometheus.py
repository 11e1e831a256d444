"""Debian's Prometheus (/usr/bin/prometheus) on loopback for tests: a free port, a temporary TSDB,
our scrape jobs and rule files; stopped (its process group) on exit, also on failure."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from typing import Any, Iterator

import httpx
import yaml

from baton.engine.bench.launcher import free_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


class Prometheus:
    def __init__(self, base_url: str, proc: subprocess.Popen, log_path: str) -> None:
        self.base_url, self._proc, self._log_path = base_url, proc, log_path

    def log_tail(self, lines: int = 30) -> str:
        with open(self._log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the JSON body (status "success" or "error", as Prometheus answers)."""
        r = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=30)
        return r.json()

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))

    def wait_for(self, expr: str, ok, what: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Poll an instant query until ok(result) holds; return the result."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            last = self.query(expr)
            if last.get("status") == "success" and ok(last["data"]["result"]):
                return last["data"]["result"]
            assert self._proc.poll() is None, f"prometheus exited\n{self.log_tail()}"
            time.sleep(0.5)  # about half a scrape interval, bounded by the deadline
        raise AssertionError(f"timed out waiting for {what}: {expr} -> {last}\n{self.log_tail()}")


@contextlib.contextmanager
def running_prometheus(scrape_configs: list[dict[str, Any]], rule_files: list[str] = (),
                       startup_timeout_s: float = 30.0) -> Iterator[Prometheus]:
    with tempfile.TemporaryDirectory(prefix="baton-prom-") as tmp:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": [os.path.abspath(p) for p in rule_files], "scrape_configs": scrape_configs}
        config_path = os.path.join(tmp, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        port = free_port()
        log_path = os.path.join(tmp, "prometheus.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp}/data",
                                     f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            _wait_ready(prom, proc, startup_timeout_s)
            yield prom
        finally:
            _stop(proc)


def _wait_ready(prom: Prometheus, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}\n{prom.log_tail()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{prom.base_url}/-/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)  # poll interval, bounded by the deadline
    raise AssertionError(f"prometheus not ready after {timeout_s}s\n{prom.log_tail()}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
