"""The one interface every transport implements.

A transport only moves bytes between registered memory; kvxfer's control protocol (``wire`` over a TCP
control connection, driven by ``handles``) decides what may move, so every transport inherits the same
admission, fencing, deadlines and cancellation. Five things make a transport: register memory at
construction, ``local_meta`` for the handshake, ``connect`` to a peer after the handshake, and a ``Link``
that can ``write`` (push) and ``read`` (pull).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from ..layout import KVLayout
from ..paging import Paging, paging
from ..shard import Selection


def ucx_logs_to_stderr() -> None:
    """UCX writes its log lines (errors included) to stdout unless told otherwise, into the output of whatever
    program uses kvxfer; they go to stderr instead (``UCX_LOG_FILE``: a user's own setting wins). Call before
    UCX reads its environment."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")


@dataclass
class Peer:
    """What the handshake established about the other side.

    ``session`` is the number the consumer gave the session in its Welcome: what data connections and tags
    carry. ``local`` is this side's key for it (its links, leases, reads and writes): on a consumer its own
    ``session``; on a producer a number of its own, because every consumer numbers its sessions from 1, so two
    consumers' sessions (a TP decode's ranks fetching from one holder) carry the same one, and a peer could
    name another's."""

    session: int
    address: str  # the consumer's listening address
    layout: KVLayout  # the peer's layout (remote addresses for one-sided transports)
    paging: Paging  # side ``a`` is the producer's layout, side ``b`` the consumer's
    meta: bytes  # the peer's ``local_meta``
    is_producer: bool  # whether *this* side is the producer
    key: bytes = b""  # the session key both sides derived in the handshake (data connections prove it)
    local: int = 0  # 0: ``session`` (sessions are numbered from 1)

    def __post_init__(self) -> None:
        if not self.local:
            self.local = self.session


class WriteHost(Protocol):
    """The consumer's side of a transport: it checks every write against its ledger before a byte lands."""

    def begin_write(
        self, session: int, req: str, gen: int, ids: np.ndarray, window: tuple[int, int] | None = None
    ) -> Any:
        """A peer wants to write blocks ``ids`` (bytes ``window`` of the request's stream, which no earlier write
        may have sent); returns a ticket (with ``.error``, ``.selection`` and ``.chunks``) or raises a kvxfer
        error. The blocks stay allocated until ``end_write`` of that ticket."""

    def end_write(self, ticket: Any, nbytes: int, error: BaseException | None) -> None: ...

    def landed(self, session: int, req: str, gen: int, nbytes: int) -> None:
        """A one-sided transport reports that ``nbytes`` of ``req`` arrived."""


class ReadHost(Protocol):
    """The producer's side of a transport: it checks every read against its leases."""

    def begin_read(self, session: int, req: str, gen: int, ids: np.ndarray) -> Any:
        """A peer wants to read offered blocks ``ids``; returns a ticket (with ``.chunks``) or raises a kvxfer
        error."""

    def end_read(self, ticket: Any, nbytes: int, error: BaseException | None) -> None: ...


Host = WriteHost | ReadHost


T = TypeVar("T", bound="Transport")
SELECTIONS = 64  # pagings of layer or head selections a link keeps (a request's parts use a few)
_SELECTING = threading.Lock()


class Link(ABC, Generic[T]):
    """The data path to one peer. Both calls block until the bytes moved, the deadline passed, or ``cancel``."""

    t: T  # the local transport that opened this link (set by each implementation)
    peer: Peer

    @abstractmethod
    def write(
        self,
        req: str,
        gen: int,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        deadline: float,
        cancel: threading.Event,
        part: Selection | None = None,
        chunks: int | None = None,
    ) -> int:
        """Push local blocks ``src_ids`` into the peer's granted blocks ``dst_ids``; returns bytes moved.
        ``part`` restricts the write to those layers or heads of every block (one part of a multi-sender push);
        ``chunks`` is the request's chunk count when the two sides page it with different block sizes."""

    @abstractmethod
    def read(
        self,
        req: str,
        gen: int,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        deadline: float,
        cancel: threading.Event,
        chunks: int | None = None,
    ) -> int:
        """Pull the peer's offered blocks ``src_ids`` into local blocks ``dst_ids``; returns bytes moved."""

    def paging(self, part: Selection | None = None) -> Paging:
        """The peer's paging, restricted to what ``part`` carries (cached per selection, the last
        ``SELECTIONS`` of them: a peer naming a new layer subset in every Admit must not grow the cache)."""
        if part is None:
            return self.peer.paging
        cache: dict[Selection, Paging] = self.__dict__.setdefault("_selected", {})
        with _SELECTING:
            p = cache.pop(part, None)
        if p is None:
            local = self.t.layout
            a, b = (local, self.peer.layout) if self.peer.is_producer else (self.peer.layout, local)
            p = paging(a, b, part)
        with _SELECTING:
            if len(cache) >= SELECTIONS:
                del cache[next(iter(cache))]  # the least recently used
            cache[part] = p
        return p

    def descriptors(self, src_ids: np.ndarray, dst_ids: np.ndarray, chunks: int | None = None) -> int:
        """How many descriptors a transfer of these blocks costs after coalescing (for reports)."""
        return 0

    def close(self) -> None:
        """Release what this link holds; a no-op for links that hold nothing of their own."""


class Transport(ABC):
    """Registers one layout's memory and opens links to peers."""

    name: ClassVar[str]
    one_sided: ClassVar[bool] = False  # True when a receiver cannot stop a remote write in flight

    def __init__(self, layout: KVLayout, host: Host, **options):
        self.layout = layout
        self.host = host

    def local_meta(self) -> bytes:
        return b""

    @abstractmethod
    def connect(self, peer: Peer) -> Link:
        """A link to ``peer``, called on both sides once the handshake succeeded."""

    def expect(self) -> None:
        """A peer was just told to move bytes here or read them from here (a Grant, an Offer), or said it moved
        them before this side saw them land (a Done): a transport that polls for arrivals or progress polls now and
        fast for a while; a no-op for the others."""

    def accept_data(self, sock, hello) -> None:
        """Consumer: a data connection of this transport arrived on the listening socket."""
        sock.close()

    def disconnect(self, session: int) -> None:
        """Forget the peer whose control session ended (``session``: its ``Peer.local``); a no-op for transports
        that keep no per-peer state."""

    def close(self) -> None:
        """Release the registered memory and every link; a no-op for transports that hold none."""
