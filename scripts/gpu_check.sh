#!/usr/bin/env bash
# The engine's GPU paths (FlashInfer, CUDA-graph decode, the overlap worker's stream, the Triton MoE), verified and
# timed in one command on a GPU machine, from the repository root:
#
#   bash scripts/gpu_check.sh                # on the GPU machine: install .whl/, run the GPU tests, time decode
#   bash scripts/gpu_check.sh fetch-wheels   # here (PyPI reachable): fill .whl/ with what that image lacks
#
# The GPU machine has no network: flashinfer-python, apache-tvm-ffi (its JIT's FFI) and pyzmq (the
# scheduler imports it) travel as wheels in the git-ignored .whl/. The flashinfer wheel is pruned to the
# sources of the two JIT modules we compile (FA2 paged decode and prefill): 62 MB -> 26 MB, so the
# working tree stays under the device tool's 64 MiB. Logs go to $OUT (or ./gpu_check_out).
set -uo pipefail

FLASHINFER_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2
PYZMQ_VERSION=27.3.0

fetch_wheels() {
    local py=${PYTHON:-.venv/bin/python}
    mkdir -p .whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" "pyzmq==$PYZMQ_VERSION" || exit 1
    "$py" - .whl/flashinfer_python-"$FLASHINFER_VERSION"-py3-none-any.whl <<'EOF' || exit 1
import fnmatch, os, sys, zipfile
path = sys.argv[1]
keep_csrc = ("batch_decode*", "batch_prefill*", "*.h", "*.cuh", "*.inc")
def keep(name):
    if name.startswith("flashinfer/data/csrc/"):
        rest = name[len("flashinfer/data/csrc/"):]
        return "/" not in rest and any(fnmatch.fnmatch(rest, p) for p in keep_csrc)
    if name.startswith("flashinfer/data/cutlass/"):
        return name.startswith(("flashinfer/data/cutlass/include/", "flashinfer/data/cutlass/tools/util/include/"))
    if name.startswith("flashinfer/data/"):
        return True  # headers: include/, cccl/, spdlog/
    return not name.startswith("flashinfer/") or name.endswith((".py", ".pyi", ".typed", ".json"))
with zipfile.ZipFile(path) as zin, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if keep(info.filename):
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
os.replace(path + ".tmp", path)
EOF
    ls -la .whl && du -sh .whl
}

if [ "${1:-}" = "fetch-wheels" ]; then
    fetch_wheels
    exit 0
fi

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
status=0

echo "== environment" | tee "$OUT/env.txt"
{
    nvidia-smi -L; nvcc --version | tail -2
    "$PY" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer: NOT importable"
    # FlashInfer's kernels go through tvm-ffi, which launches on torch's current stream (the overlap
    # worker's stream, a graph's capture stream) only when torch exports its DLPack exchange API
    "$PY" -c "import torch; print('torch DLPack exchange API:', hasattr(torch.Tensor, '__dlpack_c_exchange_api__') or hasattr(torch.Tensor, '__c_dlpack_exchange_api__'))"
    "$PY" -c "import baton.engine, baton.engine.scheduler.scheduler; print('baton.engine imports')"
} 2>&1 | tee -a "$OUT/env.txt"

echo "== JIT-compile FlashInfer's FA2 decode + prefill (fp16, head_dim 64: what the tests and the timing use)"
SECONDS=0
timeout 270 "$PY" - <<'EOF' 2>&1 | tee "$OUT/jit.txt" || status=1
import torch, flashinfer
ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
kv = torch.randn(2, 8, 16, 2, 64, dtype=torch.float16, device="cuda")  # [k/v, pages, P, H, D]
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
d = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
d.plan(i32([0, 2]), i32([1, 2]).cuda(), i32([5]), 4, 2, 64, 16, q_data_type=torch.float16, kv_data_type=torch.float16)
print("decode", tuple(d.run(torch.randn(1, 4, 64, dtype=torch.float16, device="cuda"), (kv[0], kv[1])).shape))
p = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
p.plan(i32([0, 3]), i32([0, 2]), i32([1, 2]).cuda(), i32([5]), 4, 2, 64, 16, causal=True,
       q_data_type=torch.float16, kv_data_type=torch.float16)
print("prefill", tuple(p.run(torch.randn(3, 4, 64, dtype=torch.float16, device="cuda"), (kv[0], kv[1])).shape))
EOF
echo "JIT compile + first run: ${SECONDS}s" | tee -a "$OUT/jit.txt"

echo "== GPU tests"
SECONDS=0
timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs tests/engine/test_gpu_paths.py 2>&1 | tee "$OUT/tests.txt" || status=1
timeout 60 "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu tests/engine/test_triton_ops.py tests/engine/test_sampling.py \
    2>&1 | tee -a "$OUT/tests.txt" || status=1
