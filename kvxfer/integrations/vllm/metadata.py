"""What crosses between the connector's two halves each step: the scheduler's orders to the worker
(``KVXferConnectorMetadata``) and the worker's report of the transfers that ended (``KVXferWorkerMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ShipOrder:
    """Ship these blocks of one request to one consumer, or hold them for a fetch (the whole prompt is computed)."""

    req_id: str  # vLLM's request id
    transfer_id: str  # the id the consumer sees (router-chosen, default: vLLM's)
    consumer: str  # "" for a hold
    block_ids: list[int]
    num_tokens: int  # prompt tokens covered by the blocks
    attempt: int  # 1 (the field fences a late report against a future re-ship policy)
    deadline: float  # seconds from the order
    digests: bool
    meta: dict
    lease_expires: float = 0.0  # a hold: time.time() when its lease ends (0: a push)
    # each KV-cache group's (first prompt block, number of blocks), its blocks one after another in ``block_ids``;
    # empty: one group, all of ``block_ids``
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "push" if self.consumer else "hold"


@dataclass
class FetchOrder:
    """Load held blocks ``[skip, skip + len(block_ids))`` of a prefill's hold into these blocks of ours."""

    req_id: str  # vLLM's request id (of the decode request)
    transfer_id: str  # the hold's request id on the prefill
    address: str  # the prefill worker's listen address
    block_ids: list[int]  # ours, scheduler blocks, in order
    skip: int  # held blocks already here (local prefix-cache hit)
    num_tokens: int  # prompt tokens the hold covers
    block_size: int  # the ticket's tokens per block (checked against ours before any connection)
    fingerprint: str  # the ticket's layout id ("" when the prefill did not know it)
    lease_expires: float
    deadline: float  # seconds from the order
    ranks: tuple[int, int] = (1, 1)  # the prefill's (TP, PP) sizes: its ranks hold shares (``ranks``)
    # each KV-cache group's (first block of its hold to read, number of blocks), their blocks one after another in
    # ``block_ids``; empty: one group, read from ``skip``
    spans: list[tuple[int, int]] = field(default_factory=list)
    # the ticket's KV-cache groups, a hold each (declines name every one, even when ``spans`` could not be mapped);
    # 0: one per span
    groups: int = 0
    error: str = ""  # the scheduler could not map the blocks: fail at once (the request still waits for a report)
    ordered_at: float = 0.0  # when the scheduler allocated the blocks (time.time()): a worker that gets it late says so

    def __post_init__(self) -> None:
        self.groups = self.groups or len(self.spans) or 1


@dataclass
class KVXferConnectorMetadata(KVConnectorMetadata):
    ship: list[ShipOrder] = field(default_factory=list)
    fetch: list[FetchOrder] = field(default_factory=list)
    cancel: dict[str, tuple[int, str]] = field(default_factory=dict)  # req -> (attempt, reason)
    delayed_free: set[str] = field(default_factory=set)  # request_finished returned True for these
    decline: list[tuple[str, str, str]] = field(default_factory=list)  # (address, hold id, why): tickets not fetched


@dataclass
class KVXferWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfers that ended on the worker: req -> (attempt, status, error); what a fetch moved: req -> info
    (``nbytes``, ``seconds``); the worker's layout id once known (the prefill puts it in its tickets)."""

    ended: dict[str, tuple[int, str, str | None]] = field(default_factory=dict)
    fetched: dict[str, dict] = field(default_factory=dict)
    fingerprint: str = ""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVXferWorkerMetadata):
            merged = dict(self.ended)
            for req, (attempt, status, error) in other.ended.items():
                old = merged.get(req)
                if old is None or old[0] < attempt or (old[0] == attempt and status != "done"):
                    merged[req] = (attempt, status, error)
            return KVXferWorkerMetadata(
                merged, {**self.fetched, **other.fetched}, self.fingerprint or other.fingerprint
            )
        return self
