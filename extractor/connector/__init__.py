"""The hsx KV connector, loaded by vLLM via ``kv_connector_module_path="extractor.connector"``."""

from extractor.connector.connector import HsxConnector

__all__ = ["HsxConnector"]
