"""kvxfer: move paged KV cache between a prefill engine and a decode runtime, zero-copy.

>>> layout = KVLayout.from_tensors(kv_caches)              # per-layer dict, list, or one cross-layer tensor
>>> consumer = Consumer(layout, transport="tcp")           # decode side, listens on consumer.address
>>> producer = Producer(layout, transport="tcp")           # prefill side
>>> producer.push(consumer.address, "req-1", block_ids).wait()
>>> arrival = consumer.get(timeout=5)                       # its blocks, metadata; release() when done
"""

from .allocator import Allocator, FreeList
from .consumer import Consumer
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
    LayoutError,
    LeaseExpiredError,
    PeerError,
    ProtocolError,
    StaleError,
    TimeoutError,
    TransportError,
)
from .fetch import Fetch
from .layout import KVLayout
from .producer import Producer
from .transfer import Arrival, Status, Transfer
from .transports import available as available_transports

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "Arrival",
    "AuthError",
    "BlockError",
    "BusyError",
    "CancelledError",
    "ClosedError",
    "ConfigError",
    "Consumer",
    "DeadlineError",
    "Fetch",
    "FreeList",
    "IncompatibleError",
    "IntegrityError",
    "KVLayout",
    "KVXferError",
    "LayoutError",
    "LeaseExpiredError",
    "PeerError",
    "Producer",
    "ProtocolError",
    "StaleError",
    "Status",
    "TimeoutError",
    "Transfer",
    "TransportError",
    "available_transports",
]
