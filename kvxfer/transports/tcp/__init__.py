"""TCP transport: the fallback for hardware without RDMA, and the reference for every other transport.

Data connections are opened by the producer to the consumer's one listening port (after the control
handshake, each proving its session). *push* connections carry ``WriteData`` + raw bytes, received by the
consumer straight into the granted blocks (``recvmsg_into``) after checking them against its ledger; *pull*
connections carry ``ReadData`` requests from the consumer, answered by the producer from the offered blocks
(``sendmsg``). The bytes of a transfer form one stream in plan order, split into ``streams`` windows that
move in parallel on separate connections. No byte is copied through a Python object.

``link`` holds the four loops, ``pool`` a link's data connections, ``windows`` the fan-out of a stream into
windows, ``watchdog`` the thread that stops moves on blocking sockets.
"""

from __future__ import annotations

import socket
import ssl
import threading

from ... import wire
from ...channel import Channel
from ...errors import TransportError
from ...memory import HOST, host_buffer
from ...plan import Extents
from ..base import Peer, Transport
from .link import TcpLink
from .watchdog import Watchdog

__all__ = ["TcpLink", "TcpTransport"]


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self, layout, host, *, streams: int = 1, window_min: int = 8 << 20, tls: ssl.SSLContext | None = None, **_
    ):
        super().__init__(layout, host)
        self.tls = tls  # a producer's client context: its data connections are TLS too
        if any(r.device != HOST for r in layout.regions):
            raise TransportError("the tcp transport moves host memory only; use nixl for device memory")
        self.streams = max(1, int(streams))
        self.window_min = window_min
        self.bufs = [host_buffer(r) for r in layout.regions]
        self.links: dict[int, TcpLink] = {}
        self.watchdog = Watchdog()
        self._lock = threading.Lock()

    def views(self, ext: Extents) -> list[memoryview]:
        bufs = self.bufs
        return [
            bufs[r][o : o + n]
            for r, o, n in zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist(), strict=True)
        ]

    def connect(self, peer: Peer) -> TcpLink:
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
            link.conns.pulls.put(link.conns.track(ch))  # tracked: closing the link stops a read in progress
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
