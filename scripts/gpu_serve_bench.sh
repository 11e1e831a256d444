#!/usr/bin/env bash
# Served throughput on a GPU machine, side by side in one run: `baton serve --device cuda` under its
# default settings (FlashInfer, CUDA-graph decode, overlap), with overlap off, and with the torch
# backend, against HF transformers' batched `generate` on the same GPU, prompts and lengths.
#
#   bash scripts/gpu_serve_bench.sh     # on the GPU machine, from the repository root
#
# The GPU image has torch/transformers but not the HTTP stack: it travels as wheels in .whl/ with
# FlashInfer (`bash scripts/gpu_check.sh fetch-wheels` here). The model is a random-weight Llama, float16: by default
# ~0.2B (hidden 1024, 16 layers, 16 heads / 8 KV heads); SHAPE sets another, ARCH=qwen3_moe (with MOE)
# a sparse MoE model. Logs go to $OUT (or ./gpu_check_out); environment knobs: NUM, INPUT, OUTPUT,
# REPEATS, HF_MODES, TORCH_BACKEND, SHAPE, ARCH, MOE, TAG. The 8B shape's served run is a stage of
# scripts/gpu_check.sh.
set -uo pipefail

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# SHAPE="hidden intermediate layers heads kv_heads" (head_dim 64 throughout: one FlashInfer JIT build)
read -r HIDDEN INTER LAYERS HEADS KV_HEADS <<<"${SHAPE:-1024 2816 16 16 8}"
# ARCH=qwen3_moe: every MLP a sparse MoE block, MOE="experts top_k moe_intermediate" (Triton experts on CUDA)
ARCH=${ARCH:-llama}
read -r EXPERTS TOP_K MOE_INTER <<<"${MOE:-64 8 512}"
MODEL=/tmp/gpu-bench-$ARCH-$HIDDEN-$LAYERS
[ -f "$MODEL/config.json" ] || "$PY" - "$MODEL" "$ARCH" "$HIDDEN" "$INTER" "$LAYERS" "$HEADS" "$KV_HEADS" \
    "$EXPERTS" "$TOP_K" "$MOE_INTER" <<'EOF' || exit 1
import sys
sys.path.insert(0, "tests/engine")
from tiny_models import make_tiny_model
path, arch = sys.argv[1:3]
hidden, inter, layers, heads, kv_heads, experts, top_k, moe_inter = map(int, sys.argv[3:])
extra = (dict(head_dim=64, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter)
         if arch == "qwen3_moe" else {})
make_tiny_model(arch, path, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, **extra)
EOF

NUM=${NUM:-64} INPUT=${INPUT:-256} OUTPUT=${OUTPUT:-512}
# every engine shares the one GPU: a fixed KV pool each instead of a fraction of free memory
timeout "${BENCH_TIMEOUT:-420}" "$PY" -m baton bench compare --model-path "$MODEL" --device cuda --dtype float16 \
    --num-prompts "$NUM" --concurrency "$NUM" --input-len "$INPUT" --output-len "$OUTPUT" \
    --repeats "${REPEATS:-3}" --warmup-rounds 1 --hf-modes "${HF_MODES-batched}" --engine-args "--max-total-tokens 131072" \
    --variant default: --variant no-overlap:--disable-overlap-schedule \
    ${TORCH_BACKEND-"--variant=torch-backend:--attention-backend torch"} \
    --json-out "$OUT/${TAG:-serve_bench}.json" 2>&1 | tee "$OUT/${TAG:-serve_bench}.txt"
