"""vLLM V1 KV connector: ship a prefilled request's paged KV to a kvxfer ``Consumer`` (producer side).

Load it by module path, alone or as one child of vLLM's ``MultiConnector``::

    --kv-transfer-config '{"kv_connector": "KVXferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transport": "tcp", "deadline": 30}}'

A request is *claimed* only when its ``kv_transfer_params`` hold the key ``"kvxfer"`` (a dict with at least
``"consumer": "host:port"``); for every other request each hook is a no-op. Everything the connector returns in
``kv_transfer_params`` lives under that one key, so it composes with NixlConnector's top-level keys.

The modules, one job each:

- ``connector``: ``KVXferConnector``, the class vLLM loads; checks the configuration and hands each hook to the
  half of its role.
- ``scheduler``: the engine-core half; tracks claimed requests across chunked prefill (prefix-cache hits
  included), orders the ship once the whole prompt is computed, holds blocks at finish only while a transfer may
  still read them.
- ``worker``: the model-runner half; registers vLLM's KV tensors with one ``Producer``, starts a push per order
  after the forward pass (no thread waits for a transfer: each push's done callback records its end) and reports
  each held request exactly once.
- ``metadata``: what the halves send each other every step.
- ``settings``: ``kv_connector_extra_config`` and the per-request claim.

Supported: vLLM >=0.32,<0.34 (0.33 adds ``supports_sleep_mode`` / ``unregister_kv_caches`` /
``restore_kv_caches``), one KV-cache group, tensor- and pipeline-parallel size 1. See docs/vllm.md.
"""

from .connector import KVXferConnector
from .metadata import KVXferConnectorMetadata, KVXferWorkerMetadata, ShipOrder
from .scheduler import KVXferScheduler
from .settings import PARAMS_KEY, Claim, Settings, parse_claim
from .worker import KVXferWorker

__all__ = [
    "PARAMS_KEY",
    "Claim",
    "KVXferConnector",
    "KVXferConnectorMetadata",
    "KVXferScheduler",
    "KVXferWorker",
    "KVXferWorkerMetadata",
    "Settings",
    "ShipOrder",
    "parse_claim",
]
