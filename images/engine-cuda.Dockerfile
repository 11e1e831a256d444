# syntax=docker/dockerfile:1
# The CUDA engine: `baton serve` (and `baton router`, `baton fetch-model`) with torch for CUDA 12.8,
# FlashInfer with its ahead-of-time kernels, and the CUDA Mooncake build (KV transfer over RDMA or TCP).
#   docker build -f images/engine-cuda.Dockerfile -t ghcr.io/baton-llm/baton:0.1.0-cuda .
# Ubuntu 24.04's Python is 3.12 (baton needs >= 3.11). The CUDA runtime base, not devel: torch's wheels
# carry their CUDA libraries and FlashInfer's jit-cache wheel its compiled kernels, so nvcc stays out.
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG FLASHINFER_INDEX_URL=https://flashinfer.ai/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/baton
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY baton ./baton
COPY engine ./engine
COPY router ./router
COPY operator ./operator
RUN /opt/baton/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" ".[engine,pd,router]" \
    && /opt/baton/bin/pip install --extra-index-url "${FLASHINFER_INDEX_URL}" \
       "flashinfer-python==0.7.2.post1" "flashinfer-jit-cache==0.7.2.post1" \
    && /opt/baton/bin/pip install "fla-core==0.6.0" einops

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Run-time needs: Python itself; libibverbs1/librdmacm1/libnuma1 for Mooncake's RDMA transport; gcc,
# libc6-dev and python3.12-dev because Triton compiles its CUDA launcher with the C compiler at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev \
       libibverbs1 librdmacm1t64 libnuma1 \
       gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 baton \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton
COPY --from=builder /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/baton
USER 1000:1000
WORKDIR /home/baton
EXPOSE 30000 8998
# probe: Kubernetes probes the engine, not Docker: the operator sets a startup probe (TCP, the model
# loads), readiness on GET /health and liveness (TCP) on the `http` port; Docker's own check is off.
HEALTHCHECK NONE
ENTRYPOINT ["baton", "serve"]
