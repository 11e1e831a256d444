"""Multi-LoRA serving, the scheduler's side: the adapters loaded (by name), the adapter each request runs
under, how many one batch may hold, and which slot of the device pool each takes.

    registry   name -> LoraRef (uid, path, pinned): /load_lora_adapter adds one, /unload_lora_adapter takes it
               out (new requests naming it get a 400 at once); it is gone once no request runs under it
    slots      slot -> uid: the pool's content as the next pass finds it (model_executor/lora_manager.py)

A uid is never reused, so a request, the radix cache (its keys live in the uid's namespace) and the pool
never mistake a reloaded name for the adapter it had before.

Admission (SGLang's rule): a batch holds at most --max-loras-per-batch distinct adapters, the base model
counting as one; a waiting request whose adapter would be one too many waits for a later batch. A
pinned adapter keeps its slot once loaded, so the others share the remaining slots. At launch each
adapter of the batch not in the pool takes a free slot, else the least recently used slot no adapter
of the batch needs (never a pinned one); the pass carries those loads (core/lora.py LoraStep) and every
rank makes them before its layers, in pass order.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from baton.engine.core.lora import LoraStep
from baton.engine.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput
from baton.engine.model_executor.lora_adapter import AdapterError
from baton.engine.server_args import parse_lora_paths

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.model_executor.lora_manager import LoraManager
    from baton.engine.scheduler.config import SchedulerConfig
    from baton.engine.scheduler.request_table import RequestTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraRef:
    uid: int
    name: str
    path: str
    pinned: bool = False


class LoraScheduler:
    def __init__(self, config: "SchedulerConfig", manager: Optional["LoraManager"], table: "RequestTable",
                 dp_rank: int = 0) -> None:
        """`manager`: the driver's adapter pool (None without --enable-lora), which reads an adapter at its
        load (a bad one is refused then) and keeps the copy the driver's passes load from."""
        self.enabled, self.manager, self.table, self.dp_rank = config.enable_lora, manager, table, dp_rank
        self.num_slots, self.max_loaded = config.max_loras_per_batch, config.max_loaded_loras
        self.registry: dict[str, LoraRef] = {}
        self.draining: dict[str, LoraRef] = {}  # unloaded while requests still run under them
        self.by_uid: dict[int, LoraRef] = {}  # every adapter a request may run under: the two above
        self.slots: list[Optional[int]] = [None] * self.num_slots
        self.last_used = [0] * self.num_slots  # the batch count when each slot's adapter last ran
        self.batches = 0
        self.drops: list[int] = []  # uids gone since the last pass: every rank lets its copy go
        self._uids = itertools.count(1)
        for spec in parse_lora_paths(config.lora_paths) if self.enabled else ():
            error = self._load(spec.name, spec.path, spec.pinned)
            if error is not None:
                raise ValueError(f"--lora-paths: {error}")

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The control messages this part answers (Scheduler.control)."""
        return {LoadLoRAAdapterReqInput: self.load, UnloadLoRAAdapterReqInput: self.unload}

    def loaded(self) -> dict[str, str]:
        return {name: ref.path for name, ref in self.registry.items()}

    def server_info(self) -> dict[str, Any]:
        return {"lora_adapters": self.loaded(), "lora_slots": [None if u is None else self.by_uid[u].name
                                                              for u in self.slots]} if self.enabled else {}

    # ---- load and unload ----

    def load(self, req: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        error = self._load(req.lora_name, req.lora_path, req.pinned)
        return LoRAUpdateOutput(error is None, error or "", self.loaded(), dp_rank=self.dp_rank)

    def _load(self, name: str, path: str, pinned: bool) -> Optional[str]:
        """Read, check and register an adapter; the reason it was refused, else None."""
        if not self.enabled:
            return "LoRA is not enabled on this server (start it with --enable-lora)"
        if name in self.registry:
            return f"a LoRA adapter named {name!r} is loaded already (unload it first)"
        if name in self.draining:
            return f"LoRA adapter {name!r} is being unloaded: requests still run under it"
        if self.max_loaded is not None and len(self.by_uid) >= self.max_loaded:
            return f"{len(self.by_uid)} LoRA adapters are loaded, the most --max-loaded-loras allows: unload one first"
        if pinned and self._pinned() >= self.num_slots - 1:
            return f"at most --max-loras-per-batch - 1 = {self.num_slots - 1} adapters may be pinned"
        try:
            adapter = self.manager.read(path)
        except AdapterError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001  (a file that is not what it claims: one refusal, not a crash)
            return f"LoRA adapter {path}: cannot be read: {type(e).__name__}: {e}"
        ref = LoraRef(next(self._uids), name, path, pinned)
        self.manager.keep(ref.uid, adapter)
        self.registry[name] = self.by_uid[ref.uid] = ref
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)
        return None

    def unload(self, req: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """Takes the adapter out of the registry at once; done once no request runs under it (until
        then the answer says how many do, and the HTTP route asks again)."""
        name = req.lora_name
        if req.retry and name not in self.draining:  # a launch let it go since the route asked (the name
            return LoRAUpdateOutput(True, "", self.loaded(), dp_rank=self.dp_rank)  # may be another's now)
        if name in self.registry:
            self.draining[name] = self.registry.pop(name)
        elif name not in self.draining:
            return LoRAUpdateOutput(False, f"LoRA adapter {name!r} is not loaded", self.loaded(), dp_rank=self.dp_rank)
        ref = self.draining[name]
        in_use = self._in_use(ref.uid)
        if in_use:
            return LoRAUpdateOutput(False, f"LoRA adapter {name!r}: {in_use} requests still run under it",
                                    self.loaded(), in_use=in_use, dp_rank=self.dp_rank)
        self._forget(ref)
        logger.info("LoRA adapter %r unloaded", name)
        return LoRAUpdateOutput(True, "", self.loaded(), dp_rank=self.dp_rank)

    def _in_use(self, uid: int) -> int:
        return sum(r.lora_uid == uid for r in self.table)

    def _forget(self, ref: LoraRef) -> None:
        del self.draining[ref.name], self.by_uid[ref.uid]
        if ref.uid in self.slots:
            self.slots[self.slots.index(ref.uid)] = None
        self.drops.append(ref.uid)

    def _pinned(self) -> int:
        return sum(ref.pinned for ref in self.by_uid.values())

    # ---- requests ----

    def resolve(self, req: "Req", name: Optional[str]) -> Optional[tuple[str, int]]:
        """Point a new request at its adapter; (message, status) when it names none that is loaded."""
        if name is None:
            return None
        if not self.enabled:
            return f"LoRA adapter {name!r} requested, but LoRA is not enabled on this server (--enable-lora)", 400
        ref = self.registry.get(name)
        if ref is None:
            loaded = ", ".join(sorted(self.registry)) or "none"
            return f"LoRA adapter {name!r} is not loaded (loaded: {loaded})", 400
        req.lora_uid = ref.uid
        return None

    # ---- batches ----

    def adapters_of(self, reqs: Iterable["Req"]) -> set[int]:
        """The adapters (uids, 0: the base model) a batch of these requests runs."""
        return {r.lora_uid for r in reqs} if self.enabled else set()

    def fits(self, adapters: set[int], req: "Req") -> bool:
        """Whether `req` may join a batch that runs `adapters`: at most --max-loras-per-batch distinct ones,
        the base model included, and the adapters that are not pinned within the slots pinned ones leave."""
        if not self.enabled or req.lora_uid in adapters:
            return True
        wanted = adapters | {req.lora_uid}
        unpinned = sum(1 for u in wanted if u and not self.by_uid[u].pinned)
        return len(wanted) <= self.num_slots and unpinned <= self.num_slots - self._pinned()

    def prepare(self, mwb: "ModelWorkerBatch", reqs: list["Req"]) -> None:
        """At launch: each row's slot, the loads that put the batch's adapters in the pool, the drops."""
        if not self.enabled:
            return
        self.batches += 1
        needed = {r.lora_uid for r in reqs} - {0}
        loads = []
        for uid in needed:
            if uid not in self.slots:
                slot = self._victim(needed)
                self.slots[slot] = uid
                loads.append((slot, uid, self.by_uid[uid].path))
            self.last_used[self.slots.index(uid)] = self.batches
        slot_of = {uid: self.slots.index(uid) for uid in needed}
        mwb.lora = LoraStep([slot_of.get(r.lora_uid, -1) for r in reqs], loads, self.drops)
        self.drops = []
        for ref in [r for r in self.draining.values() if not self._in_use(r.uid)]:
            self._forget(ref)  # its route's next ask finds it gone (or its client stopped asking)

    def _victim(self, needed: set[int]) -> int:
        """A slot for an adapter the batch needs: a free one, else the least recently used slot of an
        adapter that neither this batch needs nor is pinned."""
        if None in self.slots:
            return self.slots.index(None)
        free = [i for i, u in enumerate(self.slots) if u not in needed and not self.by_uid[u].pinned]
        if not free:  # admission keeps a batch's adapters within the slots: a scheduler bug
            raise RuntimeError(f"LoRA: a batch needs {len(needed)} adapters, more than the pool's free slots")
        return min(free, key=lambda i: self.last_used[i])
