"""Executes the loaded model's structure (engine/model_structure.py) on CPU with native kernels.

Each step is one call of cpu_forward.c (engine/kernels/cpu_forward.py's binding) over the model's
weights and the runner's pools:

    fwd = NativeForward.create(model, req_to_token_pool, token_to_kv_pool)   # None: the reason is logged
    hidden = fwd.decode(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc)        # [bs, hidden]
    hidden = fwd.extend(input_ids, positions, out_cache_loc, req_pool_indices, prefix_lens, extend_lens)
    logits = fwd.logits(hidden[rows])      # [rows, vocab] float32, the model's LM head (fwd.has_logits)
    step = fwd.step(..., seq_lens=...); step.run()   # a whole step: forward, head, argmax -> step.next_ids

This is not a second model: it executes the one the model runner loaded, read through the plain
description the model gives of itself (`decoder_structure()`), its own weights (the packed linears'
copies) and nothing else of it. On CPU a small model's decode step is as much Python and dispatch as
arithmetic, even compiled: at batch 16 of the bench model on one thread, 2.5 ms of which the GEMMs
and the attention are 1.4 ms and the compiled graph's guards, wrapper and op dispatch ~0.7 ms. This
runs the same kernels (the packed bfloat16 GEMMs, the paged decode and extend attention) from C,
layer after layer, with the norms, RoPE and the KV store between them, so a step costs its kernels
and one call. It serves the decode and extend steps of bfloat16 Llama, Qwen2 and Qwen3 models (not
MoE) on CPUs with AVX512_BF16, with the packed linears, a bfloat16 KV cache and one TP rank; anything
else keeps the model's own forward (the reason is logged once). It rounds where the eager bfloat16
model rounds and sums the RMSNorm's squares in torch's order, so its logits, greedy tokens and
stored K/V are the eager model's bit for bit (the tests require it). `--disable-native-forward` or
`BATON_DISABLE_CPU_KERNELS=1` turn it off.

A batch runs as one model step (the forward and the LM head over each request's last token; for a
batch whose every sampling row is greedy, torch.argmax's choice too, and for the overlap loop its
future map), with no Python between; kernels/cpu_forward.py's ForwardStream runs such steps on a C
thread (worker/executors/native_stream.py). The C kernels, their build and their ctypes binding
live in engine/kernels/.
"""
from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.kernels import cpu_attention, cpu_linear
from baton.engine.kernels.build import KernelUnavailable
from baton.engine.kernels.cpu_forward import (SAMPLING_ROWS, LayerWeights, ModelStep, ModelStepStruct, NativeModel,
                                              as_int64, check_len, library, ptr_of, raise_on)

if TYPE_CHECKING:
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from baton.engine.model_structure import DecoderStructure

logger = logging.getLogger(__name__)


def unavailable_reason(model: torch.nn.Module, kv_pool: "MHATokenToKVPool", tp_size: int = 1,
                       device: str = "cpu") -> Optional[str]:
    """None when the native forward can serve this model; otherwise why not."""
    reason = cpu_linear.unavailable_reason(device) or cpu_attention.unavailable_reason(torch.bfloat16, device)
    if reason is not None:
        return reason
    if tp_size != 1:
        return "tensor parallelism (one rank only)"
    if getattr(model, "linear_state_shapes", lambda: None)() is not None:
        return f"{type(model).__name__} is a hybrid model (linear-attention layers keep a recurrent state)"
    describe = getattr(model, "decoder_structure", None)
    if describe is None:
        return f"{type(model).__name__} is not a Llama-family model (it describes no decoder structure)"
    s = describe()
    if s.embed.dtype != torch.bfloat16 or cpu_linear.is_released(s.embed) or not s.embed.is_contiguous():
        return f"the model is {s.embed.dtype}, not bfloat16"
    # the kernels read per-layer [slots, kv_heads, head_dim] K and V tensors (mem_cache/memory_pool.py)
    if getattr(kv_pool, "layout", None) != "mha" or kv_pool.dtype != torch.bfloat16:
        return f"the KV cache is {kv_pool.dtype} (bfloat16 only)"
    return _layers_reason(s, type(model).__name__)


