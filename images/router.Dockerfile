# syntax=docker/dockerfile:1
# The router: `baton router` only, installed without torch (`pip install '.[router]'`).
#   docker build -f images/router.Dockerfile -t ghcr.io/baton-llm/baton-router:0.1.0 .
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/baton
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY baton ./baton
COPY engine ./engine
COPY router ./router
COPY operator ./operator
RUN /opt/baton/bin/pip install ".[router]"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 1000 baton \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton
COPY --from=builder /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/baton
USER 1000:1000
WORKDIR /home/baton
EXPOSE 8000
# probe: the operator gives router pods readiness on GET /health and a TCP liveness probe on the
# `http` port (the port is an argument, so Docker's own check is off).
HEALTHCHECK NONE
ENTRYPOINT ["baton", "router"]
