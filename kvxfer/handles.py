"""Producer / Consumer / Transfer: what a vLLM connector and a decode runtime hold.

The producer (prefill side) *pushes* a request's blocks into blocks the consumer grants, or *offers* them
under a lease for the consumer to *pull*. The consumer (decode side) listens on one address, admits or
rejects, receives into its own paged cache, and hands each arrived request to the runtime as an ``Arrival``.
Every transfer ends -- done, failed, cancelled or timed out -- and releases what it held on both sides.
"""

from __future__ import annotations

import enum
import hmac
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import transports, wire
from .digest import block_digests, mismatches
from .admission import Grants, Leases, Part, Slot
from .allocator import Allocator, FreeList
from .channel import Channel, connect, parse_address
from .errors import (AuthError, BlockError, BusyError, CancelledError, ClosedError, IncompatibleError,
                     IntegrityError, KVXferError, LayoutError, LeaseExpiredError, PeerError, ProtocolError, StaleError,
                     TimeoutError, from_code)
from .layout import KVLayout, check_compatible
from .plan import check_ids, pair
from .transports.base import Peer

log = logging.getLogger("kvxfer")

REAP_INTERVAL = 0.02
_attempts = itertools.count(1)  # every push is an attempt of its own: answers name it


class Status(str, enum.Enum):
    PENDING = "pending"        # waiting for admission (push) or for the consumer to read (pull)
    MOVING = "moving"          # bytes in flight
    COMMITTING = "committing"  # bytes moved, waiting for the other side to confirm
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Transfer:
    """One request's KV crossing, as the producer sees it. ``wait`` always returns or raises in time."""

    def __init__(self, req: str, kind: str, address: str, src_ids: np.ndarray, block_bytes: int,
                 deadline: float):
        self.req = req
        self.kind = kind
        self.address = address
        self.src_ids = src_ids
        self.dst_ids: np.ndarray | None = None
        self.gen = 0
        self.deadline = deadline
        self.status = Status.PENDING
        self.error: KVXferError | None = None
        self.nbytes = len(src_ids) * block_bytes
        self._descriptors: int | Callable[[], int] = 0
        self.attempt = next(_attempts)
        self.meta: dict[str, Any] = {}
        self.override: np.ndarray | None = None
        self.layers: list[int] | None = None   # one part of a multi-sender push: only these layers
        self.digests = b""
        self.timings: dict[str, float] = {"submitted": time.monotonic()}
        self.cancel_event = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._on_cancel: Callable[[Transfer, str], None] | None = None

    def __repr__(self) -> str:
        return f"<Transfer {self.kind} {self.req!r} -> {self.address} {self.status.value}>"

    def done(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until the transfer ended; raise its error, or ``TimeoutError`` if ``timeout`` passes first."""
        limit = max(0.0, self.deadline - time.monotonic()) + 1.0
        if not self._ended.wait(limit if timeout is None else min(timeout, limit)):
            raise TimeoutError(f"transfer {self.req!r} still {self.status.value} after waiting")
        if self.error is not None:
            raise self.error
        return self

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Stop the transfer; the other side is told and both release what they hold."""
        if self._finish(CancelledError(reason), Status.CANCELLED):
            if self._on_cancel is not None:
                self._on_cancel(self, reason)
            return True
        return False

    @property
    def descriptors(self) -> int:
        """Descriptors the transfer cost after coalescing (planned again on first access, off the hot path)."""
        if callable(self._descriptors):
            self._descriptors = self._descriptors()
        return self._descriptors

    @property
    def seconds(self) -> float:
        end = self.timings.get("completed", time.monotonic())
        return end - self.timings["submitted"]

    @property
    def gbps(self) -> float:
        start = self.timings.get("admitted", self.timings["submitted"])
        end = self.timings.get("moved")
        return self.nbytes / (end - start) / 1e9 if end and end > start else 0.0

    def _mark(self, status: Status, stamp: str) -> None:
        with self._lock:
            if not self._ended.is_set():
                self.status = status
                self.timings[stamp] = time.monotonic()

    def _finish(self, error: KVXferError | None, status: Status | None = None) -> bool:
        with self._lock:
            if self._ended.is_set():
                return False
            self.error = error
            self.status = status or (Status.DONE if error is None else Status.FAILED)
            self.timings["completed"] = time.monotonic()
            if error is not None:
                self.cancel_event.set()
            self._ended.set()
            return True


@dataclass
class Arrival:
    """A request whose KV landed in the consumer's blocks: hand it to the decode runtime, ``release`` it after."""

    req: str
    block_ids: np.ndarray
    meta: dict[str, Any]
    nbytes: int
    gen: int
    peer: str
    kind: str
    digests: bytes = b""
    timings: dict[str, float] = field(default_factory=dict)


def _make_transport(name: str, layout: KVLayout, host, auth: str, options: dict):
    name = transports.resolve(name)
    return transports.get(name)(layout, host, auth=auth, **options)


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class _Endpoint:
    """What both handles share: a transport, a reaper thread, a worker pool and closing."""

    def __init__(self, layout: KVLayout, transport: str, auth: str, transport_options: dict | None,
                 peer_id: str | None, workers: int):
        self.layout = layout
        self.auth = auth
        self.peer_id = peer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.transport = _make_transport(transport, layout, self, auth, dict(transport_options or {}))
        self.transport_name = self.transport.name
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvxfer-worker")
        self.closed = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="kvxfer-reaper")

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL):
            try:
                self._reap(time.monotonic())
            except Exception:  # noqa: BLE001 - the reaper must survive anything to keep deadlines
                log.exception("kvxfer reaper")

    def _reap(self, now: float) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("handle is closed")

    def _close_common(self) -> None:
        self.closed = True
        self._stop.set()
        self.transport.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


