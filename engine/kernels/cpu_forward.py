"""The whole forward of a dense Llama-family model in one native call per step (`cpu_forward.c`).

    fwd = NativeForward.create(model, req_to_token_pool, token_to_kv_pool)   # None: the reason is logged
    hidden = fwd.decode(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc)        # [bs, hidden]
    hidden = fwd.extend(input_ids, positions, out_cache_loc, req_pool_indices, prefix_lens, extend_lens)
    logits = fwd.logits(hidden[rows])      # [rows, vocab] float32, the model's LM head (fwd.has_logits)
    step = fwd.step(..., seq_lens=...); step.run()   # a whole step: forward, head, argmax -> step.next_ids
    stream = ForwardStream(fwd.num_threads); stream.submit(step); stream.wait(step)   # on a C thread

On CPU a small model's decode step is as much Python and dispatch as arithmetic, even compiled:
at batch 16 of the bench model on one thread, 2.5 ms of which the GEMMs and the attention are
1.4 ms and the compiled graph's guards, wrapper and op dispatch ~0.7 ms. This runs the same
kernels (the packed bfloat16 GEMMs, the paged decode and extend attention) from C, layer after
layer, with the norms, RoPE and the KV store between them, so a step costs its kernels and one
call. It serves the decode and extend steps of bfloat16 Llama, Qwen2 and Qwen3 models (not MoE) on
CPUs with AVX512_BF16, with the packed linears, a bfloat16 KV cache and one TP rank; anything else
keeps the model's own forward (the reason is logged once). It knows a model only through the plain
description the model gives of itself (`decoder_structure()`, engine/model_structure.py). It rounds
where the eager bfloat16 model rounds and sums the RMSNorm's squares in torch's order, so its
logits, greedy tokens and stored K/V are the eager model's bit for bit (the tests require it).
`--disable-native-forward` or `BATON_DISABLE_CPU_KERNELS=1` turn it off.

A batch runs as one model step (the forward and the LM head over each request's last token; for a
batch whose every sampling row is greedy, torch.argmax's choice too, and for the overlap loop its
future map), with no Python between; a ForwardStream runs such steps, each maybe followed by a
Python sampler, on a C thread in submission order: the overlap loop's forward on CPU
(worker/executors/native_stream.py).

Its parallel loops run on parallel.h's crew rather than OpenMP: chunks claimed by whoever is free,
no barrier that waits for a thread the OS took off its core, and, on a stream, the thread waiting
for the step working in place of a helper thread.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from baton.engine.kernels import cpu_attention, cpu_linear
from baton.engine.kernels.build import DEFAULT_CFLAGS, KernelUnavailable, build_library

if TYPE_CHECKING:
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from baton.engine.model_structure import DecoderStructure

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_forward.c")
_ERRORS = {1: "out of memory", 2: "a token id, position, slot or request row out of range",
           3: "this build has no AVX512_BF16",  # KERNEL_NO_MEMORY, KERNEL_BAD_INDEX, FORWARD_UNSUPPORTED
           4: "a placeholder token id or slot outside the future map"}  # STEP_BAD_FUTURE

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):  # LayerWeights in cpu_forward.c, field for field
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up",
                                          "down", "qkv_bias", "k_cache", "v_cache")]


class _Model(ctypes.Structure):  # NativeModel
    _fields_ = ([(name, _i64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                           "vocab", "max_positions", "num_slots", "r2t_rows", "r2t_stride")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, _ptr) for name in ("embed", "final_norm", "cos", "sin", "r2t")]
                + [("layer", ctypes.POINTER(_Layer))])


class _ModelStep(ctypes.Structure):  # ModelStep
    _fields_ = ([("model", ctypes.POINTER(_Model)), ("lm_head", _ptr), ("n", _i64), ("bs", _i64)]
                + [(name, _ptr) for name in ("ids", "positions", "loc", "rows", "lens", "prefix_lens", "extend_lens",
                                             "future_map")]
                + [("future_len", _i64), ("future_slots", _ptr), ("next_ids", _ptr), ("logits", _ptr)]
                + [(name, _ptr) for name in ("temperatures", "top_ps", "min_ps", "top_ks", "seeds", "counters")]
                + [("num_threads", ctypes.c_int), ("err", ctypes.c_int), ("done", ctypes.c_int), ("next", _ptr),
                   ("call", _ptr)])


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)
# a sampling step's per-row inputs and their dtypes (seeds and counters: uint64 in C, same bits)
_SAMPLING_ROWS = {"temperatures": torch.float32, "top_ps": torch.float32, "min_ps": torch.float32,
                  "top_ks": torch.int64, "seeds": torch.int64, "counters": torch.int64}


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, DEFAULT_CFLAGS)))
    # model, ids, positions, rows, lens, loc, bs, out, num_threads
    lib.decode_step.argtypes = [ctypes.POINTER(_Model), _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
    lib.decode_step.restype = ctypes.c_int
    # model, ids, positions, loc, n, rows, prefix_lens, extend_lens, bs, out, num_threads
    lib.extend_step.argtypes = [ctypes.POINTER(_Model), _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
                                ctypes.c_int]
    lib.extend_step.restype = ctypes.c_int
    # model, hidden, rows, packed LM head, out, num_threads
    lib.logits_step.argtypes = [ctypes.POINTER(_Model), _ptr, _i64, _ptr, _ptr, ctypes.c_int]
    lib.logits_step.restype = ctypes.c_int
    lib.model_step.argtypes = [ctypes.POINTER(_ModelStep)]
    lib.model_step.restype = ctypes.c_int
    lib.stream_create.argtypes, lib.stream_create.restype = [ctypes.c_int], _ptr
    lib.openmp_hand_over.argtypes, lib.openmp_hand_over.restype = [], ctypes.c_int
    lib.stream_submit.argtypes, lib.stream_submit.restype = [_ptr, ctypes.POINTER(_ModelStep)], None
    lib.stream_wait.argtypes, lib.stream_wait.restype = [_ptr, ctypes.POINTER(_ModelStep)], ctypes.c_int
    lib.stream_destroy.argtypes, lib.stream_destroy.restype = [_ptr], None
    lib.rms_norm_bf16.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr]  # x, rows, n, weight, eps, y
    lib.rms_norm_bf16.restype = None
    # num_threads, n, grain, wait_ms, hits, slots (int32 [n] each): parallel.h's crew, for the tests
    lib.par_selftest.argtypes, lib.par_selftest.restype = [ctypes.c_int, _i64, _i64, ctypes.c_int, _ptr, _ptr], \
        ctypes.c_int
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The native forward's RMSNorm alone, over the rows of a contiguous bfloat16 x (for the tests)."""
    y = torch.empty_like(x)
    _library().rms_norm_bf16(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, y.data_ptr())
    return y


