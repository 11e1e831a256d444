"""PD disaggregation: KV transfer between a prefill engine and a decode engine.

Backends are picked by name and imported lazily, so engines without Mooncake installed can still
run colocated. "fake", the in-process backend of the scheduler tests, is a test double: it lives in
tests/support/baton_testing/fake_kv_transfer.py, is not in the package, and loads only where
tests/support is on sys.path (tests/conftest.py puts it there).
"""
from __future__ import annotations

import importlib
from typing import Optional, Union

from baton.engine.disaggregation.base import (DisaggregationMode, KVArgs, KVManagerBase, MetadataBuffers,
                                              TransferConfig)

# name -> "module:class" of its KVManagerBase
TRANSFER_BACKENDS = {
    "mooncake": "baton.engine.disaggregation.mooncake.conn:MooncakeKVManager",
    "fake": "baton_testing.fake_kv_transfer:FakeKVManager",  # test support, outside the package
}


def create_transfer_backend(name: str, args: KVArgs, metadata: MetadataBuffers,
                            mode: Union[DisaggregationMode, str], config: TransferConfig,
                            bootstrap_addr: Optional[str] = None) -> KVManagerBase:
    """The per-engine-rank manager; prefill managers need `bootstrap_addr` ("host:port") to register at."""
    if name not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {', '.join(TRANSFER_BACKENDS)}")
    module, cls = TRANSFER_BACKENDS[name].split(":")
    try:
        manager = getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if name != "fake" or e.name != "baton_testing":
            raise
        raise ValueError("the 'fake' KV transfer backend is a test double in tests/support/baton_testing "
                         "(put tests/support on sys.path, as the tests do)") from e
    return manager(args, metadata, mode, config, bootstrap_addr)
