"""SIGTERM to `baton serve` (what Kubernetes sends a pod's main process) drains it: /health fails at once
(the readiness probe takes the pod out of its Service), a new generation is refused with a retriable 503
(Retry-After, error type "draining", which the router reads), the streams already running finish whole,
and then the server and its scheduler and detokenizer processes exit cleanly, leaving no IPC socket files
behind. POST /drain does the same on request, behind the API key."""
from __future__ import annotations

import json
import time

import httpx

from engine_server import running_engine

MAX_TOKENS = 300


def test_sigterm_drains_running_streams_then_exits(tiny_model_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the server's temporary files, where this test sees them
    with running_engine(tiny_model_factory("llama"), "--max-total-tokens", "2048") as engine:
        body = {"prompt": "drain me", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, finish, refused_while_streaming = "", None, None, False
        assert [p.name for p in tmp_path.glob("baton-ipc-*")], "the server's IPC sockets are not under TMPDIR"
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{engine.base_url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
                if i == 2:
                    engine.terminate()
                elif i > 2 and not refused_while_streaming and finish is None:
                    health = httpx.get(f"{engine.base_url}/health", timeout=5)
                    new = httpx.post(f"{engine.base_url}/v1/completions", json=body | {"stream": False}, timeout=5)
                    if health.status_code == 503:  # the signal may not have landed yet
                        assert new.status_code == 503 and new.headers["retry-after"] == "1", new.text
                        assert new.json()["error"]["type"] == "draining"
                        refused_while_streaming = True
                        seen_at = i
        assert finish == "length" and usage["completion_tokens"] == MAX_TOKENS, (finish, usage)
        assert refused_while_streaming, "the server kept accepting new requests after SIGTERM"
        assert seen_at < MAX_TOKENS - 1
        started = time.monotonic()
        code = engine.wait_exit(timeout_s=60)
        assert code == 0, f"exit code {code} after {time.monotonic() - started:.1f}s\n{engine.log_tail()}"
        time.sleep(1)  # the resource tracker (a process of its own) reports leaks just after the exit
        log = engine.log_tail(400)
        assert "SIGTERM: stopped" in log and "draining (SIGTERM)" in log
        # a clean stop says nothing more: no leaked semaphore (tqdm's multiprocessing lock used to be one
        # in the scheduler) and none of the "nanobind: leaked" lines of an interpreter teardown
        assert "leaked" not in log and "Traceback" not in log, log
        assert text
        assert not list(tmp_path.glob("baton-ipc-*")), "the IPC socket directory outlived the server"


def test_a_killed_engines_ipc_directory_goes_at_the_next_start(tmp_path):
    """SIGKILL runs no shutdown, so its IPC directory stays; the next engine to start removes the
    directories of processes that no longer exist, and never a live one's."""
    import os
    import subprocess
    import sys

    from baton.engine.utils.process import IPC_PREFIX, remove_stale_ipc_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live, other = (tmp_path / f"{IPC_PREFIX}{gone.pid}-abc", tmp_path / f"{IPC_PREFIX}{os.getpid()}-def",
                          tmp_path / "unrelated-123")
    for d in (stale, live, other):
        d.mkdir()
        (d / "0").write_text("")  # a socket file left behind
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_drain_route_needs_the_api_key_then_drains_and_exits(tiny_model_factory):
    with running_engine(tiny_model_factory("llama"), api_key="k") as engine:
        assert httpx.post(f"{engine.base_url}/drain", timeout=10).status_code == 401
        assert httpx.get(f"{engine.base_url}/health", timeout=10).status_code == 200  # not drained by that
        r = httpx.post(f"{engine.base_url}/drain", headers={"Authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 200 and r.json()["draining"] is True
        assert engine.wait_exit(timeout_s=60) == 0, engine.log_tail()
