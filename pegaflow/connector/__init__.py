"""vLLM v1 KV connector: ``kv_connector_module_path="pegaflow.connector"``, class ``PegaKVConnector``;
``kv_transfer_config()`` builds vLLM's config for it.

The class is imported on first use, so the vLLM-free parts (layout, config, namespace)
import without vLLM.
"""

from pegaflow.connector.config import kv_transfer_config

__all__ = ["PegaKVConnector", "kv_transfer_config"]


def __getattr__(name: str):
    if name == "PegaKVConnector":
        from pegaflow.connector.connector import PegaKVConnector
        return PegaKVConnector
    raise AttributeError(f"module 'pegaflow.connector' has no attribute {name!r}")
