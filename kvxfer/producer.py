"""The prefill side: a ``Producer`` pushes a request's blocks into a consumer's grant, offers them for the
consumer to pull under a lease, or holds them under a lease for whichever consumer fetches them (``listen``).
One control session per consumer address (plus one per consumer that connected to fetch); bytes move on the
worker pool so ``push``, ``offer`` and ``hold`` return at once with a ``Transfer`` (a future).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

import numpy as np

from . import handshake, inline, wire
from .channel import SPIN, Channel, Spin, connect, parse_address, remaining
from .digest import block_digests
from .errors import (
    BlockError,
    BusyError,
    CancelledError,
    ClosedError,
    ConfigError,
    DeadlineError,
    KVXferError,
    LeaseExpiredError,
    PeerError,
    ProtocolError,
    StaleError,
    TransportError,
    from_code,
)
from .layout import KVLayout
from .ledger import Lease, Leases
from .lifecycle import HandleBase, deadline_in, gate, given_seconds, ms
from .plan import check_ids, check_tokens, is_whole, whole
from .shard import Selection, held, held_layers, sharded, staged
from .sockets import accept, shutdown
from .sockets import close as close_socket
from .sockets import listen as listen_on
from .transfer import Status, Transfer, _attempts
from .transports.base import Peer, Transport

log = logging.getLogger("kvxfer")

VERDICT_WAIT = 0.25  # how long a broken data connection waits for the control connection to say why
QUIET_WAIT = 10.0  # how long an ended session's control connection stays open for its moves to return


class _ProducerSession:
    def __init__(
        self, owner: Producer, address: str, ch: Channel, peer: Peer, transport: Transport, link, remote_id: str
    ):
        self.owner = owner
        self.transport = transport  # the one both sides agreed on in the handshake
        self.address = address
        self.ch = ch
        self.peer = peer
        self.link = link
        self.remote_id = remote_id
        self.transfers: dict[str, Transfer] = {}
        self.alive = True
        self.moving = 0  # moves (Link.write) in progress on this session
        self.quiet = threading.Condition()
        self.thread = threading.Thread(target=self._read_loop, daemon=True, name=f"kvxfer-producer-{address}")

    def wait_quiet(self, timeout: float) -> bool:
        """Wait until no move of this session is in progress (a cancelled one returns within a poll)."""
        with self.quiet:
            return self.quiet.wait_for(lambda: self.moving == 0, timeout)

    def send(self, msg) -> None:
        try:
            self.ch.send(msg)
        except KVXferError:
            self.owner._session_lost(self, PeerError(f"consumer {self.address} is gone"))

    def _read_loop(self) -> None:
        error: KVXferError = PeerError(f"consumer {self.address} closed the connection")
        try:
            while self.alive:
                self.owner._on_message(self, self.ch.recv())
        except KVXferError as e:
            error = e if not isinstance(e, PeerError) else PeerError(f"consumer {self.address}: {e}")
        except Exception as e:
            error = PeerError(f"consumer {self.address}: {e!r}")
        self.owner._session_lost(self, error)


class Producer(HandleBase):
    """The prefill side: pushes blocks into a consumer's grant, or offers them for the consumer to pull.

    ``transport`` is ``"tcp"``, ``"nixl"`` or ``"auto"``; ``deadline`` (seconds) bounds every transfer that
    does not name its own; ``auth`` is a shared token the consumer must expect; ``tls`` (a client context,
    ``kvxfer.tls.client_context``) makes every control and TCP data connection TLS.

    ``listen`` (``"host:port"``, port 0 picks one; ``address`` says which) lets consumers connect to fetch
    what ``hold`` keeps for them: a decode instance that chooses its own destination blocks.

    ``inline_max``: a whole push, offer or fetched hold of at most this many bytes from host memory travels
    inside its ``Admit`` or ``Offer`` (``kvxfer.inline``: fewer round trips, one copy per side); 0 always moves
    bytes over the transport.

    ``spin``: seconds a control connection's reader busy-waits for the next message before it blocks
    (``kvxfer.channel.Spin``: a small request's answers come without a thread wake-up); 0 never spins.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        transport: str = "auto",
        auth: str = "",
        deadline: float = 30.0,
        lease: float = 30.0,
        connect_timeout: float = 5.0,
        peer_id: str | None = None,
        transport_options: dict | None = None,
        workers: int = 8,
        max_frame: int = wire.MAX_FRAME,
        tls: ssl.SSLContext | None = None,
        listen: str | None = None,
        inline_max: int = inline.DEFAULT,
        spin: float = SPIN,
    ):
        if isinstance(inline_max, bool) or not isinstance(inline_max, int) or not 0 <= inline_max <= inline.LIMIT:
            raise ConfigError(f"inline_max must be within [0, {inline.LIMIT}], got {inline_max}")
        if listen is not None and tls is not None:
            raise ConfigError("fetching over TLS is not supported yet: give listen= or tls=, not both")
        where = parse_address(listen) if listen is not None else None
        options = dict(transport_options or {}, **({"tls": tls} if tls is not None else {}))
        self.deadline = given_seconds(deadline, "deadline")  # every option is checked before anything opens
        self.lease = given_seconds(lease, "lease")
        self.connect_timeout = given_seconds(connect_timeout, "connect_timeout")
        self.spin = Spin(spin).limit
        self._listener: socket.socket | None = None if where is None else listen_on(where)
        try:
            super().__init__(layout, transport, auth, options, peer_id, workers)
        except BaseException:
            if self._listener is not None:
                close_socket(self._listener)
            raise
        self.inline_max = inline_max
        self._inline = inline.Inline(layout) if inline_max and inline.Inline.usable(layout) else None
        self.tls = tls
        self.max_frame = max_frame
        self.leases = Leases()
        self._sessions: dict[str, _ProducerSession] = {}
        self._locals = itertools.count(1)  # each session's Peer.local: its consumer's number is not unique here
        self._connecting: dict[str, threading.Lock] = {}
        self._fetchers: set[_ProducerSession] = set()  # sessions consumers opened to fetch
        self._holds: dict[str, Transfer] = {}
        self._launching: set[Transfer] = set()  # waiting for a worker or a session: the reaper ends them in time
        self._dialing: set[Channel] = set()  # connections of handshakes under way (close() shuts them down)
        self.address: str | None = None
        if where is not None and self._listener is not None:
            self.address = f"{where[0]}:{self._listener.getsockname()[1]}"
            threading.Thread(target=self._accept_loop, daemon=True, name="kvxfer-producer-accept").start()
        self._reaper.start()

    # ---- sessions ---------------------------------------------------------------------------------------
    def _session(self, address: str, deadline: float, req: str = "") -> _ProducerSession:
        """The live session to ``address``, or a new one, whose handshake names ``req`` (the request it is for)."""
        with self._lock:
            s = self._sessions.get(address)
            if s is not None and s.alive:
                return s
            lock = self._connecting.setdefault(address, threading.Lock())
        with gate(lock, deadline, f"no session to {address}"):
            with self._lock:
                self._check_open()  # queued behind a handshake the close cut short: no new one
                s = self._sessions.get(address)
                if s is not None and s.alive:
                    return s
            s = self._handshake(address, min(self.connect_timeout, max(0.05, deadline - time.monotonic())), req)
            with self._lock:
                closed = self.closed
                if not closed:
                    self._sessions[address] = s
            if closed:  # close() began during the handshake: the new session goes with it
                self._session_lost(s, ClosedError("producer closed"))
                raise ClosedError("producer closed")
            s.thread.start()
            return s

    def _handshake(self, address: str, timeout: float, req: str = "") -> _ProducerSession:
        """Dial ``address`` and shake hands; ``close()`` shuts the connection down under a handshake still
        waiting for its peer, so that no worker outlives the close by a handshake timeout."""
        parse_address(address)
        ch = Channel(connect(address, timeout, self.tls), self.max_frame, spin=self.spin)
        with self._lock:
            if self.closed:
                ch.close()
                raise ClosedError("producer closed")
            self._dialing.add(ch)
        try:
            return self._shake(ch, address, timeout, req=req)
        except KVXferError:
            if self.closed:
                raise ClosedError("producer closed") from None
            raise
        finally:
            with self._lock:
                self._dialing.discard(ch)

    def _shake(
        self, ch: Channel, address: str | None, timeout: float, host: str = "", req: str = ""
    ) -> _ProducerSession:
        """The producer's half of the handshake on ``ch``: one we dialed to ``address`` for request ``req``, or
        (``None``) one a fetching consumer opened from ``host``, whose Welcome says where its data connections go."""
        accepted = address is None
        try:
            end = time.monotonic() + timeout
            opening, nonce = handshake.hello(self.peer_id)
            offers = [(name, t.local_meta()) for name, t in self.transports.items()]
            who = address or host
            challenge = ch.request(opening, timeout, max_frame=wire.MAX_HANDSHAKE_FRAME)
            proof, key = handshake.answer(challenge, who, self.auth, nonce, self.layout, offers, req)
            welcome = ch.request(proof, remaining(end), max_frame=wire.MAX_HANDSHAKE_FRAME)
            reply, remote, paging = handshake.check_welcome(welcome, who, key, self.layout, list(self.transports))
            if address is None:
                address = _data_address(reply.address, host)
            peer = Peer(
                reply.session, address, remote, paging, reply.transport_meta, True, key=key, local=next(self._locals)
            )
            ch.sock.settimeout(None)
            transport = self.transports[reply.transport]
            return _ProducerSession(self, address, ch, peer, transport, transport.connect(peer), challenge.peer_id)
        except BaseException as e:
            if accepted and isinstance(e, KVXferError) and not isinstance(e, PeerError):
                with contextlib.suppress(KVXferError):  # say why, as a consumer refusing a producer does
                    ch.send(wire.Error(req="", code=e.code, message=str(e)))
            ch.close()
            if isinstance(e, DeadlineError):  # say that the session never came up, not just that a read timed out
                raise DeadlineError(f"handshake with {address or host} not done within {timeout:.3g}s: {e}") from None
            raise

    def _session_lost(self, s: _ProducerSession, error: KVXferError) -> None:
        with self._lock:
            if not s.alive:
                return
            s.alive = False
            if self._sessions.get(s.address) is s:
                del self._sessions[s.address]
            self._fetchers.discard(s)
            pending = list(s.transfers.values())
            s.transfers.clear()
        for t in pending:
            self._end(t, error)
        # The consumer takes a closed control connection to mean that nothing of ours writes any more (it frees
        # quarantined blocks at once): close it only once every move of the session returned.
        if s.moving:
            threading.Thread(target=self._close_when_quiet, args=(s,), daemon=True, name="kvxfer-close").start()
        else:
            self._close_when_quiet(s)

    def _close_when_quiet(self, s: _ProducerSession) -> None:
        if not s.wait_quiet(QUIET_WAIT):
            log.warning("kvxfer: a move to %s still runs %gs after its session ended", s.address, QUIET_WAIT)
        s.ch.close()
        s.transport.disconnect(s.peer.local)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while (taken := accept(self._listener, lambda: self.closed)) is not None:
            sock, host = taken
            with contextlib.suppress(OSError):  # reset before we got to it: its thread finds out
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._accepted, args=(sock, host), daemon=True, name="kvxfer-fetcher").start()

    def _accepted(self, sock: socket.socket, host: str) -> None:
        """A consumer connected to fetch: the same handshake, this side speaking first, then its session."""
        sock.settimeout(self.connect_timeout)
        try:
            s = self._shake(Channel(sock, self.max_frame, spin=self.spin), None, self.connect_timeout, host)
        except KVXferError as e:
            log.info("kvxfer: fetching consumer from %s refused: %s", host, e)
            return
        with self._lock:
            if self.closed:
                s.ch.close()
                return
            self._fetchers.add(s)
        log.debug("kvxfer: fetching consumer %s connected", s.address)
        s.thread.start()

    # ---- submitting -------------------------------------------------------------------------------------
    def _start(
        self, kind: str, address: str, req: str, block_ids, deadline: float | None, tokens: int | None = None
    ) -> Transfer:
        self._check_open()
        ids = check_ids(block_ids, self.layout.num_blocks, "source block ids")
        n_tokens = check_tokens(tokens, len(ids), self.layout.fingerprint.block_size)
        seconds = self.deadline if deadline is None else given_seconds(deadline, "deadline")
        t = Transfer(wire.check_req(req), kind, address, ids, self.layout.block_bytes, deadline_in(seconds))
        t.tokens = n_tokens
        t._on_cancel = self._cancelled
        return t

    @staticmethod
    def _tokens(s: _ProducerSession, t: Transfer) -> int | None:
        """What an Admit or Offer says of ``t``'s tokens: nothing when both sides page alike, else the count the
        consumer maps blocks through (per-block digests cannot follow blocks that change size)."""
        paging = s.link.paging()
        if paging.k == 1:
            return None
        if t.digests:
            raise BlockError(f"request {t.req!r}: per-block digests need the same tokens per block on both sides")
        return t.tokens or len(t.src_ids) * paging.src_block

    def _enroll(self, t: Transfer) -> _ProducerSession:
        s = self._session(t.address, t.deadline, t.req)
        with self._lock:
            self._launching.discard(t)
            if t.done():  # the reaper ended it (its deadline) while it waited for the session
                raise t.error or DeadlineError(f"{t.kind} of {t.req!r} ended before its session was up")
            if not s.alive:  # lost since it was handed out: enrolled there, no reaper or loss would ever end it
                raise PeerError(f"consumer {t.address} closed the session")
            if t.req in s.transfers:
                raise BlockError(f"request {t.req!r} is already in flight to {t.address}")
            s.transfers[t.req] = t
        return s

    def _launch(self, t: Transfer, send: Callable[[_ProducerSession, Transfer], None]) -> Transfer:
        """Enroll ``t`` in its consumer's session and ``send`` its first message: here when the session is up,
        else on the worker pool, so ``push`` and ``offer`` never wait for a connection or a handshake."""

        def ended(e: KVXferError) -> None:  # a handshake cut short by close() is the close, whatever broke first
            with self._lock:
                self._launching.discard(t)
            self._end(t, ClosedError("producer closed") if self.closed else e)

        def run() -> None:
            if t.done():
                return
            try:
                send(self._enroll(t), t)
            except KVXferError as e:
                ended(e)
            except Exception as e:  # a bug or an input no check foresaw: the transfer still ends, and says why
                log.exception("kvxfer %s of %r", t.kind, t.req)
                ended(TransportError(f"{t.kind} of {t.req!r} failed: {e!r}"))

        with self._lock:
            s = self._sessions.get(t.address)
            ready = s is not None and s.alive
            if not ready:
                self._launching.add(t)
        if ready:
            run()
        else:
            self._submit(run, dropped=lambda: ended(ClosedError("producer closed")))
        return t

    def push(
        self,
        address: str,
        req: str,
        block_ids,
        *,
        meta: dict | None = None,
        deadline: float | None = None,
        digests: bool = False,
        dst_block_ids=None,
        layers=None,
        heads=None,
        senders: int = 1,
        part: int = 0,
        retry_busy: bool = False,
        tokens: int | None = None,
    ) -> Transfer:
        """Ask ``address`` to admit ``len(block_ids)`` blocks and write these blocks into its grant.

        Returns at once; the transfer goes on in the background. ``dst_block_ids`` (a test hook for the
        protocol's fencing) overrides the granted destination, which the consumer must refuse unless equal.
        ``digests`` sends a CRC per block for the consumer to check (host memory; for tests and debugging).

        Multi-sender (prefill ranks): ``senders`` producers each push ``part`` of one request into the same
        granted blocks, carrying only ``layers`` (pipeline stages: disjoint, together every layer) or only
        ``heads`` (``[start, stop)`` of the model's kv heads: tensor-parallel ranks, whose layouts declare the
        heads they hold; ``kvxfer.shard.sources`` says which rank ships which heads to a consumer rank); the
        consumer hands the request off once the parts together filled every byte of the blocks. Between shards
        a single sender is enough when it holds every head the consumer holds.

        ``retry_busy``: a ``Busy`` consumer is asked again after the ``retry_after`` it named, until the
        deadline (then ``DeadlineError``); without it the transfer ends with ``BusyError`` at once.

        ``tokens``: how many tokens the blocks hold (the last one may be partial; default all full). A consumer
        paging with other tokens per block (a multiple or a divisor of ours) is granted the blocks that hold
        them and receives them token for token.
        """
        t = self._start("push", address, req, block_ids, deadline, tokens)
        t.meta, t.meta_size = wire.check_meta(meta)
        own = held_layers(self.layout)
        if not (is_whole(senders) and is_whole(part) and 0 <= part < senders):
            raise BlockError(
                f"part {part!r} of {senders!r} senders: senders must be a whole number, 1 or more, part within them"
            )
        senders, part = int(senders), int(part)
        if digests and (senders > 1 or heads is not None):
            raise BlockError("per-block digests cover whole blocks: not for a part of a request")
        hs = ls = None
        if heads is not None:  # alone, it must be every head the consumer holds: the consumer checks
            try:
                lo, hi = (whole(x, "heads") for x in heads)
            except (TypeError, ValueError):
                raise BlockError(f"heads must be [start, stop) of kv heads, got {heads!r}") from None
            mine = held(self.layout)
            if not mine[0] <= lo < hi <= mine[1]:
                raise BlockError(f"heads [{lo}, {hi}) are not among the heads {list(mine)} this producer holds")
            hs = (lo, hi)
        if layers is not None or (senders > 1 and heads is None):
            ls = tuple(sorted(int(x) for x in (range(*own) if layers is None else layers)))  # the consumer checks
            if ls and not own[0] <= ls[0] <= ls[-1] < own[1]:
                raise BlockError(f"layers {list(ls)} are not among the layers {list(own)} this producer holds")
        if hs is not None or ls is not None:
            t.part_of = Selection(layers=ls, heads=hs)
        t.digests = block_digests(self.layout, t.src_ids) if digests else b""
        t.override = None if dst_block_ids is None else np.asarray(dst_block_ids, dtype=np.int64)
        t.retry_busy = retry_busy
        t.senders, t.part = senders, part
        return self._launch(t, self._admit)

    def _admit(self, s: _ProducerSession, t: Transfer) -> None:
        tokens = self._tokens(s, t)
        s.send(
            wire.Admit(
                req=t.req,
                num_blocks=len(t.src_ids),
                attempt=t.attempt,
                deadline_ms=ms(t.deadline - time.monotonic()),
                meta=t.meta,
                senders=t.senders,
                part=t.part,
                layers=None if t.part_of is None or t.part_of.layers is None else list(t.part_of.layers),
                heads=None if t.part_of is None or t.part_of.heads is None else list(t.part_of.heads),
                tokens=tokens,
                data=self._packed(s, t, t.src_ids, tokens),
            )
        )

    def _packed(self, s: _ProducerSession, t: Transfer, ids: np.ndarray, tokens: int | None) -> bytes:
        """A small whole request's bytes, to travel inside its Admit or Offer (``kvxfer.inline``); else nothing.
        They are read now: the caller's blocks must hold the request already, as for any push or offer."""
        t.inline = False
        if self._inline is None or t.senders > 1 or t.part_of is not None or t.override is not None:
            return b""
        if t.kind == "push" and t.digests:  # a push's digests travel in its Done, which an inline push skips
            return b""
        paging = s.link.paging()
        chunks = None if tokens is None else paging.chunks(tokens)
        nbytes = paging.nbytes(len(ids) if chunks is None else chunks)
        if nbytes > self.inline_max or nbytes + t.meta_size > inline.LIMIT:  # meta and bytes share the frame
            return b""
        t.inline = True
        return self._inline.pack(paging, ids, chunks)

    def offer(
        self,
        address: str,
        req: str,
        block_ids,
        *,
        meta: dict | None = None,
        lease: float | None = None,
        digests: bool = False,
        tokens: int | None = None,
    ) -> Transfer:
        """Offer blocks for ``address`` to pull; the transfer ends when the consumer released them (the
        producer may then free them) or when the lease runs out (``LeaseExpiredError``). ``tokens`` as for
        ``push``."""
        seconds = self.lease if lease is None else given_seconds(lease, "lease")
        t = self._start("pull", address, req, block_ids, seconds, tokens)
        t.meta, t.meta_size = wire.check_meta(meta)
        t.digests = block_digests(self.layout, t.src_ids) if digests else b""
        return self._launch(t, self._offer)

    def _offer(self, s: _ProducerSession, t: Transfer) -> None:
        seconds = max(0.0, t.deadline - time.monotonic())
        tokens = self._tokens(s, t)
        t.chunks = None if tokens is None else s.link.paging().chunks(tokens)
        t._lease = self.leases.offer(s.peer.local, t.req, t.src_ids, seconds, time.monotonic(), t.chunks)
        t.gen = t._lease.gen
        s.transport.expect()
        s.send(
            wire.Offer(
                req=t.req,
                gen=t.gen,
                ids=wire.ids_to_bytes(t.src_ids),
                lease_ms=ms(seconds),
                meta=t.meta,
                digests=self._digests(s, t.digests),
                tokens=tokens,
                data=self._packed(s, t, t.src_ids, tokens),
            )
        )

    def hold(
        self,
        req: str,
        block_ids,
        *,
        lease: float | None = None,
        meta: dict | None = None,
        digests: bool = False,
        tokens: int | None = None,
    ) -> Transfer:
        """Keep ``block_ids`` readable as ``req`` until one consumer fetched them (``Consumer.fetch``) or the
        lease runs out; ``tokens`` as for ``push`` (a consumer with other tokens per block fetches by them).
        ``ticket`` on the returned transfer is what that consumer needs (JSON-safe). The transfer ends when the
        blocks are no longer read: fetched and confirmed (no error), the fetch failed, the lease expired
        (``LeaseExpiredError``) or ``cancel``; only then may the caller reuse them."""
        if self.address is None:
            raise ConfigError("hold() needs a producer that listens (Producer(listen=...))")
        seconds = self.lease if lease is None else given_seconds(lease, "lease")
        t = self._start("hold", self.address, req, block_ids, seconds, tokens)
        t.meta, t.meta_size = wire.check_meta(meta)
        t.digests = block_digests(self.layout, t.src_ids) if digests else b""
        t.ticket = {
            "address": self.address,
            "request_id": t.req,
            "num_blocks": len(t.src_ids),
            "tokens": t.tokens or len(t.src_ids) * self.layout.fingerprint.block_size,
            "lease_expires": time.time() + seconds,
            "fingerprint": self.layout.fingerprint_id,
            "transports": list(self.transports),
        }
        with self._lock:
            self._check_open()
            if t.req in self._holds:
                raise BlockError(f"request {t.req!r} is already held")
            self._holds[t.req] = t
        return t

    def _fetch(self, s: _ProducerSession, msg: wire.Fetch) -> None:
        """A consumer asks for blocks of a hold: offer them on its session, under what is left of the lease.
        A consumer paging with other tokens per block asks for tokens from block ``skip`` on: it gets the hold's
        blocks that hold them, up to the hold's last token. A hold that several consumers read (each its own
        heads or layers: tensor-parallel decode ranks) gets one read per fetch, as many as the first fetch said
        (``readers``), and ends once every read ended."""
        error: KVXferError | None = None
        paging = s.link.paging()
        with self._lock:
            t = self._holds.get(msg.req)
            n, tokens = msg.num_blocks, None
            if t is not None and paging.k > 1:
                held_tokens = t.tokens or len(t.src_ids) * paging.src_block
                tokens = min(msg.tokens or n * paging.src_block, held_tokens - msg.skip * paging.src_block)
                n = paging.src_blocks(tokens) if tokens > 0 else 0
            if t is None or t.done():
                error = StaleError(f"no hold for request {msg.req!r} (never held, fetched, expired or cancelled)")
            elif t.readers and msg.readers != t.readers:
                error = BlockError(
                    f"request {msg.req!r}: a fetch for {msg.readers} readers of a hold fetched by {t.readers}"
                )
            elif t.fetcher is not None or len(t.reads) >= msg.readers:
                error = StaleError(f"request {msg.req!r} is already being fetched")
            elif n == 0 or msg.skip + n > len(t.src_ids):
                error = BlockError(
                    f"request {msg.req!r}: blocks [{msg.skip}, {msg.skip + n}) asked of a hold of {len(t.src_ids)}"
                )
            elif msg.req in s.transfers:
                error = BlockError(f"request {msg.req!r} is already in flight on this session")
            else:
                t.readers = msg.readers
                r = t if t.readers == 1 else self._read_of(t, s)
                r.fetcher = s
                s.transfers[t.req] = r
        if error is not None:
            s.send(wire.Error(req=msg.req, code=error.code, message=str(error), attempt=msg.attempt))
            return
        assert t is not None
        log.debug("kvxfer hold %s: fetched by %s", r.req, s.address)
        now = time.monotonic()
        ids = r.src_ids[msg.skip : msg.skip + n]
        seconds = max(0.0, r.deadline - now)
        r.chunks = None if tokens is None else paging.chunks(tokens)
        r._lease = self.leases.offer(s.peer.local, r.req, ids, seconds, now, r.chunks)
        r.gen = r._lease.gen
        t._mark(Status.MOVING, "admitted")
        r._mark(Status.MOVING, "admitted")
        digests = self._digests(s, r.digests[4 * msg.skip : 4 * (msg.skip + n)])
        s.transport.expect()
        s.send(
            wire.Offer(
                req=r.req,
                gen=r.gen,
                ids=wire.ids_to_bytes(ids),
                lease_ms=ms(seconds),
                meta=r.meta,
                digests=digests,
                tokens=tokens,
                data=self._packed(s, r, ids, tokens),
            )
        )

    def _digests(self, s: _ProducerSession, digests: bytes) -> bytes:
        """Per-block digests cover whole blocks: a consumer whose blocks hold other bytes (other tokens per block,
        other heads or layers) goes without."""
        a, b = self.layout, s.peer.layout
        whole = s.link.paging().k == 1 and not sharded(a, b) and not staged(a, b)
        return digests if whole else b""

    def _read_of(self, t: Transfer, s: _ProducerSession) -> Transfer:
        """A read of hold ``t`` (under ``_lock``) by one of its several readers: a transfer of its own."""
        r = Transfer(t.req, "hold", s.address, t.src_ids, self.layout.block_bytes, t.deadline)
        r.meta, r.meta_size, r.digests, r.tokens, r.hold = t.meta, t.meta_size, t.digests, t.tokens, t
        r._on_cancel = self._cancelled
        t.reads.append(r)
        return r

    # ---- ending -----------------------------------------------------------------------------------------
    def _session_of(self, t: Transfer) -> _ProducerSession | None:
        if t.kind == "hold":
            return t.fetcher
        return self._sessions.get(t.address)

    def _end(self, t: Transfer, error: KVXferError | None, status: Status | None = None) -> None:
        """End ``t``: at once, or for a pull or a hold once no read is served from its blocks any more (its
        owner may reuse them as soon as it ended)."""
        with self._lock:
            s = self._session_of(t)
            if s is not None and s.transfers.get(t.req) is t:
                del s.transfers[t.req]
            if t.kind == "hold" and self._holds.get(t.req) is t:
                del self._holds[t.req]
            reading = [r for r in t.reads if not r.done()]
            if reading and t._ending is None:  # a hold several consumers read: it ends after its last read
                t._ending = (error, status)
        lease = t._lease
        if reading:
            return
        if lease is None:
            return self._ended(t, error, status)
        self.leases.drop(lease, error or StaleError(f"{t.kind} of {t.req!r} ended"))
        self.leases.when_unread(lease, lambda: self._ended(t, error, status))

    def _ended(self, t: Transfer, error: KVXferError | None, status: Status | None) -> None:
        if t._finish(error, status) and error is not None:
            log.debug("kvxfer %s %s failed: %s", t.kind, t.req, error)
        hold = t.hold
        if hold is None:  # one read of a hold several consumers read: it ends with its last read
            return
        with self._lock:
            unread = all(r.done() for r in hold.reads)
            last = unread and len(hold.reads) == hold.readers
            ending = hold._ending
        if last or (unread and ending is not None):
            error, status = ending or (next((r.error for r in hold.reads if r.error is not None), None), None)
            self._end(hold, error, status)

    def _cancelled(self, t: Transfer, reason: str) -> None:
        with self._lock:
            s = self._session_of(t)
            reads = list(t.reads)
        self._end(t, t.error, Status.CANCELLED)
        if s is not None and s.alive:
            s.send(wire.Cancel(req=t.req, gen=t.gen, reason=reason))
        for r in reads:  # a hold several consumers read: each read stops too
            r.cancel(reason)

    def _fail(self, s: _ProducerSession, t: Transfer, error: KVXferError, tell: bool = True) -> None:
        self._end(t, error)
        if tell and s.alive:
            if t.kind == "push":
                s.send(wire.Cancel(req=t.req, gen=t.gen, reason=str(error)))
            else:  # a reader learns why its lease ended (LeaseExpiredError), not just that it did
                s.send(wire.Error(req=t.req, gen=t.gen, code=error.code, message=str(error)))

    def _reap(self, now: float) -> None:
        with self._lock:
            sessions = [*self._sessions.values(), *self._fetchers]
            live = [(s, t) for s in sessions for t in s.transfers.values()]
            late = [t for t in self._launching if t.deadline <= now]
            self._launching.difference_update(late)
        for t in late:  # every worker busy, or its handshake slow: it still ends at its deadline
            err = LeaseExpiredError if t.kind == "pull" else DeadlineError
            self._end(t, err(f"{t.kind} of {t.req!r} to {t.address} passed its deadline before its session was up"))
        for s, t in live:
            if t.deadline <= now:
                err = LeaseExpiredError if t.kind in ("pull", "hold") else DeadlineError
                busy = f" (the consumer stayed busy, {t.busy_retries} retries)" if t.busy_retries else ""
                self._fail(
                    s, t, err(f"{t.kind} of {t.req!r} to {t.address} passed its deadline while {t.status.value}{busy}")
                )
            elif t.retry_at and t.retry_at <= now and not t.done():
                t.retry_at, t.attempt = 0.0, next(_attempts)
                self._admit(s, t)
        with self._lock:
            unfetched = [t for t in self._holds.values() if t.fetcher is None and t.deadline <= now]
        for t in unfetched:  # after its reads above: a hold ends only with (or after) them
            who = f"{len(t.reads)} of its {t.readers} readers" if t.reads else "no consumer"
            self._end(t, LeaseExpiredError(f"hold of {t.req!r} expired: {who} fetched it"))

    # ---- control messages -------------------------------------------------------------------------------
    def _on_message(self, s: _ProducerSession, msg) -> None:
        if isinstance(msg, wire.Fetch):
            return self._fetch(s, msg)
        req = getattr(msg, "req", "")
        with self._lock:
            t = s.transfers.get(req)
        if isinstance(msg, wire.Error) and not req:
            raise from_code(msg.code, msg.message)
        if t is None:
            if isinstance(msg, wire.Cancel):  # a consumer that will not fetch after all: the hold ends now
                with self._lock:
                    hold = self._holds.get(req)
                if hold is not None and hold.fetcher is None and not hold.reads:
                    self._end(
                        hold, CancelledError(f"consumer {s.address} cancelled {req!r}: {msg.reason}"), Status.CANCELLED
                    )
            return  # a late answer for a transfer that already ended
        if getattr(msg, "attempt", 0) and msg.attempt != t.attempt:
            return  # the answer to an earlier attempt of the same request id
        if isinstance(msg, wire.Grant) and t.kind == "push" and t.status is Status.PENDING:
            self._granted(s, t, msg)
        elif isinstance(msg, wire.Busy):
            if t.retry_busy:  # the reaper asks again; the deadline still bounds it
                t.retry_at = time.monotonic() + msg.retry_after_ms / 1000
                t.busy_retries += 1
            else:
                self._end(t, BusyError(f"consumer {s.address} busy: {msg.reason}", msg.retry_after_ms / 1000))
        elif isinstance(msg, wire.Error):
            self._end(t, from_code(msg.code, f"consumer {s.address}: {msg.message}"))
        elif isinstance(msg, wire.Cancel):
            self._end(t, CancelledError(f"consumer {s.address} cancelled {req!r}: {msg.reason}"), Status.CANCELLED)
        elif isinstance(msg, wire.Ack) and msg.gen == t.gen and t.status is Status.COMMITTING:
            self._end(t, None)
        elif isinstance(msg, wire.Released) and t.kind in ("pull", "hold"):
            self._released(s, t, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} for {req!r} while {t.status.value}")

    def _granted(self, s: _ProducerSession, t: Transfer, msg: wire.Grant) -> None:
        t.gen = msg.gen
        try:
            t.dst_ids = wire.ids_from_bytes(msg.ids, s.peer.layout.num_blocks)
            tokens = self._tokens(s, t)
            paging = s.link.paging(t.part_of)
            want = len(t.src_ids) if tokens is None else paging.dst_blocks(tokens)
            if len(t.dst_ids) != want:
                raise BlockError(f"consumer granted {len(t.dst_ids)} blocks for {want}")
            t.chunks = None if tokens is None else paging.chunks(tokens)
            t.nbytes = paging.nbytes(len(t.src_ids) if tokens is None else t.chunks)
        except KVXferError as e:
            return self._fail(s, t, e)
        t._mark(Status.MOVING, "admitted")
        if t.inline:  # the bytes came with the Admit and have landed: the Ack follows the Grant
            t._mark(Status.COMMITTING, "moved")
            return
        self._submit(self._move, s, t, dropped=lambda: self._fail(s, t, ClosedError("producer closed")))

    def _move(self, s: _ProducerSession, t: Transfer) -> None:
        if t.done():  # cancelled, superseded or timed out before its turn: not a byte moves
            return
        if time.monotonic() >= t.deadline:  # a grant handled late (a stopped producer): its blocks may be gone
            return self._fail(s, t, DeadlineError(f"push of {t.req!r} granted after its deadline"))
        granted = t.dst_ids
        assert granted is not None  # _granted set it before submitting this move
        dst = granted if t.override is None else t.override
        with s.quiet:
            s.moving += 1
        try:
            if s.transport.one_sided and not np.array_equal(dst, granted):
                # RDMA gives the receiver no say over a remote write: the grant is enforced here
                raise BlockError(f"request {t.req!r} would write blocks it was not granted")
            if t.part_of is None:
                t._descriptors = lambda: s.link.descriptors(t.src_ids, dst, t.chunks)
            moved = s.link.write(t.req, t.gen, t.src_ids, dst, t.deadline, t.cancel_event, t.part_of, t.chunks)
        except KVXferError as e:
            if isinstance(e, PeerError) and s.alive:
                # a consumer that cancels or fails a request cuts its data connection and says why on the control
                # connection: that verdict, arriving a moment later, names the end, not the broken socket
                t.wait_ended(VERDICT_WAIT)
            return self._fail(s, t, e)
        except Exception as e:
            return self._fail(s, t, PeerError(f"write failed: {e!r}"))
        finally:
            with s.quiet:
                s.moving -= 1
                s.quiet.notify_all()
        if t.done():
            return
        t._mark(Status.COMMITTING, "moved")
        s.send(wire.Done(req=t.req, gen=t.gen, nbytes=moved, meta=t.meta, digests=self._digests(s, t.digests)))

    def _released(self, s: _ProducerSession, t: Transfer, msg: wire.Released) -> None:
        now = time.monotonic()
        try:
            self.leases.release(t.req, msg.gen, now)
            ok = None
        except KVXferError as e:
            ok = e
        if ok is None:
            t.timings["moved"] = now
            s.send(wire.Ack(req=t.req, gen=msg.gen))
            self._end(t, None)
        else:
            s.send(wire.Error(req=t.req, gen=msg.gen, code=ok.code, message=str(ok)))
            self._end(t, LeaseExpiredError(str(ok)))

    # ---- ReadHost: the transport asks before serving a pull's read ---------------------------------------
    def begin_read(self, session: int, req: str, gen: int, ids: np.ndarray) -> Lease:
        return self.leases.check_read(session, req, gen, ids, time.monotonic())

    def end_read(self, ticket: Lease, nbytes: int, error: BaseException | None) -> None:
        """A read stopped: a pull or hold that ended meanwhile ends for its owner now (the consumer's
        ``Released`` or the lease's end decides how)."""
        self.leases.end_read(ticket)

    def close(self) -> None:
        with self._lock:  # from here no push, offer or hold starts, and no new session registers
            if self.closed:
                return
            self.closed = True
            sessions = list(self._sessions.values())
            launching, self._launching = list(self._launching), set()
            dialing = list(self._dialing)
        if self._listener is not None:
            close_socket(self._listener)
        for ch in dialing:
            shutdown(ch.sock)
        for t in launching:  # waiting for a worker or a session that will not come now
            self._end(t, ClosedError("producer closed"))
        with self._lock:
            sessions += list(self._fetchers)
            holds = list(self._holds.values())
        for s in sessions:
            self._session_lost(s, ClosedError("producer closed"))
        for t in holds:
            self._end(t, ClosedError("producer closed"))
        for s in sessions:  # the transports go only once nothing moves through them
            s.wait_quiet(QUIET_WAIT)
        self._close_common()


def _data_address(advertised: str, host: str) -> str:
    """Where a fetching consumer's data connections go: the address its Welcome named, with an unspecified
    host (it listens on every interface) replaced by the one it connected from."""
    if not advertised:
        raise ProtocolError("a fetching consumer must name its listening address in its welcome")
    h, port = parse_address(advertised)
    return f"{host if h in ('', '0.0.0.0', '::') else h}:{port}"