def _layers_reason(s: "DecoderStructure", name: str) -> Optional[str]:
    norms, shapes = [s.final_norm], set()
    for layer in s.layers:
        attn, mlp = layer.attn, layer.mlp
        if mlp.kind != "gated":
            return f"{name} has layers other than dense Llama ones (MoE)"
        shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, id(attn.rope), mlp.intermediate))
        if mlp.act != "silu":
            return "the MLP's activation is not SiLU"
        for proj, lin in (("qkv_proj", attn.qkv), ("o_proj", attn.o), ("gate_up_proj", mlp.gate_up),
                          ("down_proj", mlp.down)):
            if lin.packed is None:
                return f"{proj} has no packed weight (--disable-packed-linear, or a shape the kernel does not take)"
            if lin.bias is not None and (proj != "qkv_proj" or lin.bias.dtype != torch.bfloat16):
                return f"{proj} has a bias" + (f" in {lin.bias.dtype}" if proj == "qkv_proj" else "")
        if not cpu_linear.silu_mul_fusable(mlp.gate_up.weight, mlp.gate_up.packed, None):
            return "the gate|up halves are not whole blocks of 16"
        if attn.rope.kind != "neox" or attn.rope.dim != attn.head_dim:
            return "the rotary embedding is not the standard one over the whole head"
        if attn.head_dim % 2 or attn.head_dim > cpu_attention.EXTEND_MAX_HEAD_DIM or attn.num_heads % attn.num_kv_heads:
            return "unsupported head layout"
        norms += [layer.input_norm, layer.post_norm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if len(shapes) > 1:
        return "the layers differ in heads, RoPE or MLP width"
    if any(n.kind != "rms" or n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
        return "a norm is not a bfloat16 RMSNorm"
    if len({n.eps for n in norms}) != 1:
        return "the norms' epsilons differ"
    return None


class NativeForward:
    """Executes one loaded model's forward over its pools (held for the engine's lifetime)."""

    def __init__(self, model: torch.nn.Module, req_to_token_pool: "ReqToTokenPool",
                 kv_pool: "MHATokenToKVPool") -> None:
        s = model.decoder_structure()
        first = s.layers[0].attn
        # the tables as of now: a later reserve() makes new ones, these stay valid for their positions
        cos, sin = first.rope.tables("cpu")
        self._cos, self._sin = cos.contiguous(), sin.contiguous()
        r2t = req_to_token_pool.req_to_token
        assert r2t.dtype == torch.int64 and r2t.is_contiguous()
        self._layers = (LayerWeights * len(s.layers))()
        for i, layer in enumerate(s.layers):
            attn, mlp = layer.attn, layer.mlp
            k_cache, v_cache = kv_pool.get_kv_buffer(i)
            assert k_cache.is_contiguous() and v_cache.is_contiguous()
            self._layers[i] = LayerWeights(
                layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(),
                ptr_of(attn.q_norm.weight if attn.q_norm is not None else None),
                ptr_of(attn.k_norm.weight if attn.k_norm is not None else None),
                attn.qkv.packed.data_ptr(), attn.o.packed.data_ptr(), mlp.gate_up.packed.data_ptr(),
                mlp.down.packed.data_ptr(), ptr_of(attn.qkv.bias), k_cache.data_ptr(), v_cache.data_ptr())
        self.hidden = s.embed.shape[1]
        self._model = NativeModel(
            layers=len(s.layers), hidden=self.hidden, heads=first.num_heads, kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, intermediate=s.layers[0].mlp.intermediate, vocab=s.embed.shape[0],
            max_positions=self._cos.shape[0], num_slots=kv_pool.get_kv_buffer(0)[0].shape[0],
            r2t_rows=r2t.shape[0], r2t_stride=r2t.shape[1], eps=s.final_norm.eps,
            scale=first.scale, embed=s.embed.data_ptr(), final_norm=s.final_norm.weight.data_ptr(),
            cos=self._cos.data_ptr(), sin=self._sin.data_ptr(), r2t=r2t.data_ptr(),
            layer=ctypes.cast(self._layers, ctypes.POINTER(LayerWeights)))
        # the LM head's packed copy (the embedding's when tied); None: the model's head scores
        packed = s.lm_head.packed
        self.vocab = s.embed.shape[0]
        fits = packed is not None and s.lm_head.weight.shape[0] == self.vocab and self.vocab % 16 == 0
        self._lm_head = packed if fits else None
        self._keep = (model, req_to_token_pool, kv_pool)  # what the pointers point into
        lib = library()
        self._decode, self._extend, self._logits = lib.decode_step, lib.extend_step, lib.logits_step
        self._model_ref = ctypes.byref(self._model)
        self._model_ptr = ctypes.pointer(self._model)  # a model step's
        self.num_threads = torch.get_num_threads()  # the model steps' threads (any thread may run them)

    @classmethod
    def create(cls, model: torch.nn.Module, req_to_token_pool: "ReqToTokenPool", kv_pool: "MHATokenToKVPool",
               tp_size: int = 1, device: str = "cpu") -> Optional["NativeForward"]:
        """The step for this model, or None (with the reason logged) where it cannot serve it."""
        try:
            reason = unavailable_reason(model, kv_pool, tp_size, device)
            if reason is None:
                step = cls(model, req_to_token_pool, kv_pool)
                logger.info("decode and extend steps run natively (cpu_forward.c): one call per step")
                return step
        except (KernelUnavailable, OSError) as e:
            reason = str(e)
        logger.info("the model's own forward serves every step: %s", reason)
        return None

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """[bs] int64 CPU tensors each -> the final norm's output [bs, hidden] bfloat16; stores each
        layer's K and V of the step at out_cache_loc."""
        ids, pos, rows, lens, loc = as_int64(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc)
        bs = ids.shape[0]
        check_len("decode", bs, pos, rows, lens, loc)
        out = torch.empty((bs, self.hidden), dtype=torch.bfloat16)
        raise_on(self._decode(self._model_ref, ids.data_ptr(), pos.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                              loc.data_ptr(), bs, out.data_ptr(), torch.get_num_threads()))
        return out

    def extend(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor) -> torch.Tensor:
        """input_ids, positions, out_cache_loc [n] (request after request); req_pool_indices,
        prefix_lens, extend_lens [bs] -> the final norm's output [n, hidden] bfloat16; stores every
        token's K and V at its slot."""
        ids, pos, loc, rows, prefix, ext = as_int64(input_ids, positions, out_cache_loc, req_pool_indices,
                                                    prefix_lens, extend_lens)
        n, bs = ids.shape[0], rows.shape[0]
        check_len("extend", n, pos, loc)
        check_len("extend", bs, prefix, ext)
        out = torch.empty((n, self.hidden), dtype=torch.bfloat16)
        raise_on(self._extend(self._model_ref, ids.data_ptr(), pos.data_ptr(), loc.data_ptr(), n, rows.data_ptr(),
                              prefix.data_ptr(), ext.data_ptr(), bs, out.data_ptr(), torch.get_num_threads()))
        return out


    @property
    def has_logits(self) -> bool:
        return self._lm_head is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: hidden [rows, hidden] bfloat16 (the final norm's output) -> [rows, vocab]
        float32, the model's compute_logits bit for bit (has_logits only)."""
        assert self._lm_head is not None, "no packed LM head"
        if hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(f"native logits: hidden must be [rows, {self.hidden}] bfloat16, got "
                             f"{tuple(hidden.shape)} {hidden.dtype}")
        hidden = hidden.contiguous()
        out = torch.empty((hidden.shape[0], self.vocab), dtype=torch.float32)
        raise_on(self._logits(self._model_ref, hidden.data_ptr(), hidden.shape[0], self._lm_head.data_ptr(),
                              out.data_ptr(), torch.get_num_threads()))
        return out

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
             req_pool_indices: torch.Tensor, seq_lens: Optional[torch.Tensor] = None,
             prefix_lens: Optional[torch.Tensor] = None, extend_lens: Optional[torch.Tensor] = None,
             future_map: Optional[torch.Tensor] = None, future_slots: Optional[torch.Tensor] = None,
             greedy: bool = True, sampling: Optional[dict[str, torch.Tensor]] = None) -> "ModelStep":
        """A whole step up to each request's last-token logits, ready to run (`.run()`, or a
        ForwardStream): a decode (`seq_lens`) or an extend (`prefix_lens`, `extend_lens`, every
        request at least one token), the inputs as decode() and extend() take them. `greedy`: on to
        the argmax (`.next_ids`), else the logits stay (`.logits` [bs, vocab] float32) for a sampler.
        `sampling` (with greedy): each row drawn instead of the argmax (cpu_sampling.c): per-row
        `temperatures`, `top_ks`, `top_ps`, `min_ps`, `seeds`, `counters` [bs] as cpu_sampling.sample
        takes them (a temperature of 0: the argmax). With `future_map` (the overlap loop's int64
        ring), ids < 0 are -slots of it, resolved first, and the tokens go to `future_slots` [bs]
        (not for a step that leaves its logits). Needs has_logits."""
        assert self._lm_head is not None, "no packed LM head"
        decode = seq_lens is not None
        ids = input_ids.to(torch.int64).clone()  # resolved in place
        if decode:
            pos, loc, rows, lens = as_int64(positions, out_cache_loc, req_pool_indices, seq_lens)
            prefix = ext = None
            bs = ids.shape[0]
            check_len("decode", bs, pos, rows, lens, loc)
        else:
            pos, loc, rows, prefix, ext = as_int64(positions, out_cache_loc, req_pool_indices, prefix_lens,
                                                   extend_lens)
            lens = None
            bs = rows.shape[0]
            check_len("extend", ids.shape[0], pos, loc)
            check_len("extend", bs, prefix, ext)
        slots = None
        if future_map is not None:
            assert future_map.dtype == torch.int64 and future_map.is_contiguous() and future_map.device.type == "cpu"
            (slots,) = as_int64(future_slots if future_slots is not None else torch.zeros(bs, dtype=torch.int64))
            check_len("model", bs, slots)
        next_ids = torch.empty(bs, dtype=torch.int64)
        logits = None if greedy else torch.empty((bs, self.vocab), dtype=torch.float32)
        rows_in: dict[str, Optional[int]] = dict.fromkeys(SAMPLING_ROWS)
        if sampling is not None:
            assert greedy, "a sampling step draws its tokens: it keeps no logits"
            sampling = {name: sampling[name].to(dtype).contiguous() for name, dtype in SAMPLING_ROWS.items()}
            check_len("sampling", bs, *sampling.values())
            rows_in = {name: t.data_ptr() for name, t in sampling.items()}
        struct = ModelStepStruct(
            model=self._model_ptr, lm_head=self._lm_head.data_ptr(), n=ids.shape[0], bs=bs,
            ids=ids.data_ptr(), positions=pos.data_ptr(), loc=loc.data_ptr(), rows=rows.data_ptr(),
            lens=ptr_of(lens), prefix_lens=ptr_of(prefix), extend_lens=ptr_of(ext), future_map=ptr_of(future_map),
            future_len=0 if future_map is None else future_map.shape[0], future_slots=ptr_of(slots),
            next_ids=next_ids.data_ptr(), logits=ptr_of(logits), **rows_in, num_threads=self.num_threads)
        return ModelStep(struct, next_ids, logits,
                         (ids, pos, loc, rows, lens, prefix, ext, future_map, slots, sampling, self))
