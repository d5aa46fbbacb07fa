#!/usr/bin/env bash
# End to end on kind: build the images, install the chart with a sample CPU InferenceCluster,
# wait until it is Ready, and send one completion through its router.
#
# Needs a Docker engine, kind, kubectl and helm on the host (none of them runs on the machines
# `make test` targets, so CI does not run this). Set PIP_EXTRA_INDEX_URL for the CPU engine's
# torch (see docker/README.md). KEEP=1 leaves the kind cluster up afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${KIND_CLUSTER:-shoal-e2e}
NAMESPACE=shoal-system
TAG=${IMAGE_TAG:-0.1.0}
for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null || { echo "e2e-kind needs $tool on PATH"; exit 1; }
done
step() { echo "==> [e2e $1/6] $2"; }

step 1 "kind cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
[ "${KEEP:-0}" = 1 ] || trap 'kind delete cluster --name "$CLUSTER"' EXIT

step 2 "images (make images)"
make images IMAGE_TAG="$TAG"

step 3 "loading the images into kind"
for image in engine-cpu router tokenizer operator; do
    kind load docker-image "shoal/$image:$TAG" --name "$CLUSTER"
done

step 4 "helm install (operator and CRD), then the sample cluster of two CPU engines"
# Two steps: Helm cannot create a cluster in the same install as the CRD that defines its kind.
helm upgrade --install shoal charts/shoal --namespace "$NAMESPACE" --create-namespace --wait
helm upgrade shoal charts/shoal --namespace "$NAMESPACE" --wait \
    --set sampleCluster.enabled=true \
    --set-json "sampleCluster.spec={\"model\":{\"source\":\"HuggingFaceTB/SmolLM2-135M-Instruct\",\
\"servedName\":\"SmolLM2-135M-Instruct\",\"dtype\":\"float32\"},\
\"engine\":{\"image\":\"shoal/engine-cpu:$TAG\",\"resources\":{\"cpu\":\"1\",\"memory\":\"4Gi\"},\"kvCacheGiB\":1},\
\"router\":{\"image\":\"shoal/router:$TAG\"},\"tokenizer\":{\"image\":\"shoal/tokenizer:$TAG\"}}"

step 5 "waiting for the InferenceCluster to be Ready (engines load the model)"
kubectl -n "$NAMESPACE" wait ic/smol --for=condition=Ready --timeout=20m
kubectl -n "$NAMESPACE" get ic,statefulsets,deployments,pods

step 6 "one completion through the router"
kubectl -n "$NAMESPACE" port-forward svc/smol-router 18000:8000 >/dev/null &
forward=$!
trap 'kill $forward 2>/dev/null || true; [ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$CLUSTER"' EXIT
for _ in $(seq 1 30); do
    curl -fsS http://127.0.0.1:18000/health >/dev/null 2>&1 && break
    sleep 1
done
reply=$(curl -fsS http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}')
echo "$reply"
echo "$reply" | grep -q '"text"' || { echo "e2e-kind: no completion in the reply"; exit 1; }
echo "e2e-kind: passed"
