"""Tensor parallelism: the process group of one model's shards, its collectives, and the step
broadcast that drives the shards from the scheduler's rank."""
