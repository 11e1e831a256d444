"""Fault timings through a PD router (baton's, sglang-router) on slow fake workers run as processes.

How long a client waits for its error when a worker is killed (SIGKILL) or stopped (SIGSTOP),
whether a stream that the decode already took over survives its prefill's fault, and how long a
worker that answers again waits for its first request. Fake workers, so what is measured is the
router's share.

    python -m baton.router.bench.faults                       # baton router, --worker-stall-timeout 15
    python -m baton.router.bench.faults --sglang --cap 60     # and sglang-router, each wait capped
    python -m baton.router.bench.faults worker --port 31000   # one slow fake worker (used by the above)

A fake worker streams like an engine: headers and a keep-alive comment at once, its first event
after `--first-event-delay` (a prefill holds its response that long, as a real one does until its KV
went out; a decode waits that long "for KV"), then `--chunks` events `--interval` apart.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from baton.router.bench.__main__ import Processes, environment, free_port
from baton.router.timeouts import timeout

HOLD = 600.0  # a first-event delay no scenario waits out
STREAM = {"text": "x", "stream": True}


# -- the slow fake worker ------------------------------------------------------------------------
def worker_app(first_event_delay: float, chunks: int, interval: float) -> web.Application:
    stats = {"requests": 0, "aborts": 0}

    async def inference(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stats["requests"] += 1
        if not body.get("stream"):
            await asyncio.sleep(first_event_delay + chunks * interval)
            return web.json_response({"text": "done", "meta_info": {"id": body.get("rid")}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b": keep-alive\n\n")
        await asyncio.sleep(first_event_delay)
        for i in range(chunks):
            await out.write(b"data: " + orjson.dumps({"text": f"t{i}", "index": 0}) + b"\n\n")
            await asyncio.sleep(interval)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def abort(request: web.Request) -> web.Response:
        stats["aborts"] += 1
        return web.json_response({})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"dp_size": 1, "model_path": "fake-model", "disaggregation_mode": "null"})

    app = web.Application()
    app.router.add_post("/generate", inference)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))
    app.router.add_get("/stats", lambda _: web.json_response(stats))
    for path in ("/get_server_info", "/server_info", "/get_model_info"):
        app.router.add_get(path, info)
    return app


# -- the scenarios -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    victim: str  # "prefill" | "decode"
    fault: str  # "kill" | "stop"
    phase: str  # "before": the decode waits for KV (no event yet); "after": it is streaming

    @property
    def name(self) -> str:
        taken = "before the decode's first event" if self.phase == "before" else "while the decode streams"
        return f"{self.victim} {'killed' if self.fault == 'kill' else 'SIGSTOPped'} {taken}"


FAULTS = [Scenario(v, f, p) for p in ("after", "before") for v in ("decode", "prefill") for f in ("kill", "stop")
          if not (v == "decode" and p == "before")]


class Bench:
    def __init__(self, router: str, args: argparse.Namespace, procs: Processes, session: aiohttp.ClientSession):
        self.router, self.args, self.procs, self.session = router, args, procs, session
        self.ports: dict[str, int] = {}
        self.workers: dict[str, subprocess.Popen] = {}
        self.url = ""

    async def start(self, prefill: tuple[float, int, float], decode: tuple[float, int, float]) -> None:
        for role, shape in (("prefill", prefill), ("decode", decode)):
            self.ports[role] = free_port()
            await self.start_worker(role, shape)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        pd = ["--pd-disaggregation", "--prefill", self.worker_url("prefill"), "8998",
              "--decode", self.worker_url("decode")]
        if self.router == "baton":
            command = [sys.executable, "-m", "baton.router", "--host", "127.0.0.1", "--port", str(port),
                       "--log-level", "warning", "--worker-stall-timeout", str(self.args.stall_timeout), *pd]
        else:
            command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                       str(port), "--log-level", "warn", "--prometheus-port", str(free_port()),
                       "--worker-startup-check-interval", "1", *pd]
        self.router_proc = self.procs.start(f"{self.router}-router-{port}", command)
        if await poll(lambda: self.get(self.url + "/health"), 60.0) is None:
            raise RuntimeError(f"{self.router} not ready after 60 s")

    async def start_worker(self, role: str, shape: tuple[float, int, float]) -> None:
        delay, chunks, interval = shape
        self.workers[role] = self.procs.start(f"{role}-{self.ports[role]}", [
            sys.executable, "-m", "baton.router.bench.faults", "worker", "--port", str(self.ports[role]),
            "--first-event-delay", str(delay), "--chunks", str(chunks), "--interval", str(interval)])
        await poll(lambda: self.get(self.worker_url(role) + "/health"), 30.0)

    def worker_url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def stop(self) -> None:
        for proc in [self.router_proc, *self.workers.values()]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()

    async def get(self, url: str) -> bool:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def served(self) -> bool:
        try:
            async with self.session.post(self.url + "/generate", json={"text": "x"},
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def until_served(self, cap: float) -> float | None:
        return await poll(self.served, cap, interval=0.1)

    def fault(self, role: str, fault: str) -> None:
        os.kill(self.workers[role].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


async def poll(check, cap: float, interval: float = 0.02) -> float | None:
    """Seconds until `check()` is true, or None after `cap` seconds."""
    started = time.monotonic()
    while time.monotonic() - started < cap:
        if await check():
            return time.monotonic() - started
        await asyncio.sleep(interval)
    return None


async def fault_to_error(bench: Bench, s: Scenario, cap: float) -> str:
    """Time from the fault to the end of the client's stream: an error event, or a cut connection."""
    stream_shape, holding, at_once = (0.0, 100_000, 0.05), (HOLD, 1, 0.0), (0.0, 1, 0.0)
    # a prefill fault after the decode took over: the prefill's response still open
    prefill = holding if s.victim == "prefill" or s.phase == "before" else at_once
    await bench.start(prefill=prefill, decode=stream_shape if s.phase == "after" else holding)
    request = asyncio.ensure_future(bench.session.post(bench.url + "/generate", json=STREAM,
                                                       timeout=aiohttp.ClientTimeout(total=None)))
    try:
        if s.phase == "after":
            try:
                async with timeout(cap):
                    resp = await request
                    while not (await resp.content.readuntil(b"\n\n")).startswith(b"data:"):
                        pass
            except asyncio.TimeoutError:
                return f"no event relayed in {cap:.0f} s (the prefill's response is open)"
        else:
            await poll(lambda: requests_seen(bench), 10.0)
        bench.fault(s.victim, s.fault)
        started = time.monotonic()
        outcome = await read_until_end(request, cap)
        elapsed = time.monotonic() - started
    finally:
        close(request)
        bench.stop()
    if outcome == "running":
        return f"stream goes on (>{cap:.0f} s)" if s.victim == "prefill" and s.phase == "after" else \
            f"nothing after {cap:.0f} s"
    return f"{elapsed:.2f} s ({outcome})"


