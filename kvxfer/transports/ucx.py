"""UCX transport: two-sided tag messages over UCX (``ucxx``), for stacks that carry UCX but not NIXL.

Each endpoint runs one UCX worker with its own progress thread; its address travels in kvxfer's handshake
(``local_meta``) and each link opens one endpoint to the peer's worker, with UCX's error handling on so a
dead peer fails the transfer instead of hanging it. The protocol is the TCP transport's, in tag messages:

* push: the producer sends a ``Header`` naming (request, generation, blocks, bytes); the consumer checks it
  against its ledger (``begin_write``), posts its receives and answers ``ready``; the producer sends the
  transfer's byte stream in ``window``-sized messages; the consumer answers once ``end_write`` took them.
* pull: the consumer sends a ``Header``; the producer checks it against its leases (``begin_read``), answers
  ``ready`` and sends the stream.

ucxx 0.52 can cancel neither one posted receive nor an endpoint's receives, so a receive is never posted
into KV memory: the stream lands in a host bounce buffer and is scattered into the granted blocks only after
it arrived and while the grant holds. The sender sends a window that is one contiguous piece of its blocks
straight from them (a send only reads) and gathers any other window into a buffer. Every request keeps its
buffer alive until it ends, even one given up mid-way (a stopped peer), or the transport closes. Host memory
only.

Tags are unique per receiving worker: 32 bits of link id (from the session key, checked unique among this
transport's links), 24 bits of transfer sequence (odd for pushes, even for pulls), 8 bits of message kind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import msgspec
import numpy as np

from .. import wire
from ..errors import CancelledError, DeadlineError, KVXferError, PeerError, ProtocolError, TransportError, from_code
from ..memory import HOST, host_buffer
from ..plan import Extents
from ..staging.engine import HostEngine, Slot
from .base import Link, Peer, ReadHost, Transport, WriteHost, ucx_logs_to_stderr

if TYPE_CHECKING:
    from types import ModuleType

HEADER_MAX = 1 << 20  # a header names at most ~256k block ids
REPLY_MAX = 4096
# ucxx closes an endpoint on its progress thread and waits for it: each wait this long (nanoseconds), this many
# times. ucxx's default, 0, waits for ever and never signals the worker again: CI saw one close wait >100 s.
CLOSE_WAIT_NS = 1_000_000_000
CLOSE_ATTEMPTS = 3

HEADER, READY, DONE, DATA = 1, 2, 3, 4  # message kinds, the low byte of a tag
_LEN = 4  # bytes of a control message's length prefix


class Header(msgspec.Struct, array_like=True):
    """A push (to a consumer) or a pull (to a producer): which one is the receiving side's role."""

    seq: int
    req: str
    gen: int
    ids: bytes
    total: int
    timeout: float  # seconds the initiator still waits: bounds how long the other side keeps sending


class Reply(msgspec.Struct, array_like=True):
    ok: bool
    code: str = ""
    message: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(Header)
_REPLY = msgspec.msgpack.Decoder(Reply)


def _frame(msg: msgspec.Struct) -> np.ndarray:
    body = _ENCODER.encode(msg)
    return np.frombuffer(len(body).to_bytes(_LEN, "little") + body, dtype=np.uint8)


def _unframe(buf: np.ndarray, decoder):
    n = int.from_bytes(buf[:_LEN].tobytes(), "little")
    if n > len(buf) - _LEN:
        raise ProtocolError("truncated UCX control message")
    try:
        return decoder.decode(buf[_LEN : _LEN + n])
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed UCX control message: {e}") from None


