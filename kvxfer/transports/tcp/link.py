"""The four loops of a TCP link: push (producer writes, consumer receives) and pull (consumer reads, producer
serves), each a window of the transfer's byte stream on one data connection, straight from and into
registered memory."""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from ... import wire
from ...channel import Channel, remaining
from ...errors import CancelledError, KVXferError, PeerError, ProtocolError, from_code
from ...handshake import data_hello
from ...plan import Extents
from ...shard import Selection
from ...sockets import connect, mapped
from .. import parallel
from ..base import Link, Peer, ReadHost, WriteHost
from . import windows
from .pool import POLL, Connections

if TYPE_CHECKING:
    from . import TcpTransport

REDIAL_WAIT = 0.025  # a broken pull connection is dialled again after this, doubled for each idle one before
REDIALS = 8  # idle pull connections in a row after which a link stops dialling them
STALE_ASKS = 2  # idle pull connections a window's read may find closed before it takes that for the producer's end


def _drain(sock: socket.socket, n: int, limit: int = 1 << 30) -> None:
    """Read and drop ``n`` bytes of a refused write so the connection stays in step (bounded by ``limit``)."""
    if n > limit:
        raise ProtocolError(f"refusing to drain {n} bytes")
    scratch = bytearray(min(n, 1 << 20))
    with mapped("draining a refused write"):
        sock.settimeout(5.0)
        while n > 0:
            k = sock.recv_into(scratch, min(n, len(scratch)))
            if k == 0:
                raise PeerError("connection closed by peer")
            n -= k


def _wait_readable(sock: socket.socket, check: Callable[[], None]) -> None:
    poller = select.poll()  # not select.select: it fails for descriptors >= FD_SETSIZE (1024) in busy processes
    with mapped("waiting for a reply"):
        if sock.fileno() < 0:
            raise PeerError("connection closed")
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return  # TLS already decrypted the reply: the raw socket may have nothing more to read
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        while not poller.poll(POLL * 1000):
            check()


