#!/usr/bin/env bash
# Every GPU figure of the project in one run on a GPU machine, from the repository root:
#
#   bash scripts/gpu_check.sh fetch-wheels   # here (PyPI reachable): fill .whl/ with what that image lacks
#   bash scripts/gpu_check.sh                # on the GPU machine (device tool: carry .whl)
#   STAGES="step serve" bash scripts/gpu_check.sh   # a subset: tests, step, serve
#
# Stages, each under its own time limit, logs in $OUT (or ./gpu_check_out):
#   (background, from the start) FlashInfer's JIT builds: FA2 decode + prefill for fp16 / head_dim 64
#       (the tests) and bf16 / head_dim 128 (the 8B shape; tensor-core decode uses the prefill module)
#   tests  the GPU tests: FlashInfer vs torch, graphs vs eager, the scheduler vs HF, the Triton layer
#          ops vs their torch references (per op and whole model), the Triton MoE
#          (then scripts/verify_accept_bench.py on CUDA: a verify step's acceptance, host rule vs device walk)
#   step   `baton bench step --shape llama-3-8b`: the decode step at batch 1/16/64 against the HBM
#          limit measured in the same run, kernels per layer and the GPU time per kernel at batch 1
#          and 64, an 8k prefill against the matmul rate; the default engine (cuBLAS) vs the Triton
#          GEMV with the norms folded in vs the GEMV with the norms' own kernels, side by side
#          (STEP_VARIANTS: another list, e.g. fused,reference-ops,other-tensor-cores; STEP_PAGE_SIZE:
#          the KV page size, 1 by default, e.g. 16 to see FlashInfer's decode at batch 64 read whole pages)
#   serve  `baton bench compare` on that checkpoint: 64 prompts x 256 in / 256 out at concurrency 64,
#          the default engine (overlap) vs --disable-overlap-schedule
#   gemv   (asked for: STAGES="... gemv") served at concurrency 16, cuBLAS vs --small-batch-gemv-rows 16
#   spec   (asked for: STAGES="... spec") scripts/spec_bench.py on that checkpoint: NGRAM vs off and
#          EAGLE with a random head (acceptance ~0: the verify step's cost) vs off, concurrency 1/4/16
#
# The GPU machine has no network: flashinfer-python (pruned to the sources of the JIT modules we
# build), apache-tvm-ffi and the HTTP/ZMQ stack travel as wheels in the git-ignored .whl/ (~42 MB,
# under the device tool's 64 MiB).
set -uo pipefail

FLASHINFER_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2
FLA_VERSION=0.6.0
# what `baton serve`, its scheduler and `baton bench` import beyond the GPU image's torch/transformers
SERVE_REQS="fastapi>=0.110 uvicorn>=0.29 uvloop>=0.19 httptools>=0.6 httpx>=0.27 orjson>=3.9 prometheus-client>=0.20
pydantic>=2.5 pyzmq>=25 aiohttp>=3.9"

fetch_wheels() {
    local py=${PYTHON:-.venv/bin/python}
    local platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
    mkdir -p .whl
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
        -d .whl "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" || exit 1
    # fla-core (pure Python + Triton): the hybrid models' gated delta rule kernels, with einops
    "$py" -m pip download -q --no-deps -d .whl "fla-core==$FLA_VERSION" einops || exit 1
    # shellcheck disable=SC2086
    "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
        -d .whl $SERVE_REQS || exit 1
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
with zipfile.ZipFile(path) as zin:
    if sum(1 for n in zin.namelist() if n.startswith("flashinfer/data/csrc/")) < 400:
        sys.exit(0)  # pruned already
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if keep(info.filename):
                zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
os.replace(path + ".tmp", path)
EOF
    ls .whl && du -sh .whl
}

