"""pegaflow: a KV-cache offload engine for vLLM (the client library and connector)."""

from pegaflow.platform.values import package_version

__version__ = package_version()
