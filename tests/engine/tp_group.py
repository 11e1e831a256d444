"""A tensor-parallel group for in-process scheduler tests: rank 0 (the driver) is this process,
ranks 1.. are spawned follower processes running the real follower entry point.

    with tp_followers(ServerArgs(model_path=p, tp_size=2, ...)) as tp:
        h = SchedulerHarness(p, tp=tp, tp_size=2, ...)   # same server args on every rank
        ...
        h.scheduler.close()                               # releases the followers
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Iterator

from baton.engine.distributed.parallel_state import TpGroup, destroy_tp_group, init_tp_group
from baton.engine.scheduler.event_loop import run_tp_follower_process
from baton.engine.server_args import ServerArgs
from baton.engine.utils.process import free_port

JOIN_TIMEOUT_S = 60


@contextlib.contextmanager
def tp_followers(args: ServerArgs) -> Iterator[TpGroup]:
    """Join rank 0 of a TP group of args.tp_size here, with the other ranks in child processes.
    On exit the children must have left their step loop (the driver's scheduler.close()); any
    still running are killed and the test fails."""
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    procs, pipes = [], []
    for rank in range(1, args.tp_size):
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_tp_follower_process, args=(args, 0, rank, addr, w), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(r)
    tp = None
    try:
        tp = init_tp_group(0, args.tp_size, addr, args.device, args.tp_cpu_allreduce)
        # no waiting for the followers' ready reports here: their start-up (compile warm-up, pool
        # sizing) runs collectives that meet the driver's own start-up, which comes next
        yield tp
        for pipe in pipes:
            assert pipe.poll(JOIN_TIMEOUT_S), "a follower never reported its start-up"
            status, payload = pipe.recv()
            assert status == "ready", payload
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
        codes = [proc.exitcode for proc in procs]
        assert codes == [0] * len(procs), f"followers did not stop cleanly: exit codes {codes}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        if tp is not None:
            destroy_tp_group(tp)
