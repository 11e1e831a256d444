"""PD disaggregation: KV transfer between a prefill engine and a decode engine.

Backends are picked by name and imported lazily, so engines without Mooncake installed can still
run colocated. Mooncake is the one the package ships; a process may register others
(register_transfer_backend): the scheduler tests register an in-process fake
(tests/support/baton_testing/fake_kv_transfer.py), which the package does not ship.
"""
from __future__ import annotations

import importlib
from typing import Optional, Union

from baton.engine.disaggregation.base import (DisaggregationMode, KVArgs, KVManagerBase, MetadataBuffers,
                                              TransferConfig)

# name -> "module:class" of its KVManagerBase; register_transfer_backend adds others (tests: an in-process fake)
TRANSFER_BACKENDS: dict[str, Union[str, type[KVManagerBase]]] = {
    "mooncake": "baton.engine.disaggregation.mooncake.conn:MooncakeKVManager",
}


def register_transfer_backend(name: str, manager: type[KVManagerBase]) -> None:
    """Make `manager` available as --disaggregation-transfer-backend `name` in this process."""
    TRANSFER_BACKENDS[name] = manager


def transfer_backend_class(name: str) -> type[KVManagerBase]:
    if name not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {', '.join(TRANSFER_BACKENDS)}")
    backend = TRANSFER_BACKENDS[name]
    if isinstance(backend, str):
        module, cls = backend.split(":")
        backend = getattr(importlib.import_module(module), cls)
    return backend


def create_transfer_backend(name: str, args: KVArgs, metadata: MetadataBuffers,
                            mode: Union[DisaggregationMode, str], config: TransferConfig,
                            bootstrap_addr: Optional[str] = None) -> KVManagerBase:
    """The per-engine-rank manager; prefill managers need `bootstrap_addr` ("host:port") to register at."""
    return transfer_backend_class(name)(args, metadata, mode, config, bootstrap_addr)
