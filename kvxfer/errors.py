"""The one exception hierarchy of kvxfer.

Every failure a caller can see is a ``KVXferError``; the subclasses say what went wrong so that a
connector or a decode runtime can decide between retrying, failing the request, or giving up on a peer.
Each carries a short, stable ``code`` that also travels on the wire inside ``wire.Error``.
"""

from __future__ import annotations


class KVXferError(Exception):
    """Base of every kvxfer error."""

    code = "error"


class LayoutError(KVXferError):
    """Memory cannot be described as paged KV blocks (a block is not an affine slice, bad shapes)."""

    code = "layout"


class ConfigError(KVXferError):
    """A handle was given something it cannot use: a malformed address, an option out of range."""

    code = "config"


class IncompatibleError(KVXferError):
    """The two sides disagree on protocol version, dtype or block geometry."""

    code = "incompatible"


class ProtocolError(KVXferError):
    """A peer sent bytes that are not a valid kvxfer message (malformed, truncated, oversized, unexpected)."""

    code = "protocol"


class AuthError(KVXferError):
    """The peer did not present the expected shared token."""

    code = "auth"


class BlockError(KVXferError):
    """Block ids are out of range, duplicated, mismatched in length, or not granted to this peer."""

    code = "blocks"


class BusyError(KVXferError):
    """The consumer cannot admit the request now; retry after ``retry_after`` seconds."""

    code = "busy"

    def __init__(self, message: str = "consumer busy", retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


class StaleError(KVXferError):
    """A message names an older generation of a request (cancelled, retried or restarted) and is refused."""

    code = "stale"


class CancelledError(KVXferError):
    """The transfer was cancelled by one of the two sides."""

    code = "cancelled"


class DeadlineError(KVXferError):
    """A deadline passed before the transfer ended (the peer may be slow, stopped or gone)."""

    code = "timeout"


TimeoutError = DeadlineError  # the name of 0.1; kept one release for callers that import it


class LeaseExpiredError(DeadlineError):
    """A pull offer's lease ran out before the consumer finished reading."""

    code = "lease_expired"


class PeerError(KVXferError):
    """The peer disconnected, died, or reported a failure of its own."""

    code = "peer"


class TransportError(KVXferError):
    """The data path failed (socket error, NIXL error state) or cannot serve this memory."""

    code = "transport"


class IntegrityError(KVXferError):
    """Blocks arrived whose digests differ from the producer's."""

    code = "integrity"


class ClosedError(KVXferError):
    """The handle was closed."""

    code = "closed"


class ClosedEmptyError(ClosedError, DeadlineError):
    """A wait on a closed handle with nothing left to hand out: nothing will come (a ``ClosedError``), so nothing
    came within the timeout either (a ``DeadlineError``, which callers polling ``get(timeout)`` catch)."""

    code = "closed"


_BY_CODE = {
    cls.code: cls
    for cls in (
        KVXferError,
        ConfigError,
        LayoutError,
        IncompatibleError,
        ProtocolError,
        AuthError,
        BlockError,
        BusyError,
        StaleError,
        CancelledError,
        DeadlineError,
        LeaseExpiredError,
        PeerError,
        TransportError,
        ClosedError,
        IntegrityError,
    )
}


def from_code(code: str, message: str) -> KVXferError:
    """Rebuild the error a peer reported; unknown codes become a plain ``PeerError``."""
    return _BY_CODE.get(code, PeerError)(message)
