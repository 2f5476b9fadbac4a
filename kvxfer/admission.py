"""Sans-IO bookkeeping of who may touch which blocks, and until when.

``Grants`` is the consumer's ledger for pushes (admission, generations, tombstones, deadlines, completion);
``Leases`` is the producer's ledger for pull offers. Neither touches a socket or a clock: callers pass ``now``
and act on what the methods return, so every rule here is testable without a network.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .allocator import Allocator
from .errors import BlockError, BusyError, CancelledError, KVXferError, StaleError

_generations = itertools.count(1)


@dataclass
class Slot:
    """Blocks granted to one request from one producer session."""

    req: str
    gen: int
    peer: int
    ids: np.ndarray
    nbytes: int
    deadline: float
    meta: dict[str, Any] = field(default_factory=dict)
    digests: bytes = b""
    landed: int = 0
    done: bool = False
    moving: int = 0           # receives in progress into these blocks (stream transports)
    error: KVXferError | None = None
    complete: bool = False
    hold_until: float = 0.0   # a failed slot keeps its blocks until no writer can still touch them

    @property
    def ready(self) -> bool:
        return self.done and self.landed >= self.nbytes and self.error is None


class Grants:
    """The consumer's grants: admit -> (write | land | done)* -> complete -> release, or fail at any point.

    A failed slot's blocks go back to the allocator once nothing may still write into them: no receive in
    progress and, for one-sided transports whose remote writes cannot be stopped from here, ``quarantine``
    seconds after the failure or as soon as the producer's session is gone.
    """

    def __init__(self, allocator: Allocator, block_bytes: int, *, max_inflight: int = 1024,
                 tombstone_ttl: float = 30.0, quarantine: float = 0.0, retry_after: float = 0.05):
        self.allocator = allocator
        self.block_bytes = block_bytes
        self.max_inflight = max_inflight
        self.tombstone_ttl = tombstone_ttl
        self.quarantine = quarantine
        self.retry_after = retry_after
        self.active: dict[str, Slot] = {}
        self.handed: dict[str, Slot] = {}
        self.dying: list[Slot] = []
        self.tombstones: dict[str, float] = {}

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, peer: int, req: str, n: int, deadline: float, now: float) -> tuple[Slot, list[Slot]]:
        """Grant ``n`` blocks or raise ``BusyError``; returns the slot and any older slot it superseded."""
        if n <= 0:
            raise BlockError(f"cannot admit {n} blocks")
        if self.tombstones.get(req, 0.0) > now:
            raise CancelledError(f"request {req!r} was cancelled")
        superseded = []
        old = self.active.get(req)
        if old is not None:
            superseded.append(self.fail(req, StaleError(f"request {req!r} superseded by a newer admission"), now))
        if len(self.active) >= self.max_inflight:
            raise BusyError(f"{len(self.active)} requests in flight", self.retry_after)
        ids = self.allocator.allocate(n)
        if ids is None:
            raise BusyError(f"no room for {n} blocks", self.retry_after)
        slot = Slot(req, next(_generations), peer, np.asarray(ids, dtype=np.int64), n * self.block_bytes, deadline)
        self.active[req] = slot
        return slot, superseded

    def _live(self, peer: int, req: str, gen: int) -> Slot:
        slot = self.active.get(req)
        if slot is None or slot.gen != gen or slot.peer != peer:
            if req in self.tombstones:
                raise CancelledError(f"request {req!r} was cancelled or failed")
            raise StaleError(f"no live grant for request {req!r} generation {gen}")
        return slot

    def check_write(self, peer: int, req: str, gen: int, ids: np.ndarray) -> Slot:
        """The slot a writer may fill, if ``ids`` are exactly the granted blocks in grant order."""
        slot = self._live(peer, req, gen)
        if len(ids) != len(slot.ids) or not np.array_equal(ids, slot.ids):
            raise BlockError(f"request {req!r} writes blocks it was not granted")
        return slot

    def begin_receive(self, slot: Slot) -> None:
        slot.moving += 1

    def end_receive(self, slot: Slot, nbytes: int, now: float) -> Slot | None:
        """Account ``nbytes`` received; returns the slot when it just became ready."""
        slot.moving -= 1
        if slot.error is None:
            slot.landed += nbytes
            return self._maybe_ready(slot)
        return None

    def landed(self, peer: int, req: str, gen: int, nbytes: int) -> Slot | None:
        """A one-sided transport says the bytes are there (NIXL notification)."""
        slot = self._live(peer, req, gen)
        slot.landed += nbytes
        return self._maybe_ready(slot)

    def done(self, peer: int, req: str, gen: int, nbytes: int, meta: dict, digests: bytes) -> Slot | None:
        slot = self._live(peer, req, gen)
        if nbytes != slot.nbytes:
            raise BlockError(f"request {req!r}: producer moved {nbytes} bytes, grant holds {slot.nbytes}")
        slot.done, slot.meta, slot.digests = True, meta, digests
        return self._maybe_ready(slot)

    def _maybe_ready(self, slot: Slot) -> Slot | None:
        if slot.ready and not slot.complete and slot.moving == 0:
            slot.complete = True
            del self.active[slot.req]
            self.handed[slot.req] = slot
            return slot
        return None

    # ---- endings -----------------------------------------------------------------------------------------
    def fail(self, req: str, error: KVXferError, now: float, *, one_sided: bool = False) -> Slot | None:
        """End an active request with ``error``; its blocks are freed once nothing can write them."""
        slot = self.active.pop(req, None)
        if slot is None:
            return None
        slot.error = error
        slot.hold_until = now + (self.quarantine if one_sided else 0.0)
        self.tombstones[req] = now + self.tombstone_ttl
        self.dying.append(slot)
        self.reap(now)
        return slot

    def release(self, req: str) -> bool:
        """The runtime is done with a handed-off request: its blocks go back."""
        slot = self.handed.pop(req, None)
        if slot is None:
            return False
        self.allocator.free(slot.ids)
        return True

    def peer_lost(self, peer: int, error: KVXferError, now: float) -> list[Slot]:
        """Every active slot of a dead session fails; nothing of it can write any more."""
        lost = [s for s in self.active.values() if s.peer == peer]
        for s in lost:
            self.fail(s.req, error, now)
        for s in self.dying:
            if s.peer == peer:
                s.hold_until = min(s.hold_until, now)
        self.reap(now)
        return lost

    def expired(self, now: float) -> list[Slot]:
        """Active slots past their deadline (the caller fails them)."""
        return [s for s in self.active.values() if s.deadline <= now]

    def reap(self, now: float) -> int:
        """Free the blocks of failed slots that no writer can touch any more; drop old tombstones."""
        keep, freed = [], 0
        for s in self.dying:
            if s.moving == 0 and s.hold_until <= now:
                self.allocator.free(s.ids)
                freed += len(s.ids)
            else:
                keep.append(s)
        self.dying = keep
        if self.tombstones:
            self.tombstones = {r: t for r, t in self.tombstones.items() if t > now}
        return freed


@dataclass
class Lease:
    req: str
    gen: int
    peer: str
    ids: np.ndarray
    expires: float


class Leases:
    """The producer's pull offers: blocks readable by one consumer until the lease expires or is released."""

    def __init__(self):
        self.active: dict[tuple[str, int], Lease] = {}

    def offer(self, peer: str, req: str, ids: np.ndarray, lease: float, now: float) -> Lease:
        item = Lease(req, next(_generations), peer, ids, now + lease)
        self.active[(req, item.gen)] = item
        return item

    def check_read(self, peer: str, req: str, gen: int, ids: np.ndarray, now: float) -> Lease:
        """The lease a reader may read from, if ``ids`` are exactly the offered blocks."""
        item = self.active.get((req, gen))
        if item is None or item.peer != peer:
            raise StaleError(f"no live offer for request {req!r} generation {gen}")
        if item.expires <= now:
            raise StaleError(f"the lease of request {req!r} expired")
        if len(ids) != len(item.ids) or not np.array_equal(ids, item.ids):
            raise BlockError(f"request {req!r} reads blocks that were not offered")
        return item

    def release(self, req: str, gen: int, now: float) -> Lease:
        """The consumer is done reading; a lease that ran out first is an error."""
        item = self.active.pop((req, gen), None)
        if item is None:
            raise StaleError(f"no live offer for request {req!r} generation {gen}")
        if item.expires <= now:
            raise StaleError(f"the lease of request {req!r} expired before it was released")
        return item

    def drop(self, req: str, gen: int) -> Lease | None:
        return self.active.pop((req, gen), None)

    def expired(self, now: float) -> list[Lease]:
        return [x for x in self.active.values() if x.expires <= now]
