"""ferry inside vLLM: a KV connector that vLLM loads by module path (docs/VLLM.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "FerryConnector",
        "kv_connector_module_path": "ferry.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"mode": "push", "port": 7710}}'

Importing this package imports vLLM (the connector derives from vLLM's KVConnectorBase_V1);
`import ferry` alone does not.
"""

from .connector import FerryConnector, FerryConnectorMetadata

__all__ = ["FerryConnector", "FerryConnectorMetadata"]
