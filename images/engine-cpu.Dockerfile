# syntax=docker/dockerfile:1
# The CPU engine: `baton serve` (and `baton router`, `baton fetch-model`) with torch for CPU and the
# non-CUDA Mooncake build (KV transfer over TCP). Built from the repository root by images/build.sh:
#   docker build -f images/engine-cpu.Dockerfile -t ghcr.io/baton-llm/baton:0.1.0 .
# Base images are pinned by version tag here; `images/build.sh --pin-digests` resolves each tag to
# its digest and builds from tag@sha256 (see docs/images.md).
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/baton
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY baton ./baton
COPY engine ./engine
COPY router ./router
COPY operator ./operator
# the install command of the README, with the extras this image runs
RUN /opt/baton/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" ".[engine,pd-cpu,router]"

FROM ${PYTHON_IMAGE}
# libibverbs1: Mooncake's TCP transport links against it. gcc + libc6-dev are not build leftovers: the
# engine compiles its native CPU kernels on the node it runs on (-march=native, engine/kernels/build.py)
# and Triton builds its launcher at run time; without a compiler the engine falls back to slower torch.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
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
