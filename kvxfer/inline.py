"""Small requests ride inside the control messages: the producer gathers a request's bytes into its ``Admit``
(push) or ``Offer`` (pull, fetch), the consumer scatters them into the blocks it grants or chose. One copy on each
side instead of a data connection: a push takes one round trip (Admit, then Grant and Ack) instead of three, a
pull no read. What a small request's latency is made of. Host memory only (a device cache stages its bytes
anyway); larger requests move zero-copy over the transport.
"""

from __future__ import annotations

from . import wire
from .layout import KVLayout
from .memory import HOST
from .plan import Extents
from .staging.engine import HostEngine, Slot

LIMIT = wire.INLINE_MAX  # the most bytes a message may carry (the wire's bound; a producer's default is lower)
FRAME = LIMIT + (64 << 10)  # a control frame carrying that many, with the rest of its message
DEFAULT = 64 << 10  # a producer inlines requests of at most this many bytes unless told otherwise


class Inline:
    """Packs and unpacks one layout's extents to and from message bytes (the host engine's native copies)."""

    def __init__(self, layout: KVLayout):
        self.engine = HostEngine(layout.regions)

    @staticmethod
    def usable(layout: KVLayout) -> bool:
        return layout.device == HOST

    def pack(self, ext: Extents) -> bytes:
        slot = self.engine.slot(ext.total)
        self.engine.gather(ext, slot)
        return bytes(slot.view)

    def unpack(self, ext: Extents, data: bytes) -> None:
        self.engine.scatter(Slot(memoryview(data), len(data)), ext)
