"""Build a model from a local Hugging Face directory: config -> registry class -> safetensors weights.

dtype "auto" takes the checkpoint's dtype (model_config.TextConfig.dtype), with
two exceptions (server_args.auto_dtype_name): float16 on CPU becomes float32, because CPU float16
matmuls are slow (no native kernels on most CPUs) and the engine compares against float32 references
there; float32 on CUDA becomes float16, as in SGLang and vLLM. bfloat16 stays bfloat16 on CPU (it has
fast kernels on recent CPUs). An explicit dtype is always honoured.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
from typing import Iterator, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from baton.engine.distributed.parallel_state import TpGroup, validate_tp
from baton.engine.model_config import ModelConfig
from baton.engine.models import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


def resolve_dtype(dtype: str, config: ModelConfig, device: str) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16")
        return DTYPES[dtype]
    from baton.engine.server_args import auto_dtype_name

    checkpoint = config.text.dtype or torch.float32
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(checkpoint, "float32")
    resolved = DTYPES[auto_dtype_name(name, str(device))]
    if resolved != checkpoint:
        logger.info("dtype auto: %s checkpoint on %s -> %s", name, device, resolved)
    return resolved


def safetensors_files(model_path: str) -> list[str]:
    """The shards named by model.safetensors.index.json, else every *.safetensors in the directory."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path} (only safetensors checkpoints are supported)")
    return files


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams (name, CPU tensor) one at a time, with a progress bar over all tensors."""
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    if not hasattr(tqdm, "_lock"):
        # A thread lock only: tqdm's default adds a multiprocessing lock, a named semaphore that the
        # scheduler process (stopped by a signal) never unlinks, so every engine stop warned
        # "resource_tracker: There appear to be 1 leaked semaphore objects".
        tqdm.set_lock(threading.RLock())
    with tqdm(total=total, desc=f"Loading {len(files)} safetensors file(s)", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype (no float32 copy on the device first).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_path: str, dtype: str = "auto", device: str = "cpu", tp: TpGroup = TpGroup(),
               mtp: bool = False, draft_model_path: Optional[str] = None, token_map: Optional[str] = None,
               draft_algorithm: Optional[str] = None,
               embedding: bool = False) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    """Returns (model in eval mode on `device`, its config, the dtype it was built in). With a
    TP group of several ranks the model is this rank's shard. `mtp`: with the checkpoint's
    multi-token-prediction head (--speculative-algorithm NEXTN; models/qwen3_next.py).
    `draft_model_path`: an EAGLE draft checkpoint (--speculative-algorithm EAGLE / EAGLE3), built as
    the model's `draft_head` (models/eagle.py), refused unless it is a `draft_algorithm` draft (when
    given); `token_map`: its LM head cut to those tokens. `embedding` (--is-embedding): without the
    LM head, which an embedding engine never reads (a checkpoint's lm_head.* is skipped)."""
    config = ModelConfig.from_pretrained(model_path)
    if not config.architecture:
        raise ValueError(f"{model_path}/config.json has no 'architectures' entry")
    model_cls = get_model_class(config.architecture)
    _check_generates(config, embedding)
    torch_dtype = resolve_dtype(dtype, config, device)
    validate_tp(config, tp.size)
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config, tp=tp)
        if mtp:
            if not hasattr(model, "add_mtp_head"):
                raise ValueError(f"--speculative-algorithm NEXTN drafts with the checkpoint's own multi-token-prediction "
                                 f"weights; {config.architecture} has none here (Qwen3-Next and Qwen3.5 models do)")
            model.add_mtp_head()
    if embedding:
        model.lm_head = None
    model.load_weights(_bare_names_prefixed(iterate_safetensors(safetensors_files(model_path))))
    if draft_model_path is not None:
        with _default_dtype(torch_dtype), torch.device(device):
            head = load_draft_head(draft_model_path, config, model.num_kv_layers, tp, draft_algorithm)
            if token_map is not None:
                from baton.engine.models.eagle import HotVocabHead, load_token_map

                hot = load_token_map(token_map, config.text.vocab_size)
                lm = model.model.embed_tokens if model.lm_head is None else model.lm_head  # one TP rank
                head = HotVocabHead(head, lm.weight.detach()[hot.to(lm.weight.device)], hot)
                logger.info("draft head: LM head cut to the %d tokens of %s", len(hot), token_map)
            model.add_module("draft_head", head)
        if model.draft_head.aux_layers:
            model.model.aux_layers = model.draft_head.aux_layers
    model.eval().requires_grad_(False)
    return model, config, torch_dtype


# The top-level modules of a bare decoder (HF's LlamaModel, Qwen3Model): a checkpoint saved from one (as
# Qwen3-Embedding's is, under architecture Qwen3ForCausalLM) names them without the `model.` prefix.
_BARE_DECODER_NAMES = ("embed_tokens.", "layers.", "norm.")


def _bare_names_prefixed(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's weight names as the model classes name them (under `model.`)."""
    for name, tensor in weights:
        yield ("model." + name if name.startswith(_BARE_DECODER_NAMES) else name), tensor


def _check_generates(config: ModelConfig, embedding: bool) -> None:
    """A checkpoint that cannot generate (no LM head: a bare decoder; a classifier's head instead)
    needs --is-embedding."""
    if embedding:
        return
    arch = config.architecture
    if config.num_labels:
        raise ValueError(f"{arch} is a sequence classifier: serve it with --is-embedding (/classify)")
    if arch.endswith("Model") and not config.text.tie_word_embeddings:
        raise ValueError(f"{arch} is a decoder without an LM head: serve it with --is-embedding "
                         "(/v1/embeddings, /encode)")


def load_draft_head(path: str, target_config: ModelConfig, first_kv_layer: int, tp: TpGroup,
                    algorithm: Optional[str] = None) -> nn.Module:
    """An EAGLE draft checkpoint (config.json and safetensors, or the pytorch_model.bin most published
    EAGLE drafts come as) as a head over the target (models/eagle.py); with `algorithm`, refused (before
    its weights load) when the checkpoint is the other kind."""
    from baton.engine.models.eagle import EAGLE_ARCHITECTURES, build_eagle_head, strip_prefix

    config = ModelConfig.from_pretrained(path)
    arch = config.architecture or "?"
    kind = EAGLE_ARCHITECTURES.get(arch)
    if algorithm is not None and kind is not None and kind != algorithm:
        raise ValueError(f"--speculative-algorithm {algorithm}: {path} is an {kind} draft ({arch}); pass "
                         f"--speculative-algorithm {kind}")
    files = glob.glob(os.path.join(path, "*.safetensors"))
    if files:
        weights = dict(iterate_safetensors(safetensors_files(path)))
    else:
        bins = sorted(glob.glob(os.path.join(path, "*.bin")))
        if not bins:
            raise FileNotFoundError(f"--speculative-draft-model-path {path}: no *.safetensors or *.bin weights")
        weights = {}
        for f in bins:
            weights.update(torch.load(f, map_location="cpu", weights_only=True))
    head = build_eagle_head(config, strip_prefix(weights), target_config, first_kv_layer, tp)
    logger.info("draft head %s from %s: %d layer(s), %.1fM parameters", head.algorithm, path, head.num_kv_layers,
                sum(p.numel() for p in head.parameters()) / 1e6)
    return head
