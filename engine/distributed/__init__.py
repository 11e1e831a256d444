"""Tensor parallelism: the process group of one model's shards and the collectives its layers call
(the per-step broadcast from the scheduler's rank is worker/tp_step.py)."""
