"""Launch one engine: scheduler and detokenizer processes, then the HTTP server in this process."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from baton.engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Weight loading of a large checkpoint can take minutes.
STARTUP_TIMEOUT_S = 1800


@dataclass
class EngineProcesses:
    schedulers: list[mp.Process]  # one per DP rank (with TP: the group's rank 0)
    detokenizer: mp.Process
    scheduler_info: dict[str, Any]  # rank 0's ready report
    scheduler_addrs: list[str]  # where each rank receives requests
    tokenizer_addr: str
    cpu_plan: Any = None  # utils.cpu_affinity.CpuPlan, or None when not binding
    prepared: Any = None  # what launch_subprocesses' while_starting returned
    followers: list[tuple[str, mp.Process]] = field(default_factory=list)  # TP ranks > 0, named
    ipc_dir: Optional[str] = None  # where the IPC sockets live; removed at shutdown

    def _named(self) -> list[tuple[str, mp.Process]]:
        dp = len(self.schedulers)
        return ([(scheduler_name(i, dp), p) for i, p in enumerate(self.schedulers)] + self.followers
                + [("detokenizer", self.detokenizer)])

    def alive(self) -> bool:
        return self.exited() is None

    def exited(self) -> Optional[str]:
        """How the first child process that is no longer running ended; None while all run."""
        for name, proc in self._named():
            if not proc.is_alive():
                return f"the {name} process {describe_exit(proc.exitcode)}"
        return None

    def shutdown(self) -> None:
        procs = [p for _, p in self._named()]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def scheduler_name(rank: int, dp_size: int) -> str:
    """How logs and errors name a scheduler process."""
    return "scheduler" if dp_size == 1 else f"scheduler (DP rank {rank})"


def follower_name(dp_rank: int, dp_size: int, tp_rank: int) -> str:
    """How logs and errors name a TP rank > 0 (it holds a shard and runs the scheduler's steps)."""
    return f"TP rank {tp_rank}" + ("" if dp_size == 1 else f" of DP rank {dp_rank}")


def tp_init_addrs(server_args: ServerArgs) -> list[Optional[str]]:
    """Each DP replica's TP rendezvous (None without TP): --nccl-port + DP rank, else free ports."""
    from baton.engine.utils.process import free_port

    if server_args.tp_size == 1:
        return [None] * server_args.dp_size
    base = server_args.nccl_port
    return [f"127.0.0.1:{base + d if base is not None else free_port()}" for d in range(server_args.dp_size)]


def describe_exit(code: int) -> str:
    """A finished process's exit code in words (negative: the signal that killed it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
    return f"exited with code {code}"


# How often the HTTP process checks that its scheduler and detokenizer still run (s).
SUPERVISE_INTERVAL_S = 0.5


async def supervise(procs: "EngineProcesses", tm: Any, server: Any) -> Optional[str]:
    """Until a child process ends: then fail every request in flight (503, at once: nothing would
    ever answer them), refuse new ones, stop the HTTP server and return why. A container whose
    scheduler died (the OOM killer's usual pick, a crash, the watchdog) thus exits and is restarted,
    instead of staying up with a TCP liveness probe that still passes."""
    while (reason := procs.exited()) is None:
        await asyncio.sleep(SUPERVISE_INTERVAL_S)
    logger.error("%s: failing %d request(s) in flight and stopping the server", reason, len(tm.states))
    tm.fail_all(f"the engine stopped: {reason}")
    server.should_exit = True
    return reason


def _wait_all_ready(named_pipes: list[tuple[str, Any]]) -> dict[str, Any]:
    """Each process's ready report, by name. The first failure raises at once: the others may be
    waiting for it (a TP group's rendezvous), so waiting on them in turn could never end."""
    from multiprocessing.connection import wait

    pending, infos = dict(named_pipes), {}
    by_pipe = {id(pipe): name for name, pipe in named_pipes}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while pending:
        ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(f"the {', '.join(pending)} did not start within {STARTUP_TIMEOUT_S}s")
        for pipe in ready:
            name = by_pipe[id(pipe)]
            try:
                status, payload = pipe.recv()
            except EOFError:  # it died before reporting
                status, payload = "error", "the process ended without reporting (killed?)"
            if status != "ready":
                raise RuntimeError(f"the {name} failed to start:\n{payload}")
            infos[name] = payload
            del pending[name]
    return infos


def launch_subprocesses(server_args: ServerArgs, while_starting: Optional[Callable[[], Any]] = None) -> EngineProcesses:
    """Start the scheduler(s) (one per DP rank) and the detokenizer, and wait until all are ready.
    `while_starting` runs in between (the front end's own start-up: imports, tokenizer), its result
    in procs.prepared."""
    from baton.engine.detokenizer import run_detokenizer_process
    from baton.engine.scheduler.event_loop import run_scheduler_process, run_tp_follower_process
    from baton.engine.utils.cpu_affinity import plan_binding
    from baton.engine.utils.process import ipc_names

    dp = server_args.dp_size
    ipc_dir, (*scheduler_addrs, detok_addr, tokenizer_addr) = ipc_names(dp + 2)
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or torch threads
    cpu_plan = plan_binding(server_args.cpu_omp_threads_bind)
    schedulers, sched_pipes, followers, follower_pipes = [], [], [], []
    for rank, (addr, tp_addr) in enumerate(zip(scheduler_addrs, tp_init_addrs(server_args))):
        r, w = ctx.Pipe(duplex=False)
        sched_pipes.append(r)
        schedulers.append(ctx.Process(target=run_scheduler_process, name=f"baton-scheduler-{rank}", daemon=True,
                                      args=(server_args, addr, detok_addr, w, cpu_plan, rank, tp_addr)))
        for tp_rank in range(1, server_args.tp_size):
            r, w = ctx.Pipe(duplex=False)
            follower_pipes.append(r)
            followers.append((follower_name(rank, dp, tp_rank), ctx.Process(
                target=run_tp_follower_process, name=f"baton-tp-{rank}-{tp_rank}", daemon=True,
                args=(server_args, rank, tp_rank, tp_addr, w, cpu_plan))))
    detok_r, detok_w = ctx.Pipe(duplex=False)
    detokenizer = ctx.Process(target=run_detokenizer_process, name="baton-detokenizer", daemon=True,
                              args=(server_args.tokenizer_path or server_args.model_path, detok_addr,
                                    tokenizer_addr, server_args.log_level, detok_w, cpu_plan))
    for proc in schedulers + [p for _, p in followers]:
        proc.start()
    detokenizer.start()
    procs = EngineProcesses(schedulers, detokenizer, {}, scheduler_addrs, tokenizer_addr, cpu_plan,
                            followers=followers, ipc_dir=ipc_dir)
    try:
        if while_starting is not None:
            procs.prepared = while_starting()
        named = ([("detokenizer", detok_r)] + [(scheduler_name(rank, dp), pipe) for rank, pipe in enumerate(sched_pipes)]
                 + [(name, pipe) for (name, _), pipe in zip(followers, follower_pipes)])
        infos = _wait_all_ready(named)
        procs.scheduler_info = infos[scheduler_name(0, dp)]
    except BaseException:
        procs.shutdown()
        raise
    return procs


def _run_event_loop(main) -> None:
    """uvloop when installed (its C transports halve the HTTP process's cost per streamed chunk:
    a py-spy profile of a served benchmark had 38% of that process in asyncio's socket write)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _exit_after_drain(signum: int, frame: Any) -> None:
    logger.info("SIGTERM: stopped; shutting the engine down")
    raise SystemExit(0)


def run_server(server_args: ServerArgs) -> None:
    from baton.engine.utils.cpu_affinity import bind_frontend

    def front_end_start_up():  # while the scheduler loads the model: ~3 s of a CPU start on this VM
        import uvicorn  # noqa: F401
        from transformers import AutoTokenizer

        import baton.engine.entrypoints.http_server  # noqa: F401
        import baton.engine.tokenizer_manager  # noqa: F401

        tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path)
        if server_args.chat_template:
            with open(server_args.chat_template) as f:
                tokenizer.chat_template = f.read()
        return tokenizer

    # SIGTERM (what Kubernetes sends) drains (drain.py): not ready, new generations refused with a
    # retriable 503, running requests finish; then the server stops and uvicorn raises the signal
    # again. Turning that into SystemExit stops the scheduler and detokenizer below and exits 0,
    # instead of dying by the signal midway.
    signal.signal(signal.SIGTERM, _exit_after_drain)
    procs = launch_subprocesses(server_args, while_starting=front_end_start_up)
    bind_frontend(procs.cpu_plan)  # after the spawns: the scheduler must not inherit the frontend's CPUs
    try:
        import uvicorn

        from baton.engine.entrypoints.drain import DrainingServer, stop_when_idle
        from baton.engine.entrypoints.head_deadline import head_deadline_protocol
        from baton.engine.entrypoints.http_common import ApiContext
        from baton.engine.entrypoints.http_server import create_app
        from baton.engine.metrics import EngineMetrics
        from baton.engine.tokenizer_manager import SSE_KEEPALIVE_S, TokenizerManager

        info, tokenizer = procs.scheduler_info, procs.prepared
        role = "colocated" if server_args.disaggregation_mode == "null" else server_args.disaggregation_mode
        tm = TokenizerManager(tokenizer, procs.scheduler_addrs, procs.tokenizer_addr,
                              EngineMetrics(server_args.model_name, role), info["vocab_size"], info["context_length"],
                              load_balance_method=server_args.load_balance_method,
                              disaggregation_mode=server_args.disaggregation_mode,
                              keepalive_s=float(os.environ.get("BATON_SSE_KEEPALIVE_S", SSE_KEEPALIVE_S)),
                              allow_auto_truncate=server_args.allow_auto_truncate)
        _enable_images(tm, server_args)
        model_info = {"model_path": server_args.model_path, "tokenizer_path": server_args.tokenizer_path,
                      "served_model_name": server_args.model_name, "is_generation": not server_args.is_embedding}
        ctx = ApiContext(server_args, tm, model_info, procs.alive,
                         extra={"dp_size": server_args.dp_size, "tp_size": server_args.tp_size,
                                "tp_follower_pids": [p.pid for _, p in procs.followers]})
        app = create_app(ctx)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level if server_args.log_level != "info" else "warning",
                                timeout_keep_alive=30, http=head_deadline_protocol(server_args.request_read_timeout))
        server = DrainingServer(config, ctx.drain)
        logger.info("serving %s on http://%s:%d", server_args.model_name, server_args.host, server_args.port)
        died: list[str] = []

        async def serve() -> None:
            watch = asyncio.create_task(supervise(procs, tm, server))
            drained = asyncio.create_task(stop_when_idle(ctx.drain, tm, server))
            try:
                await server.serve()
            finally:
                if watch.done() and not watch.cancelled():
                    died.append(watch.result())
                watch.cancel()
                drained.cancel()

        _run_event_loop(serve())
        if died:
            raise SystemExit(1)
    finally:
        procs.shutdown()


def _enable_images(tm: Any, server_args: ServerArgs) -> None:
    """A vision-language checkpoint: the tokenizer manager takes images."""
    if not os.path.isdir(server_args.model_path):
        return
    from baton.engine.model_config import ModelConfig

    vision = ModelConfig.from_pretrained(server_args.model_path).vision
    if vision is None:
        return
    from baton.engine.multimodal.media import MediaPolicy
    from baton.engine.multimodal.processor import ImageProcessor

    tm.enable_images(ImageProcessor(server_args.model_path, vision, tm.vocab_size), server_args.view(MediaPolicy),
                     server_args.mm_max_concurrent_calls, server_args.mm_encoder_max_patches)