class _Bounces:
    """Bounce buffers kept between transfers: a fresh one costs a page fault per 4 KiB as the bytes first land
    (160-290 ms for 512 MiB here). A buffer belongs to one transfer at a time and comes back only when every
    request on it ended well; one a failed request may still fill is never handed out again. At most ``keep``
    bytes wait here (the largest buffers are kept)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.free: list[np.ndarray] = []  # by size, smallest first
        self.lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes: the smallest kept one that fits, else a new one."""
        with self.lock:
            for i, buf in enumerate(self.free):
                if len(buf) >= n:
                    return self.free.pop(i)
        return np.empty(n, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=len)
            while self.free and sum(len(b) for b in self.free) > self.keep:
                self.free.pop(0)


class _Op(NamedTuple):
    """A posted UCX request and the buffer it reads or fills: UCX holds only a pointer, so the buffer must live
    until the request ended (a send posted before the endpoint's wire-up finished goes out later)."""

    req: Any
    buf: np.ndarray


def ucxx() -> ModuleType:
    """ucxx's bindings, loaded on first use only: a process that loads this UCX before NIXL's runs NIXL over the
    wrong UCX modules (measured: 0.6-0.8 GB/s where NIXL alone moves 4-5), so naming, listing or probing this
    transport never loads it, and ``auto`` never opens it."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # set before UCX reads its environment
    ucx_logs_to_stderr()
    import ucxx._lib.libucxx as ucx

    return ucx


def _array(buf: np.ndarray):
    from ucxx._lib.arr import Array

    return Array(buf)


def _link_id(peer: Peer) -> int:
    """The same 32 bits on both sides of a session, unpredictable to anyone without its key."""
    digest = hashlib.blake2b(peer.key + str(peer.session).encode(), digest_size=4, person=b"kvxfer-ucx").digest()
    return int.from_bytes(digest, "little")


class UcxTransport(Transport):
    name = "ucx"

    @staticmethod
    def usable() -> bool:
        return importlib.util.find_spec("ucxx") is not None

    def __init__(self, layout, host, *, window: int = 8 << 20, bounce_keep: int = 1 << 30, **_):
        super().__init__(layout, host)
        if any(r.device != HOST for r in layout.regions):
            raise TransportError("the ucx transport moves host memory only")
        self.window = max(1, int(window))
        self.copies = HostEngine(layout.regions)
        self.memory = [np.frombuffer(host_buffer(r), dtype=np.uint8) for r in layout.regions]  # sent from directly
        self.bounces = _Bounces(max(0, int(bounce_keep)))
        ucx = ucxx()
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        self.worker.start_progress_thread()
        self.links: dict[int, UcxLink] = {}
        self.unattended: list[_Op] = []  # requests nobody waits for any more, kept until they end
        self.closed = False
        self._lock = threading.Lock()
        # our threads post requests one at a time (cheap next to a message), leaving ucxx one caller beside its
        # progress thread; the same lock guards ``unattended``
        self.calls = threading.Lock()

    def local_meta(self) -> bytes:
        return self.worker.address.tobytes()

    def connect(self, peer: Peer) -> UcxLink:
        lid = _link_id(peer)
        with self._lock:
            if self.closed:
                raise PeerError("UCX transport closed")
            if any(x.lid == lid for x in self.links.values()):
                raise TransportError("UCX link id collides with a live link; retry the handshake")
            try:
                ucx = ucxx()
                address = ucx.UCXAddress.create_from_buffer(peer.meta)
                ep = ucx.UCXEndpoint.create_from_worker_address(self.worker, address, True)
            except Exception as e:
                raise TransportError(f"opening a UCX endpoint to the peer: {e}") from None
            link = self.links[peer.local] = UcxLink(self, peer, ep, lid)
        link.start()
        return link

    def disconnect(self, session: int) -> None:
        with self._lock:
            link = self.links.pop(session, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        """Close every link, then cancel what is still posted on the worker."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.close()
        with contextlib.suppress(Exception):
            self.worker.stop_progress_thread()
        with contextlib.suppress(Exception):
            self.worker.cancel_inflight_requests(period=CLOSE_WAIT_NS, max_attempts=CLOSE_ATTEMPTS)
        # a request UCX has not reported ended may still be filled (a peer's rendezvous write): its buffer lives
        # as long as this transport, and with it its worker
        with self.calls:
            self.unattended = [op for op in self.unattended if not op.req.completed]

    # ---- the stream: gather into and scatter from a bounce buffer (the staging engine's host copies) ------
    def gather(self, ext: Extents, out: np.ndarray) -> None:
        self.copies.gather(ext, Slot(out.data, ext.total))

    def scatter(self, ext: Extents, data: np.ndarray) -> None:
        self.copies.scatter(Slot(data.data, len(data)), ext)

    def windows(self, total: int) -> list[tuple[int, int]]:
        return [(o, min(self.window, total - o)) for o in range(0, total, self.window)]


