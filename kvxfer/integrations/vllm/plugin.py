"""vLLM general plugin (entry point ``vllm.general_plugins``): registers ``KVXferConnector`` by name.

A connector loaded by ``kv_connector_module_path`` works without it, but vLLM's API server rebuilds a
``MultiConnector``'s per-child transfer stats by *registered* connector name, in a process that never imports
the connector's module: without the name, the first stats a worker reports end that server ("Connector
'KVXferConnector' is not registered"). vLLM loads general plugins in every one of its processes (API server,
engine core, workers), so the name is known everywhere kvxfer is installed.
"""

from __future__ import annotations

NAME = "KVXferConnector"


def register() -> None:
    """Register the connector lazily (its module is imported only when vLLM asks for the class); idempotent."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM's plugin loader calls this; without vLLM there is nothing to register with
        return
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvxfer.integrations.vllm.connector", NAME)
