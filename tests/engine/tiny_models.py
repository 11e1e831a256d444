"""Tiny random-weight HF checkpoints (+ an offline tokenizer) for engine tests.

    path = make_tiny_model("qwen3", tmp_path / "qwen3")      # llama | qwen2 | qwen3 | qwen3_moe | HYBRID_ARCHS
    AutoModelForCausalLM.from_pretrained(path)  /  load_model(str(path))  /  AutoTokenizer.from_pretrained(path)

Weights use initializer_range 0.15 instead of the usual 0.02. With 0.02 a 64-wide random model is
nearly inert: attention is almost uniform and logits are almost flat (std ~0.16), so a masking or
indexing bug could move logits by less than the test tolerance. With 0.15 every layer matters,
logits have std ~1.2 and the median top-1/top-2 gap is ~0.3, orders of magnitude above float32
rounding differences between two implementations (~1e-6): greedy ties are implausible, so
token-for-token comparisons against transformers are meaningful and atol 1e-4 on logits is tight.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# ids follow SPECIAL_TOKENS order (the BPE trainer adds them first). <|endoftext|> is there because
# transformers' Qwen2Tokenizer (picked by AutoTokenizer for model_type qwen2) adds it when missing.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Baton hands the KV cache from prefill pods to decode pods.",
    "Hello world! How are you today? I am a tiny language model.",
    "Prefill first, then decode one token at a time, batch after batch.",
    "0123456789 + - * / = ( ) [ ] { } < > , ; : ' \" ? !",
]

_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
             initializer_range=0.15, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
             tie_word_embeddings=False)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
# Hybrids (Gated DeltaNet + gated attention): four layers, linear and full attention alternating (so
# full-attention layer 3 is KV layer 1 and linear layer 2 is state layer 1), partial RoPE 0.25.
_HYBRID = {"head_dim": 16, "num_hidden_layers": 4,
           "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_HYBRID_MOE = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4,
               "num_experts_per_tok": 2}
ARCH_DEFAULTS.update({
    "qwen3_next": {**_HYBRID, **_HYBRID_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    "qwen3_5": dict(_HYBRID),
    "qwen3_5_moe": {**_HYBRID, **_HYBRID_MOE},
})
HYBRID_ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _config_and_model_classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
    }[arch]


def make_tiny_model(arch: str, path: Union[str, os.PathLike], seed: int = 0, extra_tokens: tuple[str, ...] = (),
                    mtp: bool = False, **overrides: Any) -> str:
    """Build, save (safetensors, float32) and return the directory of a tiny random `arch` model.
    `mtp` (hybrids): with a random multi-token-prediction head (`mtp.*`, MtpReference), as the
    published Qwen3-Next / Qwen3.5 checkpoints carry one."""
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(ARCH_DEFAULTS)}")
    config_cls, model_cls = _config_and_model_classes(arch)
    if mtp:  # each family's config key (model_config.ModelConfig.num_mtp_layers)
        overrides = {**overrides, ("num_nextn_predict_layers" if arch == "qwen3_next" else "mtp_num_hidden_layers"): 1}
    config = config_cls(**{**_BASE, **ARCH_DEFAULTS[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize_zero_params(model, config.initializer_range)
    path = os.fspath(path)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size, extra_tokens)
    if mtp:
        from safetensors.torch import load_file, save_file

        head = MtpReference(model)
        with torch.no_grad():  # every weight drawn here (a module built outside from_pretrained starts empty)
            for name, p in head.named_parameters():
                p.normal_(0.0, config.initializer_range if p.ndim >= 2 else 0.3)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        tensors.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
        save_file(tensors, file, metadata={"format": "pt"})
    return path


class MtpReference(torch.nn.Module):
    """A hybrid checkpoint's `mtp.*` head built from transformers' own modules (transformers skips
    these weights; vLLM's and SGLang's Qwen3-Next MTP compute the same): fc over [pre-normed
    embedding ; pre-normed hidden], one full-attention decoder layer of the model's classes (its MLP
    the kind of a layer after the last), the final norm; the model's embedding and LM head."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy

        super().__init__()
        config = copy.deepcopy(model.config)
        n, hidden = config.num_hidden_layers, config.hidden_size
        config.layer_types = list(config.layer_types) + ["full_attention"]
        config.num_hidden_layers = n + 1
        norm = type(model.model.norm)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([type(model.model.layers[0])(config, n)])
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        self._model = [model]  # not a submodule: its weights are not the head's
        self.to(torch.float32).eval()

    @classmethod
    def load(cls, path: str) -> "MtpReference":
        """The head saved in a make_tiny_model(..., mtp=True) checkpoint, on its HF model."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        head = cls(model)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        head.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("mtp.")})
        return head

    @torch.no_grad()
    def chain(self, tokens: list[int], steps: int) -> list[int]:
        """The greedy chain NEXTN drafts after `tokens` (a prompt and the token sampled after it): the
        head over every position p of (token p + 1, the model's final hidden state at p), causally,
        then step by step over (its draft, its own output at the previous position)."""
        model = self._model[0]
        ids = torch.tensor([tokens])
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # [n - 1, hidden]: positions 0 .. n - 2
        inputs, states, drafts = list(tokens[1:]), list(hidden), []
        for _ in range(steps):
            out = self._run(torch.tensor([inputs]), torch.stack(states)[None])[0]
            drafts.append(int(torch.argmax(model.lm_head(out[-1]))))
            inputs.append(drafts[-1])
            states.append(out[-1])
        return drafts

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """ids [b, t], the model's hidden states [b, t, hidden] -> the head's outputs [b, t, hidden],
        causally over the t positions."""
        model = self._model[0]
        t = ids.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(model.model.embed_tokens(ids)),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask,
                           position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        return self.norm(x)


class EagleReference(torch.nn.Module):
    """An EAGLE draft head built from transformers' Llama modules, as the EAGLE authors define it
    (SafeAILab/EAGLE; SGLang's llama_eagle.py / llama_eagle3.py compute the same), over a target HF model.

    EAGLE:  out = layer(fc([embed(t[p+1]) ; state[p]])), the layer without its input norm; the target's
            LM head reads out. state: the target's final hidden state, or the head's own out.
    EAGLE3: g = fc(the target's states entering three layers) (or the head's own out), attention over
            [input_norm(embed) ; hidden_norm(g)] with g as residual, MLP; its own norm and LM head over
            a reduced vocabulary, draft id i meaning target id i + d2t[i]."""

    def __init__(self, target: torch.nn.Module, kind: str, draft_vocab: int = 0, aux_layer_ids=(0, 1, 2),
                 intermediate_size: int = 96) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        tc = target.config
        hidden = tc.hidden_size
        self.kind = kind
        self.config = LlamaConfig(
            vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate_size, num_hidden_layers=1,
            num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
            head_dim=getattr(tc, "head_dim", None) or hidden // tc.num_attention_heads,
            max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=1e-6,
            rope_theta=float(getattr(tc, "rope_theta", None) or 50000.0),
            tie_word_embeddings=False, architectures=["LlamaForCausalLMEagle" if kind == "EAGLE" else "LlamaForCausalLMEagle3"])
        self.config._attn_implementation = "eager"
        self.rotary = LlamaRotaryEmbedding(self.config)
        layer = LlamaDecoderLayer(self.config, 0)
        if kind == "EAGLE":
            self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
            layer.input_layernorm = torch.nn.Identity()
            self.layers = torch.nn.ModuleList([layer])
        else:
            self.config.draft_vocab_size = draft_vocab
            self.config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
            self.aux_layers = [i + 1 for i in aux_layer_ids]  # the states entering these target layers
            self.fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # q/k/v read [embedding ; state]
                old = getattr(attn, name)
                setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=False))
            self.midlayer = torch.nn.Module()
            self.midlayer.self_attn, self.midlayer.mlp = attn, LlamaMLP(self.config)
            for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
                setattr(self.midlayer, name, LlamaRMSNorm(hidden, eps=1e-6))
            self.norm = LlamaRMSNorm(hidden, eps=1e-6)
            self.lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self._target = [target]  # not a submodule: its weights are not the head's
        self.to(torch.float32).eval()

    @torch.no_grad()
    def randomize(self, std: float, seed: int) -> None:
        """Every weight drawn (norms near 1), and EAGLE3's draft vocabulary a random subset of the target's."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.ndim >= 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        if self.kind == "EAGLE3":
            n = self.d2t.numel()
            hot = torch.randperm(self._target[0].config.vocab_size, generator=gen)[:n].sort().values
            self.d2t.copy_(hot - torch.arange(n))

    def fit(self, sequences: list[list[int]], steps: int, lr: float = 1e-2, decoy: float = 0.0) -> float:
        """Train the head on the target's own greedy continuations (`sequences`: prompt + output): at
        every position, from the target's state there and the next token, the token after it (the
        EAGLE authors' objective, without their feature loss). Returns the last mean loss. A few dozen
        steps make the head predict these sequences, so the engine's drafts for them get accepted.
        `decoy` w: the label weighs 1 - w and a wrong token (the next id) w, so with w > 0.5 the head's
        argmax is wrong where it learned and its second choice right (a tree's second branch)."""
        target = self._target[0]
        data = []
        with torch.no_grad():
            for seq in sequences:
                out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
                states = (out.last_hidden_state[0] if self.kind == "EAGLE"
                          else torch.cat([out.hidden_states[i][0] for i in self.aux_layers], dim=-1))
                labels = torch.tensor(seq[2:])
                if self.kind == "EAGLE3":  # as draft ids; a token outside the draft vocabulary teaches nothing
                    to_draft = torch.full((target.config.vocab_size,), -100)
                    to_draft[self.d2t + torch.arange(self.d2t.numel())] = torch.arange(self.d2t.numel())
                    labels = to_draft[labels]
                data.append((torch.tensor(seq[1:-1]), states[:-2], labels))
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            total = 0.0
            for ids, states, labels in data:
                if self.kind == "EAGLE3":
                    states = self.fc(states)
                out = self._run(ids[None], states[None])[0]
                logits = target.lm_head(out) if self.kind == "EAGLE" else self.lm_head(self.norm(out))
                wrong = torch.where(labels >= 0, (labels + 1) % logits.shape[-1], labels)
                total = total + (1 - decoy) * torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
                if decoy:
                    total = total + decoy * torch.nn.functional.cross_entropy(logits, wrong, ignore_index=-100)
            opt.zero_grad()
            total.backward()
            opt.step()
        return float(total.detach()) / len(data)

    def save(self, path: Union[str, os.PathLike]) -> str:
        """The published layouts: EAGLE as pytorch_model.bin (layers.N.*, fc with bias, a copy of the
        target's embedding), EAGLE3 as safetensors (midlayer.*, d2t / t2d, its lm_head)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.config.save_pretrained(path)
        tensors = {k: v.contiguous() for k, v in self.state_dict().items() if k != "d2t"}
        tensors["embed_tokens.weight"] = self._target[0].model.embed_tokens.weight.detach().clone()
        if self.kind == "EAGLE":
            torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
        else:
            from safetensors.torch import save_file

            t2d = torch.zeros(self._target[0].config.vocab_size, dtype=torch.bool)
            t2d[self.d2t + torch.arange(self.d2t.numel())] = True
            save_file({**tensors, "d2t": self.d2t, "t2d": t2d}, os.path.join(path, "model.safetensors"))
        return path

    @torch.no_grad()
    def chain(self, tokens: list[int], steps: int) -> list[int]:
        """The greedy chain the engine drafts after `tokens` (a prompt and the token sampled after it):
        the head over every position p of (token p + 1, the target's state at p), causally, then step
        by step over (its draft, its own output at the previous position)."""
        return self.branches(tokens, steps, 1)[0]

    def _prompt_states(self, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The head's inputs over the prompt (the target's states at positions 0 .. n - 2; EAGLE-3: after
        its fc) and its output at the last position, whose predictions are the first drafts."""
        out = self._target[0].model(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if self.kind == "EAGLE":
            states = list(out.last_hidden_state[0])
        else:
            states = list(self.fc(torch.cat([out.hidden_states[i][0] for i in self.aux_layers], dim=-1)))
        return states, self._run(torch.tensor([tokens[1:]]), torch.stack(states)[None])[0, -1]

    @torch.no_grad()
    def branches(self, tokens: list[int], steps: int, topk: int) -> list[list[int]]:
        """The tree the engine drafts with --speculative-eagle-topk `topk`: for each of the head's `topk`
        best first drafts (best first), the chain that goes on from it greedily."""
        states, first = self._prompt_states(tokens)
        trees = []
        for token in self._draft_ids(first, topk):
            inputs, drafts, outs = list(tokens[1:]) + [token], [token], states + [first]
            for _ in range(steps - 1):
                last = self._run(torch.tensor([inputs]), torch.stack(outs)[None])[0, -1]
                drafts.append(self._draft_ids(last, 1)[0])
                inputs.append(drafts[-1])
                outs.append(last)
            trees.append(drafts)
        return trees

    @torch.no_grad()
    def best_first(self, tokens: list[int], steps: int, topk: int, nodes: int) -> tuple[list[int], list[int]]:
        """The tree the engine drafts with --speculative-eagle-topk `topk` > 1, grown best-first as SGLang's
        EAGLE does: the head's topk best first drafts are the leaves; `steps` - 1 times every leaf's topk
        best children join the candidates, each scored by the sum of the head's log-probabilities along
        its path, and the topk best children are the next leaves; the tree is the `nodes` best
        candidates (ties: the shallower, then the first drafted). Returns (parents, drafts) packed by
        depth, then score."""
        states, first = self._prompt_states(tokens)
        ids, lps = self._scored(first, topk)
        # a node: its score, depth, parent (0: the root), token, and the head's outputs its path ran on
        cands: list[dict] = [dict(score=0.0, depth=0, parent=-1, path=[], outs=states + [first])]
        leaves = []
        for token, lp in zip(ids, lps):
            cands.append(dict(score=lp, depth=1, parent=0, path=[token], outs=states + [first]))
            leaves.append(len(cands) - 1)
        for _ in range(steps - 1):
            children = []
            for leaf in leaves:
                c = cands[leaf]
                last = self._run(torch.tensor([list(tokens[1:]) + c["path"]]), torch.stack(c["outs"])[None])[0, -1]
                for token, lp in zip(*self._scored(last, topk)):
                    cands.append(dict(score=c["score"] + lp, depth=c["depth"] + 1, parent=leaf,
                                      path=c["path"] + [token], outs=c["outs"] + [last]))
                    children.append(len(cands) - 1)
            leaves = sorted(children, key=lambda n: -cands[n]["score"])[:topk]
        chosen = sorted(range(1, len(cands)), key=lambda n: (-cands[n]["score"], cands[n]["depth"], n))[:nodes]
        chosen.sort(key=lambda n: (cands[n]["depth"], -cands[n]["score"], n))
        index = {0: 0, **{n: k + 1 for k, n in enumerate(chosen)}}
        return [-1] + [index[cands[n]["parent"]] for n in chosen], [cands[n]["path"][-1] for n in chosen]

    def _scored(self, out: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """The head's k best next tokens after `out` and their log-probabilities (float32) over the
        vocabulary it drafts from."""
        if self.kind == "EAGLE":
            logits = self._target[0].lm_head(out)
            logits = logits if self.hot is None else logits[..., self.hot]
        else:
            logits = self.lm_head(self.norm(out))
        lp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.topk(logits, k).indices
        if self.kind == "EAGLE":
            ids = idx if self.hot is None else self.hot[idx]
        else:
            ids = idx + self.d2t[idx]
        return ids.tolist(), lp[idx].tolist()

    # EAGLE with --speculative-token-map: the token ids its drafts are chosen among (None: all)
    hot: Optional[torch.Tensor] = None

    def _draft_ids(self, out: torch.Tensor, k: int) -> list[int]:
        if self.kind == "EAGLE":
            logits = self._target[0].lm_head(out)
            if self.hot is not None:
                return self.hot[torch.topk(logits[..., self.hot], k).indices].tolist()
            return torch.topk(logits, k).indices.tolist()
        ids = torch.topk(self.lm_head(self.norm(out)), k).indices
        return (ids + self.d2t[ids]).tolist()

    def _run(self, ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """ids [1, t], states [1, t, hidden] (EAGLE3: after its fc) -> the head's outputs [1, t, hidden]."""
        embeds = self._target[0].model.embed_tokens(ids)
        t = ids.shape[1]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        if self.kind == "EAGLE":
            x = self.fc(torch.cat([embeds, states], dim=-1))
            x = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                               position_ids=positions)
            return x[0] if isinstance(x, tuple) else x
        m = self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(states)], dim=-1)
        a = m.self_attn(x, position_embeddings=self.rotary(states, positions), attention_mask=mask)[0]
        h = a + states
        return m.mlp(m.post_attention_layernorm(h)) + h


def make_eagle_draft(target_path: Union[str, os.PathLike], path: Union[str, os.PathLike], kind: str,
                     seed: int = 0, std: float = 0.15, draft_vocab: int = 256,
                     fit_on: Optional[list[list[int]]] = None, fit_steps: int = 50, decoy: float = 0.0) -> str:
    """A random EAGLE (kind "EAGLE") or EAGLE-3 ("EAGLE3") draft checkpoint for the tiny model at
    `target_path`, in the published layout (EagleReference.save); `fit_on`: trained on those sequences
    (EagleReference.fit, with `decoy`) so that drafts for them are accepted."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(os.fspath(target_path), dtype=torch.float32).eval()
    target.requires_grad_(False)
    head = EagleReference(target, kind, draft_vocab)
    head.randomize(std, seed)
    if fit_on:
        torch.manual_seed(seed)
        head.fit(fit_on, fit_steps, decoy=decoy)
    return head.save(path)


def load_eagle_reference(target_path: str, draft_path: str) -> EagleReference:
    """A saved draft (make_eagle_draft) back as its reference, over its target's HF model."""
    import json

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    with open(os.path.join(draft_path, "config.json")) as f:
        config = json.load(f)
    kind = "EAGLE3" if config["architectures"][0].endswith("Eagle3") else "EAGLE"
    head = EagleReference(target, kind, config.get("draft_vocab_size", 0),
                          tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", (0, 1, 2))))
    if kind == "EAGLE":
        tensors = torch.load(os.path.join(draft_path, "pytorch_model.bin"), weights_only=True)
    else:
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(draft_path, "model.safetensors"))
    head.load_state_dict({k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "t2d")})
    return head


@torch.no_grad()
def _randomize_zero_params(model: torch.nn.Module, std: float) -> None:
    # Some modules start at zero (e.g. the MoE router): every expert would tie and top-k picks would
    # depend on tie-breaking rather than on the math under test. The hybrids' (1 + w) norms start at
    # w = 0: a small random w makes each norm's weight (and which norm is which) matter.
    for name, p in model.named_parameters():
        if p.ndim >= 2 and not p.any():
            p.normal_(0.0, std)
        elif p.ndim == 1 and name.endswith("norm.weight") and not p.any():
            p.normal_(0.0, 0.3)


def save_tiny_tokenizer(path: Union[str, os.PathLike], vocab_size: int = VOCAB_SIZE,
                        extra_tokens: tuple[str, ...] = ()) -> None:
    """A byte-level BPE trained in-process, padded with plain added tokens up to exactly `vocab_size`
    so that every id a random model can emit decodes to something. `extra_tokens` (e.g. "</think>")
    are added first, each one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_tokens(list(extra_tokens))
    filler = vocab_size - tok.get_vocab_size()
    assert filler >= 0, "tokenizer vocab exceeds the model vocab"
    tok.add_tokens([f"<|x{i}|>" for i in range(filler)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [PAD_ID, BOS_ID, EOS_ID]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(os.fspath(path))


ENCODER_LAYOUTS = ("causal", "bare", "bare_causal", "classifier")


def make_tiny_encoder(arch: str, path: Union[str, os.PathLike], layout: str, seed: int = 0, num_labels: int = 3,
                      **overrides: Any) -> str:
    """A tiny random checkpoint (llama | qwen2 | qwen3) for --is-embedding, in one of the layouts such
    models ship in:

        causal       *ForCausalLM, LM head and all (any generation checkpoint)
        bare         the bare decoder (*Model): no LM head, weights without the `model.` prefix
        bare_causal  bare weights under architecture *ForCausalLM (Qwen3-Embedding's layout)
        classifier   *ForSequenceClassification: a `score` head of `num_labels` rows
    """
    import json

    import transformers as tf

    if layout == "causal":
        return make_tiny_model(arch, path, seed=seed, **overrides)
    config_cls, causal_cls = _config_and_model_classes(arch)
    config = config_cls(**{**_BASE, **ARCH_DEFAULTS[arch], **overrides})
    torch.manual_seed(seed)
    path = os.fspath(path)
    if layout == "classifier":
        config.num_labels = num_labels
        model = getattr(tf, causal_cls.__name__.replace("ForCausalLM", "ForSequenceClassification"))(config)
        _randomize_zero_params(model.to(torch.float32).eval(), config.initializer_range)
        model.save_pretrained(path)
    else:
        model = causal_cls(config).to(torch.float32).eval()
        _randomize_zero_params(model, config.initializer_range)
        model.model.save_pretrained(path)  # architectures: [*Model]; names without `model.`
        if layout == "bare_causal":
            with open(os.path.join(path, "config.json")) as f:
                saved = json.load(f)
            saved["architectures"] = [causal_cls.__name__]
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(saved, f)
    save_tiny_tokenizer(path, config.vocab_size)
    return path
