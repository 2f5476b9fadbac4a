"""The decode side: a ``Consumer`` listens on one address, admits pushes into blocks its allocator grants,
pulls offered blocks, fetches held blocks into blocks its caller chose (``fetch``), and hands every arrived
request to the runtime as an ``Arrival``. Every protocol rule
is the ledger's (``ledger.Grants``); this module wires it to sockets, threads and the transport.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from . import handshake, inline, tls, wire
from .allocator import Allocator, FreeList
from .channel import SPIN, Channel, Spin, parse_address, remaining
from .digest import mismatches
from .errors import (
    AuthError,
    BlockError,
    BusyError,
    CancelledError,
    ClosedError,
    ConfigError,
    DeadlineError,
    IncompatibleError,
    IntegrityError,
    KVXferError,
    PeerError,
    ProtocolError,
    StaleError,
    from_code,
)
from .fetch import Fetch, Fetches
from .layout import KVLayout
from .ledger import Grants, Part, Slot
from .lifecycle import REAP_INTERVAL, HandleBase, Mailbox, given_seconds, ms
from .plan import check_ids
from .shard import Selection, coverage
from .sockets import accept, close
from .sockets import listen as listen_on
from .transfer import Arrival
from .transports.base import Peer, Transport

log = logging.getLogger("kvxfer")

HAND_OFF_WAIT = 5.0  # seconds close() waits at most for hand-offs under way (an on_arrival callback runs in one)


class _ConsumerSession:
    """One producer's control connection, and the pulls this consumer runs for it."""

    def __init__(self, ch: Channel, remote_id: str, peer: Peer, transport: Transport):
        self.sid = peer.session
        self.ch = ch
        self.remote_id = remote_id
        self.peer = peer
        self.transport = transport  # the one both sides agreed on in the handshake
        self.link = transport.connect(peer)
        self.covered = coverage(peer.layout, transport.layout)  # the bytes of our blocks a whole push fills
        self.covered.setflags(write=False)  # shared by every admission of the session
        self.alive = True
        self.pulls: dict[str, tuple[Slot, threading.Event | None]] = {}  # None: its bytes came with the offer
        self.data_nonces: set[bytes] = set()  # each data connection proves the session key once
        self.fetches: dict[str, Fetch] = {}  # a session this consumer opened to fetch: its fetches, by request
        self.fetch_address = ""  # that session's producer address

    def send(self, *msgs) -> bool:
        try:
            self.ch.send(*msgs)
            return True
        except KVXferError:
            return False


