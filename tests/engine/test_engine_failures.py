"""When an engine process dies or hangs, the engine fails cleanly instead of hanging its clients.

- The scheduler killed (SIGKILL: what the OOM killer does) mid-stream: the stream and a waiting
  non-streaming request get a 503 error at once, new requests are refused, and `baton serve` exits 1
  with every process of its group gone (so its pod is restarted).
- The watchdog: a scheduler loop that stops ticking past --watchdog-timeout ends its process with
  exit code 1 after dumping every thread's stack; ticks keep it quiet.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from baton.engine.scheduler.watchdog import Watchdog
from baton.engine.server_args import ServerArgs
from engine_server import running_engine


def test_a_killed_scheduler_fails_requests_in_flight_and_the_server_exits(tiny_model_factory):
    with running_engine(tiny_model_factory("llama"), "--max-total-tokens", "4096") as engine:
        base = engine.base_url
        scheduler_pid = httpx.get(f"{base}/get_server_info", timeout=30).json()["scheduler_pid"]
        plain: dict = {}

        def non_streaming() -> None:  # waits for its whole answer when the scheduler dies
            body = {"prompt": "wait for me", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            plain.update(status=r.status_code, body=r.json())

        waiter = threading.Thread(target=non_streaming)
        waiter.start()
        body = {"prompt": "stream me", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        events, killed_at = [], None
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.kill(scheduler_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        ended_after = time.monotonic() - killed_at
        waiter.join(timeout=60)
        assert not waiter.is_alive()

        error = events[-1].get("error")
        assert error is not None, events[-3:]
        assert error["code"] == 503 and "scheduler process was killed by SIGKILL" in error["message"], error
        assert ended_after < 15, f"the stream ended {ended_after:.1f}s after the kill"
        assert plain["status"] == 503 and "SIGKILL" in plain["body"]["error"]["message"], plain
        code = engine.wait_exit(timeout_s=60)  # the server, its detokenizer: the whole process group
        log = engine.log_tail(200)
        assert code == 1, f"exit code {code}\n{log}"
        assert "the scheduler process was killed by SIGKILL (out of memory?): failing" in log, log


def test_watchdog_calls_on_stall_only_when_the_loop_stops_ticking():
    stalls: list[float] = []
    dog = Watchdog(0.3, on_stall=stalls.append, poll_s=0.02).start()
    try:
        until = time.monotonic() + 0.9
        while time.monotonic() < until:  # a loop that keeps stepping: three timeouts' worth
            dog.tick()
            time.sleep(0.01)
        assert stalls == []
        time.sleep(0.6)  # the loop hangs
        assert len(stalls) == 1 and stalls[0] > 0.3
    finally:
        dog.stop()


HUNG_SCHEDULER = textwrap.dedent("""
    import logging, threading, time
    from baton.engine.scheduler.watchdog import Watchdog

    logging.basicConfig(level=logging.INFO)
    def hung_forward():
        time.sleep(60)  # stands for a forward that never returns
    Watchdog(0.5).start()
    hung_forward()
    print("not reached")
""")


def test_watchdog_dumps_stacks_and_exits_1_from_a_hung_process():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_SCHEDULER], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "not reached" not in proc.stdout
    assert "watchdog: the scheduler loop has not completed a step" in proc.stderr
    assert "in hung_forward" in proc.stderr  # the stack shows where it hung
    assert took < 30


def test_watchdog_timeout_flag():
    assert ServerArgs(model_path="m").watchdog_timeout == 300.0  # SGLang's default
    with pytest.raises(ValueError, match="--watchdog-timeout"):
        ServerArgs(model_path="m", watchdog_timeout=-1)
