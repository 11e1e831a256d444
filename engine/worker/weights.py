"""Weight operations on every rank of a TP group: updates, the weight-update group, reads.

Updates come from disk, from tensors, or over a weight-update group.

The driver sends each operation to the followers as a TP step command (tp_step.py StepSender.
send_weights), then runs it itself; each follower runs it from its step loop. Every rank loads its
own shard (the model's load_weights shards full tensors by the rank), so every rank gets the full
tensors: from the checkpoint's files, from the tensors sent for its rank, or from the trainer's
broadcasts over the weight-update group (where the engine's TP rank r is rank rank_offset + r).

An update is checked on every rank before any rank writes (model_executor/weight_update.py), and
the ranks agree after each phase over the TP group's CPU group: one rank's refusal is the group's,
and no rank writes a weight unless every rank's check passed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import torch

from baton.engine.distributed import weight_group
from baton.engine.distributed.parallel_state import TpGroup, all_gather_object, resolve_group
from baton.engine.model_executor.weight_update import ModelWeights, WeightsError, meta_like
from baton.engine.utils.named_tensors import NamedTensorsError, deserialize_named_tensors

if TYPE_CHECKING:
    from baton.engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskUpdate:
    model_path: str
    load_format: Optional[str] = None


@dataclass(frozen=True)
class TensorUpdate:
    serialized: tuple[bytes, ...]  # per TP rank; one entry serves every rank


@dataclass(frozen=True)
class GroupUpdate:
    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class InitGroup:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class DestroyGroup:
    group_name: str


@dataclass(frozen=True)
class ReadWeight:
    name: str
    truncate_size: int


WeightOp = Union[DiskUpdate, TensorUpdate, GroupUpdate, InitGroup, DestroyGroup, ReadWeight]


class Outcome(NamedTuple):
    success: bool
    message: str
    value: Any = None  # a read's nested list (on the driver)


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(f"unknown dtype {name!r}")
    return dtype


class RankWeights:
    """One rank's side: its model's weights and the weight-update groups it has joined."""

    def __init__(self, runner: "ModelRunner", tp: TpGroup) -> None:
        self.weights, self.tp, self.device = ModelWeights(runner), tp, runner.device
        self.groups: dict[str, Any] = {}  # group name -> process group

    def run(self, op: WeightOp) -> Outcome:
        """The same operation on every rank (each follower once its driver sent it)."""
        handler: Callable[[Any], Outcome] = {
            DiskUpdate: self._disk, TensorUpdate: self._tensors, GroupUpdate: self._group_update,
            InitGroup: self._init_group, DestroyGroup: self._destroy_group, ReadWeight: self._read,
        }[type(op)]
        return handler(op)

    # ---- agreement ----
    def _agree(self, ok: bool, message: str) -> Outcome:
        """Every rank's (ok, message): success only where all succeeded; else the first failure's message."""
        if self.tp.size == 1:
            return Outcome(ok, message)
        views = all_gather_object((ok, message), self.tp)
        failed = [(rank, msg) for rank, (good, msg) in enumerate(views) if not good]
        if not failed:
            return Outcome(True, views[0][1])
        rank, msg = failed[0]
        return Outcome(False, msg if rank == 0 else f"TP rank {rank}: {msg}")

    def _checked(self, check: Callable[[], set[str]]) -> tuple[Optional[set[str]], Outcome]:
        """(touched parameters or None, the ranks' agreement on the check)."""
        try:
            touched, error = check(), ""
        except WeightsError as e:
            touched, error = None, str(e)
        outcome = self._agree(touched is not None, error)
        return (touched if outcome.success else None), outcome

    def _written(self, write: Callable[[], None], what: str) -> Outcome:
        try:
            write()
            ok, message = True, f"{what}: weights updated"
        except Exception as e:  # noqa: BLE001 - a write the check passed failed: the weights are mixed now
            logger.exception("weight update failed while writing")
            ok, message = False, (f"{what}: writing failed after the check passed ({type(e).__name__}: {e}); the "
                                  "weights may be partly updated: update again")
        return self._agree(ok, message)

    # ---- updates ----
    def _disk(self, op: DiskUpdate) -> Outcome:
        touched, outcome = self._checked(lambda: self.weights.check_checkpoint(op.model_path, op.load_format))
        if touched is None:
            return outcome
        return self._written(lambda: self.weights.load_checkpoint(op.model_path, touched), op.model_path)

    def _tensors(self, op: TensorUpdate) -> Outcome:
        named: list = []

        def check() -> set[str]:
            if len(op.serialized) not in (1, self.tp.size):
                raise WeightsError(f"serialized_named_tensors has {len(op.serialized)} entries; give one per TP rank "
                                   f"({self.tp.size}) or one for all")
            try:
                named.extend(deserialize_named_tensors(op.serialized[self.tp.rank % len(op.serialized)],
                                                       cuda=self.device.startswith("cuda")))
            except NamedTensorsError as e:
                raise WeightsError(str(e)) from e
            return self.weights.check(named, complete=False)

        touched, outcome = self._checked(check)
        if touched is None:
            return outcome
        return self._written(lambda: self.weights.write(named, touched), f"{len(named)} tensors")

    def _group_update(self, op: GroupUpdate) -> Outcome:
        """Receive every tensor the trainer broadcasts (also when the check failed: the trainer's
        broadcasts must end), then write them if every rank's check passed."""
        pg = self.groups.get(op.group_name)
        if pg is None:
            return self._agree(False, f"no weight-update group {op.group_name!r} here: /init_weights_update_group first")
        try:
            dtypes = [parse_dtype(d) for d in op.dtypes]
        except WeightsError as e:
            return self._agree(False, str(e))
        metas = [(n, meta_like(s, d)) for n, s, d in zip(op.names, op.shapes, dtypes)]
        try:
            touched, error = self.weights.check(metas, complete=False), ""
        except WeightsError as e:
            touched, error = None, str(e)
        named = [(n, weight_group.receive(pg, list(s), d, self.device)) for n, s, d in zip(op.names, op.shapes, dtypes)]
        outcome = self._agree(touched is not None, error)
        if not outcome.success:
            return outcome
        return self._written(lambda: self.weights.write(named, touched), f"{len(named)} tensors from {op.group_name}")

    # ---- the weight-update group ----
    def _init_group(self, op: InitGroup) -> Outcome:
        if op.group_name in self.groups:
            return self._agree(False, f"weight-update group {op.group_name!r} exists already")
        rank = op.rank_offset + self.tp.rank
        try:
            self.groups[op.group_name] = weight_group.init_custom_process_group(
                op.backend, f"tcp://{op.master_address}:{op.master_port}", op.world_size, rank, op.group_name)
            ok, message = True, f"joined weight-update group {op.group_name!r} as rank {rank} of {op.world_size}"
        except Exception as e:  # noqa: BLE001 - a rendezvous that failed or timed out
            ok, message = False, f"could not join weight-update group {op.group_name!r}: {type(e).__name__}: {e}"
        return self._agree(ok, message)

    def _destroy_group(self, op: DestroyGroup) -> Outcome:
        pg = self.groups.pop(op.group_name, None)
        if pg is None:
            return self._agree(False, f"no weight-update group {op.group_name!r} here")
        weight_group.destroy_process_group(pg)
        return self._agree(True, f"weight-update group {op.group_name!r} destroyed")

    # ---- reads ----
    def _read(self, op: ReadWeight) -> Outcome:
        try:
            values, counts, shape = self.weights.read(op.name, op.truncate_size)
            ok, error = True, ""
        except WeightsError as e:
            values = counts = shape = None
            ok, error = False, str(e)
        outcome = self._agree(ok, error)
        if not outcome.success:
            return outcome
        if self.tp.size > 1:  # every rank's part: replicated elements count once per rank that holds them
            import torch.distributed as dist

            for t in (values, counts):
                dist.all_reduce(t, group=resolve_group(self.tp.cpu_group))
        if bool((counts == 0).any()):
            return Outcome(False, f"{op.name}: no parameter holds some of its elements")
        full = (values / counts).to(torch.float32)
        return Outcome(True, "", (full.reshape(-1, *shape[1:]) if shape else full.reshape(())).tolist())


class DriverWeights:
    """The driver's side: each operation to the followers first (`send`: StepSender.send_weights,
    None without TP), then here."""

    def __init__(self, rank: RankWeights, send: Optional[Callable[[WeightOp], None]]) -> None:
        self.rank, self.send = rank, send

    @property
    def device(self) -> str:
        return self.rank.device

    def run(self, op: WeightOp) -> Outcome:
        if self.send is not None:
            self.send(op)
        return self.rank.run(op)

