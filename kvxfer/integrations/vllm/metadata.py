"""What crosses between the connector's two halves each step: the scheduler's orders to the worker
(``KVXferConnectorMetadata``) and the worker's report of the transfers that ended (``KVXferWorkerMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ShipOrder:
    """Ship these blocks of one request to one consumer (the whole prompt is computed)."""

    req_id: str  # vLLM's request id
    transfer_id: str  # the id the consumer sees (router-chosen, default: vLLM's)
    consumer: str
    block_ids: list[int]
    num_tokens: int  # prompt tokens covered by the blocks
    attempt: int  # 1 (the field fences a late report against a future re-ship policy)
    deadline: float  # seconds from the order
    digests: bool
    meta: dict


@dataclass
class KVXferConnectorMetadata(KVConnectorMetadata):
    ship: list[ShipOrder] = field(default_factory=list)
    cancel: dict[str, tuple[int, str]] = field(default_factory=dict)  # req -> (attempt, reason)
    delayed_free: set[str] = field(default_factory=set)  # request_finished returned True for these


@dataclass
class KVXferWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfers that ended on the worker: req -> (attempt, status, error)."""

    ended: dict[str, tuple[int, str, str | None]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVXferWorkerMetadata):
            merged = dict(self.ended)
            for req, (attempt, status, error) in other.ended.items():
                old = merged.get(req)
                if old is None or old[0] < attempt or (old[0] == attempt and status != "done"):
                    merged[req] = (attempt, status, error)
            return KVXferWorkerMetadata(merged)
        return self
