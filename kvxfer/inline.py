"""Small requests ride inside the control messages: the producer gathers a request's bytes into its ``Admit``
(push) or ``Offer`` (pull, fetch), the consumer scatters them into the blocks it grants or chose. One copy on each
side instead of a data connection: a push takes one round trip (Admit, then Grant and Ack) instead of three, a
pull no read. What a small request's latency is made of. Host memory only (a device cache stages its bytes
anyway); larger requests move zero-copy over the transport.
"""

from __future__ import annotations

import numpy as np

from . import _kvx, wire
from .layout import KVLayout
from .memory import HOST
from .paging import Paging
from .staging.engine import HostEngine, Slot

LIMIT = wire.INLINE_MAX  # the most bytes a message may carry (the wire's bound; a producer's default is lower)
FRAME = LIMIT + (64 << 10)  # a control frame carrying that many, with the rest of its message
DEFAULT = 64 << 10  # a producer inlines requests of at most this many bytes unless told otherwise


class Inline:
    """Packs one layout's blocks into message bytes and unpacks them back (native copies). Blocks paged alike
    on both sides are copied straight from their ids and the side's piece table (``_kvx.gather_blocks``): a
    small request's extents cost more to build than its bytes to copy; other pagings go through extents."""

    def __init__(self, layout: KVLayout):
        self.engine = HostEngine(layout.regions)
        self.num_blocks = layout.num_blocks

    @staticmethod
    def usable(layout: KVLayout) -> bool:
        return layout.device == HOST

    def pack(self, paging: Paging, ids: np.ndarray, chunks: int | None) -> bytes:
        """The bytes of source blocks ``ids`` (``chunks`` of them when the sides page differently)."""
        p = paging.alike(chunks, len(ids))
        if p is not None:
            e = self.engine
            return _kvx.gather_blocks(e.bases, e.sizes, p.a.region, p.a.offset, p.a.stride, p.nbytes, ids)
        ext = paging.side(True, ids, chunks, self.num_blocks)
        slot = self.engine.slot(ext.total)
        self.engine.gather(ext, slot)
        return bytes(slot.view)

    def unpack(self, paging: Paging, ids: np.ndarray, chunks: int | None, data: bytes) -> None:
        """Scatter ``data`` into destination blocks ``ids``; its length is the caller's to check."""
        p = paging.alike(chunks, len(ids))
        if p is not None:
            e = self.engine
            _kvx.scatter_blocks(e.bases, e.sizes, p.b.region, p.b.offset, p.b.stride, p.nbytes, ids, data)
            return
        self.engine.scatter(Slot(memoryview(data), len(data)), paging.side(False, ids, chunks, self.num_blocks))
