# pegaflow's engine and pegaflow-stat (its probes and Prometheus exporter): numpy, posix-ipc,
# cuda-python, prometheus-client, xxhash and NVRTC; no torch, no vLLM.  From the repository root:
#
#     docker build -f deploy/engine.Dockerfile -t pegaflow-engine:0.1.0 .
#
# The GPU driver's libraries come from the NVIDIA container runtime at start (NVIDIA_VISIBLE_DEVICES,
# NVIDIA_DRIVER_CAPABILITIES): nothing of the driver is in the image.  docs/running.md says how
# to run it (docker) and deploy/kubernetes/ as a DaemonSet.
FROM python:3.12-slim-bookworm

ARG PEGAFLOW_VERSION=0.1.0
LABEL org.opencontainers.image.title="pegaflow-engine" \
      org.opencontainers.image.version="${PEGAFLOW_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# Only what the wheel is built from: the package, the engine, and pyproject's metadata files.
COPY pyproject.toml README.md LICENSE /src/
COPY pegaflow /src/pegaflow
COPY engine /src/engine
# [nvrtc]: the copy kernel is compiled at start by NVRTC, which a driver-only host lacks.
RUN pip install --no-cache-dir "/src[nvrtc]" && rm -rf /src

# Every segment the engine makes is mode 0600: the engine and every vLLM that attaches run as
# one uid.  1000 here; the vLLM image's pods set the same (deploy/kubernetes/vllm-deployment.yaml).
RUN useradd --uid 1000 --create-home pegaflow
USER 1000
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility

ENTRYPOINT ["pegaflow-engine"]