# ==========================================================================================================
# Producer
# ==========================================================================================================
class _ProducerSession:
    def __init__(self, owner: "Producer", address: str, ch: Channel, peer: Peer, link, remote_id: str):
        self.owner = owner
        self.address = address
        self.ch = ch
        self.peer = peer
        self.link = link
        self.remote_id = remote_id
        self.transfers: dict[str, Transfer] = {}
        self.alive = True
        self.thread = threading.Thread(target=self._read_loop, daemon=True, name=f"kvxfer-producer-{address}")

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
        except Exception as e:  # noqa: BLE001
            error = PeerError(f"consumer {self.address}: {e!r}")
        self.owner._session_lost(self, error)


class Producer(_Endpoint):
    """The prefill side: pushes blocks into a consumer's grant, or offers them for the consumer to pull.

    ``transport`` is ``"tcp"``, ``"nixl"`` or ``"auto"``; ``deadline`` (seconds) bounds every transfer that
    does not name its own; ``auth`` is a shared token the consumer must expect.
    """

    def __init__(self, layout: KVLayout, *, transport: str = "auto", auth: str = "", deadline: float = 30.0,
                 lease: float = 30.0, connect_timeout: float = 5.0, peer_id: str | None = None,
                 transport_options: dict | None = None, workers: int = 8, max_frame: int = wire.MAX_FRAME):
        super().__init__(layout, transport, auth, transport_options, peer_id, workers)
        self.deadline = deadline
        self.lease = lease
        self.connect_timeout = connect_timeout
        self.max_frame = max_frame
        self.leases = Leases()
        self._sessions: dict[str, _ProducerSession] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._reaper.start()

    # ---- sessions ---------------------------------------------------------------------------------------
    def _session(self, address: str, deadline: float) -> _ProducerSession:
        with self._lock:
            s = self._sessions.get(address)
            if s is not None and s.alive:
                return s
            gate = self._connecting.setdefault(address, threading.Lock())
        with gate:
            with self._lock:
                s = self._sessions.get(address)
                if s is not None and s.alive:
                    return s
            s = self._handshake(address, min(self.connect_timeout, max(0.05, deadline - time.monotonic())))
            with self._lock:
                self._check_open()
                self._sessions[address] = s
            s.thread.start()
            return s

    def _handshake(self, address: str, timeout: float) -> _ProducerSession:
        parse_address(address)
        ch = Channel(connect(address, timeout), self.max_frame)
        try:
            hello = wire.Hello(version=wire.VERSION, peer_id=self.peer_id, layout=self.layout.desc(),
                               transport=self.transport_name, transport_meta=self.transport.local_meta(),
                               auth=self.auth)
            reply = ch.request(hello, timeout)
            if isinstance(reply, wire.Error):
                raise from_code(reply.code, f"consumer {address} refused the handshake: {reply.message}")
            if not isinstance(reply, wire.Welcome):
                raise ProtocolError(f"expected welcome, got {type(reply).__name__}")
            if reply.version != wire.VERSION:
                raise IncompatibleError(f"protocol version {reply.version} != {wire.VERSION}")
            if reply.transport != self.transport_name:
                raise IncompatibleError(f"consumer uses transport {reply.transport!r}, we use {self.transport_name!r}")
            remote = KVLayout.from_desc(reply.layout)
            check_compatible(self.layout.fingerprint, remote.fingerprint)
            peer = Peer(reply.session, address, remote, pair(self.layout, remote), reply.transport_meta,
                        is_producer=True, auth=self.auth)
            ch.sock.settimeout(None)
            link = self.transport.connect(peer)
            return _ProducerSession(self, address, ch, peer, link, reply.peer_id)
        except BaseException:
            ch.close()
            raise

    def _session_lost(self, s: _ProducerSession, error: KVXferError) -> None:
        with self._lock:
            if not s.alive:
                return
            s.alive = False
            if self._sessions.get(s.address) is s:
                del self._sessions[s.address]
            pending = list(s.transfers.values())
            s.transfers.clear()
        for t in pending:
            self._end(t, error)
        s.ch.close()
        self.transport.disconnect(s.peer.session)

    # ---- submitting -------------------------------------------------------------------------------------
    def _start(self, kind: str, address: str, req: str, block_ids, deadline: float | None) -> Transfer:
        self._check_open()
        ids = check_ids(block_ids, self.layout.num_blocks, "source block ids")
        seconds = self.deadline if deadline is None else deadline
        t = Transfer(str(req), kind, address, ids, self.layout.block_bytes, _deadline(seconds))
        t._on_cancel = self._cancelled
        return t

    def _enroll(self, t: Transfer) -> _ProducerSession:
        s = self._session(t.address, t.deadline)
        with self._lock:
            if t.req in s.transfers:
                raise BlockError(f"request {t.req!r} is already in flight to {t.address}")
            s.transfers[t.req] = t
        return s

    def push(self, address: str, req: str, block_ids, *, meta: dict | None = None,
             deadline: float | None = None, digests: bool = False, dst_block_ids=None,
             layers=None, senders: int = 1, part: int = 0) -> Transfer:
        """Ask ``address`` to admit ``len(block_ids)`` blocks and write these blocks into its grant.

        Returns at once; the transfer goes on in the background. ``dst_block_ids`` (a test hook for the
        protocol's fencing) overrides the granted destination, which the consumer must refuse unless equal.
        ``digests`` sends a CRC per block for the consumer to check (host memory; for tests and debugging).

        Multi-sender (tensor-parallel prefill ranks): ``senders`` producers each push ``part`` of one request,
        carrying only ``layers`` (disjoint, together every layer) into the same granted blocks; the consumer
        hands the request off once every part is done.
        """
        t = self._start("push", address, req, block_ids, deadline)
        t.meta = dict(meta or {})
        if senders == 1 and layers is not None \
                and sorted(layers) != list(range(self.layout.fingerprint.num_layers)):
            raise BlockError("a subset of layers is one part of a multi-sender push: give senders and part")
        if senders > 1:
            if digests:
                raise BlockError("per-block digests cover whole blocks: not for a multi-sender push")
            n = self.layout.fingerprint.num_layers
            t.layers = sorted(int(x) for x in (range(n) if layers is None else layers))  # checked by the consumer
            t.nbytes = len(t.src_ids) * self.layout.fingerprint.layer_bytes * len(t.layers)
        t.digests = block_digests(self.layout, t.src_ids) if digests else b""
        t.override = None if dst_block_ids is None else np.asarray(dst_block_ids, dtype=np.int64)
        try:
            s = self._enroll(t)
            s.send(wire.Admit(req=t.req, num_blocks=len(t.src_ids), attempt=t.attempt,
                              deadline_ms=_ms(t.deadline - time.monotonic()), meta=t.meta,
                              **({"senders": senders, "part": part, "layers": t.layers} if senders > 1 else {})))
        except KVXferError as e:
            self._end(t, e)
        return t

    def offer(self, address: str, req: str, block_ids, *, meta: dict | None = None,
              lease: float | None = None, digests: bool = False) -> Transfer:
        """Offer blocks for ``address`` to pull; the transfer ends when the consumer released them (the
        producer may then free them) or when the lease runs out (``LeaseExpiredError``)."""
        seconds = self.lease if lease is None else lease
        t = self._start("pull", address, req, block_ids, seconds)
        try:
            s = self._enroll(t)
            with self._lock:
                item = self.leases.offer(s.peer.session, t.req, t.src_ids, seconds, time.monotonic())
                t.gen = item.gen
            s.send(wire.Offer(req=t.req, gen=t.gen, ids=wire.ids_to_bytes(t.src_ids), lease_ms=_ms(seconds),
                              meta=dict(meta or {}),
                              digests=block_digests(self.layout, t.src_ids) if digests else b""))
        except KVXferError as e:
            self._end(t, e)
        return t

    # ---- ending -----------------------------------------------------------------------------------------
    def _end(self, t: Transfer, error: KVXferError | None, status: Status | None = None) -> None:
        with self._lock:
            s = self._sessions.get(t.address)
            if s is not None and s.transfers.get(t.req) is t:
                del s.transfers[t.req]
            if t.kind == "pull":
                self.leases.drop(t.req, t.gen)
        if t._finish(error, status) and error is not None:
            log.debug("kvxfer %s %s failed: %s", t.kind, t.req, error)

    def _cancelled(self, t: Transfer, reason: str) -> None:
        with self._lock:
            s = self._sessions.get(t.address)
        self._end(t, t.error, Status.CANCELLED)
        if s is not None and s.alive:
            s.send(wire.Cancel(req=t.req, gen=t.gen, reason=reason))

    def _fail(self, s: _ProducerSession, t: Transfer, error: KVXferError, tell: bool = True) -> None:
        self._end(t, error)
        if tell and s.alive:
            s.send(wire.Cancel(req=t.req, gen=t.gen, reason=str(error)))

    def _reap(self, now: float) -> None:
        with self._lock:
            late = [(s, t) for s in self._sessions.values() for t in s.transfers.values() if t.deadline <= now]
        for s, t in late:
            err = LeaseExpiredError if t.kind == "pull" else TimeoutError
            self._fail(s, t, err(f"{t.kind} of {t.req!r} to {t.address} passed its deadline "
                                 f"while {t.status.value}"))

    # ---- control messages -------------------------------------------------------------------------------
    def _on_message(self, s: _ProducerSession, msg) -> None:
        req = getattr(msg, "req", "")
        with self._lock:
            t = s.transfers.get(req)
        if isinstance(msg, wire.Error) and not req:
            raise from_code(msg.code, msg.message)
        if t is None:
            return  # a late answer for a transfer that already ended
        if getattr(msg, "attempt", 0) and msg.attempt != t.attempt:
            return  # the answer to an earlier attempt of the same request id
        if isinstance(msg, wire.Grant) and t.kind == "push" and t.status is Status.PENDING:
            self._granted(s, t, msg)
        elif isinstance(msg, wire.Busy):
            self._end(t, BusyError(f"consumer {s.address} busy: {msg.reason}", msg.retry_after_ms / 1000))
        elif isinstance(msg, wire.Error):
            self._end(t, from_code(msg.code, f"consumer {s.address}: {msg.message}"))
        elif isinstance(msg, wire.Cancel):
            self._end(t, CancelledError(f"consumer {s.address} cancelled {req!r}: {msg.reason}"), Status.CANCELLED)
        elif isinstance(msg, wire.Ack) and msg.gen == t.gen and t.status is Status.COMMITTING:
            self._end(t, None)
        elif isinstance(msg, wire.Released) and t.kind == "pull":
            self._released(s, t, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} for {req!r} while {t.status.value}")

    def _granted(self, s: _ProducerSession, t: Transfer, msg: wire.Grant) -> None:
        t.gen = msg.gen
        try:
            t.dst_ids = wire.ids_from_bytes(msg.ids, s.peer.layout.num_blocks)
            if len(t.dst_ids) != len(t.src_ids):
                raise BlockError(f"consumer granted {len(t.dst_ids)} blocks for {len(t.src_ids)}")
        except KVXferError as e:
            return self._fail(s, t, e)
        t._mark(Status.MOVING, "admitted")
        try:
            self.pool.submit(self._move, s, t)
        except RuntimeError:
            self._fail(s, t, ClosedError("producer closed"))

    def _move(self, s: _ProducerSession, t: Transfer) -> None:
        if t.done():  # cancelled, superseded or timed out before its turn: not a byte moves
            return
        dst = t.dst_ids if t.override is None else t.override
        try:
            if self.transport.one_sided and not np.array_equal(dst, t.dst_ids):
                # RDMA gives the receiver no say over a remote write: the grant is enforced here
                raise BlockError(f"request {t.req!r} would write blocks it was not granted")
            if t.layers is None:
                t._descriptors = lambda: s.link.descriptors(t.src_ids, dst)
                moved = s.link.write(t.req, t.gen, t.src_ids, dst, t.deadline, t.cancel_event)
            else:
                moved = s.link.write(t.req, t.gen, t.src_ids, dst, t.deadline, t.cancel_event, layers=t.layers)
        except KVXferError as e:
            return self._fail(s, t, e)
        except Exception as e:  # noqa: BLE001
            return self._fail(s, t, PeerError(f"write failed: {e!r}"))
        if t.done():
            return
        t._mark(Status.COMMITTING, "moved")
        s.send(wire.Done(req=t.req, gen=t.gen, nbytes=moved, meta=t.meta, digests=t.digests))

    def _released(self, s: _ProducerSession, t: Transfer, msg: wire.Released) -> None:
        now = time.monotonic()
        with self._lock:
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

    # ---- transport host callbacks (pull reads over a stream transport) ----------------------------------
    def begin_read(self, session: int, req: str, gen: int, ids: np.ndarray):
        with self._lock:
            return self.leases.check_read(session, req, gen, ids, time.monotonic())

    def end_read(self, ticket, nbytes: int, error) -> None:
        pass

    def begin_write(self, *a):
        raise ProtocolError("a producer does not accept writes")

    def end_write(self, *a) -> None:
        pass

    def landed(self, *a) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            self._session_lost(s, ClosedError("producer closed"))
        self._close_common()


