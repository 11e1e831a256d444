# syntax=docker/dockerfile:1
# The operator: `baton operator` (kopf), installed without torch (`pip install '.[operator]'`).
#   docker build -f images/operator.Dockerfile -t ghcr.io/baton-llm/baton-operator:0.1.0 .
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
RUN /opt/baton/bin/pip install ".[operator]"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 1000 baton \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton
COPY --from=builder /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/baton
USER 1000:1000
WORKDIR /home/baton
EXPOSE 8080 9090
# The manifests' and the chart's liveness probe asks the same route (GET /healthz on 8080, kopf's).
HEALTHCHECK --interval=30s --timeout=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=5)"]
ENTRYPOINT ["baton", "operator"]
CMD ["--all-namespaces", "--standalone"]
