"""Sans-IO bookkeeping of who may touch which blocks, and until when: every protocol rule lives here.

``Grants`` is the consumer's ledger (admission, generations, tombstones, deadlines, completion, cancel
matching, meta merging, revocation, and when blocks may be freed); ``Leases`` is the producer's ledger for
pull offers. Neither touches a socket or a clock: callers pass ``now`` and act on what the methods return,
so every rule is testable without a network. A slot's life is an explicit state with a transition table
(in the manner of h11's ``_state``); an illegal transition raises ``ProtocolError`` and changes nothing.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import logging
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .allocator import Allocator
from .errors import (
    BlockError,
    BusyError,
    CancelledError,
    ClosedError,
    ConfigError,
    KVXferError,
    ProtocolError,
    StaleError,
)
from .plan import byte_ranges, check_ids, range_bytes

log = logging.getLogger("kvxfer")
_generations = itertools.count(1)

# seconds a pull whose Released went out waits past its deadline for the producer's Ack or Error
VERDICT_WAIT = 5.0
MAX_REFUSED, MAX_REFUSED_NAME = 4096, 1024  # the tombstones refused handshakes may leave, and their names' length


class State(enum.Enum):
    GRANTED = "granted"  # blocks allocated to the request, waiting for bytes (or for Done)
    RECEIVING = "receiving"  # a local receiver is landing bytes in them now (stream push, any pull)
    HANDED = "handed"  # complete: the runtime owns the blocks until it releases them
    FAILED = "failed"  # ended with an error: the blocks wait until no byte can still land in them
    FREED = "freed"  # the blocks are back in the allocator

    __hash__ = object.__hash__  # members are compared by identity: Enum's own hash is Python code, on every step


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.GRANTED: frozenset({State.RECEIVING, State.HANDED, State.FAILED}),
    State.RECEIVING: frozenset({State.GRANTED, State.FAILED}),
    State.HANDED: frozenset({State.FREED, State.FAILED}),  # FAILED: revoked before the runtime saw it
    State.FAILED: frozenset({State.FREED}),
    State.FREED: frozenset(),
}


@dataclass
class Part:
    """One sender's share of a multi-sender request: its own generation, session, what it carries of every
    block (``selection``: layers or heads; ``ranges``: those bytes of a block, sorted) and its total bytes."""

    index: int
    gen: int
    peer: int
    selection: Any
    ranges: np.ndarray
    nbytes: int
    slot: Slot
    landed: int = 0
    done: bool = False
    windows: list[tuple[int, int]] = field(default_factory=list)  # stream bytes receives claimed, sorted
    extents: Any = None  # the receiving transport's extents of it, made once for all its windows

    @property
    def error(self) -> KVXferError | None:  # a write ticket: a failed request stops every part's receive
        return self.slot.error

    @property
    def chunks(self) -> int | None:
        return self.slot.chunks


@dataclass
class Slot:
    """Blocks granted to one request: from one producer session, or from ``senders`` sessions (``parts``)
    that each fill disjoint bytes (layers, heads) of the same blocks."""

    req: str
    gen: int
    peer: int
    ids: np.ndarray
    nbytes: int
    deadline: float
    kind: str = "push"  # "pull": the consumer reads an offer; ``lease_gen`` names it to the producer
    lease_gen: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    digests: bytes = b""
    landed: int = 0
    done: bool = False
    released: bool = False  # a pull whose Released went out: the producer's Ack or Error ends it (VERDICT_WAIT)
    moving: int = 0  # receives in progress into these blocks
    error: KVXferError | None = None
    state: State = State.GRANTED
    hold_until: float = 0.0  # a failed slot keeps its blocks until no writer can still touch them
    senders: int = 1
    parts: dict[int, Part] = field(default_factory=dict)  # multi-sender only, by part index
    live_peers: set[int] = field(default_factory=set)  # sessions that may still write these blocks
    admitted: float = 0.0
    one_sided: bool = False  # a writer's transport is one-sided: a failure quarantines the blocks
    external: bool = False  # the caller chose the blocks (a fetch): "freed" hands them back to it, not the allocator
    chunks: int | None = None  # blocks of another size map through token positions: the request's chunk count
    per_block: int = 1  # chunks per block of ours (a big block takes several of the producer's small ones)
    windows: list[tuple[int, int]] = field(default_factory=list)  # stream bytes receives claimed, sorted
    superseded: list[Slot] = field(default_factory=list)  # an offer's admission: the slots of the id it replaced
    extents: Any = None  # the receiving transport's extents of it, made once for all its windows

    @property
    def ready(self) -> bool:
        if self.senders > 1:
            return (
                len(self.parts) == self.senders
                and self.error is None
                and all(p.done and p.landed >= p.nbytes for p in self.parts.values())
            )
        return self.done and self.landed >= self.nbytes and self.error is None

    @property
    def complete(self) -> bool:
        return self.state in (State.HANDED, State.FREED) and self.error is None

    def to(self, state: State) -> None:
        """Move to ``state``; a transition the table does not allow raises and changes nothing."""
        if state not in _TRANSITIONS[self.state]:
            raise ProtocolError(f"request {self.req!r}: {self.state.value} -> {state.value} is not allowed")
        self.state = state

    def members(self) -> list[tuple[int, int]]:
        """(session, generation the producer knows) of every writer of this request."""
        if self.senders > 1:
            return [(p.peer, p.gen) for p in self.parts.values()]
        return [(self.peer, self.lease_gen if self.kind == "pull" else self.gen)]


def _locked(method):
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class Grants:
    """The consumer's grants: admit -> (receive | land | done)* -> hand off -> release, or fail at any point.

    A failed slot's blocks go back to the allocator once nothing may still write into them: no local receive
    in progress and, for one-sided transports whose remote writes cannot be stopped from here, ``quarantine``
    seconds after the failure or as soon as every producer session that could write them is gone. Every
    public method takes the ledger's own lock.
    """

    def __init__(
        self,
        allocator: Allocator,
        block_bytes: int,
        *,
        max_inflight: int = 1024,
        tombstone_ttl: float = 30.0,
        quarantine: float = 0.0,
        retry_after: float = 0.05,
        max_inflight_per_peer: int | None = None,
        num_blocks: int | None = None,
    ):
        for name, value in (("tombstone_ttl", tombstone_ttl), ("quarantine", quarantine), ("retry_after", retry_after)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a finite number of seconds, 0 or more, got {value!r}")
        for name, count in (("max_inflight", max_inflight), ("max_inflight_per_peer", max_inflight_per_peer or 1)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"{name} must be a whole number, 1 or more, got {count!r}")
        self.allocator = allocator
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks  # the cache's blocks: what an allocator's answer is checked against
        self.max_inflight = max_inflight
        self.max_inflight_per_peer = max_inflight_per_peer or max_inflight  # one session cannot take every grant
        self.tombstone_ttl = tombstone_ttl
        self.quarantine = quarantine
        self.retry_after = retry_after
        self.lock = threading.RLock()
        self.active: dict[str, Slot] = {}
        self.handed: dict[str, Slot] = {}
        self.dying: list[Slot] = []
        self.tombstones: dict[str, float] = {}
        self.freed_external: list[Slot] = []  # caller-chosen blocks given back: the caller learns via take_freed
        self.closed = False  # no admission any more: a session thread may still hand us one it read before
        self._checked: tuple[np.ndarray, np.ndarray, int] | None = None  # the last read-only ranges checked
        # (a session's coverage, the same array every admission): them, as checked, and the bytes they cover

    # ---- admission ---------------------------------------------------------------------------------------
    def _allocate(self, req: str, n: int) -> np.ndarray:
        """``n`` blocks from the runtime's allocator, checked: an allocator that fails or answers wrongly (other
        than ``n`` ids, repeated, out of range) refuses this request with ``BlockError``; the session goes on,
        and the wrong answer is not given back (its ids are the allocator's to mend)."""
        try:
            ids = self.allocator.allocate(n)
        except Exception as e:
            log.exception("kvxfer allocator")
            raise BlockError(f"request {req!r}: the consumer's allocator failed: {e!r}") from None
        if ids is None:
            raise BusyError(f"no room for {n} blocks", self.retry_after)
        try:
            if self.num_blocks is None:  # a ledger of no cache in particular (tests): the count alone
                a = np.asarray(ids, dtype=np.int64)
            else:
                a = check_ids(ids, self.num_blocks, "allocated block ids")
            if len(a) != n:
                raise BlockError(f"{len(a)} blocks allocated for {n} asked")
        except BlockError as e:
            log.error("kvxfer allocator %r answered wrongly: %s", self.allocator, e)
            raise BlockError(f"request {req!r}: the consumer's allocator answered wrongly: {e}") from None
        return a

    @_locked
    def close(self) -> None:
        """Admit nothing from now on. A closing consumer sweeps its active slots once; a message its session
        threads read before the close must not add a slot after that sweep, with no reaper left to free it."""
        self.closed = True

    @_locked
    def admit(
        self,
        peer: int,
        req: str,
        n: int,
        deadline: float,
        now: float,
        *,
        senders: int = 1,
        part: int = 0,
        selection=None,
        ranges: np.ndarray | None = None,
        meta: dict | None = None,
        one_sided: bool = False,
        ids: np.ndarray | None = None,
        chunks: int | None = None,
        per_block: int = 1,
        partial: bool = False,
    ) -> tuple[Slot, list[Slot]]:
        """Grant ``n`` blocks or raise ``BusyError``; returns the slot and any older slot it superseded.

        ``ranges``: the bytes of every block this admission fills (sorted; the caller derives them from what it
        carries; default all). With ``senders > 1`` the request is split between that many producer sessions,
        part ``part`` carrying ``selection`` (layers or heads; opaque here): the first part to arrive is admitted
        (blocks, deadline, in-flight bound); later parts join the same grant and get their own generation, without
        a second allocation, and none may overlap another's bytes. ``meta`` merges
        into the slot's (part 0's keys win). ``one_sided``: the writer's transport cannot be stopped from here,
        so a failed slot is quarantined (see ``fail``). ``ids``: blocks the caller chose (a fetch), used
        instead of the allocator's and never given to it (``take_freed`` reports them). ``chunks``: the producer
        pages the request with other tokens per block (``paging``): it fills ``chunks`` chunks, ``per_block`` to
        each of our blocks (the last one perhaps partly), so ``n`` blocks hold up to ``n * per_block`` chunks.
        ``partial``: a fetch whose caller gathers the other bytes of its blocks itself (one of several producer
        ranks holding other heads or layers) may fill only ``ranges``.
        """
        if self.closed:
            raise ClosedError(f"request {req!r}: the consumer is closing")
        if n <= 0:
            raise BlockError(f"cannot admit {n} blocks")
        if self.tombstones.get(req, 0.0) > now:
            raise CancelledError(f"request {req!r} was cancelled")
        if req in self.handed:
            raise StaleError(f"request {req!r} was already received and is held by the runtime")
        r, covered = self._check_ranges(req, senders, part, ranges)
        if chunks is not None and not (n - 1) * per_block < chunks <= n * per_block:
            raise BlockError(f"request {req!r}: {chunks} chunks do not fill {n} blocks of {per_block} chunks")
        if senders == 1 and (part != 0 or (covered != self.block_bytes and not (partial and ids is not None))):
            raise BlockError(f"request {req!r}: a single sender carries every byte of the blocks as part 0")
        superseded = []
        old = self.active.get(req)
        if old is not None and senders > 1 and old.senders == senders and part not in old.parts:
            if chunks != old.chunks:
                raise BlockError(f"request {req!r} part {part}: {chunks} chunks, the request holds {old.chunks}")
            self._join(old, peer, n, part, selection, r)
            self._merge_meta(old, part, meta)
            old.one_sided = old.one_sided or one_sided
            return old, []
        if old is not None:
            superseded.append(self.fail(req, StaleError(f"request {req!r} superseded by a newer admission"), now))
        if len(self.active) >= self.max_inflight:
            raise BusyError(f"{len(self.active)} requests in flight", self.retry_after)
        if self.max_inflight_per_peer < self.max_inflight:
            mine = sum(1 for s in self.active.values() if peer in s.live_peers)
            if mine >= self.max_inflight_per_peer:
                raise BusyError(f"{mine} requests of this producer in flight", self.retry_after)
        per_slot = (n if chunks is None else chunks) * (covered if senders == 1 else self.block_bytes)
        per_slot //= per_block if chunks is not None else 1
        external = ids is not None
        if ids is not None:
            if len(ids) != n:
                raise BlockError(f"request {req!r}: {n} blocks offered for {len(ids)} chosen")
        else:
            ids = self._allocate(req, n)
        slot = Slot(
            req,
            next(_generations),
            peer,
            np.asarray(ids, dtype=np.int64),
            per_slot,
            deadline,
            senders=senders,
            live_peers={peer},
            admitted=now,
            one_sided=one_sided,
            external=external,
            chunks=chunks,
            per_block=per_block,
        )
        self.active[req] = slot
        if senders > 1:
            slot.gen = self._join(slot, peer, n, part, selection, r).gen
        self._merge_meta(slot, part, meta)
        return slot, superseded

    @_locked
    def admit_pull(
        self,
        peer: int,
        req: str,
        n: int,
        deadline: float,
        now: float,
        lease_gen: int,
        meta: dict | None = None,
        digests: bytes = b"",
        one_sided: bool = False,
        ids: np.ndarray | None = None,
        ranges: np.ndarray | None = None,
        chunks: int | None = None,
        per_block: int = 1,
        partial: bool = False,
    ) -> Slot:
        """Admit an offer this consumer will read: blocks to read into (``ids`` for a fetch), named to the
        producer by its lease; ``ranges``: the bytes of every block the offer fills (it must fill them all). The
        slots it superseded are in the new slot's ``superseded``, for the caller to tell their writers."""
        slot, slot.superseded = self.admit(
            peer,
            req,
            n,
            deadline,
            now,
            meta=meta,
            one_sided=one_sided,
            ids=ids,
            ranges=ranges,
            chunks=chunks,
            per_block=per_block,
            partial=partial,
        )
        slot.kind, slot.lease_gen, slot.digests = "pull", lease_gen, digests
        return slot

    def _check_ranges(self, req: str, senders: int, part: int, ranges) -> tuple[np.ndarray, int]:
        """``ranges`` checked (``byte_ranges``) and the bytes of each block they cover. A read-only array is
        checked once while it is the last one seen: owning its bytes, it cannot have changed since."""
        if senders < 1 or not 0 <= part < senders:
            raise BlockError(f"request {req!r}: part {part} of {senders} senders")
        last = self._checked
        if last is not None and ranges is last[0]:
            return last[1], last[2]
        try:
            r = byte_ranges(ranges, self.block_bytes)
        except BlockError as e:
            raise BlockError(f"request {req!r} part {part}: {e}") from None
        covered = range_bytes(r)
        if isinstance(ranges, np.ndarray) and ranges.flags.owndata and not ranges.flags.writeable:
            self._checked = (ranges, r, covered)
        return r, covered

    def _join(self, slot: Slot, peer: int, n: int, part: int, selection, ranges: np.ndarray) -> Part:
        if n != len(slot.ids):
            raise BlockError(f"request {slot.req!r} part {part}: {n} blocks, the request holds {len(slot.ids)}")
        both = np.concatenate([*(p.ranges for p in slot.parts.values()), ranges])
        both = both[np.argsort(both[:, 0], kind="stable")]
        if (both[1:, 0] < both[:-1, 1]).any():
            raise BlockError(f"request {slot.req!r} part {part}: {selection} overlaps bytes of another part")
        covered = int((both[:, 1] - both[:, 0]).sum())
        if len(slot.parts) == slot.senders - 1 and covered != self.block_bytes:
            raise BlockError(
                f"request {slot.req!r}: its {slot.senders} parts cover {covered} of {self.block_bytes} bytes per block"
            )
        mine = int((ranges[:, 1] - ranges[:, 0]).sum())
        nbytes = n * mine if slot.chunks is None else slot.chunks * mine // slot.per_block
        p = Part(part, next(_generations), peer, selection, ranges, nbytes, slot)
        slot.parts[part] = p
        slot.live_peers.add(peer)
        return p

    @staticmethod
    def _merge_meta(slot: Slot, part: int, meta: dict | None) -> None:
        """Multi-sender parts each carry meta; part 0's keys win, whichever part arrives first."""
        if not meta:
            return
        if slot.senders == 1:
            slot.meta = dict(meta)
        else:
            slot.meta = {**slot.meta, **meta} if part == 0 else {**meta, **slot.meta}

    def part(self, slot: Slot, gen: int) -> Part | None:
        """The part of a multi-sender ``slot`` with generation ``gen``."""
        return next((p for p in slot.parts.values() if p.gen == gen), None)

    def _live_part(self, peer: int, req: str, gen: int) -> tuple[Slot, Part | None]:
        slot = self.active.get(req)
        part = self.part(slot, gen) if slot is not None and slot.senders > 1 else None
        if (
            slot is None
            or slot.kind != "push"
            or (part is None and (slot.senders > 1 or slot.gen != gen))
            or (part.peer if part else slot.peer) != peer
        ):
            if req in self.tombstones:
                raise CancelledError(f"request {req!r} was cancelled or failed")
            raise StaleError(f"no live grant for request {req!r} generation {gen}")
        return slot, part

    # ---- bytes arriving ----------------------------------------------------------------------------------
    @_locked
    def check_write(self, peer: int, req: str, gen: int, ids: np.ndarray) -> Slot | Part:
        """The ticket a writer may fill (the slot, or the part of a multi-sender request), if ``ids`` are
        exactly the granted blocks in grant order."""
        slot, part = self._live_part(peer, req, gen)
        if len(ids) != len(slot.ids) or not np.array_equal(ids, slot.ids):
            raise BlockError(f"request {req!r} writes blocks it was not granted")
        return part or slot

    @_locked
    def begin_write(
        self, peer: int, req: str, gen: int, ids: np.ndarray, window: tuple[int, int] | None = None
    ) -> Slot | Part:
        """``check_write`` and ``begin_receive`` at once: the ticket of a receive that starts now, of stream bytes
        ``window`` (``[start, stop)``) when the receiver lands them itself. A byte is received once: a window
        overlapping one received before is a ``ProtocolError`` (counted twice, it would make a request that left
        bytes unwritten look complete)."""
        ticket = self.check_write(peer, req, gen, ids)
        if window is not None:
            lo, hi = window
            claimed = ticket.windows
            i = bisect.bisect_left(claimed, (lo, hi))
            if (i and claimed[i - 1][1] > lo) or (i < len(claimed) and claimed[i][0] < hi):
                raise ProtocolError(f"request {req!r}: bytes [{lo}, {hi}) of its stream were sent before")
            claimed.insert(i, (lo, hi))
        self.begin_receive(ticket.slot if isinstance(ticket, Part) else ticket)
        return ticket

    @_locked
    def begin_receive(self, slot: Slot) -> None:
        """A local receiver starts landing bytes in ``slot``'s blocks: they stay allocated until it ends."""
        if slot.error is not None:
            raise slot.error
        if slot.moving == 0:
            slot.to(State.RECEIVING)
        slot.moving += 1

    @_locked
    def end_receive(self, slot: Slot, nbytes: int, now: float, part: Part | None = None) -> Slot | None:
        """Account ``nbytes`` received (into ``part``, for a multi-sender request); returns the slot when it
        just became ready. A failed slot whose last receive ended is freed here (when nothing else holds it)."""
        slot.moving -= 1
        if slot.error is not None:
            self.reap(now)
            return None
        if slot.moving == 0:
            slot.to(State.GRANTED)
        return self._account(slot, part, nbytes)

    @_locked
    def landed(self, peer: int, req: str, gen: int, nbytes: int) -> Slot | None:
        """A one-sided transport says the bytes are there (NIXL notification)."""
        slot, part = self._live_part(peer, req, gen)
        return self._account(slot, part, nbytes)

    def _account(self, slot: Slot, part: Part | None, nbytes: int) -> Slot | None:
        """``nbytes`` arrived for ``slot`` (into ``part`` of a multi-sender request); the slot if now ready."""
        if part is not None:
            part.landed += nbytes
        else:
            slot.landed += nbytes
        return self._maybe_ready(slot)

    @_locked
    def done(self, peer: int, req: str, gen: int, nbytes: int, meta: dict, digests: bytes) -> Slot | None:
        """The producer (or one part's producer) says it moved everything. A duplicate ``Done`` for a
        request already handed off is harmless: it raises ``StaleError`` and changes nothing."""
        slot, part = self._live_part(peer, req, gen)
        expected = part.nbytes if part else slot.nbytes
        if nbytes != expected:
            raise BlockError(f"request {req!r}: producer moved {nbytes} bytes, grant holds {expected}")
        if part is not None:
            part.done = True
            self._merge_meta(slot, part.index, meta)
        else:
            slot.done, slot.meta, slot.digests = True, meta, digests
        return self._maybe_ready(slot)

    @_locked
    def confirm(self, slot: Slot) -> Slot | None:
        """Pull: the producer confirmed the read (its lease held); returns the slot if it is now ready."""
        if self.active.get(slot.req) is not slot:
            return None
        slot.done = True
        return self._maybe_ready(slot)

    def _maybe_ready(self, slot: Slot) -> Slot | None:
        if slot.ready and slot.state is State.GRANTED and slot.moving == 0:
            slot.to(State.HANDED)
            del self.active[slot.req]
            self.handed[slot.req] = slot
            return slot
        return None

    # ---- endings -----------------------------------------------------------------------------------------
    @_locked
    def fail(self, req: str, error: KVXferError, now: float, *, one_sided: bool | None = None) -> Slot | None:
        """End an active request with ``error``; its blocks are freed once nothing can write them: at once
        when no receive is in progress, ``quarantine`` seconds later when a one-sided writer (the slot's, or
        ``one_sided`` when given) may still be writing, or as soon as every writer's session is gone."""
        slot = self.active.pop(req, None)
        if slot is None:
            return None
        self._fail(slot, error, now, slot.one_sided if one_sided is None else one_sided)
        return slot

    def _fail(self, slot: Slot, error: KVXferError, now: float, one_sided: bool) -> None:
        slot.to(State.FAILED)
        slot.error = error
        slot.hold_until = now + (self.quarantine if one_sided else 0.0)
        self.tombstones[slot.req] = now + self.tombstone_ttl
        self.dying.append(slot)
        self.reap(now)

    @_locked
    def cancel(self, peer: int, req: str, gen: int, error: KVXferError, now: float) -> Slot | None:
        """A producer session cancels ``req``; the slot it failed, or ``None`` if the Cancel names nothing
        of that session's. It matches a pull the session offered (any lease), generation 0 (a push whose
        grant the producer has not seen yet) or one of the session's generations of the request."""
        slot = self.active.get(req)
        if slot is None:
            return None
        mine = [g for sid, g in slot.members() if sid == peer]
        if not mine or not (slot.kind == "pull" or gen == 0 or gen in mine):
            return None
        return self.fail(req, error, now)

    @_locked
    def revoke(self, slot: Slot, error: KVXferError, now: float) -> bool:
        """Take back a handed-off slot the runtime has not seen (its digests failed): its blocks are freed."""
        if self.handed.get(slot.req) is not slot:
            return False
        del self.handed[slot.req]
        self._fail(slot, error, now, one_sided=False)
        return True

    @_locked
    def release(self, req: str) -> bool:
        """The runtime is done with a handed-off request: its blocks go back."""
        slot = self.handed.pop(req, None)
        if slot is None:
            return False
        self._free(slot)
        return True

    def _free(self, slot: Slot) -> None:
        slot.to(State.FREED)
        if slot.external:
            self.freed_external.append(slot)
        else:
            self.allocator.free(slot.ids)

    @_locked
    def take_freed(self) -> list[Slot]:
        """Caller-chosen slots (fetches) whose blocks were given back since the last call: no byte can land in
        them any more."""
        out, self.freed_external = self.freed_external, []
        return out

    @_locked
    def peer_lost(self, peer: int, error: KVXferError, now: float, *, gone: bool = True) -> list[Slot]:
        """Every active slot of a lost session fails. ``gone``: the producer ended the session (it died or
        closed), so nothing of it writes any more and its quarantined blocks are freed now; when this side
        dropped the session (closing) a live producer may still post a one-sided write, so quarantines hold."""
        lost = [s for s in self.active.values() if peer in s.live_peers]
        for s in lost:
            self.fail(s.req, error, now)
        if gone:
            for s in self.dying:
                s.live_peers.discard(peer)
                if not s.live_peers:
                    s.hold_until = min(s.hold_until, now)
        self.reap(now)
        return lost

    @_locked
    def active_slots(self) -> list[Slot]:
        return list(self.active.values())

    @_locked
    def held_until(self) -> float:
        """When the last failed slot's quarantine ends (0 when none waits on one)."""
        return max((s.hold_until for s in self.dying), default=0.0)

    @_locked
    def expired(self, now: float) -> list[Slot]:
        """Active slots past their deadline. A pull whose every byte landed and whose ``Released`` went out is
        the producer's to end (its ``Ack`` or ``Error`` says whether the lease held): it waits ``VERDICT_WAIT``
        past its deadline for that answer, so that a consumer stopped for a moment after sending ``Released``
        does not fail a request its producer confirmed."""
        return [s for s in self.active.values() if s.deadline + (VERDICT_WAIT if s.released else 0.0) <= now]

    @_locked
    def expire(self, now: float, error: Callable[[Slot], KVXferError]) -> list[Slot]:
        """Fail every slot ``expired`` names with ``error(slot)``, in one step with the check (a pull's
        ``Released`` cannot go out between them); returns the slots failed."""
        out = self.expired(now)
        for slot in out:
            self.fail(slot.req, error(slot), now)
        return out

    @_locked
    def releasing(self, slot: Slot) -> KVXferError | None:
        """A pull's bytes all landed and its ``Released`` is about to go out: from now on the producer's answer
        ends it (``expired``). The slot's error instead, if it failed first (then no ``Released`` goes out)."""
        if slot.error is not None:
            return slot.error
        slot.released = True
        return None

    @_locked
    def reap(self, now: float) -> int:
        """Free the blocks of failed slots that no writer can touch any more; drop old tombstones."""
        keep, freed = [], 0
        for s in self.dying:
            if s.moving == 0 and s.hold_until <= now:
                self._free(s)
                freed += len(s.ids)
            else:
                keep.append(s)
        self.dying = keep
        if self.tombstones:
            self.tombstones = {r: t for r, t in self.tombstones.items() if t > now}
        return freed

    @_locked
    def counts(self) -> dict[str, int]:
        return {"inflight": len(self.active), "handed": len(self.handed), "dying": len(self.dying)}

    @_locked
    def refused(self, req: str, now: float) -> None:
        """A producer's session opened for ``req`` was refused at its handshake (layouts or transports that do not
        pair): ``req`` fails now, for its waiters and for any Admit of it, rather than never being admitted. Only
        a proved producer names one, and the names it leaves are bounded in number and length."""
        if (
            req not in self.active
            and req not in self.handed
            and len(req) <= MAX_REFUSED_NAME
            and len(self.tombstones) < MAX_REFUSED
        ):
            self.tombstones[req] = now + self.tombstone_ttl

    @_locked
    def phase(self, req: str) -> str | None:
        """Where ``req`` stands: ``"receiving"`` (admitted), ``"ready"`` (handed off, not yet released),
        ``"failed"`` (failed or cancelled, remembered for ``tombstone_ttl``), or ``None``."""
        if req in self.active:
            return "receiving"
        if req in self.handed:
            return "ready"
        if self.tombstones.get(req, 0.0) > 0:
            return "failed"
        return None

    @_locked
    def get(self, req: str) -> Slot | None:
        """The active slot of ``req``, if any."""
        return self.active.get(req)


@dataclass
class Lease:
    req: str
    gen: int
    peer: int
    ids: np.ndarray
    expires: float
    chunks: int | None = None  # the reader pages with other tokens per block: the request's chunk count
    readers: int = 0  # reads being served from its blocks now
    error: KVXferError | None = None  # why it ended (released, expired, cancelled): a read being served stops
    unread: list[Callable[[], None]] = field(default_factory=list)  # what runs once it ended and no read serves
    extents: Any = None  # the serving transport's extents of it, made once for all its reads


class Leases:
    """The producer's pull offers: blocks readable by one consumer until the lease expires or is released.

    A lease ends before its reads stop (each sees ``error`` and stops); what may reuse its blocks waits in
    ``when_unread`` for the last of them, so no byte leaves a block once its owner was told it is free."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active: dict[tuple[str, int], Lease] = {}

    @_locked
    def offer(self, peer: int, req: str, ids: np.ndarray, lease: float, now: float, chunks: int | None = None) -> Lease:
        item = Lease(req, next(_generations), peer, ids, now + lease, chunks)
        self.active[(req, item.gen)] = item
        return item

    @_locked
    def check_read(self, peer: int, req: str, gen: int, ids: np.ndarray, now: float) -> Lease:
        """The lease a reader may read from, if ``ids`` are exactly the offered blocks; the read counts as
        served until ``end_read``."""
        item = self.active.get((req, gen))
        if item is None or item.peer != peer:
            raise StaleError(f"no live offer for request {req!r} generation {gen}")
        if item.expires <= now:
            raise StaleError(f"the lease of request {req!r} expired")
        if len(ids) != len(item.ids) or not np.array_equal(ids, item.ids):
            raise BlockError(f"request {req!r} reads blocks that were not offered")
        item.readers += 1
        return item

    def end_read(self, item: Lease) -> None:
        """A read of ``item`` stopped: no byte of it leaves the blocks any more."""
        with self.lock:
            item.readers -= 1
            due = item.readers == 0 and item.error is not None
            run, item.unread = (item.unread, []) if due else ([], item.unread)
        for fn in run:
            fn()

    def when_unread(self, item: Lease, fn: Callable[[], None]) -> None:
        """Run ``fn`` once ``item`` ended and none of its reads serves: now, or at the last ``end_read``."""
        with self.lock:
            if item.error is None:
                raise ProtocolError(f"the lease of {item.req!r} was waited on before it ended")
            if item.readers:
                item.unread.append(fn)
                return
        fn()

    @_locked
    def release(self, req: str, gen: int, now: float) -> Lease:
        """The consumer is done reading; a lease that ran out first is an error."""
        item = self.active.pop((req, gen), None)
        if item is None:
            raise StaleError(f"no live offer for request {req!r} generation {gen}")
        item.error = StaleError(f"request {req!r} was released")
        if item.expires <= now:
            raise StaleError(f"the lease of request {req!r} expired before it was released")
        return item

    @_locked
    def drop(self, item: Lease, error: KVXferError) -> None:
        """End ``item`` (unless it ended): no read starts from now on, and those being served stop."""
        self.active.pop((item.req, item.gen), None)
        if item.error is None:
            item.error = error

    @_locked
    def expired(self, now: float) -> list[Lease]:
        return [x for x in self.active.values() if x.expires <= now]
