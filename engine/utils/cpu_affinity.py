"""CPU binding for CPU serving (`--cpu-omp-threads-bind`, as vLLM's and SGLang's CPU backends do).

On a CPU box the forward pass's OpenMP threads share the cores with the HTTP server, the
detokenizer and often the client. An OpenMP region waits for its slowest thread, so one thread
preempted by a streaming write stalls the whole step. Binding gives the scheduler process (the
forward pass) its own cores, one torch thread each, and the frontend processes the rest:

    off       no binding (the default): torch picks its thread count, the OS places everything
    auto      the last CPU of this process's affinity set for the frontend, all others for the
              scheduler (needs at least 2 CPUs; otherwise off, with a log line)
    CPULIST   e.g. "0-6" or "0,2,4-5": the scheduler's CPUs; the remaining CPUs of the affinity set
              go to the frontend (none remaining: the frontend is left unbound)
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPlan:
    scheduler: tuple[int, ...]  # CPUs of the scheduler process; torch runs one thread per CPU
    frontend: tuple[int, ...]  # CPUs of the HTTP server and detokenizer; empty = unbound


def parse_cpu_list(spec: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: expected e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU list {spec!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_binding(spec: str, available: Optional[list[int]] = None) -> Optional[CpuPlan]:
    """The binding `spec` asks for on these CPUs, or None for no binding. ValueError when a listed
    CPU is not available to this process."""
    if spec == "off":
        return None
    available = sorted(available if available is not None else available_cpus())
    if spec == "auto":
        if len(available) < 2:
            logger.info("--cpu-omp-threads-bind auto: only %d CPU available, not binding", len(available))
            return None
        return CpuPlan(tuple(available[:-1]), (available[-1],))
    wanted = parse_cpu_list(spec)
    missing = sorted(set(wanted) - set(available))
    if missing:
        raise ValueError(f"--cpu-omp-threads-bind {spec}: CPUs {missing} are not available to this process "
                         f"(available: {available})")
    return CpuPlan(tuple(wanted), tuple(c for c in available if c not in wanted))


def rank_cpus(cpus: tuple[int, ...], dp_rank: int, dp_size: int) -> tuple[int, ...]:
    """DP rank `dp_rank`'s share of the scheduler CPUs: contiguous, as even as the count allows;
    with fewer CPUs than ranks, ranks share them round-robin."""
    if dp_size <= 1:
        return cpus
    if len(cpus) < dp_size:
        return (cpus[dp_rank % len(cpus)],)
    base, extra = divmod(len(cpus), dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return cpus[start:start + base + (dp_rank < extra)]


def bind_scheduler(plan: Optional[CpuPlan], dp_rank: int = 0, dp_size: int = 1) -> None:
    """In a scheduler process, before the model runs: pin it and size torch's thread pool. With
    several DP ranks each takes its share of the CPUs; unbound, each still sizes its thread pool to
    its share, so the ranks' OpenMP teams do not oversubscribe the machine."""
    import torch

    if plan is None:
        if dp_size > 1:
            torch.set_num_threads(max(1, len(available_cpus()) // dp_size))
        return
    cpus = rank_cpus(plan.scheduler, dp_rank, dp_size)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("scheduler bound to CPUs %s (%d torch threads)", list(cpus), len(cpus))


def bind_frontend(plan: Optional[CpuPlan]) -> None:
    """In the HTTP server and the detokenizer (after the scheduler has been spawned)."""
    if plan is not None and plan.frontend:
        os.sched_setaffinity(0, plan.frontend)
