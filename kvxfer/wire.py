"""The control protocol: every message kvxfer puts on a wire, as tagged, versioned ``msgspec.Struct``s.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Frames above ``max_frame``
are refused before a byte of their body is read, and decoding untrusted bytes raises nothing but
``ProtocolError``: every number is range-checked (no negative length, nothing that wraps int64 arithmetic),
unknown fields are refused, and the free-form ``meta`` is a JSON-like dict of bounded depth and size. Block
ids travel as packed little-endian uint32 (``ids_to_bytes``) so a 128k-token request costs one memcpy, not a
million msgpack integers.

Control flow (one TCP control connection per producer -> consumer pair; data moves on the transport):

hello  producer -> Hello(nonce_p)   consumer -> Challenge(nonce_c, proof_c)   producer -> Proof(proof_p, layout,
       transports)   consumer -> Welcome(session, layout, transport, meta, mac): mutual HMAC-SHA256 proofs of
       the shared token before any memory is described (see ``handshake``)

push   producer -> Admit(req, n[, senders, part, layers])  consumer -> Grant(req, gen, ids) | Busy(req, retry_after)
       producer moves the bytes into exactly ``ids``, then -> Done(req, gen, meta)
       consumer -> Ack(req, gen)  once the bytes have landed (or Error)
pull   producer -> Offer(req, gen, ids, lease)   consumer reads them into its own blocks
       consumer -> Released(req, gen)            producer -> Ack(req, gen) if the lease still held, else Error
fetch  the consumer connects to a producer's listening address (the producer then speaks first: the same
       handshake, the consumer's Welcome naming the address its data connections go to)
       consumer -> Fetch(req, skip, n)          producer -> Offer of blocks [skip, skip + n) of its hold ``req``
       (or Error), then as pull, into blocks the consumer's caller chose
either Cancel(req, gen) from either side; Error(req, code, message) on any failure
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

from .errors import BlockError, ConfigError, ProtocolError

VERSION = 3  # 2: mutual authentication, meaningful fingerprints, strict decoding; 3: fetch (consumer-initiated)
MAX_FRAME = 64 << 20
INLINE_MAX = 1 << 20  # the most bytes an Admit or Offer carries inline (kvxfer.inline)
MAX_HANDSHAKE_FRAME = 1 << 20  # before both sides proved the token (a layout with 640 segments is ~9 KiB)
MAX_SEGMENTS = 1 << 16
MAX_BLOCKS = 1 << 32  # block ids travel as uint32
META_DEPTH = 4  # containers a meta value may nest, below the meta dict itself
META_ITEMS = 1024  # entries of any one dict or list inside meta
META_BYTES = 1 << 20  # the most a request's meta may take encoded (checked where a caller hands it in, and on receipt)
MAX_REQ = 1 << 12  # characters of a request id a caller may choose
_LEN = struct.Struct(">I")

U32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # counts, lengths, offsets: int64 arithmetic never wraps
Tokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]  # a request's tokens: at least one
MAX_READERS = 1024  # consumers that may fetch one hold (each its heads or layers: tensor-parallel decode ranks)
Readers = Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack holds nothing above 2**64 - 1
Device = Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=1 << 16)]
Secret = Annotated[bytes, msgspec.Meta(max_length=64)]  # nonces and MACs


def _json_like(depth: int) -> Any:
    """A JSON-like value nesting at most ``depth`` containers of at most ``META_ITEMS`` entries each."""
    t: Any = None | bool | int | float | str
    for _ in range(depth):
        t = (
            None
            | bool
            | int
            | float
            | str
            | Annotated[list[t], msgspec.Meta(max_length=META_ITEMS)]
            | Annotated[dict[str, t], msgspec.Meta(max_length=META_ITEMS)]
        )
    return t


if TYPE_CHECKING:  # a type built at run time is opaque to a checker: code sees the dict it decodes to
    Meta = dict[str, Any]
else:
    Meta = Annotated[dict[str, _json_like(META_DEPTH)], msgspec.Meta(max_length=META_ITEMS)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused rather than skipped: skipping an untyped value is where unbounded nesting
    would get in. Versions evolve through ``VERSION``, checked first in the handshake."""


