"""`baton bench step`: the GPU decode step and prefill of a real model shape against the hardware.

    baton bench step --shape llama-3-8b --batch-sizes 1,16,64 --context 1024

1. Builds a random-weight bfloat16 checkpoint of the named shape: every tensor generated on the GPU
   and written as safetensors to /dev/shm (or --dir), reused by later runs.
2. Measures, in the same process, the device-to-device copy bandwidth (read + write bytes / time)
   and the bf16 matmul throughput (8192^3).
3. Per batch size: the decode step (ModelRunner with FlashInfer and the CUDA graph; host inputs,
   logits and argmax included), the bytes it must read (every weight once, the LM head included,
   plus each request's KV), the limit = bytes / copy bandwidth, and the step as % of it.
4. Kernels per decoder layer: torch.profiler over one eager (uncaptured) forward.
5. Prefill: one chunk of --prefill-tokens tokens, tokens/s and FLOP/s as % of the matmul rate.

Variants (side by side, the same weights and pools): `fused` (the default engine: Triton layer ops,
decode on tensor cores where auto picks them), `reference-ops` (--disable-fused-ops), the other
tensor-core setting, and `triton-gemv` (asked for by name: `fused` with the linears of 1..64 rows on
the Triton GEMV of triton_ops/gemv.py, gate|up with silu * up in its epilogue, instead of cuBLAS;
its configs are autotuned during the graph warm-ups; each layer's two RMSNorms folded into the GEMVs
that read them, layers/norm_linear.py), and `triton-gemv-own-norms` (the same with the norms'
own kernels, to measure that fold). This is a benchmark command, not a test: it
asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import time
import types
from collections import Counter
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

# Real model shapes (their config.json fields). llama-3-8b keeps the 32,000-token vocabulary of the
# first 8B baseline measured on an H200 so the figures compare; the layers are Llama-3-8B's.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu"),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False, hidden_act="silu", attention_bias=False),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False, hidden_act="silu", attention_bias=False),
}
SHARD_BYTES = 4 << 30
VARIANTS = ("fused", "reference-ops", "other-tensor-cores", "triton-gemv", "triton-gemv-own-norms")
GEMV_ROWS = 64  # triton-gemv: batches of up to this many rows take the GEMV (1, 16 and 64: where it wins shows)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma list of decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="KV tokens each request holds before the step")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="one prefill chunk of this many tokens (0: skip)")
    p.add_argument("--page-size", type=int, default=1,
                   help="KV-cache page size (the engine's --page-size): FlashInfer reads the KV page by page")
    p.add_argument("--variants", default="fused,reference-ops,other-tensor-cores",
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: /dev/shm/baton-step-<shape>, "
                                                "or the temp dir when /dev/shm lacks room)")
    p.add_argument("--profile-batch-sizes", default=None,
                   help="comma list of batches whose eager forward is profiled per kernel (default: the first and "
                        "the last); the first gives the kernel count")
    p.add_argument("--json-out", default=None)


# ---------------------------------------------------------------- checkpoint

def checkpoint_dir(shape: str, requested: Optional[str], nbytes: int) -> str:
    if requested:
        return requested
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > nbytes * 1.1:
        return os.path.join(shm, f"baton-step-{shape}")
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"baton-step-{shape}")


def _tensor_specs(config_dict: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the HF checkpoint of this config (from a meta-device model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def build_checkpoint(shape: str, requested_dir: Optional[str] = None, device: str = "cuda") -> tuple[str, float]:
    """A random-weight bf16 checkpoint of `shape` (reused when it exists); returns (dir, seconds)."""
    from safetensors.torch import save_file

    config = dict(SHAPES[shape], dtype="bfloat16", torch_dtype="bfloat16")
    specs = _tensor_specs(config)
    nbytes = sum(2 * _numel(s) for _, s in specs)
    path = checkpoint_dir(shape, requested_dir, nbytes)
    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path, 0.0
    start = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            save_file(shard, os.path.join(path, f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, shard_bytes, index = {}, 0, index + 1

    for name, s in specs:
        if name.endswith("norm.weight"):  # RMSNorm weights near 1, as trained ones are
            t = 1.0 + 0.05 * torch.randn(s, generator=gen, device=device)
        else:
            t = 0.02 * torch.randn(s, generator=gen, device=device)
        shard[name] = t.to(torch.bfloat16).cpu()
        shard_bytes += shard[name].numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    open(marker, "w").close()
    return path, time.perf_counter() - start


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- hardware anchors

def _cuda_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting what it reads and what it writes."""
    buffers = torch.empty(2, nbytes, dtype=torch.uint8, device="cuda")
    ms = _cuda_ms(lambda: buffers[1].copy_(buffers[0]), reps=20)
    return 2 * nbytes / (ms / 1e3)


