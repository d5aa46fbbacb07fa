# syntax=docker/dockerfile:1
# The InferenceCluster operator (kopf). Build from the repository root (`make images`):
#   docker build -f docker/operator.Dockerfile -t shoal/operator:0.1.0 .
# Runs as an unprivileged user and with a read-only root filesystem (writes only under /tmp).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY constraints.txt ./
COPY protos/python protos/python
COPY operator operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt ./protos/python ./operator

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index /wheels/*.whl \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shoal
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["shoal-operator"]