def _ptr_of(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


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
    """The forward of one loaded model over its pools (held for the engine's lifetime)."""

    def __init__(self, model: torch.nn.Module, req_to_token_pool: "ReqToTokenPool",
                 kv_pool: "MHATokenToKVPool") -> None:
        s = model.decoder_structure()
        first = s.layers[0].attn
        # the tables as of now: a later reserve() makes new ones, these stay valid for their positions
        cos, sin = first.rope.tables("cpu")
        self._cos, self._sin = cos.contiguous(), sin.contiguous()
        r2t = req_to_token_pool.req_to_token
        assert r2t.dtype == torch.int64 and r2t.is_contiguous()
        self._layers = (_Layer * len(s.layers))()
        for i, layer in enumerate(s.layers):
            attn, mlp = layer.attn, layer.mlp
            k_cache, v_cache = kv_pool.get_kv_buffer(i)
            assert k_cache.is_contiguous() and v_cache.is_contiguous()
            self._layers[i] = _Layer(
                layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(),
                _ptr_of(attn.q_norm.weight if attn.q_norm is not None else None),
                _ptr_of(attn.k_norm.weight if attn.k_norm is not None else None),
                attn.qkv.packed.data_ptr(), attn.o.packed.data_ptr(), mlp.gate_up.packed.data_ptr(),
                mlp.down.packed.data_ptr(), _ptr_of(attn.qkv.bias), k_cache.data_ptr(), v_cache.data_ptr())
        self.hidden = s.embed.shape[1]
        self._model = _Model(
            layers=len(s.layers), hidden=self.hidden, heads=first.num_heads, kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, intermediate=s.layers[0].mlp.intermediate, vocab=s.embed.shape[0],
            max_positions=self._cos.shape[0], num_slots=kv_pool.get_kv_buffer(0)[0].shape[0],
            r2t_rows=r2t.shape[0], r2t_stride=r2t.shape[1], eps=s.final_norm.eps,
            scale=first.scale, embed=s.embed.data_ptr(), final_norm=s.final_norm.weight.data_ptr(),
            cos=self._cos.data_ptr(), sin=self._sin.data_ptr(), r2t=r2t.data_ptr(),
            layer=ctypes.cast(self._layers, ctypes.POINTER(_Layer)))
        # the LM head's packed copy (the embedding's when tied); None: the model's head scores
        packed = s.lm_head.packed
        self.vocab = s.embed.shape[0]
        fits = packed is not None and s.lm_head.weight.shape[0] == self.vocab and self.vocab % 16 == 0
        self._lm_head = packed if fits else None
        self._keep = (model, req_to_token_pool, kv_pool)  # what the pointers point into
        lib = _library()
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
        ids, pos, rows, lens, loc = _as_int64(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc)
        bs = ids.shape[0]
        _check_len("decode", bs, pos, rows, lens, loc)
        out = torch.empty((bs, self.hidden), dtype=torch.bfloat16)
        _raise_on(self._decode(self._model_ref, ids.data_ptr(), pos.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                               loc.data_ptr(), bs, out.data_ptr(), torch.get_num_threads()))
        return out

    def extend(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor) -> torch.Tensor:
        """input_ids, positions, out_cache_loc [n] (request after request); req_pool_indices,
        prefix_lens, extend_lens [bs] -> the final norm's output [n, hidden] bfloat16; stores every
        token's K and V at its slot."""
        ids, pos, loc, rows, prefix, ext = _as_int64(input_ids, positions, out_cache_loc, req_pool_indices,
                                                     prefix_lens, extend_lens)
        n, bs = ids.shape[0], rows.shape[0]
        _check_len("extend", n, pos, loc)
        _check_len("extend", bs, prefix, ext)
        out = torch.empty((n, self.hidden), dtype=torch.bfloat16)
        _raise_on(self._extend(self._model_ref, ids.data_ptr(), pos.data_ptr(), loc.data_ptr(), n, rows.data_ptr(),
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
        _raise_on(self._logits(self._model_ref, hidden.data_ptr(), hidden.shape[0], self._lm_head.data_ptr(),
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
            pos, loc, rows, lens = _as_int64(positions, out_cache_loc, req_pool_indices, seq_lens)
            prefix = ext = None
            bs = ids.shape[0]
            _check_len("decode", bs, pos, rows, lens, loc)
        else:
            pos, loc, rows, prefix, ext = _as_int64(positions, out_cache_loc, req_pool_indices, prefix_lens,
                                                    extend_lens)
            lens = None
            bs = rows.shape[0]
            _check_len("extend", ids.shape[0], pos, loc)
            _check_len("extend", bs, prefix, ext)
        slots = None
        if future_map is not None:
            assert future_map.dtype == torch.int64 and future_map.is_contiguous() and future_map.device.type == "cpu"
            (slots,) = _as_int64(future_slots if future_slots is not None else torch.zeros(bs, dtype=torch.int64))
            _check_len("model", bs, slots)
        next_ids = torch.empty(bs, dtype=torch.int64)
        logits = None if greedy else torch.empty((bs, self.vocab), dtype=torch.float32)
        rows_in: dict[str, Optional[int]] = dict.fromkeys(_SAMPLING_ROWS)
        if sampling is not None:
            assert greedy, "a sampling step draws its tokens: it keeps no logits"
            sampling = {name: sampling[name].to(dtype).contiguous() for name, dtype in _SAMPLING_ROWS.items()}
            _check_len("sampling", bs, *sampling.values())
            rows_in = {name: t.data_ptr() for name, t in sampling.items()}
        struct = _ModelStep(
            model=self._model_ptr, lm_head=self._lm_head.data_ptr(), n=ids.shape[0], bs=bs,
            ids=ids.data_ptr(), positions=pos.data_ptr(), loc=loc.data_ptr(), rows=rows.data_ptr(),
            lens=_ptr_of(lens), prefix_lens=_ptr_of(prefix), extend_lens=_ptr_of(ext), future_map=_ptr_of(future_map),
            future_len=0 if future_map is None else future_map.shape[0], future_slots=_ptr_of(slots),
            next_ids=next_ids.data_ptr(), logits=_ptr_of(logits), **rows_in, num_threads=self.num_threads)
        return ModelStep(struct, next_ids, logits,
                         (ids, pos, loc, rows, lens, prefix, ext, future_map, slots, sampling, self))


class _Queued:
    """Something a ForwardStream runs: a C struct, and maybe a Python callback run after it on the
    stream's thread (with the GIL), whose outcome wait() hands back."""

    struct: _ModelStep
    outcome: Optional[tuple] = None  # the callback's, once it ran: (True, value) or (False, exception)

    def then(self, fn: Callable[[], Any]) -> None:
        """Run fn() on the stream's thread once the rest of this item has run (before the next item)."""
        self.outcome = (False, RuntimeError("the callback did not run"))

        def run() -> int:
            try:
                self.outcome = (True, fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                self.outcome = (False, e)
            return 0

        self._callback: Optional[Any] = _CALLBACK(run)  # alive as long as the struct that points to it
        self.struct.call = ctypes.cast(self._callback, _ptr)

    def release(self) -> None:
        """Once the stream is done with it: drop the callback (its closure usually refers back here)."""
        self.struct.call, self._callback = None, None

    @property
    def result(self) -> Any:
        """The callback's return value (its exception raised), once it ran."""
        ok, value = self.outcome
        if not ok:
            raise value
        return value


class ModelStep(_Queued):
    """One prepared model step (NativeForward.step): the C struct and every tensor it points into."""

    def __init__(self, struct: _ModelStep, next_ids: torch.Tensor, logits: Optional[torch.Tensor],
                 keep: tuple) -> None:
        self.struct = struct
        self.next_ids = next_ids  # [bs] int64, once a greedy step ran
        self.logits = logits  # [bs, vocab] float32, once a step that is not greedy ran
        self._keep = keep

    def run(self) -> None:
        """Run it here, now (without its callback)."""
        _raise_on(_library().model_step(ctypes.byref(self.struct)))


class StreamCall(_Queued):
    """A bare Python call for a ForwardStream: fn() on the stream's thread, in its turn."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.struct = _ModelStep()
        self.then(fn)


class ForwardStream:
    """A native thread that runs what is submitted in order: model steps without the GIL (a
    sampler's callback after its step, and bare Python calls, with it). The overlap loop's forward
    on CPU: the scheduler thread processes step N while step N+1 runs.

    A model step's loops run on parallel.h's crew, `num_threads` wide: the stream's thread and, in
    place of one helper, the thread blocked in wait() (so the scheduler's thread computes once it
    has nothing else to do, and no thread is ever waited for while it runs Python). The callbacks'
    torch ops run on the stream thread's OpenMP team; a process that serves through the stream
    calls hand_over_openmp() from the creating thread once, so that thread's idle OpenMP team does
    not slow the stream's down (see openmp_hand_over in cpu_forward.c)."""

    def __init__(self, num_threads: int) -> None:
        self._lib = _library()
        self.num_threads = num_threads
        self._stream = self._lib.stream_create(num_threads)
        if not self._stream:
            raise OSError("native forward stream: could not start its thread")

    def submit(self, item: _Queued) -> None:
        """Queue a ModelStep or StreamCall; the caller keeps it alive until wait() returns for it."""
        self._lib.stream_submit(self._stream, ctypes.byref(item.struct))

    def wait(self, item: _Queued) -> None:
        """Block (the GIL released) until a submitted item has run; its error, or its callback's
        exception, raised here."""
        err = self._lib.stream_wait(self._stream, ctypes.byref(item.struct))
        item.release()
        _raise_on(err)
        if item.outcome is not None:
            item.result  # noqa: B018 - raises the callback's exception

    def hand_over_openmp(self) -> None:
        """From the thread that made the stream, once: free its idle OpenMP team, run its own regions
        single-threaded from now on (that thread then computes nothing big: the stream does)."""
        if self._lib.openmp_hand_over() != 0:
            logger.warning("could not free the scheduler thread's OpenMP team; the forward stream's may spin less")

    def close(self) -> None:
        """Run what was submitted, then end the thread."""
        if self._stream:
            self._lib.stream_destroy(self._stream)
            self._stream = None


def _as_int64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.dtype == torch.int64 and t.is_contiguous() and t.dim() == 1 else t.to(torch.int64).contiguous()
            for t in tensors]


def _check_len(step: str, n: int, *tensors: torch.Tensor) -> None:
    if any(t.shape != (n,) for t in tensors):
        raise ValueError(f"native {step} step: inputs must be [{n}], got {[tuple(t.shape) for t in tensors]}")


def _raise_on(err: int) -> None:
    if err:
        raise RuntimeError(f"native forward: {_ERRORS.get(err, f'error {err}')}")