def matmul_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = _cuda_ms(lambda: a @ b, reps=20)
    return 2 * n ** 3 / (ms / 1e3)


# ---------------------------------------------------------------- model facts

@dataclasses.dataclass(frozen=True)
class ModelFacts:
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    heads: int
    layer_linear_params: int  # what a prefill token multiplies through (experts: the activated ones)
    weight_bytes_fn: Callable[[int], float]  # bytes of weights a decode step of batch b reads

    def kv_bytes(self, bs: int, context: int, itemsize: int = 2) -> int:
        return bs * context * self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def model_facts(model: torch.nn.Module, config: dict) -> ModelFacts:
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    hidden = config["hidden_size"]
    experts = config.get("num_experts", 0)
    top_k = config.get("num_experts_per_tok", 0)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if n.endswith((".w13", ".w2")))
    dense_bytes = total - expert_bytes - (0 if tied else embed.numel() * embed.element_size())

    def weight_bytes(bs: int) -> float:
        # experts: those a batch of bs tokens hits, expected under uniform routing
        hit = experts * (1 - (1 - top_k / experts) ** bs) if experts else 0
        return dense_bytes + (expert_bytes * hit / experts if experts else 0) + bs * hidden * 2

    linear = 0
    for n, p in params.items():
        if ".layers." not in n or p.dim() < 2:
            continue
        if n.endswith((".w13", ".w2")):
            linear += p.numel() * top_k // experts
        elif not n.endswith(".gate.weight"):
            linear += p.numel()
    return ModelFacts(config["num_hidden_layers"], hidden, config["num_key_value_heads"], config["head_dim"],
                      config["num_attention_heads"], linear, weight_bytes)


# ---------------------------------------------------------------- timing

def _decode_batch(runner: Any, bs: int, context: int) -> tuple[Any, torch.Tensor]:
    from baton.engine.core.forward_batch import ForwardMode

    slots = runner.allocator.alloc_extend([0] * bs, [context + 1] * bs, [-1] * bs)
    assert slots is not None, "KV pool too small for the batch"
    slots = slots.view(bs, context + 1)
    runner.req_to_token_pool.req_to_token[:bs, :context + 1] = slots.to(runner.device)
    mwb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, input_ids=torch.randint(3, runner.vocab_size, (bs,)),
                                positions=torch.full((bs,), context), req_pool_indices=torch.arange(bs),
                                seq_lens_cpu=[context + 1] * bs, out_cache_loc=slots[:, -1].clone(),
                                extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None)
    return mwb, slots


def decode_step_ms(runner: Any, bs: int, context: int, steps: int) -> float:
    mwb, slots = _decode_batch(runner, bs, context)

    @torch.inference_mode()
    def step() -> None:
        fb, _ = runner.forward_batch_from(mwb)
        runner.compute_logits(runner.forward(fb)).argmax(-1)

    try:
        return _cuda_ms(step, reps=steps, warmup=5)
    finally:
        runner.allocator.free(slots.flatten())


def kernels_per_step(runner: Any, bs: int, context: int) -> tuple[Counter, Counter]:
    """Kernel launches of one eager decode forward (no graph) by kernel name, and their GPU
    microseconds (eager, so launch gaps are not counted)."""
    from torch.profiler import ProfilerActivity, profile

    mwb, slots = _decode_batch(runner, bs, context)
    try:
        with torch.inference_mode():
            fb, _ = runner.forward_batch_from(mwb)
            runner.attn_backend.init_forward_metadata(fb)
            runner.model(fb.input_ids, fb.positions, fb)  # warm
            runner.attn_backend.init_forward_metadata(fb)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model(fb.input_ids, fb.positions, fb)
                torch.cuda.synchronize()
    finally:
        runner.allocator.free(slots.flatten())
    names: Counter = Counter()
    micros: Counter = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            names[e.name] += 1
            micros[e.name] += e.device_time_total
    return names, micros


