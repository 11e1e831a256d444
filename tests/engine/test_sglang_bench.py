"""The field's benchmark, SGLang's own `sglang.bench_serving` (sglang==0.4.6.post5, pure Python, from
the `test` extra), against a colocated engine: it runs to its end (it reads `internal_states` from
/get_server_info there) and every request completes. Offline: `random-ids` prompts from the local
tokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_server import running_engine, wait_idle_integrity

NUM_PROMPTS = 8


def run_bench_serving(base_url: str, tokenizer: str, out_file: str, *extra: str) -> dict:
    """sglang.bench_serving's result line; fails with its output when it does not finish."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", base_url,
           "--dataset-name", "random-ids", "--tokenizer", tokenizer, "--num-prompts", str(NUM_PROMPTS),
           "--random-input-len", "48", "--random-output-len", "8", "--random-range-ratio", "1",
           "--request-rate", "inf", "--output-file", out_file, "--disable-tqdm", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out_file) as f:
        return json.loads(f.read().splitlines()[-1])


def test_sglang_bench_serving_against_a_colocated_engine(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    with running_engine(model) as engine:
        result = run_bench_serving(engine.base_url, model, str(tmp_path / "bench.jsonl"))
        assert result["completed"] == NUM_PROMPTS and result["total_output_tokens"] == NUM_PROMPTS * 8, result
        assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True
