"""vLLM v1 KV connector: ``kv_connector_module_path="pegaflow.connector"``, class ``PegaKVConnector``."""

from pegaflow.connector.connector import PegaKVConnector

__all__ = ["PegaKVConnector"]
