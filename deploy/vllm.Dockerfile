# vLLM with pegaflow's connector, on vLLM's own image at the release verified on a GPU
# (pyproject.toml's `vllm` extra; tests/deploy/ checks the two agree).  From the repository root:
#
#     docker build -f deploy/vllm.Dockerfile -t pegaflow-vllm:0.26.0 .
#
# vLLM's image already has numpy, cuda-python and prometheus-client; pip adds posix-ipc and
# xxhash and upgrades nothing vLLM pinned.
FROM vllm/vllm-openai:v0.26.0

ARG PEGAFLOW_VERSION=0.1.0
LABEL org.opencontainers.image.title="pegaflow-vllm" \
      org.opencontainers.image.version="${PEGAFLOW_VERSION}"

COPY pyproject.toml README.md LICENSE /src/
COPY pegaflow /src/pegaflow
COPY engine /src/engine
RUN python3 -m pip install --no-cache-dir /src && rm -rf /src

# vLLM's image starts `vllm serve` with the container's arguments; the connector is chosen by
# them: --kv-transfer-config '{"kv_connector":"PegaKVConnector",
#   "kv_connector_module_path":"pegaflow.connector","kv_role":"kv_both"}'
