"""Sampling parameters and the per-request/per-batch sampling state (penalties, seeds, min_tokens)."""
