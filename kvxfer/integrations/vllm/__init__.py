"""vLLM V1 KV connector: ship a prefilled request's paged KV to a kvxfer ``Consumer`` (push), hold it for a vLLM
decode instance to fetch, and, on that decode instance, fetch it into the blocks vLLM allocated.

Load it by module path, alone or as one child of vLLM's ``MultiConnector``::

    --kv-transfer-config '{"kv_connector": "KVXferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transport": "tcp", "deadline": 30,
                                                         "listen": "10.0.3.5:5600"}}'

A request is *claimed* only when its ``kv_transfer_params`` hold the key ``"kvxfer"``: ``{"consumer": "host:port"}``
pushes, ``{}`` holds (needs ``listen``), and a prefill's response ``{"status": "held", ...}`` passed on to a
``kv_consumer`` instance is fetched. For every other request each hook is a no-op. Everything the connector returns
in ``kv_transfer_params`` lives under that one key, so it composes with NixlConnector's top-level keys.

The modules, one job each:

- ``connector``: ``KVXferConnector``, the class vLLM loads; checks the configuration and hands each hook to the
  half of its role.
- ``scheduler``: the engine-core half; tracks claimed requests across chunked prefill (prefix-cache hits
  included), orders the push or hold once the whole prompt is computed, holds blocks at finish only while a
  transfer may still read them; reports a ticket's tokens as loaded asynchronously and orders their fetch.
- ``worker``: the model-runner half; registers vLLM's KV tensors with a ``Producer`` and / or a fetching
  ``Consumer``, starts pushes and holds after the forward pass and fetches before it (no thread waits for a
  transfer) and reports each request exactly once (``finished_sending`` / ``finished_recving``, load errors).
- ``stats``: the transfers, per kind, for vLLM's connector stats and Prometheus metrics.
- ``ranks``: which prefill ranks each decode rank fetches from, and where they hold.
- ``groups``: which blocks of each KV-cache group ship (a sliding window: only the tail it keeps).
- ``metadata``: what the halves send each other every step.
- ``settings``: ``kv_connector_extra_config`` and the per-request claim.
- ``plugin``: the ``vllm.general_plugins`` entry point that registers the connector's name in every vLLM process.

Supported: vLLM >=0.32,<0.34 (0.33 adds ``supports_sleep_mode`` / ``unregister_kv_caches`` /
``restore_kv_caches``), tensor and pipeline parallelism, full-attention and sliding-window KV-cache groups. See
docs/vllm.md.
"""

from .connector import KVXferConnector
from .metadata import FetchOrder, KVXferConnectorMetadata, KVXferWorkerMetadata, ShipOrder
from .plugin import register
from .scheduler import KVXferScheduler
from .settings import PARAMS_KEY, Claim, Settings, Ticket, parse_claim
from .stats import KVXferStats
from .worker import KVXferWorker

__all__ = [
    "PARAMS_KEY",
    "Claim",
    "FetchOrder",
    "KVXferConnector",
    "KVXferConnectorMetadata",
    "KVXferScheduler",
    "KVXferStats",
    "KVXferWorker",
    "KVXferWorkerMetadata",
    "Settings",
    "ShipOrder",
    "Ticket",
    "parse_claim",
    "register",
]