def prefill_ms(runner: Any, tokens: int, reps: int = 3) -> float:
    from baton.engine.core.forward_batch import ForwardMode

    slots = runner.allocator.alloc_extend([0], [tokens], [-1])
    assert slots is not None, "KV pool too small for the prefill"
    runner.req_to_token_pool.req_to_token[0, :tokens] = slots.to(runner.device)
    mwb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, input_ids=torch.randint(3, runner.vocab_size, (tokens,)),
                                positions=torch.arange(tokens), req_pool_indices=torch.tensor([0]),
                                seq_lens_cpu=[tokens], out_cache_loc=slots.clone(), extend_prefix_lens_cpu=[0],
                                extend_seq_lens_cpu=[tokens])

    @torch.inference_mode()
    def run() -> None:
        fb, _ = runner.forward_batch_from(mwb)
        hidden = runner.forward(fb)
        runner.compute_logits(hidden[-1:]).argmax(-1)

    try:
        return _cuda_ms(run, reps=reps, warmup=1)
    finally:
        runner.allocator.free(slots)


# ---------------------------------------------------------------- variants

def _set_variant(runner: Any, base_args: Any, name: str, max_bs: int) -> str:
    """Rebind the runner's ops / attention backend / graphs for a variant; returns its description."""
    from baton.engine.layers.attention import create_attention_backend, use_tensor_core_decode
    from baton.engine.layers.custom_op import bind_layer_ops
    from baton.engine.layers.gemm import SmallBatchGemv
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner

    fused = name != "reference-ops"
    tc = base_args.flashinfer_decode_tensor_cores
    if name == "other-tensor-cores":
        g = runner.attn_backend.geometry
        tc = "off" if use_tensor_core_decode(tc, g.num_qo_heads // g.num_kv_heads) else "on"
    runner.config = dataclasses.replace(runner.config, disable_fused_ops=not fused, flashinfer_decode_tensor_cores=tc)
    gemv_rows = GEMV_ROWS if name.startswith("triton-gemv") else 0
    fuse_norms = name != "triton-gemv-own-norms"
    # before the capture below, whose warm-ups autotune the GEMV
    bind_layer_ops(runner.model, runner.device, fused=fused, gemv=SmallBatchGemv(gemv_rows, fuse_norms))
    runner.cuda_graph_runner = None
    torch.cuda.empty_cache()
    runner.attn_backend = create_attention_backend("flashinfer", model_runner=runner)
    runner.cuda_graph_runner = CudaGraphRunner(runner, max_bs=max_bs)
    gemv = (f", Triton GEMV for 1..{gemv_rows} rows, norms {'folded in' if fuse_norms else 'own kernels'}"
            if gemv_rows else "")
    return (f"{'Triton' if fused else 'torch reference'} ops, decode tensor cores "
            f"{runner.attn_backend.decode_tensor_cores}{gemv}")


def engine_args(path: str, args: argparse.Namespace, max_bs: int) -> Any:
    """The engine the step runs: FlashInfer, bf16, a KV pool of max_bs requests of --context tokens
    in whole pages (and room for the prefill chunk); graphs are captured per variant (_set_variant)."""
    from baton.engine.server_args import ServerArgs

    page = args.page_size
    per_request = -(-(args.context + 2) // page) * page
    return ServerArgs(model_path=path, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                      disable_cuda_graph=True, page_size=page,
                      context_length=max(args.context + 2, args.prefill_tokens) + 16, max_running_requests=max_bs,
                      cuda_graph_max_bs=max_bs,
                      max_total_tokens=max(max_bs * per_request, args.prefill_tokens) + 64 * page)


def run_cli(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("baton bench step needs a CUDA device")
        return 2
    logging.basicConfig(level=logging.WARNING)
    from baton.engine.model_executor.model_runner import ModelRunner

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not batch_sizes:
        print(f"unknown variants {sorted(unknown)} or no batch sizes")
        return 2
    path, build_s = build_checkpoint(args.shape, args.dir)
    print(f"checkpoint {args.shape}: {path} ({'built in %.1f s' % build_s if build_s else 'reused'})", flush=True)
    bw, flops = copy_bandwidth(), matmul_flops()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul 8192^3 {flops / 1e12:.0f} TFLOP/s", flush=True)
    profile_sizes = ([int(b) for b in args.profile_batch_sizes.split(",") if b.strip()] if args.profile_batch_sizes
                     else sorted({batch_sizes[0], batch_sizes[-1]}, key=batch_sizes.index))
    max_bs = max(batch_sizes)
    server_args = engine_args(path, args, max_bs)
    page = server_args.page_size
    start = time.perf_counter()
    runner = ModelRunner(server_args)
    print(f"model loaded in {time.perf_counter() - start:.1f} s; startup {runner.startup_s}; KV page size {page}",
          flush=True)
    facts = model_facts(runner.model, SHAPES[args.shape])
    results: dict[str, Any] = dict(shape=args.shape, device=torch.cuda.get_device_name(), copy_bw=bw,
                                   matmul_flops=flops, context=args.context, page_size=page, variants={})
    for name in variants:
        desc = _set_variant(runner, server_args, name, max_bs)
        rows = []
        for bs in batch_sizes:
            ms = decode_step_ms(runner, bs, args.context, args.steps)
            nbytes = facts.weight_bytes_fn(bs) + facts.kv_bytes(bs, args.context + 1)
            limit = nbytes / bw * 1e3
            rows.append(dict(bs=bs, step_ms=ms, bytes=nbytes, limit_ms=limit, pct=100 * limit / ms))
        profiles = []
        for pbs in profile_sizes:
            kernels, kernel_us = kernels_per_step(runner, pbs, args.context)
            profiles.append(dict(bs=pbs, kernels=sum(kernels.values()), gpu_us=sum(kernel_us.values()),
                                 kernel_names=kernels.most_common(25), kernel_us=kernel_us.most_common(25)))
        total = profiles[0]["kernels"]
        entry: dict[str, Any] = dict(description=desc, decode=rows, kernels_per_step=total,
                                     kernels_per_layer=total / facts.layers, profiles=profiles)
        if args.prefill_tokens:
            ms = prefill_ms(runner, args.prefill_tokens)
            t = args.prefill_tokens
            flop = 2 * facts.layer_linear_params * t + 2 * t * t * facts.head_dim * facts.heads * facts.layers
            entry["prefill"] = dict(tokens=t, ms=ms, tok_s=t / (ms / 1e3), flops=flop / (ms / 1e3),
                                    pct=100 * flop / (ms / 1e3) / flops)
        results["variants"][name] = entry
        _print_variant(name, entry)
    _print_side_by_side(results, batch_sizes)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def _print_variant(name: str, entry: dict) -> None:
    print(f"\n### {name}: {entry['description']}")
    print("| batch | step ms | GB read | limit ms | % of limit |\n|---|---|---|---|---|")
    for r in entry["decode"]:
        print(f"| {r['bs']} | {r['step_ms']:.3f} | {r['bytes'] / 1e9:.2f} | {r['limit_ms']:.3f} | {r['pct']:.0f}% |")
    print(f"kernels per eager decode forward: {entry['kernels_per_step']} "
          f"({entry['kernels_per_layer']:.1f} per decoder layer)")
    for prof in entry["profiles"]:
        counts = dict(prof["kernel_names"])
        print(f"  batch {prof['bs']}: {prof['kernels']} kernels, {prof['gpu_us']:.0f} us of GPU time; the most GPU time (eager forward, no launch gaps):"
              "\n    count  GPU us  kernel")
        for kname, us in prof["kernel_us"][:14]:
            print(f"    {counts.get(kname, 0):5d}  {us:6.0f}  {kname[:110]}")
    if "prefill" in entry:
        p = entry["prefill"]
        print(f"prefill {p['tokens']} tokens: {p['ms']:.1f} ms, {p['tok_s'] / 1e3:.1f}k tok/s, "
              f"{p['flops'] / 1e12:.0f} TFLOP/s = {p['pct']:.0f}% of the measured bf16 matmul rate", flush=True)


def _print_side_by_side(results: dict, batch_sizes: list[int]) -> None:
    names = list(results["variants"])
    if len(names) < 2:
        return
    base = results["variants"][names[0]]["decode"]
    print(f"\n### side by side: step time of each variant / {names[0]}'s")
    print("| batch | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for i, bs in enumerate(batch_sizes):
        cells = [f"{results['variants'][n]['decode'][i]['step_ms'] / base[i]['step_ms']:.2f}x" for n in names]
        print(f"| {bs} | " + " | ".join(cells) + " |")