# ==========================================================================================================
# Consumer
# ==========================================================================================================
class _ConsumerSession:
    def __init__(self, sid: int, ch: Channel, remote_id: str):
        self.sid = sid
        self.ch = ch
        self.remote_id = remote_id
        self.link = None
        self.peer: Peer | None = None
        self.alive = True
        self.pulls: dict[str, tuple[Slot, int, threading.Event]] = {}

    def send(self, msg) -> bool:
        try:
            self.ch.send(msg)
            return True
        except KVXferError:
            return False


class Consumer(_Endpoint):
    """The decode side: listens on ``listen``, admits pushes into blocks its ``allocator`` grants, pulls
    offered blocks, and hands every arrived request to the runtime (``get`` / ``on_arrival``).

    Blocks of an arrived request belong to the runtime until it calls ``release(req)``. ``deadline`` caps
    every admitted request; ``max_inflight`` bounds admitted-but-unfinished requests (then ``Busy``).
    """

    def __init__(self, layout: KVLayout, *, transport: str = "auto", listen: str = "127.0.0.1:0",
                 allocator: Allocator | None = None, auth: str = "", deadline: float = 30.0,
                 max_inflight: int = 1024, tombstone_ttl: float = 30.0, retry_after: float = 0.05,
                 quarantine: float = 2.0, on_arrival: Callable[[Arrival], None] | None = None,
                 peer_id: str | None = None, transport_options: dict | None = None, workers: int = 8,
                 max_frame: int = wire.MAX_FRAME, handshake_timeout: float = 5.0, queue_arrivals: bool = True):
        super().__init__(layout, transport, auth, transport_options, peer_id, workers)
        self.queue_arrivals = queue_arrivals  # False: arrivals go to ``on_arrival`` only, never queue up
        self.allocator = allocator or FreeList(layout.num_blocks)
        self.grants = Grants(self.allocator, layout.block_bytes, max_inflight=max_inflight,
                             tombstone_ttl=tombstone_ttl, retry_after=retry_after,
                             quarantine=quarantine if self.transport.one_sided else 0.0,
                             num_layers=layout.fingerprint.num_layers)
        self.deadline = deadline
        self.max_frame = max_frame
        self.handshake_timeout = handshake_timeout
        self.on_arrival = on_arrival
        self.arrivals: queue.Queue[Arrival] = queue.Queue()
        self.counters = {"admitted": 0, "rejected": 0, "completed": 0, "failed": 0, "bytes": 0}
        self._sessions: dict[int, _ConsumerSession] = {}
        self._sids = itertools.count(1)
        host, port = parse_address(listen)
        self._listener = socket.create_server((host, port), backlog=128)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, daemon=True, name="kvxfer-accept").start()
        self._reaper.start()

    # ---- public -----------------------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Arrival:
        """The next arrived request; ``TimeoutError`` if none arrives within ``timeout``."""
        try:
            return self.arrivals.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no arrival within {timeout}s") from None

    def release(self, req: str) -> bool:
        """Give an arrived request's blocks back to the allocator (the runtime is done with them)."""
        with self._lock:
            return self.grants.release(req)

    def cancel(self, req: str, reason: str = "cancelled by consumer") -> bool:
        """Cancel an admitted push or a running pull; the producer is told, blocks are released."""
        with self._lock:
            slot = self.grants.active.get(req)
        if slot is None:
            return False
        self._fail_slot(slot, CancelledError(reason))
        self._tell_members(slot, lambda s, gen: wire.Cancel(req=req, gen=gen, reason=reason))
        return True

    def _tell_members(self, slot: Slot, make, skip: int | None = None) -> None:
        """Send ``make(session, gen)`` to every producer session writing ``slot`` (all parts)."""
        for sid, gen in slot.members():
            with self._lock:
                s = self._sessions.get(sid)
            if s is not None and sid != skip:
                s.send(make(s, self._remote_gen(s, slot) if slot.senders == 1 else gen))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters, inflight=len(self.grants.active), handed=len(self.grants.handed),
                        dying=len(self.grants.dying), sessions=len(self._sessions),
                        free_blocks=getattr(self.allocator, "num_free", -1))

    # ---- connections ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), daemon=True, name="kvxfer-session").start()

    def _serve(self, sock: socket.socket) -> None:
        ch = Channel(sock, self.max_frame)
        try:
            first = ch.recv(self.handshake_timeout)
        except KVXferError as e:
            _tell(ch, wire.Error(req="", code=e.code, message=str(e)))
            ch.close()
            return
        if isinstance(first, wire.DataHello):
            if not _auth_ok(first.auth, self.auth):
                return ch.close()
            sock.settimeout(None)
            return self.transport.accept_data(sock, first)
        s = None
        try:
            s = self._welcome(ch, first)
            sock.settimeout(None)
            while s.alive:
                self._on_message(s, ch.recv())
        except KVXferError as e:
            if not isinstance(e, PeerError):
                _tell(ch, wire.Error(req="", code=e.code, message=str(e)))
            error = e
        except Exception as e:  # noqa: BLE001 - a peer must never crash the consumer
            log.exception("kvxfer consumer session")
            error = PeerError(repr(e))
        else:
            error = PeerError("session closed")
        if s is not None:
            self._session_lost(s, error)
        ch.close()

    def _welcome(self, ch: Channel, hello) -> _ConsumerSession:
        if not isinstance(hello, wire.Hello):
            raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        if hello.version != wire.VERSION:
            raise IncompatibleError(f"protocol version {hello.version} != {wire.VERSION}")
        if not _auth_ok(hello.auth, self.auth):
            raise AuthError("bad auth token")
        if hello.transport != self.transport_name:
            raise IncompatibleError(f"producer uses transport {hello.transport!r}, consumer {self.transport_name!r}")
        try:
            remote = KVLayout.from_desc(hello.layout)
        except LayoutError as e:
            raise ProtocolError(f"bad layout in hello: {e}") from None
        check_compatible(self.layout.fingerprint, remote.fingerprint)
        s = _ConsumerSession(next(self._sids), ch, hello.peer_id)
        s.peer = Peer(s.sid, self.address, remote, pair(remote, self.layout), hello.transport_meta,
                      is_producer=False, auth=self.auth)
        s.link = self.transport.connect(s.peer)
        with self._lock:
            self._sessions[s.sid] = s
        ch.send(wire.Welcome(version=wire.VERSION, peer_id=self.peer_id, session=s.sid,
                             layout=self.layout.desc(), transport=self.transport_name,
                             transport_meta=self.transport.local_meta()))
        return s

    def _session_lost(self, s: _ConsumerSession, error: KVXferError) -> None:
        with self._lock:
            s.alive = False
            self._sessions.pop(s.sid, None)
            lost = self.grants.peer_lost(s.sid, PeerError(f"producer {s.remote_id} lost: {error}"),
                                         time.monotonic())
            self.counters["failed"] += len(lost)
            pulls = list(s.pulls.values())
        for _, _, ev in pulls:
            ev.set()
        self.transport.disconnect(s.sid)

    # ---- control messages -------------------------------------------------------------------------------
    def _on_message(self, s: _ConsumerSession, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, wire.Admit):
            return self._admit(s, msg, now)
        if isinstance(msg, wire.Offer):
            return self._offered(s, msg, now)
        if isinstance(msg, wire.Done):
            try:
                with self._lock:
                    slot = self.grants.done(s.sid, msg.req, msg.gen, msg.nbytes, msg.meta, msg.digests)
            except KVXferError as e:
                self._refuse(s, msg.req, msg.gen, e)
                return
            if slot is not None:
                self._deliver(slot, "push")
            return
        if isinstance(msg, wire.Cancel):
            with self._lock:
                slot = self.grants.active.get(msg.req)
                pull = s.pulls.get(msg.req)
            mine = [g for sid, g in slot.members() if sid == s.sid] if slot is not None else []
            # a pull's Cancel names the producer's lease; gen 0 a push whose grant the producer has not seen yet
            if mine and (pull is not None or msg.gen == 0 or msg.gen in mine):
                self._fail_slot(slot, CancelledError(f"producer cancelled: {msg.reason}"))
                if slot.senders > 1:
                    self._tell_members(slot, lambda _, gen: wire.Cancel(req=msg.req, gen=gen, reason=msg.reason),
                                       skip=s.sid)
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
        with self._lock:
            self.counters["rejected"] += 1
        if isinstance(e, BusyError):
            s.send(wire.Busy(req=req, retry_after_ms=_ms(e.retry_after), reason=str(e), attempt=attempt))
        else:
            self._refuse(s, req, gen, e, attempt)

    def _admit(self, s: _ConsumerSession, msg: wire.Admit, now: float) -> None:
        deadline = now + min(self.deadline, max(msg.deadline_ms, 1) / 1000)
        try:
            with self._lock:
                slot, superseded = self.grants.admit(s.sid, msg.req, msg.num_blocks, deadline, now,
                                                     senders=msg.senders, part=msg.part, layers=msg.layers)
                joined = slot.senders > 1 and len(slot.parts) > 1
                self.counters["admitted"] += not joined
                self.counters["failed"] += len(superseded)
        except KVXferError as e:
            return self._reject(s, msg.req, e, attempt=msg.attempt)
        for old in superseded:  # its writers learn now, before they move a byte (one-sided writes included)
            self._tell_members(old, lambda _, gen: wire.Error(req=old.req, gen=gen, code=StaleError.code,
                                                              message=f"request {old.req!r} superseded"),
                               skip=s.sid)  # on the same session the answer would name the new transfer
        if slot.senders > 1:
            gen = slot.parts[msg.part].gen
            slot.meta = {**slot.meta, **msg.meta} if msg.part == 0 else {**msg.meta, **slot.meta}  # part 0 wins
        else:
            gen = slot.gen
            slot.meta = dict(msg.meta)
        s.send(wire.Grant(req=msg.req, gen=gen, ids=wire.ids_to_bytes(slot.ids), attempt=msg.attempt))

    def _fail_slot(self, slot: Slot, error: KVXferError) -> None:
        with self._lock:
            if self.grants.fail(slot.req, error, time.monotonic(), one_sided=self.transport.one_sided):
                self.counters["failed"] += 1
            s = self._sessions.get(slot.peer)
            pull = s.pulls.get(slot.req) if s else None
        if pull is not None:
            pull[2].set()

    def _deliver(self, slot: Slot, kind: str) -> None:
        with self._lock:
            s = self._sessions.get(slot.peer)
        err = self._integrity(slot) if kind == "push" else None  # a pull is checked before its release
        if err is not None:
            with self._lock:
                if self.grants.handed.pop(slot.req, None) is slot:
                    self.allocator.free(slot.ids)
                self.counters["failed"] += 1
            if s is not None:
                s.send(wire.Error(req=slot.req, gen=self._remote_gen(s, slot), code=err.code, message=str(err)))
            return
        with self._lock:
            self.counters["completed"] += 1
            self.counters["bytes"] += slot.nbytes
        arrival = Arrival(slot.req, slot.ids, slot.meta, slot.nbytes, slot.gen,
                          s.remote_id if s else "", kind, slot.digests,
                          {"admitted": slot.admitted, "completed": time.monotonic()})
        if kind == "push":
            self._tell_members(slot, lambda _, gen: wire.Ack(req=slot.req, gen=gen))
        if self.on_arrival is not None:
            try:
                self.on_arrival(arrival)
            except Exception:  # noqa: BLE001 - the runtime's callback must not break the transport
                log.exception("kvxfer on_arrival callback for %s", slot.req)
        if self.queue_arrivals or self.on_arrival is None:
            self.arrivals.put(arrival)

    def _integrity(self, slot: Slot) -> IntegrityError | None:
        """The error to fail ``slot`` with if its blocks differ from the producer's digests (when it sent any)."""
        bad = mismatches(self.layout, slot.ids, slot.digests) if slot.digests else []
        if not bad:
            return None
        err = IntegrityError(f"request {slot.req!r}: {len(bad)} of {len(slot.ids)} blocks differ from the "
                             f"producer's digests (first at position {bad[0]})")
        log.error("kvxfer %s", err)
        return err

    def _remote_gen(self, s: _ConsumerSession, slot: Slot) -> int:
        pull = s.pulls.get(slot.req)
        return pull[1] if pull else slot.gen

    def _reap(self, now: float) -> None:
        with self._lock:
            late = self.grants.expired(now)
        for slot in late:
            missing = slot.senders - len(slot.parts) if slot.senders > 1 else 0
            err = TimeoutError(f"request {slot.req!r} passed its deadline"
                               + (f" ({missing} of {slot.senders} senders never came)" if missing else ""))
            self._fail_slot(slot, err)
            self._tell_members(slot, lambda _, gen: wire.Error(req=slot.req, gen=gen, code=err.code,
                                                               message=str(err)))
        with self._lock:
            self.grants.reap(now)

    # ---- pull -------------------------------------------------------------------------------------------
    def _offered(self, s: _ConsumerSession, msg: wire.Offer, now: float) -> None:
        try:
            src = wire.ids_from_bytes(msg.ids, s.peer.layout.num_blocks)
            check_ids(src, s.peer.layout.num_blocks, "offered block ids")
            deadline = now + min(self.deadline, max(msg.lease_ms, 1) / 1000)
            with self._lock:
                slot, _ = self.grants.admit(s.sid, msg.req, len(src), deadline, now)
                self.counters["admitted"] += 1
        except KVXferError as e:
            return self._reject(s, msg.req, e, gen=msg.gen)
        slot.meta, slot.digests = dict(msg.meta), msg.digests
        cancel = threading.Event()
        with self._lock:
            s.pulls[msg.req] = (slot, msg.gen, cancel)
        self.pool.submit(self._pull, s, slot, msg.gen, src, cancel)

    def _pull(self, s: _ConsumerSession, slot: Slot, gen: int, src: np.ndarray, cancel: threading.Event) -> None:
        try:
            moved = s.link.read(slot.req, gen, src, slot.ids, slot.deadline, cancel)
        except KVXferError as e:
            self._pull_failed(s, slot, gen, e)
            return
        except Exception as e:  # noqa: BLE001
            self._pull_failed(s, slot, gen, PeerError(f"read failed: {e!r}"))
            return
        err = self._integrity(slot)
        if err is not None:
            self._pull_failed(s, slot, gen, err)
            return
        slot.landed = moved
        if not s.send(wire.Released(req=slot.req, gen=gen, nbytes=moved)):
            self._pull_failed(s, slot, gen, PeerError("producer gone before release"))

    def _pull_failed(self, s: _ConsumerSession, slot: Slot, gen: int, error: KVXferError) -> None:
        with self._lock:
            s.pulls.pop(slot.req, None)
        self._fail_slot(slot, error)
        s.send(wire.Error(req=slot.req, gen=gen, code=error.code, message=str(error)))

    def _pull_answer(self, s: _ConsumerSession, msg) -> None:
        with self._lock:
            slot, gen, _ = s.pulls.pop(msg.req)
            live = self.grants.active.get(msg.req) is slot
        if not live or msg.gen != gen:
            return
        if isinstance(msg, wire.Error):
            self._fail_slot(slot, from_code(msg.code, f"producer: {msg.message}"))
            return
        with self._lock:
            ready = self.grants.confirm(slot)
        if ready is not None:
            self._deliver(ready, "pull")

    # ---- transport host callbacks ----------------------------------------------------------------------
    def begin_write(self, session: int, req: str, gen: int, ids: np.ndarray) -> Slot | Part:
        with self._lock:
            ticket = self.grants.check_write(session, req, gen, ids)
            self.grants.begin_receive(ticket.slot if isinstance(ticket, Part) else ticket)
            return ticket

    def end_write(self, ticket: Slot | Part, nbytes: int, error) -> None:
        part = ticket if isinstance(ticket, Part) else None
        slot = part.slot if part else ticket
        with self._lock:
            ready = self.grants.end_receive(slot, nbytes, time.monotonic(), part)
        if error is not None:
            err = error if isinstance(error, KVXferError) else PeerError(f"receive failed: {error!r}")
            self._fail_slot(slot, err)
            with self._lock:
                self.grants.reap(time.monotonic())
        elif ready is not None:
            self._deliver(ready, "push")

    def landed(self, session: int, req: str, gen: int, nbytes: int) -> None:
        try:
            with self._lock:
                ready = self.grants.landed(session, req, gen, nbytes)
        except KVXferError:
            return
        if ready is not None:
            self._deliver(ready, "push")

    def begin_read(self, *a):
        raise ProtocolError("a consumer does not serve reads")

    def end_read(self, *a) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.ch.close()
            self._session_lost(s, ClosedError("consumer closed"))
        self._close_common()


def _auth_ok(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _tell(ch: Channel, msg) -> None:
    try:
        ch.send(msg)
    except KVXferError:
        pass
