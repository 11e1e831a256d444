"""The engine's shared data types, below every part that passes them around: a request (req.py), the
scheduler's queues (queues.py), a batch on its way to the device (schedule_batch.py: ScheduleBatch ->
ModelWorkerBatch; forward_batch.py: ForwardBatch) and back (batch_result.py), a verify step's drafts
(spec_info.py), the attention backend contract the layers implement (in forward_batch.py) and the scheduler's
counters (stats.py). Nothing here imports the layers, models, executors, scheduler or PD above it."""
