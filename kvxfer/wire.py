"""The control protocol: every message kvxfer puts on a wire, as tagged, versioned ``msgspec.Struct``s.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Frames above ``max_frame``
are refused before a byte of their body is read, and decoding untrusted bytes raises nothing but
``ProtocolError``. Block ids travel as packed little-endian uint32 (``ids_to_bytes``) so a 128k-token
request costs one memcpy, not a million msgpack integers.

Control flow (one TCP control connection per producer -> consumer pair; data moves on the transport):

hello  producer -> Hello(nonce_p)   consumer -> Challenge(nonce_c, proof_c)   producer -> Proof(proof_p, layout,
       transports)   consumer -> Welcome(session, layout, transport, meta, mac): mutual HMAC-SHA256 proofs of
       the shared token before any memory is described (see ``handshake``)

push   producer -> Admit(req, n[, senders, part, layers])  consumer -> Grant(req, gen, ids) | Busy(req, retry_after)
       producer moves the bytes into exactly ``ids``, then -> Done(req, gen, meta)
       consumer -> Ack(req, gen)  once the bytes have landed (or Error)
pull   producer -> Offer(req, gen, ids, lease)   consumer reads them into its own blocks
       consumer -> Released(req, gen)            producer -> Ack(req, gen) if the lease still held, else Error
either Cancel(req, gen) from either side; Error(req, code, message) on any failure
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec
import numpy as np

from .errors import BlockError, ProtocolError

VERSION = 2
MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What two sides must agree on before a byte moves."""

    version: int
    dtype: str
    block_size: int
    num_layers: int
    layer_bytes: int
    block_bytes: int
    order: str


class RegionDesc(msgspec.Struct, array_like=True, frozen=True):
    ptr: int
    nbytes: int
    device: int


class LayoutDesc(msgspec.Struct, frozen=True):
    num_blocks: int
    regions: list[RegionDesc]
    seg_region: list[int]
    seg_offset: list[int]
    seg_stride: list[int]
    seg_bytes: list[int]
    fingerprint: Fingerprint


class _Msg(msgspec.Struct, tag_field="t", kw_only=True):
    pass


class Hello(_Msg, tag="hello"):
    """First frame on a control connection, producer -> consumer: who it is and its challenge. Nothing about
    memory (layout, transport metadata) crosses before both sides proved they hold the token."""

    version: int
    peer_id: str
    nonce: bytes


class Challenge(_Msg, tag="challenge"):
    """Consumer -> producer: the consumer's challenge, and its proof over both nonces that it holds the token."""

    version: int
    peer_id: str
    nonce: bytes
    proof: bytes


class Proof(_Msg, tag="proof"):
    """Producer -> consumer: its proof, bound to what follows (its layout, and per transport it can use, in
    preference order, that transport's metadata); the consumer picks the first transport it has too."""

    proof: bytes
    layout: LayoutDesc
    transports: list[tuple[str, bytes]]


class Welcome(_Msg, tag="welcome"):
    """The consumer's answer to ``Proof``: its session id, layout, the chosen transport and that transport's
    metadata, authenticated with the session key."""

    session: int
    layout: LayoutDesc
    transport: str
    transport_meta: bytes = b""
    mac: bytes = b""


class Admit(_Msg, tag="admit"):
    """Push: ask the consumer to grant ``num_blocks`` destination blocks for ``req``.

    Multi-sender (tensor-parallel prefill): ``senders`` producer sessions each send ``part`` of one request,
    carrying only ``layers`` of every block; all parts are granted the same blocks, each its own generation,
    and the request is ready when every part is done. The defaults are the single-sender push.
    """

    req: str
    num_blocks: int
    deadline_ms: int
    meta: dict[str, Any] = {}
    senders: int = 1
    part: int = 0
    layers: Union[list[int], None] = None
    attempt: int = 0  # the producer's attempt id, echoed in the answer: a late answer to an older attempt is ignored


