"""EAGLE draft heads (--speculative-algorithm EAGLE / EAGLE3 with --speculative-draft-model-path): a
small decoder that drafts from the target model's hidden states, as published by the EAGLE authors
(SafeAILab/EAGLE) and served by SGLang and vLLM under the same checkpoint layouts.

    EAGLE (-1/-2, "LlamaForCausalLMEagle")      EAGLE-3 ("LlamaForCausalLMEagle3")
    x = fc([embed(t[p+1]) ; h[p]])  (bias)      g = fc([a1 ; a2 ; a3][p])   three target layers' inputs
                                                x = [input_norm(embed(t[p+1])) ; hidden_norm(g)]
    N Llama decoder layers, the first           one decoder layer ("midlayer") whose q/k/v read the
    without its input norm                      2 x hidden concatenation; residual g
    out = the last layer's output + residual    out = the layer's output + residual
    logits = the target's LM head (out)         logits = own LM head (norm(out)) over a reduced draft
                                                vocabulary; draft id i is target id i + d2t[i]

`h[p]` is the target's final (normed) hidden state at p; EAGLE-3's `a1..a3` are the residual streams
entering three of its layers (by default 2, N/2 and N-3; the checkpoint's
eagle_config.eagle_aux_hidden_state_layer_ids say otherwise), which LlamaModel captures into the
forward batch (`aux_hidden`). Both read the target's embedding (EAGLE also its LM head): a draft
checkpoint's own embed_tokens, when it has one, is not loaded. A chain step past the first feeds back
`out` at the previous position in place of the target's state (EAGLE-3: without its fc).

The head's attention layers take KV-pool layers after the target's (`first_kv_layer`), in the same
slots as the target's KV, so the pool, prefix sharing, retraction and the PD transfer carry them as
any layer (the drafting itself: speculative/head_worker.py). Their KV geometry must therefore be the
target's: the same KV heads and head size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.layers.layernorm import RMSNorm
from baton.engine.layers.linear import MergedColumnLinear, OutputPart, load_param, qkv_parts
from baton.engine.layers.vocab_parallel import VocabParallelEmbedding
from baton.engine.model_config import ModelConfig
from baton.engine.models.llama import STACKED_SHARDS, LlamaAttention, LlamaDecoderLayer, LlamaMLP

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch

EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle": "EAGLE", "LlamaForCausalLMEagle3": "EAGLE3"}


def eagle3_aux_layers(draft_config: ModelConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3 reads: the checkpoint's layer ids (outputs of those
    layers, so inputs of the next ones), else SGLang's default (inputs of 2, N/2, N-3)."""
    ids = draft_config.eagle.aux_layer_ids
    layers = tuple(i + 1 for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(0 < i < num_layers for i in layers):
        raise ValueError(f"EAGLE3 reads three target layers inside the model's {num_layers}; got inputs of {layers}")
    return layers


def _replicated(in_features: int, out_features: int, bias: bool) -> MergedColumnLinear:
    """A linear every rank holds whole (the fc's output feeds the replicated residual stream)."""
    return MergedColumnLinear(in_features, [OutputPart(out_features, 0, out_features)], bias=bias)


class _Loader:
    """Checkpoint tensors into a head's parameters: q/k/v and gate/up into their fused linears
    (models/llama.py's rule), the rest by name; every parameter must be filled."""

    @staticmethod
    def load(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(module.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in STACKED_SHARDS:
                fused, shard = STACKED_SHARDS[parts[-2]]
                path = ".".join(parts[:-2] + [fused])
                module.get_submodule(path).load_shard(parts[-1], shard, tensor)
                loaded.add(f"{path}.{parts[-1]}")
            elif name in params:
                load_param(params[name], tensor, name)
                loaded.add(name)
            else:
                raise KeyError(f"draft checkpoint tensor {name!r} has no matching parameter in {type(module).__name__}")
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"the draft checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")


class EagleHead(nn.Module):
    """EAGLE-1/-2 (module docstring): `num_hidden_layers` Llama layers over fc([embedding ; hidden])."""

    algorithm = "EAGLE"
    own_lm_head = False  # the target's LM head reads `out` (EAGLE-3: draft_logits, draft_to_target)

    def __init__(self, config: ModelConfig, first_kv_layer: int, fc_bias: bool, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        text = config.text
        hidden, bias = text.hidden_size, text.attention_bias
        self.fc = _replicated(2 * hidden, hidden, fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, LlamaAttention(config, first_kv_layer + i, bias, bias, tp=tp),
                              LlamaMLP(hidden, text.intermediate_size, text.hidden_act, bias=text.mlp_bias, tp=tp))
            for i in range(text.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer has none (its fc output is the input)
        self.num_kv_layers = text.num_layers
        self.aux_layers: tuple[int, ...] = ()

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """embeds: the next tokens' embeddings, hidden: the target's final hidden states (or the
        head's own outputs), both [num_tokens, hidden] -> the head's outputs [num_tokens, hidden]."""
        x, residual = self.fc(torch.cat([embeds, hidden], dim=-1)), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, forward_batch)
        return x + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # the target's embedding and LM head serve; a first-layer input norm, where a conversion kept
        # one, is not in the published architecture
        skip = ("embed_tokens.", "lm_head.", "layers.0.input_layernorm.")
        _Loader.load(self, ((n, t) for n, t in weights if not n.startswith(skip)))


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's one layer: attention over [input_norm(embedding) ; hidden_norm(state)] (2 x hidden
    wide), the state as its residual, then the usual post-attention norm and MLP."""

    def __init__(self, config: ModelConfig, kv_layer: int, tp: TpGroup) -> None:
        super().__init__()
        text, heads = config.text, config.heads
        hidden, bias = text.hidden_size, text.attention_bias
        self.self_attn = LlamaAttention(config, kv_layer, bias, bias, tp=tp)
        self.self_attn.qkv_proj = MergedColumnLinear(
            2 * hidden, qkv_parts(heads.num_heads, heads.num_kv_heads, heads.head_dim, tp), bias=bias)
        self.mlp = LlamaMLP(hidden, text.intermediate_size, text.hidden_act, bias=text.mlp_bias, tp=tp)
        self.input_layernorm = RMSNorm(hidden, text.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, text.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, text.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, state: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, state)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    """EAGLE-3 (module docstring): fc over three target layers' states, one layer, its own norm and LM
    head over the draft vocabulary."""

    algorithm = "EAGLE3"
    own_lm_head = True

    def __init__(self, config: ModelConfig, first_kv_layer: int, aux_layers: tuple[int, ...],
                 target_hidden: int, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        hidden = config.text.hidden_size
        self.hidden_size = hidden
        self.fc = _replicated(3 * target_hidden, hidden, config.eagle.fc_bias)
        self.midlayer = Eagle3DecoderLayer(config, first_kv_layer, tp)
        self.norm = RMSNorm(hidden, config.text.rms_norm_eps)
        draft_vocab = config.eagle.draft_vocab_size
        self.lm_head = VocabParallelEmbedding(draft_vocab, hidden, tp)
        # draft id -> target id (d2t holds the offsets; a checkpoint over the full vocabulary has none)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab, dtype=torch.int64), persistent=False)
        self.num_kv_layers = 1
        self.aux_layers = aux_layers

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """hidden: the target's three captured states [num_tokens, 3 x target hidden], or the head's
        own outputs [num_tokens, hidden] -> the head's outputs (before its norm) [num_tokens, hidden]."""
        state = self.fc(hidden) if hidden.shape[-1] != self.hidden_size else hidden
        return self.midlayer(positions, embeds, state, forward_batch)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's outputs [m, hidden] -> logits over its draft vocabulary [m, draft vocab] (draft_to_target
        turns the ids chosen from them into target ids)."""
        return self.lm_head.logits(self.norm(out))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def named() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "d2t":
                    self.draft_to_target.add_(tensor.to(self.draft_to_target.device, torch.int64))
                elif name != "t2d" and not name.startswith("embed_tokens."):
                    # some trainers save the one layer as `layers.0.`, the published drafts as `midlayer.`
                    yield (f"midlayer.{name[len('layers.0.'):]}" if name.startswith("layers.0.") else name), tensor

        _Loader.load(self, named())


class HotVocabHead(nn.Module):
    """An EAGLE head whose drafts come from a hot vocabulary (--speculative-token-map, SGLang's flag; the
    FR-Spec idea): the model's LM head cut to those rows, so a draft step scores a few thousand tokens
    instead of the whole vocabulary. Everything else is the inner head's."""

    own_lm_head = True

    def __init__(self, inner: nn.Module, lm_rows: torch.Tensor, hot_ids: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.algorithm, self.num_kv_layers, self.aux_layers = inner.algorithm, inner.num_kv_layers, inner.aux_layers
        self.lm_head = VocabParallelEmbedding(len(hot_ids), lm_rows.shape[1])
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
        self.register_buffer("draft_to_target", hot_ids.to(torch.int64), persistent=False)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        return self.inner(embeds, positions, hidden, forward_batch)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's outputs [m, hidden] -> logits over the hot vocabulary [m, hot tokens]."""
        return self.lm_head.logits(out)


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """--speculative-token-map: a .pt file holding a tensor or list of token ids, as SGLang reads it."""
    ids = torch.load(path, map_location="cpu", weights_only=True)
    ids = torch.as_tensor(ids, dtype=torch.int64).flatten().unique()  # sorted, each once
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"--speculative-token-map {path}: needs token ids in [0, {vocab_size})")
    return ids


def build_eagle_head(draft_config: ModelConfig, weights: dict[str, torch.Tensor], target_config: ModelConfig,
                     first_kv_layer: int, tp: TpGroup) -> nn.Module:
    """The draft checkpoint's head (by its architecture), checked against the target, weights loaded.
    Called under the target's dtype and device."""
    arch = draft_config.architecture or "?"
    if arch not in EAGLE_ARCHITECTURES:
        raise ValueError(f"--speculative-draft-model-path: architecture {arch} is not an EAGLE draft "
                         f"({', '.join(EAGLE_ARCHITECTURES)})")
    draft, target = draft_config, target_config
    target_kv = (target.heads.num_kv_heads, target.heads.head_dim)
    draft_kv = (draft.heads.num_kv_heads, draft.heads.head_dim)
    if draft_kv != target_kv or draft.text.hidden_size != target.text.hidden_size:
        raise ValueError(f"the draft's KV heads, head size and hidden size {draft_kv + (draft.text.hidden_size,)} must "
                         f"be the target's {target_kv + (target.text.hidden_size,)}: its KV layers share the "
                         "target's pool and it reads the target's embedding")
    if EAGLE_ARCHITECTURES[arch] == "EAGLE":
        head: nn.Module = EagleHead(draft, first_kv_layer, fc_bias="fc.bias" in weights, tp=tp)
    else:
        head = Eagle3Head(draft, first_kv_layer, eagle3_aux_layers(draft, target.text.num_layers),
                          target.text.hidden_size, tp=tp)
    head.load_weights(weights.items())
    return head.eval().requires_grad_(False)


def strip_prefix(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Draft checkpoints save their tensors with or without a leading `model.`; ours take them without."""
    return {(n[len("model."):] if n.startswith("model.") else n): t for n, t in weights.items()}