async def requests_seen(bench: Bench) -> bool:
    counts = []
    for role in ("prefill", "decode"):
        try:
            async with bench.session.get(bench.worker_url(role) + "/stats") as resp:
                counts.append((await resp.json())["requests"])
        except aiohttp.ClientError:
            return False
    return all(c >= 1 for c in counts)


async def read_until_end(request: asyncio.Future, cap: float) -> str:
    try:
        async with timeout(cap):
            resp = await request
            if resp.status != 200:
                return f"status {resp.status}"
            while True:
                event = await resp.content.readuntil(b"\n\n")
                if event.startswith(b'data: {"error"'):
                    return "error event"
                if not event or event.startswith(b"data: [DONE]"):
                    return "stream closed without an error event"
    except asyncio.TimeoutError:
        return "running"
    except (aiohttp.ClientError, ValueError):
        return "connection cut"


async def back_to_served(bench: Bench, victim: str, fault: str, cap: float) -> str:
    """Time from the worker answering again to the first request served through the router, with
    clients sending all along (their failures are what open breakers)."""
    await bench.start(prefill=(0.0, 1, 0.0), decode=(0.0, 1, 0.0))
    background = [asyncio.ensure_future(keep_sending(bench))]
    try:
        if fault == "stop":  # a stream open on it, so that the stall is noticed
            background.append(asyncio.ensure_future(bench.session.post(bench.url + "/generate", json=STREAM)))
        bench.fault(victim, fault)
        await asyncio.sleep(bench.args.outage)
        if fault == "kill":
            await bench.start_worker(victim, (0.0, 1, 0.0))
        else:
            os.kill(bench.workers[victim].pid, signal.SIGCONT)
            await poll(lambda: bench.get(bench.worker_url(victim) + "/health"), 30.0)
        elapsed = await bench.until_served(cap)
    finally:
        for task in background:
            close(task)
        bench.stop()
    return f"{elapsed:.2f} s" if elapsed is not None else f"not served after {cap:.0f} s"


