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
class Part:
    """One sender's share of a multi-sender request: its own generation, session, layers and bytes."""

    index: int
    gen: int
    peer: int
    layers: tuple[int, ...]
    nbytes: int
    slot: "Slot"
    landed: int = 0
    done: bool = False

    @property
    def error(self) -> KVXferError | None:  # a write ticket: a failed request stops every part's receive
        return self.slot.error


@dataclass
class Slot:
    """Blocks granted to one request: from one producer session, or from ``senders`` sessions (``parts``)
    that each fill a disjoint subset of layers of the same blocks."""

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
    senders: int = 1
    parts: dict[int, Part] = field(default_factory=dict)   # multi-sender only, by part index
    live_peers: set[int] = field(default_factory=set)      # sessions that may still write these blocks
    admitted: float = 0.0

    @property
    def ready(self) -> bool:
        if self.senders > 1:
            return (len(self.parts) == self.senders and self.error is None
                    and all(p.done and p.landed >= p.nbytes for p in self.parts.values()))
        return self.done and self.landed >= self.nbytes and self.error is None

    def members(self) -> list[tuple[int, int]]:
        """(session, generation) of every writer of this request."""
        if self.senders > 1:
            return [(p.peer, p.gen) for p in self.parts.values()]
        return [(self.peer, self.gen)]


