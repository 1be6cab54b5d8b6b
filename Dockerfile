# syntax=docker/dockerfile:1
#
# coliworker images. Three stages; build from the repository root:
#
#   docker build -t coliworker:cuda .              # default target: CUDA 12 + CuPy
#   docker build -t coliworker:cpu --target cpu .  # NumPy backend only, no GPU needed
#
# Both run `coliworker serve` as an unprivileged user, listen on 0.0.0.0:50051 (gRPC),
# 0.0.0.0:50052 (the socket data plane) and 0.0.0.0:9400 (/metrics), and report health
# through grpc.health.v1. Every setting is a COLIWORKER_* variable (docs/deployment.md). A
# worker listening beyond loopback needs a token (COLIWORKER_TOKEN_FILE) or an explicit
# COLIWORKER_INSECURE=1: the image sets neither.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------
# builder: the wheel (pure Python; the .cu kernels travel as package data and compile on
# first use on the target GPU, cached per device).
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY server/ server/
COPY client/ client/
COPY kernels/ kernels/
COPY tools/ tools/
COPY LICENSE ./
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------
# cpu: NumPy backend, for development, CI and machines without a GPU.
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    COLIWORKER_HOST=0.0.0.0 \
    COLIWORKER_PORT=50051 \
    COLIWORKER_DATA_PORT=50052 \
    COLIWORKER_METRICS_PORT=9400 \
    COLIWORKER_BACKEND=numpy
COPY --from=builder /wheels/ /wheels/
# The wheel built above, by path (a same-named package on the index cannot win); its
# dependencies keep pyproject's ranges.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/coliworker-*.whl \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --create-home --home-dir /home/coliworker coliworker
USER 10001
WORKDIR /home/coliworker
EXPOSE 50051 50052 9400
# The probe speaks grpc.health.v1 with hand-encoded bytes; the shell expands the port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["sh", "-c", "python -m coliworker.tools.health 127.0.0.1:${COLIWORKER_PORT:-50051}"]
ENTRYPOINT ["coliworker", "serve"]

# ---------------------------------------------------------------------------------------
# cuda (default): CUDA 12 runtime (cuBLAS, NVRTC for the kernels) + CuPy. Needs the NVIDIA
# container toolkit on the host (`docker run --gpus all`, or the compose GPU reservation).
FROM ${CUDA_IMAGE} AS cuda
# Ubuntu's Python is externally managed (PEP 668): install into a virtual environment.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/coliworker \
    && useradd --system --uid 10001 --create-home --home-dir /home/coliworker coliworker
ENV PATH=/opt/coliworker/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CUPY_CACHE_DIR=/home/coliworker/.cupy/kernel_cache \
    COLIWORKER_KEPT_CACHE=/opt/coliworker/kept \
    COLIWORKER_HOST=0.0.0.0 \
    COLIWORKER_PORT=50051 \
    COLIWORKER_DATA_PORT=50052 \
    COLIWORKER_METRICS_PORT=9400 \
    COLIWORKER_BACKEND=auto
COPY --from=builder /wheels/ /wheels/
# The compiled decode calls (server/kept.c, server/fastpath.c) are built here, with a compiler
# and the Python headers that leave the image again (docs/performance.md, COLIWORKER_KEPT_C,
# COLIWORKER_FASTPATH).
# hadolint ignore=DL3008,DL3013
RUN wheel=$(echo /wheels/coliworker-*.whl) \
    && pip install --no-cache-dir "coliworker[gpu] @ file://${wheel}" \
    && rm -rf /wheels \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && python -m coliworker.server.kept \
    && python -m coliworker.server.fastpath \
    && apt-get purge -y --auto-remove gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
USER 10001
WORKDIR /home/coliworker
EXPOSE 50051 50052 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sh", "-c", "python -m coliworker.tools.health 127.0.0.1:${COLIWORKER_PORT:-50051}"]
ENTRYPOINT ["coliworker", "serve"]
