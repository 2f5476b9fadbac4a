"""How a TCP link's bytes leave and reach registered memory: straight from host memory (``Direct``), or
through host staging for memory a socket cannot reach, such as CUDA memory (``Staged``)."""

from __future__ import annotations

import socket
import ssl

import numpy as np

from ...memory import Region, host_buffer
from ...plan import Extents
from ...sockets import recv_extents, recv_views, send_extents, send_views
from ...staging import Rings, engine_for, recv_staged, send_staged


class Direct:
    """Scatter/gather I/O straight from and into the registered host regions: native ``sendmsg``/``recvmsg``
    over the extent arrays; TLS, which has no scatter/gather, piece by piece through memoryviews."""

    def __init__(self, regions: list[Region]):
        self.bufs = [host_buffer(r) for r in regions]  # TLS's per-piece views slice these
        self.bases = np.array([r.ptr for r in regions], dtype=np.uint64)
        self.sizes = np.array([r.nbytes for r in regions], dtype=np.int64)

    def _views(self, ext: Extents) -> list[memoryview]:
        bufs = self.bufs
        return [
            bufs[r][o : o + n]
            for r, o, n in zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist(), strict=True)
        ]

    def send(self, sock: socket.socket, ext: Extents) -> None:
        if isinstance(sock, ssl.SSLSocket):
            send_views(sock, self._views(ext))
        else:
            send_extents(sock, self.bases, self.sizes, ext.region, ext.offset, ext.nbytes)

    def recv(self, sock: socket.socket, ext: Extents) -> None:
        if isinstance(sock, ssl.SSLSocket):
            recv_views(sock, self._views(ext))
        else:
            recv_extents(sock, self.bases, self.sizes, ext.region, ext.offset, ext.nbytes)


class Staged:
    """Chunked and pipelined through staging slots of a copy engine (``kvxfer.staging``)."""

    def __init__(self, regions: list[Region], chunk: int, depth: int):
        self.rings = Rings(engine_for(regions), chunk, depth)

    def send(self, sock: socket.socket, ext: Extents) -> None:
        send_staged(sock, ext, self.rings)

    def recv(self, sock: socket.socket, ext: Extents) -> None:
        recv_staged(sock, ext, self.rings)