class UcxLink(Link[UcxTransport]):
    def __init__(self, transport: UcxTransport, peer: Peer, ep, lid: int):
        self.t = transport
        self.peer = peer
        self.ep = ep
        self.lid = lid
        self.closed = False
        # the producer numbers pushes odd, the consumer pulls even: both land data on the consumer's worker, so a
        # push and a pull of one session never share a tag
        self._seq = itertools.count(1 if peer.is_producer else 2, 2)

    def _tag(self, seq: int, kind: int) -> Any:
        return ucxx().UCXXTag((self.lid << 32) | ((seq & 0xFFFFFF) << 8) | kind)

    def start(self) -> None:
        """Serve the peer's headers: push headers on a consumer, pull headers on a producer."""
        threading.Thread(target=self._serve, daemon=True, name="kvxfer-ucx-serve").start()

    def _extents(self, ids: np.ndarray, part=None, chunks: int | None = None) -> Extents:
        return self.paging(part).side(self.peer.is_producer, ids, chunks, self.t.layout.num_blocks)

    def descriptors(self, src_ids, dst_ids, chunks=None) -> int:
        return len(self._extents(src_ids if self.peer.is_producer else dst_ids, chunks=chunks))

    # ---- waiting on UCX requests -------------------------------------------------------------------------
    def _live(self) -> None:
        if self.closed or self.t.closed:
            raise PeerError("link closed")
        if not self.ep.alive:
            raise PeerError("UCX endpoint to the peer failed (peer gone)")

    def _wait(self, ops: list[_Op], check) -> None:
        """Block until every request completed; ``check`` raises to stop waiting (deadline, cancel, closed).
        Requests still running when it raises are left to ``unattended``, with their buffers."""
        try:
            self._wait_all(ops, check)
        except BaseException:
            self._leave(ops)
            raise

    def _wait_all(self, ops: list[_Op], check) -> None:
        pause = 0.00002
        for r, _ in ops:
            while not r.completed:
                check()
                time.sleep(pause)
                pause = min(pause * 2, 0.001)
            try:
                r.check_error()
            except Exception as e:
                if not self.ep.alive:
                    raise PeerError(f"UCX peer gone: {e}") from None
                raise TransportError(f"UCX request failed: {type(e).__name__}: {e}") from None

    def _send(self, data: np.ndarray, tag) -> _Op:
        with self.t.calls:  # checked and posted under the lock ``close`` takes: never onto a closed endpoint
            self._live()
            return _Op(self.ep.tag_send(_array(data), tag), data)

    def _post(self, buf: np.ndarray, tag) -> _Op:
        with self.t.calls:
            self._live()
            return _Op(self.ep.tag_recv(_array(buf), tag), buf)

    def _leave(self, ops: list[_Op]) -> None:
        """Keep the buffers of requests still running alive until they end (or the transport closes)."""
        with self.t.calls:
            self.t.unattended = [op for op in self.t.unattended + ops if not op.req.completed]

    def _reply(self, seq: int, kind: int, reply: Reply) -> None:
        with contextlib.suppress(KVXferError):
            self._leave([self._send(_frame(reply), self._tag(seq, kind))])

    def _refusal(self, seq: int, kind: int, e: KVXferError) -> None:
        self._reply(seq, kind, Reply(ok=False, code=e.code, message=str(e)))

    def _await_reply(self, seq: int, kind: int, check) -> Reply:
        op = self._post(np.empty(REPLY_MAX, dtype=np.uint8), self._tag(seq, kind))
        self._wait([op], check)
        reply = _unframe(op.buf, _REPLY)
        if not reply.ok:
            raise from_code(reply.code, reply.message)
        return reply

    def _checker(self, deadline: float, cancel: threading.Event):
        def check() -> None:
            if cancel.is_set():
                raise CancelledError("transfer cancelled")
            self._live()
            if time.monotonic() >= deadline:
                raise DeadlineError("UCX transfer still in progress at the deadline")

        return check

    def _send_stream(self, ext: Extents, seq: int, check) -> None:
        """Send ``ext`` a window at a time: a window that is one contiguous piece of a region straight from the
        blocks, any other gathered into a bounce buffer first, each send posted once its window is ready (the
        next window's copy overlaps it); the buffer goes back once every send ended well."""
        tag, ops = self._tag(seq, DATA), []
        whole = None
        try:
            for o, w in zip(range(0, ext.total, self.t.window), ext.split(self.t.window), strict=True):
                if len(w) == 1:
                    start = int(w.offset[0])
                    data = self.t.memory[int(w.region[0])][start : start + w.total]
                else:
                    whole = self.t.bounces.take(ext.total) if whole is None else whole
                    data = whole[o : o + w.total]
                    self.t.gather(w, data)
                ops.append(self._send(data, tag))
        except BaseException:
            self._leave(ops)
            raise
        self._wait(ops, check)
        if whole is not None:
            self.t.bounces.give(whole)

    def _recv_stream(self, ext: Extents, seq: int, check) -> None:
        """Receive the stream into a bounce buffer, scattering each window into ``ext`` once it arrived."""
        whole = self.t.bounces.take(ext.total)
        buf = whole[: ext.total]
        tag = self._tag(seq, DATA)
        spans, ops = self.t.windows(ext.total), []
        try:
            for o, n in spans:
                ops.append(self._post(buf[o : o + n], tag))
            for (o, n), op in zip(spans, ops, strict=True):
                self._wait_all([op], check)
                self.t.scatter(ext.window(o, n), op.buf)
        except BaseException:
            self._leave(ops)
            raise
        self.t.bounces.give(whole)

    # ---- push: producer side -----------------------------------------------------------------------------
    def _ask(self, req: str, gen: int, ids, total: int, deadline: float, check) -> int:
        """Send a transfer's header and wait for the serving side's READY; the transfer's sequence number."""
        seq = next(self._seq)
        head = Header(seq, req, gen, wire.ids_to_bytes(ids), total, deadline - time.monotonic())
        self._wait([self._send(_frame(head), self._tag(0, HEADER))], check)
        self._await_reply(seq, READY, check)
        return seq

    def write(self, req, gen, src_ids, dst_ids, deadline, cancel, part=None, chunks=None) -> int:
        ext = self._extents(src_ids, part, chunks)
        check = self._checker(deadline, cancel)
        seq = self._ask(req, gen, dst_ids, ext.total, deadline, check)
        self._send_stream(ext, seq, check)
        self._await_reply(seq, DONE, check)
        return ext.total

    # ---- push and pull: the serving side -----------------------------------------------------------------
    def _serve(self) -> None:
        """Receive headers one at a time and handle each on its own thread, so a slow transfer holds no other."""
        buf = np.empty(HEADER_MAX, dtype=np.uint8)
        while True:
            try:
                self._wait([self._post(buf, self._tag(0, HEADER))], self._live)
                head = _unframe(buf, _HEADER)
            except KVXferError:
                return
            handle = self._serve_pull if self.peer.is_producer else self._serve_push
            threading.Thread(target=handle, args=(head,), daemon=True, name="kvxfer-ucx-move").start()

    def _begin(self, head: Header, begin) -> tuple[np.ndarray, Any] | None:
        """The header's block ids and the host's ticket for them (``begin``: its begin_write / begin_read);
        None once a refusal answered the header."""
        try:
            ids = wire.ids_from_bytes(head.ids, self.t.layout.num_blocks)
            return ids, begin(self.peer.local, head.req, head.gen, ids)
        except KVXferError as e:
            self._refusal(head.seq, READY, e)
            return None

    def _serve_push(self, head: Header) -> None:
        host = cast(WriteHost, self.t.host)
        if (begun := self._begin(head, functools.partial(host.begin_write, window=(0, head.total)))) is None:
            return
        ids, ticket = begun
        answer = READY  # which reply the producer waits for: a failure before the stream answers the header
        try:
            ext = self._extents(ids, getattr(ticket, "selection", None), getattr(ticket, "chunks", None))
            if ext.total != head.total:
                raise ProtocolError(f"the grant holds {ext.total} bytes, the producer sends {head.total}")
            self._reply(head.seq, READY, Reply(ok=True))
            answer = DONE

            def check() -> None:
                if ticket.error is not None:
                    raise ticket.error
                self._live()

            self._recv_stream(ext, head.seq, check)
        except KVXferError as e:
            host.end_write(ticket, 0, e)
            self._refusal(head.seq, answer, e)
            return
        host.end_write(ticket, ext.total, None)
        self._reply(head.seq, DONE, Reply(ok=True))

    def _serve_pull(self, head: Header) -> None:
        host = cast(ReadHost, self.t.host)
        if (begun := self._begin(head, host.begin_read)) is None:
            return
        ids, ticket = begun
        try:
            ext = self._extents(ids, chunks=getattr(ticket, "chunks", None))
            if ext.total != head.total:
                raise ProtocolError(f"the offer holds {ext.total} bytes, the consumer asks for {head.total}")
        except KVXferError as e:
            host.end_read(ticket, 0, e)
            self._refusal(head.seq, READY, e)
            return
        self._reply(head.seq, READY, Reply(ok=True))
        until = time.monotonic() + max(0.0, head.timeout)

        def check() -> None:
            self._live()
            if ticket.error is not None:  # the lease ended (released, expired, cancelled): no more bytes of it
                raise ticket.error
            if time.monotonic() >= until:
                raise DeadlineError("the consumer stopped reading")

        try:
            self._send_stream(ext, head.seq, check)
        except KVXferError as e:
            host.end_read(ticket, 0, e)
            return
        host.end_read(ticket, ext.total, None)

    # ---- pull: consumer side -----------------------------------------------------------------------------
    def read(self, req, gen, src_ids, dst_ids, deadline, cancel, chunks=None) -> int:
        ext = self._extents(dst_ids, chunks=chunks)
        check = self._checker(deadline, cancel)
        seq = self._ask(req, gen, src_ids, ext.total, deadline, check)
        self._recv_stream(ext, seq, check)
        return ext.total

    def close(self) -> None:
        """Close the endpoint, blocking. Not ``ep.close()``: on an endpoint that already failed with its peer it
        wraps a null request and crashes (SIGSEGV), and checking ``ep.alive`` first races UCX's error callback
        (CI lost a run to it); ``close_blocking`` does nothing on a failed or closed endpoint and cancels what is
        still posted on a live one, bounded by ``CLOSE_WAIT_NS``. A closed ucxx endpoint has no UCP handle, and a
        request posted on it dereferences that (SIGSEGV): the link is marked closed under the lock every post
        holds, so no post runs from there on, and the close itself needs no lock."""
        with self.t.calls:
            if self.closed:
                return
            self.closed = True
        with contextlib.suppress(Exception):
            self.ep.close_blocking(CLOSE_WAIT_NS, CLOSE_ATTEMPTS)