class _StrictFrozen(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``_Strict`` for immutable values (a frozen struct cannot derive from a mutable one)."""


class Fingerprint(_StrictFrozen, frozen=True):
    """What two sides must agree on before a byte moves. ``order`` names every in-block dimension by what it
    means, outermost first (``layout`` builds it): equal fingerprints mean the same bytes in the same places."""

    version: U32
    dtype: Name
    block_size: U32
    num_layers: U32
    layer_bytes: U63
    block_bytes: U63
    order: Name


class RegionDesc(_StrictFrozen, array_like=True, frozen=True):
    ptr: U64
    nbytes: U63
    device: Device


_Segs = Annotated[list[U63], msgspec.Meta(max_length=MAX_SEGMENTS)]


class LayoutDesc(_StrictFrozen, frozen=True):
    num_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)]
    regions: Annotated[list[RegionDesc], msgspec.Meta(max_length=MAX_SEGMENTS)]
    seg_region: _Segs
    seg_offset: _Segs
    seg_stride: _Segs
    seg_bytes: _Segs
    fingerprint: Fingerprint
    heads: Annotated[list[U32], msgspec.Meta(min_length=2, max_length=2)] | None = None  # [start, stop) of the
    # model's kv heads this cache holds (a tensor-parallel rank's shard); None: it does not say (all it holds)
    layers: Annotated[list[U32], msgspec.Meta(min_length=2, max_length=2)] | None = None  # likewise the model's
    # layers it holds (a pipeline stage's)


class _Msg(_Strict, tag_field="t", kw_only=True):
    pass


class Hello(_Msg, tag="hello"):
    """First frame on a control connection, producer -> consumer: who it is and its challenge. Nothing about
    memory (layout, transport metadata) crosses before both sides proved they hold the token."""

    version: U32
    peer_id: Name
    nonce: Secret


class Challenge(_Msg, tag="challenge"):
    """Consumer -> producer: the consumer's challenge, and its proof over both nonces that it holds the token."""

    version: U32
    peer_id: Name
    nonce: Secret
    proof: Secret


class Proof(_Msg, tag="proof"):
    """Producer -> consumer: its proof, bound to what follows (its layout, and per transport it can use, in
    preference order, that transport's metadata); the consumer picks the first transport it has too."""

    proof: Secret
    layout: LayoutDesc
    transports: Annotated[list[tuple[Name, bytes]], msgspec.Meta(max_length=8)]
    # the request a dialling producer (push or offer) opens the session for, under the proof: a consumer refusing it
    # (layouts or transports that do not pair) fails that request at once, not after its waiter's admission timeout
    req: Name = ""


class Welcome(_Msg, tag="welcome"):
    """The consumer's answer to ``Proof``: its session id, layout, the chosen transport and that transport's
    metadata, authenticated with the session key."""

    session: U64
    layout: LayoutDesc
    transport: Name
    transport_meta: bytes = b""
    mac: Secret = b""
    address: Name = ""  # a fetching consumer's listening address (its TCP data connections); "" on a push session


class Admit(_Msg, tag="admit"):
    """Push: ask the consumer to grant ``num_blocks`` destination blocks for ``req``.

    Multi-sender (tensor-parallel or pipeline-parallel prefill): ``senders`` producer sessions each send ``part``
    of one request, carrying only ``layers`` or only ``heads`` of every block; all parts are granted the same
    blocks, each its own generation, and the request is ready when every part is done and together they covered
    every byte of the blocks. The defaults are the single-sender push.
    """

    req: str
    num_blocks: U32
    deadline_ms: U63
    meta: Meta = {}
    senders: U32 = 1
    part: U32 = 0
    layers: Annotated[list[U32], msgspec.Meta(max_length=1 << 20)] | None = None
    heads: Annotated[list[U32], msgspec.Meta(min_length=2, max_length=2)] | None = None  # [start, stop): a part
    # carrying these kv heads of every block (of the model's heads; both sides declared theirs in the handshake)
    attempt: U63 = 0  # the producer's attempt id, echoed in the answer: a late answer to an older attempt is ignored
    tokens: Tokens | None = None  # set when the two sides page with different tokens per block: the request's
    # tokens in its ``num_blocks`` source blocks; the grant is the consumer's blocks that hold them
    data: Annotated[bytes, msgspec.Meta(max_length=INLINE_MAX)] = b""  # a small single-sender push's bytes, in
    # stream order: the consumer lands them before its Grant and acknowledges at once (no data, no Done)


class Grant(_Msg, tag="grant"):
    req: str
    gen: U63
    ids: bytes
    attempt: U63 = 0


class Busy(_Msg, tag="busy"):
    req: str
    retry_after_ms: U63
    reason: str = ""
    attempt: U63 = 0


class Offer(_Msg, tag="offer"):
    """Pull: the producer's blocks ``ids`` may be read until the lease runs out."""

    req: str
    gen: U63
    ids: bytes
    lease_ms: U63
    meta: Meta = {}
    digests: bytes = b""
    tokens: Tokens | None = None  # as in ``Admit``: the offered blocks' tokens, when the two sides page differently
    data: Annotated[bytes, msgspec.Meta(max_length=INLINE_MAX)] = b""  # a small offer's bytes (read at the offer):
    # the consumer lands them and releases at once, with no read


class Fetch(_Msg, tag="fetch"):
    """Fetch, consumer -> producer: offer me blocks ``[skip, skip + num_blocks)`` of your hold ``req``. The
    answer is an ``Offer`` (then the pull goes on as any other) or an ``Error`` naming ``attempt``."""

    req: str
    num_blocks: U32
    skip: U32 = 0
    attempt: U63 = 0
    tokens: Tokens | None = None  # the two sides page differently: the tokens wanted from hold block ``skip`` on
    # (the offer holds at most what the hold has)
    readers: Readers = 1  # consumers that fetch this hold, each once (the first fetch sets it; the hold ends after
    # that many reads)


class Done(_Msg, tag="done"):
    """Push: the producer has moved every byte of ``req`` into the granted blocks."""

    req: str
    gen: U63
    nbytes: U63
    meta: Meta = {}
    digests: bytes = b""


class Released(_Msg, tag="released"):
    """Pull: the consumer has read ``req``; the producer may free its blocks."""

    req: str
    gen: U63
    nbytes: U63


class Ack(_Msg, tag="ack"):
    """The other side agrees that ``req`` completed."""

    req: str
    gen: U63


class Cancel(_Msg, tag="cancel"):
    req: str
    gen: U63
    reason: str = ""


class Error(_Msg, tag="error"):
    req: str
    code: str
    message: str
    gen: U63 = 0
    attempt: U63 = 0  # set when answering an Admit


class DataHello(_Msg, tag="data_hello"):
    """First frame of a transport data connection: the control session it belongs to, proven with that
    session's key over a fresh nonce (a replayed one is refused)."""

    session: U64
    purpose: Name = "push"  # "push": producer -> consumer writes; "pull": consumer reads served by the producer
    nonce: Secret = b""
    mac: Secret = b""


class WriteData(_Msg, tag="write_data"):
    """Producer -> consumer data connection: ``length`` raw bytes follow, bytes [offset, offset+length) of
    the byte stream of blocks ``ids`` (the consumer's own ids, checked against the grant)."""

    req: str
    gen: U63
    ids: bytes
    offset: U63
    length: U63


class ReadData(_Msg, tag="read_data"):
    """Consumer -> producer data connection: send bytes [offset, offset+length) of the producer's blocks
    ``ids`` (checked against the offer); the producer answers ``DataReply`` then the bytes."""

    req: str
    gen: U63
    ids: bytes
    offset: U63
    length: U63


class DataReply(_Msg, tag="data_reply"):
    """Answer on a data connection: ``ok`` with ``length`` raw bytes following, or an error code."""

    req: str
    ok: bool
    length: U63 = 0
    code: str = ""
    message: str = ""


Message = (
    Hello
    | Challenge
    | Proof
    | Welcome
    | Admit
    | Grant
    | Busy
    | Offer
    | Fetch
    | Done
    | Released
    | Ack
    | Cancel
    | Error
    | DataHello
    | WriteData
    | ReadData
    | DataReply
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_meta_decoder = msgspec.msgpack.Decoder(Meta)  # built once: ``msgspec.convert(x, Meta)`` hashes the nested
# type on every call (~0.5 ms a push)
_EMPTY_META_SIZE = len(_encoder.encode({}))


def check_meta(meta) -> tuple[dict[str, Any], int]:
    """A caller's ``meta`` as the wire carries it, and its encoded size; ``ConfigError`` if the wire cannot
    (not JSON-like, keys not strings, nested or sized past the limits), before it reaches a peer: a consumer
    refuses such a message by ending the whole session."""
    if not meta and (meta is None or type(meta) is dict):
        return {}, _EMPTY_META_SIZE
    try:
        encoded = _encoder.encode(meta)
        checked = _meta_decoder.decode(encoded)
        size = len(encoded)
    except (msgspec.MsgspecError, TypeError, ValueError, OverflowError) as e:  # OverflowError: ints past 64 bits
        raise ConfigError(f"meta must be a JSON-like dict with string keys: {e}") from None
    if size > META_BYTES:
        raise ConfigError(f"meta takes {size} bytes encoded, more than {META_BYTES}")
    return checked, size


def check_req(req) -> str:
    """A caller's request id: a non-empty string of at most ``MAX_REQ`` characters (ints are taken as text)."""
    if isinstance(req, bool) or not isinstance(req, (str, int)):
        raise ConfigError(f"a request id must be a string, got {type(req).__name__}")
    text = str(req)
    if not 0 < len(text) <= MAX_REQ:
        raise ConfigError(f"a request id must have 1 to {MAX_REQ} characters, got {len(text)}")
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate (os.fsdecode of undecodable bytes): the wire is UTF-8
        raise ConfigError(f"a request id must be valid Unicode text, got {text!r}") from None
    return text


def encode(msg: _Msg) -> bytes:
    """One frame: length prefix and body."""
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes | bytearray, max_frame: int = MAX_FRAME) -> int:
    """The body length announced by a 4-byte header, refused if oversized or empty."""
    if len(header) != 4:
        raise ProtocolError("truncated frame header")
    (n,) = _LEN.unpack(header)
    if n == 0 or n > max_frame:
        if bytes(header) == b"HTTP":
            raise ProtocolError("the peer answered in HTTP: that address is not a kvxfer endpoint")
        raise ProtocolError(f"frame of {n} bytes refused (limit {max_frame})")
    return n


def _tag_first(body) -> bool:
    """Whether ``body`` is a map whose first key is the tag ``t``, as ``encode`` writes every message.

    Then msgspec reads the tag first and decodes every field by its type, whose nesting is bounded; a tag
    further in would make it skip untyped values to find it, recursing as deep as the peer nests them.
    """
    head = body[:1]
    if not head:
        return False
    b = head[0]
    skip = 1 if 0x80 <= b <= 0x8F else 3 if b == 0xDE else 5 if b == 0xDF else 0
    return bool(skip) and body[skip : skip + 2] == b"\xa1t"


class _MetaOf(msgspec.Struct, tag_field="t"):
    """A message's ``meta`` left encoded, every other field skipped: what a big frame is checked by first."""

    meta: msgspec.Raw = msgspec.Raw(b"\x80")


class _AdmitMeta(_MetaOf, tag="admit"):
    pass


class _OfferMeta(_MetaOf, tag="offer"):
    pass


class _DoneMeta(_MetaOf, tag="done"):
    pass


_meta_only = msgspec.msgpack.Decoder(_AdmitMeta | _OfferMeta | _DoneMeta)


def _check_meta_bytes(body) -> None:
    """A ``meta`` past ``META_BYTES`` encoded is refused before it is decoded: nested empty lists take one byte
    each on the wire and tens once decoded. Only a frame larger than that bound can hold one, so small frames
    (every latency-bound message) skip this pass."""
    try:
        meta = _meta_only.decode(body).meta
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return  # no message with a meta, or a malformed one: the full decode says which
    if len(meta) > META_BYTES:
        raise ProtocolError(f"malformed message: meta of {len(meta)} bytes, more than {META_BYTES}")


def decode(body: bytes | bytearray | memoryview) -> _Msg:
    """Decode one frame body; any defect is a ``ProtocolError``."""
    if not _tag_first(body):
        raise ProtocolError("malformed message: not a map starting with its tag 't'")
    if len(body) > META_BYTES:
        _check_meta_bytes(body)
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise ProtocolError(f"malformed message: {e}") from None


FEW_IDS = 64  # up to this many ids pack as Python ints (struct checks the range): two numpy reductions cost more


def ids_to_bytes(ids) -> bytes:
    a = np.asarray(ids)
    if a.ndim == 1 and len(a) <= FEW_IDS and a.dtype.kind in "iu":
        try:
            return struct.pack(f"<{len(a)}I", *a.tolist())
        except struct.error:
            raise BlockError("block ids must fit in uint32") from None
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise BlockError("block ids must fit in uint32")
    return a.astype("<u4", copy=False).tobytes()


def ids_from_bytes(b: bytes, limit: int | None = None) -> np.ndarray:
    if len(b) % 4:
        raise ProtocolError("block id list is not a whole number of uint32")
    if limit is not None and len(b) // 4 > limit:
        raise BlockError(f"{len(b) // 4} block ids exceed the {limit} blocks of the layout")
    return np.frombuffer(b, dtype="<u4").astype(np.int64)
