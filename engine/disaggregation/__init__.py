"""PD disaggregation: KV transfer between a prefill engine and a decode engine (issue 3).

Backends are picked by name and imported lazily, so engines without Mooncake installed can still
run colocated or with the in-process fake.
"""
from __future__ import annotations

from typing import Optional, Union

from baton.engine.disaggregation.base import (DisaggregationMode, KVArgs, KVManagerBase, MetadataBuffers,
                                              TransferConfig)

TRANSFER_BACKENDS = ("mooncake", "fake")


def create_transfer_backend(name: str, args: KVArgs, metadata: MetadataBuffers,
                            mode: Union[DisaggregationMode, str], config: TransferConfig,
                            bootstrap_addr: Optional[str] = None) -> KVManagerBase:
    """The per-engine-rank manager; prefill managers need `bootstrap_addr` ("host:port") to register at."""
    if name == "mooncake":
        from baton.engine.disaggregation.mooncake.conn import MooncakeKVManager
        return MooncakeKVManager(args, metadata, mode, config, bootstrap_addr)
    if name == "fake":
        from baton.engine.disaggregation.fake import FakeKVManager
        return FakeKVManager(args, metadata, mode, config, bootstrap_addr)
    raise ValueError(f"unknown KV transfer backend {name!r}; known: {', '.join(TRANSFER_BACKENDS)}")
