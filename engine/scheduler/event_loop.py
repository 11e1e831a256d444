"""The scheduler process's loops and its ZMQ plumbing.

Plain loop:    schedule N -> run N -> process N
Overlap loop:  schedule N+1 -> launch N+1 -> process N   (the CPU work on N's results overlaps the
               forward of N+1; tokens of N reach N+1 through the worker's future map)
Both produce identical outputs; tests compare them.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Optional

import zmq

from baton.engine.scheduler.scheduler import Scheduler
from baton.engine.scheduler.watchdog import Watchdog
from baton.engine.server_args import ServerArgs

if TYPE_CHECKING:
    from baton.engine.utils.cpu_affinity import CpuPlan

logger = logging.getLogger(__name__)

# How long an idle scheduler blocks in recv before running periodic work (ms).
IDLE_POLL_MS = 1000
# How long a scheduler that only waits on background work (PD KV transfers, grammar compiles) blocks
# in recv (ms), instead of spinning.
BACKGROUND_POLL_MS = 1


class SchedulerIO:
    def __init__(self, ctx: zmq.Context, recv_addr: str, send_addr: str) -> None:
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(recv_addr)
        self.send = ctx.socket(zmq.PUSH)
        self.send.connect(send_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)

    def recv_requests(self, block: bool, timeout_ms: int = IDLE_POLL_MS) -> list[Any]:
        msgs: list[Any] = []
        if block and not self.poller.poll(timeout_ms):
            return msgs
        while True:
            try:
                msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def flush(self, scheduler: Scheduler) -> None:
        for msg in scheduler.outbox:
            self.send.send_pyobj(msg)
        scheduler.outbox.clear()


def event_loop(scheduler: Scheduler, io: SchedulerIO, watchdog: Optional[Watchdog] = None) -> None:
    while True:
        if watchdog is not None:
            watchdog.tick()
        waits_in_background = scheduler.pd.polls_in_background or scheduler.grammar_queue
        if scheduler.ops.holds_steps():  # paused or memory released: nothing runs until a control message
            msgs = io.recv_requests(block=True)
        elif waits_in_background and scheduler.last_batch is None and not scheduler.is_idle():
            # only background work (KV transfers, grammar compiles) to wait for: block briefly
            msgs = io.recv_requests(block=True, timeout_ms=BACKGROUND_POLL_MS)
        else:
            msgs = io.recv_requests(block=scheduler.is_idle())
        scheduler.process_input_requests(msgs)
        scheduler.run_step()
        io.flush(scheduler)


def _start_process(server_args: ServerArgs, dp_rank: int, tp_rank: int, cpu_plan: Optional["CpuPlan"]) -> None:
    """What every engine process that holds a model shard does first: die with its parent, log
    under its name, take its CPUs (or its GPU)."""
    from baton.engine.utils.cpu_affinity import bind_scheduler
    from baton.engine.utils.logging import configure_logging
    from baton.engine.utils.process import die_with_parent

    die_with_parent()
    dp, tp = server_args.dp_size, server_args.tp_size
    name = "scheduler" if tp_rank == 0 else f"TP{tp_rank}"
    configure_logging(server_args.log_level, prefix=f"{name} DP{dp_rank}" if dp > 1 else name)
    bind_scheduler(cpu_plan, dp_rank * tp + tp_rank, dp * tp)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    if server_args.device.startswith("cuda") and dp * tp > 1:
        import torch

        torch.cuda.set_device(server_args.gpu_id(dp_rank, tp_rank))  # "cuda" means this process's GPU from here


def run_scheduler_process(server_args: ServerArgs, recv_addr: str, send_addr: str, ready_pipe: Any,
                          cpu_plan: Optional["CpuPlan"] = None, dp_rank: int = 0,
                          tp_init_addr: Optional[str] = None) -> None:
    """Entry point of a scheduler process (one per DP rank; with TP, the group's rank 0, which joins
    the group at `tp_init_addr`). Reports ("ready", info) or ("error", text) on ready_pipe."""
    from baton.engine.distributed.parallel_state import init_tp_group
    from baton.engine.utils.logging import format_phases
    from baton.engine.utils.process import process_age_s

    _start_process(server_args, dp_rank, 0, cpu_plan)
    try:
        from transformers import AutoTokenizer

        start, spawn_s = time.perf_counter(), process_age_s()  # interpreter + imports before this point
        tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path)
        tokenizer_s = time.perf_counter() - start
        tp = init_tp_group(0, server_args.tp_size, tp_init_addr, server_args.device,  # TpGroup() without TP
                           server_args.tp_cpu_allreduce)
        scheduler = Scheduler(server_args, tokenizer, dp_rank=dp_rank, tp=tp)
        if scheduler.overlap is not None:  # the CPU forward stream takes this thread's OpenMP team
            scheduler.overlap.hand_over_openmp()
        io = SchedulerIO(zmq.Context(2), recv_addr, send_addr)
        grammar_start = time.perf_counter()
        if scheduler.grammar_backend is not None:  # ready means full speed: not while it holds the GIL
            scheduler.grammar_backend.wait_prepared()
        grammar_s = time.perf_counter() - grammar_start
    except Exception:
        ready_pipe.send(("error", traceback.format_exc()))
        return
    scheduler.startup_s = {"spawn": round(spawn_s, 3), "tokenizer": round(tokenizer_s, 3), **scheduler.startup_s,
                           "grammar": round(grammar_s, 3), "total": round(time.perf_counter() - start + spawn_s, 3)}
    logger.info("ready: %s", format_phases(scheduler.startup_s))
    ready_pipe.send(("ready", {**scheduler.get_server_info(), "vocab_size": scheduler.vocab_size}))
    watchdog = Watchdog(server_args.watchdog_timeout).start() if server_args.watchdog_timeout > 0 else None
    try:
        event_loop(scheduler, io, watchdog)
    except Exception:
        # the HTTP process's supervisor sees this process end: it fails the requests in flight and exits
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)


def run_tp_follower_process(server_args: ServerArgs, dp_rank: int, tp_rank: int, tp_init_addr: str,
                            ready_pipe: Any, cpu_plan: Optional["CpuPlan"] = None) -> None:
    """Entry point of a TP rank > 0: load this rank's shard, then run the steps the group's
    scheduler sends (worker/tp_step.py) until it says stop. Reports on ready_pipe like a
    scheduler; a failure ends the process with 1, which stops the engine."""
    from baton.engine.distributed.parallel_state import init_tp_group
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.worker.tp_step import StepReceiver

    _start_process(server_args, dp_rank, tp_rank, cpu_plan)
    try:
        tp = init_tp_group(tp_rank, server_args.tp_size, tp_init_addr, server_args.device, server_args.tp_cpu_allreduce)
        runner = ModelRunner(server_args, tp)
        kv = None
        from baton.engine.disaggregation.colocated import DisaggregationMode

        if DisaggregationMode(server_args.disaggregation_mode) is not DisaggregationMode.NULL:
            from baton.engine.disaggregation.tp_fanout import FollowerKVService  # each rank moves its KV shard

            kv = FollowerKVService.join(runner, tp)
    except Exception:
        ready_pipe.send(("error", traceback.format_exc()))
        return
    ready_pipe.send(("ready", {"tp_rank": tp_rank}))
    try:
        steps = StepReceiver(tp, runner).run()
    except Exception:
        logger.error("TP rank %d crashed:\n%s", tp_rank, traceback.format_exc())
        sys.exit(1)
    if kv is not None:
        kv.close()
    logger.info("TP rank %d: stopped after %d steps", tp_rank, steps)
    # Leave without tearing the process group down: gloo's teardown, at destroy or at interpreter
    # exit, races the peer's sockets closing and can std::terminate (SIGABRT) a finished process.
    logging.shutdown()
    os._exit(0)
