"""A receive service in the test process, for the receive-service tests (``service`` fixture in conftest)."""

from __future__ import annotations

from conformance.kvspec import Spec
from kvxfer import KVLayout
from kvxfer.runtime import PagedPool, ReceiveService

SPEC = Spec(kind="nhd", num_blocks=64, layers=4, heads=2, block_size=4, head_dim=8)
SENTINEL = 0xAB
OPTIONS = {"quarantine": 0.2, "deadline": 10.0}


class Local:
    """A ReceiveService in the test process over sentinel-filled memory, so tests can read its blocks."""

    def __init__(self, spec: Spec, transport: str, **options):
        self.spec = spec
        tensors, kw, self.views, self.raw = spec.build(fill=SENTINEL)
        layout = KVLayout.from_tensors(tensors, **kw)
        self.pool = options.pop("pool", None) or PagedPool(spec.num_blocks, spec.block_size)
        self.svc = ReceiveService(layout, self.pool, transport=transport, **{**OPTIONS, **options})
        self.address = self.svc.address

    def __getattr__(self, name):
        return getattr(self.svc, name)

    def settled(self) -> bool:
        s = self.svc.stats()
        return self.pool.num_free == self.pool.capacity and s["inflight"] == 0 and s["dying"] == 0 and s["handed"] == 0

    def metric(self, name: str) -> float:
        return self.svc.metrics.value(f"kvxfer_receive_{name}")