def close(request: asyncio.Future) -> None:
    """Cancel a request still on its way, or close the response it got."""
    if not request.done():
        request.cancel()
    elif not request.cancelled() and request.exception() is None and request.result() is not None:
        request.result().close()


async def keep_sending(bench: Bench) -> None:
    while True:
        await bench.served()
        await asyncio.sleep(0.05)


async def bounded(scenario, args: argparse.Namespace) -> str:
    limit = 2 * args.cap + args.outage + 120
    try:
        return await asyncio.wait_for(scenario, limit)
    except asyncio.TimeoutError:
        return f"scenario did not finish in {limit:.0f} s"


async def run(args: argparse.Namespace) -> str:
    routers = ["baton", "sglang-router"] if args.sglang else ["baton"]
    rows = [s.name for s in FAULTS] + [f"{v} {'restarted' if f == 'kill' else 'SIGCONTed'} after "
                                       f"{args.outage:g} s: answers -> first request served"
                                       for v in ("decode", "prefill") for f in ("kill", "stop")]
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="baton-router-faults-") as log_dir:
        procs = Processes(log_dir)
        try:
            async with aiohttp.ClientSession() as session:
                for router in routers:
                    out = results[router] = []
                    for s in FAULTS:
                        out.append(await bounded(fault_to_error(Bench(router, args, procs, session), s, args.cap),
                                                 args))
                    for victim in ("decode", "prefill"):
                        for fault in ("kill", "stop"):
                            out.append(await bounded(back_to_served(Bench(router, args, procs, session), victim,
                                                                    fault, args.cap), args))
        finally:
            procs.stop_all()
    lines = ["| fault | " + " | ".join(routers) + " |", "|---" * (len(routers) + 1) + "|"]
    lines += [f"| {row} | " + " | ".join(results[r][i] for r in routers) + " |" for i, row in enumerate(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        parser = argparse.ArgumentParser(prog="python -m baton.router.bench.faults worker")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--first-event-delay", type=float, default=0.0)
        parser.add_argument("--chunks", type=int, default=1)
        parser.add_argument("--interval", type=float, default=0.0)
        w = parser.parse_args(argv[1:])
        web.run_app(worker_app(w.first_event_delay, w.chunks, w.interval), host="127.0.0.1", port=w.port,
                    print=None, access_log=None)
        return 0
    parser = argparse.ArgumentParser(prog="python -m baton.router.bench.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang", action="store_true", help="also measure sglang-router")
    parser.add_argument("--stall-timeout", type=float, default=15.0, help="baton's --worker-stall-timeout")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds a worker stays down or stopped")
    parser.add_argument("--cap", type=float, default=90.0, help="longest wait for any one outcome")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(f"{report}\n\ncommand: python -m baton.router.bench.faults {' '.join(argv)}\n"
          f"environment: {environment()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
