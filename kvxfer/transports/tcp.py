"""TCP transport: the fallback for hardware without RDMA, and the reference for every other transport.

Data connections are opened by the producer to the consumer's one listening port (after the control
handshake, each naming its session). *push* connections carry ``WriteData`` + raw bytes, received by the
consumer straight into the granted blocks (``recvmsg_into``) after checking them against its ledger; *pull*
connections carry ``ReadData`` requests from the consumer, answered by the producer from the offered blocks
(``sendmsg``). The bytes of a transfer form one stream in plan order, split into ``streams`` windows that
move in parallel on separate connections. No byte is copied through a Python object.
"""

from __future__ import annotations

import itertools
import queue
import select
import socket
import threading
import time

import numpy as np

from .. import wire
from ..channel import Channel, connect, recv_views, remaining, send_views
from ..handshake import data_hello
from ..errors import (CancelledError, KVXferError, PeerError, ProtocolError, TimeoutError, TransportError,
                      from_code)
from ..memory import HOST, host_buffer
from ..plan import Extents, extents
from .base import Link, Peer, Transport

POLL = 0.25  # how often a wait for a reply looks at cancel / deadline
WATCH = 0.05  # how often the watchdog looks at the transfers moving on blocking sockets


class _Watchdog:
    """Stops transfers that must stop while their socket is blocked in ``sendmsg`` / ``recvmsg_into``.

    Data moves on blocking sockets: a socket timeout would make Python poll before every call and split the
    copy into many short non-blocking calls (measured: about 9% of loopback goodput). Cancel, deadlines and
    failed grants are enforced from this one thread instead, by shutting the socket down under the mover.
    """

    def __init__(self):
        self._items: dict[int, tuple[socket.socket, object]] = {}
        self._why: dict[int, BaseException] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, check) -> int:
        with self._lock:
            token = next(self._ids)
            self._items[token] = (sock, check)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="kvxfer-tcp-watchdog")
                self._thread.start()
        return token

    def unwatch(self, token: int) -> BaseException | None:
        """Stop watching; the reason the watchdog shut the socket down, if it did."""
        with self._lock:
            self._items.pop(token, None)
            return self._why.pop(token, None)

    def _loop(self) -> None:
        while not self._stop.wait(WATCH):
            with self._lock:
                items = list(self._items.items())
            for token, (sock, check) in items:
                try:
                    check()
                except BaseException as e:  # noqa: BLE001 - any reason to stop is recorded for the mover
                    with self._lock:
                        if self._items.pop(token, None) is None:
                            continue
                        self._why[token] = e
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def guarded(self, sock: socket.socket, check, move) -> None:
        """Run ``move()`` on ``sock`` in blocking mode, stopped early (with ``check``'s error) if it must."""
        token = self.watch(sock, check)
        sock.settimeout(None)
        try:
            move()
        except (OSError, KVXferError):
            why, token = self.unwatch(token), None
            if why is not None:
                raise why from None
            raise
        finally:
            if token is not None:
                why = self.unwatch(token)
                if why is not None:  # fired as the move ended: the socket is shut, the caller drops it
                    raise why

    def close(self) -> None:
        self._stop.set()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, layout, host, *, auth: str = "", streams: int = 1, window_min: int = 8 << 20, **_):
        super().__init__(layout, host, auth=auth)
        if any(r.device != HOST for r in layout.regions):
            raise TransportError("the tcp transport moves host memory only; use nixl for device memory")
        self.streams = max(1, int(streams))
        self.window_min = window_min
        self.bufs = [host_buffer(r) for r in layout.regions]
        self.links: dict[int, TcpLink] = {}
        self.watchdog = _Watchdog()
        self._lock = threading.Lock()

    def views(self, ext: Extents) -> list[memoryview]:
        bufs = self.bufs
        return [bufs[r][o:o + n] for r, o, n in zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist())]

    def connect(self, peer: Peer) -> "TcpLink":
        link = TcpLink(self, peer)
        with self._lock:
            self.links[peer.session] = link
        if peer.is_producer:
            for _ in range(self.streams):
                link.open_pull()
        return link

    def accept_data(self, sock: socket.socket, hello: wire.DataHello) -> None:
        with self._lock:
            link = self.links.get(hello.session)
        if link is None or link.closed:
            sock.close()
            return
        ch = Channel(sock)
        if hello.purpose == "pull":
            link.pull_pool.put(ch)
        else:
            link.spawn(link.serve_writes, ch)

    def disconnect(self, session: int) -> None:
        with self._lock:
            link = self.links.pop(session, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        with self._lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.close()
        self.watchdog.close()


def _drain(sock: socket.socket, n: int, limit: int = 1 << 30) -> None:
    """Read and drop ``n`` bytes of a refused write so the connection stays in step (bounded by ``limit``)."""
    if n > limit:
        raise ProtocolError(f"refusing to drain {n} bytes")
    sock.settimeout(5.0)
    scratch = bytearray(min(n, 1 << 20))
    while n > 0:
        k = sock.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise PeerError("connection closed by peer")
        n -= k


def _window(ext: Extents, offset: int, length: int) -> Extents:
    """The extents of stream bytes ``[offset, offset + length)``, which a peer named: checked first."""
    if offset < 0 or length <= 0 or offset + length > ext.total:
        raise ProtocolError(f"window [{offset}, +{length}) outside {ext.total} bytes")
    return ext.window(offset, length)


def _wait_readable(sock: socket.socket, check) -> None:
    poller = select.poll()  # not select.select: it fails for descriptors >= FD_SETSIZE (1024) in busy processes
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    while not poller.poll(POLL * 1000):
        check()


class TcpLink(Link):
    def __init__(self, transport: TcpTransport, peer: Peer):
        self.t = transport
        self.peer = peer
        self.push_pool: queue.Queue[Channel] = queue.Queue()
        self.pull_pool: queue.Queue[Channel] = queue.Queue()
        self.open_push = 0
        self.closed = False
        self._chans: set[Channel] = set()
        self._lock = threading.Lock()
        side = peer.pairing.a if peer.is_producer else peer.pairing.b
        self._side, self._nbytes = side, peer.pairing.nbytes

    # ---- plumbing ----------------------------------------------------------------------------------------
    def spawn(self, fn, *args) -> None:
        threading.Thread(target=fn, args=args, daemon=True, name=f"kvxfer-tcp-{fn.__name__}").start()

    def _track(self, ch: Channel) -> Channel:
        with self._lock:
            if self.closed:
                ch.close()
                raise PeerError("link closed")
            self._chans.add(ch)
        return ch

    def _drop(self, ch: Channel) -> None:
        with self._lock:
            self._chans.discard(ch)
        ch.close()

    def _dial(self, purpose: str, timeout: float) -> Channel:
        ch = Channel(connect(self.peer.address, timeout))
        ch.send(data_hello(self.peer.session, purpose, self.peer.key))
        return self._track(ch)

    def open_pull(self) -> None:
        """Producer: give the consumer one more connection to read offered blocks through."""
        try:
            ch = self._dial("pull", 5.0)
        except KVXferError:
            return
        self.spawn(self.serve_reads, ch)

    def _extents(self, ids: np.ndarray, layers=None) -> Extents:
        if layers is not None:
            p = self.pairing(layers)
            return extents(p.a if self.peer.is_producer else p.b, p.nbytes, ids, self.t.layout.num_blocks)
        return extents(self._side, self._nbytes, ids, self.t.layout.num_blocks)

    @staticmethod
    def _windows(total: int, k: int) -> list[tuple[int, int]]:
        cuts = np.linspace(0, total, k + 1).astype(np.int64).tolist()
        return [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]

    def _parallel(self, fn, windows) -> int:
        errors: list[BaseException] = []

        def run(w):
            try:
                fn(*w)
            except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in windows[1:]]
        for th in threads:
            th.start()
        run(windows[0])
        for th in threads:
            th.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, PeerError)), errors[0])
        return sum(n for _, n in windows)

    def _checker(self, deadline: float, cancel: threading.Event):
        def check():
            if cancel.is_set():
                raise CancelledError("transfer cancelled")
            if self.closed:
                raise PeerError("link closed")
            remaining(deadline)
        return check

    def descriptors(self, src_ids, dst_ids) -> int:
        return len(self._extents(src_ids if self.peer.is_producer else dst_ids))

    # ---- push: producer side -------------------------------------------------------------------------------
    def _checkout_push(self, check) -> Channel:
        while True:
            try:
                return self.push_pool.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                dial = self.open_push < self.t.streams
                if dial:
                    self.open_push += 1
            if dial:
                try:
                    return self._dial("push", 5.0)
                except BaseException:
                    with self._lock:
                        self.open_push -= 1
                    raise
            check()
            try:
                return self.push_pool.get(timeout=POLL)
            except queue.Empty:
                continue

    def write(self, req, gen, src_ids, dst_ids, deadline, cancel, layers=None) -> int:
        ext = self._extents(src_ids, layers)
        ids = wire.ids_to_bytes(dst_ids)
        check = self._checker(deadline, cancel)
        k = min(self.t.streams, max(1, ext.total // self.t.window_min))

        def one(offset: int, length: int) -> None:
            ch = self._checkout_push(check)
            try:
                ch.send(wire.WriteData(req=req, gen=gen, ids=ids, offset=offset, length=length))
                views = self.t.views(ext.window(offset, length))
                self.t.watchdog.guarded(ch.sock, check, lambda: send_views(ch.sock, views))
                _wait_readable(ch.sock, check)
                reply = ch.recv(remaining(deadline))
            except BaseException:
                with self._lock:
                    self.open_push -= 1
                self._drop(ch)
                raise
            if not isinstance(reply, wire.DataReply) or not reply.ok:
                with self._lock:
                    self.open_push -= 1
                self._drop(ch)
                if isinstance(reply, wire.DataReply):
                    raise from_code(reply.code, reply.message)
                raise ProtocolError(f"unexpected {type(reply).__name__} on a data connection")
            self.push_pool.put(ch)

        return self._parallel(one, self._windows(ext.total, k))

    # ---- push: consumer side -------------------------------------------------------------------------------
    def serve_writes(self, ch: Channel) -> None:
        """Receive ``WriteData`` windows into granted blocks until the connection ends."""
        host, sock = self.t.host, ch.sock
        try:
            self._track(ch)
            while not self.closed:
                sock.settimeout(None)
                msg = ch.recv()
                if not isinstance(msg, wire.WriteData):
                    raise ProtocolError(f"unexpected {type(msg).__name__} on a push connection")
                try:
                    ids = wire.ids_from_bytes(msg.ids, self.t.layout.num_blocks)
                    ticket = host.begin_write(self.peer.session, msg.req, msg.gen, ids)
                except KVXferError as e:
                    _drain(sock, msg.length)  # the refused bytes never touch registered memory
                    ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                    continue
                try:
                    # the grant decides the bytes
                    window = _window(self._extents(ids, getattr(ticket, "layers", None)), msg.offset, msg.length)

                    def check():
                        if ticket.error is not None:
                            raise ticket.error
                        if self.closed:
                            raise PeerError("link closed")

                    views = self.t.views(window)
                    self.t.watchdog.guarded(sock, check, lambda: recv_views(sock, views))
                except BaseException as e:
                    host.end_write(ticket, 0, e)
                    if isinstance(e, KVXferError) and not isinstance(e, PeerError):
                        try:
                            ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                        except KVXferError:
                            pass
                    return
                host.end_write(ticket, msg.length, None)
                ch.send(wire.DataReply(req=msg.req, ok=True, length=msg.length))
        except (KVXferError, OSError):
            pass
        finally:
            self._drop(ch)

    # ---- pull: consumer side -------------------------------------------------------------------------------
    def read(self, req, gen, src_ids, dst_ids, deadline, cancel) -> int:
        ext = self._extents(dst_ids)
        ids = wire.ids_to_bytes(src_ids)
        check = self._checker(deadline, cancel)
        k = min(self.t.streams, max(1, ext.total // self.t.window_min))

        def one(offset: int, length: int) -> None:
            while True:
                try:
                    ch = self.pull_pool.get(timeout=POLL)
                    break
                except queue.Empty:
                    check()
            try:
                ch.send(wire.ReadData(req=req, gen=gen, ids=ids, offset=offset, length=length))
                _wait_readable(ch.sock, check)
                reply = ch.recv(remaining(deadline))
                if not isinstance(reply, wire.DataReply):
                    raise ProtocolError(f"unexpected {type(reply).__name__} on a pull connection")
                if not reply.ok:
                    self.pull_pool.put(ch)
                    ch = None
                    raise from_code(reply.code, reply.message)
                if reply.length != length:
                    raise ProtocolError(f"asked for {length} bytes, peer sends {reply.length}")
                views = self.t.views(ext.window(offset, length))
                self.t.watchdog.guarded(ch.sock, check, lambda: recv_views(ch.sock, views))
            except BaseException:
                if ch is not None:
                    self._drop(ch)
                raise
            self.pull_pool.put(ch)

        return self._parallel(one, self._windows(ext.total, k))

    # ---- pull: producer side -------------------------------------------------------------------------------
    def serve_reads(self, ch: Channel) -> None:
        """Answer ``ReadData`` requests from offered blocks; reopen a connection that broke."""
        host, sock = self.t.host, ch.sock
        try:
            while not self.closed:
                sock.settimeout(None)
                msg = ch.recv()
                if not isinstance(msg, wire.ReadData):
                    raise ProtocolError(f"unexpected {type(msg).__name__} on a pull connection")
                try:
                    ids = wire.ids_from_bytes(msg.ids, self.t.layout.num_blocks)
                    ticket = host.begin_read(self.peer.session, msg.req, msg.gen, ids)
                    try:
                        window = _window(self._extents(ids), msg.offset, msg.length)
                    except KVXferError as e:
                        host.end_read(ticket, 0, e)
                        raise
                except KVXferError as e:
                    ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                    continue
                try:
                    ch.send(wire.DataReply(req=msg.req, ok=True, length=msg.length))

                    def check():
                        if self.closed:
                            raise PeerError("link closed")

                    views = self.t.views(window)
                    self.t.watchdog.guarded(sock, check, lambda: send_views(sock, views))
                except BaseException as e:
                    host.end_read(ticket, 0, e)
                    raise
                host.end_read(ticket, msg.length, None)
        except (KVXferError, OSError):
            pass
        finally:
            self._drop(ch)
            if not self.closed:
                time.sleep(0.05)
                self.open_pull()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            chans, self._chans = list(self._chans), set()
        for ch in chans:
            ch.close()
        for pool in (self.push_pool, self.pull_pool):
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break