class TcpLink(Link["TcpTransport"]):
    def __init__(self, transport: TcpTransport, peer: Peer):
        self.t = transport
        self.peer = peer
        self.conns = Connections(self._dial, transport.streams)
        self._idle_redials = 0  # pull connections in a row that ended having served no read

    @property
    def closed(self) -> bool:
        return self.conns.closed

    def spawn(self, fn, *args) -> None:
        threading.Thread(target=fn, args=args, daemon=True, name=f"kvxfer-tcp-{fn.__name__}").start()

    def _dial(self, purpose: str) -> Channel:
        ch = Channel(connect(self.peer.address, 5.0, self.t.tls))
        ch.send(data_hello(self.peer.session, purpose, self.peer.key))
        return ch

    def open_pull(self) -> None:
        """Producer: give the consumer one more connection to read offered blocks through."""
        try:
            ch = self.conns.track(self._dial("pull"))
        except KVXferError:
            return
        self.spawn(self.serve_reads, ch)

    def _extents(self, ids: np.ndarray, part: Selection | None = None, chunks: int | None = None) -> Extents:
        """Our side of a transfer of ``ids``: the stream transport needs no other side's ids."""
        return self.paging(part).side(self.peer.is_producer, ids, chunks, self.t.layout.num_blocks)

    def _ticket_extents(self, ticket, ids: np.ndarray) -> Extents:
        """Our side of a grant or lease, as its ticket decides (its selection, its chunks): made once for all its
        windows, since a window of one byte must not cost the extents of the whole request each time."""
        ext = ticket.extents
        if ext is None:
            ticket.extents = ext = self._extents(
                ids, getattr(ticket, "selection", None), getattr(ticket, "chunks", None)
            )
        return ext

    def _checker(self, deadline: float, cancel: threading.Event) -> Callable[[], None]:
        def check():
            if cancel.is_set():
                raise CancelledError("transfer cancelled")
            if self.closed:
                raise PeerError("link closed")
            remaining(deadline)

        return check

    def _stopped_if_closed(self) -> None:
        if self.closed:
            raise PeerError("link closed")

    def _ticket_live(self, ticket) -> None:
        """A receive goes on while its grant holds (a failed request stops it), a served read while its lease
        does (released, expired or cancelled, it stops), and either only while the link is open."""
        if ticket.error is not None:
            raise ticket.error
        self._stopped_if_closed()

    def _streams(self, ext: Extents) -> list[tuple[int, int]]:
        return windows.split(ext.total, min(self.t.streams, max(1, ext.total // self.t.window_min)))

    def descriptors(self, src_ids, dst_ids, chunks=None) -> int:
        return len(self._extents(src_ids if self.peer.is_producer else dst_ids, chunks=chunks))

    # ---- push: producer side -------------------------------------------------------------------------------
    def write(self, req, gen, src_ids, dst_ids, deadline, cancel, part=None, chunks=None) -> int:
        ext = self._extents(src_ids, part, chunks)
        ids = wire.ids_to_bytes(dst_ids)
        check = self._checker(deadline, cancel)

        def one(offset: int, length: int) -> None:
            ch = self.conns.push(check)
            try:
                ch.send(wire.WriteData(req=req, gen=gen, ids=ids, offset=offset, length=length))
                move = functools.partial(self.t.mover.send, ch.sock, ext.window(offset, length))
                self.t.watchdog.guarded(ch.sock, check, move)
                _wait_readable(ch.sock, check)
                reply = ch.recv(remaining(deadline))
            except BaseException:
                self.conns.lost_push(ch)
                raise
            if not isinstance(reply, wire.DataReply) or not reply.ok:
                self.conns.lost_push(ch)
                if isinstance(reply, wire.DataReply):
                    raise from_code(reply.code, reply.message)
                raise ProtocolError(f"unexpected {type(reply).__name__} on a data connection")
            self.conns.give_back(self.conns.pushes, ch)

        parallel.run_all(one, self._streams(ext), "kvxfer-tcp-window")
        return ext.total

    # ---- push: consumer side -------------------------------------------------------------------------------
    def serve_writes(self, ch: Channel) -> None:
        """Receive ``WriteData`` windows into granted blocks until the connection ends."""
        host, sock = cast(WriteHost, self.t.host), ch.sock
        try:
            self.conns.track(ch)
            while not self.closed:
                with mapped("waiting for a write"):
                    sock.settimeout(None)
                msg = ch.recv()
                if not isinstance(msg, wire.WriteData):
                    raise ProtocolError(f"unexpected {type(msg).__name__} on a push connection")
                try:
                    ids = wire.ids_from_bytes(msg.ids, self.t.layout.num_blocks)
                    span = (msg.offset, msg.offset + msg.length)  # each byte of the stream is received once
                    ticket = host.begin_write(self.peer.local, msg.req, msg.gen, ids, span)
                except KVXferError as e:
                    _drain(sock, msg.length)  # the refused bytes never touch registered memory
                    ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                    continue
                try:
                    window = windows.checked(self._ticket_extents(ticket, ids), msg.offset, msg.length)
                    check = functools.partial(self._ticket_live, ticket)
                    self.t.watchdog.guarded(sock, check, functools.partial(self.t.mover.recv, sock, window))
                except KVXferError as e:
                    host.end_write(ticket, 0, e)
                    if not isinstance(e, PeerError):
                        with contextlib.suppress(KVXferError):
                            ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                    return
                host.end_write(ticket, msg.length, None)
                ch.send(wire.DataReply(req=msg.req, ok=True, length=msg.length))
        except KVXferError:
            pass
        finally:
            self.conns.drop(ch)

    # ---- pull: consumer side -------------------------------------------------------------------------------
    def read(self, req, gen, src_ids, dst_ids, deadline, cancel, chunks=None) -> int:
        ext = self._extents(dst_ids, chunks=chunks)
        ids = wire.ids_to_bytes(src_ids)
        check = self._checker(deadline, cancel)

        def one(offset: int, length: int) -> None:
            ask = wire.ReadData(req=req, gen=gen, ids=ids, offset=offset, length=length)
            ch, reply = self._ask(ask, check, deadline)
            reusable = False  # a connection that failed mid-read is dropped; a refusal leaves it in step
            try:
                if not isinstance(reply, wire.DataReply):
                    raise ProtocolError(f"unexpected {type(reply).__name__} on a pull connection")
                if not reply.ok:
                    reusable = True
                    raise from_code(reply.code, reply.message)
                if reply.length != length:
                    raise ProtocolError(f"asked for {length} bytes, peer sends {reply.length}")
                move = functools.partial(self.t.mover.recv, ch.sock, ext.window(offset, length))
                self.t.watchdog.guarded(ch.sock, check, move)
                reusable = True
            finally:
                if reusable:
                    self.conns.give_back(self.conns.pulls, ch)
                else:
                    self.conns.drop(ch)

        parallel.run_all(one, self._streams(ext), "kvxfer-tcp-window")
        return ext.total

    def _ask(self, msg: wire.ReadData, check: Callable[[], None], deadline: float) -> tuple[Channel, object]:
        """Send one window's ``ReadData`` on an idle pull connection; the connection and the producer's answer.
        An idle connection can be closed before it answers: the producer shuts one down when the lease of the
        read it served ends as that read ends (the consumer's ``Released`` racing the producer's own end of the
        move), after the consumer took it back as idle. Nothing of this read moved on it, so it is asked again on
        another (the producer dials a new one), a few times at most."""
        stale = 0
        while True:
            ch = self.conns.pull(check)
            try:
                ch.send(msg)
                _wait_readable(ch.sock, check)
                return ch, ch.recv(remaining(deadline))
            except PeerError:
                self.conns.drop(ch)
                stale += 1
                if stale > STALE_ASKS or self.closed:
                    raise
            except BaseException:
                self.conns.drop(ch)
                raise

    # ---- pull: producer side -------------------------------------------------------------------------------
    def serve_reads(self, ch: Channel) -> None:
        """Answer ``ReadData`` requests from offered blocks; reopen a connection that broke."""
        host, sock = cast(ReadHost, self.t.host), ch.sock
        served = False
        try:
            while not self.closed:
                with mapped("waiting for a read"):
                    sock.settimeout(None)
                msg = ch.recv()
                if not isinstance(msg, wire.ReadData):
                    raise ProtocolError(f"unexpected {type(msg).__name__} on a pull connection")
                try:
                    ids = wire.ids_from_bytes(msg.ids, self.t.layout.num_blocks)
                    ticket = host.begin_read(self.peer.local, msg.req, msg.gen, ids)
                    served = True  # a consumer is there: what happens to this read is no reason to dial less
                    try:
                        window = windows.checked(self._ticket_extents(ticket, ids), msg.offset, msg.length)
                    except KVXferError as e:
                        host.end_read(ticket, 0, e)
                        raise
                except KVXferError as e:
                    ch.send(wire.DataReply(req=msg.req, ok=False, code=e.code, message=str(e)))
                    continue
                try:
                    ch.send(wire.DataReply(req=msg.req, ok=True, length=msg.length))
                    move = functools.partial(self.t.mover.send, sock, window)
                    self.t.watchdog.guarded(sock, functools.partial(self._ticket_live, ticket), move)
                except KVXferError as e:
                    host.end_read(ticket, 0, e)
                    raise
                host.end_read(ticket, msg.length, None)
        except KVXferError:
            pass
        finally:
            self.conns.drop(ch)
            # a connection that no read came through counts against redialling: an address that takes connections
            # and drops them (perhaps no consumer at all, only an address a peer named) is dialled ever less
            self._idle_redials = 0 if served else self._idle_redials + 1
            if not self.closed and self._idle_redials <= REDIALS:
                time.sleep(min(REDIAL_WAIT * 2**self._idle_redials, 5.0))
                self.open_pull()

    def close(self) -> None:
        self.conns.close()
