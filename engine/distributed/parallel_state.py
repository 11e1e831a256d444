"""One tensor-parallel group: which shard this process holds, and the collectives its layers call.

A `TpGroup` is passed down the configuration chain (server args -> model runner -> model -> layers);
there is no process-wide state. With size 1 every collective is the identity and nothing is
initialised, so a single-process engine never touches torch.distributed.

Two process groups per TP group, as SGLang keeps them:
- the device group, for the all-reduces inside the forward: NCCL on CUDA, gloo on CPU;
- the CPU group (gloo), for what the scheduler's rank tells the others every step (step.py).
On CPU both are one gloo group, and its all-reduces and the step broadcasts go through a shared
memory segment instead (shm_group.py; `--tp-cpu-allreduce gloo` keeps gloo's).

The all-reduce is a torch op (`baton::tp_all_reduce`, registered in kernels/torch_ops.py): Dynamo
treats it as one opaque call, so a compiled forward keeps one graph, and on CUDA it is captured into
the decode graphs like any kernel (NCCL's all-reduce is graph-safe). The LM head's all-gather
(`baton::tp_all_gather`) is one too.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from baton.engine.kernels.torch_ops import define_op
from baton.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

# An idle engine's followers wait in a broadcast until the next step, for as long as nothing is sent.
# gloo would raise after its timeout, so it is long; a dead peer is noticed sooner (its socket
# closes), and the HTTP process's supervisor stops the engine when any of its processes ends.
IDLE_WAIT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TpGroup:
    rank: int = 0
    size: int = 1
    # torch.distributed group names (the op takes a string); None when size is 1
    device_group: Optional[str] = None
    cpu_group: Optional[str] = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"TP rank {self.rank} out of range for size {self.size}"

    @property
    def is_driver(self) -> bool:
        """The rank that runs the scheduler, samples, and tells the others what to run."""
        return self.rank == 0

    def shard(self, total: int, what: str = "size") -> int:
        """This rank's part of `total` (an even split; anything else is refused at start-up)."""
        if total % self.size:
            raise ValueError(f"{what} {total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds. With fewer KV heads than ranks each KV head is
        replicated on size // num_kv_heads consecutive ranks (as SGLang and vLLM do)."""
        if num_kv_heads >= self.size:
            n = self.shard(num_kv_heads, "num_key_value_heads")
            return self.rank * n, n
        if self.size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size {self.size} must be a multiple of num_key_value_heads "
                             f"({num_kv_heads}) when it exceeds it")
        return self.rank // (self.size // num_kv_heads), 1


def validate_tp(config: ModelConfig, tp_size: int) -> None:
    """Refuse, before any process starts, a checkpoint whose heads or MLP do not split over tp_size."""
    if tp_size == 1:
        return
    heads, kv = config.heads.num_heads, config.heads.num_kv_heads
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads})")
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        problems.append(f"num_key_value_heads ({kv})")
    moe, linear = config.moe, config.heads.linear
    sizes = {"intermediate_size": config.text.intermediate_size,
             "moe_intermediate_size": moe and moe.intermediate_size,
             "shared_expert_intermediate_size": moe and moe.shared_expert_intermediate_size,
             "linear_num_key_heads": linear and linear.num_key_heads,  # a hybrid's linear-attention layers
             "linear_num_value_heads": linear and linear.num_value_heads}
    for name, value in sizes.items():
        if value and value % tp_size:
            problems.append(f"{name} ({value})")
    if problems:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's " + ", ".join(problems))


CPU_ALLREDUCE = ("shm", "gloo")

# group name -> the shared memory segment of a CPU TP group this process belongs to (on CPU the
# device and CPU groups are one group)
_SHM: dict[str, Any] = {}


def init_tp_group(tp_rank: int, tp_size: int, init_addr: str, device: str, cpu_allreduce: str = "shm") -> TpGroup:
    """Join this model's TP group (every rank calls it; `init_addr` is host:port of the rendezvous).
    Returns TpGroup() without touching torch.distributed when tp_size is 1."""
    if tp_size == 1:
        return TpGroup()
    import torch.distributed as dist

    assert cpu_allreduce in CPU_ALLREDUCE, cpu_allreduce
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{init_addr}", world_size=tp_size,
                            rank=tp_rank, timeout=IDLE_WAIT)
    world = dist.group.WORLD
    cpu = dist.new_group(list(range(tp_size)), backend="gloo", timeout=IDLE_WAIT) if cuda else world
    tp = TpGroup(tp_rank, tp_size, world.group_name, cpu.group_name)
    if not cuda and cpu_allreduce == "shm":
        _join_shm_all_reduce(tp)
    logger.info("TP rank %d of %d joined (%s, all-reduce over %s)", tp_rank, tp_size, dist.get_backend(world),
                all_reduce_backend(tp))
    return tp


