"""TCP transport: the fallback for hardware without RDMA, and the reference for every other transport.

Data connections are opened by the producer to the consumer's one listening port (after the control
handshake, each proving its session). *push* connections carry ``WriteData`` + raw bytes, received by the
consumer straight into the granted blocks (``recvmsg_into``) after checking them against its ledger; *pull*
connections carry ``ReadData`` requests from the consumer, answered by the producer from the offered blocks
(``sendmsg``). The bytes of a transfer form one stream in plan order, split into ``streams`` windows that
move in parallel on separate connections. No byte is copied through a Python object.

CUDA memory moves through pinned host staging, chunked and pipelined (``movers.Staged``, ``kvxfer.staging``);
``staging=True`` sends host memory the same way (how CI runs that path without a GPU).

``link`` holds the four loops, ``movers`` how bytes leave and reach memory, ``pool`` a link's data
connections, ``windows`` the fan-out of a stream into windows, ``watchdog`` the thread that stops moves on
blocking sockets.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading

from ... import wire
from ...channel import Channel
from ...errors import KVXferError
from ...memory import HOST
from .. import parallel
from ..base import Peer, Transport
from .link import TcpLink
from .movers import Direct, Staged
from .watchdog import Watchdog

__all__ = ["TcpLink", "TcpTransport"]


def default_streams() -> int:
    """One data connection per core, up to ``parallel.MAX``: with the data path's system calls outside the GIL,
    a second connection lifted a 70B-shaped 8 KiB-page transfer from 0.76-0.80x to 0.95-1.01x of one plain
    socket on 2 cores, and a fourth there lost a little (docs/performance.md). A transfer is split only into
    windows of at least ``window_min`` bytes, so a small one keeps to one connection."""
    return parallel.per_core()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self,
        layout,
        host,
        *,
        streams: int | None = None,
        window_min: int = 8 << 20,
        tls: ssl.SSLContext | None = None,
        staging: bool | None = None,
        stage_chunk: int = 16 << 20,
        stage_depth: int = 2,
        **_,
    ):
        super().__init__(layout, host)
        self.tls = tls  # a producer's client context: its data connections are TLS too
        self.streams = default_streams() if streams is None else max(1, int(streams))
        self.window_min = window_min
        if staging is None:
            staging = any(r.device != HOST for r in layout.regions)
        self.mover = Staged(layout.regions, stage_chunk, stage_depth) if staging else Direct(layout.regions)
        self.links: dict[int, TcpLink] = {}
        self.watchdog = Watchdog()
        self._lock = threading.Lock()

    def connect(self, peer: Peer) -> TcpLink:
        link = TcpLink(self, peer)
        with self._lock:
            self.links[peer.local] = link
        if peer.is_producer:
            for _ in range(self.streams):
                link.open_pull()
        return link

    def accept_data(self, sock: socket.socket, hello: wire.DataHello) -> None:
        with self._lock:
            link = self.links.get(hello.session)  # a consumer's: its own number
        if link is None or link.closed:
            sock.close()
            return
        ch = Channel(sock)
        if hello.purpose == "pull":
            with contextlib.suppress(KVXferError):  # refused: closed
                link.conns.give_back(link.conns.pulls, link.conns.track(ch))  # tracked: a closing link stops its read
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