class Grant(_Msg, tag="grant"):
    req: str
    gen: int
    ids: bytes
    attempt: int = 0


class Busy(_Msg, tag="busy"):
    req: str
    retry_after_ms: int
    reason: str = ""
    attempt: int = 0


class Offer(_Msg, tag="offer"):
    """Pull: the producer's blocks ``ids`` may be read until the lease runs out."""

    req: str
    gen: int
    ids: bytes
    lease_ms: int
    meta: dict[str, Any] = {}
    digests: bytes = b""


class Done(_Msg, tag="done"):
    """Push: the producer has moved every byte of ``req`` into the granted blocks."""

    req: str
    gen: int
    nbytes: int
    meta: dict[str, Any] = {}
    digests: bytes = b""


class Released(_Msg, tag="released"):
    """Pull: the consumer has read ``req``; the producer may free its blocks."""

    req: str
    gen: int
    nbytes: int


class Ack(_Msg, tag="ack"):
    """The other side agrees that ``req`` completed."""

    req: str
    gen: int


class Cancel(_Msg, tag="cancel"):
    req: str
    gen: int
    reason: str = ""


class Error(_Msg, tag="error"):
    req: str
    code: str
    message: str
    gen: int = 0
    attempt: int = 0  # set when answering an Admit


class DataHello(_Msg, tag="data_hello"):
    """First frame of a transport data connection: the control session it belongs to, proven with that
    session's key over a fresh nonce (a replayed one is refused)."""

    session: int
    purpose: str = "push"  # "push": producer -> consumer writes; "pull": consumer reads served by the producer
    nonce: bytes = b""
    mac: bytes = b""


class WriteData(_Msg, tag="write_data"):
    """Producer -> consumer data connection: ``length`` raw bytes follow, bytes [offset, offset+length) of
    the byte stream of blocks ``ids`` (the consumer's own ids, checked against the grant)."""

    req: str
    gen: int
    ids: bytes
    offset: int
    length: int


class ReadData(_Msg, tag="read_data"):
    """Consumer -> producer data connection: send bytes [offset, offset+length) of the producer's blocks
    ``ids`` (checked against the offer); the producer answers ``DataReply`` then the bytes."""

    req: str
    gen: int
    ids: bytes
    offset: int
    length: int


class DataReply(_Msg, tag="data_reply"):
    """Answer on a data connection: ``ok`` with ``length`` raw bytes following, or an error code."""

    req: str
    ok: bool
    length: int = 0
    code: str = ""
    message: str = ""


Message = Union[Hello, Challenge, Proof, Welcome, Admit, Grant, Busy, Offer, Done, Released, Ack, Cancel, Error,
                DataHello, WriteData, ReadData, DataReply]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    """One frame: length prefix and body."""
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes, max_frame: int = MAX_FRAME) -> int:
    """The body length announced by a 4-byte header, refused if oversized or empty."""
    if len(header) != 4:
        raise ProtocolError("truncated frame header")
    (n,) = _LEN.unpack(header)
    if n == 0 or n > max_frame:
        raise ProtocolError(f"frame of {n} bytes refused (limit {max_frame})")
    return n


def decode(body: bytes) -> _Msg:
    """Decode one frame body; any defect is a ``ProtocolError``."""
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message: {e}") from None


def ids_to_bytes(ids) -> bytes:
    a = np.asarray(ids)
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise BlockError("block ids must fit in uint32")
    return a.astype("<u4", copy=False).tobytes()


def ids_from_bytes(b: bytes, limit: int | None = None) -> np.ndarray:
    if len(b) % 4:
        raise ProtocolError("block id list is not a whole number of uint32")
    if limit is not None and len(b) // 4 > limit:
        raise BlockError(f"{len(b) // 4} block ids exceed the {limit} blocks of the layout")
    return np.frombuffer(b, dtype="<u4").astype(np.int64)