echo "tests: ${SECONDS}s" | tee -a "$OUT/tests.txt"

echo "== decode step timing (ms per step: H2D batch, forward, logits, argmax; side by side in one process)"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/timing.txt" || status=1
import logging, sys, tempfile, types
import torch
sys.path.insert(0, "tests/engine")
from tiny_models import make_tiny_model
from baton.engine.model_executor.forward_batch import ForwardMode
from baton.engine.model_executor.model_runner import ModelRunner
from baton.engine.server_args import ServerArgs

logging.basicConfig(level=logging.WARNING)
BATCHES, CONTEXT, STEPS = (1, 8, 32, 64), 512, 50
path = make_tiny_model("llama", tempfile.mkdtemp(), hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)

def step_ms(runner, bs):
    rows = list(range(bs))
    slots = runner.allocator.alloc_extend([0] * bs, [CONTEXT + 1] * bs, [-1] * bs).view(bs, CONTEXT + 1)
    runner.req_to_token_pool.req_to_token[:bs, :CONTEXT + 1] = slots.cuda()
    mwb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, input_ids=torch.randint(3, 500, (bs,)),
                                positions=torch.full((bs,), CONTEXT), req_pool_indices=torch.tensor(rows),
                                seq_lens_cpu=[CONTEXT + 1] * bs, out_cache_loc=slots[:, -1].clone(),
                                extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None)
    @torch.inference_mode()
    def step():
        fb, _ = runner.forward_batch_from(mwb)
        runner.model.compute_logits(runner.forward(fb)).argmax(-1)
    for _ in range(5):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(STEPS):
        step()
    end.record(); torch.cuda.synchronize()
    runner.allocator.free(slots.flatten())
    return start.elapsed_time(end) / STEPS

configs = {"torch": dict(attention_backend="torch"), "flashinfer": dict(attention_backend="flashinfer", disable_cuda_graph=True),
           "flashinfer+graph": dict(attention_backend="flashinfer")}
times = {}
for name, kw in configs.items():
    runner = ModelRunner(ServerArgs(model_path=path, device="cuda", dtype="float16", max_total_tokens=80 * 1024,
                                    max_running_requests=64, cuda_graph_max_bs=64, **kw))
    times[name] = {bs: step_ms(runner, bs) for bs in BATCHES}
    del runner; torch.cuda.empty_cache()
print(f"model: llama hidden 512, 4 layers, 8 heads / 4 KV heads (head_dim 64), fp16; KV context {CONTEXT}; {STEPS} steps")
print("| bs | torch ms | flashinfer ms | flashinfer+graph ms | flashinfer / torch | graph speedup | graph vs torch |")
print("|---|---|---|---|---|---|---|")
for bs in BATCHES:
    t, f, g = times["torch"][bs], times["flashinfer"][bs], times["flashinfer+graph"][bs]
    print(f"| {bs} | {t:.3f} | {f:.3f} | {g:.3f} | {t / f:.2f}x | {f / g:.2f}x | {t / g:.2f}x |")
EOF

echo "== MoE experts: Triton grouped GEMMs vs the per-expert loop (one Qwen3-30B-A3B layer's shape, bf16)"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/moe_timing.txt" || status=1
import torch, torch.nn.functional as F
from baton.engine.triton_ops.fused_moe import fused_experts_torch, fused_experts_triton

E, K, H, I, REPS = 128, 8, 2048, 768, 20
dt, dev = torch.bfloat16, "cuda"
w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H ** 0.5
w2 = torch.randn(E, H, I, device=dev, dtype=dt) / I ** 0.5

def ms(fn):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(REPS):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS

print(f"E {E}, top_k {K}, hidden {H}, moe_intermediate {I}, bf16; ms per call, CUDA events, {REPS} calls")
print("| tokens | loop ms | triton ms | triton graph ms | loop / triton | loop / graph |")
print("|---|---|---|---|---|---|")
for n in (1, 8, 32, 64, 256, 2048):
    x = torch.randn(n, H, device=dev, dtype=dt)
    weights, ids = torch.topk(torch.softmax(torch.randn(n, E, device=dev), -1), K)
    weights = weights.to(dt)
    loop = ms(lambda: fused_experts_torch(x, w13, w2, weights, ids, F.silu))
    tri = ms(lambda: fused_experts_triton(x, w13, w2, weights, ids, F.silu))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_experts_triton(x, w13, w2, weights, ids, F.silu)
    graph = ms(g.replay)
    print(f"| {n} | {loop:.3f} | {tri:.3f} | {graph:.3f} | {loop / tri:.2f}x | {loop / graph:.2f}x |")
EOF

echo "== done (status $status); logs in $OUT"
exit $status