class Consumer(HandleBase):
    """The decode side: listens on ``listen``, admits pushes into blocks its ``allocator`` grants, pulls
    offered blocks, and hands every arrived request to the runtime (``get`` / ``on_arrival``).

    Blocks of an arrived request belong to the runtime until it calls ``release(req)``. ``deadline`` caps
    every admitted request; ``max_inflight`` bounds admitted-but-unfinished requests (then ``Busy``).

    Limits against a careless or hostile peer: ``allowed_producers`` (IP addresses or networks, e.g.
    ``["10.0.0.0/8"]``; others are closed before a byte is read), ``max_sessions_per_host``,
    ``max_inflight_per_peer`` (admissions of one session), ``max_msgs_per_sec`` (control frames of one
    session, averaged over a one-second burst), ``max_frame`` (control-frame size after the handshake, at least
    ``kvxfer.inline.FRAME``; ``wire.MAX_HANDSHAKE_FRAME`` before it) and ``handshake_timeout`` (the whole
    handshake).

    ``tls`` (a server context, ``kvxfer.tls.server_context``): every control and TCP data connection is TLS.
    ``spin``: seconds a control connection's reader busy-waits for the next message before it blocks
    (``kvxfer.channel.Spin``); 0 never spins.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        transport: str = "auto",
        listen: str = "127.0.0.1:0",
        allocator: Allocator | None = None,
        auth: str = "",
        deadline: float = 30.0,
        max_inflight: int = 1024,
        tombstone_ttl: float = 30.0,
        retry_after: float = 0.05,
        quarantine: float = 2.0,
        on_arrival: Callable[[Arrival], None] | None = None,
        peer_id: str | None = None,
        transport_options: dict | None = None,
        workers: int = 8,
        max_frame: int = wire.MAX_FRAME,
        handshake_timeout: float = 5.0,
        queue_arrivals: bool = True,
        allowed_producers: Iterable[str] | None = None,
        max_sessions_per_host: int = 64,
        max_inflight_per_peer: int | None = None,
        max_msgs_per_sec: float = 20_000.0,
        tls: ssl.SSLContext | None = None,
        spin: float = SPIN,
    ):
        host, port = parse_address(listen)
        self.spin = Spin(spin).limit
        try:
            self.allowed = (
                None
                if allowed_producers is None
                else [ipaddress.ip_network(a, strict=False) for a in allowed_producers]
            )
        except ValueError as e:
            raise ConfigError(f"allowed_producers: {e}") from None
        self.max_sessions_per_host = max_sessions_per_host
        self.max_msgs_per_sec = max_msgs_per_sec
        self.tls = tls
        self.deadline = given_seconds(deadline, "deadline")  # every option is checked before anything opens
        self.handshake_timeout = given_seconds(handshake_timeout, "handshake_timeout")
        if max_frame < inline.FRAME:
            raise ConfigError(f"max_frame must hold an inline request ({inline.FRAME} bytes), got {max_frame}")
        self.max_frame = max_frame
        self.allocator = allocator or FreeList(layout.num_blocks)
        self.grants = Grants(
            self.allocator,
            layout.block_bytes,
            max_inflight=max_inflight,
            tombstone_ttl=tombstone_ttl,
            retry_after=retry_after,
            quarantine=quarantine,
            max_inflight_per_peer=max_inflight_per_peer,
            num_blocks=layout.num_blocks,
        )
        self._listener = listen_on((host, port))
        try:
            super().__init__(layout, transport, auth, transport_options, peer_id, workers)
        except BaseException:
            close(self._listener)
            raise
        self._inline = inline.Inline(layout) if inline.Inline.usable(layout) else None
        self.queue_arrivals = queue_arrivals  # False: arrivals go to ``on_arrival`` only, never queue up
        self.on_arrival = on_arrival
        self.arrivals = Mailbox("arrival")
        self.counters = {"admitted": 0, "rejected": 0, "completed": 0, "failed": 0, "bytes": 0}
        self._sessions: dict[int, _ConsumerSession] = {}
        self._sids = itertools.count(1)
        self._per_host: dict[str, int] = {}
        self.fetches = Fetches(self)
        self._delivering: set[int] = set()  # threads handing a request off now: close() waits for them
        self._delivered = threading.Condition(self._lock)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, daemon=True, name="kvxfer-accept").start()
        self._reaper.start()

    # ---- public -----------------------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Arrival:
        """The next arrived request; ``DeadlineError`` if none arrives within ``timeout``, ``ClosedError`` once
        the consumer closed and every arrival before was taken."""
        return self.arrivals.get(timeout)

    def release(self, req: str) -> bool:
        """Give an arrived request's blocks back to the allocator (the runtime is done with them)."""
        return self.grants.release(req)

    def cancel(self, req: str, reason: str = "cancelled by consumer") -> bool:
        """Cancel an admitted push or a running pull; the producer is told, blocks are released."""
        slot = self.grants.get(req)
        if slot is None:
            return False
        self._fail_slot(slot, CancelledError(reason))
        self._tell_members(slot, lambda gen: wire.Cancel(req=req, gen=gen, reason=reason))
        return True

    def fetch(
        self,
        address: str,
        req: str,
        block_ids,
        *,
        skip: int = 0,
        deadline: float | None = None,
        tokens: int | None = None,
        from_token: int | None = None,
        readers: int = 1,
        partial: bool = False,
    ) -> Fetch:
        """Read blocks ``[skip, skip + len(block_ids))`` of what the producer at ``address`` holds as ``req``
        (``Producer.hold``) into this consumer's ``block_ids``, chosen by the caller (never taken from or given
        back to the allocator). Returns at once; the transfer ends with no error once every byte landed, else
        with a typed error, and in both cases only when no byte can land in ``block_ids`` any more. A producer
        paging with other tokens per block offers the blocks holding ``tokens`` tokens (default: all our blocks
        full) from its block ``skip`` on, at most its hold's last token: ``block_ids`` must be the blocks of ours
        that hold what it offers. ``from_token`` says where to start in tokens instead of ``skip`` (it must
        start one of the producer's blocks), for a caller that does not know the producer's block size.

        Parallel ranks: a producer holding only some of our heads or layers (a tensor- or pipeline-parallel prefill
        rank) fills only those bytes of ``block_ids``: the caller says ``partial=True`` and fetches the others from
        the other ranks (``kvxfer.shard.sources`` says which), else it is ``IncompatibleError``. A hold that
        several consumers fetch (decode ranks, each its heads) is fetched by each with ``readers`` set to their
        number: the producer keeps it until that many fetches ended."""
        return self.fetches.start(address, req, block_ids, skip, deadline, tokens, from_token, readers, partial)

    def decline(self, address: str, req: str, reason: str = "not needed") -> None:
        """Tell the producer at ``address`` that its hold ``req`` will not be fetched, so it frees the blocks
        now rather than at the end of the lease (say, a local prefix-cache hit covered the whole prompt).
        Best effort and in the background; returns at once."""
        self.fetches.decline(address, req, reason)

    def state(self, req: str) -> str | None:
        """Where ``req`` stands (``Grants.phase``): ``"receiving"``, ``"ready"``, ``"failed"`` or ``None``, so
        a runtime waiting for it can give up at once."""
        return self.grants.phase(req)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(
                self.counters,
                **self.grants.counts(),
                sessions=len(self._sessions),
                free_blocks=getattr(self.allocator, "num_free", -1),
            )

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def _tell_members(self, slot: Slot, make, skip: int | None = None, first=None) -> None:
        """Send ``make(gen)`` to every producer session writing ``slot`` (all parts), by the generation each
        of them knows; ``first`` (a single sender's Grant) goes ahead of it in the same write."""
        for sid, gen in slot.members():
            with self._lock:
                s = self._sessions.get(sid)
            if s is not None and sid != skip:
                s.send(*(() if first is None else (first,)), make(gen))

    # ---- connections ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while (taken := accept(self._listener, lambda: self.closed)) is not None:
            sock, host = taken
            with self._lock:
                crowded = self._per_host.get(host, 0) >= self.max_sessions_per_host
                if not crowded and self._allowed(host):
                    self._per_host[host] = self._per_host.get(host, 0) + 1
                    admitted = True
                else:
                    admitted = False
            if not admitted:
                sock.close()
                continue
            with contextlib.suppress(OSError):  # reset before we got to it: its thread finds out
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_from, args=(sock, host), daemon=True, name="kvxfer-session").start()

    def _allowed(self, host: str) -> bool:
        if self.allowed is None:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.allowed)

    def _serve_from(self, sock: socket.socket, host: str) -> None:
        try:
            self._serve(sock)
        finally:
            with self._lock:
                left = self._per_host.get(host, 1) - 1
                if left > 0:
                    self._per_host[host] = left
                else:
                    self._per_host.pop(host, None)

    def _serve(self, sock: socket.socket) -> None:
        end = time.monotonic() + self.handshake_timeout  # one deadline for the whole handshake
        if self.tls is not None:
            try:
                sock = tls.accept(self.tls, sock, self.handshake_timeout)
            except KVXferError as e:
                log.info("kvxfer: TLS handshake failed: %s", e)
                close(sock)
                return
        ch = Channel(sock, self.max_frame, spin=self.spin)
        try:
            first = ch.recv(self.handshake_timeout, max_frame=wire.MAX_HANDSHAKE_FRAME)
            if isinstance(first, wire.DataHello):
                return self._accept_data(ch, first)
        except KVXferError as e:
            _tell(ch, wire.Error(req="", code=e.code, message=str(e)))
            ch.close()
            return
        try:
            s = self._welcome(ch, first, end)
        except KVXferError as e:
            _tell(ch, wire.Error(req="", code=e.code, message=str(e)))
            ch.close()
            return
        except Exception:  # a peer must never crash the consumer
            log.exception("kvxfer consumer handshake")
            ch.close()
            return
        sock.settimeout(None)
        self._run_session(s)

    def _run_session(self, s: _ConsumerSession) -> None:
        """Serve one control session until it ends (a producer's, or one this consumer opened to fetch)."""
        ch = s.ch
        try:
            budget, refilled = self.max_msgs_per_sec, time.monotonic()
            while s.alive:
                msg = ch.recv()
                now = time.monotonic()
                budget = min(self.max_msgs_per_sec, budget + (now - refilled) * self.max_msgs_per_sec)
                refilled = now
                if budget < 1:
                    raise ProtocolError(f"more than {self.max_msgs_per_sec:g} control messages a second")
                budget -= 1
                self._on_message(s, msg)
        except KVXferError as e:
            if not isinstance(e, PeerError):
                _tell(ch, wire.Error(req="", code=e.code, message=str(e)))
            error = e
        except Exception as e:  # a peer must never crash the consumer
            log.exception("kvxfer consumer session")
            error = PeerError(repr(e))
        else:
            error = PeerError("session closed")
        self._session_lost(s, error)
        ch.close()

    def _accept_data(self, ch: Channel, hello: wire.DataHello) -> None:
        """A transport data connection: it must prove the key of a live session, with a nonce never seen."""
        with self._lock:
            s = self._sessions.get(hello.session)
            if s is None or not s.alive:
                raise AuthError(f"data connection for unknown session {hello.session}")
            handshake.check_data_hello(hello, s.peer.key, s.data_nonces)
        ch.sock.settimeout(None)
        s.transport.accept_data(ch.sock, hello)

    def _welcome(self, ch: Channel, first, end: float, address: str = "") -> _ConsumerSession:
        hello = handshake.check_hello(first)
        challenge, nonce = handshake.challenge(hello, self.peer_id, self.auth)
        ch.send(challenge)
        proof = ch.recv(remaining(end), max_frame=wire.MAX_HANDSHAKE_FRAME)
        try:
            remote, paging, name, meta, key = handshake.check_proof(
                proof, self.auth, hello.nonce, nonce, self.layout, list(self.transports)
            )
        except IncompatibleError:  # proved, but it does not pair: the request it was for fails now
            if isinstance(proof, wire.Proof) and proof.req:
                self.grants.refused(proof.req, time.monotonic())
            raise
        peer = Peer(next(self._sids), self.address, remote, paging, meta, is_producer=False, key=key)
        s = _ConsumerSession(ch, hello.peer_id, peer, self.transports[name])
        with self._lock:
            self._sessions[s.sid] = s
        try:
            ch.send(handshake.welcome(s.sid, self.layout, name, s.transport.local_meta(), key, address))
        except KVXferError as e:  # the peer left mid-handshake: the session never was
            self._session_lost(s, e)
            raise
        return s

    def _session_lost(self, s: _ConsumerSession, error: KVXferError, gone: bool = True) -> None:
        with self._lock:
            s.alive = False
            self._sessions.pop(s.sid, None)
            pulls = list(s.pulls.values())
        lost = self.grants.peer_lost(
            s.sid, PeerError(f"producer {s.remote_id} lost: {error}"), time.monotonic(), gone=gone
        )
        self._count("failed", len(lost))
        for _, ev in pulls:
            if ev is not None:
                ev.set()
        if s.transport is not None:
            s.transport.disconnect(s.sid)
        self.fetches.session_lost(s, error)
        self.fetches.finish_freed()

    # ---- control messages -------------------------------------------------------------------------------
    def _on_message(self, s: _ConsumerSession, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, wire.Admit):
            return self._admit(s, msg, now)
        if isinstance(msg, wire.Offer):
            return self._offered(s, msg, now)
        if isinstance(msg, wire.Error) and (f := self.fetches.pending(s, msg.req)) is not None:
            return self.fetches.refused(f, msg)
        if isinstance(msg, wire.Done):
            try:
                slot = self.grants.done(s.sid, msg.req, msg.gen, msg.nbytes, msg.meta, msg.digests)
            except KVXferError as e:
                self._refuse(s, msg.req, msg.gen, e)
                return
            if slot is not None:
                self._deliver(slot, "push")
            else:  # the bytes have landed by now, but a transport that learns so by polling has not yet seen it
                s.transport.expect()
            return
        if isinstance(msg, wire.Cancel):
            slot = self.grants.cancel(s.sid, msg.req, msg.gen, CancelledError(f"producer cancelled: {msg.reason}"), now)
            if slot is not None:
                self._failed(slot)
                if slot.senders > 1:
                    self._tell_members(
                        slot, lambda gen: wire.Cancel(req=msg.req, gen=gen, reason=msg.reason), skip=s.sid
                    )
            return
        if isinstance(msg, (wire.Ack, wire.Error)) and msg.req in s.pulls:
            return self._pull_answer(s, msg)
        if isinstance(msg, wire.Error):
            return
        raise ProtocolError(f"unexpected {type(msg).__name__} on a control connection")

    def _refuse(self, s: _ConsumerSession, req: str, gen: int, e: KVXferError, attempt: int = 0) -> None:
        s.send(wire.Error(req=req, gen=gen, code=e.code, message=str(e), attempt=attempt))

    def _reject(self, s: _ConsumerSession, req: str, e: KVXferError, gen: int = 0, attempt: int = 0) -> None:
        """Refuse an admission (push) or an offer (pull): ``Busy`` with its retry-after, else the error."""
        self._count("rejected")
        if isinstance(e, BusyError):
            s.send(wire.Busy(req=req, retry_after_ms=ms(e.retry_after), reason=str(e), attempt=attempt))
        else:
            self._refuse(s, req, gen, e, attempt)

    def _admit(self, s: _ConsumerSession, msg: wire.Admit, now: float) -> None:
        deadline = now + min(self.deadline, max(msg.deadline_ms, 1) / 1000)
        try:
            if s.fetch_address:  # opened to fetch: the producer there is no peer allowed_producers admitted
                raise ProtocolError(f"request {msg.req!r}: a session this consumer opened to fetch takes no pushes")
            if msg.data and (msg.senders != 1 or msg.layers is not None or msg.heads is not None):
                raise BlockError(f"request {msg.req!r}: only a whole single-sender push carries its bytes inline")
            if msg.data and self._inline is None:
                raise BlockError(f"request {msg.req!r}: this consumer's device memory takes no inline bytes")
            part, ranges = self._part(s, msg)
            n, chunks, per_block = self._paged(s, part, msg.req, msg.num_blocks, msg.tokens)
            slot, superseded = self.grants.admit(
                s.sid,
                msg.req,
                n,
                deadline,
                now,
                senders=msg.senders,
                part=msg.part,
                selection=part,
                ranges=ranges,
                meta=msg.meta,
                one_sided=s.transport.one_sided,
                chunks=chunks,
                per_block=per_block,
            )
        except KVXferError as e:
            return self._reject(s, msg.req, e, attempt=msg.attempt)
        self._count("admitted", not (slot.senders > 1 and len(slot.parts) > 1))
        self._superseded(s, superseded)
        gen = slot.parts[msg.part].gen if slot.senders > 1 else slot.gen
        if msg.data:
            return self._land_inline(s, slot, msg)
        s.transport.expect()
        s.send(wire.Grant(req=msg.req, gen=gen, ids=wire.ids_to_bytes(slot.ids), attempt=msg.attempt))

    def _superseded(self, s: _ConsumerSession, superseded: list[Slot]) -> None:
        """Slots a new admission of their id replaced: their writers learn now, before they move a byte (one-sided
        writes included); on the admitting session the answer would name the new transfer."""
        self._count("failed", len(superseded))
        for old in superseded:
            self._tell_members(
                old,
                lambda gen, old=old: wire.Error(
                    req=old.req, gen=gen, code=StaleError.code, message=f"request {old.req!r} superseded"
                ),
                skip=s.sid,
            )

    def _landed_inline(self, s: _ConsumerSession, slot: Slot, data: bytes) -> int:
        """Scatter a request's bytes, carried in its Admit or Offer, into the slot's blocks; returns their count."""
        if self._inline is None:
            raise BlockError(f"request {slot.req!r}: this consumer's device memory takes no inline bytes")
        if len(data) != slot.nbytes:
            raise BlockError(f"request {slot.req!r}: {len(data)} bytes inline, its blocks take {slot.nbytes}")
        self._inline.unpack(s.link.paging(), slot.ids, slot.chunks, data)
        return len(data)

    def _land_inline(self, s: _ConsumerSession, slot: Slot, msg: wire.Admit) -> None:
        """A small push's bytes came with its Admit: land them in the granted blocks (the slot is receiving
        meanwhile, so a failure frees them only after), then Grant and, once handed off, Ack."""
        error: KVXferError | None = None
        try:
            self.grants.begin_receive(slot)
        except KVXferError as e:
            return self._refuse(s, msg.req, slot.gen, e, msg.attempt)
        try:
            self._landed_inline(s, slot, msg.data)
        except KVXferError as e:
            error = e
        self.grants.end_receive(slot, 0 if error else slot.nbytes, time.monotonic())
        if error is not None:
            self._fail_slot(slot, error)
            return self._refuse(s, msg.req, slot.gen, error, msg.attempt)
        grant = wire.Grant(req=msg.req, gen=slot.gen, ids=wire.ids_to_bytes(slot.ids), attempt=msg.attempt)
        try:
            ready = self.grants.done(s.sid, msg.req, slot.gen, slot.nbytes, msg.meta, b"")
        except KVXferError as e:
            s.send(grant)
            return self._refuse(s, msg.req, slot.gen, e)
        if ready is None:
            s.send(grant)
        else:  # the Grant goes with the Ack, in one write
            self._deliver(ready, "push", grant)

    @staticmethod
    def _paged(
        s: _ConsumerSession, part: Selection | None, req: str, n: int, tokens: int | None
    ) -> tuple[int, int | None, int]:
        """For ``n`` source blocks holding ``tokens``: how many of our blocks hold them, and when the producer
        pages with other tokens per block, the chunk count and chunks per block of ours (else None, 1)."""
        paging = s.link.paging(part)
        if paging.k == 1:
            if tokens is not None and paging.src_blocks(tokens) != n:
                raise BlockError(f"request {req!r}: {tokens} tokens do not fill {n} blocks of {paging.src_block}")
            return n, None, 1
        tokens = paging.tokens(n) if tokens is None else tokens
        try:
            chunks = paging.check(tokens, src_blocks=n)
        except BlockError as e:
            raise BlockError(f"request {req!r}: {e}") from None
        return paging.dst_blocks(tokens), chunks, paging.k if paging.dst_block > paging.src_block else 1

    def _part(self, s: _ConsumerSession, msg: wire.Admit) -> tuple[Selection | None, np.ndarray]:
        """What an admission carries of every block (its layers or heads) and the bytes of our blocks it fills."""
        if msg.layers is None and msg.heads is None:
            return None, s.covered
        part = Selection(
            layers=None if msg.layers is None else tuple(sorted(int(x) for x in msg.layers)),
            heads=None if msg.heads is None else (int(msg.heads[0]), int(msg.heads[1])),
        )
        try:
            s.link.paging(part)  # both sides hold what it names (a peer may claim heads it does not hold)
            return part, part.ranges(s.peer.layout, self.layout)
        except IncompatibleError as e:
            raise BlockError(f"request {msg.req!r}: {e}") from None

    def _fail_slot(self, slot: Slot, error: KVXferError) -> None:
        if self.grants.fail(slot.req, error, time.monotonic()) is not None:
            self._failed(slot)
        self.fetches.finish_freed()

    def _failed(self, slot: Slot) -> None:
        """Count a failed slot and stop the pull reading into it, if one is."""
        self._count("failed")
        with self._lock:
            s = self._sessions.get(slot.peer)
            pull = s.pulls.get(slot.req) if s else None
        if pull is not None and pull[1] is not None:
            pull[1].set()

    def _deliver(self, slot: Slot, kind: str, grant: wire.Grant | None = None) -> None:
        """Hand a complete request off (or fail it on its digests). A request completing once ``close()`` began
        is taken back instead, so nothing is handed off after ``close()`` returned: it waits for hand-offs
        already under way, and the runtime takes those from ``get()``."""
        me = threading.get_ident()
        with self._lock:
            closing = self.closed
            if not closing:
                self._delivering.add(me)
        if closing:
            err = ClosedError(f"request {slot.req!r} completed as the consumer closed")
            if self.grants.revoke(slot, err, time.monotonic()):
                self._count("failed")
            self.fetches.finish_freed()
            return
        try:
            self._hand_off(slot, kind, grant)
        finally:
            with self._lock:
                self._delivering.discard(me)
                self._delivered.notify_all()

    def _hand_off(self, slot: Slot, kind: str, grant: wire.Grant | None) -> None:
        with self._lock:
            s = self._sessions.get(slot.peer)
        err = self._integrity(slot) if kind == "push" else None  # a pull is checked before its release
        if err is not None:
            if self.grants.revoke(slot, err, time.monotonic()):
                self._count("failed")
            if s is not None:
                error = wire.Error(req=slot.req, gen=slot.members()[0][1], code=err.code, message=str(err))
                s.send(*(() if grant is None else (grant,)), error)
            return
        with self._lock:
            self.counters["completed"] += 1
            self.counters["bytes"] += slot.nbytes
        if slot.external:  # a fetch: the blocks are its caller's, who learns from the fetch's transfer
            self.grants.release(slot.req)
            self.fetches.finish_freed()
            return
        arrival = Arrival(
            slot.req,
            slot.ids,
            slot.meta,
            slot.nbytes,
            slot.gen,
            s.remote_id if s else "",
            kind,
            slot.digests,
            {"admitted": slot.admitted, "completed": time.monotonic()},
        )
        if kind == "push":  # before the runtime sees it, so that a consumer closing once it has it loses no Ack
            self._tell_members(slot, lambda gen: wire.Ack(req=slot.req, gen=gen), first=grant)
        if self.on_arrival is not None:
            try:
                self.on_arrival(arrival)
            except Exception:  # the runtime's callback must not break the transport
                log.exception("kvxfer on_arrival callback for %s", slot.req)
        if self.queue_arrivals or self.on_arrival is None:
            self.arrivals.put(arrival)

    def _integrity(self, slot: Slot) -> IntegrityError | None:
        """The error to fail ``slot`` with if its blocks differ from the producer's digests (when it sent any)."""
        bad = mismatches(self.layout, slot.ids, slot.digests) if slot.digests else []
        if not bad:
            return None
        err = IntegrityError(
            f"request {slot.req!r}: {len(bad)} of {len(slot.ids)} blocks differ from the "
            f"producer's digests (first at position {bad[0]})"
        )
        log.error("kvxfer %s", err)
        return err

    def _reap(self, now: float) -> None:
        for slot in self.grants.expire(now, _overdue):
            self._failed(slot)
            self._tell_members(slot, functools.partial(_error_for, slot.req, slot.error))
        self.grants.reap(now)
        self.fetches.reap(now)  # hands the blocks of failed fetches back to their callers too

    # ---- pull -------------------------------------------------------------------------------------------
    def _offered(self, s: _ConsumerSession, msg: wire.Offer, now: float) -> None:
        fetch = self.fetches.pending(s, msg.req)
        log.debug("kvxfer offer %s on session %d (%s)", msg.req, s.sid, "a fetch" if fetch else "no fetch waits")
        try:
            src = wire.ids_from_bytes(msg.ids, s.peer.layout.num_blocks)
            check_ids(src, s.peer.layout.num_blocks, "offered block ids")
            lease_end = now + max(msg.lease_ms, 1) / 1000
            n, chunks, per_block = self._paged(s, None, msg.req, len(src), msg.tokens)
            if fetch is None:
                if s.fetch_address:  # a session this consumer opened answers its fetches only: this one ended
                    raise StaleError(
                        f"no fetch of {msg.req!r} waits for this offer (it ended: deadline, cancel or close)"
                    )
                deadline = min(now + self.deadline, lease_end)
                slot = self.grants.admit_pull(
                    s.sid,
                    msg.req,
                    n,
                    deadline,
                    now,
                    msg.gen,
                    dict(msg.meta),
                    msg.digests,
                    one_sided=s.transport.one_sided,
                    ranges=s.covered,
                    chunks=chunks,
                    per_block=per_block,
                )
            else:
                covered = s.covered
                if n != len(fetch.ids):
                    raise BlockError(
                        f"request {msg.req!r}: the {len(src)} blocks offered fill {n} of ours, {len(fetch.ids)} fetched"
                    )
                slot = self.fetches.claim(
                    fetch,
                    lambda: self.grants.admit_pull(
                        s.sid,
                        msg.req,
                        n,
                        min(fetch.deadline, lease_end),
                        now,
                        msg.gen,
                        dict(msg.meta),
                        msg.digests,
                        one_sided=s.transport.one_sided,
                        ranges=covered,
                        ids=fetch.ids,
                        chunks=chunks,
                        per_block=per_block,
                        partial=fetch.partial,
                    ),
                )
                if slot is None:
                    raise CancelledError(f"fetch of {msg.req!r} ended before its offer arrived")
        except KVXferError as e:
            if fetch is not None and not isinstance(e, CancelledError):
                self.fetches.end(fetch, e)
            return self._reject(s, msg.req, e, gen=msg.gen)
        self._count("admitted")
        superseded, slot.superseded = slot.superseded, []
        self._superseded(s, superseded)
        cancel = None if msg.data else threading.Event()  # landing an offer's own bytes has no read to stop
        with self._lock:
            s.pulls[msg.req] = (slot, cancel)
        if cancel is None:  # the offer carried its bytes (kvxfer.inline): land them here, no read
            self._pull(s, slot, src, None, msg.data)
        else:
            closed = ClosedError("consumer closed")
            self._submit(self._pull, s, slot, src, cancel, dropped=lambda: self._pull_failed(s, slot, closed))

    def _pull(self, s: _ConsumerSession, slot: Slot, src: np.ndarray, cancel: threading.Event | None, data=b"") -> None:
        """Read an offer into the slot's blocks (or land the bytes it carried). The slot is *receiving* while the
        reader runs, so a failure from any thread (cancel, deadline, lost session) frees the blocks only after
        the last byte landed."""
        try:
            self.grants.begin_receive(slot)
        except KVXferError as e:  # failed before its turn: not a byte moves
            return self._pull_failed(s, slot, e)
        moved, error = 0, None
        try:
            if cancel is None:
                moved = self._landed_inline(s, slot, data)
            else:
                moved = s.link.read(slot.req, slot.lease_gen, src, slot.ids, slot.deadline, cancel, slot.chunks)
        except KVXferError as e:
            error = e
        except Exception as e:
            error = PeerError(f"read failed: {e!r}")
        self.grants.end_receive(slot, 0 if error else moved, time.monotonic())
        error = error or slot.error or self._integrity(slot) or self.grants.releasing(slot)
        if error is not None:
            return self._pull_failed(s, slot, error)
        if not s.send(wire.Released(req=slot.req, gen=slot.lease_gen, nbytes=moved)):
            self._pull_failed(s, slot, PeerError("producer gone before release"))

    def _pull_failed(self, s: _ConsumerSession, slot: Slot, error: KVXferError) -> None:
        with self._lock:
            s.pulls.pop(slot.req, None)
        self._fail_slot(slot, error)
        s.send(wire.Error(req=slot.req, gen=slot.lease_gen, code=error.code, message=str(error)))

    def _pull_answer(self, s: _ConsumerSession, msg) -> None:
        """The producer's Ack or Error for a read. A late answer to an earlier offer of the same request id (one
        this consumer failed already) is ignored and leaves the live offer's entry for its own answer."""
        with self._lock:
            entry = s.pulls.get(msg.req)
            if entry is None or msg.gen != entry[0].lease_gen:
                return
            slot = s.pulls.pop(msg.req)[0]
        if self.grants.get(msg.req) is not slot:
            return
        if isinstance(msg, wire.Error):
            self._fail_slot(slot, from_code(msg.code, f"producer: {msg.message}"))
            return
        ready = self.grants.confirm(slot)
        if ready is not None:
            self._deliver(ready, "pull")

    # ---- WriteHost: the transport asks before landing bytes, and reports what landed ---------------------
    def begin_write(
        self, session: int, req: str, gen: int, ids: np.ndarray, window: tuple[int, int] | None = None
    ) -> Slot | Part:
        return self.grants.begin_write(session, req, gen, ids, window)

    def end_write(self, ticket: Slot | Part, nbytes: int, error: BaseException | None) -> None:
        part = ticket if isinstance(ticket, Part) else None
        slot = ticket.slot if isinstance(ticket, Part) else ticket
        if error is not None:
            err = error if isinstance(error, KVXferError) else PeerError(f"receive failed: {error!r}")
            self._fail_slot(slot, err)
        ready = self.grants.end_receive(slot, 0 if error is not None else nbytes, time.monotonic(), part)
        if ready is not None:
            self._deliver(ready, "push")

    def landed(self, session: int, req: str, gen: int, nbytes: int) -> None:
        try:
            ready = self.grants.landed(session, req, gen, nbytes)
        except KVXferError:
            return
        if ready is not None:
            self._deliver(ready, "push")

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.grants.close()
        close(self._listener)
        with self._lock:
            sessions = list(self._sessions.values())
        for slot in self.grants.active_slots():  # writers learn first, ahead of the closed connection
            self._tell_members(slot, lambda gen, req=slot.req: wire.Cancel(req=req, gen=gen, reason="consumer closed"))
        for s in sessions:
            s.ch.close()
            self._session_lost(s, ClosedError("consumer closed"), gone=False)
        self.fetches.close()
        # a live producer may still post a one-sided write into a grant it holds: its blocks go back only after
        # the quarantine (the reaper's job, done here once more before the handle is gone)
        end = self.grants.held_until()
        while self.grants.counts()["dying"] and time.monotonic() < end:
            time.sleep(REAP_INTERVAL)
            self.grants.reap(time.monotonic())
        self._close_common()
        self.grants.reap(time.monotonic())
        self.fetches.finish_freed()
        with self._lock:  # a hand-off under way when the close began: its arrival is queued before we return
            self._delivered.wait_for(lambda: not self._delivering - {threading.get_ident()}, HAND_OFF_WAIT)
        self.arrivals.close()


def _overdue(slot: Slot) -> DeadlineError:
    missing = slot.senders - len(slot.parts) if slot.senders > 1 else 0
    return DeadlineError(
        f"request {slot.req!r} passed its deadline"
        + (f" ({missing} of {slot.senders} senders never came)" if missing else "")
        + (" (the producer never answered its Released)" if slot.released else "")
    )


def _tell(ch: Channel, msg) -> None:
    with contextlib.suppress(KVXferError):
        ch.send(msg)


def _error_for(req: str, err: KVXferError, gen: int) -> wire.Error:
    return wire.Error(req=req, gen=gen, code=err.code, message=str(err))
