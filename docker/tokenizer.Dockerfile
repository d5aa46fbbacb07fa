# syntax=docker/dockerfile:1
# The tokenizer service (gRPC): the model's own tokenizer and chat template, shared by the
# routers. Build from the repository root (`make images`):
#   docker build -f docker/tokenizer.Dockerfile -t shoal/tokenizer:0.1.0 .
# Runs as an unprivileged user and with a read-only root filesystem: tokenizer files a model id
# names are fetched into HF_HOME under /tmp (mount an emptyDir or a volume there).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY constraints.txt ./
COPY protos/python protos/python
COPY services/tokenizer services/tokenizer
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt ./protos/python ./services/tokenizer

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/huggingface
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index /wheels/*.whl \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shoal
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["shoal-tokenizer"]
