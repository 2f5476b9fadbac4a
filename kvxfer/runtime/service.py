"""The receive service a decode runtime embeds: a ``Consumer`` with token-based admission, back-pressure,
hand-off events and Prometheus metrics.

Admission, generation fencing, tombstones, deadlines, quarantine and multi-sender bookkeeping live in the
consumer's sans-IO ledger (``kvxfer.admission.Grants``); this module adds what a runtime needs around it and
nothing that would duplicate it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..consumer import Consumer
from ..layout import KVLayout
from ..lifecycle import Mailbox
from ..transfer import Arrival
from .allocator import PagedPool, TokenAllocator, TokenBlocks

log = logging.getLogger("kvxfer.runtime")

# keys of a push's ``meta`` the service reads; everything else passes through untouched in ``Handoff.meta``
NUM_TOKENS, FIRST_TOKEN, SAMPLING = "num_tokens", "first_token", "sampling"


def handoff_meta(num_tokens: int, first_token: int | None = None, sampling: Any = None, **extra) -> dict:
    """The ``meta`` a producer (a prefill connector) sends with a push so the decode side can start at once:
    the prompt's token count, the first sampled token, and opaque sampling parameters (msgpack-able)."""
    meta = dict(extra)
    meta[NUM_TOKENS] = int(num_tokens)
    if first_token is not None:
        meta[FIRST_TOKEN] = int(first_token)
    if sampling is not None:
        meta[SAMPLING] = sampling
    return meta


@dataclass(frozen=True)
class Handoff:
    """A request whose KV is in the runtime's blocks. The blocks belong to the runtime until ``release``."""

    req: str
    block_ids: np.ndarray  # destination block ids, in token order
    num_tokens: int  # tokens of KV in those blocks
    first_token: int | None  # the token prefill sampled, if the producer sent it
    sampling: Any  # opaque sampling metadata from the producer, passed through
    meta: dict[str, Any]  # the producer's whole meta (parts of a multi-sender request merged)
    nbytes: int
    seconds: float  # admission to hand-off
    gen: int
    peer: str
    timings: dict[str, float] = field(default_factory=dict)
    verified: bool = False  # per-block digests came with the KV and matched (checked before hand-off)


class ReceiveService:
    """Receive KV for a decode runtime.

    ``allocator`` is the runtime's token-based allocator (``allocate(num_tokens) -> block ids | None``,
    ``free(ids)``, optionally ``num_free``); by default a ``PagedPool`` over the whole layout. Admission asks it
    for blocks; when it cannot (or ``reserve_blocks`` would be breached, or ``max_inflight`` requests are
    receiving, or ``max_pending`` hand-offs wait unclaimed in the queue) the producer gets ``Busy`` with
    ``retry_after`` seconds: back-pressure, never an unbounded queue.

    Ready requests go to ``on_ready(handoff)`` (called on a kvxfer thread: keep it short) or, without a
    callback, to a queue read with ``next(timeout)``. The runtime calls ``release(req)`` when the request ends.
    Everything else (``deadline``, ``tombstone_ttl``, ``quarantine``, ``auth``, ``transport_options``, ...) is
    passed to the ``Consumer``.
    """

    def __init__(
        self,
        layout: KVLayout,
        allocator: TokenAllocator | None = None,
        *,
        transport: str = "auto",
        listen: str = "127.0.0.1:0",
        max_inflight: int = 64,
        max_pending: int | None = None,
        reserve_blocks: int = 0,
        deadline: float = 30.0,
        retry_after: float = 0.05,
        on_ready: Callable[[Handoff], None] | None = None,
        metrics: bool = True,
        registry=None,
        **consumer_options,
    ):
        self.layout = layout
        self.block_size = layout.fingerprint.block_size
        self.allocator = allocator if allocator is not None else PagedPool(layout.num_blocks, self.block_size)
        self.blocks = TokenBlocks(self.allocator, self.block_size, reserve_blocks=reserve_blocks)
        self.max_pending = max_pending
        self.blocks.gate = self._gate
        self.on_ready = on_ready
        self._ready = Mailbox("request ready")
        self.metrics = None
        self.consumer = Consumer(
            layout,
            transport=transport,
            listen=listen,
            allocator=self.blocks,
            deadline=deadline,
            max_inflight=max_inflight,
            retry_after=retry_after,
            on_arrival=self._arrived,
            queue_arrivals=False,
            **consumer_options,
        )
        if metrics:
            from .metrics import ServiceMetrics

            try:
                self.metrics = ServiceMetrics(self.stats, registry=registry)
            except BaseException:
                self.consumer.close()
                raise
        self.address = self.consumer.address
        self.transport = self.consumer.transport_name

    # ---- the runtime's calls ------------------------------------------------------------------------------
    def next(self, timeout: float | None = None) -> Handoff:
        """The next ready request (queue mode); ``DeadlineError`` if none within ``timeout``, ``ClosedError``
        once the service closed and every request before was taken."""
        return self._ready.get(timeout)

    def release(self, req: str) -> bool:
        """The runtime is done with ``req``: its blocks go back to the allocator. False if not held."""
        return self.consumer.release(req)

    def cancel(self, req: str, reason: str = "cancelled by the decode runtime") -> bool:
        """Stop receiving ``req``: every producer of it is told, its blocks return once nothing can write them,
        and a tombstone refuses late transfers for it."""
        return self.consumer.cancel(req, reason)

    def state(self, req: str) -> str | None:
        """Where ``req`` stands in the consumer's ledger, so a runtime waiting for it can give up at once:
        ``"receiving"`` (admitted), ``"ready"`` (handed over, not yet released), ``"failed"`` (failed or
        cancelled after admission; remembered for the consumer's ``tombstone_ttl``), or ``None`` (never admitted,
        refused, or released)."""
        return self.consumer.state(req)

    def stats(self) -> dict[str, int]:
        return dict(self.consumer.stats(), pending=self._ready.qsize())

    def close(self) -> None:
        self.consumer.close()
        self._ready.close()

    def __enter__(self) -> ReceiveService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inside ---------------------------------------------------------------------------------------------
    def _gate(self, n: int) -> bool:
        return self.max_pending is None or self.on_ready is not None or self._ready.qsize() < self.max_pending

    def _arrived(self, a: Arrival) -> None:
        meta = a.meta or {}
        capacity = len(a.block_ids) * self.block_size
        num_tokens = meta.get(NUM_TOKENS, capacity)
        if not isinstance(num_tokens, int) or not capacity - self.block_size < num_tokens <= capacity:
            log.warning(
                "kvxfer request %s: num_tokens %r does not fit its %d blocks; using %d",
                a.req,
                num_tokens,
                len(a.block_ids),
                capacity,
            )
            num_tokens = capacity
        first = meta.get(FIRST_TOKEN)
        start = a.timings.get("admitted", a.timings.get("completed", time.monotonic()))
        seconds = max(0.0, a.timings.get("completed", time.monotonic()) - start)
        h = Handoff(
            a.req,
            a.block_ids,
            num_tokens,
            first if isinstance(first, int) else None,
            meta.get(SAMPLING),
            meta,
            a.nbytes,
            seconds,
            a.gen,
            a.peer,
            dict(a.timings),
            bool(a.digests),
        )
        if self.metrics is not None:
            self.metrics.observe(seconds)
        if self.on_ready is not None:
            self.on_ready(h)  # the consumer logs (and survives) a failing callback
        else:
            self._ready.put(h)
