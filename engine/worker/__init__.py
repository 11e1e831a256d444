"""The worker: what runs a batch the scheduler formed. TpModelWorker (tp_worker.py) drives one forward and
sample per batch through the model runner (model_executor/) and, with TP, sends each step to the other
ranks first (tp_step.py); the forward executors (executors/) launch batches plainly or overlapped; the
future map (future_map.py) resolves the overlap loop's placeholder ids on the device."""