class Grants:
    """The consumer's grants: admit -> (write | land | done)* -> complete -> release, or fail at any point.

    A failed slot's blocks go back to the allocator once nothing may still write into them: no receive in
    progress and, for one-sided transports whose remote writes cannot be stopped from here, ``quarantine``
    seconds after the failure or as soon as the producer's session is gone.
    """

    def __init__(self, allocator: Allocator, block_bytes: int, *, max_inflight: int = 1024,
                 tombstone_ttl: float = 30.0, quarantine: float = 0.0, retry_after: float = 0.05,
                 num_layers: int = 1):
        self.allocator = allocator
        self.block_bytes = block_bytes
        self.num_layers = num_layers
        self.max_inflight = max_inflight
        self.tombstone_ttl = tombstone_ttl
        self.quarantine = quarantine
        self.retry_after = retry_after
        self.active: dict[str, Slot] = {}
        self.handed: dict[str, Slot] = {}
        self.dying: list[Slot] = []
        self.tombstones: dict[str, float] = {}

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, peer: int, req: str, n: int, deadline: float, now: float, *, senders: int = 1,
              part: int = 0, layers=None) -> tuple[Slot, list[Slot]]:
        """Grant ``n`` blocks or raise ``BusyError``; returns the slot and any older slot it superseded.

        With ``senders > 1`` the request is split between that many producer sessions, part ``part`` carrying
        ``layers``: the first part to arrive is admitted (blocks, deadline, in-flight bound); later parts
        join the same grant and get their own generation (``admit_part``), without a second allocation.
        """
        if n <= 0:
            raise BlockError(f"cannot admit {n} blocks")
        if self.tombstones.get(req, 0.0) > now:
            raise CancelledError(f"request {req!r} was cancelled")
        if req in self.handed:
            raise StaleError(f"request {req!r} was already received and is held by the runtime")
        if senders > 1:
            layers = self._check_layers(senders, part, layers)
        elif senders != 1 or part != 0 or (layers is not None and len(layers) != self.num_layers):
            raise BlockError(f"request {req!r}: a single sender carries every layer as part 0")
        superseded = []
        old = self.active.get(req)
        if old is not None and senders > 1 and old.senders == senders and part not in old.parts:
            self._join(old, peer, n, part, layers)
            return old, []
        if old is not None:
            superseded.append(self.fail(req, StaleError(f"request {req!r} superseded by a newer admission"), now))
        if len(self.active) >= self.max_inflight:
            raise BusyError(f"{len(self.active)} requests in flight", self.retry_after)
        ids = self.allocator.allocate(n)
        if ids is None:
            raise BusyError(f"no room for {n} blocks", self.retry_after)
        slot = Slot(req, next(_generations), peer, np.asarray(ids, dtype=np.int64), n * self.block_bytes, deadline,
                    senders=senders, live_peers={peer}, admitted=now)
        self.active[req] = slot
        if senders > 1:
            first = self._join(slot, peer, n, part, layers)
            slot.gen = first.gen
        return slot, superseded

    def _check_layers(self, senders: int, part: int, layers) -> tuple[int, ...]:
        if not 0 <= part < senders:
            raise BlockError(f"part {part} of {senders} senders")
        ls = tuple(sorted(int(x) for x in (layers or ())))
        if not ls or len(set(ls)) != len(ls) or ls[0] < 0 or ls[-1] >= self.num_layers:
            raise BlockError(f"part {part}: layers {list(layers or ())} are not distinct layers of "
                             f"[0, {self.num_layers})")
        return ls

    def _join(self, slot: Slot, peer: int, n: int, part: int, layers: tuple[int, ...]) -> Part:
        if n != len(slot.ids):
            raise BlockError(f"request {slot.req!r} part {part}: {n} blocks, the request holds {len(slot.ids)}")
        taken = {x for p in slot.parts.values() for x in p.layers}
        if taken & set(layers):
            raise BlockError(f"request {slot.req!r} part {part}: layers {sorted(taken & set(layers))} "
                             "already belong to another part")
        if len(slot.parts) == slot.senders - 1 and len(taken) + len(layers) != self.num_layers:
            raise BlockError(f"request {slot.req!r}: its {slot.senders} parts cover "
                             f"{len(taken) + len(layers)} of {self.num_layers} layers")
        p = Part(part, next(_generations), peer, layers, n * self.block_bytes * len(layers) // self.num_layers,
                 slot)
        slot.parts[part] = p
        slot.live_peers.add(peer)
        return p

    def part(self, slot: Slot, gen: int) -> Part | None:
        """The part of a multi-sender ``slot`` with generation ``gen``."""
        return next((p for p in slot.parts.values() if p.gen == gen), None)

    def _live(self, peer: int, req: str, gen: int) -> Slot:
        return self._live_part(peer, req, gen)[0]

    def _live_part(self, peer: int, req: str, gen: int) -> tuple[Slot, Part | None]:
        slot = self.active.get(req)
        part = self.part(slot, gen) if slot is not None and slot.senders > 1 else None
        if slot is None or (part is None and (slot.senders > 1 or slot.gen != gen)) \
                or (part.peer if part else slot.peer) != peer:
            if req in self.tombstones:
                raise CancelledError(f"request {req!r} was cancelled or failed")
            raise StaleError(f"no live grant for request {req!r} generation {gen}")
        return slot, part

    def check_write(self, peer: int, req: str, gen: int, ids: np.ndarray) -> Slot | Part:
        """The ticket a writer may fill (the slot, or the part of a multi-sender request), if ``ids`` are
        exactly the granted blocks in grant order."""
        slot, part = self._live_part(peer, req, gen)
        if len(ids) != len(slot.ids) or not np.array_equal(ids, slot.ids):
            raise BlockError(f"request {req!r} writes blocks it was not granted")
        return part or slot

    def begin_receive(self, slot: Slot) -> None:
        slot.moving += 1

    def end_receive(self, slot: Slot, nbytes: int, now: float, part: Part | None = None) -> Slot | None:
        """Account ``nbytes`` received (into ``part``, for a multi-sender request); returns the slot when it
        just became ready."""
        slot.moving -= 1
        if slot.error is None:
            if part is not None:
                part.landed += nbytes
            else:
                slot.landed += nbytes
            return self._maybe_ready(slot)
        return None

    def landed(self, peer: int, req: str, gen: int, nbytes: int) -> Slot | None:
        """A one-sided transport says the bytes are there (NIXL notification)."""
        slot, part = self._live_part(peer, req, gen)
        if part is not None:
            part.landed += nbytes
        else:
            slot.landed += nbytes
        return self._maybe_ready(slot)

    def done(self, peer: int, req: str, gen: int, nbytes: int, meta: dict, digests: bytes) -> Slot | None:
        """The producer (or one part's producer) says it moved everything. A duplicate ``Done`` for a
        request already handed off is harmless: it raises ``StaleError`` and changes nothing."""
        slot, part = self._live_part(peer, req, gen)
        expected = part.nbytes if part else slot.nbytes
        if nbytes != expected:
            raise BlockError(f"request {req!r}: producer moved {nbytes} bytes, grant holds {expected}")
        if part is not None:
            part.done = True
            slot.meta = {**slot.meta, **meta} if part.index == 0 else {**meta, **slot.meta}  # part 0 wins
        else:
            slot.done, slot.meta, slot.digests = True, meta, digests
        return self._maybe_ready(slot)

    def confirm(self, slot: Slot) -> Slot | None:
        """Pull: the producer confirmed the read (its lease held); returns the slot if it is now ready."""
        slot.done = True
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
        lost = [s for s in self.active.values() if peer in s.live_peers]
        for s in lost:
            self.fail(s.req, error, now)
        for s in self.dying:
            s.live_peers.discard(peer)
            if not s.live_peers:
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