# tests/gpu_last_run.json: when the GPU tests last ran on a GPU (date, card, commit, counts); the
# summary of every CI run prints it. On the device tool the checkout is a copy: the record also goes
# to $OUT; copy it over tests/gpu_last_run.json and commit it with the run's figures.
record_gpu_run() {  # the pytest log of the tests stage
    local commit=${BATON_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
    "$PY" - "$1" "$commit" "$OUT/gpu_last_run.json" tests/gpu_last_run.json <<'EOF'
import datetime, json, re, sys, torch
log, commit, *targets = sys.argv[1:]
final = [line for line in open(log).read().splitlines() if re.search(r"\d+ (passed|failed)", line)]
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?)", final[-1] if final else "")}
record = {"date": datetime.date.today().isoformat(), "card": torch.cuda.get_device_name(), "commit": commit,
          "passed": counts.get("passed", 0),
          "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)}
for path in targets:
    with open(path, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
print("GPU run recorded:", record)
EOF
}

if [ "${1:-}" = "fetch-wheels" ]; then
    fetch_wheels
    exit 0
fi

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
STAGES=${STAGES:-tests step serve}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/pip.txt" 2>&1 || { tail -20 "$OUT/pip.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
status=0
T0=$SECONDS
stamp() { echo "[+$((SECONDS - T0))s] $*"; }

stamp "== environment" | tee "$OUT/env.txt"
{
    nvidia-smi -L; nvcc --version | tail -2; df -h /dev/shm | tail -1; nproc; free -g | head -2
    "$PY" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer: NOT importable"
    "$PY" -c "import fla; print('fla-core', fla.__version__)" || echo "fla-core: NOT importable"
    "$PY" -c "import baton.engine.scheduler.scheduler, baton.engine.entrypoints.http_server; print('baton engine + server import')"
} 2>&1 | tee -a "$OUT/env.txt"

# FlashInfer JIT builds in the background (two processes: the fp16/64 pair and the bf16/128 pair)
jit() {  # dtype head_dim heads kv_heads
    "$PY" - "$@" <<'EOF'
import sys, time, torch, flashinfer
dtype, hd, heads, kv = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
kvc = torch.randn(2, 8, 16, kv, hd, dtype=dtype, device="cuda")
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
for tc in (False, True):
    d = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend="fa2")
    d.plan(i32([0, 2]), i32([1, 2]).cuda(), i32([5]), heads, kv, hd, 16, q_data_type=dtype, kv_data_type=dtype)
    d.run(torch.randn(1, heads, hd, dtype=dtype, device="cuda"), (kvc[0], kvc[1]))
p = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
p.plan(i32([0, 3]), i32([0, 2]), i32([1, 2]).cuda(), i32([5]), heads, kv, hd, 16, causal=True, q_data_type=dtype, kv_data_type=dtype)
p.run(torch.randn(3, heads, hd, dtype=dtype, device="cuda"), (kvc[0], kvc[1]))
torch.cuda.synchronize()
print(f"JIT {sys.argv[1:]}: decode (CUDA cores, tensor cores) + prefill built and run in {time.perf_counter() - t:.0f} s")
EOF
}
(jit float16 64 4 2 >"$OUT/jit_fp16.txt" 2>&1; echo "rc $?" >>"$OUT/jit_fp16.txt") &
JIT1=$!
(jit bfloat16 128 32 8 >"$OUT/jit_bf16.txt" 2>&1; echo "rc $?" >>"$OUT/jit_bf16.txt") &
JIT2=$!

CKPT=""
if [[ $STAGES == *step* || $STAGES == *serve* || $STAGES == *spec* || $STAGES == *gemv* ]]; then
    stamp "== llama-3-8b checkpoint (random bf16 weights generated on the GPU) + a 32k-token tokenizer"
    CKPT=$(timeout 240 "$PY" - <<'EOF' 2>"$OUT/ckpt.txt"
import sys, os
sys.path.insert(0, "tests/engine")
from baton.engine.bench.step import build_checkpoint
path, seconds = build_checkpoint("llama-3-8b")
if not os.path.exists(os.path.join(path, "tokenizer.json")):
    from tiny_models import save_tiny_tokenizer
    save_tiny_tokenizer(path, 32000)
print(f"checkpoint at {path}: {seconds:.1f} s", file=sys.stderr)
print(path)
EOF
) || { status=1; tail -5 "$OUT/ckpt.txt"; }
    cat "$OUT/ckpt.txt"
fi

wait $JIT1 $JIT2
stamp "== JIT"; cat "$OUT/jit_fp16.txt" "$OUT/jit_bf16.txt" | tail -6

if [[ $STAGES == *step* && -n $CKPT ]]; then
    stamp "== baton bench step --shape llama-3-8b"
    timeout "${STEP_TIMEOUT:-200}" "$PY" -m baton bench step --shape llama-3-8b --dir "$CKPT" --batch-sizes 1,16,64 \
        --context 1024 --steps 50 --prefill-tokens 8192 --profile-batch-sizes 1,64 \
        --variants "${STEP_VARIANTS:-fused,triton-gemv,triton-gemv-own-norms}" --page-size "${STEP_PAGE_SIZE:-1}" \
        --json-out "$OUT/step.json" 2>&1 | tee "$OUT/step.txt" || status=1
fi

if [[ $STAGES == *tests* ]]; then
    stamp "== GPU tests"
    timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -p no:cacheprovider -q -rs --maxfail 8 --timeout 120 -m gpu \
        tests/engine/test_fused_ops.py tests/engine/test_gpu_paths.py tests/engine/test_triton_ops.py tests/engine/test_sampling.py \
        tests/engine/test_hybrid_radix_cache.py tests/engine/test_speculative_nextn.py tests/engine/test_speculative_eagle.py \
        tests/engine/test_gemv.py tests/engine/test_speculative_tree.py tests/engine/test_causal_conv1d.py \
        tests/engine/test_gated_delta_decode.py tests/engine/test_vision_tower.py tests/engine/test_vl_models.py \
        tests/engine/test_lora.py tests/engine/test_operations.py \
        2>&1 | tee "$OUT/tests.txt" | tail -25 || status=1
    grep -h "max |logprob diff|\|exact argmax" "$OUT/tests.txt" | head -20
    record_gpu_run "$OUT/tests.txt"
    stamp "== verify acceptance: host rule vs the device walk (128k vocabulary)"
    timeout 120 "$PY" scripts/verify_accept_bench.py --device cuda --vocab 128256 --iters 20 2>&1 \
        | tee "$OUT/verify_accept.txt" || status=1
fi

if [[ $STAGES == *serve* && -n $CKPT ]]; then
    stamp "== served llama-3-8b: 64 x 256 in / 256 out, concurrency 64, default (overlap) vs plain loop"
    timeout "${SERVE_TIMEOUT:-240}" "$PY" -m baton bench compare --model-path "$CKPT" --device cuda --dtype bfloat16 \
        --num-prompts 64 --concurrency 64 --input-len 256 --output-len 256 --repeats "${REPEATS:-2}" --warmup-rounds 1 \
        --hf-modes "" --engine-args "--max-total-tokens 131072 --cuda-graph-max-bs 64 --max-running-requests 64" \
        --variant default: --variant no-overlap:--disable-overlap-schedule \
        --json-out "$OUT/serve.json" 2>&1 | tee "$OUT/serve.txt" | tail -30 || status=1
fi

if [[ $STAGES == *gemv* && -n $CKPT ]]; then
    stamp "== served llama-3-8b at concurrency 16 (32 x 256 / 256): cuBLAS vs --small-batch-gemv-rows 16"
    timeout "${SERVE_TIMEOUT:-240}" "$PY" -m baton bench compare --model-path "$CKPT" --device cuda --dtype bfloat16 \
        --num-prompts 32 --concurrency 16 --input-len 256 --output-len 256 --repeats "${REPEATS:-2}" --warmup-rounds 1 \
        --hf-modes "" --engine-args "--max-total-tokens 131072 --cuda-graph-max-bs 64 --max-running-requests 64" \
        --variant default: --variant gemv16:--small-batch-gemv-rows=16 \
        --json-out "$OUT/serve_gemv.json" 2>&1 | tee "$OUT/serve_gemv.txt" | tail -20 || status=1
fi

if [[ $STAGES == *spec* && -n $CKPT ]]; then
    # random weights: what a verify step costs against a plain step on this GPU (verify graphs, the
    # head's passes), with whatever the random model's repetitions let NGRAM accept
    stamp "== speculation on llama-3-8b: NGRAM vs off, then EAGLE (a random head) vs off, concurrency 1, 4, 16"
    SPEC_ENGINE="--device cuda --max-total-tokens 65536 --cuda-graph-max-bs 32"
    timeout "${SPEC_TIMEOUT:-300}" "$PY" scripts/spec_bench.py --model-path "$CKPT" --concurrency 1,4,16 \
        --input-len 256 --output-len 128 --engine-args "$SPEC_ENGINE" 2>&1 | tee "$OUT/spec.txt" | tail -8 || status=1
    EAGLE_DIR=$(timeout 180 "$PY" -c "import sys, tempfile; sys.path.insert(0, 'tests/engine')
from tiny_models import make_eagle_draft
print(make_eagle_draft(sys.argv[1], tempfile.mkdtemp(prefix='eagle-8b-'), 'EAGLE', std=0.02))" "$CKPT" \
        2>>"$OUT/spec.txt") || status=1
    if [ -n "$EAGLE_DIR" ]; then
        timeout "${SPEC_TIMEOUT:-300}" "$PY" scripts/spec_bench.py --model-path "$CKPT" --concurrency 1,4,16 \
            --input-len 256 --output-len 128 --engine-args "$SPEC_ENGINE" \
            --spec-args "--speculative-algorithm EAGLE --speculative-draft-model-path $EAGLE_DIR" \
            2>&1 | tee -a "$OUT/spec.txt" | tail -8 || status=1
    fi
fi

stamp "== done (status $status); logs in $OUT"
exit $status
