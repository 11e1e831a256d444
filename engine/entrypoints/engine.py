"""Launch one engine: scheduler and detokenizer processes, then the HTTP server in this process."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass
from typing import Any, Callable, Optional

from baton.engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Weight loading of a large checkpoint can take minutes.
STARTUP_TIMEOUT_S = 1800


@dataclass
class EngineProcesses:
    schedulers: list[mp.Process]  # one per DP rank
    detokenizer: mp.Process
    scheduler_info: dict[str, Any]  # rank 0's ready report
    scheduler_addrs: list[str]  # where each rank receives requests
    tokenizer_addr: str
    cpu_plan: Any = None  # utils.cpu_affinity.CpuPlan, or None when not binding
    prepared: Any = None  # what launch_subprocesses' while_starting returned

    def _named(self) -> list[tuple[str, mp.Process]]:
        dp = len(self.schedulers)
        return [(scheduler_name(i, dp), p) for i, p in enumerate(self.schedulers)] + [("detokenizer", self.detokenizer)]

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


def scheduler_name(rank: int, dp_size: int) -> str:
    """How logs and errors name a scheduler process."""
    return "scheduler" if dp_size == 1 else f"scheduler (DP rank {rank})"


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


def _wait_ready(name: str, pipe: Any, proc: mp.Process) -> Any:
    if not pipe.poll(STARTUP_TIMEOUT_S):
        raise RuntimeError(f"the {name} did not start within {STARTUP_TIMEOUT_S}s")
    status, payload = pipe.recv()
    if status != "ready":
        raise RuntimeError(f"the {name} failed to start:\n{payload}")
    return payload


def launch_subprocesses(server_args: ServerArgs, while_starting: Optional[Callable[[], Any]] = None) -> EngineProcesses:
    """Start the scheduler(s) (one per DP rank) and the detokenizer, and wait until all are ready.
    `while_starting` runs in between (the front end's own start-up: imports, tokenizer), its result
    in procs.prepared."""
    from baton.engine.detokenizer import run_detokenizer_process
    from baton.engine.scheduler.event_loop import run_scheduler_process
    from baton.engine.utils.cpu_affinity import plan_binding
    from baton.engine.utils.process import ipc_names

    dp = server_args.dp_size
    *scheduler_addrs, detok_addr, tokenizer_addr = ipc_names(dp + 2)
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or torch threads
    cpu_plan = plan_binding(server_args.cpu_omp_threads_bind)
    schedulers, sched_pipes = [], []
    for rank, addr in enumerate(scheduler_addrs):
        r, w = ctx.Pipe(duplex=False)
        sched_pipes.append(r)
        schedulers.append(ctx.Process(target=run_scheduler_process, name=f"baton-scheduler-{rank}", daemon=True,
                                      args=(server_args, addr, detok_addr, w, cpu_plan, rank)))
    detok_r, detok_w = ctx.Pipe(duplex=False)
    detokenizer = ctx.Process(target=run_detokenizer_process, name="baton-detokenizer", daemon=True,
                              args=(server_args.tokenizer_path or server_args.model_path, detok_addr,
                                    tokenizer_addr, server_args.log_level, detok_w, cpu_plan))
    for proc in schedulers:
        proc.start()
    detokenizer.start()
    procs = EngineProcesses(schedulers, detokenizer, {}, scheduler_addrs, tokenizer_addr, cpu_plan)
    try:
        if while_starting is not None:
            procs.prepared = while_starting()
        _wait_ready("detokenizer", detok_r, detokenizer)
        infos = [_wait_ready(scheduler_name(rank, dp), pipe, proc)
                 for rank, (pipe, proc) in enumerate(zip(sched_pipes, schedulers))]
        procs.scheduler_info = infos[0]
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

    # uvicorn answers SIGTERM (what Kubernetes sends) by closing the listener and letting running
    # requests finish, then raises the signal again once it has drained. Turning that into SystemExit
    # stops the scheduler and detokenizer below and exits 0, instead of dying by the signal midway.
    signal.signal(signal.SIGTERM, _exit_after_drain)
    procs = launch_subprocesses(server_args, while_starting=front_end_start_up)
    bind_frontend(procs.cpu_plan)  # after the spawns: the scheduler must not inherit the frontend's CPUs
    try:
        import uvicorn

        from baton.engine.entrypoints.http_server import ApiContext, create_app
        from baton.engine.metrics import EngineMetrics
        from baton.engine.tokenizer_manager import TokenizerManager

        info, tokenizer = procs.scheduler_info, procs.prepared
        role = "colocated" if server_args.disaggregation_mode == "null" else server_args.disaggregation_mode
        tm = TokenizerManager(tokenizer, procs.scheduler_addrs, procs.tokenizer_addr,
                              EngineMetrics(server_args.model_name, role), info["vocab_size"], info["context_length"],
                              load_balance_method=server_args.load_balance_method,
                              disaggregation_mode=server_args.disaggregation_mode)
        model_info = {"model_path": server_args.model_path, "tokenizer_path": server_args.tokenizer_path,
                      "served_model_name": server_args.model_name, "is_generation": True}
        ctx = ApiContext(server_args, tm, model_info, procs.alive,
                         extra={"dp_size": server_args.dp_size, "tp_size": server_args.tp_size})
        app = create_app(ctx)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level if server_args.log_level != "info" else "warning",
                                timeout_keep_alive=30)
        server = uvicorn.Server(config)
        logger.info("serving %s on http://%s:%d", server_args.model_name, server_args.host, server_args.port)
        died: list[str] = []

        async def serve() -> None:
            watch = asyncio.create_task(supervise(procs, tm, server))
            try:
                await server.serve()
            finally:
                if watch.done() and not watch.cancelled():
                    died.append(watch.result())
                watch.cancel()

        _run_event_loop(serve())
        if died:
            raise SystemExit(1)
    finally:
        procs.shutdown()
