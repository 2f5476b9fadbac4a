"""The consumer's fetch: read blocks a producer holds (``Producer.hold``) into blocks the caller chose.

The consumer connects to the producer's listening address; the producer speaks first and the handshake is
the usual one. ``Fetch`` asks for a range of the hold; the producer's ``Offer`` then runs as any pull, through
the same ledger (a slot over the caller's blocks, ``external``), lease, deadline and quarantine. A fetch's
``Transfer`` ends only when its blocks are the caller's again: every byte landed, or no byte can land any more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from . import wire
from .channel import Channel, connect, parse_address
from .errors import (
    BlockError,
    CancelledError,
    ClosedError,
    ConfigError,
    DeadlineError,
    IncompatibleError,
    KVXferError,
    PeerError,
    from_code,
)
from .ledger import VERDICT_WAIT
from .lifecycle import deadline_in, gate, given_seconds
from .plan import check_ids, check_tokens, whole
from .transfer import Status, Transfer

if TYPE_CHECKING:
    from .consumer import Consumer, _ConsumerSession
    from .ledger import Slot

log = logging.getLogger("kvxfer")


class Fetch(Transfer):
    """A fetch as its caller sees it. ``cancel`` stops it, but it *ends* (and ``done()`` turns true) only
    when nothing can land in its blocks any more."""

    _grace = VERDICT_WAIT + 1.0  # a read that released its blocks waits that long for the producer's verdict

    def __init__(self, req: str, address: str, ids: np.ndarray, block_bytes: int, deadline: float, skip: int):
        super().__init__(req, "fetch", address, ids, block_bytes, deadline)
        self.ids = ids
        self.skip = skip
        self.from_token: int | None = None  # where to start, in tokens (skip follows once the producer is known)
        self.readers = 1  # consumers fetching the same hold, each its own heads or layers (the producer counts them)
        self.partial = False  # the caller gathers the rest of its blocks' bytes from other producer ranks
        self.slot: Slot | None = None  # the ledger's slot once the producer offered the blocks
        self.session: _ConsumerSession | None = None

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        with self._lock:
            if self._done or self.cancel_event.is_set():
                return False
            self.cancel_event.set()
        if self._on_cancel is not None:
            self._on_cancel(self, reason)
        return True


class Fetches:
    """A consumer's fetches and the sessions it opened to producers for them (one per producer address)."""

    def __init__(self, consumer: Consumer):
        self.c = consumer
        self.lock = threading.Lock()
        self.by_req: dict[str, Fetch] = {}
        self.sessions: dict[str, _ConsumerSession] = {}
        self._connecting: dict[str, threading.Lock] = {}

    def start(
        self,
        address: str,
        req: str,
        block_ids,
        skip: int,
        deadline: float | None,
        tokens: int | None = None,
        from_token: int | None = None,
        readers: int = 1,
        partial: bool = False,
    ) -> Fetch:
        c = self.c
        c._check_open()
        if c.tls is not None:
            raise ConfigError("fetching over TLS is not supported yet")
        parse_address(address)
        ids = check_ids(block_ids, c.layout.num_blocks, "destination block ids")
        skip = whole(skip, "skip")
        from_token = None if from_token is None else whole(from_token, "from_token")
        readers = whole(readers, "readers", 1)
        if skip and from_token is not None:
            raise BlockError("give skip (the producer's blocks) or from_token, not both")
        bs = c.layout.fingerprint.block_size
        n_tokens = check_tokens(tokens, len(ids), bs)
        if readers > wire.MAX_READERS:
            raise BlockError(f"readers must be within [1, {wire.MAX_READERS}], got {readers}")
        seconds = c.deadline if deadline is None else given_seconds(deadline, "deadline")
        f = Fetch(wire.check_req(req), address, ids, c.layout.block_bytes, deadline_in(seconds), skip)
        f.tokens = len(ids) * bs if n_tokens is None else n_tokens
        f.from_token = from_token
        f.readers, f.partial = readers, bool(partial)
        f._on_cancel = self._cancelled
        with self.lock:
            if f.req in self.by_req:
                raise BlockError(f"request {f.req!r} is already being fetched")
            self.by_req[f.req] = f
        c._submit(self._ask, f, dropped=lambda: self.end(f, ClosedError("consumer closed")))
        return f

    def decline(self, address: str, req: str, reason: str) -> None:
        """Tell the producer at ``address`` that its hold ``req`` will not be fetched (best effort, in the
        background: its lease frees the blocks anyway)."""
        c = self.c
        c._check_open()
        parse_address(address)

        def tell() -> None:
            try:
                s = self._session(address, time.monotonic() + c.handshake_timeout)
                s.send(wire.Cancel(req=str(req), gen=0, reason=reason))
            except KVXferError as e:
                log.info("kvxfer: could not decline %r at %s: %s", req, address, e)

        c._submit(tell)  # dropped: closed meanwhile, nothing to tell

    # ---- the session and the ask ------------------------------------------------------------------------
    def _session(self, address: str, deadline: float) -> _ConsumerSession:
        with self.lock:
            s = self.sessions.get(address)
            if s is not None and s.alive:
                return s
            lock = self._connecting.setdefault(address, threading.Lock())
        with gate(lock, deadline, f"no session to producer {address}"):
            with self.lock:
                s = self.sessions.get(address)
                if s is not None and s.alive:
                    return s
            c = self.c
            # bounded by the fetch's own deadline, not by handshake_timeout (which protects this consumer's
            # listener from peers it did not choose): a producer busy starting up may be slow to answer
            timeout = max(0.05, deadline - time.monotonic())
            end = time.monotonic() + timeout
            ch = Channel(connect(address, timeout), c.max_frame, spin=c.spin)
            try:
                first = ch.recv(timeout, max_frame=wire.MAX_HANDSHAKE_FRAME)
                if isinstance(first, wire.Error):
                    raise from_code(first.code, f"producer {address} refused the handshake: {first.message}")
                s = c._welcome(ch, first, end, address=c.address)
            except BaseException:
                ch.close()
                raise
            ch.sock.settimeout(None)
            s.fetch_address = address
            with self.lock:
                self.sessions[address] = s
            threading.Thread(target=c._run_session, args=(s,), daemon=True, name="kvxfer-fetch").start()
            return s

    def _ask(self, f: Fetch) -> None:
        if f.done() and not f.cancel_event.is_set():
            return
        try:
            s = self._session(f.address, f.deadline)
            with self.lock:
                if f.cancel_event.is_set() or f.done():  # ended while connecting: the producer may drop the hold
                    why = "fetch cancelled" if f.cancel_event.is_set() else "fetch ended before it was asked"
                    s.send(wire.Cancel(req=f.req, gen=0, reason=why))
                    return
                if not s.alive:
                    raise PeerError(f"producer {f.address} closed the session")
                f.session = s
                s.fetches[f.req] = f
            layout = self.c.layout
            covered = s.covered
            if not f.partial and int((covered[:, 1] - covered[:, 0]).sum()) != layout.block_bytes:
                raise IncompatibleError(
                    f"producer {f.address} holds only some of the heads or layers of our blocks: fetch each of "
                    "its parallel ranks with partial=True"
                )
            paging = s.link.paging()
            if f.from_token is not None:  # the caller counts in tokens: the producer's blocks, now that we know them
                if f.from_token % paging.src_block:
                    raise BlockError(
                        f"token {f.from_token} does not start one of the producer's {paging.src_block}-token blocks"
                    )
                f.skip = f.from_token // paging.src_block
            if paging.k == 1:
                ask = wire.Fetch(req=f.req, skip=f.skip, num_blocks=len(f.ids), attempt=f.attempt, readers=f.readers)
            else:  # blocks of other sizes: ask for our tokens (the producer offers at most what it holds)
                tokens = f.tokens or len(f.ids) * paging.dst_block
                n = paging.src_blocks(tokens)
                ask = wire.Fetch(
                    req=f.req, skip=f.skip, num_blocks=n, attempt=f.attempt, tokens=tokens, readers=f.readers
                )
            if not s.send(ask):
                raise PeerError(f"producer {f.address} is gone")
            log.debug("kvxfer fetch %s: asked %s on session %d", f.req, f.address, s.sid)
        except KVXferError as e:
            self.end(f, ClosedError("consumer closed") if self.c.closed else e)
        except Exception as e:  # a bug here must still end the fetch, typed, not leave it to its deadline
            log.exception("kvxfer fetch %s", f.req)
            self.end(f, PeerError(f"fetch failed: {e!r}"))

    # ---- answers ----------------------------------------------------------------------------------------
    def pending(self, s: _ConsumerSession, req: str) -> Fetch | None:
        """The fetch of ``req`` on ``s`` still waiting for its offer."""
        with self.lock:
            f = s.fetches.get(req)
            return f if f is not None and f.slot is None else None

    def refused(self, f: Fetch, msg: wire.Error) -> None:
        self.end(f, from_code(msg.code, f"producer {f.address}: {msg.message}"))

    def claim(self, f: Fetch, make_slot) -> Slot | None:
        """The offer for ``f`` arrived: ``make_slot()`` admits it into the caller's blocks, unless ``f`` was
        cancelled or ended meanwhile (then ``None``, and the caller refuses the offer)."""
        with self.lock:
            if f.done() or f.cancel_event.is_set() or f.slot is not None:
                return None
            f.slot = make_slot()
            f._mark(Status.MOVING, "admitted")
            return f.slot

    # ---- endings ----------------------------------------------------------------------------------------
    def end(self, f: Fetch, error: KVXferError) -> None:
        """End ``f`` with ``error``: at once if no slot holds its blocks, else by failing the slot (the fetch
        then ends when the ledger gives the blocks back)."""
        with self.lock:
            slot = f.slot
            if slot is None:
                self._forget(f)
        if slot is None:
            f._finish(error, Status.CANCELLED if f.cancel_event.is_set() else None)
            return
        self.c._fail_slot(slot, error)
        if f.session is not None:
            f.session.send(wire.Cancel(req=f.req, gen=slot.lease_gen, reason=str(error)))

    def _cancelled(self, t: Transfer, reason: str) -> None:
        assert isinstance(t, Fetch)
        s = t.session
        if t.slot is None and s is not None:
            s.send(wire.Cancel(req=t.req, gen=0, reason=reason))
        self.end(t, CancelledError(reason))

    def _forget(self, f: Fetch) -> None:
        if self.by_req.get(f.req) is f:
            del self.by_req[f.req]
        if f.session is not None and f.session.fetches.get(f.req) is f:
            del f.session.fetches[f.req]

    def finish_freed(self) -> None:
        """End every fetch whose blocks the ledger gave back (done, or failed once nothing can land)."""
        for freed in self.c.grants.take_freed():
            f = self._owner(freed)
            if f is None:
                continue
            error, f.nbytes = freed.error, freed.landed
            if error is None:
                f.timings["moved"] = time.monotonic()
                f.meta = dict(freed.meta)  # what the hold carries for its reader (``Producer.hold(meta=...)``)
            f._finish(error, Status.CANCELLED if f.cancel_event.is_set() and error is not None else None)

    def _owner(self, slot: Slot) -> Fetch | None:
        """The fetch ``slot`` belongs to, forgotten now (its blocks were given back)."""
        with self.lock:
            f = self.by_req.get(slot.req)
            if f is None or f.slot is not slot:
                return None
            self._forget(f)
            return f

    def reap(self, now: float) -> None:
        with self.lock:
            late = [f for f in self.by_req.values() if f.slot is None and f.deadline <= now]
        for f in late:
            self.end(f, DeadlineError(f"fetch of {f.req!r} from {f.address} passed its deadline before any offer"))
        self.finish_freed()

    def session_lost(self, s: _ConsumerSession, error: KVXferError) -> None:
        with self.lock:
            if self.sessions.get(getattr(s, "fetch_address", "")) is s:
                del self.sessions[s.fetch_address]
            waiting = [f for f in s.fetches.values() if f.slot is None]
        for f in waiting:
            self.end(f, PeerError(f"producer {f.address} lost: {error}"))

    def close(self) -> None:
        with self.lock:
            waiting = [f for f in self.by_req.values() if f.slot is None]
        for f in waiting:
            self.end(f, ClosedError("consumer closed"))
