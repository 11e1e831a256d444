"""PD disaggregation as a strategy of the scheduler: one interface, chosen once at start-up.

    mode        strategy                                what it adds to the scheduler's loop
    null        Colocated (this file)                   nothing: requests go straight to the waiting queue
    prefill     prefill.PrefillDisaggregation           bootstrap queue -> waiting queue -> forward ->
                                                        KV sent per chunk -> inflight queue -> freed
    decode      decode.DecodeDisaggregation             prealloc queue -> transfer queue -> running batch
                                                        (with the prefill's first token, no forward)

The scheduler calls the hooks below and never asks which mode it runs in. A strategy sees the
scheduler through a SchedulerView: the queues, pools and the few scheduler actions it needs (finish
a request, stream outputs, start a batch), not the Scheduler object. Hybrid models' state transfer
and speculative decoding's hidden-state hand-over plug in here as further hooks.
"""
from __future__ import annotations

from typing import Any

from baton.engine.disaggregation.colocated import Colocated, DisaggregationMode, SchedulerView


def create_strategy(mode: DisaggregationMode, view: SchedulerView, transfer_config: Any = None) -> Colocated:
    """The strategy of `mode` (the PD implementations are imported only when used)."""
    if mode is DisaggregationMode.PREFILL:
        from baton.engine.disaggregation.prefill import PrefillDisaggregation
        return PrefillDisaggregation(view, transfer_config)
    if mode is DisaggregationMode.DECODE:
        from baton.engine.disaggregation.decode import DecodeDisaggregation
        return DecodeDisaggregation(view, transfer_config)
    return Colocated(view)