def _join_shm_all_reduce(tp: TpGroup) -> None:
    """Rank 0 makes the segment, every rank maps it; all ranks use it only if every rank could (a
    rank without it would wait in gloo for the others forever), else all keep gloo."""
    import torch.distributed as dist

    from baton.engine.distributed import shm_group

    made, shm, why = None, None, shm_group.unavailable_reason()
    if tp.is_driver and why is None:
        made = shm_group.new_segment_path()
        why = None if made else f"no writable {shm_group.SHM_DIR}"
        if made is not None:
            try:  # made before its path is sent: a follower opens an existing file
                shm = shm_group.ShmGroup(made, tp.rank, tp.size, create=True)
            except OSError as e:
                why = f"{made}: {e}"
    box = [made if shm is not None else None]
    dist.broadcast_object_list(box, src=0, group=resolve_group(tp.cpu_group))
    path = box[0]
    if not tp.is_driver and path is not None and why is None:
        try:
            shm = shm_group.ShmGroup(path, tp.rank, tp.size)
        except OSError as e:
            why = f"{path}: {e}"
    ok = all_reduce_min(int(shm is not None), tp)  # also: every rank has mapped the file by now
    if made is not None and os.path.exists(made):
        os.unlink(made)  # the mappings stay; nothing is left in /dev/shm if a rank dies
    if ok:
        _SHM[tp.device_group] = shm
    elif tp.is_driver or why:
        logger.warning("TP all-reduce stays on gloo: %s", why or "another rank could not map the shared memory")


def shm_group_of(group_name: Optional[str]) -> Any:
    """The shared memory segment that carries this group's collectives, or None (gloo, NCCL)."""
    return _SHM.get(group_name) if group_name else None


def all_reduce_backend(tp: TpGroup) -> str:
    """What the forward's all-reduces go through: "shm", "gloo", "nccl", or "none" without TP."""
    if tp.size == 1:
        return "none"
    if tp.device_group in _SHM:
        return "shm"
    import torch.distributed as dist

    return str(dist.get_backend(resolve_group(tp.device_group)))


def destroy_tp_group(tp: TpGroup) -> None:
    if tp.size > 1:
        import torch.distributed as dist

        _SHM.pop(tp.device_group, None)
        if dist.is_initialized():
            dist.destroy_process_group()


def resolve_group(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _tp_all_reduce_impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
    import torch.distributed as dist

    shm = _SHM.get(group_name)
    if shm is not None and shm.supports(x):
        return shm.all_reduce(x)
    out = x.clone()
    dist.all_reduce(out, group=resolve_group(group_name))
    return out


define_op("tp_all_reduce", "(Tensor x, str group_name) -> Tensor", _tp_all_reduce_impl,
          lambda x, group_name: torch.empty_like(x), dispatch_key="CompositeExplicitAutograd")
_tp_all_reduce = torch.ops.baton.tp_all_reduce.default


def all_reduce(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """The sum of x over the TP group (x itself when the group is one rank)."""
    if tp.size == 1:
        return x
    return _tp_all_reduce(x, tp.device_group)


def _tp_all_gather_impl(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    import torch.distributed as dist

    shm = _SHM.get(group_name)
    if shm is not None and shm.supports(x):
        return shm.all_gather(x)
    x = x.contiguous()
    out = x.new_empty((size, *x.shape))
    group = resolve_group(group_name)
    if x.device.type == "cuda":
        dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=group)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


define_op("tp_all_gather", "(Tensor x, str group_name, int size) -> Tensor", _tp_all_gather_impl,
          lambda x, group_name, size: x.new_empty((size, *x.shape)), dispatch_key="CompositeExplicitAutograd")
_tp_all_gather = torch.ops.baton.tp_all_gather.default


def all_gather_last_dim(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """[m, n] on each rank -> [m, size * n], the ranks' columns side by side in rank order (x
    itself when the group is one rank)."""
    if tp.size == 1:
        return x
    m, n = x.shape
    return _tp_all_gather(x, tp.device_group, tp.size).permute(1, 0, 2).reshape(m, tp.size * n)


def all_reduce_min(value: int, tp: TpGroup) -> int:
    """The smallest of each rank's `value` (e.g. KV pool sizes: every shard must hold the same slots)."""
    if tp.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=resolve_group(tp.cpu_group))
    return int(t.item())


def all_gather_object(obj: Any, tp: TpGroup) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, over the CPU group (ViT DP's embeddings)."""
    import torch.distributed as dist

    out: list[Any] = [None] * tp.size
    dist.all_gather_object(out, obj, group=resolve_group(tp.cpu_group))
    return out


def broadcast_object(obj: Any, tp: TpGroup) -> Any:
    """The driver's `obj` on every rank (the driver passes it, the others anything)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=resolve_group(tp.cpu_group))
    return box[0]
