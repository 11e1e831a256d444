"""Router benchmark, side by side in one run on one fake backend:

  direct       the client calls the backend itself (the floor)
  baton        `python -m baton.router` in front of it
  sglang       `python -m sglang_router.launch_router` (PyPI `sglang-router`, Rust) in front of it

For each: added latency (p50/p99 at concurrency 1, over direct) and requests/s at fixed concurrency.
Rounds interleave the targets so that noise on a shared machine hits all of them alike; medians are
reported. PD mode puts two backends (prefill, decode) behind each router; "direct" then calls the
decode backend alone.

    python -m baton.router.bench --mode both --concurrency 32 --requests 3000 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp

from baton.ports import free_port
from baton.router.bench.load import LoadResult, median, run_load

ROUTE = "/v1/chat/completions"


@dataclass
class Target:
    name: str
    url: str  # base URL the client calls
    command: list[str] | None = None  # None: nothing to launch
    results: list[tuple[LoadResult, LoadResult]] = field(default_factory=list)  # (serial, loaded) per round
    cpu_us: list[float] = field(default_factory=list)  # router process CPU per request at load, per round
    pid: int | None = None


def worker_flags(mode: str, backends: list[str]) -> list[str]:
    if mode == "regular":
        return ["--worker-urls", backends[0]]
    return ["--pd-disaggregation", "--prefill", backends[0], "8998", "--decode", backends[1]]


def targets_for(mode: str, backends: list[str], args: argparse.Namespace) -> list[Target]:
    direct = Target("direct", backends[-1])
    port = free_port()
    baton = Target("baton router", f"http://127.0.0.1:{port}", [
        sys.executable, "-m", "baton.router", "--host", "127.0.0.1", "--port", str(port), "--policy", args.policy,
        "--log-level", "warning", *worker_flags(mode, backends)])
    targets = [direct, baton]
    if args.compare_upstream:
        port = free_port()
        targets.append(Target("baton router (aiohttp client)", f"http://127.0.0.1:{port}", [
            *baton.command[:6], str(port), *baton.command[7:], "--upstream-client", "aiohttp"]))
    if not args.no_sglang:
        port = free_port()
        targets.append(Target("sglang-router", f"http://127.0.0.1:{port}", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", args.policy, "--log-level", "warn", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", *worker_flags(mode, backends)]))
    return targets


class Processes:
    """Started processes, all stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, name.replace(" ", "_") + ".log"), "wb")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_ready(session: aiohttp.ClientSession, target: Target, proc: subprocess.Popen | None,
                     timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{target.name} exited with {proc.returncode}")
        try:
            async with session.post(target.url + ROUTE, data=b'{"messages": [{"role": "user", "content": "hi"}]}',
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{target.name} not ready after {timeout}s")
        await asyncio.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc): CPU spent, whatever else the machine is doing."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(session: aiohttp.ClientSession, target: Target, args: argparse.Namespace, offset: int) -> None:
    url = target.url + ROUTE
    serial = await run_load(session, url, args.serial_requests, 1, args.stream, offset)
    cpu = cpu_seconds(target.pid) if target.pid else 0.0
    loaded = await run_load(session, url, args.requests, args.concurrency, args.stream, offset + 10**6)
    if target.pid:
        target.cpu_us.append((cpu_seconds(target.pid) - cpu) / args.requests * 1e6)
    target.results.append((serial, loaded))


async def run_mode(mode: str, args: argparse.Namespace, procs: Processes) -> list[Target]:
    ports = [free_port() for _ in range(1 if mode == "regular" else 2)]
    for i, port in enumerate(ports):
        procs.start(f"{mode}-backend{i}", [sys.executable, "-m", "baton.router.bench.backend", "--port", str(port)])
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    targets = targets_for(mode, backends, args)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for target in targets:
            proc = procs.start(f"{mode}-{target.name}", target.command) if target.command else None
            target.pid = proc.pid if proc is not None and os.path.exists("/proc") else None
            await wait_ready(session, target, proc)
            await run_load(session, target.url + ROUTE, args.warmup, min(args.concurrency, 8))  # warm caches
        for round_ in range(args.rounds):
            for target in targets:
                await measure(session, target, args, offset=round_ * 10**7)
    return targets


def summarize(mode: str, targets: list[Target], args: argparse.Namespace) -> str:
    def stat(t: Target, fn) -> float:
        return median([fn(serial, loaded) for serial, loaded in t.results])

    direct_p50 = stat(targets[0], lambda s, _: s.percentile(0.5))
    direct_p99 = stat(targets[0], lambda s, _: s.percentile(0.99))
    sglang = next((t for t in targets if t.name == "sglang-router"), None)
    sglang_rps = stat(sglang, lambda _, loaded: loaded.rps) if sglang else float("nan")
    lines = [f"### {mode} (concurrency {args.concurrency}, medians of {args.rounds} rounds)", "",
             f"| target | req/s @ c={args.concurrency} | p50 @ c=1 (ms) | p99 @ c=1 (ms) | added p50 (ms) "
             f"| added p99 (ms) | req/s vs sglang-router | router CPU/request (µs) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        rps = stat(t, lambda _, loaded: loaded.rps)
        p50, p99 = stat(t, lambda s, _: s.percentile(0.5)), stat(t, lambda s, _: s.percentile(0.99))
        errors = sum(serial.errors + loaded.errors for serial, loaded in t.results)
        added = "—" if t.name == "direct" else f"{(p50 - direct_p50) * 1e3:.3f}"
        added99 = "—" if t.name == "direct" else f"{(p99 - direct_p99) * 1e3:.3f}"
        ratio = f"{rps / sglang_rps:.2f}x" if sglang and t.name != "direct" else "—"
        cpu = f"{median(t.cpu_us):.0f}" if t.cpu_us else "—"
        lines.append(f"| {t.name} | {rps:,.0f} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {added} | {added99} "
                     f"| {ratio} | {cpu} | {errors} |")
    return "\n".join(lines)


def environment() -> str:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"
    return (f"python {platform.python_version()}, {os.cpu_count()} CPUs, aiohttp {version('aiohttp')}, "
            f"uvloop {version('uvloop')}, sglang-router {version('sglang-router')}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m baton.router.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["regular", "pd", "both"], default="both")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3000, help="per target per round, at --concurrency")
    parser.add_argument("--serial-requests", type=int, default=1000, help="per target per round, at concurrency 1")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="cache_aware", help="the same policy for both routers")
    parser.add_argument("--stream", action="store_true", help="ask for SSE streams")
    parser.add_argument("--no-sglang", action="store_true", help="skip sglang-router (e.g. not installed)")
    parser.add_argument("--compare-upstream", action="store_true",
                        help="also run baton with --upstream-client aiohttp (the reference client)")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> str:
    modes = ["regular", "pd"] if args.mode == "both" else [args.mode]
    with tempfile.TemporaryDirectory(prefix="baton-router-bench-") as log_dir:
        procs = Processes(log_dir)
        try:
            reports = [summarize(mode, await run_mode(mode, args, procs), args) for mode in modes]
        except Exception:
            for name in sorted(os.listdir(log_dir)):
                with open(os.path.join(log_dir, name), "rb") as f:
                    print(f"--- {name}\n{f.read()[-2000:].decode(errors='replace')}", file=sys.stderr)
            raise
        finally:
            procs.stop_all()
    return "\n\n".join(reports)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop
        report = uvloop.run(main_async(args))
    except ImportError:
        report = asyncio.run(main_async(args))
    command = "python -m baton.router.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"{report}\n\ncommand: {command}\nenvironment: {environment()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
