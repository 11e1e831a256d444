"""A decode step of the gated delta rule (Gated DeltaNet) in place on the state pool, one Triton kernel.

    delta_rule_decode_triton(q, k [bs, Hk, Dk], v [bs, Hv, Dv], g, beta [bs, Hv], states [S, Hv, Dk, Dv],
                             slots [bs]) -> out [bs, Hv, Dv] in v's dtype

(layers/gated_delta_net.py delta_rule_decode calls it where `takes` says, else its torch twin.)

Row i continues from its state states[slots[i]]; value head h reads key head h // (Hv / Hk) (GVA). In
float32, as layers/gated_delta_net.py's recurrent_gated_delta_rule does after `_prepare` (HF's
torch_recurrent_gated_delta_rule with q/k l2-normed): q, k <- x * rsqrt(sum(x^2) + 1e-6), q scaled by
1/sqrt(Dk); S = states[slot, h] * exp(g); delta = (v - S^T k) * beta; S = S + k delta^T; out = S^T q;
the state becomes S in the states' dtype. One kernel replaces the CUDA path's gather of the rows'
states (the step's biggest tensor: Hv * Dk * Dv per request and layer), the recurrent kernel on the
copy and the scatter back: grid (bs, Hv, cdiv(Dv, BLOCK_V)), each program reads its [Dk, BLOCK_V]
block of S (columns of S are independent, so blocking V is exact; Dk whole), the q and k of its key
head and its block of v, and writes the block back where it lies. No host sync, so a decode CUDA graph
captures it.

Rows may share a slot (a graph's padded rows all point at the padding slot): what lands there is
garbage that nothing reads, and every other slot is still only written by its own row.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None

_EPS = 1e-6  # _l2norm's
_MAX_DK = 256  # Dk is held whole per program (128 in Qwen3-Next / Qwen3.5)


def check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           states: torch.Tensor, slots: torch.Tensor) -> None:
    (bs, hk, dk), (_, hv, dv) = q.shape, v.shape
    if (k.shape != q.shape or v.shape[0] != bs or g.shape != (bs, hv) or beta.shape != (bs, hv)
            or states.shape[1:] != (hv, dk, dv) or slots.shape != (bs,) or hv % hk):
        raise ValueError(f"delta_rule_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}, states {tuple(states.shape)} and slots "
                         f"{tuple(slots.shape)} do not match")


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CUDA, triton importable, contiguous heads, Dk <= 256. The
    torch twin (layers/gated_delta_net.py delta_rule_decode_torch) serves the rest."""
    return (triton is not None and q.is_cuda and q.shape[-1] <= _MAX_DK
            and all(t.stride(-1) == 1 for t in (q, k, v, states)))


def delta_rule_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    check_args(q, k, v, g, beta, states, slots)
    assert all(t.stride(-1) == 1 for t in (q, k, v, states)), "heads must be contiguous (other strides may be anything)"
    (bs, hk, dk), (_, hv, dv) = q.shape, v.shape
    out = torch.empty((bs, hv, dv), dtype=v.dtype, device=v.device)
    if out.numel() == 0:
        return out
    block_v = min(32, triton.next_power_of_2(dv))
    # no FMA contraction: each product rounded to fp32, as the torch ops do (the kernel is memory-bound)
    _delta_rule_decode_kernel[(bs, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, states, slots, out, dk, dv, hv // hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), states.stride(0),
        states.stride(1), states.stride(2), out.stride(0), out.stride(1), dk ** -0.5, _EPS,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4,
        enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit
    def _delta_rule_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, slot_ptr, o_ptr, DK, DV, GROUP,
                                  q_stride, q_stride_h, k_stride, k_stride_h, v_stride, v_stride_h, g_stride,
                                  g_stride_h, beta_stride, beta_stride_h, s_stride, s_stride_h, s_stride_k, o_stride,
                                  o_stride_h, scale, eps, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        ks = tl.arange(0, BLOCK_K)
        vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask, vmask = ks < DK, vs < DV
        hk = h // GROUP  # the key head this value head reads
        q = tl.load(q_ptr + row * q_stride + hk * q_stride_h + ks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * k_stride + hk * k_stride_h + ks, mask=kmask, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(v_ptr + row * v_stride + h * v_stride_h + vs, mask=vmask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + row * g_stride + h * g_stride_h).to(tl.float32))
        beta = tl.load(beta_ptr + row * beta_stride + h * beta_stride_h).to(tl.float32)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        block = s_ptr + slot * s_stride + h * s_stride_h + ks[:, None] * s_stride_k + vs[None, :]
        mask = kmask[:, None] & vmask[None, :]
        s = tl.load(block, mask=mask, other=0.0).to(tl.float32) * decay  # [BLOCK_K, BLOCK_V]
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(block, s.to(s_ptr.dtype.element_ty), mask=mask)
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + row * o_stride + h * o_stride_h + vs, out.to(o_ptr.dtype.element_ty), mask=vmask)
