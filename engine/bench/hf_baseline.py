"""The HF `transformers` baseline: `generate` on the benchmark's prompts, greedy, EOS ignored.

`min_new_tokens == max_new_tokens == output_len` makes every sequence as long as a served request
with `ignore_eos`. Two modes:
- batched: all prompts in one left-padded batch (HF at its best for offline throughput);
- sequential: one prompt at a time (what a naive server built on `generate` would do).
Prompt tokenization and model loading are not timed; one short warm-up `generate` runs first.
"""
from __future__ import annotations

import time
from enum import Enum
from typing import Optional

import torch

from baton.engine.bench.workload import BenchPrompt
from baton.engine.utils.gc_freeze import gc_paused


class HFMode(str, Enum):
    BATCHED = "batched"
    SEQUENTIAL = "sequential"


def load_hf_model(model_path: str, device: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model, tokenizer


def pad_token_id(model, tokenizer) -> int:
    """Any id works for left padding (it is masked); prefer the tokenizer's, then EOS."""
    for candidate in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate[0] if isinstance(candidate, list) else candidate)
    return 0


def left_pad(prompts: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligned batch: returns input ids and attention mask, both [batch, max_len]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def _generate(model, batch: list[list[int]], output_lens: list[int], pad_id: int, temperature: float = 0.0,
              top_p: float = 1.0) -> int:
    """Generate a padded batch until its longest request is done (greedy, or sampled at
    `temperature` and `top_p`); returns the tokens the requests asked for (a static batch cannot
    stop a row early, so rows beyond their own length are wasted work, as in any static-batching
    server)."""
    ids, mask = left_pad(batch, pad_id, str(model.device))
    longest = max(output_lens)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                         pad_token_id=pad_id, **sampling)  # [batch, prompt + new]
    assert out.shape[1] - ids.shape[1] == longest
    return sum(output_lens)


def run_hf_baseline(model_path: str, prompts: list[BenchPrompt], mode: HFMode | str,
                    device: str = "cpu", dtype: str = "float32", model_and_tokenizer=None,
                    max_batch_size: Optional[int] = None) -> dict:
    """Time `generate` over all prompts; returns output tokens, seconds and tokens/s."""
    mode = HFMode(mode)
    model, tokenizer = model_and_tokenizer or load_hf_model(model_path, device, dtype)
    pad_id = pad_token_id(model, tokenizer)
    token_ids = [list(p.token_ids) for p in prompts]
    output_lens = [p.output_len for p in prompts]
    sampling = dict(temperature=prompts[0].temperature, top_p=prompts[0].top_p)  # the workload's, every prompt's
    _generate(model, token_ids[:1], [2], pad_id, **sampling)  # warm-up: first-call allocations are not the baseline
    size = 1 if mode is HFMode.SEQUENTIAL else (max_batch_size or len(token_ids))
    with gc_paused():  # as the engines' runs are timed (bench/client.py)
        start = time.perf_counter()
        output_tokens = sum(_generate(model, token_ids[i:i + size], output_lens[i:i + size], pad_id, **sampling)
                            for i in range(0, len(token_ids), size))
        seconds = time.perf_counter() - start
    return {
        "mode": mode.value,
        "requests": len(prompts),
        "batch_size": size,
        "input_tokens": sum(len(t) for t in token_ids),
        "output_tokens": output_tokens,
        "duration_s": seconds,
        "output_throughput": output_tokens / seconds,
        "request_throughput": len(prompts) / seconds,
    }
