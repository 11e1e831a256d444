"""What a speculation strategy reads of the server args (ServerArgs.view; tests/test_flags.py checks each
field is a flag declared as speculation's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SpecConfig:
    speculative_algorithm: Optional[str]
    speculative_num_steps: int
    speculative_eagle_topk: int
    speculative_num_draft_tokens: int
    speculative_disable_by_batch_size: int
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_ngram_max_bfs_breadth: int
    speculative_ngram_capacity: int
